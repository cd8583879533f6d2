"""Tries policies: which near-ties of the next step's drafts idle ranks draft branches from, once every key is drafted
(docs/design.md §13)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from bubblespec.core.interfaces import OpenNearTie, TriesPolicyBase


class TailMargin(TriesPolicyBase):
    """The near-ties whose branch is worth the most on the step's critical path first: by

        exp(-margin / MARGIN_SCALE) * (tokens of the path after the tie) * (path length / the longest path)

    The first factor stands for the chance that the policy update flips the tie (after a real GRPO step every flip
    sat at one of a response's smallest margins, all below 0.51); the second for what the branch can draft; the third
    weights the responses predicted longest, which end the step. Ties further than ``MAX_MARGIN`` are left out."""

    MARGIN_SCALE = 0.2
    MAX_MARGIN = 1.0

    def order(self, ties: Sequence[OpenNearTie]) -> list[OpenNearTie]:
        longest = max((t.path_length for t in ties), default=1) or 1

        def worth(t: OpenNearTie) -> float:
            after = max(t.path_length - t.tie.index - 1, 0)
            return math.exp(-t.tie.margin / self.MARGIN_SCALE) * after * t.path_length / longest

        kept = [t for t in ties if t.tie.margin <= self.MAX_MARGIN]
        return sorted(kept, key=lambda t: (-worth(t), t.key, t.route, t.tie.index))
