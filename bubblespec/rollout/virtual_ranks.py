"""Rollout ranks on the virtual clock (docs/design.md §6): every rank in this process, on simulated time.

Ranks hold identical weights, so one engine serves them all in turn. Each rank has a
:class:`~bubblespec.rollout.clocks.VirtualClock` that the forward passes it runs advance by their cost. The pool is a
driver of :class:`~bubblespec.rollout.bubble_scheduler.PhaseScheduler`: it runs the calls the scheduler asks for and
reports each return at its simulated time, earliest first, so that the scheduler decides exactly as it does on Ray
Serve.

A shard's length does not depend on what other ranks do, so the pool simulates every shard when the phase starts
and knows the barrier (the last shard's end) before any drafting chunk runs; a chunk runs until its rank's time
reaches that barrier (or the trainer's end), as a real rank runs until it is told to stop.

The phase ends at the barrier (or the trainer's end), as on Ray Serve: a chunk whose last forward pass runs past it
is late, reported by :meth:`VirtualRankPool.settle`. Its rank is busy until that pass ends: drafting while the
trainer trains starts there on that rank, and a weight sync that comes sooner waits for it (``settle`` says how
long), as a real rank's engine finishes its pass before it takes new weights.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

from bubblespec.core.interfaces import Engine, GenerationRequest, GenerationResult
from bubblespec.models.draft_head import (
    HeadLearning,
    HeadLearningReport,
    Sample,
    hidden_passes,
    trained_pairs_by_step,
)
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
from bubblespec.rollout.step import DraftPlan, HeadRound, RolloutOutcome

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
        self._training_plan, self._training_ranks = DraftPlan([]), None
        self._late: list[tuple[PhaseScheduler, list, float]] = []
        """Phases with late chunks: the scheduler, the chunks' returns (a heap) and the phase's end."""
        self._late_drafts: list = []
        """Drafts of late chunks reported but not yet handed to :meth:`settle`'s caller."""
        self._busy_until = [0.0] * num_ranks
        """Per rank, how far past the last rollout's barrier its late drafting pass runs."""
        self._head_until = 0.0
        """Where a draft head learns beside the trainer: when it is done, in seconds from the last phase's end (the
        rollout's, then the training phase's): :meth:`settle` waits for it."""
        self._head_bytes = 0
        """The draft head learned since the last weight sync (its own parameters, bfloat16): the sync sends it."""
        self._keeps_hidden = False
        """Whether the rank that learns the head keeps its responses' hidden states (:meth:`keep_hidden_states`)."""
        self.head_synced_seconds: float | None = None
        """None: the head's sync is charged from the profile (:meth:`head_sync_seconds`), not measured."""
        self._learned: HeadRound | None = None
        """The round :meth:`learn_head` ran, until :meth:`learned_head` collects it."""
        self.head_wait_seconds = 0.0
        """Of the last :meth:`settle`'s wait, what the draft head's learning added: the wait beyond the late passes of
        the ranks that do not learn it (its own rank's drafting waits for it)."""

    def update_weights(self, state_dict, version: int) -> float:
        """The new policy to every rank; a draft head learned since the last sync also goes from its rank to the
        others (:meth:`CostProfile.head_sync_seconds`)."""
        self.engine.update_weights(state_dict, version)
        state_bytes = sum(tensor.numel() * tensor.element_size() for tensor in state_dict.values())
        head_seconds, self._head_bytes = self.head_sync_seconds(), 0
        return self.profile.weight_sync_seconds(state_bytes, self.num_ranks) + head_seconds

    def head_sync_seconds(self) -> float:
        """What the next weight sync spends sending the head learned since the last one to the other ranks."""
        head = self._head_bytes
        return self.profile.head_sync_seconds(head, self.num_ranks - 1) if head else 0.0

    def pause_head(self) -> None:
        """The ranks draft without the head until its next round of learning (the engine's ``pause_draft_head``);
        the next weight sync does not send it."""
        self.engine.pause_draft_head()
        self._head_bytes = 0

    def learn_head(
        self, samples: Sequence[Sample], learning: HeadLearning, beside: bool = True, budget: float | None = None
    ) -> None:
        """The draft head's online learning on ``samples`` (docs/design.md §14), on the last rank, as the trainer
        starts; :meth:`learned_head` says its simulated seconds (the policy's passes over the responses whose hidden
        states it did not keep, :meth:`keep_hidden_states`, on the profile, then the AdamW steps,
        :meth:`CostProfile.head_learning_seconds`), when it started (seconds from the trainer's start: after
        the rank's late drafting pass, if any) and the engine's report. ``beside`` the trainer (the ranks have
        hardware of their own), that rank's drafting while the trainer trains starts once it is done, and the next
        :meth:`settle` waits for it as for a late drafting pass; otherwise the caller charges it. The next weight
        sync also sends the head to the other ranks. ``budget``: its seconds at most (:meth:`_head_round`)."""
        samples, steps = self._head_round(samples, learning, budget)
        learning = dataclasses.replace(learning, steps=steps)
        started = self._busy_until[-1]
        if learning.steps == 0:  # not one step fits: no learning this round
            self._learned = HeadRound(0.0, started, HeadLearningReport.nothing())
            return
        report = self.engine.learn_draft_head(samples, learning)
        seconds = sum(self.profile.forward_seconds(p) for p in report.hidden_passes)
        seconds += self.profile.head_learning_seconds(report.trained_pairs, report.steps, learning.window)
        if beside:
            self._busy_until[-1] += seconds
            self._head_until = started + seconds
        self._head_bytes = 0 if self.engine.draft_head is None else 2 * self.engine.draft_head.num_parameters
        self._learned = HeadRound(seconds, started, report)

    def learned_head(self) -> HeadRound:
        """The round :meth:`learn_head` ran (on this clock it is done when that returns)."""
        learned, self._learned = self._learned, None
        return learned

    def keep_hidden_states(self, keep: bool) -> None:
        """Whether in the next rollouts the rank that learns the head (the last) keeps the hidden states of the
        responses it generates, so that learning from them runs no pass of the policy again."""
        self._keeps_hidden = keep

    def _head_round(
        self, samples: Sequence[Sample], learning: HeadLearning, budget: float | None
    ) -> tuple[list[Sample], int]:
        """The responses and AdamW steps of a round that fits ``budget``: those whose hidden states the learning
        rank kept first (its own: no pass computes them again), then the others; of all of them, the first half, and
        so on down to one step's responses, the ones with the most steps that fit (:meth:`_head_steps`), the most
        responses among those (the passes that compute the others' hidden states are what grows with them: on
        bench-long 32 passes over 63,569 tokens outlast the trainer)."""
        samples = [sample for sample in samples if len(sample[1])]
        kept = self.engine.hidden_kept(samples) if self._keeps_hidden else [False] * len(samples)
        ordered = [s for s, k in zip(samples, kept, strict=True) if k]
        ordered += [s for s, k in zip(samples, kept, strict=True) if not k]
        best, count = (None, 0), len(ordered)
        while True:
            chosen = ordered[:count]
            steps = self._head_steps(chosen, min(count, kept.count(True)), learning, budget)
            if steps > best[1] or best[0] is None:
                best = (chosen, steps)
            if steps == learning.steps or count <= learning.rows_per_step:
                return best
            count = max(count // 2, learning.rows_per_step)

    def _head_steps(
        self, samples: Sequence[Sample], num_kept: int, learning: HeadLearning, budget: float | None
    ) -> int:
        """The most of ``learning.steps`` AdamW steps whose charge, after the hidden-state passes (over the samples
        after the first ``num_kept``), fits ``budget`` simulated seconds (None: all of them; 0 where not even the
        passes and one step fit)."""
        if budget is None:
            return learning.steps
        passes = sum(self.profile.forward_seconds(p) for p in hidden_passes(samples[num_kept:]))
        lengths = [len(response) for _, response, _ in samples if len(response)]
        steps, trained = 0, 0
        for pairs in trained_pairs_by_step(lengths, learning.steps, learning.rows_per_step):
            trained += pairs
            if passes + self.profile.head_learning_seconds(trained, steps + 1, learning.window) > budget:
                break
            steps += 1
        return steps

    def head_step_cost(self, window: int) -> float:
        """A draft-head step's cost in decode passes on the profile (:meth:`CostProfile.head_step_cost`)."""
        return self.profile.head_step_cost(window)

    def draft_head_state(self) -> dict | None:
        return self.engine.draft_head_state()

    def load_draft_head_state(self, state: dict | None, learning: HeadLearning) -> None:
        self.engine.load_draft_head_state(state, learning)

    def release(self) -> None:
        self.engine.release()

    def resume(self) -> None:
        self.engine.resume()

    def placement(self) -> list[dict]:
        return []

    def evaluate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Each rank generates every ``num_ranks``-th request, as the Ray Serve ranks do."""
        results = {}
        for rank in range(min(self.num_ranks, len(requests))):
            self.engine.select_rank(rank)
            results |= {r.key: r for r in self.engine.generate(requests[rank :: self.num_ranks])}
        return [results[r.key] for r in requests]

    def rollout(self, shards: Sequence[Sequence[GenerationRequest]], plan: DraftPlan) -> RolloutOutcome:
        scheduler = PhaseScheduler(self.num_ranks, plan, self.engine.policy_version, shards, self.on_activity)
        return self._run(scheduler, trainer_ends=None)

    def start_drafting(self, plan: DraftPlan, ranks: int | None = None) -> None:
        self._training_plan, self._training_ranks = plan, ranks

    def stop_drafting(self, train_seconds: float) -> RolloutOutcome:
        """Every rank drafts the rest of the plan for the training phase's ``train_seconds``, a rank with a late
        pass from the rollout once that pass is over (its keys left unfinished go on in this phase)."""
        self._report_late()
        self._head_until -= train_seconds  # from this phase's end on
        scheduler = PhaseScheduler(self.num_ranks, self._training_plan, self.engine.policy_version,
                                   on_activity=self.on_activity, drafting_ranks=self._training_ranks)  # fmt: skip
        return self._run(scheduler, trainer_ends=train_seconds)

    def settle(self, elapsed: float = 0.0) -> tuple[list, float]:
        """Reports the late chunks of earlier phases (their drafts join those phases' outcomes); returns their
        drafts and the simulated seconds a caller ``elapsed`` seconds after the last phase's end waits for them."""
        late, others = self._report_late()
        head, self._head_until = self._head_until, 0.0  # a head learning past the phase's end too
        waited = max(max(late, head) - elapsed, 0.0)
        self.head_wait_seconds = waited - max((others if head > 0 else late) - elapsed, 0.0)
        drafts, self._late_drafts = self._late_drafts, []
        return drafts, waited

    def _report_late(self) -> tuple[float, float]:
        """Reports every late chunk; returns how far the latest ran past its phase's end, and the latest of the
        ranks that do not learn the draft head (the last does)."""
        lateness = others = 0.0
        for scheduler, returns, end in self._late:
            while returns:
                now, _, rank, _, _, results = heapq.heappop(returns)
                scheduler.chunk_done(rank, now, results)
                lateness = max(lateness, now - end)
                others = max(others, now - end) if rank != self.num_ranks - 1 else others
            self._late_drafts += scheduler.late_drafts
        self._late = []
        return lateness, others

    def _run(self, scheduler: PhaseScheduler, trainer_ends: float | None) -> RolloutOutcome:
        starts = [0.0] * self.num_ranks if trainer_ends is None else self._busy_until
        timelines = [VirtualClock(self.profile, start) for start in starts]
        returns: list[tuple[float, int, int, int, float, list[GenerationResult]]] = []
        """Calls that have run, by the simulated time they return: (time, kind, rank, forward passes, seconds the
        drafts saved, results)."""
        stop_at = trainer_ends
        head_calls = [0.0] * self.num_ranks
        """Per rank, the seconds of its shard's draft-head calls."""

        def run(commands: list[Command]) -> None:
            for command in commands:
                if isinstance(command, StopDrafting):
                    assert command.at == stop_at, f"the scheduler stopped at {command.at}, the pool at {stop_at}"
                    continue
                timeline = timelines[command.rank]
                self.engine.select_rank(command.rank)  # a draft source's memory is its own rank's
                if isinstance(command, Generate):
                    self.engine.keep_hidden = self._keeps_hidden and command.rank == self.num_ranks - 1
                    try:
                        results = self.engine.generate(list(command.requests), on_forward=timeline)
                    finally:
                        self.engine.keep_hidden = False
                    saved = seconds_saved(command.requests, results, timeline.now, self.max_batch_size,
                                          self.engine.vocab_size, self.profile.forward_seconds)  # fmt: skip
                    head_calls[command.rank] = timeline.head_seconds
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
        while returns and not scheduler.ended:
            now, kind, rank, passes, saved, results = heapq.heappop(returns)
            if rank < 0:
                run(scheduler.stop(now))
            elif kind == _SHARD:
                run(scheduler.shard_done(rank, now, results, passes, saved, head_calls[rank] or None))
            else:
                run(scheduler.chunk_done(rank, now, results))
        # the phase ends at the barrier (the trainer's end): chunks still running then, or returning at that very
        # time (reported after it), are late
        if returns:
            self._late.append((scheduler, returns, stop_at))
        if trainer_ends is None:
            self._busy_until = [max(t.now - stop_at, 0.0) for t in timelines]
        return scheduler.outcome(stop_at)
