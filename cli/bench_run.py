"""``bubblespec bench CONFIG``: the same run with speculation off and on, side by side.

Both runs use the same keys, so their rollouts, rewards and weights must be identical; what may differ is the
number of decode steps and the time the rollout phase takes. Throughput is rollout tokens per second of the
rollout phase, on the config's clock (virtual seconds of the cost profile, or real seconds on Ray);
``step_seconds_ratio`` compares whole steps (rollout + train + weight sync), which is where drafting while
training on hardware shared with the trainer shows its cost.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from bubblespec.cli.bench_tables import figure, print_tables, table
from bubblespec.core.config import RunConfig
from bubblespec.core.interfaces import acceptance_length
from bubblespec.observe.records import StepRecord
from bubblespec.observe.summary import bubble_utilization


def _variant(config: RunConfig, enabled: bool, output_dir: Path) -> RunConfig:
    # Off, nothing drafts: one candidate, as validation asks of a configuration with speculation off.
    update = {"enabled": enabled} | ({} if enabled else {"draft_candidates": 1})
    speculation = config.speculation.model_copy(update=update)
    name = f"{config.name}-speculation-{'on' if enabled else 'off'}"
    return config.model_copy(update={"speculation": speculation, "name": name, "output_dir": str(output_dir)})


def run_side_by_side(config: RunConfig, output_dir: Path | None = None) -> dict:
    from safetensors.torch import load_file

    from bubblespec.observe.run_dir import RunDirectory
    from bubblespec.run.launch import run

    scratch = output_dir is None
    output_dir = Path(tempfile.mkdtemp(prefix="bubblespec-bench-")) if scratch else output_dir
    try:
        steps, weights, summaries = {}, {}, {}
        for enabled in (False, True):
            variant = _variant(config, enabled, output_dir)
            summaries[enabled] = run(variant)
            run_dir = RunDirectory(variant.run_dir)
            steps[enabled] = run_dir.read_steps()
            weights[enabled] = load_file(str(run_dir.latest_checkpoint() / "weights.safetensors"))
    finally:
        if scratch:
            shutil.rmtree(output_dir, ignore_errors=True)
    per_step = [_compare(off, on) for off, on in zip(steps[False], steps[True], strict=True)]
    report = {
        "config": config.name,
        "clock": config.clock.kind,
        "profile": config.clock.profile if config.clock.kind == "virtual" else None,
        "num_ranks": config.rollout.num_ranks,
        "per_step": per_step,
        "overall": _aggregate(steps[False], steps[True], config.clock.kind, config.num_steps),
        "from_step_2": _aggregate(steps[False][1:], steps[True][1:], config.clock.kind, config.num_steps),
        "identical_rollouts": all(s["identical_rollouts"] for s in per_step),
        "identical_weights": weights[False].keys() == weights[True].keys()
        and all((weights[False][k] == weights[True][k]).all() for k in weights[False]),
        "wall_seconds": {"off": summaries[False]["wall_seconds"], "on": summaries[True]["wall_seconds"]},
    }
    return report


def _compare(off: StepRecord, on: StepRecord) -> dict:
    return {
        "step": on.step,
        "decode_steps_off": off.decode_steps,
        "decode_steps_on": on.decode_steps,
        "decode_step_reduction": 1 - on.decode_steps / off.decode_steps if off.decode_steps else 0.0,
        "acceptance_length_mean": acceptance_length(on.draft_tokens_accepted, on.verify_steps),
        "bubble_utilization": on.bubble_utilization,
        "draft_coverage": on.draft_coverage,
        "rollout_seconds_off": off.phase_seconds.rollout,
        "rollout_seconds_on": on.phase_seconds.rollout,
        "rollout_seconds_off_estimated_by_on": on.rollout_seconds_without_drafts,
        "throughput_ratio": off.phase_seconds.rollout / on.phase_seconds.rollout,
        "train_seconds_on": on.phase_seconds.train,
        "weight_sync_seconds_on": on.phase_seconds.weight_sync,
        "step_seconds_off": off.phase_seconds.total,
        "step_seconds_on": on.phase_seconds.total,
        "step_seconds_ratio": off.phase_seconds.total / on.phase_seconds.total,
        **_slowest_response(on),
        # draft tries: branches this step's responses took, and branch tokens its ranks drafted for the next step
        "branches_followed": sum(rank.branches_followed for rank in on.ranks),
        "branch_tokens_drafted": sum(rank.branch_tokens_produced for rank in on.ranks),
        "identical_rollouts": off.rollout_digest == on.rollout_digest and off.reward_mean == on.reward_mean,
    }


def _slowest_response(on: StepRecord) -> dict:
    """The rank that finished its shard last, and its response with the most decode steps: what the rollout
    waited for. The response's tokens not accepted from a draft were decoded one per forward pass."""
    if not on.ranks:
        return {}
    rank = max(on.ranks, key=lambda r: (r.generation_seconds, r.forward_passes))
    if rank.slowest_response_decode_steps is None:  # a record from before these fields
        return {"slowest_rank": rank.rank, "slowest_rank_forward_passes": rank.forward_passes}
    return {
        "slowest_rank": rank.rank,
        "slowest_rank_forward_passes": rank.forward_passes,
        "slowest_response_tokens": rank.slowest_response_tokens,
        "slowest_response_draft_tokens": rank.slowest_response_draft_tokens,
        "slowest_response_decode_steps": rank.slowest_response_decode_steps,
    }


