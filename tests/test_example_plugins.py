"""The example plugins as their users install them: ``examples/minimal_backend.py`` and the package
``examples/transformers_backend`` are found through their entry points, pass the conformance suites, and give the
built-in engine's rollouts in a run (virtual clock; the transformers one on Ray Serve ranks too).

Nothing is installed into the environment: the module's fixture installs both examples into a temporary folder, as
pip installs a package (the transformers example with pip itself, offline; the single-file minimal example with the
metadata pip would write for a package declaring its entry point ``minimal``), and puts that folder on ``sys.path``
and ``PYTHONPATH`` (subprocesses and Ray workers) for this module's tests only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bubblespec.core import plugins
from bubblespec.core.config import EngineSettings, validate
from bubblespec.core.errors import ConfigError
from bubblespec.core.interfaces import Engine, ForwardPass
from bubblespec.observe.run_dir import RunDirectory
from bubblespec.run.launch import run
from bubblespec.testing import EngineConformance, RealVocabularyConformance, run_settings

EXAMPLES = Path(__file__).parent.parent / "examples"
ENTRY_POINTS = {
    "minimal": "minimal_backend:MinimalEngine",
    "transformers-example": "bubblespec_transformers_example.engine:TransformersEngine",
}
MODULES = ("minimal_backend", "bubblespec_transformers_example")


@pytest.fixture(scope="module", autouse=True)
def installed_examples(tmp_path_factory):
    """A folder with both examples installed, on ``sys.path`` and ``PYTHONPATH`` while this module's tests run."""
    root = tmp_path_factory.mktemp("example-plugins")
    source, site = root / "transformers_backend", root / "site"
    # pip builds in the source folder: build a copy, so that the repository stays as it is
    shutil.copytree(EXAMPLES / "transformers_backend", source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet"]
    installed = subprocess.run([*pip, "--target", str(site), str(source)], capture_output=True, text=True)
    assert installed.returncode == 0, f"pip install examples/transformers_backend failed:\n{installed.stderr}"
    shutil.copy(EXAMPLES / "minimal_backend.py", site)
    metadata = site / "bubblespec_minimal_example-0.1.0.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: bubblespec-minimal-example\nVersion: 0.1.0\n")
    (metadata / "entry_points.txt").write_text(f"[bubblespec.backends]\nminimal = {ENTRY_POINTS['minimal']}\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(site))
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
        yield site
    for name in [m for m in sys.modules if m.split(".")[0] in MODULES]:
        del sys.modules[name]


def test_the_entry_points_are_found_in_this_process_and_by_the_cli():
    found = plugins.available("backends")
    for name, value in ENTRY_POINTS.items():
        assert found[name].value == value
        engine_class = plugins.load_subclass("backends", name, Engine)
        assert issubclass(engine_class.config_class, EngineSettings)
    listed = subprocess.run(
        [sys.executable, "-m", "bubblespec.cli.main", "plugins"], capture_output=True, text=True, check=True
    ).stdout
    for name, value in ENTRY_POINTS.items():
        assert any(line.split() == [name, value] for line in listed.splitlines()), listed


@pytest.mark.parametrize("backend", list(ENTRY_POINTS))
def test_every_setting_a_run_passes_is_taken_and_max_batch_size_caps_a_forward_pass(backend):
    """The issue: the minimal example refused ``max_batch_size``. Every common setting goes in; a batch cap of 3
    runs at most 3 sequences a pass and changes no token."""
    from bubblespec.tasks import ArithmeticTask

    engine_class = plugins.load("backends", backend)
    path = ArithmeticTask.model_path()
    requests = TestMinimalExample().make_requests()[:8]
    uncapped = engine_class.from_pretrained(**run_settings(path, "float64", {}))
    capped = engine_class.from_pretrained(**run_settings(path, "float64", {"max_batch_size": 3, "num_threads": 1}))
    passes: list[ForwardPass] = []
    expected = [r.token_ids for r in uncapped.generate(requests)]
    assert [r.token_ids for r in capped.generate(requests, on_forward=passes.append)] == expected
    assert max(p.num_sequences for p in passes) == 3


@pytest.mark.parametrize(
    ("backend", "changes", "message"),
    [
        ("minimal", {"rollout": {"verification": "one_hot"}}, r"verification: Input should be 'coupled'"),
        (
            "minimal",
            {"rollout": {"engine_options": {"device": "cuda"}}},
            r"device: Extra inputs are not permitted \(valid settings: .*max_batch_size",
        ),
        (
            "transformers-example",
            {"rollout": {"engine_options": {"device": "gpu"}}},
            r"device: Value error, 'gpu' is not a torch device",
        ),
    ],
)
def test_a_setting_the_example_cannot_follow_is_refused_by_name_before_the_run_starts(
    tmp_path, backend, changes, message
):
    config = _run_config(tmp_path, backend, "virtual", **changes)
    with pytest.raises(ConfigError, match=message):
        run(config)
    assert not config.run_dir.exists()


def test_the_transformers_example_updates_tied_embeddings_in_both_forms_trainers_send(tmp_path):
    """A Qwen2 checkpoint with tied embeddings. The built-in trainer sends ``model.embed_tokens.weight`` only, the
    transformers one ``lm_head.weight`` too (docs/plugins.md, Weight updates): either way the output head follows, as
    in the built-in engine. An unknown name is refused."""
    from safetensors.torch import load_file

    from bubblespec.testing.random_checkpoints import write_random_checkpoint

    path = write_random_checkpoint(tmp_path, "qwen2", vocab_size=64, tie_word_embeddings=True, norm_and_bias_noise=0.1)
    weights = load_file(str(path / "model.safetensors"))
    assert "lm_head.weight" not in weights
    engine, reference = [
        plugins.load("backends", name).from_pretrained(**run_settings(path, "float64", {}))
        for name in ("transformers-example", "torch")
    ]
    requests = TestMinimalExample().make_requests()[:6]

    def tokens(engine) -> list:
        return [r.token_ids for r in engine.generate(requests)]

    before = tokens(engine)
    assert before == tokens(reference)
    embeddings = weights["model.embed_tokens.weight"] * 1.5
    reference.update_weights({"model.embed_tokens.weight": embeddings}, version=1)
    expected = tokens(reference)
    assert expected != before
    for version, sent in enumerate(
        [
            {"model.embed_tokens.weight": embeddings},
            {"model.embed_tokens.weight": embeddings, "lm_head.weight": embeddings},
        ]
    ):
        engine.update_weights(weights, version=0)
        assert tokens(engine) == before
        engine.update_weights(sent, version=version + 1)
        assert tokens(engine) == expected, sorted(sent)
    with pytest.raises(ValueError, match=r"unknown weight names \['model.embed.weight'\]"):
        engine.update_weights({"model.embed.weight": embeddings}, version=3)


class TestMinimalExample(EngineConformance):
    """examples/minimal_backend.py through its entry point, with every setting a run passes."""

    backend = "minimal"
    dtype = "float64"
    num_prompts = 4
    engine_settings = {"max_draft_tokens_per_step": 8, "draft_alignment": "position"}


class TestTransformersExample(EngineConformance):
    """examples/transformers_backend: transformers' float32 rotary tables and norms put its float64 logits ~1e-6 from
    the reference's, within the suite's float64 logprob tolerance; no token may differ."""

    backend = "transformers-example"
    dtype = "float64"
    num_prompts = 4
    engine_settings = {"max_draft_tokens_per_step": 8, "max_batch_size": 5}


class TestTransformersExampleAtARealVocabulary(RealVocabularyConformance):
    """A Llama checkpoint written by transformers with 32,000 tokens, float32, against the torch engine."""

    backend = "transformers-example"
    family = "llama"
    dtype = "float32"


# -- runs --------------------------------------------------------------------------------------------------------------


def _run_config(tmp_path: Path, backend: str, clock: str, rollout: dict | None = None, **changes):
    """2 float64 steps of 4 prompts x 2 samples on 2 ranks, at most 3 sequences a forward pass."""
    data = {
        "name": f"{backend}-{clock}",
        "output_dir": str(tmp_path),
        "num_steps": 2,
        "model": {"dtype": "float64"},
        "task": {"prompts_per_step": 4, "samples_per_prompt": 2},
        "rollout": {"backend": backend, "num_ranks": 2, "max_batch_size": 3, "sampling": {"max_new_tokens": 32}},
        "trainer": {"optimizer": {"learning_rate": 1e-3}},
        "clock": {"kind": clock} | ({"profile": "h100-7b"} if clock == "virtual" else {}),
        "metrics": {"enabled": False},
    } | changes
    data["rollout"] |= rollout or {}
    return validate(data)


def _steps(config) -> list:
    run(config)
    return RunDirectory(config.run_dir).read_steps()


@pytest.fixture(scope="module")
def torch_run_steps(tmp_path_factory) -> Callable[[str], list]:
    """The steps of the built-in engine's virtual run with a given ``rollout.verification``, each run made once."""
    cache: dict[str, list] = {}

    def steps(verification: str) -> list:
        if verification not in cache:
            folder = tmp_path_factory.mktemp(f"torch-{verification}")
            cache[verification] = _steps(_run_config(folder, "torch", "virtual", {"verification": verification}))
        return cache[verification]

    return steps


@pytest.mark.parametrize(
    ("backend", "verification"),
    [("minimal", "coupled"), ("transformers-example", "coupled"), ("transformers-example", "one_hot")],
)
def test_a_run_on_the_example_gives_the_built_in_engines_rollouts(tmp_path, torch_run_steps, backend, verification):
    """float64 keyed sampling: the example's rollouts, and so its rewards, are the built-in engine's; the bubble's
    drafts were verified in the run (draft tokens accepted)."""
    steps = _steps(_run_config(tmp_path, backend, "virtual", {"verification": verification}))
    expected = torch_run_steps(verification)
    assert [s.rollout_digest for s in steps] == [s.rollout_digest for s in expected]
    assert [s.reward_mean for s in steps] == [s.reward_mean for s in expected]
    assert sum(rank.draft_tokens_accepted for s in steps for rank in s.ranks) > 0


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("backend", list(ENTRY_POINTS))
def test_the_example_on_ray_serve_ranks_gives_the_built_in_engines_rollouts(tmp_path, torch_run_steps, backend):
    """Two Ray Serve ranks load the plugin from the installed package (PYTHONPATH reaches Ray's workers) and give
    exactly the rollouts of the built-in engine's virtual run (about 45 s on 2 cores, Ray's start included)."""
    wall = _steps(_run_config(tmp_path, backend, "wall"))
    expected = torch_run_steps("coupled")
    assert [s.rollout_digest for s in wall] == [s.rollout_digest for s in expected]
    assert [s.reward_mean for s in wall] == [s.reward_mean for s in expected]
    assert all(rank.generation_seconds > 0 for step in wall for rank in step.ranks)
