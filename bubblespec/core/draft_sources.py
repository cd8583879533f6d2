"""Draft sources: where speculative proposals come from. Verification is the same for all of them, so a source
can only change the speed of a rollout, never its tokens.

Two kinds, each a base class that declares what a source of its kind implements:

* **static** sources (:class:`StaticDraftSource`) give a request one :class:`~bubblespec.core.interfaces.Draft` before
  generation starts: ``bubble`` (ours: the next step's responses drafted in the bubble by the previous policy with
  the same keys) and ``history`` (the response to the same prompt and sample index from the last step that used
  this prompt, SPEC-RL / HistoSpec style). The first static source in the configured order with a draft for a key
  wins.
* **dynamic** sources (:class:`DynamicDraftSource`) propose tokens inside the engine, per sequence and per forward
  pass, whenever the request's own draft has nothing to propose (none, used up, or diverged with no
  re-alignment): ``ngram`` (prompt lookup, as in vLLM and SGLang), ``group`` (siblings of the same prompt in the
  same engine call, Seer style) and ``suffix`` (every response the engine produced before, SuffixDecoding style).
  They see a :class:`ProposalContext` and return token ids; with ``speculation.draft_candidates`` > 1 an engine
  verifies several proposals at once (each source's :meth:`DynamicDraftSource.propose_all`).

``none`` proposes nothing: plain decoding with speculation's bookkeeping. Sources are plugins (entry point
group ``bubblespec.draft_sources``); ``speculation.draft_sources`` names them in priority order and
``speculation.draft_source_options`` gives each its constructor's arguments. A third-party source subclasses one of
the two bases; anything else is refused by name when the config is validated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from bubblespec.core.interfaces import Draft, DraftStore, GenerationResult, RolloutKey

SourceKind = Literal["none", "static", "dynamic"]

REQUEST_DRAFT = "request"
"""In an engine's draft chain, the place of the request's own (static) draft among the dynamic sources."""
HEAD_DRAFT = "head"
"""The source of an engine's draft-head proposals (where the chain, or the request's draft, proposed nothing), as
``GenerationStats.accepted_by_source`` names it."""


@dataclass(frozen=True, slots=True)
class ProposalContext:
    """What a dynamic source may look at when proposing for one sequence."""

    key: RolloutKey
    prompt_token_ids: Sequence[int]
    tokens: Sequence[int]
    """The response so far."""
    siblings: Sequence[Sequence[int]]
    """Responses so far (finished ones whole) of the other samples of the same prompt and step in this engine
    call, in sample order."""


def lookup_continuation(
    tokens: Sequence[int], history: Sequence[int], max_n: int, min_n: int, num_tokens: int, before: int | None = None
) -> list[int]:
    """Prompt lookup: for n from ``max_n`` down to ``min_n``, the latest occurrence of the last n ``tokens`` in
    ``history`` that ends before index ``before`` (default: anywhere) and has a continuation; up to
    ``num_tokens`` tokens of that continuation. Empty if no n-gram matches."""
    end_limit = len(history) if before is None else min(before, len(history))
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        if n <= 0:
            break
        suffix = list(tokens[len(tokens) - n :])
        for end in range(end_limit, n - 1, -1):  # end: one past the match; latest occurrence first
            if end < len(history) and list(history[end - n : end]) == suffix:
                return list(history[end : end + num_tokens])
    return []


class DraftSource:
    """What every draft source declares: its kind."""

    kind: ClassVar[SourceKind] = "none"


class StaticDraftSource(DraftSource):
    """A source that gives a request its draft before generation starts (the rollout service asks it).

    ``drafts`` is the one method a source must implement. ``observe`` sees every step's responses (in request
    order) after the step; ``snapshot`` / ``restore`` carry what the source remembers through a checkpoint (only the
    ``history`` source's state is saved in checkpoints today; another source starts empty after a resume).
    """

    kind: ClassVar[SourceKind] = "static"

    def drafts(self, keys: Sequence[RolloutKey]) -> dict[RolloutKey, Draft]:
        """Drafts for those of ``keys`` the source has one for."""
        raise NotImplementedError

    def observe(self, results: Sequence[GenerationResult]) -> None:
        """A step's responses, once the step is done."""

    def snapshot(self) -> list[Draft]:
        """What the source remembers, for a checkpoint."""
        return []

    def restore(self, remembered: Sequence[Draft]) -> None:
        """Back to a :meth:`snapshot`."""


class DynamicDraftSource(DraftSource):
    """A source that proposes inside the engine, per sequence and forward pass (a draft chain entry)."""

    kind: ClassVar[SourceKind] = "dynamic"

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.propose is DynamicDraftSource.propose and cls.propose_all is DynamicDraftSource.propose_all:
            raise TypeError(f"draft source {cls.__name__} must define propose or propose_all (each gives the other)")

    def propose(self, context: ProposalContext, limit: int) -> list[int]:
        """Up to ``limit`` token ids to propose after ``context.tokens``; [] for none. By default the best of
        :meth:`propose_all`."""
        proposals = self.propose_all(context, limit)
        return proposals[0] if proposals else []

    def propose_all(self, context: ProposalContext, limit: int) -> list[list[int]]:
        """Every proposal the source has, best first, for an engine that verifies several candidates at once
        (``speculation.draft_candidates``); by default the one :meth:`propose` gives."""
        return [self.propose(context, limit)]

    def observe(self, context: ProposalContext) -> None:
        """A response this engine finished or stopped (``context.tokens``), for a source that learns from them;
        engines call it as responses end (drafting calls' included)."""


class NoDrafts(DraftSource):
    """Proposes nothing: plain decoding."""


class BubbleDrafts(StaticDraftSource):
    """Ours: drafts of the next step's keys made in the bubble by the policy one step older (same keys, so the
    keyed noise is shared). They live in the draft store, which the rollout service hands to this source."""

    def __init__(self, store: DraftStore | None = None) -> None:
        self.store = store

    def drafts(self, keys: Sequence[RolloutKey]) -> dict[RolloutKey, Draft]:
        return {} if self.store is None else self.store.get(keys)


class NGramProposer(DynamicDraftSource):
    """Prompt lookup decoding (vLLM ``ngram``, SGLang's n-gram speculation): match the last ``max_n`` ..
    ``min_n`` tokens against prompt + response so far, latest occurrence first, and propose up to
    ``num_tokens`` of the tokens that followed it."""

    def __init__(self, max_n: int = 4, min_n: int = 2, num_tokens: int = 8) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram needs 1 <= min_n <= max_n, got min_n={min_n!r}, max_n={max_n!r}")
        if num_tokens < 1:
            raise ValueError(f"ngram num_tokens must be >= 1, got {num_tokens!r}")
        self.max_n, self.min_n, self.num_tokens = max_n, min_n, num_tokens

    def propose(self, context: ProposalContext, limit: int) -> list[int]:
        history = [*context.prompt_token_ids, *context.tokens]
        # The match must end before the last token: the suffix itself trivially matches there.
        return lookup_continuation(
            context.tokens, history, self.max_n, self.min_n, min(limit, self.num_tokens), before=len(history) - 1
        )


class GroupProposer(DynamicDraftSource):
    """Seer-style group drafting: the sibling samples of the same prompt are the draft. A sibling's tokens at
    the same response positions are proposed when the two responses agree on the last ``match_tokens``
    tokens there; otherwise the sibling's latest occurrence of our last ``max_n`` .. ``min_n`` tokens is
    re-aligned to. The sibling with the longest proposal wins (a finished sibling usually)."""

    def __init__(self, max_n: int = 8, min_n: int = 3, match_tokens: int = 2) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"group needs 1 <= min_n <= max_n, got min_n={min_n!r}, max_n={max_n!r}")
        self.max_n, self.min_n, self.match_tokens = max_n, min_n, match_tokens

    def propose_all(self, context: ProposalContext, limit: int) -> list[list[int]]:
        """Each sibling's proposal, longest first (siblings in sample order among equals)."""
        tokens = context.tokens
        proposals = []
        for sibling in context.siblings:
            aligned = self._aligned(tokens, sibling, limit)
            proposals.append(aligned or lookup_continuation(tokens, sibling, self.max_n, self.min_n, limit))
        return sorted((p for p in proposals if p), key=len, reverse=True)

    def _aligned(self, tokens: Sequence[int], sibling: Sequence[int], limit: int) -> list[int]:
        position = len(tokens)
        if len(sibling) <= position:
            return []
        recent = min(self.match_tokens, position)
        if list(sibling[position - recent : position]) != list(tokens[position - recent :]):
            return []
        return list(sibling[position : position + limit])


