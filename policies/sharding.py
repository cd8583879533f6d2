"""Sharding policies: how a step's requests are split across ranks. Keyed sampling makes the split a matter of
speed only: every request gives the same tokens on whichever rank it runs."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from bubblespec.core.interfaces import GenerationRequest, RolloutKey, ShardingPolicyBase


class RoundRobin(ShardingPolicyBase):
    """Request i goes to rank i mod num_ranks: the baseline of most RL frameworks."""

    def shard(
        self, requests: Sequence[GenerationRequest], num_ranks: int, predicted_lengths: Mapping[RolloutKey, int]
    ) -> list[list[GenerationRequest]]:
        return [list(requests[rank::num_ranks]) for rank in range(num_ranks)]


class LengthBalanced(ShardingPolicyBase):
    """Longest-processing-time-first by predicted response length: the longest request goes to the least
    loaded rank, and so on. Drafts predict lengths well (a draft is a response of a policy one step older);
    requests without a prediction count as the mean of the predicted ones."""

    def shard(
        self, requests: Sequence[GenerationRequest], num_ranks: int, predicted_lengths: Mapping[RolloutKey, int]
    ) -> list[list[GenerationRequest]]:
        default = _mean_prediction(requests, predicted_lengths)
        load = [(0.0, rank) for rank in range(num_ranks)]
        shards: list[list[GenerationRequest]] = [[] for _ in range(num_ranks)]
        by_length = sorted(
            enumerate(requests), key=lambda item: (-predicted_lengths.get(item[1].key, default), item[0])
        )
        for _, request in by_length:
            total, rank = heapq.heappop(load)
            shards[rank].append(request)
            heapq.heappush(load, (total + predicted_lengths.get(request.key, default), rank))
        return shards


class PromptGrouped(ShardingPolicyBase):
    """Keeps every sample of a prompt on one rank (what group drafting needs: siblings propose for each other
    only within an engine), whole groups placed longest-predicted-first on the least loaded rank. A group's
    predicted length is the sum of its samples' (the mean of the known ones for samples without)."""

    def shard(
        self, requests: Sequence[GenerationRequest], num_ranks: int, predicted_lengths: Mapping[RolloutKey, int]
    ) -> list[list[GenerationRequest]]:
        default = _mean_prediction(requests, predicted_lengths)
        groups: dict[tuple[int, str], list[GenerationRequest]] = {}
        for request in requests:
            groups.setdefault((request.key.step, request.key.prompt_uid), []).append(request)
        sizes = [(sum(predicted_lengths.get(r.key, default) for r in g), i, g) for i, g in enumerate(groups.values())]
        load = [(0.0, rank) for rank in range(num_ranks)]
        shards: list[list[GenerationRequest]] = [[] for _ in range(num_ranks)]
        for size, _, group in sorted(sizes, key=lambda item: (-item[0], item[1])):
            total, rank = heapq.heappop(load)
            shards[rank] += group
            heapq.heappush(load, (total + size, rank))
        return shards


def _mean_prediction(requests: Sequence[GenerationRequest], predicted_lengths: Mapping[RolloutKey, int]) -> float:
    """What a request without a predicted length counts as: the mean of the known ones (1 if none is known)."""
    known = [predicted_lengths[r.key] for r in requests if r.key in predicted_lengths]
    return sum(known) / len(known) if known else 1.0
