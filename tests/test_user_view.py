"""What a user sees of their task and their run: validate's task summary, samples.jsonl, rewards that fail loudly,
the GSM8K example, paths relative to the config file, "did you mean", and what speculation saved or cost
(bubblespec.rollout.speculation_effect, checked against a run with speculation off)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from bubblespec.cli.main import app
from bubblespec.core.config import load_config
from bubblespec.core.interfaces import Draft, ForwardPass, GenerationRequest, Prompt, RolloutKey, SamplingParams
from bubblespec.observe.run_dir import RunDirectory
from bubblespec.observe.task_summary import summarize_task
from bubblespec.rl.loop import step_line
from bubblespec.rollout.speculation_effect import PassCostFit, fit_pass_cost, plain_decode_passes, seconds_saved
from bubblespec.run.launch import run
from bubblespec.tasks.arithmetic import ArithmeticTask
from bubblespec.testing.random_checkpoints import write_chat_model
from tests.step_records import step_record

EXAMPLES = Path(__file__).parent.parent / "examples"
SHIPPED_MODEL = ArithmeticTask.model_path()


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The model the GSM8K example's comment tells users to make."""
    return str(write_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat"))


def _gsm8k_config(tmp_path: Path, chat_model: str, *overrides: str) -> Path:
    """examples/gsm8k.yaml copied next to a model folder where its relative model.path points, with its data."""
    folder = tmp_path / "examples"
    (folder / "data").mkdir(parents=True)
    for name in ("gsm8k-train.jsonl", "gsm8k-test.jsonl"):
        (folder / "data" / name).write_text((EXAMPLES / "data" / name).read_text())
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "tiny-chat").symlink_to(chat_model)
    config = folder / "gsm8k.yaml"
    config.write_text((EXAMPLES / "gsm8k.yaml").read_text())
    return config


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_validate_shows_the_gsm8k_example_s_rendered_prompt_answer_and_lengths(chat_model, tmp_path, monkeypatch):
    config = _gsm8k_config(tmp_path, chat_model)
    monkeypatch.chdir(tmp_path.parent)  # relative paths resolve from the config file, not from here
    result = _invoke("validate", str(config))
    assert result.exit_code == 0, result.output
    first = json.loads((EXAMPLES / "data" / "gsm8k-train.jsonl").read_text().split("\n")[0])
    assert "train rows: 48" in result.output and "held-out rows: 16" in result.output
    assert "<|im_start|>system\n    Solve the problem step by step." in result.output
    assert first["question"].split("\n")[0] in result.output
    gold = first["answer"].rsplit("####", 1)[1].strip()
    assert f"its reference answer, as rewards get it: {gold!r}" in result.output
    assert "prompt tokens: min " in result.output and "rewards: math (weight 1), format (weight 0.1)" in result.output
    assert "unknown tokens: 0.0%" in result.output and "warning" not in result.output


def test_validate_warns_when_the_model_s_vocabulary_does_not_cover_the_text(tmp_path, monkeypatch):
    """The shipped 19-token arithmetic model on GSM8K's text: the prompts are mostly the unknown token."""
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({
        "model": {"path": str(SHIPPED_MODEL)}, "eval_every": 0,
        "task": {"name": "dataset", "prompts_per_step": 4, "options": {
            "path": str(EXAMPLES / "data" / "gsm8k-train.jsonl"), "prompt_column": "question",
            "answer_pattern": "####\\s*(.+)", "reward": "math"}},
    }))  # fmt: skip
    result = _invoke("validate", str(config))
    assert result.exit_code == 0, result.output
    assert "warning: " in result.output and "of the train prompts' tokens are the tokenizer's unknown token" in (
        result.output
    )


