"""The bubble scheduler (docs/design.md §5): which rank does what, and when, in a phase of a step. Both clocks run it.

A phase is either a step's **rollout** or **drafting while the trainer trains**:

    rollout    every rank generates its shard; a rank that finishes early takes chunks of the drafting plan
               (:class:`~bubblespec.rollout.step.DraftPlan`) until the barrier (the moment the last shard is done),
               when every rank is told to stop and each chunk in flight returns its partial drafts
    training   every rank takes chunks of the rest of the plan until :meth:`PhaseScheduler.stop`

:class:`PhaseScheduler` makes every decision and keeps every record (:class:`~bubblespec.rollout.step.RankRecord`,
timelines, drafts, the live activity feed). It does no I/O and reads no clock: a *driver* starts the calls it asks
for (:class:`Generate`, :class:`DraftChunk`, :class:`StopDrafting`) and reports each call's return with the time on
its own clock, in seconds from the phase start. The virtual clock's driver
(:class:`bubblespec.rollout.virtual_ranks.VirtualRankPool`) reports simulated seconds, the Ray Serve driver
(:class:`bubblespec.rollout.serve_ranks.ServeRankPool`) real ones. Given the same durations, both get the same
decisions.

Rules, for a reader who wants them in one place:

- The first idle rank takes the next chunk (:meth:`DraftPlan.take`: an equal share of the keys left per rank that
  may still take one, the rank that finishes a rollout last excepted).
- No chunk is handed out at or after the barrier (rollout) or the stop (training); calls that return together are
  taken shards first, so a rank that falls idle exactly at the barrier stays idle.
- The phase ends at the barrier (rollout) or the stop (training): the step goes on at once. A drafting call still
  in flight then is *late*: it returns after its current forward pass, off the step's critical path (the rank
  finishes that pass while the trainer trains), and the driver reports it later (``settle``); its drafts and
  figures join the phase's outcome then. A drafting call's time counts towards bubble use only up to the barrier (or
  stop); the time it runs past it is the rank's preemption latency.
- A drafting call lost with its rank (the replica died) costs its chunk's drafts only; the rank takes no more chunks
  in this phase. A lost shard is retried on the rank's replacement up to :attr:`RetryPolicy.max_retries` times
  (keyed sampling makes the retried shard's tokens those of the lost one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from bubblespec.core.interfaces import Draft, GenerationRequest, GenerationResult, RolloutKey
from bubblespec.rollout.step import DraftPlan, RankRecord, RolloutOutcome, drafted_tokens

ActivityListener = Callable[[int, str, str], None]
"""Told (rank, activity, detail) as ranks start generating ("generate"), draft ("draft"), fall idle ("idle") or get
a new replica (:data:`REPLACED`): the live display and the metrics."""
REPLACED = "replaced"
"""The activity a rank pool reports when a rank's replica died and its replacement holds the policy again."""


@dataclass(frozen=True, slots=True)
class Generate:
    """Start generating ``requests`` (the rank's shard) on ``rank``; report with :meth:`PhaseScheduler.shard_done`."""

    rank: int
    requests: tuple[GenerationRequest, ...]


@dataclass(frozen=True, slots=True)
class DraftChunk:
    """Start drafting ``requests`` on ``rank`` until the phase's stop; report with :meth:`PhaseScheduler.chunk_done`
    (or :meth:`PhaseScheduler.chunk_lost`)."""

    rank: int
    requests: tuple[GenerationRequest, ...]


@dataclass(frozen=True, slots=True)
class StopDrafting:
    """Tell every rank to stop drafting: each chunk in flight returns after its current forward pass."""

    at: float


Command = Generate | DraftChunk | StopDrafting


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """What a driver does when a rank's replica dies under a call: restore the rank (its replacement gets the current
    policy) and call again, at most ``max_retries`` times."""

    max_retries: int = 3

    def retry(self, attempt: int) -> bool:
        """Whether a call that failed on its ``attempt``-th try (0 first) is tried again."""
        return attempt < self.max_retries


def ignore_activity(rank: int, activity: str, detail: str) -> None:
    pass


