"""The branches idle ranks draft once a step's keys are drafted: draft tries in the bubble (docs/design.md §13).

A :class:`~bubblespec.rollout.step.DraftPlan` hands out its keys first; with ``speculation.tries_max_tokens_per_rank``
above 0 it then hands out branch requests from its :class:`TriesPlan`: the cut branches to continue first, then the
open near-ties of the next step's finished drafts in the tries policy's order. A branch request is an ordinary
drafting request of the key (its prompt, sampling and noise) that gives the path up to the near-tie and the runner-up
as its response prefix, so branches of many keys share batched passes as drafts do, and both clocks charge them as
such. What comes back is merged into the key's trie, which the plan keeps: the store receives the grown trie.

One branch request per key is in flight at a time (its result is told apart from its key's other requests by
key alone); a key's trie is branched only from a finished draft of the policy the ranks hold, so a draft refreshed
by this phase's drafting starts a trie of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

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
        self._in_flight: dict[RolloutKey, tuple[Route, int, bool]] = {}
        """Per key with a branch request out: the route of the node it grows, the branch's index, and whether it
        continues a cut branch."""
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

    def available(self, policy_version: int) -> bool:
        """Whether a branch request is left to hand out to ranks holding ``policy_version``."""
        return self.tokens < self.max_tokens and any(self._candidates(1, policy_version))

    def take(self, size: int, policy_version: int) -> list[GenerationRequest]:
        """Up to ``size`` branch requests, one per key, none for a key with one in flight, from the tries of
        drafts that ranks holding ``policy_version`` made (another policy's path would branch off another text)."""
        if self.tokens >= self.max_tokens:
            return []
        chosen: list[GenerationRequest] = []
        for key, route, index, request, continuing in self._candidates(size, policy_version):
            self._in_flight[key] = (route, index, continuing)
            chosen.append(request)
        return chosen

    def is_branch(self, result: GenerationResult) -> bool:
        return result.key in self._in_flight

    def merge(self, results: Sequence[GenerationResult]) -> list[Draft]:
        """The tries grown by branch results (those of :meth:`take`'s requests; others are left alone)."""
        grown = []
        for result in results:
            if result.key not in self._in_flight:
                continue
            route, index, continuing = self._in_flight.pop(result.key)
            trie = self.tries.get(result.key)
            if trie is None:  # the key's draft was replaced meanwhile: the branch belongs to an old path
                continue
            branch = branch_from(result, index)
            if continuing:
                old = node_at(trie, (*route, index))
                branch = dataclasses.replace(branch, branches=old.branches)
                self.tokens += max(len(branch.token_ids) - len(old.token_ids), 0)
            else:
                self.tokens += len(branch.token_ids)
            self.tries[result.key] = trie = with_branch(trie, route, branch)
            grown.append(trie)
        return grown

    def _candidates(self, size: int, policy_version: int):
        """(key, route, index, request, continuing) for at most ``size`` keys: cut branches first, then open
        near-ties in the policy's order."""
        taken: set[RolloutKey] = set(self._in_flight)
        tries = {key: trie for key, trie in self.tries.items() if trie.policy_version == policy_version}
        for key, trie in tries.items():
            if len(taken) - len(self._in_flight) >= size:
                return
            if key in taken:
                continue
            route = next(unfinished_branches(trie), None)
            if route is not None:
                taken.add(key)
                yield key, route[:-1], route[-1], continue_request(self.requests[key], trie, route), True
        opened: dict[tuple, OpenTie] = {}
        ties = []
        for key, trie in tries.items():
            if key in taken:
                continue
            for tie in open_ties(trie):
                opened[(key, tie.route, tie.tie.index)] = tie
                ties.append(OpenNearTie(key, tie.route, tie.tie, len(tie.path)))
        for candidate in self.policy.order(ties):
            if len(taken) - len(self._in_flight) >= size:
                return
            if candidate.key in taken:
                continue
            taken.add(candidate.key)
            tie = opened[(candidate.key, candidate.route, candidate.tie.index)]
            yield candidate.key, tie.route, tie.tie.index, branch_request(self.requests[candidate.key], tie), False
