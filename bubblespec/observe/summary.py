"""summary.json: a run's headline numbers from its step records, and one sentence on whether speculation helped.
:mod:`bubblespec.run.launch` writes it at a run's end; :mod:`bubblespec.observe.report` recomputes it for a run
that ended before writing it."""

from __future__ import annotations

from bubblespec.core.config import RunConfig
from bubblespec.core.interfaces import acceptance_length
from bubblespec.observe.records import StepRecord
from bubblespec.rollout.step import bubble_use


def eval_means_by_name(summary: dict) -> dict[str, dict]:
    """The held-out eval's named rewards of a summary, each as {step ("start": before training): mean}."""
    evals = summary.get("eval_reward_means") or {}
    names = dict.fromkeys(name for means in evals.values() for name in means)
    return {name: {step: means[name] for step, means in evals.items() if name in means} for name in names}


def speculation_verdict(summary: dict) -> str:
    """Did speculation help in this run? One sentence from the summary: what the drafts saved in decode passes net
    of verification, what waiting for drafting passes in flight cost, and, when it did not pay, the cause that
    dominated and the setting that addresses it; how long ranks drafted beside the trainer on hardware it uses (a
    cost the run cannot see); the steps ``speculation.enabled: auto`` paused drafting in."""
    if not summary.get("speculation"):
        return "speculation was off in this run (speculation.enabled: false)"
    paused = summary.get("drafting_paused_steps", 0)
    steps = summary["num_steps"]
    pauses = f"; speculation.enabled: auto paused drafting in {paused} of {steps} steps, where it had not paid"
    return _verdict(summary) + _beside_training(summary) + (f"{pauses} (true drafts in every step)" if paused else "")


def _verdict(summary: dict) -> str:
    saved, rollout = summary.get("rollout_seconds_saved"), summary["rollout_seconds"]
    steps = f"{summary['decode_steps_saved']:.1%} fewer decode steps"
    if saved is None:
        return f"{steps}; the time saved was not estimated"
    without = rollout + saved
    share = saved / without if without > 0 else 0.0
    clock = summary.get("clock", "wall")
    wait = summary.get("barrier_wait_seconds", 0.0)
    passes = saved + wait
    parts = (
        f"the drafts saved {passes:.2f} s of decode passes net of verifying them, and the steps waited {wait:.2f} s "
        "for drafting passes in flight"
    )
    estimated = "estimated: the same responses replayed without drafts under this run's own pass timings"
    if saved >= 0:
        return f"speculation saved {saved:.2f} {clock}-clock seconds of rollout ({share:.1%}; {estimated}): {parts}"
    cost = f"speculation cost {-saved:.2f} {clock}-clock seconds of rollout ({-share:.1%} slower; {estimated})"
    verdict = f"{cost}: {parts}"
    if wait >= max(-passes, 0.0):
        return (
            f"{verdict}. Waiting for drafting dominated: drafting passes still ran when the step needed the ranks "
            "(for a weight sync, or colocated ranks releasing their memory to the trainer); speculation.enabled: auto "
            "pauses drafting that does not pay, false runs without drafts. `bubblespec bench CONFIG` measures both "
            "side by side"
        )
    if summary["decode_steps_saved"] < 0.05:
        return (
            f"{verdict}. The bubbles were too short to draft much ({steps}, drafts for "
            f"{summary.get('draft_coverage_mean', 0.0):.0%} of the requests): verifying drafts that short costs about "
            "what it saves; a workload with a longer tail of response lengths leaves longer bubbles, and "
            "speculation.enabled: auto pauses drafting that does not pay"
        )
    return (
        f"{verdict}. Verifying the drafts dominated: they cost more than they saved; try a smaller "
        "rollout.max_draft_tokens_per_step, rollout.adaptive_draft_length: true, or another "
        "speculation.bubble_policy (speculation.enabled: auto pauses drafting that does not pay), and "
        "`bubblespec bench CONFIG` to measure them side by side"
    )


def _beside_training(summary: dict) -> str:
    """The fourth part of what speculation did, which the run's estimate leaves out: drafting beside the trainer
    on hardware it uses."""
    beside = summary.get("drafting_beside_training_seconds", 0.0)
    if not beside or not summary.get("drafting_shares_trainer_hardware"):
        return ""
    return (
        f"; ranks drafted beside the trainer, on CPU cores it uses, for {beside:.2f} s of its "
        f"{summary.get('train_seconds', 0.0):.2f} s of training, which slows it by what this run cannot see "
        "(`bubblespec bench CONFIG` measures it: train + sync with speculation off against on)"
    )


def bubble_utilization(steps: list[StepRecord], num_steps: int) -> float:
    """The run's :func:`~bubblespec.rollout.step.bubble_use`: every rank of every step but the run's last."""
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
    wait = sum(s.barrier_wait_seconds for s in steps)
    names = dict.fromkeys(name for s in steps for name in s.reward_means)
    drafting, why = config.training_drafting()
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
        "train_seconds": sum(s.phase_seconds.train for s in steps),
        "drafting_beside_training_seconds": sum(
            s.phase_seconds.train for s in steps if s.training_timelines and any(s.training_timelines)
        ),
        "drafting_shares_trainer_hardware": bool(drafting) and config.drafting_shares_trainer_hardware,
        "rollout_seconds_saved": saved,
        "barrier_wait_seconds": wait,
        "drafting_paused_steps": sum(s.drafting_paused for s in steps),
        "rollout_tokens_per_second": tokens / rollout if rollout > 0 else 0.0,
        "eval_rewards": {
            **({"start": before} if before is not None else {}),
            **{s.step: s.eval_reward for s in steps if s.eval_reward is not None},
        },
        "eval_reward_means": {
            **(
                {"start": steps[0].eval_reward_means_before_training}
                if steps[0].eval_reward_means_before_training
                else {}
            ),
            **{s.step: s.eval_reward_means for s in steps if s.eval_reward_means},
        },  # fmt: skip
        "wall_seconds": wall_seconds,
        "drafting_while_training": f"{ranks_drafting(drafting, config.rollout.num_ranks)} ({why})",
    }
    return summary | {"speculation_effect": speculation_verdict(summary)}


def ranks_drafting(drafting: int, num_ranks: int) -> str:
    """'off', 'on' (every rank) or 'on for N of M ranks'."""
    if not drafting:
        return "off"
    return "on" if drafting >= num_ranks else f"on for {drafting} of {num_ranks} ranks"
