"""``bubblespec bench peers-async CONFIG``: bubblespec against what users pick instead against the long tail.

Every method is the config's run under another rollout schedule (``schedule.kind``, docs/design.md §12) with
speculation off or on (``+bubblespec``), on the same workload, keys and cost profile: synchronous plain decoding
(the baseline), synchronous bubblespec, async RL with ``max_staleness`` k (``async-k``), partial rollouts,
exact partial rollouts, tail batching, and the combinations. Each trains on what its schedule really gives it.

Per method, from the second step: rollout throughput (trained response tokens per second of rollout phase) and
whole-step throughput (trained tokens per second of the run's timeline, where async overlaps generation with
training), both against synchronous plain; the bubble share (rank-seconds the ranks idled at the barrier, not
drafting, over the rollout phases' rank-seconds); staleness (share of trained tokens a policy older than the trained
one generated); and the learning effect: held-out reward after the last step and its curve against simulated time
and steps (``eval_every``). A method and its ``+bubblespec`` twin must train on identical rollouts where the
schedule does not depend on time (every kind but async with ``max_staleness`` over 1): checked by digest.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from bubblespec.cli.bench_tables import print_tables, table
from bubblespec.core.config import RunConfig
from bubblespec.core.errors import ConfigError
from bubblespec.observe.records import StepRecord

DEFAULT_METHODS = (
    "sync",
    "sync+bubblespec",
    "async-1",
    "async-2",
    "partial",
    "exact-partial+bubblespec",
    "tail-batching",
    "tail-batching+bubblespec",
    "async-1+bubblespec",
)
BASELINE = "sync"
KINDS = ("sync", "async", "partial", "exact-partial", "tail-batching")
_METHOD = re.compile(r"^(sync|async-(\d+)|partial|exact-partial|tail-batching)(\+bubblespec)?$")


def parse_method(text: str) -> tuple[str, int | None, bool]:
    """``"async-2+bubblespec"`` -> ``("async", 2, True)``; ``"partial"`` -> ``("partial", None, False)``."""
    match = _METHOD.match(text.strip())
    if match is None:
        raise ConfigError(
            f"unknown method {text!r}; a method is a schedule (sync, async-K with K the max staleness, partial, "
            "exact-partial, tail-batching), optionally followed by +bubblespec (speculation on): e.g. "
            "async-1+bubblespec"
        )
    kind, staleness, bubblespec = match.groups()
    return ("async", int(staleness), bool(bubblespec)) if staleness else (kind, None, bool(bubblespec))


def method_config(config: RunConfig, method: str, cut: dict, seed: int, output_dir: Path) -> RunConfig:
    """``config`` as ``method`` runs it (``cut``: schedule.cut_tokens or cut_quantile for the kinds that cut)."""
    kind, staleness, bubblespec = parse_method(method)
    schedule: dict = {"kind": kind}
    if kind == "async":
        schedule["max_staleness"] = staleness
    if kind in ("partial", "exact-partial", "tail-batching"):
        schedule |= cut
    data = config.model_dump() | {
        "schedule": schedule,
        "speculation": config.speculation.model_dump() | {"enabled": bubblespec},
        "metrics": config.metrics.model_dump() | {"enabled": False},  # runs may run side by side: no port to share
        "seed": seed,
        "name": f"{config.name}-{method.replace('+', '.')}-seed{seed}",
        "output_dir": str(output_dir),
    }
    return RunConfig.model_validate(data)


def run_methods(
    config: RunConfig, methods: list[str], cut: dict, seeds: int = 1, output_dir: Path | None = None, jobs: int = 1
) -> dict:
    """Runs every method with every seed (``jobs`` runs at a time, each in a process of its own with one torch
    thread when ``jobs`` > 1) and measures them against ``sync`` of the same seed."""
    from bubblespec.observe.run_dir import RunDirectory

    if config.num_steps < 3:
        raise ConfigError(
            f"bench peers-async measures from the second step: num_steps must be >= 3, got {config.num_steps}"
        )
    methods = [m.strip() for m in methods]
    repeated = sorted({m for m in methods if methods.count(m) > 1})
    if repeated:
        raise ConfigError(f"method(s) {', '.join(map(repr, repeated))} named more than once in {methods}")
    methods = methods if BASELINE in methods else [BASELINE, *methods]
    seed_list = [config.seed + i for i in range(seeds)]
    configs = {(m, s): method_config(config, m, cut, s, Path(".")) for m in methods for s in seed_list}  # fail early
    scratch = output_dir is None
    output_dir = Path(tempfile.mkdtemp(prefix="bubblespec-peers-async-")) if scratch else output_dir
    try:
        runs = {key: c.model_copy(update={"output_dir": str(output_dir)}) for key, c in configs.items()}
        if jobs == 1:
            for method_run in runs.values():
                _run_one(method_run.model_dump_json())
        else:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            spawn = multiprocessing.get_context("spawn")  # no fork of a process that holds torch threads
            with ProcessPoolExecutor(jobs, mp_context=spawn, initializer=_one_thread) as pool:
                for done in [pool.submit(_run_one, c.model_dump_json()) for c in runs.values()]:
                    done.result()  # a run's error, with its own message
        steps = {key: RunDirectory(c.run_dir).read_steps() for key, c in runs.items()}
    finally:
        if scratch:
            shutil.rmtree(output_dir, ignore_errors=True)
    per_seed = {
        m: [_measure(steps[m, s], steps[BASELINE, s], config.rollout.num_ranks) for s in seed_list] for m in methods
    }
    report = {
        "config": config.name,
        "profile": config.clock.profile,
        "num_ranks": config.rollout.num_ranks,
        "num_steps": config.num_steps,
        "seeds": seed_list,
        "cut": cut,
        "methods": methods,
        "per_seed": per_seed,
        "mean": {m: _mean(rows) for m, rows in per_seed.items()},
        "curves": {m: [_curve(steps[m, s]) for s in seed_list] for m in methods},
        "twins": _twins(methods, steps, seed_list),
    }
    report["identical_rollouts"] = all(t["identical"] for t in report["twins"] if t["must_match"])
    return report


def _run_one(config_json: str) -> None:
    from bubblespec.run.launch import run

    run(RunConfig.model_validate_json(config_json))


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _measure(steps: list[StepRecord], baseline: list[StepRecord], num_ranks: int) -> dict:
    """One run against the baseline run of the same seed, from the second step."""
    later, base = steps[1:], baseline[1:]

    def rollout(records: list[StepRecord]) -> float:
        return sum(s.phase_seconds.rollout for s in records)

    def throughput(records: list[StepRecord], seconds: float) -> float:
        return sum(s.trained_tokens or 0 for s in records) / seconds if seconds > 0 else 0.0

    def timeline(records: list[StepRecord]) -> float:  # from the end of the first step to the end of the last
        return records[-1].finished_at_seconds - records[0].finished_at_seconds

    idle = sum(max(0.0, r.bubble_seconds - r.drafting_seconds) for s in later for r in s.ranks)
    trained = sum(s.trained_tokens or 0 for s in steps)
    generated = sum(s.generated_tokens for s in later)
    evals = [s.eval_reward for s in steps if s.eval_reward is not None]
    return {
        "rollout_throughput_ratio": throughput(later, rollout(later)) / throughput(base, rollout(base)),
        "step_throughput_ratio": throughput(later, timeline(steps)) / throughput(base, timeline(baseline)),
        "bubble_share": idle / (num_ranks * rollout(later)) if rollout(later) > 0 else 0.0,
        "staleness": sum(s.stale_tokens for s in steps) / trained if trained else 0.0,
        "decode_steps_per_token": sum(s.decode_steps for s in later) / generated if generated else 0.0,
        "trained_samples": sum(s.num_samples for s in steps),
        "trained_tokens": trained,
        "generated_tokens": sum(s.generated_tokens for s in steps),
        "final_eval_reward": evals[-1] if evals else None,
        "simulated_seconds": steps[-1].finished_at_seconds,
    }


def _mean(rows: list[dict]) -> dict:
    mean = {}
    for field in rows[0]:
        values = [r[field] for r in rows if r[field] is not None]
        mean[field] = sum(values) / len(values) if values else None
    return mean


def _curve(steps: list[StepRecord]) -> list[dict]:
    """Held-out reward against steps and simulated seconds (the initial policy at 0)."""
    points = []
    if steps and steps[0].eval_reward_before_training is not None:
        points.append({"step": 0, "seconds": 0.0, "eval_reward": steps[0].eval_reward_before_training})
    points += [
        {"step": s.step + 1, "seconds": s.finished_at_seconds, "eval_reward": s.eval_reward}
        for s in steps
        if s.eval_reward is not None
    ]
    return points


def _twins(methods: list[str], steps: dict, seeds: list[int]) -> list[dict]:
    """Each ``+bubblespec`` method against the same schedule without speculation, where both ran: the rollouts
    must be identical step by step where the schedule does not depend on how long steps take."""
    twins = []
    for method in methods:
        kind, staleness, bubblespec = parse_method(method)
        plain = method.removesuffix("+bubblespec")
        if not bubblespec or plain not in methods:
            continue
        identical = all(
            [a.rollout_digest for a in steps[plain, s]] == [b.rollout_digest for b in steps[method, s]] for s in seeds
        )
        twins.append({
            "method": method, "plain": plain, "identical": identical,
            "must_match": kind != "async" or (staleness or 0) <= 1,
        })  # fmt: skip
    return twins


SPEED_COLUMNS = (
    ("rollout", "rollout_throughput_ratio", "{:.2f}x"),
    ("whole step", "step_throughput_ratio", "{:.2f}x"),
    ("bubble", "bubble_share", "{:.1%}"),
    ("steps/token", "decode_steps_per_token", "{:.3f}"),
)
COST_COLUMNS = (
    ("stale", "staleness", "{:.1%}"),
    ("eval reward", "final_eval_reward", "{:.4f}"),
    ("samples", "trained_samples", "{:.0f}"),
    ("sim. seconds", "simulated_seconds", "{:.2f}"),
)
"""The table's columns: header, field of the report's means, format."""


def _fmt(value, pattern: str) -> str:
    return "—" if value is None else pattern.format(value)


def print_report(report: dict, console=None) -> None:
    """One table: each method's speed, bubble, staleness and learning, from the second step, against sync."""
    seeds = report["seeds"]
    title = (
        f"{report['config']}: {report['num_ranks']} ranks, {report['profile']} profile, {report['num_steps']} steps, "
        f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))} (throughput from the second step, "
        "against sync)"
    )
    tables = []
    for table_title, columns in ((title, SPEED_COLUMNS), ("what it costs", COST_COLUMNS)):
        made = table(table_title, ("method", *(header for header, _, _ in columns)), first="left")
        for method in report["methods"]:
            made.add_row(method, *(_fmt(report["mean"][method][field], pattern) for _, field, pattern in columns))
        tables.append(made)
    cut = ", ".join(f"{k}={v}" for k, v in report["cut"].items())
    notes = [
        "rollout / whole step: trained response tokens per second of rollout phase / of the run's timeline; bubble: "
        "rank time idle at the barrier; steps/token: decode steps per generated token; stale: trained tokens from an "
        "older policy; eval reward: held-out, after the last step; samples: trained; sim. seconds: the whole run "
        f"(means over seeds); cut: {cut}"
    ]
    for twin in report["twins"]:
        verdict = "identical" if twin["identical"] else "DIFFERENT" if twin["must_match"] else "different (timing)"
        notes.append(f"rollouts of {twin['method']} vs {twin['plain']}: {verdict}")
    print_tables(tables, notes, console)


