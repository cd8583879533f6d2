"""Rollout ranks on the virtual clock (docs/design.md §6): every rank in this process, on simulated time.

Ranks hold identical weights, so one engine serves them all in turn. Each rank has a
:class:`~bubblespec.rollout.clocks.VirtualClock` that the forward passes it runs advance by their cost. The pool is a
driver of :class:`~bubblespec.rollout.bubble_scheduler.PhaseScheduler`: it runs the calls the scheduler asks for and
reports each return at its simulated time, earliest first, so that the scheduler decides exactly as it does on Ray
Serve.

A shard's length does not depend on what other ranks do, so the pool simulates every shard when the phase starts
and knows the barrier (the last shard's end) before any drafting chunk runs; a chunk runs until its rank's time
reaches that barrier (or the trainer's end), as a real rank runs until it is told to stop.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from bubblespec.core.interfaces import Engine, GenerationRequest, GenerationResult
from bubblespec.rollout.bubble_scheduler import (
    ActivityListener,
    Command,
    DraftChunk,
    Generate,
    PhaseScheduler,
    StopDrafting,
    ignore_activity,
)
from bubblespec.rollout.clocks import CostProfile, DeadlineStop, VirtualClock
from bubblespec.rollout.speculation_effect import seconds_saved
from bubblespec.rollout.step import DraftPlan, RolloutOutcome

_SHARD, _CHUNK = 0, 1
"""Calls that return at the same simulated time are reported shards first (the barrier before a chunk's end)."""


class VirtualRankPool:
    """All ranks in this process on virtual time."""

    def __init__(self, engine: Engine, num_ranks: int, profile: CostProfile, max_batch_size: int = 64) -> None:
        self.engine = engine
        self.num_ranks = num_ranks
        self.context_length = engine.context_length
        self.profile = profile
        self.max_batch_size = max_batch_size
        """The engine's batch limit, for the replay of shards without drafts
        (:mod:`bubblespec.rollout.speculation_effect`)."""
        self.on_activity: ActivityListener = ignore_activity
        self._training_plan = DraftPlan([])

    def update_weights(self, state_dict, version: int) -> float:
        self.engine.update_weights(state_dict, version)
        state_bytes = sum(tensor.numel() * tensor.element_size() for tensor in state_dict.values())
        return self.profile.weight_sync_seconds(state_bytes, self.num_ranks)

    def release(self) -> None:
        self.engine.release()

    def resume(self) -> None:
        self.engine.resume()

    def placement(self) -> list[dict]:
        return []

    def evaluate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        return self.engine.generate(requests)

    def rollout(self, shards: Sequence[Sequence[GenerationRequest]], plan: DraftPlan) -> RolloutOutcome:
        scheduler = PhaseScheduler(self.num_ranks, plan, self.engine.policy_version, shards, self.on_activity)
        return self._run(scheduler, trainer_ends=None)

    def start_drafting(self, plan: DraftPlan) -> None:
        self._training_plan = plan

    def stop_drafting(self, train_seconds: float) -> RolloutOutcome:
        """Every rank drafts the rest of the plan for the training phase's ``train_seconds``."""
        scheduler = PhaseScheduler(self.num_ranks, self._training_plan, self.engine.policy_version,
                                   on_activity=self.on_activity)  # fmt: skip
        return self._run(scheduler, trainer_ends=train_seconds)

    def _run(self, scheduler: PhaseScheduler, trainer_ends: float | None) -> RolloutOutcome:
        timelines = [VirtualClock(self.profile) for _ in range(self.num_ranks)]
        returns: list[tuple[float, int, int, int, float, list[GenerationResult]]] = []
        """Calls that have run, by the simulated time they return: (time, kind, rank, forward passes, seconds the
        drafts saved, results)."""
        stop_at = trainer_ends

        def run(commands: list[Command]) -> None:
            for command in commands:
                if isinstance(command, StopDrafting):
                    assert command.at == stop_at, f"the scheduler stopped at {command.at}, the pool at {stop_at}"
                    continue
                timeline = timelines[command.rank]
                if isinstance(command, Generate):
                    results = self.engine.generate(list(command.requests), on_forward=timeline)
                    saved = seconds_saved(command.requests, results, timeline.now, self.max_batch_size,
                                          self.engine.vocab_size, self.profile.forward_seconds)  # fmt: skip
                    heapq.heappush(
                        returns, (timeline.now, _SHARD, command.rank, timeline.forward_passes, saved, results)
                    )
                elif isinstance(command, DraftChunk):
                    stop = DeadlineStop(timeline, stop_at)
                    results = self.engine.generate(list(command.requests), stop=stop, on_forward=timeline)
                    heapq.heappush(returns, (timeline.now, _CHUNK, command.rank, 0, 0.0, results))

        first = scheduler.start()
        if trainer_ends is None:  # a rollout: ``first`` is every shard; the barrier is the last one's end
            run(first)
            stop_at = max(t.now for t in timelines)
        else:
            heapq.heappush(returns, (trainer_ends, _SHARD, -1, 0, 0.0, []))  # the trainer's end, before any chunk's
            run(first)
        while returns:
            now, kind, rank, passes, saved, results = heapq.heappop(returns)
            if rank < 0:
                run(scheduler.stop(now))
            elif kind == _SHARD:
                run(scheduler.shard_done(rank, now, results, passes, saved))
            else:
                run(scheduler.chunk_done(rank, now, results))
        end = max(t.now for t in timelines) if trainer_ends is None else trainer_ends
        return scheduler.outcome(end)
