"""Per-sequence decoding state shared by every backend: what to verify next, and what a verify step emitted.

A backend runs forward passes (or requests) its own way; for each sequence it asks :meth:`Sequence.propose` for
the draft tokens to score next, and hands back the keyed samples at the scored positions to
:meth:`Sequence.record`: ``samples[j]`` at the position of ``draft[j]`` and ``samples[len(draft)]`` right after the
draft (the *bonus* token, or the plain decode step's token when nothing was proposed). A sample may be ``None``:
the engine's top-K log-probabilities did not decide it (:func:`bubblespec.verify.verification.decide_keyed_samples`).
Then the accepted tokens before it are kept and the next pass decodes that position as one plain keyed token
before verification goes on; a chunk is never resubmitted unchanged.

The bookkeeping lives here once: the draft chunk (position alignment, suffix re-alignment after a mismatch,
dynamic draft sources), the adaptive proposal length, stop tokens and the length limit, and the per-request
stats (:class:`~bubblespec.core.interfaces.RequestStats`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Literal

import torch

from bubblespec.core.draft_sources import REQUEST_DRAFT, DynamicDraftSource, ProposalContext, source_class
from bubblespec.core.errors import RequestError
from bubblespec.core.interfaces import (
    DraftBranch,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    NearTie,
    RequestStats,
)
from bubblespec.verify import sampling
from bubblespec.verify.drafts import check_request, realign, stop_token_ids
from bubblespec.verify.margins import REPORTED_MARGIN_LIMIT, keyed_runner_up
from bubblespec.verify.tree import DraftTree
from bubblespec.verify.verification import accepted_length, decide_keyed_samples

Alignment = Literal["position", "suffix"]


@dataclass(frozen=True)
class ProposalSettings:
    """How a backend proposes draft tokens (its engine config's speculation settings)."""

    max_draft_tokens_per_step: int = 16
    adaptive_draft_length: bool = False
    draft_alignment: Alignment = "suffix"
    draft_chain: tuple[str, ...] = (REQUEST_DRAFT,)
    proposers: Mapping[str, object] = field(default_factory=dict)
    """Dynamic draft sources by name (see :func:`load_proposers`)."""
    source_options: Mapping[str, dict] = field(default_factory=dict)
    """The dynamic sources' constructor arguments, to build another rank's (:meth:`select_rank`)."""
    _by_rank: dict[int, dict[str, object]] = field(default_factory=dict, repr=False, compare=False)
    _rank: list[int] = field(default_factory=lambda: [0], repr=False, compare=False)
    draft_candidates: int = 1
    """Candidate continuations a sequence verifies per forward pass (:meth:`Sequence.propose_candidates`): 1
    takes the chain's first proposal; more verify several as one token tree (:mod:`bubblespec.verify.tree`),
    at most ``draft_candidates * max_draft_tokens_per_step`` tree tokens for the sequence predicted longest and one
    proposal's worth for the others (:func:`tree_budgets`)."""

    def observe(self, sequence: Sequence) -> None:
        """Shows a response that ended (finished, or stopped with tokens) to the dynamic sources that learn from
        responses (:meth:`~bubblespec.core.draft_sources.DynamicDraftSource.observe`)."""
        if sequence.tokens:
            for proposer in self.proposers.values():
                proposer.observe(sequence._context())

    @property
    def tree_budget(self) -> int:
        """Draft tokens a sequence may verify per forward pass, every candidate together."""
        return self.draft_candidates * self.max_draft_tokens_per_step

    @classmethod
    def of(cls, config) -> ProposalSettings:
        """The settings of an engine config with the common speculation fields (``max_draft_tokens_per_step``,
        ``adaptive_draft_length``, ``draft_alignment``, ``draft_chain``, ``draft_source_options``), the chain's
        dynamic sources loaded."""
        return cls(
            max_draft_tokens_per_step=config.max_draft_tokens_per_step,
            adaptive_draft_length=config.adaptive_draft_length,
            draft_alignment=config.draft_alignment,
            draft_chain=config.draft_chain,
            proposers=load_proposers(config.draft_chain, config.draft_source_options),
            source_options=config.draft_source_options,
            draft_candidates=config.draft_candidates,
        )

    def select_rank(self, rank: int) -> None:
        """From now on the dynamic sources of data-parallel rank ``rank`` (new ones for a rank not seen before),
        swapped into :attr:`proposers` in place so that every holder of these settings sees them
        (:meth:`~bubblespec.core.interfaces.Engine.select_rank`)."""
        if not self.proposers or rank == self._rank[0]:
            return
        self._by_rank[self._rank[0]] = dict(self.proposers)
        chosen = self._by_rank.get(rank) or load_proposers(self.draft_chain, self.source_options)
        self.proposers.clear()  # type: ignore[attr-defined]  # the dict of :meth:`of`
        self.proposers.update(chosen)  # type: ignore[attr-defined]
        self._rank[0] = rank


@dataclass
class Sequence:
    """Decoding state of one request."""

    index: int
    request: GenerationRequest
    max_new_tokens: int
    stop_ids: frozenset[int]
    noise_seed: tuple[int, int]  # the key's hash, computed once rather than at every forward pass
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    finish: FinishReason | None = None

    draft_offset: int = 0  # the draft token proposed for response position i is draft[i + draft_offset]
    proposal_limit: int | None = None  # adaptive proposal length; None: max_draft_tokens_per_step
    diverged: bool = False  # the request's draft mismatched and no suffix re-alignment was found (chains only)
    proposed_by: str = REQUEST_DRAFT  # which source proposed the last chunk
    decode_next: bool = False  # the top-K could not decide the next position: decode it plainly first
    # after an undecided position: (draft tokens from it on, samples at the positions after each, their logprobs)
    _held: tuple[list[int], list[int | None], list[float]] | None = field(default=None, repr=False)
    # the other samples of the same prompt and step in this generate call (group drafting)
    siblings: list[Sequence] = field(default_factory=list, repr=False, compare=False)
    # the request draft's path being followed (its tokens, then a branch's once the response took one), the branches
    # and near-ties off that path (draft tries, docs/design.md §13)
    path: tuple[int, ...] = ()
    branches: tuple[DraftBranch, ...] = field(default=(), repr=False)
    near_ties: tuple[NearTie, ...] = field(default=(), repr=False)
    # runner-ups and margins of the emitted tokens, where the request asked for them (GenerationRequest.margins)
    runner_up_ids: list[int] = field(default_factory=list, repr=False)
    margins: list[float] = field(default_factory=list, repr=False)

    @classmethod
    def admit(
        cls,
        index: int,
        request: GenerationRequest,
        vocab_size: int,
        context_length: int,
        eos_ids: Seq[int],
        reserve: int = 0,
        tries: bool = False,
    ) -> Sequence:
        """Checks one request before any work starts (a bad one fails the whole call with a clear error).
        ``reserve`` is context the engine keeps back beyond prompt + response (SGLang needs one position);
        ``tries``: the engine takes a response prefix (``Engine.supports_draft_tries``)."""
        check_request(index, request, vocab_size, context_length, reserve=reserve, tries=tries)
        prompt = request.prompt_token_ids
        draft = request.draft
        sequence = cls(
            index=index,
            request=request,
            max_new_tokens=min(request.sampling.max_new_tokens, context_length - len(prompt) - reserve),
            stop_ids=stop_token_ids(request.sampling, eos_ids),
            noise_seed=request.key.noise_seed(),
            path=() if draft is None else draft.token_ids,
            branches=() if draft is None else draft.branches,
            near_ties=() if draft is None else draft.near_ties,
        )
        sequence._start_with(request.response_prefix)
        return sequence

    def _start_with(self, prefix: Seq[int]) -> None:
        """Takes a response prefix (:attr:`GenerationRequest.response_prefix`) as the response's first tokens. One
        that fills the response's room, or ends with a stop token, leaves the response finished before any pass."""
        if not prefix:
            return
        if len(prefix) > self.max_new_tokens:
            raise RequestError(
                f"request {self.index} ({self.request.key}): a response prefix of {len(prefix)} tokens is longer "
                f"than the response may be ({self.max_new_tokens} tokens)"
            )
        stopping = [t for t in prefix[:-1] if t in self.stop_ids]
        if stopping:
            raise RequestError(
                f"request {self.index} ({self.request.key}): the response prefix holds stop tokens {stopping[:5]} "
                "before its last; a response ends at its first stop token, so nothing could follow them"
            )
        self.tokens = list(prefix)
        self.logprobs = [0.0] * len(prefix)
        self.stats.given_tokens = len(prefix)
        if self.request.margins:
            self.runner_up_ids, self.margins = [-1] * len(prefix), [float("inf")] * len(prefix)
        if prefix[-1] in self.stop_ids:
            self.finish = "stop"
        elif self.room <= 0:
            self.finish = "length"
        self._follow(0)

    @property
    def room(self) -> int:
        """Response tokens still allowed."""
        return self.max_new_tokens - len(self.tokens)

    def result(self, reason: FinishReason | None = None) -> GenerationResult:
        reason = reason or self.finish or "preempted"
        return GenerationResult(
            self.request.key, self.tokens, self.logprobs, reason, self.stats, self.runner_up_ids, self.margins
        )

    # -- proposing -----------------------------------------------------------------------------------------------

    def proposal_length(self, settings: ProposalSettings) -> int:
        """Tokens one proposal may hold: room is left for the sampled token that always follows them (0: the next
        pass decodes plainly). An engine that extends a proposal (a draft head) fills it up to this."""
        limit = settings.max_draft_tokens_per_step
        if self.proposal_limit is not None:
            limit = min(limit, self.proposal_limit)
        return 0 if self.decode_next else min(limit, self.room - 1)

    def propose(self, settings: ProposalSettings, request_only: bool = False) -> list[int]:
        """The draft tokens to score in the next pass: the first non-empty proposal of the draft chain
        (:meth:`_chain_proposals`; ``request_only``: of the request's draft alone), leaving room for the sampled token
        that always follows them. Empty for a plain decode step."""
        limit = self.proposal_length(settings)
        if limit <= 0:
            return []
        for name, chunk in self._chain_proposals(settings, limit, every=False, request_only=request_only):
            if chunk:
                self.proposed_by = name
                return chunk
        self.proposed_by = REQUEST_DRAFT
        return []

    def propose_candidates(self, settings: ProposalSettings) -> list[tuple[str, list[int]]]:
        """Up to ``settings.draft_candidates`` distinct (source, tokens) proposals in the chain's priority order
        (:meth:`_chain_proposals` with every proposal of each source, e.g. one per sibling), to verify together as
        a token tree. Empty for a plain decode step."""
        limit = self.proposal_length(settings)
        if limit <= 0:
            return []
        found: list[tuple[str, list[int]]] = []
        for name, proposal in self._chain_proposals(settings, limit, every=True):
            if proposal and all(proposal != tokens for _, tokens in found):
                found.append((name, proposal))
        return found[: settings.draft_candidates]

    def _chain_proposals(
        self, settings: ProposalSettings, limit: int, every: bool, request_only: bool = False
    ) -> Iterator[tuple[str, list[int]]]:
        """The draft chain's proposals of at most ``limit`` tokens, in priority order, asked lazily: the request's
        draft, each dynamic source's best (with ``every``: all of a source's, best first), and last the request's
        draft by position where it has diverged. The request's draft re-aligns to the response after a divergence
        where something else could propose instead (other sources, or ``every``); alone, it proposes by position.
        ``request_only``: the request's draft's aligned proposals only (an engine's draft head goes before the others
        and before a diverged draft's proposals by position)."""
        chain = settings.draft_chain
        if chain == (REQUEST_DRAFT,) and not every:
            yield REQUEST_DRAFT, self._draft_chunk(limit)
            return
        for name in chain:
            if request_only and name != REQUEST_DRAFT:
                continue
            if name == REQUEST_DRAFT:
                proposals = [self._aligned_draft_chunk(limit)]
                if every:
                    proposals += self._branch_chunks(limit)
            elif every:
                proposals = settings.proposers[name].propose_all(self._context(), limit)
            else:
                proposals = [settings.proposers[name].propose(self._context(), limit)]
            for proposal in proposals:
                yield name, list(proposal)[:limit]
        if REQUEST_DRAFT in chain and self.diverged and not request_only:  # the chain's last resort, after a head's
            yield REQUEST_DRAFT, self._draft_chunk(limit)

    def _draft_chunk(self, limit: int) -> list[int]:
        start = len(self.tokens) + self.draft_offset
        if start < 0:
            return []
        return list(self.path[start : start + limit])

    def _branch_chunks(self, limit: int) -> list[list[int]]:
        """The path's branches that start within the next ``limit`` positions, as proposals that follow the path
        up to the branch and the branch after it: the smallest near-tie margin first (the likeliest to be taken)."""
        start = len(self.tokens) + self.draft_offset
        if self.diverged or not self.branches or start < 0:
            return []
        margins = {tie.index: tie.margin for tie in self.near_ties}
        ahead = [b for b in self.branches if start <= b.index < start + limit]
        ahead.sort(key=lambda b: (margins.get(b.index, float("inf")), b.index))
        return [[*self.path[start : b.index], *b.token_ids][:limit] for b in ahead]

    def _aligned_draft_chunk(self, limit: int) -> list[int]:
        """The request draft's proposal when the chain has other sources to fall back on: none while the draft
        has diverged, unless the response's latest tokens re-align to it now."""
        if self.diverged and self.request.draft is not None:
            found = realign(self.tokens, self.path, self.draft_offset)
            if found is None:
                return []
            self.draft_offset, self.diverged = found, False
        return self._draft_chunk(limit)

    def _context(self) -> ProposalContext:
        return ProposalContext(
            key=self.request.key,
            prompt_token_ids=self.request.prompt_token_ids,
            tokens=self.tokens,
            siblings=[s.tokens for s in self.siblings],
        )

    # -- recording -----------------------------------------------------------------------------------------------

    def record(
        self,
        draft: Seq[int],
        samples: Seq[int | None],
        logprobs: Seq[float],
        settings: ProposalSettings,
        verified: int | None = None,
        near_ties: tuple[Seq[int], Seq[float]] | None = None,
    ) -> int:
        """Applies one forward pass that scored ``draft`` (possibly empty); returns the draft tokens accepted.
        ``verified``: the draft tokens the pass scored, counted as proposed (a token tree's; default ``len(draft)``).
        ``near_ties``: the runner-up and margin at each scored position, laid out as ``samples`` (kept for the
        emitted tokens where the request asked for margins; not computed after a held, undecided position).

        samples / logprobs: at least ``len(draft) + 1`` entries (more are ignored); ``samples[j]`` is the keyed
        sample at the position of ``draft[j]``, ``samples[len(draft)]`` the one after the draft; ``None`` where
        undecided (then its logprob is ignored). The scores after an undecided position are kept: they hold if the
        token decoded there is the draft's, and then the plain step that decodes it goes on verifying with them.
        """
        proposed = len(draft)
        held, self._held = self._held, None
        if not draft and held is not None and samples[0] is not None and samples[0] == held[0][0]:
            draft, samples, logprobs = held[0], [samples[0], *held[1]], [logprobs[0], *held[2]]
        accepted = accepted_length(samples[: len(draft)], draft)
        undecided = samples[accepted] is None
        if undecided:
            self._held = (
                list(draft[accepted:]),
                list(samples[accepted + 1 : len(draft) + 1]),
                list(logprobs[accepted + 1 : len(draft) + 1]),
            )
        emitted = list(draft[:accepted]) + ([] if undecided else [samples[accepted]])
        first_response_pass = self.stats.decode_steps == 0
        resolved = self.decode_next and not draft  # a plain step decoded a position the top-K left open
        self.decode_next = undecided
        since = len(self.tokens)
        kept = self._emit(emitted, list(logprobs[: len(emitted)]))
        if self.request.margins:
            runner_ups, margins = near_ties if near_ties is not None and held is None else ((), ())
            self.runner_up_ids += [*runner_ups[:kept], *[-1] * (kept - len(runner_ups[:kept]))]
            self.margins += [*margins[:kept], *[float("inf")] * (kept - len(margins[:kept]))]
        if first_response_pass:
            self.stats.prefill_tokens = len(self.request.prompt_token_ids) + len(self.request.response_prefix)
        self.stats.decode_steps += 1
        if draft:
            self._count_verify_step(proposed if verified is None else verified, accepted, kept, undecided)
            if settings.adaptive_draft_length and proposed:
                # Propose what the last verify step accepted, plus one; double after a full acceptance. Where a
                # forward pass costs in proportion to its tokens (CPUs, compute-bound GPUs) this stops paying
                # for long proposals that a diverged draft keeps failing.
                grown = 2 * proposed if accepted == proposed else accepted + 1
                self.proposal_limit = min(settings.max_draft_tokens_per_step, grown)
        if self.proposed_by == REQUEST_DRAFT and ((draft and accepted < len(draft) and not undecided) or resolved):
            self._after_request_draft_step(settings.draft_alignment, since)
        elif self.proposed_by == REQUEST_DRAFT and self.branches and not undecided:
            self._follow(since)  # every token matched what was proposed: a tree's branch candidate, or a plain step
        return accepted

    def record_tree(
        self,
        tree: DraftTree,
        samples: Seq[int],
        logprobs: Seq[float],
        settings: ProposalSettings,
        near_ties: tuple[Seq[int], Seq[float]] | None = None,
    ) -> list[int]:
        """Applies one forward pass that scored ``tree`` (``samples[0]`` / ``logprobs[0]`` after the sequence's
        last token, ``[1 + i]`` after node ``i``; ``near_ties`` likewise); returns the accepted path (nodes). The
        step is recorded as the candidate that holds the path, with every tree token counted as proposed."""
        if not tree.candidates:  # a plain decode step
            ties = None if near_ties is None else (near_ties[0][:1], near_ties[1][:1])
            self.record((), samples[:1], logprobs[:1], settings, near_ties=ties)
            return []
        path = tree.accept(samples)
        source, draft = tree.chosen(path)

        def along(values: Seq) -> list:
            return [values[0], *(values[1 + node] for node in path)]

        padding = len(draft) - len(path)  # the candidate's tokens past the path were rejected: any sample will do
        self.proposed_by = source
        since = len(self.tokens)
        ties = None if near_ties is None else (along(near_ties[0]), along(near_ties[1]))
        self.record(
            draft,
            [*along(samples), *[-1] * padding],
            [*along(logprobs), *[0.0] * padding],
            settings,
            len(tree),
            near_ties=ties,
        )
        if source != REQUEST_DRAFT and self.request.draft is not None and not self.diverged:
            self._after_request_draft_step(settings.draft_alignment, since)  # the request's draft may be passed by
        return path

    def _count_verify_step(self, proposed: int, accepted: int, kept: int, undecided: bool) -> None:
        """Stats of a step that verified draft tokens (``proposed`` == 0: it went on with held scores)."""
        stats = self.stats
        counted = min(accepted, kept)  # tokens accepted after a stop token are not emitted: they do not count
        stats.verify_steps += 1
        stats.draft_tokens_proposed += proposed
        stats.draft_tokens_accepted += counted
        if counted:
            by_source = stats.accepted_by_source
            by_source[self.proposed_by] = by_source.get(self.proposed_by, 0) + counted
        stats.undecided_steps += undecided
        length = counted if undecided else counted + 1
        stats.acceptance_lengths[length] = stats.acceptance_lengths.get(length, 0) + 1

    def record_plain(self, tokens: Seq[int], logprobs: Seq[float], settings: ProposalSettings) -> None:
        """Tokens of plain decode steps, one forward pass each (an engine that decodes several per request)."""
        for token, logprob in zip(tokens, logprobs, strict=True):
            if self.finish is not None:
                break
            self.record((), (token,), (logprob,), settings)

    def _after_request_draft_step(self, alignment: Alignment, since: int) -> None:
        """After a rejected draft token (or a plainly decoded one), the tokens emitted from response position
        ``since`` on: where they are the path's, or a branch's from where they left it, the draft still holds.
        Otherwise positional alignment keeps proposing the path's tokens at the following positions; suffix
        alignment first looks for where the response's latest tokens continue in the path (falling back to
        position)."""
        if self.request.draft is None or self._follow(since):
            return
        if alignment == "suffix":
            found = realign(self.tokens, self.path, self.draft_offset)
            if found is not None:
                self.draft_offset = found
            self.diverged = found is None

    def _follow(self, since: int) -> bool:
        """Walks the response's tokens from position ``since`` along the path; where one is not the path's token
        but the first of a branch from there, the path becomes that branch (draft tries). False at a token that is
        neither."""
        for position in range(since, len(self.tokens)):
            index, token = position + self.draft_offset, self.tokens[position]
            if 0 <= index < len(self.path) and self.path[index] == token:
                continue
            branch = next((b for b in self.branches if b.index == index and b.token_ids[0] == token), None)
            if branch is None:
                return False
            self.path = (*self.path[:index], *branch.token_ids)
            self.near_ties = (*(t for t in self.near_ties if t.index < index), *branch.near_ties)
            self.branches = branch.branches
            self.stats.branches_followed += 1
        return True

    def _emit(self, tokens: list[int], logprobs: list[float]) -> int:
        """Appends tokens up to and including a stop token and within the length limit; returns how many."""
        kept = min(len(tokens), self.room)
        for i, token in enumerate(tokens[:kept]):
            if token in self.stop_ids:
                kept, self.finish = i + 1, "stop"
                break
        self.tokens += tokens[:kept]
        self.logprobs += logprobs[:kept]
        if self.finish is None and self.room <= 0:
            self.finish = "length"
        return kept


def keyed_samples(
    logits_BTV: torch.Tensor,
    sequences: Seq[Sequence],
    drafts: Seq[Seq[int]],
    offsets: Seq[int] | None = None,
    stream: int = 0,
) -> tuple[list[list[int]], list[list[float]]]:
    """The keyed samples and their logprobs of one forward pass, as lists [B][T]: row b of ``logits_BTV`` holds the
    logits of ``sequences[b]`` at response positions ``len(tokens) + offsets[b] + t`` (offsets default 0), the pass
    having fed ``drafts[b]`` after the sequence's tokens. Each request's sampling settings apply (temperature, its
    suppressed tokens, top-k, top-p, min-p; the repetition penalty over its prompt, its tokens and the draft tokens
    before each position).
    ``stream``: the noise stream (0: the key's own; one-hot verification samples another)."""
    tokens_BT, logprobs_BT = sampling.keyed_sample(*_keyed_arguments(logits_BTV, sequences, drafts, offsets, stream))
    return tokens_BT.tolist(), logprobs_BT.tolist()


def keyed_samples_with_near_ties(
    logits_BTV: torch.Tensor,
    sequences: Seq[Sequence],
    drafts: Seq[Seq[int]],
    offsets: Seq[int] | None = None,
) -> tuple[list[list[int]], list[list[float]], list[list[int]], list[list[float]]]:
    """:func:`keyed_samples` (the key's own noise) with each sample's runner-up and margin, as lists [B][T]
    (:func:`~bubblespec.verify.margins.keyed_runner_up` up to :data:`~bubblespec.verify.margins.REPORTED_MARGIN_LIMIT`):
    what a drafting pass records for draft tries."""
    tokens_BT, logprobs_BT, runner_ups_BT, margins_BT = keyed_runner_up(
        *_keyed_arguments(logits_BTV, sequences, drafts, offsets, 0), margin_limit=REPORTED_MARGIN_LIMIT
    )
    return tokens_BT.tolist(), logprobs_BT.tolist(), runner_ups_BT.tolist(), margins_BT.tolist()


def _keyed_arguments(logits_BTV, sequences, drafts, offsets, stream) -> tuple:
    """:func:`~bubblespec.verify.sampling.keyed_sample`'s arguments for the rows of :func:`keyed_samples`."""
    params = [s.request.sampling for s in sequences]
    device = logits_BTV.device
    batch, num_positions = logits_BTV.shape[:2]
    offsets = [0] * batch if offsets is None else list(offsets)
    seeds_B2 = torch.tensor([s.noise_seed for s in sequences], dtype=torch.int64)
    if stream:
        seeds_B2 = sampling.stream_seeds(seeds_B2, stream)
    starts_B1 = torch.tensor([len(s.tokens) + o for s, o in zip(sequences, offsets, strict=True)])[:, None]
    penalty = None
    if any(p.repetition_penalty != 1.0 for p in params):
        penalty = sampling.RepetitionPenalty(
            torch.tensor([p.repetition_penalty for p in params], dtype=torch.float64),
            _padded([[*s.request.prompt_token_ids, *s.tokens, *d[:o]] for s, d, o in zip(sequences, drafts, offsets,
                                                                                         strict=True)]),
            _padded([list(d[o:]) for d, o in zip(drafts, offsets, strict=True)]),
        )  # fmt: skip
    return (
        logits_BTV,
        seeds_B2,
        (starts_B1 + torch.arange(num_positions)).to(device),
        torch.tensor([p.temperature for p in params], dtype=torch.float64, device=device),
        torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device),
        torch.tensor([p.min_p for p in params], dtype=torch.float64, device=device),
        penalty,
        _padded([p.suppressed_token_ids for p in params]) if any(p.suppressed_token_ids for p in params) else None,
    )


