"""Sharding policies: how a step's requests are split across ranks. Keyed sampling makes the split a matter of
speed only: every request gives the same tokens on whichever rank it runs."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from bubblespec.interfaces import GenerationRequest, RolloutKey


class RoundRobin:
    """Request i goes to rank i mod num_ranks: the baseline of most RL frameworks."""

    role = "sharding"

    def shard(
        self, requests: Sequence[GenerationRequest], num_ranks: int, predicted_lengths: Mapping[RolloutKey, int]
    ) -> list[list[GenerationRequest]]:
        return [list(requests[rank::num_ranks]) for rank in range(num_ranks)]


class LengthBalanced:
    """Longest-processing-time-first by predicted response length: the longest request goes to the least
    loaded rank, and so on. Drafts predict lengths well (a draft is a response of a policy one step older);
    requests without a prediction count as the mean of the predicted ones."""

    role = "sharding"

    def shard(
        self, requests: Sequence[GenerationRequest], num_ranks: int, predicted_lengths: Mapping[RolloutKey, int]
    ) -> list[list[GenerationRequest]]:
        known = [predicted_lengths[r.key] for r in requests if r.key in predicted_lengths]
        default = sum(known) / len(known) if known else 1.0
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
