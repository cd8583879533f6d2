"""Draft tries: a draft's near-ties, the branches drafted from them, and the requests that draft them
(docs/design.md §13).

A drafting pass that asks for margins (:attr:`~bubblespec.core.interfaces.GenerationRequest.margins`) leaves each
draft the positions where its policy nearly sampled another token (:class:`~bubblespec.core.interfaces.NearTie`).
With keyed sampling a newer policy's sample differs from the older one's only where its update reorders the top of
the same perturbed scores, so at a near-tie the newer token is most often the older policy's runner-up. A branch
is the drafting policy's response to the same key given the path up to the near-tie and the runner-up there
(:func:`branch_request`): the older policy's keyed continuation of the text the newer one will likely write. A
verifier that emits the runner-up follows the branch (:meth:`bubblespec.verify.sequence.Sequence._follow`), so the
response goes on drafting where a single path would decode one token a pass.

A *route* names a node of the trie by the indices its branches start at: ``()`` the draft itself, ``(i, j)`` the
branch from index ``j`` of the draft's branch from index ``i`` (a node has at most one branch per index, so a route
stays valid while branches are added).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from bubblespec.core.interfaces import Draft, DraftBranch, GenerationRequest, GenerationResult, NearTie

Route = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class OpenTie:
    """A near-tie of a trie with no branch yet: where it is (``route``, the path to it) and how near it is."""

    route: Route
    path: tuple[int, ...]
    """The tokens of the path the near-tie is on, from the response's start (the draft's, then each branch's)."""
    tie: NearTie


def node_at(draft: Draft, route: Route) -> Draft | DraftBranch:
    node: Draft | DraftBranch = draft
    for index in route:
        node = next(branch for branch in node.branches if branch.index == index)
    return node


def path_at(draft: Draft, route: Route) -> tuple[int, ...]:
    """The tokens from the response's start along ``route``: the draft's up to each branch, then the branch's."""
    path = draft.token_ids
    node: Draft | DraftBranch = draft
    for index in route:
        node = next(branch for branch in node.branches if branch.index == index)
        path = (*path[:index], *node.token_ids)
    return path


def open_ties(draft: Draft) -> Iterator[OpenTie]:
    """Every near-tie of the trie without a branch from it, in no particular order."""
    stack: list[tuple[Route, Draft | DraftBranch, tuple[int, ...]]] = [((), draft, draft.token_ids)]
    while stack:
        route, node, path = stack.pop()
        branched = {branch.index for branch in node.branches}
        for tie in node.near_ties:
            if tie.index not in branched:
                yield OpenTie(route, path, tie)
        for branch in node.branches:
            stack.append(((*route, branch.index), branch, (*path[: branch.index], *branch.token_ids)))


def branch_request(request: GenerationRequest, opened: OpenTie) -> GenerationRequest:
    """The drafting request for the branch at ``opened``: the key's own prompt and sampling, the path up to the
    near-tie and its runner-up given as the response's first tokens, margins asked for (its near-ties in turn)."""
    prefix = (*opened.path[: opened.tie.index], opened.tie.token)
    return dataclasses.replace(request, draft=None, response_prefix=prefix, margins=True)


def continue_request(request: GenerationRequest, draft: Draft, route: Route) -> GenerationRequest:
    """The drafting request that continues the unfinished branch at ``route``: its path verified as a draft (the
    same policy accepts it) after the prefix up to its first token, then sampled on."""
    branch = node_at(draft, route)
    path = path_at(draft, route)
    assert isinstance(branch, DraftBranch), "continue_request continues a branch; a draft goes on as a draft"
    prefix = path[: branch.index + 1]
    return dataclasses.replace(
        request, draft=Draft(draft.key, path, draft.policy_version), response_prefix=prefix, margins=True
    )


def branch_from(result: GenerationResult, index: int) -> DraftBranch:
    """The branch a drafting call for a near-tie at ``index`` produced (its tokens from the near-tie's runner-up on,
    with their near-ties). A result the barrier stopped gives an unfinished branch."""
    return DraftBranch(
        index,
        tuple(result.token_ids[index:]),
        finished=result.finish_reason != "preempted",
        near_ties=tuple(t for t in result.near_ties() if t.index > index),
    )


def with_branch(draft: Draft, route: Route, branch: DraftBranch) -> Draft:
    """The draft with ``branch`` added to (or, at the same index, replacing that of) the node at ``route``."""

    def grown(node, rest: Route):
        if not rest:
            kept = tuple(b for b in node.branches if b.index != branch.index)
            return dataclasses.replace(node, branches=tuple(sorted((*kept, branch), key=lambda b: b.index)))
        children = tuple(grown(b, rest[1:]) if b.index == rest[0] else b for b in node.branches)
        return dataclasses.replace(node, branches=children)

    return grown(draft, route)


def unfinished_branches(draft: Draft) -> Iterator[Route]:
    """The routes of branches a barrier cut before their drafting policy ended them."""
    stack: list[tuple[Route, Draft | DraftBranch]] = [((), draft)]
    while stack:
        route, node = stack.pop()
        for branch in node.branches:
            if not branch.finished:
                yield (*route, branch.index)
            stack.append(((*route, branch.index), branch))