def tree_budgets(sequences: Seq[Sequence], settings: ProposalSettings) -> list[int]:
    """Tree tokens each sequence may verify in one pass: one proposal's worth (``max_draft_tokens_per_step``) each,
    and the rest of one sequence's tree (``(draft_candidates - 1) * max_draft_tokens_per_step``) to the sequence
    predicted to be the longest: the longer of its request draft (an older policy's response to its key) and its
    response so far. A verified token costs compute, so a pass in a large batch verifies little more than a chain
    would, and the longest response, which decides when the step ends, gets the tree (at batch 1: all of it)."""
    chunk = settings.max_draft_tokens_per_step
    budgets = [chunk] * len(sequences)
    if sequences and settings.draft_candidates > 1:

        def predicted(sequence: Sequence) -> int:
            draft = sequence.request.draft
            return max(len(sequence.tokens), 0 if draft is None else len(draft.token_ids))

        longest = max(range(len(sequences)), key=lambda i: predicted(sequences[i]))
        budgets[longest] = settings.tree_budget
    return budgets


def _padded(rows: Seq[Seq[int]]) -> torch.Tensor:
    """Token id lists as one [B, S] int64 tensor, -1 where a row is shorter (at least one column)."""
    width = max(1, max((len(row) for row in rows), default=0))
    return torch.tensor([[*row, *[-1] * (width - len(row))] for row in rows], dtype=torch.int64)