def plot_report(report: dict, folder: Path, prefix: str = "peers-async") -> list[Path]:
    """Held-out reward against simulated seconds and against steps, every method (seed 0's run solid, others
    faded): ``{prefix}-reward.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    figure, (by_time, by_step) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, method in enumerate(report["methods"]):
        colour = colours[index % len(colours)]
        style = "-" if method.endswith("+bubblespec") or method == "sync" else "--"
        for seed_index, curve in enumerate(report["curves"][method]):
            if not curve:
                continue
            label = method if seed_index == 0 else None
            alpha = 1.0 if seed_index == 0 else 0.4
            by_time.plot([p["seconds"] for p in curve], [p["eval_reward"] for p in curve], style, color=colour,
                         marker="o", markersize=3, alpha=alpha, label=label)  # fmt: skip
            by_step.plot([p["step"] for p in curve], [p["eval_reward"] for p in curve], style, color=colour,
                         marker="o", markersize=3, alpha=alpha)  # fmt: skip
    by_time.set_xlabel(f"simulated seconds ({report['profile']} profile)")
    by_step.set_xlabel("steps trained")
    by_time.set_ylabel("held-out reward")
    for axes in (by_time, by_step):
        axes.grid(alpha=0.3)
    figure.suptitle(f"{report['config']}: {report['num_ranks']} ranks, seeds {', '.join(map(str, report['seeds']))}")
    figure.legend(fontsize=8, loc="center right")
    figure.tight_layout(rect=(0, 0, 0.83, 1))
    path = folder / f"{prefix}-reward.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return [path]
