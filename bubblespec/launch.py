"""Runs a run: ``bubblespec run`` in a function. :mod:`bubblespec.assembly` builds its parts for the configured clock;
this module drives them (the controller, the run directory, metrics) and summarises the run."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from bubblespec.assembly import build_parts, close_tasks
from bubblespec.config import RunConfig
from bubblespec.controller import Components, Controller
from bubblespec.interfaces import acceptance_length
from bubblespec.metrics import RunMetrics, info_labels
from bubblespec.records import StepRecord
from bubblespec.rollout import bubble_use
from bubblespec.run_dir import RunDirectory


def run(
    config: RunConfig,
    resume_dir: Path | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    on_phase: Callable[[int, str], None] | None = None,
    on_activity: Callable[[int, str, str], None] | None = None,
) -> dict:
    """Runs (or resumes) a whole run; returns its summary. ``on_step`` gets each step's record, ``on_phase``
    (step, phase) as the controller enters rollout, train and weight sync, and ``on_activity`` (rank,
    activity, detail) as wall-clock ranks generate, draft and fall idle within a step. With
    ``metrics.enabled`` the step records also feed Prometheus metrics served while the run runs."""
    metrics = RunMetrics(config.rollout.num_ranks, info_labels(config)) if config.metrics.enabled else None
    run_dir = RunDirectory(resume_dir or config.run_dir)
    with contextlib.ExitStack() as stack:
        if metrics is not None:
            if resume_dir is not None:  # counters continue from the steps kept, before the first scrape sees them
                metrics.observe_history(run_dir.checkpointed_steps())
            # First: a port in use fails before Ray starts or anything is written.
            metrics.serve(config.metrics)
            stack.callback(metrics.close)
            on_phase = _both(metrics.phase, on_phase)
            on_activity = _both(metrics.activity, on_activity)
        parts = stack.enter_context(build_parts(config))
        stack.callback(close_tasks, parts.task, parts.eval_task)

        def step_done(record: StepRecord) -> None:
            if metrics is not None:
                metrics.observe_step(record)
            if on_step is not None:
                on_step(record)

        controller = Controller(config, parts, run_dir, step_done, on_phase)
        start = 0
        if resume_dir is None:
            run_dir.create(config)
        else:
            start = controller.restore()
        if metrics is not None:
            metrics.write_target(run_dir.path, config.name)
        started = time.perf_counter()
        if on_activity is not None:
            parts.service.ranks.on_activity = on_activity
        try:
            controller.run(start_step=start)
        except KeyboardInterrupt:
            if metrics is not None:
                metrics.remove_target()
            raise
        if metrics is not None:  # a run that failed keeps its target: Prometheus shows it down
            metrics.remove_target()
        summary = summarize(config, run_dir.read_steps(), time.perf_counter() - started) | placement(parts)
        run_dir.write_summary(summary)
        return summary


def _both(first: Callable | None, second: Callable | None) -> Callable | None:
    """A listener that tells ``first`` then ``second`` (either may be None)."""
    if first is None or second is None:
        return first or second
    return lambda *event: (first(*event), second(*event))


def speculation_verdict(summary: dict) -> str:
    """Did speculation help in this run? One sentence from the summary, with what to try when it did not."""
    if not summary.get("speculation"):
        return "speculation was off in this run (speculation.enabled: false)"
    saved, rollout = summary.get("rollout_seconds_saved"), summary["rollout_seconds"]
    steps = f"{summary['decode_steps_saved']:.1%} fewer decode steps"
    if saved is None:
        return f"{steps}; the time saved was not estimated"
    without = rollout + saved
    share = saved / without if without > 0 else 0.0
    clock = summary.get("clock", "wall")
    if saved >= 0:
        return (
            f"speculation saved {saved:.2f} {clock}-clock seconds of rollout ({share:.1%}; estimated: the same "
            f"responses replayed without drafts under this run's own pass timings), with {steps}"
        )
    return (
        f"speculation cost {-saved:.2f} {clock}-clock seconds of rollout ({-share:.1%} slower; estimated: the same "
        f"responses replayed without drafts under this run's own pass timings), with {steps}: verifying the "
        "drafts cost more than it saved. Try `bubblespec bench CONFIG` (the run with speculation off and on, side "
        "by side), speculation.draft_during_training: true (longer drafts), or another speculation.bubble_policy"
    )


def placement(parts: Components) -> dict:
    """Where a Ray run's ranks and trainer workers ran at its end (node, GPUs; ranks' releases), for the summary;
    nothing on the virtual clock."""
    found = {}
    ranks = parts.service.ranks.placement()
    if ranks:
        found["ranks"] = ranks
    workers = parts.trainer.placement()
    if workers:
        found["trainer_workers"] = workers
    return {"placement": found} if found else {}


def bubble_utilization(steps: list[StepRecord], num_steps: int) -> float:
    """The run's :func:`~bubblespec.rollout.bubble_use`: every rank of every step but the run's last."""
    return bubble_use(r for s in steps if s.step < num_steps - 1 for r in s.ranks)


def summarize(config: RunConfig, steps: list[StepRecord], wall_seconds: float) -> dict:
    """summary.json: the run's headline numbers from its step records."""
    if not steps:
        return {"num_steps": 0}
    rollout = sum(s.phase_seconds.rollout for s in steps)
    tokens = sum(s.generated_tokens for s in steps)
    decode = sum(s.decode_steps for s in steps)
    verify = sum(s.verify_steps for s in steps)
    accepted = sum(s.draft_tokens_accepted for s in steps)
    before = steps[0].eval_reward_before_training
    saved = None if any(s.rollout_seconds_saved is None for s in steps) else sum(s.rollout_seconds_saved for s in steps)
    names = dict.fromkeys(name for s in steps for name in s.reward_means)
    summary = {
        "name": config.name,
        "clock": config.clock.kind,
        "speculation": config.speculation.enabled,
        "num_steps": len(steps),
        "reward_first": steps[0].reward_mean,
        "reward_last": steps[-1].reward_mean,
        "rewards": [s.reward_mean for s in steps],
        "reward_means": {n: sum(s.reward_means.get(n, 0.0) for s in steps) / len(steps) for n in names},
        "reward_calls": sum(s.reward_calls for s in steps),
        "reward_failures": sum(s.reward_timeouts + s.reward_errors for s in steps),
        "steps_not_trained": sum(not s.trained for s in steps),
        "generated_tokens": tokens,
        "decode_steps": decode,
        "decode_steps_saved": 1 - decode / tokens if tokens else 0.0,
        "acceptance_length_mean": acceptance_length(accepted, verify),
        "draft_coverage_mean": sum(s.draft_coverage for s in steps) / len(steps),
        "bubble_utilization": bubble_utilization(steps, config.num_steps),
        "rollout_seconds": rollout,
        "rollout_seconds_saved": saved,
        "rollout_tokens_per_second": tokens / rollout if rollout > 0 else 0.0,
        "eval_rewards": {
            **({"start": before} if before is not None else {}),
            **{s.step: s.eval_reward for s in steps if s.eval_reward is not None},
        },
        "wall_seconds": wall_seconds,
    }
    return summary | {"speculation_effect": speculation_verdict(summary)}
