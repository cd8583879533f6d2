"""Rollout schedules (bubblespec/rl/rollout_schedules.py): the timeline, what each kind generates and trains on, and
whole runs of every kind against the synchronous loop, through ``bubblespec bench peers-async``."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from bubblespec.cli import bench_schedules
from bubblespec.cli.main import app
from bubblespec.core.errors import ConfigError
from bubblespec.core.interfaces import GenerationResult, Prompt, RequestStats, SamplingParams
from bubblespec.observe.run_dir import RunDirectory
from bubblespec.rl.rollout_schedules import CutRolloutSchedule, StepClock, build_rollout_schedule
from bubblespec.run.launch import run
from bubblespec.tasks.arithmetic import ArithmeticTask
from tests.test_rl_loop import SMALL, _config


def test_without_staleness_the_timeline_is_the_sum_of_the_phases():
    timeline = StepClock(max_staleness=0, start=1.0)
    ends = []
    for step, (rollout, train, sync) in enumerate([(2.0, 1.0, 0.5), (0.5, 1.0, 0.5), (3.0, 0.25, 0.5)]):
        assert timeline.rollout_version(step) == step
        ends.append(timeline.finish(step, rollout, train, sync))
    assert ends == [4.5, 6.5, 10.25]


def test_one_step_off_generates_with_the_previous_policy_while_the_trainer_trains():
    timeline = StepClock(max_staleness=1)
    assert timeline.rollout_version(0) == 0
    assert timeline.finish(0, 1.0, 2.0, 0.5) == 3.5  # nothing to overlap with yet
    assert timeline.rollout_version(1) == 0  # starts at 1.0, while step 0 trains: policy 0
    assert timeline.finish(1, 1.0, 2.0, 0.5) == 6.0  # trains from 3.5: generation (1.0-2.0) hid under training
    assert timeline.rollout_version(2) == 1  # policy 1 (there at 3.5) is needed: generation waits for it
    assert timeline.finish(2, 1.0, 2.0, 0.5) == 8.5  # 3.5 + 1.0 generating, but training waits for 6.0
    assert timeline.rollout_version(3) == 2


def test_with_more_staleness_allowed_fast_generation_runs_further_ahead():
    timeline = StepClock(max_staleness=2)
    versions = []
    for step in range(4):
        versions.append(timeline.rollout_version(step))
        timeline.finish(step, 0.5, 2.0, 0.5)
    assert versions == [0, 0, 0, 1]  # two steps generated with policy 0 before the first update arrives


class _Task:
    """Prompts a-b of each step: what CutRolloutSchedule asks of a task."""

    def batch(self, step: int) -> list[Prompt]:
        return [Prompt(f"p{step}-{i}", (1, 2, 3 + i), f"prompt {i}", "0") for i in range(2)]


def _schedule(
    kind: str, cut_tokens: int = 3, speculation: bool = True, num_steps: int = 5, context_length: int | None = None
) -> CutRolloutSchedule:
    config = _config(
        "/tmp", "unit", num_steps=num_steps, task={"prompts_per_step": 2, "samples_per_prompt": 2},
        schedule={"kind": kind, "cut_tokens": cut_tokens}, speculation={"enabled": speculation},
    )  # fmt: skip
    return build_rollout_schedule(config, _Task(), 7, SamplingParams(max_new_tokens=8), context_length=context_length)


def _respond(step_rollout, lengths: dict[str, int], context_length: int = 10**6) -> list[GenerationResult]:
    """Responses to the step rollout's requests as an engine of ``context_length`` gives them: ``lengths[prompt uid]``
    tokens (at most the request's limit and the room its prompt leaves, then finished "length"), token i = i."""
    results = []
    for request in step_rollout.requests:
        wanted = lengths[request.key.prompt_uid.removesuffix("/continued")]
        limit = min(request.sampling.max_new_tokens, context_length - len(request.prompt_token_ids))
        n = min(wanted, limit)
        reason = "length" if n == limit else "stop"
        results.append(GenerationResult(request.key, list(range(n)), [-0.5] * n, reason, RequestStats()))
    return results


def test_partial_rollouts_continue_a_cut_response_from_its_prefix_under_the_next_policy():
    schedule = _schedule("partial")
    work = schedule.rollout(0)
    assert {r.sampling.max_new_tokens for r in work.requests} == {3}  # the step's budget
    trained = schedule.collect(0, work, _respond(work, {"p0-0": 2, "p0-1": 6}))
    assert [g.prompt.uid for g in trained] == ["p0-0"] and schedule.carried() == 1
    work = schedule.rollout(1)
    continued = [r for r in work.requests if r.key.prompt_uid.endswith("/continued")]
    assert [r.prompt_token_ids for r in continued] == [(1, 2, 4, 0, 1, 2)] * 2  # prompt + the older prefix
    assert {r.sampling.max_new_tokens for r in continued} == {8 - 3}
    trained = schedule.collect(1, work, _respond(work, {"p1-0": 1, "p1-1": 1, "p0-1": 3}))
    carried = next(g for g in trained if g.prompt.uid == "p0-1")
    assert [r.token_ids for r in carried.results] == [[0, 1, 2, 0, 1, 2]] * 2  # prefix + continuation
    assert [r.key.step for r in carried.results] == [0, 0]  # trained under its own key
    assert carried.stale_tokens == 6  # the prefixes came from the older policy


def test_exact_partial_generates_a_cut_group_again_with_its_responses_as_drafts():
    schedule = _schedule("exact-partial")
    work = schedule.rollout(0)
    schedule.collect(0, work, _respond(work, {"p0-0": 2, "p0-1": 6}))
    work = schedule.rollout(1)
    again = [r for r in work.requests if r.key.step == 0]
    assert [r.draft.token_ids for r in again] == [(0, 1, 2)] * 2
    assert [r.draft.finished for r in again] == [False, False]  # cut: the new policy verifies and goes on
    assert {r.sampling.max_new_tokens for r in again} == {8}  # whole, not budgeted again
    trained = schedule.collect(1, work, _respond(work, {"p1-0": 1, "p1-1": 1, "p0-1": 6}))
    assert sum(g.stale_tokens for g in trained) == 0
    assert schedule.carried() == 0


def test_exact_partial_without_speculation_generates_a_cut_group_again_from_scratch():
    schedule = _schedule("exact-partial", speculation=False)
    work = schedule.rollout(0)
    schedule.collect(0, work, _respond(work, {"p0-0": 2, "p0-1": 6}))
    assert [r.draft for r in schedule.rollout(1).requests if r.key.step == 0] == [None, None]


def test_tail_batching_pools_cut_groups_until_a_long_step_generates_only_them():
    schedule = _schedule("tail-batching", num_steps=6)
    for step, batch in ((0, 0), (1, 1)):
        work = schedule.rollout(step)
        assert work.draft_step == batch
        trained = schedule.collect(step, work, _respond(work, {f"p{batch}-0": 2, f"p{batch}-1": 6}))
        assert [g.prompt.uid for g in trained] == [f"p{batch}-0"]
    work = schedule.rollout(2)  # two groups wait: a step's worth
    assert [g.prompt.uid for g in work.groups] == ["p0-1", "p1-1"]
    assert work.draft_step == 1  # idle ranks draft the next fresh batch, 2
    assert {r.sampling.max_new_tokens for r in work.requests} == {8}
    assert all(r.draft is not None for r in work.requests)
    trained = schedule.collect(2, work, _respond(work, {"p0-1": 6, "p1-1": 6}))
    assert len(trained) == 2 and schedule.carried() == 0
    assert [g.prompt.uid for g in schedule.rollout(3).groups] == ["p2-0", "p2-1"]  # fresh batches go on


@pytest.mark.parametrize("kind", ["partial", "exact-partial", "tail-batching"])
def test_a_response_the_context_ended_is_finished_not_cut(kind):
    """A budget cuts only what it stops: a response that fills the model's context ends there under sync too, so its
    group trains in its own step (it was carried at every step, forever, when any 'length' short of max_new_tokens
    counted as a cut)."""
    for context_length, budget in ((8, 3), (8, 5), (8, 200)):  # prompts of 3 tokens: the context leaves room for 5
        schedule = _schedule(kind, cut_tokens=budget, num_steps=2, context_length=context_length)
        work = schedule.rollout(0)
        capped = {r.sampling.max_new_tokens for r in work.requests}
        assert capped == ({3} if budget < 5 else {8}), (budget, capped)  # at or above the room: no cap at all
        results = _respond(work, {"p0-0": 2, "p0-1": 6}, context_length)  # p0-1 fills the context: 5 tokens
        assert {len(r.token_ids) for r in results if r.key.prompt_uid == "p0-1"} == {min(budget, 5)}
        trained = schedule.collect(0, work, results)
        if budget < 5:  # the budget stopped p0-1: carried, and trained whole a step later
            assert [g.prompt.uid for g in trained] == ["p0-0"] and schedule.carried() == 1
            work = schedule.rollout(1)  # the last step: no budget (tail-batching: only the pooled group)
            trained = schedule.collect(1, work, _respond(work, {"p0-1": 6, "p1-0": 2, "p1-1": 2}, context_length))
            assert "p0-1" in [g.prompt.uid for g in trained], kind
            whole = next(g for g in trained if g.prompt.uid == "p0-1")
            assert [len(r.token_ids) for r in whole.results] == [5, 5]  # ended by the context, not cut again
            assert [r.finish_reason for r in whole.results] == ["length", "length"]
        else:
            assert [g.prompt.uid for g in trained] == ["p0-0", "p0-1"] and schedule.carried() == 0, (kind, budget)


def test_without_the_engines_context_a_response_short_of_its_limit_is_still_finished():
    """An engine that does not say its context (``Engine.context_length`` None): a response that ended "length"
    short of the cap it was asked for was ended by the context, never by the budget."""
    schedule = _schedule("exact-partial", cut_tokens=6)
    work = schedule.rollout(0)
    assert {r.sampling.max_new_tokens for r in work.requests} == {6}  # the room is not known: capped
    trained = schedule.collect(0, work, _respond(work, {"p0-0": 2, "p0-1": 7}, context_length=8))
    assert [g.prompt.uid for g in trained] == ["p0-0", "p0-1"] and schedule.carried() == 0


def test_the_budget_is_a_quantile_of_the_last_step_and_the_last_step_has_none():
    config = _config(
        "/tmp", "unit", num_steps=5, task={"prompts_per_step": 2, "samples_per_prompt": 2},
        schedule={"kind": "exact-partial", "cut_quantile": 0.5},
    )  # fmt: skip
    schedule = build_rollout_schedule(config, _Task(), 7, SamplingParams(max_new_tokens=8))
    assert schedule.budget(0) is None  # no history yet
    work = schedule.rollout(0)
    schedule.collect(0, work, _respond(work, {"p0-0": 2, "p0-1": 6}))
    assert schedule.budget(1) == 2  # the median of 2, 2, 6, 6
    work = schedule.rollout(1)
    schedule.collect(1, work, _respond(work, {"p1-0": 6, "p1-1": 7}))  # every response cut at 2
    assert schedule.budget(2) == 2  # cut responses count at their cut length: the budget does not shrink
    work = schedule.rollout(2)
    schedule.collect(2, work, _respond(work, {"p2-0": 1, "p2-1": 1, "p1-0": 6, "p1-1": 7}))
    assert schedule.budget(3) == 1  # the fresh responses' median; carried groups' lengths are not counted again
    assert schedule.budget(4) is None  # the last step


def test_the_step_line_says_what_a_schedule_did():
    from bubblespec.rl.loop import step_line
    from tests.step_records import step_record

    line = step_line(step_record(4, policy_lag=1, stale_tokens=120, carried_groups=3, train={"skipped": 1}))
    for field in ("policy_lag=1", "stale_tokens=120", "carried_groups=3", "trained=no:every_group_carried"):
        assert field in line, (field, line)
    assert "policy_lag" not in step_line(step_record(4))  # a synchronous step says nothing of it


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"schedule": {"kind": "async"}, "clock": {"kind": "wall"}}, "runs on the virtual clock only"),
        ({"schedule": {"kind": "partial"}}, "set exactly one of schedule.cut_tokens"),
        ({"schedule": {"kind": "partial", "cut_tokens": 4, "cut_quantile": 0.5}}, "set exactly one"),
        ({"schedule": {"kind": "sync", "cut_tokens": 4}}, "are for kinds partial"),
        ({"schedule": {"kind": "sync", "max_staleness": 2}}, "is for kind 'async'"),
        ({"schedule": {"kind": "nearly-async"}}, "schedule.kind"),
        (
            {"schedule": {"kind": "async"}, "speculation": {"enabled": True, "draft_sources": ["bubble", "suffix"]}},
            "'suffix' with schedule.kind 'async'",
        ),
    ],
)
def test_a_wrong_schedule_is_a_config_error_that_says_what_is_allowed(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, "bad", **changes)