class PhaseScheduler:
    """The decisions and records of one phase.

    ``shards`` (one per rank) makes a rollout phase; ``None`` makes a drafting-while-training phase. ``policy_version``
    is the version the ranks hold, which the drafts they make are stamped with.
    """

    def __init__(
        self,
        num_ranks: int,
        plan: DraftPlan,
        policy_version: int,
        shards: Sequence[Sequence[GenerationRequest]] | None = None,
        on_activity: ActivityListener = ignore_activity,
        drafting_ranks: int | None = None,
    ) -> None:
        if shards is not None and len(shards) != num_ranks:
            raise ValueError(f"{len(shards)} shards for {num_ranks} ranks")
        self.num_ranks = num_ranks
        self.drafting_ranks = num_ranks if drafting_ranks is None else drafting_ranks
        """Ranks 0 to this one less take chunks (``speculation.draft_during_training`` as a number of ranks); all by
        default."""
        self.plan = plan
        self.policy_version = policy_version
        self.shards = None if shards is None else [list(shard) for shard in shards]
        self.on_activity = on_activity
        self.records = [RankRecord(rank) for rank in range(num_ranks)]
        self.timelines: list[list[tuple[str, float, float]]] = [[] for _ in range(num_ranks)]
        self.results: dict[RolloutKey, GenerationResult] = {}
        self.stopped_at: float | None = None
        """The barrier (rollout) or the stop (training): when the ranks were told to stop drafting."""
        self._generating = set() if shards is None else set(range(num_ranks))
        self._drafting: dict[int, tuple[float, int]] = {}
        """Ranks drafting a chunk: its start and its place in :attr:`_chunks`."""
        self._chunks: list[list[Draft]] = []
        """The drafts of each chunk, in the order the chunks were handed out."""
        self._outcome: RolloutOutcome | None = None
        self.late_drafts: list[Draft] = []
        """Drafts of chunks that returned after the phase's outcome was taken (late chunks)."""

    @property
    def is_rollout(self) -> bool:
        return self.shards is not None

    @property
    def in_flight(self) -> bool:
        """Whether some rank still runs a call of this phase."""
        return bool(self._generating or self._drafting)

    @property
    def ended(self) -> bool:
        """Whether the phase is over for the step: every shard is back and the ranks were told to stop. Drafting
        calls still running are late; the driver may take the :meth:`outcome` and report them afterwards."""
        return not self._generating and self.stopped_at is not None

    def start(self) -> list[Command]:
        """The phase's first calls: every shard (rollout), or a chunk for every rank (training)."""
        if self.shards is not None:
            for rank, shard in enumerate(self.shards):
                with_draft = sum(r.draft is not None for r in shard)
                self.on_activity(rank, "generate", f"{len(shard)} requests, {with_draft} with a draft")
            return [Generate(rank, tuple(shard)) for rank, shard in enumerate(self.shards)]
        return [command for rank in range(self.num_ranks) for command in self._hand_out(rank, 0.0, "while training")]

    def shard_done(
        self,
        rank: int,
        now: float,
        results: Sequence[GenerationResult],
        forward_passes: int,
        seconds_saved: float | None = None,
        head_call_seconds: float | None = None,
    ) -> list[Command]:
        """``rank`` returned its shard at ``now`` after ``forward_passes`` forward passes; its drafts saved
        ``seconds_saved`` (an estimate, negative when they cost time; None: not estimated), and its draft-head calls
        took ``head_call_seconds`` of it (None: none, or not measured)."""
        assert self.shards is not None and rank in self._generating, f"rank {rank} has no shard running"
        self._generating.discard(rank)
        self.results |= {r.key: r for r in results}
        record = self.records[rank]
        record.add_results(results, [r.draft is not None for r in self.shards[rank]])
        record.generation_seconds = now
        record.forward_passes = forward_passes
        record.seconds_saved_by_drafts = seconds_saved
        record.head_call_seconds = head_call_seconds
        self.timelines[rank].append(("generate", 0.0, now))
        tokens = sum(len(r.token_ids) for r in results)
        self.on_activity(rank, "idle", f"shard done at {now:.1f}s: {tokens} tokens, {forward_passes} passes")
        if not self._generating:
            return self._stop(now)  # the barrier
        return self._hand_out(rank, now, "in the bubble")

    def chunk_done(self, rank: int, now: float, results: Sequence[GenerationResult]) -> list[Command]:
        """``rank`` returned its drafting chunk at ``now`` (unfinished responses where the stop cut them off)."""
        began, chunk = self._drafting.pop(rank)
        keys = [r.key for r in results if not self.plan.is_branch(r)]
        branches = [r for r in results if self.plan.is_branch(r)]
        made = self.plan.drafts_of(results, self.policy_version)
        self._chunks[chunk] = made
        record = self.records[rank]
        record.draft_requests += len(made)
        record.draft_tokens_produced += drafted_tokens(results)
        record.branch_tokens_produced += drafted_tokens(branches)
        record.drafting_seconds += min(now, self._stop_time) - began
        if self.stopped_at is not None and now > self.stopped_at:
            record.preemption_latency_seconds = now - self.stopped_at
        self.timelines[rank].append(("draft", began, now))
        self.on_activity(rank, "idle", f"{len(made)} drafts, {drafted_tokens(results)} tokens")
        if self._outcome is not None:  # a late chunk: its drafts join the outcome taken at the stop, and the keys it
            self.late_drafts += made  # left unfinished go back to the plan for the next phase that drafts from it
            self._outcome.drafts[:] = self._all_drafts()
            self.plan.requeue(made, keys)
        return self._hand_out(rank, now, "in the bubble" if self.is_rollout else "while training")

    def chunk_lost(self, rank: int, now: float, error: BaseException) -> list[Command]:
        """``rank``'s replica died while drafting: its chunk's drafts are lost, and the rank drafts no more in this
        phase (its next shard call restores it)."""
        began, _ = self._drafting.pop(rank)
        self.timelines[rank].append(("draft", began, now))
        self.on_activity(rank, "idle", f"lost its replica while drafting: {type(error).__name__}")
        return []

    def stop(self, now: float) -> list[Command]:
        """The trainer finished at ``now`` (training phase): no more chunks; the ranks drafting are told to stop."""
        assert not self.is_rollout, "a rollout phase stops at its barrier"
        return self._stop(now) if self.stopped_at is None else []

    def outcome(self, end: float) -> RolloutOutcome:
        """What the phase did; ``end``: when the driver ended the phase (seconds from the phase start), at once
        after the barrier or stop. A rollout lasts until ``end``, its ranks idle from their last call on, except
        those still drafting (late chunks); drafting while training lasts as long as the trainer did (until the
        stop). A late chunk reported afterwards adds its drafts, records and timeline to this same outcome."""
        assert self.ended or not self.in_flight, "the phase still has shards running, or was not stopped"
        barrier = self.stopped_at if self.stopped_at is not None else end
        if not self.is_rollout:
            end = barrier
        else:
            for rank, (record, timeline) in enumerate(zip(self.records, self.timelines, strict=True)):
                record.bubble_seconds = barrier - record.generation_seconds
                busy_until = timeline[-1][2] if timeline else 0.0
                if busy_until < end and rank not in self._drafting:
                    timeline.append(("idle", busy_until, end))
        self._outcome = RolloutOutcome(
            list(self.results.values()),
            self._all_drafts(),
            self.records,
            end,
            barrier,
            self.timelines,
            late_chunks=len(self._drafting),
        )
        return self._outcome

    def _all_drafts(self) -> list[Draft]:
        return [draft for chunk in self._chunks for draft in chunk]

    @property
    def _takers(self) -> int:
        """The ranks that may take a chunk in this phase: those that draft, less the one that finishes its shard
        last in a rollout (the barrier: it never drafts)."""
        if not self.is_rollout:
            return max(self.drafting_ranks, 1)
        return max(1, min(self.drafting_ranks, self.num_ranks - 1))

    @property
    def _stop_time(self) -> float:
        return float("inf") if self.stopped_at is None else self.stopped_at

    def _stop(self, now: float) -> list[Command]:
        self.stopped_at = now
        return [StopDrafting(now)]

    def _hand_out(self, rank: int, now: float, when: str) -> list[Command]:
        """The next chunk of the plan to ``rank``, idle at ``now``; none after the stop or when the plan is done."""
        if self.stopped_at is not None or not self.plan.has_work(self.policy_version) or rank >= self.drafting_ranks:
            if not self.is_rollout:
                self.on_activity(rank, "idle", "")
            return []
        chunk = self.plan.take(self._takers, self.policy_version)
        self.on_activity(rank, "draft", _chunk_detail(chunk, when))
        self._drafting[rank] = (now, len(self._chunks))
        self._chunks.append([])
        return [DraftChunk(rank, tuple(chunk))]