def test_validate_s_90th_percentile_of_prompt_lengths_is_never_above_the_longest():
    """Three prompts of 5, 5 and 100 tokens: statistics.quantiles' default ('exclusive') put the 90th percentile at
    157 tokens, above the longest prompt."""
    prompts = [Prompt(f"p{i}", (0,) * length, "x", "") for i, length in enumerate([5, 5, 100])]
    task = SimpleNamespace(
        prompts=prompts, num_dropped_prompts=0, reward_names=list, unknown_token_share=None, own_system_prompts=0
    )
    (line,) = [line for line in summarize_task(task).lines if line.startswith("prompt tokens")]
    assert line == "prompt tokens: min 5, median 5, 90th percentile 81, max 100"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"task": {"options": {"patth": "x"}}},
            "patth: Extra inputs are not permitted (got 'x') (did you mean 'path'?)",
        ),
        ({"task": {"options": {"reward": {"name": "format", "patern": "x"}}}}, "did you mean 'pattern'?"),
        ({"task": {"options": {"answer_pattern": "(#"}}}, "answer_pattern"),
        ({"task": {"options": {"answer_pattern": "@@(.*)"}}}, "does not match row train-0's 'answer'"),
        ({"rollout": {"max_batch_sise": 4}}, "did you mean 'max_batch_size'?"),
        ({"trainer": {"loss": {"policy": {"clip_epsilonn": 0.1}}}}, "did you mean 'clip_epsilon'?"),
    ],
)
def test_bad_input_is_one_message_with_the_closest_name(chat_model, tmp_path, change, message):
    config = _gsm8k_config(tmp_path, chat_model)
    data = load_config(config).model_dump(mode="json")
    for section, values in change.items():
        if section == "task":
            data["task"]["options"] |= values["options"]
        else:
            data[section] = _merged(data[section], values)
    config.write_text(json.dumps(data))
    result = _invoke("validate", str(config))
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def _merged(base: dict, change: dict) -> dict:
    return base | {k: _merged(base.get(k, {}), v) if isinstance(v, dict) else v for k, v in change.items()}


def test_paths_resolve_from_the_config_file_and_set_paths_from_here(chat_model, tmp_path, monkeypatch):
    config = _gsm8k_config(tmp_path, chat_model)
    monkeypatch.chdir(tmp_path)
    loaded = load_config(config)
    assert loaded.model.path == str(tmp_path / "checkpoints" / "tiny-chat")
    assert loaded.task.options["path"] == str(tmp_path / "examples" / "data" / "gsm8k-train.jsonl")
    assert load_config(config, ["model.path=elsewhere"]).model.path == "elsewhere"
    assert loaded.output_dir == "runs"  # where runs are written stays relative to the current directory


@pytest.mark.slow
def test_the_gsm8k_example_runs_and_logs_samples_with_each_reward_and_advantage(chat_model, tmp_path):
    config = _gsm8k_config(tmp_path, chat_model)
    overrides = [f"output_dir={tmp_path / 'runs'}", "clock.kind=virtual", "num_steps=2", "eval_every=0",
                 "task.options.max_new_tokens=16", "task.options.reward_workers=1", "metrics.enabled=false",
                 "task.prompts_per_step=4", "task.samples_per_prompt=2", "logged_prompts=2"]  # fmt: skip
    loaded = load_config(config, overrides)
    run(loaded)
    folder = RunDirectory(loaded.run_dir)
    steps, samples = folder.read_steps(), folder.read_samples()
    assert [s.step for s in samples] == [0, 0, 1, 1]
    first = samples[0]
    assert first.prompt.startswith("<|im_start|>system\nSolve the problem step by step.")
    assert first.answer.isdigit() and len(first.responses) == 2
    for response in first.responses:
        assert set(response.rewards) == {"math", "format"}
        assert response.reward == pytest.approx(response.rewards["math"] + 0.1 * response.rewards["format"])
    assert set(steps[0].reward_means) == {"math", "format"} and steps[0].reward_calls > 0
    result = _invoke("report", str(loaded.run_dir))
    assert result.exit_code == 0, result.output
    summary = (loaded.run_dir / "report" / "summary.md").read_text()
    assert "## Samples" in summary and "reward math (mean, unweighted)" in summary


@pytest.mark.slow
def test_a_run_whose_reward_fails_on_every_call_stops_with_one_clear_error(tmp_path):
    """A reward that raises on every call: the first step stops the run (exit code 2, the reward's own error), and
    nothing of that step is recorded."""
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({
        "name": "failing", "output_dir": str(tmp_path), "num_steps": 2, "eval_every": 0,
        "clock": {"kind": "virtual"}, "metrics": {"enabled": False}, "model": {"path": str(SHIPPED_MODEL)},
        "task": {"name": "dataset", "prompts_per_step": 4, "samples_per_prompt": 2, "options": {
            "path": str(EXAMPLES / "data" / "arithmetic-train.jsonl"), "max_new_tokens": 8, "reward_workers": 1,
            "reward": "tests.reward_functions:always_raises"}},
    }))  # fmt: skip
    result = _invoke("run", str(config), "--quiet")
    assert result.exit_code == 2, result.output
    assert "reward 'tests.reward_functions:always_raises' failed (timed out or raised) on 8 of its 8 calls" in (
        result.output
    )
    assert "Traceback" not in result.output
    assert RunDirectory(tmp_path / "failing").read_steps() == []  # the failed step is not recorded as trained


