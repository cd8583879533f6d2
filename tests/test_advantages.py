"""Advantage estimators against loop references written from each paper's equation."""

from __future__ import annotations

import math
import random

import pytest

from bubblespec.rl.advantages import compute_advantages


def _std(values):
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _reference(rewards, groups, estimator, scale, eps=1e-6):
    """One sample at a time, straight from the equations."""
    out = []
    for i, (r, g) in enumerate(zip(rewards, groups, strict=True)):
        same = [rewards[j] for j in range(len(rewards)) if groups[j] == g]
        mean = sum(same) / len(same)
        if estimator == "grpo":
            s = {"group": _std(same), "batch": _std(rewards), "none": None}[scale]
            out.append(r - mean if s is None else (r - mean) / (s + eps))
        elif estimator == "dr_grpo":
            out.append(r - mean)
        elif estimator == "rloo":
            others = [rewards[j] for j in range(len(rewards)) if groups[j] == g and j != i]
            out.append(r - sum(others) / len(others) if others else 0.0)
        else:  # reinforce_pp: group-centred, then normalised over the batch
            centred = [rewards[j] - sum(rewards[k] for k in range(len(rewards)) if groups[k] == groups[j])
                       / groups.count(groups[j]) for j in range(len(rewards))]  # fmt: skip
            mu = sum(centred) / len(centred)
            out.append((centred[i] - mu) / (_std(centred) + eps))
    return out


@pytest.mark.parametrize(
    ("estimator", "scale"),
    [("grpo", "group"), ("grpo", "batch"), ("grpo", "none"), ("dr_grpo", "group"), ("rloo", "group"),
     ("reinforce_pp", "group")],
)  # fmt: skip
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_estimators_equal_their_loop_reference(estimator, scale, seed):
    rng = random.Random(seed)
    groups = [g for g in range(6) for _ in range(rng.choice([1, 2, 4, 5]))]  # uneven groups, one of a single sample
    rewards = [rng.choice([0.0, 1.0, rng.random()]) for _ in groups]
    got = compute_advantages(rewards, groups, estimator, scale)
    assert got == pytest.approx(_reference(rewards, groups, estimator, scale), abs=1e-12)


def test_rloo_baseline_and_equal_rewards():
    assert compute_advantages([1.0, 0.0, 0.0], [0, 0, 0], "rloo") == pytest.approx([1.0, -0.5, -0.5])
    for estimator in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        assert compute_advantages([0.5] * 4, [0, 0, 1, 1], estimator) == [0.0] * 4  # no signal, no advantage


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="choose one of grpo, dr_grpo, rloo, reinforce_pp"):
        compute_advantages([1.0], [0], "ppo")
    with pytest.raises(ValueError, match="choose group, batch or none"):
        compute_advantages([1.0], [0], "grpo", "tokens")
