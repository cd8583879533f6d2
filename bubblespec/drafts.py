"""Draft checks shared by every engine and draft store."""

from __future__ import annotations

import numbers

from bubblespec.errors import DraftError
from bubblespec.interfaces import Draft, RolloutKey


def validate_draft(draft: object, vocab_size: int) -> Draft:
    """Refuses a malformed draft with a message that names what is wrong; returns it unchanged otherwise.

    Well-formed but useless drafts (random, stale, truncated, over-long, another key's) are accepted: they can
    only cost speed, never change an output.
    """
    if not isinstance(draft, Draft):
        raise DraftError(f"expected a Draft, got {type(draft).__name__}")
    if not isinstance(draft.key, RolloutKey):
        raise DraftError(f"draft key must be a RolloutKey, got {type(draft.key).__name__}")
    for position, token in enumerate(draft.token_ids):
        if not isinstance(token, numbers.Integral) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise DraftError(
                f"draft for {draft.key} has token {token!r} at position {position}; "
                f"token ids must be integers in [0, {vocab_size})"
            )
    return draft
