"""Advantage estimators of the GRPO family, as pure functions of a step's rewards and groups (a group: the samples
of one prompt). Shapes are Python lists; a step has a few thousand samples at most.

    grpo          A_i = (r_i - mean_g) / (s + eps)       s: the group's std (scale "group"), the batch's ("batch"),
                                                          or 1 ("none")                 Shao et al. 2024, DeepSeekMath
    dr_grpo       A_i = r_i - mean_g                      no std: its bias toward easy and hard prompts removed
                                                                                        Liu et al. 2025, Dr. GRPO
    rloo          A_i = r_i - mean_(j in g, j != i) r_j   the leave-one-out baseline    Ahmadian et al. 2024, RLOO
    reinforce_pp  A_i = (a_i - mean(a)) / (std(a) + eps)  a_i = r_i - mean_g, normalised over the whole batch
                                                                                        Hu 2025, REINFORCE++-baseline

Standard deviations are the unbiased ones (n - 1), as ``torch.std``; a group or batch of one sample has none (0).
A group whose rewards are all equal has ``r_i - mean_g = 0`` exactly (in floating point the mean of three 0.1s is
not 0.1, and the difference divided by a std of the same size would be an advantage of 1e-11): it carries no
signal, and the learner skips a step in which no group does.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Literal

Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]
Scale = Literal["group", "batch", "none"]
ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp")


def compute_advantages(
    rewards: Sequence[float],
    groups: Sequence[int],
    estimator: Estimator = "grpo",
    scale: Scale = "group",
    epsilon: float = 1e-6,
) -> list[float]:
    """One advantage per sample; ``scale`` applies to ``grpo`` only (the others define their own scale)."""
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards for {len(groups)} groups")
    members: dict[int, list[float]] = {}
    for reward, group in zip(rewards, groups, strict=True):
        members.setdefault(group, []).append(reward)
    means = {g: statistics.fmean(r) for g, r in members.items()}
    equal = {g for g, r in members.items() if len(set(r)) == 1}
    centred = [0.0 if g in equal else r - means[g] for r, g in zip(rewards, groups, strict=True)]
    if estimator == "dr_grpo":
        return centred
    if estimator == "rloo":
        return [0.0 if g in equal else _leave_one_out(r, members[g]) for r, g in zip(rewards, groups, strict=True)]
    if estimator == "reinforce_pp":
        mean = statistics.fmean(centred) if centred else 0.0
        spread = _std(centred)
        return [(a - mean) / (spread + epsilon) for a in centred]
    if estimator != "grpo":
        raise ValueError(f"advantage estimator {estimator!r} is not known; choose one of {', '.join(ESTIMATORS)}")
    if scale == "none":
        return centred
    if scale == "batch":
        spread = _std(rewards)
        return [a / (spread + epsilon) for a in centred]
    if scale != "group":
        raise ValueError(f"scale_rewards {scale!r} is not known; choose group, batch or none")
    spreads = {g: _std(r) for g, r in members.items()}
    return [a / (spreads[g] + epsilon) for a, g in zip(centred, groups, strict=True)]


def _leave_one_out(reward: float, group: list[float]) -> float:
    if len(group) < 2:
        return 0.0  # no other sample to compare with
    return reward - (sum(group) - reward) / (len(group) - 1)


def _std(values: Sequence[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0
