"""The branches idle ranks draft once a step's keys are drafted: draft tries in the bubble (docs/design.md §13).

A :class:`~bubblespec.rollout.step.DraftPlan` hands out its keys first; with ``speculation.tries_max_tokens_per_rank``
above 0 it then hands out branch requests from its :class:`TriesPlan`: the cut branches to continue first, then the
open near-ties of the next step's finished drafts in the tries policy's order. A branch request is an ordinary
drafting request of the key (its prompt, sampling and noise) that gives the path up to the near-tie and the runner-up
as its response prefix, so branches of many keys share batched passes as drafts do, and both clocks charge them as
such. What comes back is merged into the key's trie, which the plan keeps: the store receives the grown trie.

Several branch requests of one key may be in flight at once, one per near-tie (a result is told apart by the
response prefix it was given), so one batched round drafts the best near-ties of every key, not one per key. A key's
trie is branched only from a finished draft of the policy the ranks hold, so a draft refreshed by this phase's
drafting starts a trie of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence

from bubblespec.core.interfaces import (
    Draft,
    GenerationRequest,
    GenerationResult,
    OpenNearTie,
    RolloutKey,
    TriesPolicyBase,
)
from bubblespec.verify.tries import (
    OpenTie,
    Route,
    branch_from,
    branch_request,
    continue_request,
    node_at,
    open_ties,
    unfinished_branches,
    with_branch,
)


@dataclasses.dataclass(frozen=True)
class _Candidate:
    """A branch request the plan may hand out: the node it grows (``route``), the branch's index, whether it
    continues a cut branch, and the request."""

    key: RolloutKey
    route: Route
    index: int
    continuing: bool
    request: GenerationRequest
    trunk: tuple[int, tuple[int, ...]]
    """The policy version and tokens of the draft it branches (a branch of another draft of the key is dropped)."""

    @property
    def where(self) -> tuple[RolloutKey, Route, int]:
        return self.key, self.route, self.index


class TriesPlan:
    """The tries of one step's keys and the branch requests still to hand out, within a budget of branch tokens."""

    def __init__(
        self,
        policy: TriesPolicyBase,
        requests: Sequence[GenerationRequest],
        max_tokens: int,
        drafts: Iterable[Draft] = (),
    ) -> None:
        """``requests``: the keys whose drafts may branch (the next step's); ``max_tokens``: branch tokens to draft
        in all; ``drafts``: the stored drafts of those keys (tries from an earlier phase go on growing)."""
        self.policy = policy
        self.requests = {r.key: r for r in requests}
        self.step = min((r.key.step for r in requests), default=-1)
        """The step whose drafts branch (its keys are handed out before any branch)."""
        self.max_tokens = max_tokens
        self.tokens = 0
        """Branch tokens drafted so far (what the budget counts)."""
        self.tries: dict[RolloutKey, Draft] = {}
        self._in_flight: dict[RolloutKey, list[_Candidate]] = {}
        """Per key, its branch requests out (told apart by their response prefixes)."""
        self._order: tuple[int, list[_Candidate]] | None = None
        """The candidates in the policy's order, for ranks holding a policy version; recomputed once the tries
        change (not at every hand-out)."""
        self.observe(drafts)

    def observe(self, drafts: Iterable[Draft]) -> None:
        """Drafts made for the plan's keys: a finished one may branch (where its policy is the ranks'); an
        unfinished one replaces the key's trie with nothing to branch (its path is not final)."""
        for draft in drafts:
            if draft.key not in self.requests:
                continue
            if draft.finished:
                self.tries[draft.key] = draft
            else:
                self.tries.pop(draft.key, None)
            self._order = None

    def available(self, policy_version: int) -> bool:
        """Whether a branch request is left to hand out to ranks holding ``policy_version``."""
        return self.tokens < self.max_tokens and any(True for _ in self._candidates(policy_version))

    def take(self, size: int, policy_version: int) -> list[GenerationRequest]:
        """Up to ``size`` branch requests, none for a near-tie with one in flight, from the tries of drafts that
        ranks holding ``policy_version`` made (another policy's path would branch off another text)."""
        if self.tokens >= self.max_tokens:
            return []
        chosen: list[GenerationRequest] = []
        for candidate in self._candidates(policy_version):
            if len(chosen) >= size:
                break
            self._in_flight.setdefault(candidate.key, []).append(candidate)
            chosen.append(candidate.request)
        return chosen

    def is_branch(self, result: GenerationResult) -> bool:
        return self._answered(result) is not None

    def merge(self, results: Sequence[GenerationResult]) -> list[Draft]:
        """The tries grown by branch results (those of :meth:`take`'s requests; others are left alone), one per
        key."""
        grown: dict[RolloutKey, Draft] = {}
        for result in results:
            candidate = self._answered(result)
            if candidate is None:
                continue
            out = self._in_flight[result.key]
            out.remove(candidate)
            if not out:
                del self._in_flight[result.key]
            trie = self.tries.get(result.key)
            if trie is None or (trie.policy_version, trie.token_ids) != candidate.trunk:
                continue  # the key's draft was replaced meanwhile: the branch belongs to an old path
            branch = branch_from(result, candidate.index)
            if candidate.continuing:
                old = node_at(trie, (*candidate.route, candidate.index))
                branch = dataclasses.replace(branch, branches=old.branches)
                self.tokens += max(len(branch.token_ids) - len(old.token_ids), 0)
            else:
                self.tokens += len(branch.token_ids)
            self.tries[result.key] = grown[result.key] = with_branch(trie, candidate.route, branch)
            self._order = None
        return list(grown.values())

    def _answered(self, result: GenerationResult) -> _Candidate | None:
        """The request in flight that ``result`` answers: its key's, with the response prefix it begins with."""
        for candidate in self._in_flight.get(result.key, ()):
            prefix = candidate.request.response_prefix
            if result.stats.given_tokens == len(prefix) and tuple(result.token_ids[: len(prefix)]) == prefix:
                return candidate
        return None

    def _candidates(self, policy_version: int) -> Iterator[_Candidate]:
        """The branch requests to hand out, best first, less those in flight: cut branches first, then open
        near-ties in the policy's order."""
        if self._order is None or self._order[0] != policy_version:
            self._order = (policy_version, self._ordered(policy_version))
        busy = {candidate.where for out in self._in_flight.values() for candidate in out}
        return (candidate for candidate in self._order[1] if candidate.where not in busy)

    def _ordered(self, policy_version: int) -> list[_Candidate]:
        tries = {key: trie for key, trie in self.tries.items() if trie.policy_version == policy_version}
        ordered = [
            _Candidate(key, route[:-1], route[-1], True, continue_request(self.requests[key], trie, route), trunk(trie))
            for key, trie in tries.items()
            for route in unfinished_branches(trie)
        ]
        opened: dict[tuple, OpenTie] = {}
        ties = []
        for key, trie in tries.items():
            for tie in open_ties(trie):
                opened[(key, tie.route, tie.tie.index)] = tie
                ties.append(OpenNearTie(key, tie.route, tie.tie, len(tie.path)))
        for chosen in self.policy.order(ties):
            tie = opened[(chosen.key, chosen.route, chosen.tie.index)]
            request = branch_request(self.requests[chosen.key], tie)
            ordered.append(_Candidate(chosen.key, tie.route, tie.tie.index, False, request, trunk(tries[chosen.key])))
        return ordered


def trunk(draft: Draft) -> tuple[int, tuple[int, ...]]:
    return draft.policy_version, draft.token_ids