def test_the_step_line_says_how_far_the_run_is_what_speculation_saved_and_why_nothing_trained():
    record = step_record(
        3, generated_tokens=1000, decode_steps=250, rollout_seconds_saved=-0.25, reward_timeouts=1, reward_errors=2,
        reward_calls=64, reward_means={"math": 0.5, "format": 0.25}, train={"skipped": 1},
    )  # fmt: skip
    line = step_line(record, num_steps=80, seconds_left=135)
    for field in ("step=3 ", "done=4/80", "left=2m15s", "reward.math=0.5000", "reward.format=0.2500",
                  "reward_failed=3/64", "steps_saved=75.0%", "rollout_saved_s=-0.250", "barrier_wait_s=0.000",
                  "trained=no:equal_rewards_in_every_group"):  # fmt: skip
        assert field in line, (field, line)


def test_the_verdict_splits_what_speculation_did_and_names_the_cause_that_dominated():
    """The summary adds up each step's wait for drafting passes in flight; the verdict splits the estimate into
    decode passes saved net of verification and that wait, and names the larger cost with what addresses it."""
    from bubblespec.core.config import validate
    from bubblespec.observe.summary import speculation_verdict, summarize

    config = validate({"speculation": {"enabled": True}})
    steps = [
        step_record(0, generated_tokens=100, decode_steps=100, rollout_seconds_saved=-0.03, barrier_wait_seconds=0.02),
        step_record(1, generated_tokens=100, decode_steps=90, rollout_seconds_saved=-0.01, barrier_wait_seconds=0.01),
    ]
    summary = summarize(config, steps, wall_seconds=1.0)
    assert summary["barrier_wait_seconds"] == pytest.approx(0.03)
    waited = speculation_verdict(summary | {"rollout_seconds": 0.5})
    assert "the drafts saved -0.01 s of decode passes net of verifying them, and the steps waited 0.03 s" in waited
    assert "Waiting for drafting dominated" in waited and "speculation.enabled: auto pauses drafting" in waited
    verified = speculation_verdict(summary | {"rollout_seconds": 0.5, "barrier_wait_seconds": 0.0})
    assert "Verifying the drafts dominated" in verified and "rollout.max_draft_tokens_per_step" in verified
    short = speculation_verdict(
        summary | {"rollout_seconds": 0.5, "barrier_wait_seconds": 0.0, "decode_steps_saved": 0.01}
    )
    assert "The bubbles were too short to draft much (1.0% fewer decode steps" in short and "auto pauses" in short
    paid = speculation_verdict(summary | {"rollout_seconds": 0.5, "rollout_seconds_saved": 0.2})
    assert (
        paid.startswith("speculation saved 0.20 wall-clock seconds")
        and "waited 0.03 s for drafting passes in flight" in paid
    )
    assert "beside the trainer" not in paid  # no rank drafted while the trainer trained


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({}, True),  # the wall clock on one machine: the ranks draft on the trainer's CPU cores
        ({"rollout": {"gpus_per_rank": 1}}, False),
        ({"clock": {"kind": "virtual"}}, False),
        ({"speculation": {"enabled": True, "draft_during_training": False}}, False),
    ],
)
def test_the_verdict_names_drafting_beside_the_trainer_on_its_cores(settings, said):
    """The fourth part of what speculation did: drafting while the trainer trains, on hardware it uses, which the
    run's estimate cannot see; the summary says for how long and where it is measured."""
    from bubblespec.core.config import validate
    from bubblespec.observe.records import PhaseSeconds
    from bubblespec.observe.summary import summarize

    config = validate({"speculation": {"enabled": True, "draft_during_training": 1}} | settings)
    steps = [
        step_record(
            step,
            generated_tokens=100,
            decode_steps=50,
            rollout_seconds_saved=0.1,
            phase_seconds=PhaseSeconds(rollout=1.0, train=2.0, weight_sync=0.0),
            training_timelines=[[("draft", 0.0, 2.0)], []] if step < 2 else None,
        )  # fmt: skip
        for step in range(3)
    ]
    summary = summarize(config, steps, wall_seconds=9.0)
    assert summary["train_seconds"] == 6.0 and summary["drafting_beside_training_seconds"] == 4.0
    verdict = summary["speculation_effect"]
    assert ("ranks drafted beside the trainer, on CPU cores it uses, for 4.00 s of its 6.00 s" in verdict) is said
    assert ("train + sync with speculation off against on" in verdict) is said