def link_siblings(sequences: Seq[Sequence]) -> None:
    """Gives each sequence the others of its prompt and step (the group drafting of dynamic sources)."""
    groups: dict[tuple[int, int, str], list[Sequence]] = {}
    for sequence in sequences:
        key = sequence.request.key
        groups.setdefault((key.run_seed, key.step, key.prompt_uid), []).append(sequence)
    for group in groups.values():
        group.sort(key=lambda s: s.request.key.sample_index)
        for sequence in group:
            sequence.siblings = [s for s in group if s is not sequence]


def load_proposers(chain: Seq[str], options: Mapping[str, dict]) -> dict[str, object]:
    """The dynamic draft sources a draft chain names, constructed with their options."""
    return {name: _load_proposer(name, options.get(name, {})) for name in chain if name != REQUEST_DRAFT}


def _load_proposer(name: str, options: dict):
    source = source_class(name)
    if not issubclass(source, DynamicDraftSource):
        raise RequestError(
            f"draft source {name!r} is not a dynamic source and cannot propose inside the engine; only the "
            f"request's own draft ({REQUEST_DRAFT!r}) and dynamic sources belong in draft_chain"
        )
    try:
        return source(**options)
    except (TypeError, ValueError) as error:  # an option the source does not take, or a bad value
        raise RequestError(f"draft source {name!r} with options {options}: {error}") from None


