"""Several candidate continuations of one sequence, verified in one forward pass as a token tree.

Keyed sampling decides every position from the verifying policy's logits and the key alone, so a candidate token
is accepted exactly when it equals the keyed sample at its position. Candidates that share a prefix share its
tokens (a trie); a pass scores every node, and the accepted path is found by walking from the root along the
child whose token is the keyed sample at each node. The path and the sample after it (the bonus token) are what
plain decoding would have produced: which candidates were proposed changes how many tokens a pass yields, never
which ones (docs/design.md §3).

Nodes are numbered in the order the candidates are inserted, highest priority first, so the first candidate's
tokens are nodes ``0, 1, ...`` at depths ``1, 2, ...``: with one candidate the tree is the linear draft chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """The candidates of one sequence for one forward pass, merged into a trie of at most ``budget`` nodes."""

    candidates: list[tuple[str, list[int]]]
    """(source, tokens) in priority order, each cut to the nodes the budget left it."""
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    """Per node: its parent node, -1 for a child of the root (the sequence's last token)."""
    depths: list[int] = field(default_factory=list)
    """Per node: 1 for a child of the root."""
    owners: list[int] = field(default_factory=list)
    """Per node: the first candidate through it."""
    _children: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, candidates: Sequence[tuple[str, Sequence[int]]], budget: int) -> DraftTree:
        """The trie of ``candidates`` (priority order); a candidate that would pass the ``budget`` of new nodes
        is cut there, and those after it are dropped once the budget is spent."""
        tree = cls([])
        for source, tokens in candidates:
            node, taken = -1, []
            for token in tokens:
                child = tree._children.get((node, token))
                if child is None:
                    if len(tree.tokens) >= budget:
                        break
                    child = tree._add(node, token, len(tree.candidates))
                node = child
                taken.append(token)
            if taken and all(taken != kept for _, kept in tree.candidates):
                tree.candidates.append((source, taken))
        return tree

    def _add(self, parent: int, token: int, owner: int) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.owners.append(owner)
        self._children[(parent, token)] = node
        return node

    def __len__(self) -> int:
        return len(self.tokens)

    def chunk_positions(self, fed: int) -> list[int]:
        """Where each token of a pass's chunk (``fed`` pending tokens, then this tree's nodes) stands past the
        cache: the pending tokens in order, a node at its depth after the last of them."""
        return [*range(fed), *(fed - 1 + depth for depth in self.depths)]

    def chunk_visible(self, fed: int) -> torch.Tensor:
        """Bool [fed + n, fed + n]: which of the chunk's tokens each one sees (a query's row): the pending tokens
        causally, a node what its parent sees (the last pending token's view for a child of the root) and itself."""
        size = fed + len(self)
        visible = torch.ones(size, size, dtype=torch.bool).tril()
        for node, parent in enumerate(self.parents):
            index = fed + node
            visible[index] = visible[fed - 1 if parent < 0 else fed + parent]
            visible[index, index] = True
        return visible

    def attention_pairs(self, fed: int, cache_length: int) -> int:
        """(query, key) pairs the chunk attends after ``cache_length`` cached positions: each pending token the
        cache and the pending tokens up to itself, each node the cache, the pending tokens and its path."""
        pending = fed * cache_length + fed * (fed + 1) // 2
        return pending + sum(cache_length + fed + depth for depth in self.depths)

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node``."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[n] for n in self.path(node)]

    def accept(self, samples: Sequence[int]) -> list[int]:
        """The accepted path (nodes) given the keyed samples: ``samples[0]`` after the sequence's last token,
        ``samples[1 + i]`` after node ``i``. The sample after the path's last node is the bonus token."""
        path, node = [], -1
        while True:
            child = self._children.get((node, samples[0 if node < 0 else 1 + node]))
            if child is None:
                return path
            path.append(child)
            node = child

    def chosen(self, path: Sequence[int]) -> tuple[str, list[int]]:
        """The candidate that holds the accepted ``path`` (the first in priority order; the first candidate where
        the path is empty)."""
        return self.candidates[self.owners[path[-1]] if path else 0]