@pytest.mark.parametrize("model", ["shipped", "qwen2-32k-bfloat16"])
def test_plain_decoding_replay_is_the_torch_engine_s_schedule_without_drafts(model, tmp_path):
    """Token for token the same forward passes the built-in engine runs without drafts, with a batch limit that
    makes requests wait for a slot: its padded batches (prompts of several lengths join) too. On the shipped model
    and on a random Qwen2 of vocabulary 32,000 in bfloat16 (the sampled logits count the vocabulary)."""
    from backends.torch_engine import TorchEngine
    from tests.conftest import write_checkpoint

    task = ArithmeticTask(seed=0, prompts_per_step=12)
    if model == "shipped":
        engine = TorchEngine.from_pretrained(str(SHIPPED_MODEL), max_batch_size=5)
    else:
        folder = write_checkpoint(tmp_path / model, "qwen2", vocab_size=32_000, seed=3)
        engine = TorchEngine.from_pretrained(str(folder), max_batch_size=5, dtype="bfloat16")
    requests = [GenerationRequest(tuple(p.token_ids), RolloutKey(0, 0, p.uid, 0),
                                  SamplingParams(max_new_tokens=12 + 7 * i % 29))  # a random model never stops
                for i, p in enumerate(task.batch(0))]  # fmt: skip
    passes: list[ForwardPass] = []
    results = engine.generate(requests, on_forward=passes.append)
    lengths = [len(r.prompt_token_ids) for r in requests], [len(r.token_ids) for r in results]
    assert len(set(lengths[0])) > 1 and len(set(lengths[1])) > 1, "prompts and responses of several lengths"
    assert any(f.padded_tokens > f.num_tokens for f in passes) and passes[-1].sampled_logits % engine.vocab_size == 0
    assert list(plain_decode_passes(*lengths, 5, engine.vocab_size, padded=True)) == passes
    unpadded = plain_decode_passes(*lengths, 5, engine.vocab_size)  # an engine that does not pad
    assert list(unpadded) == [replace(f, padded_tokens=0, padded_attention_pairs=0) for f in passes]


def test_a_shard_s_saving_is_exact_when_its_passes_cost_what_a_padded_batch_computes():
    """The wall clock's estimate, with pass times that a padded CPU engine's cost gives (a constant, and every padded
    position and attention pair): fitted on drafted passes alone, it prices the replayed plain passes exactly (fitted
    to the sequence count and the context read instead, it was 2.8% low here)."""
    from backends.torch_engine import TorchEngine

    task = ArithmeticTask(seed=0, prompts_per_step=12)
    requests = [GenerationRequest(tuple(p.token_ids), RolloutKey(0, 0, p.uid, 0), SamplingParams(max_new_tokens=40))
                for p in task.batch(0)]  # fmt: skip
    plain, drafted = [], []
    plain_engine = TorchEngine.from_pretrained(str(SHIPPED_MODEL), max_batch_size=5)
    results = plain_engine.generate(requests, on_forward=plain.append)
    with_drafts = [replace(r, draft=Draft(r.key, tuple(result.token_ids[: i % 4 * 4]), 0))
                   for i, (r, result) in enumerate(zip(requests, results, strict=True))]  # fmt: skip
    engine = TorchEngine.from_pretrained(str(SHIPPED_MODEL), max_batch_size=5, max_draft_tokens_per_step=6)
    outputs = engine.generate(with_drafts, on_forward=drafted.append)
    assert [r.token_ids for r in outputs] == [r.token_ids for r in results]

    def seconds(forward: ForwardPass) -> float:
        return 2e-3 + 3e-5 * forward.padded_tokens + 2e-8 * forward.padded_attention_pairs

    assert drafted != plain and any(f.padded_tokens > f.num_tokens for f in drafted)
    truth = sum(seconds(f) for f in plain)
    timed = [(f, seconds(f)) for f in drafted]
    ran = sum(s for _, s in timed)
    saved = seconds_saved(with_drafts, results, ran, 5, engine.vocab_size, fit_pass_cost(timed), padded=True)
    assert ran + saved == pytest.approx(truth, rel=1e-6)


