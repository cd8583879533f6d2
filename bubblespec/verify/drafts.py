"""Draft checks shared by every engine and draft store."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from bubblespec.core.errors import DraftError
from bubblespec.core.interfaces import Draft, RolloutKey, SamplingParams


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


def realign(
    tokens: Sequence[int], draft: Sequence[int], offset: int, match_length: int = 6, window: int = 16
) -> int | None:
    """Re-aligns a draft after a mismatch: the offset ``o`` (draft index = response position + o) nearest to
    ``offset`` at which the last ``match_length`` response tokens end in the draft; None if no window matches.

    A policy step often inserts or deletes a token (a carry, a word) and leaves the rest of the response as the
    draft had it, one position off; the suffix match finds where the draft continues. Only speed depends on it:
    the verifier decides every token.
    """
    length = len(tokens)
    if length < match_length:
        return None
    suffix = list(tokens[length - match_length :])
    for delta in sorted(range(-window, window + 1), key=abs):
        end = length + offset + delta
        if match_length <= end <= len(draft) and list(draft[end - match_length : end]) == suffix:
            return offset + delta
    return None


def check_request(index: int, request: object, vocab_size: int, context_length: int, reserve: int = 0) -> None:
    """The checks every engine makes before any work starts; a bad request fails the whole call with a clear error.

    ``reserve`` is context an engine keeps back beyond the prompt (SGLang needs prompt + 1 < context).
    """
    from bubblespec.core.errors import RequestError
    from bubblespec.core.interfaces import GenerationRequest

    if not isinstance(request, GenerationRequest):
        raise RequestError(f"request {index} is a {type(request).__name__}, expected a GenerationRequest")
    prompt = request.prompt_token_ids
    if len(prompt) == 0:
        raise RequestError(f"request {index} ({request.key}) has an empty prompt")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"request {index} ({request.key}) has prompt token ids {bad[:5]} outside [0, {vocab_size})")
    outside = [t for t in request.sampling.suppressed_token_ids if t >= vocab_size]
    if outside:
        raise RequestError(
            f"request {index} ({request.key}) suppresses token ids {outside[:5]} outside [0, {vocab_size})"
        )
    if len(prompt) + reserve >= context_length:
        raise RequestError(
            f"request {index} ({request.key}): prompt of {len(prompt)} tokens leaves no room in the model's "
            f"context of {context_length} tokens"
        )
    if request.draft is not None:
        validate_draft(request.draft, vocab_size)


def stop_token_ids(params: SamplingParams, eos_ids: Sequence[int]) -> frozenset[int]:
    """The tokens that end a response: the request's stop ids, and the model's EOS ids unless it ignores EOS."""
    return frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else eos_ids)
