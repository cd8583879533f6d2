"""Draft checks shared by every engine and draft store."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from bubblespec.core.errors import DraftError
from bubblespec.core.interfaces import Draft, DraftBranch, NearTie, RolloutKey, SamplingParams


def validate_draft(draft: object, vocab_size: int) -> Draft:
    """Refuses a malformed draft with a message that names what is wrong; returns it unchanged otherwise.

    Well-formed but useless drafts (random, stale, truncated, over-long, another key's) are accepted: they can
    only cost speed, never change an output.
    """
    if not isinstance(draft, Draft):
        raise DraftError(f"expected a Draft, got {type(draft).__name__}")
    if not isinstance(draft.key, RolloutKey):
        raise DraftError(f"draft key must be a RolloutKey, got {type(draft.key).__name__}")
    _check_path(draft, draft.token_ids, 0, draft.near_ties, draft.branches, vocab_size, "")
    return draft


def _check_path(draft, tokens, start: int, near_ties, branches, vocab_size: int, where: str) -> None:
    """A draft's path (or a branch's, from index ``start``), its near-ties and its branches, recursively."""
    for position, token in enumerate(tokens, start):
        if not isinstance(token, numbers.Integral) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise DraftError(
                f"draft for {draft.key}{where} has token {token!r} at position {position}; "
                f"token ids must be integers in [0, {vocab_size})"
            )
    end = start + len(tokens)
    for tie in near_ties:
        if not isinstance(tie, NearTie) or not start <= tie.index < end or not 0 <= tie.token < vocab_size:
            raise DraftError(
                f"draft for {draft.key}{where} has near-tie {tie!r}; a NearTie's index must be within the path's "
                f"positions [{start}, {end}) and its token in [0, {vocab_size})"
            )
    for branch in branches:
        if not isinstance(branch, DraftBranch):
            raise DraftError(f"draft for {draft.key}{where} has a branch of type {type(branch).__name__}")
        # a branch leaves the path at one of its positions, with a token other than the path's there
        within = start <= branch.index < end and branch.token_ids
        if not within or branch.token_ids[0] == tokens[branch.index - start]:
            raise DraftError(
                f"draft for {draft.key}{where} has a branch at index {branch.index} starting "
                f"{list(branch.token_ids[:1])}; a branch starts within the path's positions [{start}, {end}) with a "
                "token other than the path's"
            )
        inner = f"{where} (branch at {branch.index})"
        _check_path(draft, branch.token_ids, branch.index, branch.near_ties, branch.branches, vocab_size, inner)


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


def check_request(
    index: int, request: object, vocab_size: int, context_length: int, reserve: int = 0, tries: bool = False
) -> None:
    """The checks every engine makes before any work starts; a bad request fails the whole call with a clear error.

    ``reserve`` is context an engine keeps back beyond the prompt (SGLang needs prompt + 1 < context); ``tries``:
    the engine takes a response prefix (``Engine.supports_draft_tries``).
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
    prefix = request.response_prefix
    if prefix and not tries:
        raise RequestError(
            f"request {index} ({request.key}) has a response prefix, which this engine does not take: only engines "
            "that draft tries (supports_draft_tries, the torch engine) begin a response with given tokens"
        )
    bad = [t for t in prefix if not (isinstance(t, numbers.Integral) and 0 <= t < vocab_size)]
    if bad:
        raise RequestError(
            f"request {index} ({request.key}) has response prefix token ids {bad[:5]} outside [0, {vocab_size})"
        )


def stop_token_ids(params: SamplingParams, eos_ids: Sequence[int]) -> frozenset[int]:
    """The tokens that end a response: the request's stop ids, and the model's EOS ids unless it ignores EOS."""
    return frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else eos_ids)