class SuffixProposer(DynamicDraftSource):
    """SuffixDecoding / DAS style: the continuations of the response's latest tokens wherever they occur in the
    responses this engine has already produced, in this run's earlier steps and calls (its rollouts and the drafts
    it made in bubbles) and in this call (those finished before). Trajectories that merge (a reasoning step many
    responses take, a Collatz number reached from several starts) continue as they did before.

    Occurrences of the last ``min_n`` tokens are ranked by how far the match reaches back (up to ``max_n``
    tokens), then by recency; the distinct continuations of the best ``max_candidates`` are the proposals (several
    for an engine that verifies candidates together). The index holds at most ``max_tokens`` response tokens (the
    oldest responses go first; about 330 bytes per token: 66 MB per rank at the default) and the latest
    ``max_occurrences`` places of each ``min_n``-gram. Its memory is not in checkpoints: after a resume it starts
    empty (speed only; with ``schedule.kind: async``, whose policy choice depends on speed, it is refused)."""

    def __init__(
        self,
        min_n: int = 4,
        max_n: int = 32,
        num_tokens: int = 32,
        max_candidates: int = 4,
        max_occurrences: int = 16,
        max_tokens: int = 200_000,
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"suffix needs 1 <= min_n <= max_n, got min_n={min_n!r}, max_n={max_n!r}")
        for name, value in [("num_tokens", num_tokens), ("max_candidates", max_candidates),
                            ("max_occurrences", max_occurrences), ("max_tokens", max_tokens)]:  # fmt: skip
            if value < 1:
                raise ValueError(f"suffix {name} must be >= 1, got {value!r}")
        self.min_n, self.max_n, self.num_tokens = min_n, max_n, num_tokens
        self.max_candidates, self.max_occurrences, self.max_tokens = max_candidates, max_occurrences, max_tokens
        self._responses: dict[int, tuple[int, ...]] = {}
        self._next_id = 0
        self._num_tokens = 0
        self._places: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        """n-gram -> (response id, index one past it), oldest first."""

    def observe(self, context: ProposalContext) -> None:
        tokens = tuple(context.tokens)
        if len(tokens) <= self.min_n:
            return
        response = self._next_id
        self._next_id += 1
        self._responses[response] = tokens
        self._num_tokens += len(tokens)
        n = self.min_n
        for end in range(n, len(tokens)):  # an n-gram at the very end has no continuation
            places = self._places.setdefault(tokens[end - n : end], [])
            places.append((response, end))
            if len(places) > self.max_occurrences:
                del places[0]
        while self._num_tokens > self.max_tokens and len(self._responses) > 1:
            oldest = next(iter(self._responses))
            evicted = self._responses.pop(oldest)
            self._num_tokens -= len(evicted)
            for end in range(n, len(evicted)):
                gram = evicted[end - n : end]
                kept = [place for place in self._places.get(gram, ()) if place[0] != oldest]
                if kept:
                    self._places[gram] = kept
                else:
                    self._places.pop(gram, None)

    def propose_all(self, context: ProposalContext, limit: int) -> list[list[int]]:
        tokens = context.tokens
        if len(tokens) < self.min_n:
            return []
        places = self._places.get(tuple(tokens[len(tokens) - self.min_n :]), ())
        ranked = []
        for order, (response, end) in enumerate(places):
            seen = self._responses.get(response)
            if seen is None:  # evicted
                continue
            reach = self.min_n
            while reach < min(self.max_n, end, len(tokens)) and seen[end - reach - 1] == tokens[-reach - 1]:
                reach += 1
            ranked.append((reach, order, seen[end : end + min(limit, self.num_tokens)]))
        proposals: list[list[int]] = []
        for _, _, continuation in sorted(ranked, reverse=True):
            if continuation and list(continuation) not in proposals:
                proposals.append(list(continuation))
                if len(proposals) == self.max_candidates:
                    break
        return proposals