def record_top_k_verifications(
    verified: Seq[tuple[Sequence, Seq[int], int, float]],
    known_ids_JC: torch.Tensor,
    known_logprobs_JC: torch.Tensor,
    num_top: int,
    vocab_size: int,
    settings: ProposalSettings,
) -> None:
    """Records the verify steps of one engine call that returned top-K log-probabilities instead of logits.

    verified: (sequence, draft, bonus token, its logprob) per verification, the bonus being the engine's keyed
        sample after the draft (decided: the engine sampled it from full logits).
    known_ids_JC / known_logprobs_JC: one row per draft position, in the order of ``verified`` and of each draft;
        the layout of :func:`bubblespec.verify.verification.decide_keyed_samples` (a row of -1 ids stays undecided).
    """
    rows = [(s, j) for s, draft, _, _ in verified for j in range(len(draft))]
    params = [s.request.sampling for s, _ in rows]
    tokens_J, logprobs_J, _ = decide_keyed_samples(
        known_ids_JC,
        known_logprobs_JC,
        num_top,
        torch.tensor([s.noise_seed for s, _ in rows], dtype=torch.int64),
        torch.tensor([len(s.tokens) + j for s, j in rows], dtype=torch.int64),
        torch.tensor([p.temperature for p in params], dtype=torch.float64),
        torch.tensor([p.top_k for p in params], dtype=torch.int64),
        torch.tensor([p.top_p for p in params], dtype=torch.float64),
        vocab_size,
    )
    tokens, logprobs, start = tokens_J.tolist(), logprobs_J.tolist(), 0
    for sequence, draft, bonus, bonus_logprob in verified:
        end = start + len(draft)
        samples = [t if t >= 0 else None for t in tokens[start:end]]
        sequence.record(draft, [*samples, bonus], [*logprobs[start:end], bonus_logprob], settings)
        start = end