def test_a_method_name_is_checked_before_anything_runs(tmp_path):
    config = _config(tmp_path, "methods")
    with pytest.raises(ConfigError, match="a method is a schedule"):
        bench_schedules.run_methods(config, ["sync", "async"], {"cut_quantile": 0.9})
    with pytest.raises(ConfigError, match="named more than once"):
        bench_schedules.run_methods(config, ["partial", "partial"], {"cut_quantile": 0.9})


def test_a_run_of_another_schedule_refuses_to_resume(tmp_path):
    config = _config(tmp_path, "async", schedule={"kind": "async"}, num_steps=1)
    run(config)
    with pytest.raises(ConfigError, match="cannot resume"):
        run(config, resume_dir=config.run_dir)


CUT = {"cut_tokens": 12}
METHODS = ["sync", "async-0", "async-1", "exact-partial", "exact-partial+bubblespec", "partial"]


@pytest.fixture(scope="module")
def schedules(tmp_path_factory):
    """Every schedule on the small run, side by side, through the command users run."""
    folder = tmp_path_factory.mktemp("peers-async")
    config = folder / "config.yaml"
    config.write_text(
        json.dumps(SMALL | {"name": "small", "eval_every": 1, "eval_prompts": 8, "metrics": {"enabled": False}})
    )
    result = CliRunner().invoke(
        app,
        ["bench", "peers-async", str(config), "--cut-tokens", str(CUT["cut_tokens"]), "--output-dir",
         str(folder / "runs"), "--json", str(folder / "report.json"), "--plot-dir", str(folder), "--jobs", "2"]
        + [arg for method in METHODS for arg in ("--methods", method)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    steps = {m: RunDirectory(folder / "runs" / f"small-{m.replace('+', '.')}-seed0").read_steps() for m in METHODS}
    return json.loads((folder / "report.json").read_text()), steps, result.output, folder


@pytest.mark.slow
def test_async_without_staleness_is_the_synchronous_run(schedules):
    _, steps, _, folder = schedules
    assert [s.model_dump(exclude={"ranks", "timelines", "training_timelines"}) for s in steps["async-0"]] == [
        s.model_dump(exclude={"ranks", "timelines", "training_timelines"}) for s in steps["sync"]
    ]
    weights = [
        load_file(str(RunDirectory(folder / "runs" / f"small-{m}-seed0").latest_checkpoint() / "weights.safetensors"))
        for m in ("sync", "async-0")
    ]
    assert all((weights[0][k] == weights[1][k]).all() for k in weights[0])


@pytest.mark.slow
def test_one_step_off_trains_on_samples_of_the_policy_before(schedules):
    _, steps, _, _ = schedules
    sync, off = steps["sync"], steps["async-1"]
    assert [s.policy_lag for s in off] == [0, 1, 1]
    assert off[0].rollout_digest == sync[0].rollout_digest  # the same keys and policy
    assert off[1].rollout_digest != sync[1].rollout_digest  # the same keys, the older policy
    assert [s.stale_tokens for s in off] == [0, off[1].trained_tokens, off[2].trained_tokens]
    assert off[-1].finished_at_seconds < sync[-1].finished_at_seconds  # generation hid under training


@pytest.mark.slow
def test_exact_partial_rollouts_are_exact_and_drafts_change_none_of_them(schedules):
    report, steps, output, _ = schedules
    exact, drafted = steps["exact-partial"], steps["exact-partial+bubblespec"]
    assert exact[0].carried_groups > 0  # the budget cut something, and it trained a step later
    assert sum(s.num_samples for s in exact) == sum(s.num_samples for s in steps["sync"])
    assert all(s.stale_tokens == 0 for s in exact + drafted)
    assert [s.rollout_digest for s in exact] == [s.rollout_digest for s in drafted]
    assert drafted[1].decode_steps < exact[1].decode_steps  # the cut responses drafted their own regeneration
    assert report["identical_rollouts"] and "rollouts of exact-partial+bubblespec vs exact-partial: identical" in output
    partial = steps["partial"]
    assert partial[1].stale_tokens > 0  # continued prefixes of the older policy


@pytest.mark.slow
def test_the_table_has_every_method_and_the_plot_is_written(schedules):
    report, _, output, folder = schedules
    for method in METHODS:
        assert method in output
    assert report["mean"]["sync"]["step_throughput_ratio"] == pytest.approx(1.0)
    assert report["mean"]["async-1"]["staleness"] > 0 and report["mean"]["exact-partial"]["staleness"] == 0
    assert (folder / "peers-async-reward.png").stat().st_size > 10_000
    assert all(len(curve) == 4 for curve in report["curves"]["sync"])  # the initial policy and 3 steps


@pytest.mark.slow
def test_exact_partial_with_the_cut_off_is_the_synchronous_run(tmp_path):
    """With no budget to end a step early, the exact schedule changes nothing, speculation off and on, also where the
    model's context ends responses before ``max_new_tokens`` (the shipped model copied with a context of 28: prompts
    of 5-14 tokens leave 14-23 for responses of up to 48). A budget above every response's room cuts nothing."""
    model = tmp_path / "short-context"
    shutil.copytree(ArithmeticTask.model_path(), model)
    hf_config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(hf_config | {"max_position_embeddings": 28}))
    context = {"model": {"dtype": "float64", "path": str(model)}, "logged_prompts": 4}
    for speculation, budget in ((False, 200), (True, 30)):
        sync = _config(tmp_path, f"sync-{speculation}", speculation={"enabled": speculation}, **context)
        exact = _config(tmp_path, f"exact-{speculation}", speculation={"enabled": speculation},
                        schedule={"kind": "exact-partial", "cut_tokens": budget}, **context)  # fmt: skip
        records = []
        for config in (sync, exact):
            run(config)
            records.append(RunDirectory(config.run_dir).read_steps())
        samples = RunDirectory(sync.run_dir).read_samples()
        ended = [r for line in samples for r in line.responses if r.finish_reason == "length" and r.tokens < 48]
        assert ended, "the context must end some responses before max_new_tokens"
        assert [s.num_samples for s in records[1]] == [s.num_samples for s in records[0]]
        assert [s.carried_groups for s in records[1]] == [0] * len(records[1])
        assert [s.rollout_digest for s in records[0]] == [s.rollout_digest for s in records[1]]
        assert [s.train for s in records[0]] == [s.train for s in records[1]]
        assert [s.finished_at_seconds for s in records[0]] == [s.finished_at_seconds for s in records[1]]