def _aggregate(off: list[StepRecord], on: list[StepRecord], clock: str, num_steps: int) -> dict:
    if not on:
        return {}
    decode_off = sum(s.decode_steps for s in off)
    decode_on = sum(s.decode_steps for s in on)
    tokens = sum(s.generated_tokens for s in on)
    seconds_off = sum(s.phase_seconds.rollout for s in off)
    seconds_on = sum(s.phase_seconds.rollout for s in on)
    ratio = (tokens / seconds_on) / (tokens / seconds_off)
    step_off = sum(s.phase_seconds.total for s in off)
    step_on = sum(s.phase_seconds.total for s in on)
    return {
        "decode_step_reduction": 1 - decode_on / decode_off,
        "acceptance_length_mean": acceptance_length(
            sum(s.draft_tokens_accepted for s in on), sum(s.verify_steps for s in on)
        ),
        "bubble_utilization": bubble_utilization(on, num_steps),
        "draft_coverage": sum(s.draft_coverage for s in on) / len(on),
        "throughput_ratio_virtual": ratio if clock == "virtual" else None,
        "throughput_ratio_wall": ratio if clock == "wall" else None,
        # what the speculation-on run estimated of the same ratio on its own (bubblespec.rollout.speculation_effect)
        "throughput_ratio_estimated_in_run": _estimated_ratio(on),
        # rollout + train + weight sync: drafting while training on shared hardware may slow the trainer
        "step_seconds_ratio": step_off / step_on,
    }


def _estimated_ratio(on: list[StepRecord]) -> float | None:
    estimates = [s.rollout_seconds_without_drafts for s in on]
    if any(e is None for e in estimates):
        return None
    return sum(estimates) / sum(s.phase_seconds.rollout for s in on)


def print_report(report: dict, console=None) -> None:
    """Three tables per step (decode steps, rollout seconds, whole steps; each fits 80 columns), then the
    aggregates."""
    title = f"{report['config']}: decode steps, speculation off vs on ({report['clock']} clock)"
    decode = table(title, ("step", "off", "on", "reduction", "acceptance", "coverage", "bubble use"))
    tries = any(s.get("branch_tokens_drafted") for s in report["per_step"])
    columns = ("step", "off", "off (est.)", "on", "throughput", "identical")
    rollout = table("rollout seconds, speculation off vs on", (*columns, "branches") if tries else columns)
    for s in report["per_step"]:
        decode.add_row(
            str(s["step"]),
            str(s["decode_steps_off"]),
            str(s["decode_steps_on"]),
            f"{s['decode_step_reduction']:.1%}",
            f"{s['acceptance_length_mean']:.2f}",
            f"{s['draft_coverage']:.2f}",
            f"{s['bubble_utilization']:.2f}",
        )
        rollout.add_row(
            str(s["step"]),
            f"{s['rollout_seconds_off']:.3f}",
            figure(s["rollout_seconds_off_estimated_by_on"]),
            f"{s['rollout_seconds_on']:.3f}",
            f"{s['throughput_ratio']:.2f}x",
            "yes" if s["identical_rollouts"] else "NO",
            *([str(s["branches_followed"])] if tries else []),
        )
    whole = table(
        "whole step seconds (train: with weight sync); the slowest rank: its forward passes, and of its "
        "response with the most decode steps the tokens and how many were accepted draft tokens (any source)",
        ("step", "off", "on", "ratio", "train", "rank", "passes", "tokens", "drafted"),
    )
    for s in report["per_step"]:
        whole.add_row(
            str(s["step"]),
            f"{s['step_seconds_off']:.2f}",
            f"{s['step_seconds_on']:.2f}",
            f"{s['step_seconds_ratio']:.2f}x",
            f"{s['train_seconds_on'] + s['weight_sync_seconds_on']:.2f}",
            *(
                str(s.get(k, "—"))
                for k in (
                    "slowest_rank",
                    "slowest_rank_forward_passes",
                    "slowest_response_tokens",
                    "slowest_response_draft_tokens",
                )
            ),
        )
    notes = ["off (est.): the rollout without drafts as the speculation-on run estimated it from its own passes"]
    if tries:
        notes.append("branches: times a response of the step took a branch of its draft (draft tries)")
    labels = {
        "overall": "every step",
        "from_step_2": "from the second step (step 1 on: step 0 has no drafts, as no step ran before it to draft "
        "them, so its ratio is what drafting cost alone)",
    }
    notes += [f"{shown}: " + ", ".join(f"{k}={figure(v)}" for k, v in report[key].items()) for key, shown in
              labels.items()]  # fmt: skip
    notes.append(f"identical_rollouts={report['identical_rollouts']}  identical_weights={report['identical_weights']}")
    print_tables((decode, rollout, whole), notes, console)
