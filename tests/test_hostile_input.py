"""Hostile input, property-based (hypothesis): configs, command-line overrides and drafts.

Every invalid input must end in a clear error (a BubblespecError, or exit code 2 with one ``error:`` line on
the command line), never a traceback; drafts, whatever they hold, can never change an output.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from bubblespec.cli.main import app
from bubblespec.core.config import RunConfig, apply_overrides, validate
from bubblespec.core.errors import BubblespecError, DraftError
from bubblespec.core.interfaces import Draft, GenerationRequest, RolloutKey, SamplingParams

SECTIONS = ["task", "model", "rollout", "speculation", "trainer", "clock", "ray", "metrics"]
FIELDS = {name: list(type(getattr(RunConfig(), name)).model_fields) for name in SECTIONS}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def config_dicts(draw) -> dict:
    """Mostly real section and field names (so validation gets deep), with arbitrary values and some junk keys."""
    data = {}
    for _ in range(draw(st.integers(0, 4))):
        section = draw(st.sampled_from(SECTIONS + ["num_steps", "name", "seed", "eval_every", "nonsense"]))
        if section in FIELDS and draw(st.booleans()):
            field = draw(st.sampled_from(FIELDS[section] + ["typo_field"]))
            data.setdefault(section, {})
            if isinstance(data[section], dict):
                data[section][field] = draw(values)
        else:
            data[section] = draw(values)
    return data


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config_dicts())
def test_any_config_validates_or_fails_with_a_clear_error(data):
    try:
        config = validate(data)
    except BubblespecError as error:
        assert str(error).strip(), "an empty error message"
    else:
        assert isinstance(config, RunConfig)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=30), max_size=4))
def test_any_override_applies_or_fails_with_a_clear_error(overrides):
    try:
        validate(apply_overrides({}, overrides))
    except BubblespecError as error:
        assert str(error).strip()


runner = CliRunner()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(override=st.text(min_size=1, max_size=30).filter(lambda s: "\n" not in s))
def test_the_command_line_never_shows_a_traceback(tmp_path, override):
    """`bubblespec validate` with a hostile --set: exit 0 (the override was valid) or 2 with one error line."""
    config = tmp_path / "config.yaml"
    config.write_text("name: hostile\n")
    result = runner.invoke(app, ["validate", str(config), "--set", override])
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        assert "error" in result.output.lower()
    assert result.exception is None or isinstance(result.exception, SystemExit)


class _Reached(Exception):
    """Raised by the stand-ins of the long-running functions: the input got past every check."""


def _reached(*args, **kwargs):
    raise _Reached


FILE_TEXTS = st.one_of(
    st.text(max_size=60),
    st.sampled_from(
        [
            "name: hostile\nnum_steps: 1\nclock: {kind: virtual}\n",
            "num_steps: -1\n",
            "{",
            "- a\n- b\n",
            "rollout: {num_ranks: 0}\n",
            "speculation: {draft_sources: [bubble, bubble]}\n",
            "task: {name: nowhere}\n",
            "!!python/object:os.system ls\n",
        ]
    ),
)
STEP_LINES = st.one_of(st.text(max_size=40), st.just('{"step": 0}\n'), st.just('{"step": 0, "ranks": 7}\n'))
COMMANDS = ["run", "validate", "report", "bench", "plugins"]
WORDS = [
    "engine", "peers", "CONFIG", "CONFIG", "RUN_DIR", "MISSING", "--set", "--resume", "--quiet", "-v", "--json",
    "--sources", "--plot-dir", "--output-dir", "--threads", "--repeats", "--quick", "--help", "num_steps=2",
    "rollout.num_ranks=x", "speculation.draft_sources=[ngram]", "bubble+x", "bubble+group", "0", "-1",
]  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    command=st.sampled_from(COMMANDS),
    words=st.lists(st.one_of(st.sampled_from(WORDS), st.sampled_from(WORDS), st.text(max_size=12)), max_size=5),
    config_text=FILE_TEXTS,
    saved_config=FILE_TEXTS,
    steps=STEP_LINES,
)
def test_no_command_shows_a_traceback_whatever_its_arguments(
    tmp_path, monkeypatch, command, words, config_text, saved_config, steps
):
    """Any argument list for any command, with hostile config files and run directories: it reaches the work
    (stood in for here: runs and benchmarks are long), prints help, or exits 2 with one error line."""
    import bubblespec.cli.bench_engine
    import bubblespec.cli.bench_peers
    import bubblespec.cli.bench_run
    import bubblespec.run.launch

    monkeypatch.setattr(bubblespec.run.launch, "run", _reached)
    monkeypatch.setattr(bubblespec.cli.bench_run, "run_side_by_side", _reached)
    monkeypatch.setattr(bubblespec.cli.bench_peers, "run_peers", _reached)
    monkeypatch.setattr(bubblespec.cli.bench_engine, "run_engine_bench", _reached)
    config = tmp_path / "config.yaml"
    config.write_text(config_text)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "config.yaml").write_text(saved_config)
    (run_dir / "steps.jsonl").write_text(steps)
    paths = {"CONFIG": str(config), "RUN_DIR": str(run_dir), "MISSING": str(tmp_path / "missing.yaml")}
    result = runner.invoke(app, [command, *(paths.get(word, word) for word in words)])
    if isinstance(result.exception, _Reached):
        return
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (0, 2), result.output
    if result.exit_code == 2:
        assert "error" in result.output.lower() or "usage" in result.output.lower()


@pytest.fixture(scope="module")
def engine():
    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.tasks import ArithmeticTask

    return TorchEngine.from_pretrained(str(ArithmeticTask.model_path()), dtype="float64", max_draft_tokens_per_step=8)


@pytest.fixture(scope="module")
def reference(engine):
    from bubblespec.tasks import ArithmeticTask

    prompt = ArithmeticTask(seed=3, prompts_per_step=1).batch(0)[0]
    request = GenerationRequest(
        prompt.token_ids, RolloutKey(0, 0, prompt.uid, 0), SamplingParams(temperature=1.0, max_new_tokens=40)
    )
    return request, engine.generate([request])[0]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.lists(st.integers(-5, 30), max_size=60))
def test_no_draft_changes_an_output_and_a_bad_one_is_refused(engine, reference, tokens):
    request, expected = reference
    drafted = GenerationRequest(
        request.prompt_token_ids, request.key, request.sampling, Draft(request.key, tuple(tokens), 0)
    )
    if any(not 0 <= t < engine.vocab_size for t in tokens):
        with pytest.raises(DraftError, match="token ids must be integers in"):
            engine.generate([drafted])
        return
    assert engine.generate([drafted])[0].token_ids == expected.token_ids


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefix=st.integers(0, 40), noise=st.lists(st.integers(3, 18), max_size=20))
def test_a_true_prefix_followed_by_anything_changes_nothing(engine, reference, prefix, noise):
    """The realistic hostile draft: right for a while (an older policy), then wrong."""
    request, expected = reference
    tokens = tuple(expected.token_ids[:prefix]) + tuple(noise)
    drafted = GenerationRequest(request.prompt_token_ids, request.key, request.sampling, Draft(request.key, tokens, 0))
    assert engine.generate([drafted])[0].token_ids == expected.token_ids


NOT_CONFIG_KEYS = {"trainer.pt", "trainer.use_v"}
"""Dotted names in error messages that start like a config section and are not keys: a checkpoint file, and verl's
``trainer.use_v1``."""


def _config_keys(model: type = RunConfig, prefix: str = "") -> set[str]:
    """Every dotted key of ``model``; a mapping field (task.options, rollout.engine_options, ...) as ``key.*``."""
    import typing

    from pydantic import BaseModel

    keys = set()
    for name, field in model.model_fields.items():
        keys.add(prefix + name)
        for kind in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                keys |= _config_keys(kind, f"{prefix}{name}.")
            elif kind is dict or typing.get_origin(kind) is dict:
                keys.add(f"{prefix}{name}.*")
    return keys


def test_every_config_key_an_error_message_names_exists():
    """The hints users follow name real keys: each ``section.field`` in the text of a ``raise`` in the package
    (where a hint once said ``run.name``, a key that never existed)."""
    import ast
    import re
    from pathlib import Path

    keys = _config_keys()
    # every section, and "run": the RunConfig's own keys are top-level (name, not run.name)
    sections = sorted([key for key in keys if "." not in key] + ["run"], key=len, reverse=True)
    named = re.compile(rf"(?<![\w./-])(?:{'|'.join(sections)})(?:\.[a-z_]+)+")

    def exists(key: str) -> bool:
        parts = key.split(".")
        return key in keys or any(".".join(parts[:i]) + ".*" in keys for i in range(1, len(parts)))

    root = Path(__file__).parent.parent
    wrong, seen = [], 0
    for folder in ("bubblespec", "cli", "backends", "policies"):
        for file in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(file.read_text())):
                if not isinstance(node, ast.Raise):
                    continue
                texts = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                for key in (m.group().rstrip(".") for text in texts for m in named.finditer(text)):
                    seen += 1
                    if not exists(key) and key not in NOT_CONFIG_KEYS:
                        wrong.append(f"{file.relative_to(root)}:{node.lineno}: {key}")
    assert seen > 50  # the scan finds the messages' keys at all
    assert not wrong, wrong
