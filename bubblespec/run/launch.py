"""Runs a run: ``bubblespec run`` in a function. :mod:`bubblespec.run.assembly` builds its parts for the configured
clock; this module drives them (the controller, the run directory, metrics) and summarises the run."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from bubblespec.core.config import RunConfig, check_resumable
from bubblespec.observe.metrics import RunMetrics, info_labels
from bubblespec.observe.records import StepRecord
from bubblespec.observe.run_dir import RunDirectory
from bubblespec.observe.summary import summarize
from bubblespec.rl.loop import Components, Controller
from bubblespec.run.assembly import build_parts, close_tasks


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
    if resume_dir is None:
        run_dir.create(config)  # first: a run of the same name fails before a port is taken or Ray starts
    else:
        check_resumable(run_dir.load_config(), config)
        run_dir.save_config(config)  # with the changes a resume allows (num_steps, metrics, ray, ...)
    try:
        return _run(config, run_dir, resume_dir is not None, metrics, on_step, on_phase, on_activity)
    except BaseException:
        if resume_dir is None:
            run_dir.remove_if_unused()
        raise


def _run(config, run_dir, resuming, metrics, on_step, on_phase, on_activity) -> dict:
    with contextlib.ExitStack() as stack:
        if metrics is not None:
            if resuming:  # counters continue from the steps kept, before the first scrape sees them
                metrics.observe_history(run_dir.checkpointed_steps())
            # A port in use fails before Ray starts.
            metrics.serve(config.metrics)
            stack.callback(metrics.close)
            on_phase = _both(metrics.phase, on_phase)
            on_activity = _both(metrics.activity, on_activity)
        parts = stack.enter_context(build_parts(config))
        stack.callback(close_tasks, parts.task, parts.eval_task)

        def step_done(record: StepRecord) -> None:
            wall[-1] = time.perf_counter() - started
            run_dir.write_wall_seconds(wall)
            if metrics is not None:
                metrics.observe_step(record)
            if on_step is not None:
                on_step(record)

        controller = Controller(config, parts, run_dir, step_done, on_phase)
        start = controller.restore() if resuming else 0
        if metrics is not None:
            metrics.write_target(run_dir.path, config.name)
        # the wall seconds of each part of the run (a resumed run has several), this one's last
        wall, started = [*(run_dir.read_wall_seconds() if resuming else []), 0.0], time.perf_counter()
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
        wall[-1] = time.perf_counter() - started
        run_dir.write_wall_seconds(wall)
        summary = summarize(config, run_dir.read_steps(), sum(wall)) | placement(parts)
        if len(wall) > 1:
            summary["wall_seconds_of_parts"] = wall
        run_dir.write_summary(summary)
        return summary


def _both(first: Callable | None, second: Callable | None) -> Callable | None:
    """A listener that tells ``first`` then ``second`` (either may be None)."""
    if first is None or second is None:
        return first or second
    return lambda *event: (first(*event), second(*event))


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