def test_a_call_with_few_passes_is_fitted_with_its_rank_s_latest_earlier_passes():
    passes = [ForwardPass(n, n, 50 * n, 50 * n, sampled_logits=n * 100) for n in (1, 2, 4, 8, 16, 32)]
    truth = [(f, 1e-3 + 2e-5 * f.num_tokens) for f in passes]
    fit = PassCostFit(min_passes=4)
    fit(truth[:5])
    alone, topped_up = fit_pass_cost(truth[5:]), fit(truth[5:])  # one pass: it alone shows no slope
    assert alone(passes[0]) != pytest.approx(truth[0][1], rel=0.5)
    assert topped_up(passes[0]) == pytest.approx(truth[0][1], rel=1e-6)
    assert fit._earlier == truth[2:]  # the latest min_passes, for the next call


def test_the_pass_cost_fit_recovers_a_linear_cost_and_drops_negative_terms():
    passes = [
        ForwardPass(n, n * t, 50 * n + 7 * t, 50 * n * t + 3 * t * t, sampled_logits=n * t * 100,
                    padded_tokens=n * (t + pad), padded_attention_pairs=n * (t + pad) * (57 + pad))
        for n in (1, 4, 16) for t in (1, 5) for pad in (0, 3)
    ]  # fmt: skip
    truth = [(f, 1e-3 + 2e-5 * f.num_tokens + 1e-7 * f.computed_attention_pairs) for f in passes]
    cost = fit_pass_cost(truth)
    for forward, seconds in truth:
        assert cost(forward) == pytest.approx(seconds, rel=1e-6)
    # the sequence count is not a feature: what a drafted pass spends per sequence does not reach plain passes
    one, eight = ForwardPass(1, 8, 400, 400, sampled_logits=800), ForwardPass(8, 8, 400, 400, sampled_logits=800)
    assert cost(one) == cost(eight)
    falling = [(f, 1e-2 - 1e-9 * f.sampled_logits) for f in passes]  # a negative weight is left out, not fitted
    assert all(cost >= 0 for cost in (fit_pass_cost(falling)(f) for f in passes))


@pytest.mark.slow
def test_the_estimated_rollout_without_drafts_is_the_rollout_of_a_run_without_them(tmp_path):
    """Virtual clock: the speculation-on run's estimate of each step's rollout without drafts equals, within 1%,
    the rollout the same run with speculation off measured (the same responses: verification is exact)."""
    records = {}
    for enabled in (True, False):
        config = load_config(EXAMPLES / "arithmetic.yaml", [
            f"name=on-{enabled}", f"output_dir={tmp_path}", "clock.kind=virtual", "num_steps=3", "eval_every=0",
            "metrics.enabled=false", f"speculation.enabled={str(enabled).lower()}", "rollout.max_batch_size=16",
            "speculation.draft_during_training=true",
        ])  # fmt: skip
        run(config)
        records[enabled] = RunDirectory(config.run_dir).read_steps()
    for drafted, plain in zip(records[True], records[False], strict=True):
        assert drafted.rollout_digest == plain.rollout_digest
        assert plain.rollout_seconds_saved == pytest.approx(0.0, abs=1e-9)
        assert drafted.rollout_seconds_without_drafts == pytest.approx(plain.phase_seconds.rollout, rel=0.01)
    assert any(r.draft_tokens_accepted for r in records[True])


def test_math_verify_s_timeout_warning_is_silenced(caplog):
    from bubblespec.tasks.rewards import math_answer

    with caplog.at_level(logging.WARNING):
        assert math_answer("p", "so \\boxed{4}", answer="4") == 1.0
    assert not [r for r in caplog.records if "Timeout is disabled" in r.getMessage()]