class HistoryDrafts(StaticDraftSource):
    """SPEC-RL / HistoSpec style: the response to the same prompt (and sample index) from the last step that
    used this prompt is the draft. Prompts repeat once per epoch; the old response was sampled with another
    key (another step) by a policy an epoch older, so it agrees with the new one less than a bubble draft."""

    def __init__(self) -> None:
        self._latest: dict[tuple[str, int], tuple[int, tuple[int, ...]]] = {}

    def observe(self, results: Sequence[GenerationResult]) -> None:
        """Remembers this step's responses (the latest step wins)."""
        for result in results:
            if result.token_ids:
                key = result.key
                self._latest[(key.prompt_uid, key.sample_index)] = (key.step, tuple(result.token_ids))

    def snapshot(self) -> list[Draft]:
        """What it remembers, as drafts of the keys that produced them (for checkpoints)."""
        return [
            Draft(RolloutKey(-1, step, uid, sample), tokens, policy_version=step, finished=True)
            for (uid, sample), (step, tokens) in self._latest.items()
        ]

    def restore(self, remembered: Sequence[Draft]) -> None:
        """Forgets everything, then remembers ``remembered`` (a :meth:`snapshot`)."""
        self._latest = {(d.key.prompt_uid, d.key.sample_index): (d.key.step, tuple(d.token_ids)) for d in remembered}

    def drafts(self, keys: Sequence[RolloutKey]) -> dict[RolloutKey, Draft]:
        """Drafts for ``keys`` from responses of earlier steps; the policy version is the step that made them."""
        found = {}
        for key in keys:
            seen = self._latest.get((key.prompt_uid, key.sample_index))
            if seen is not None and seen[0] < key.step:
                found[key] = Draft(key, seen[1], policy_version=seen[0], finished=True)
        return found


def draft_chain(sources: Sequence[str]) -> tuple[str, ...]:
    """The engine's proposal order for configured sources: static sources become one :data:`REQUEST_DRAFT`
    entry (at the first one's place, since a request carries a single draft); ``none`` becomes nothing."""

    chain: list[str] = []
    for name in sources:
        kind = source_class(name).kind
        if kind == "dynamic":
            chain.append(name)
        elif kind == "static" and REQUEST_DRAFT not in chain:
            chain.append(REQUEST_DRAFT)
    return tuple(chain)


def source_class(name: str) -> type[DraftSource]:
    """The class of draft source plugin ``name``; refused by name unless it subclasses one of the bases here."""
    from bubblespec.core import plugins

    found = plugins.load("draft_sources", name)
    if not (isinstance(found, type) and issubclass(found, DraftSource)):
        raise ValueError(
            f"draft source {name!r} ({found!r}) is not a draft source class: a draft source subclasses "
            "bubblespec.core.draft_sources.StaticDraftSource (a draft per request, before generation) or "
            "DynamicDraftSource (proposals inside the engine)"
        )
    return found