def _chunk_detail(chunk: Sequence[GenerationRequest], when: str) -> str:
    steps = sorted({r.key.step for r in chunk})
    if any(r.response_prefix for r in chunk):
        return f"branches of {len(chunk)} keys of step {', '.join(map(str, steps))} {when}"
    going_on = sum(r.draft is not None for r in chunk)
    return f"{len(chunk)} keys of step {', '.join(map(str, steps))} {when}" + (
        f" ({going_on} going on from a draft)" if going_on else ""
    )


class RankPool(Protocol):
    """The rollout ranks of a run, as the rollout service drives them: a driver of :class:`PhaseScheduler` on one
    clock (:class:`bubblespec.rollout.virtual_ranks.VirtualRankPool`,
    :class:`bubblespec.rollout.serve_ranks.ServeRankPool`)."""

    num_ranks: int
    context_length: int | None
    """The ranks' engines' :attr:`~bubblespec.core.interfaces.Engine.context_length` (None: not known here)."""
    on_activity: ActivityListener
    """Told (rank, activity, detail) as the scheduler decides: the live display. :func:`ignore_activity` by default."""
    head_wait_seconds: float
    """Of the last :meth:`settle`'s wait, what a draft head's learning beside the trainer added (0 without one)."""
    head_synced_seconds: float | None
    """What the last :meth:`update_weights` spent sending a learned draft head to the other ranks, where the pool
    measures it (the wall clock); None where :meth:`head_sync_seconds` charges it beforehand (the virtual clock)."""

    def rollout(self, shards: Sequence[Sequence[GenerationRequest]], plan: DraftPlan) -> RolloutOutcome:
        """A step's rollout phase: every rank generates its shard, idle ranks draft ``plan`` until the barrier."""
        ...

    def update_weights(self, state_dict, version: int) -> float:
        """Sends weights to every rank; returns the seconds it took (virtual or wall)."""
        ...

    def learn_head(self, samples, learning, beside: bool = True, budget: float | None = None) -> None:
        """Starts the draft head's online learning on a rollout's responses (``speculation.draft_head``), on the last
        rank, as the trainer starts. ``beside`` the trainer (ranks on hardware of their own) it runs while the trainer
        trains; otherwise before, on the step. ``budget``: the most seconds it may take (fewer AdamW steps; on the
        virtual clock, none where not one fits)."""
        ...

    def learned_head(self) -> Any:
        """The round :meth:`learn_head` started, once the trainer is done (``rollout.step.HeadRound``): the wall
        clock waits for it here, the virtual clock's :meth:`settle` where it outlasts the trainer."""
        ...

    def head_sync_seconds(self) -> float:
        """What the next weight sync spends sending the draft head learned since the last one to the other ranks (the
        wall clock: what the last one spent)."""
        ...

    def pause_head(self) -> None:
        """The ranks draft without the draft head until its next round of learning, and the next weight sync does not
        send it (``draft_head.enabled: auto``)."""
        ...

    def keep_hidden_states(self, keep: bool) -> None:
        """Whether in the next rollouts the rank that learns the head keeps its responses' hidden states (learning
        from them then runs no pass of the policy again)."""
        ...

    def head_step_cost(self, window: int) -> float:
        """A draft-head step's cost (attending ``window`` pairs) over a decode pass's on this pool's clock (what
        sizes the head's proposals)."""
        ...

    def draft_head_state(self) -> dict | None:
        """The learned head's parameters and optimizer state, for a checkpoint (None: none learned yet)."""
        ...

    def load_draft_head_state(self, state: dict | None, learning) -> None:
        """Back to :meth:`draft_head_state`'s ``state`` (None: no head)."""
        ...

    def start_drafting(self, plan: DraftPlan, ranks: int | None = None) -> None:
        """Ranks draft the rest of ``plan`` while the trainer runs: the first ``ranks`` of them (None: all;
        :meth:`ServiceConfig.training_drafting` says how many)."""
        ...

    def stop_drafting(self, train_seconds: float) -> RolloutOutcome:
        """Stops that drafting (the virtual clock budgets it by ``train_seconds``); returns the drafts made, with
        per-rank records and timelines (seconds from the start of training) and no results."""
        ...

    def settle(self, elapsed: float = 0.0) -> tuple[list[Draft], float]:
        """Waits for the drafting calls still running from ended phases (late chunks: their drafts, records and
        timelines join those phases' outcomes); returns their drafts and the seconds this waited (the virtual clock:
        what is left of them ``elapsed`` seconds after the last phase's end)."""
        ...

    def release(self) -> None:
        """Every rank's engine frees its generation memory (``GenerationEngine.release``): the trainer shares the
        hardware."""
        ...

    def resume(self) -> None:
        """Undo :meth:`release`."""
        ...

    def evaluate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Generates held-out requests with the current weights (no drafts, not timed)."""
        ...

    def placement(self) -> list[dict]:
        """Where each rank runs (node, GPUs, releases), for the run's summary; [] where that says nothing (one
        process on the virtual clock)."""
        ...
