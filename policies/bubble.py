"""Bubble policies: the order in which idle ranks draft the next step's keys.

Ranks pull keys from one shared queue in this order, so the order decides which keys get drafts when the
bubble is too short to draft them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from bubblespec.core.interfaces import BubblePolicyBase, RolloutKey


class CoverageFirst(BubblePolicyBase):
    """One sample of every prompt before a second sample of any: the most prompts get a draft soonest.

    Samples of one prompt differ (their keys differ), but a draft for sample 0 still shows how long the
    responses to that prompt are, which length-balanced sharding uses."""

    def order(self, keys: Sequence[RolloutKey], predicted_lengths: Mapping[RolloutKey, int]) -> list[RolloutKey]:
        position = {key: i for i, key in enumerate(keys)}
        return sorted(keys, key=lambda k: (k.sample_index, position[k]))


class LongestFirst(BubblePolicyBase):
    """The longest predicted responses first: they are the ones that make the next step's tail, so drafting
    them saves the most time on the critical path. Keys without a prediction come last, coverage-first.

    The controller predicts from a key's draft (an unfinished one is a lower bound) or from the responses to
    the same prompt the last time it was sampled (:mod:`bubblespec.rollout.predictions`)."""

    def order(self, keys: Sequence[RolloutKey], predicted_lengths: Mapping[RolloutKey, int]) -> list[RolloutKey]:
        position = {key: i for i, key in enumerate(keys)}
        return sorted(keys, key=lambda k: (-predicted_lengths.get(k, -1), k.sample_index, position[k]))
