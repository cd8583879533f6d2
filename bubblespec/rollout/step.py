"""One step's rollout across ranks, with bubble-time drafting of the next step (docs/design.md §5).

The pieces every rank pool shares live here: the requests of a step, the drafting plan, and the per-rank
record of what happened. :mod:`bubblespec.rollout.bubble_scheduler` decides which rank does what with them; the virtual
clock (:mod:`bubblespec.rollout.virtual_ranks`) and Ray Serve (:mod:`bubblespec.rollout.serve_ranks`) run its decisions.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pydantic

from bubblespec.core.interfaces import (
    Draft,
    GenerationRequest,
    GenerationResult,
    Prompt,
    RolloutKey,
    SamplingParams,
)

if TYPE_CHECKING:
    from bubblespec.models.draft_head import HeadLearningReport
    from bubblespec.rollout.tries_plan import TriesPlan


def step_requests(
    prompts: Sequence[Prompt], run_seed: int, step: int, samples_per_prompt: int, sampling: SamplingParams
) -> list[GenerationRequest]:
    """Every request of one step, in a fixed order: prompt by prompt, sample by sample."""
    return [
        GenerationRequest(tuple(prompt.token_ids), RolloutKey(run_seed, step, prompt.uid, sample), sampling)
        for prompt in prompts
        for sample in range(samples_per_prompt)
    ]


def attach_drafts(requests: Sequence[GenerationRequest], drafts: dict[RolloutKey, Draft]) -> list[GenerationRequest]:
    return [dataclasses.replace(r, draft=drafts.get(r.key)) for r in requests]


def drafts_from(results: Sequence[GenerationResult], policy_version: int) -> list[Draft]:
    """Drafts from (possibly partial) responses of the drafting policy; empty ones are dropped. A response the
    barrier stopped makes an unfinished draft, which a later bubble may continue. Where the engine reported margins
    the draft keeps its near-ties (draft tries)."""
    return [
        Draft(r.key, tuple(r.token_ids), policy_version, r.finish_reason != "preempted", r.near_ties())
        for r in results
        if r.token_ids
    ]


def drafted_tokens(results: Sequence[GenerationResult]) -> int:
    """Tokens that drafting forward passes sampled: a continued draft's accepted old tokens and a branch's given
    prefix are not counted."""
    return sum(len(r.token_ids) - r.stats.draft_tokens_accepted - r.stats.given_tokens for r in results)


@pydantic.dataclasses.dataclass
class RankRecord:
    """What one rank did in one step (a row of the run's per-step JSONL)."""

    rank: int
    num_requests: int = 0
    shard_tokens: int = 0
    forward_passes: int = 0
    decode_steps: int = 0
    verify_steps: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    requests_with_draft: int = 0
    requests_with_proposals: int = 0
    """Requests that verified at least one proposed token, from their draft or from a dynamic draft source."""
    generation_seconds: float = 0.0
    bubble_seconds: float = 0.0
    drafting_seconds: float = 0.0
    draft_requests: int = 0
    draft_tokens_produced: int = 0
    branch_tokens_produced: int = 0
    """Tokens of branches (draft tries) the rank drafted, in its bubble and while the trainer trained (in the step
    record; those of the bubble are also in :attr:`draft_tokens_produced`)."""
    branches_followed: int = 0
    """Times its shard's responses left a draft's path onto one of the draft's branches (draft tries)."""
    head_tokens_proposed: int = 0
    head_tokens_accepted: int = 0
    """Of the draft tokens proposed and accepted, those the draft head drafted (``speculation.draft_head``)."""
    head_call_seconds: float | None = None
    """Of ``generation_seconds``, the draft head's calls' (charged by the virtual clock, timed by the torch engine on
    the wall clock; None without a head call)."""
    preemption_latency_seconds: float = 0.0
    acceptance_lengths: dict[int, int] = field(default_factory=dict)
    """Verify steps of this rank's shard by acceptance length."""
    seconds_saved_by_drafts: float | None = None
    """Its shard's generation seconds without drafts minus with them, an estimate
    (:mod:`bubblespec.rollout.speculation_effect`); negative when verifying drafts cost more than it saved."""
    drafting_seconds_while_training: float | None = None
    draft_tokens_produced_while_training: int | None = None
    """Its drafting while the trainer ran (speculation.draft_during_training only)."""
    slowest_response_decode_steps: int | None = None
    slowest_response_tokens: int | None = None
    slowest_response_draft_tokens: int | None = None
    """The shard's response with the most decode steps: its decode steps (a rank's batch waits for it, so they
    bound the rank's forward passes from below), its tokens and how many of them were accepted draft tokens (of any
    source). Its tokens not accepted from a draft were decoded one per forward pass. None: no response (or a step
    record written before these fields existed)."""
    slowest_response_draft_tokens_by_source: dict[str, int] | None = None
    """Of ``slowest_response_draft_tokens``, those of each draft-chain source (``GenerationStats.accepted_by_source``:
    ``request`` the bubble's or other static source's draft, a dynamic source's name, ``head``)."""

    def add_results(self, results: Sequence[GenerationResult], had_draft: Sequence[bool]) -> None:
        self.num_requests += len(results)
        self.requests_with_draft += sum(had_draft)
        for result in results:
            self.requests_with_proposals += result.stats.verify_steps > 0
            self.shard_tokens += len(result.token_ids)
            self.decode_steps += result.stats.decode_steps
            self.verify_steps += result.stats.verify_steps
            self.draft_tokens_proposed += result.stats.draft_tokens_proposed
            self.draft_tokens_accepted += result.stats.draft_tokens_accepted
            self.branches_followed += result.stats.branches_followed
            self.head_tokens_proposed += result.stats.head_tokens_proposed
            self.head_tokens_accepted += result.stats.head_tokens_accepted
            if result.stats.decode_steps > (self.slowest_response_decode_steps or -1):
                self.slowest_response_decode_steps = result.stats.decode_steps
                self.slowest_response_tokens = len(result.token_ids)
                self.slowest_response_draft_tokens = result.stats.draft_tokens_accepted
                self.slowest_response_draft_tokens_by_source = dict(result.stats.accepted_by_source)
            for length, count in result.stats.acceptance_lengths.items():
                self.acceptance_lengths[length] = self.acceptance_lengths.get(length, 0) + count

    @pydantic.field_serializer("acceptance_lengths")
    def _by_length(self, lengths: dict[int, int]) -> dict[int, int]:
        return dict(sorted(lengths.items()))

    @pydantic.computed_field
    @property
    def draft_coverage(self) -> float:
        return self.requests_with_draft / self.num_requests if self.num_requests else 0.0

    @pydantic.computed_field
    @property
    def bubble_utilization(self) -> float:
        return bubble_use([self])


@pydantic.dataclasses.dataclass(frozen=True)
class HeadLearningRecord:
    """One round of the draft head's online learning (``speculation.draft_head``, docs/design.md §14), after a
    step's rollout on that step's responses: what it learned from, its first and last loss, the seconds it took on
    the run's clock (the policy's passes that computed the hidden states and the AdamW steps), and of those the
    seconds the weight sync waited for it (all of them where it ran on hardware the trainer used; beside the trainer,
    what it added to the sync's wait beyond the other ranks' late drafting passes, its own rank's drafting after it
    included: part of the sync's seconds, not of the step's ``barrier_wait_seconds``, which are the drafts')."""

    rank: int
    responses: int
    pairs: int
    steps: int
    first_loss: float | None = None
    final_loss: float | None = None
    """None where the round took no step (not one fitted its budget); a step record leaves them out then."""
    seconds: float = 0.0
    wait_seconds: float = 0.0
    kept_responses: int = 0
    """Of ``responses``, those whose hidden states the learning rank kept from its rollout (no pass computed them
    again; the others' passes are in ``seconds``)."""
    sync_seconds: float = 0.0
    """What the weight sync after it spent sending the head to the other ranks."""


@dataclass(frozen=True)
class HeadRound:
    """A round of the draft head's online learning as the rank pool ran it (``RankPool.learn_head``, collected by
    ``RankPool.learned_head``): its seconds on the pool's clock, when it started (seconds from the trainer's start),
    the engine's report (``models.draft_head.HeadLearningReport``), and where the pool waited for it itself (the wall
    clock: once the trainer is done, or before it where the round does not run beside it) the seconds of that wait,
    None where the caller estimates it (the virtual clock, whose ``settle`` waits for it)."""

    seconds: float
    started: float
    report: HeadLearningReport
    waited: float | None = None


def bubble_use(ranks: Iterable[RankRecord]) -> float:
    """The one bubble utilisation figure: the ranks' seconds spent drafting in their bubbles over their bubble
    seconds (0 without a bubble). A step's is over its ranks; a run's (summary, report) over every rank of every step
    but the last, whose bubble has no later step to draft for."""
    ranks = list(ranks)
    bubble = sum(r.bubble_seconds for r in ranks)
    return sum(r.drafting_seconds for r in ranks) / bubble if bubble > 0 else 0.0


@dataclass
class RolloutOutcome:
    """What a rollout phase did; drafting while training reports in the same form, with no results."""

    results: list[GenerationResult]
    """One per request, in any order."""
    drafts: list[Draft]
    """Drafts made in the bubble for the next step."""
    ranks: list[RankRecord]
    seconds: float
    """Rollout phase length: until the last rank finished its shard and the ranks were told to stop drafting (a
    drafting pass still running then ends off the critical path: a late chunk)."""
    barrier_seconds: float = 0.0
    """When the last rank finished its shard."""
    timelines: list[list[tuple[str, float, float]]] = field(default_factory=list)
    """Per rank: (activity, start, end) with activity in generate, draft, idle; seconds from phase start."""
    late_wait_seconds: float = 0.0
    """Seconds the step waited after this phase for its late drafting passes, before a weight sync could start
    (part of that sync's seconds; the rank pool's ``settle``); not the draft head's learning (its record's
    ``wait_seconds``)."""
    late_chunks: int = 0
    """Drafting calls still running when the phase ended (late chunks): the keys they leave unfinished go back to
    the plan when they return."""

    @property
    def seconds_saved(self) -> float | None:
        """Rollout seconds the drafts saved (negative: cost), estimated (:mod:`bubblespec.rollout.speculation_effect`):
        without drafts the rollout ends at the replayed barrier (the slowest rank's generation less its saving);
        with them at the barrier, and the step also waits for drafting passes in flight (:attr:`drafting_wait_seconds`),
        a cost of drafting. None where a rank's saving was not estimated."""
        if not self.ranks or any(rank.seconds_saved_by_drafts is None for rank in self.ranks):
            return None
        without = max(rank.generation_seconds + rank.seconds_saved_by_drafts for rank in self.ranks)
        return without - self.barrier_seconds - self.drafting_wait_seconds

    @property
    def seconds_without_drafts(self) -> float | None:
        """The rollout's seconds as estimated without drafts (:attr:`seconds` plus :attr:`seconds_saved`): what a
        gate measures a saving against. None where the saving was not estimated."""
        saved = self.seconds_saved
        return None if saved is None else self.seconds + saved

    @property
    def drafting_wait_seconds(self) -> float:
        """Seconds the step waited for drafting passes in flight: from the barrier until the phase ended (when
        ranks drafted in the bubble), plus :attr:`late_wait_seconds`."""
        drafted = any(rank.drafting_seconds > 0 for rank in self.ranks)
        at_barrier = max(self.seconds - self.barrier_seconds, 0.0) if drafted else 0.0
        return at_barrier + self.late_wait_seconds


@dataclass(frozen=True)
class TrainingDrafting:
    """What the ranks drafted while the trainer trained (``speculation.draft_during_training``), as
    :meth:`RolloutService.training_ended <bubblespec.rollout.service.RolloutService.training_ended>` returns it: the
    step record reads it beside the rollout's outcome (the drafts themselves go to the draft store). Read from the
    drafting phase's outcome when asked, so that late chunks reported after the trainer's end are counted."""

    outcome: RolloutOutcome

    @property
    def drafts_made(self) -> int:
        return len(self.outcome.drafts)

    @property
    def drafting_seconds(self) -> list[float]:
        """Per rank."""
        return [rank.drafting_seconds for rank in self.outcome.ranks]

    @property
    def draft_tokens_produced(self) -> list[int]:
        """Per rank."""
        return [rank.draft_tokens_produced for rank in self.outcome.ranks]

    @property
    def branch_tokens_produced(self) -> list[int]:
        """Per rank: of :attr:`draft_tokens_produced`, those of branches (draft tries)."""
        return [rank.branch_tokens_produced for rank in self.outcome.ranks]

    @property
    def timelines(self) -> list[list[tuple[str, float, float]]]:
        """Per rank: (activity, start, end), seconds from the start of training."""
        return self.outcome.timelines


class DraftPlan:
    """The keys of later steps to draft, in bubble-policy order, handed out in chunks to idle ranks.

    A chunk is an equal share of the keys left per rank that may still take one (at most ``max_batch_size``
    keys): the first rank to fall idle does not take every key, and a rank that finishes its chunk early still finds
    work. A chunk holds its rank until its keys are drafted or the phase stops, so where no other rank will take
    one (the one rank drafting while the trainer trains; in a rollout of two ranks, the rank that finishes first:
    the other one is the barrier) the chunk is every key left, up to ``max_batch_size``.

    A request may carry an unfinished draft of its own key: the drafting rank then verifies that draft (one
    forward pass per ``max_draft_tokens_per_step`` tokens with the policy that made it) and goes on from its
    end, so a long response is drafted over several bubbles instead of restarting in each.

    With ``tries`` (draft tries, :mod:`bubblespec.rollout.tries_plan`), once every key of the tries' step (the next
    one) is handed out the chunks are branch requests of the drafts made so far, before the keys of later steps
    (lookahead): a branch pays in the next step, a later step's draft is refreshed before it is used. :meth:`drafts_of`
    merges what branch requests return into the keys' tries.
    """

    def __init__(
        self,
        requests: Sequence[GenerationRequest],
        num_ranks: int = 1,
        max_batch_size: int = 64,
        tries: TriesPlan | None = None,
    ) -> None:
        self._requests = list(requests)
        self._next = 0
        self.num_ranks = num_ranks
        self.max_batch_size = max_batch_size
        self.tries = tries
        self._policy_version = 0

    def is_branch(self, result: GenerationResult) -> bool:
        """Whether ``result`` answers a branch request of this plan's (not a key's own)."""
        return self.tries is not None and self.tries.is_branch(result)

    def drafts_of(self, results: Sequence[GenerationResult], policy_version: int) -> list[Draft]:
        """The drafts a drafting chunk's results make: a key's request its draft (:func:`drafts_from`), a branch
        request its key's grown trie."""
        if self.tries is None:
            return drafts_from(results, policy_version)
        keys = [r for r in results if not self.tries.is_branch(r)]
        made = drafts_from(keys, policy_version)
        self.tries.observe(made)
        return made + self.tries.merge([r for r in results if self.tries.is_branch(r)])

    def requeue(self, drafts: Sequence[Draft], keys: Sequence[RolloutKey] = ()) -> None:
        """Puts the keys of unfinished ``drafts`` back at the front of what is left, each with its draft, so
        that the next phase that drafts from this plan (drafting during training) continues them; and those of
        ``keys`` (a chunk's) that made no draft at all (stopped before its first pass) as they were handed out."""
        handed_out = {r.key: r for r in self._requests[: self._next]}
        drafted = {d.key for d in drafts}
        again = [
            dataclasses.replace(handed_out[d.key], draft=d) for d in drafts if not d.finished and d.key in handed_out
        ] + [handed_out[key] for key in keys if key not in drafted and key in handed_out]
        self._requests[self._next : self._next] = again

    def take(self, takers: int | None = None, policy_version: int = 0) -> list[GenerationRequest]:
        """The next chunk: a ``takers``-th (default: ``num_ranks``) of the keys left; once every key is handed
        out, branch requests for ranks holding ``policy_version`` (a ``takers``-th of a batch)."""
        self._policy_version = policy_version
        if self._branches_next(policy_version):
            size = max(1, -(-self.max_batch_size // (takers or self.num_ranks)))
            return self.tries.take(size, policy_version)  # type: ignore[union-attr]
        remaining = len(self._requests) - self._next
        size = max(1, min(self.max_batch_size, -(-remaining // (takers or self.num_ranks))))
        chunk = self._requests[self._next : self._next + size]
        self._next += len(chunk)
        return chunk

    def __bool__(self) -> bool:
        return self._next < len(self._requests)

    def _branches_next(self, policy_version: int) -> bool:
        """Whether the next chunk is branches: no key of the tries' step is left, and a branch is."""
        if self.tries is None or any(r.key.step == self.tries.step for r in self._requests[self._next :]):
            return False
        return self.tries.available(policy_version)

    def has_work(self, policy_version: int | None = None) -> bool:
        """Keys left, or branch requests for ranks holding ``policy_version`` (None: the version the plan was last
        asked for, the ranks' since: weights change between steps, not between a step's phases)."""
        if policy_version is None:
            policy_version = self._policy_version
        self._policy_version = policy_version
        return bool(self) or (self.tries is not None and self.tries.available(policy_version))


def rollout_digest(results: list[GenerationResult]) -> str:
    """A fingerprint of a step's rollouts (keys and tokens, in request order): equal digests, equal rollouts."""
    digest = hashlib.sha256()
    for result in results:
        key = result.key
        digest.update(f"{key.run_seed}/{key.step}/{key.prompt_uid}/{key.sample_index}:".encode())
        digest.update(",".join(map(str, result.token_ids)).encode() + b";")
    return digest.hexdigest()
