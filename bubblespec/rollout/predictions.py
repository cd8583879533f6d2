"""Predicted response lengths, for bubble policies that draft the longest responses first.

A key's own draft is the best predictor: it is a response of the policy one step older, sampled with the same
keyed noise. A finished draft predicts the length; an unfinished one (cut off by a barrier) is a lower bound.
Without a draft, the mean length of the responses to the same prompt the last time it was sampled (prompts
repeat once per epoch) predicts it. A key with neither has no prediction: policies order those keys by coverage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from bubblespec.core.interfaces import Draft, GenerationResult, RolloutKey


class ResponseLengths:
    """The mean response length per prompt uid at the latest step that sampled the prompt, for at most
    ``max_prompts`` prompts: the prompts sampled longest ago are forgotten first."""

    def __init__(self, max_prompts: int = 32_768) -> None:
        if max_prompts < 1:
            raise ValueError(f"max_prompts must be at least 1, got {max_prompts!r}")
        self.max_prompts = max_prompts
        self._mean_by_uid: dict[str, int] = {}

    def observe(self, results: Iterable[GenerationResult]) -> None:
        """Remembers the mean length (rounded) of the responses of each prompt in ``results`` (one step's)."""
        lengths_by_uid: dict[str, list[int]] = {}
        for result in results:
            lengths_by_uid.setdefault(result.key.prompt_uid, []).append(len(result.token_ids))
        for uid, lengths in lengths_by_uid.items():
            self._mean_by_uid.pop(uid, None)  # re-inserted last: the most recently sampled
            self._mean_by_uid[uid] = round(sum(lengths) / len(lengths))
        for uid in list(self._mean_by_uid)[: max(len(self._mean_by_uid) - self.max_prompts, 0)]:
            del self._mean_by_uid[uid]

    def get(self, prompt_uid: str) -> int | None:
        return self._mean_by_uid.get(prompt_uid)

    def snapshot(self) -> list[list]:
        """``[[uid, length], ...]`` oldest first, for a checkpoint's JSON (a resumed run forgets in the same order)."""
        return [[uid, length] for uid, length in self._mean_by_uid.items()]

    def restore(self, snapshot: Sequence[Sequence]) -> None:
        """Forgets everything, then remembers a :meth:`snapshot`."""
        self._mean_by_uid = {str(uid): int(length) for uid, length in snapshot}


def predicted_lengths(
    keys: Sequence[RolloutKey], drafts: Mapping[RolloutKey, Draft], lengths: ResponseLengths
) -> dict[RolloutKey, int]:
    """Each key's predicted response length: its finished draft's length; the larger of its unfinished draft's
    length (a lower bound) and its prompt's last mean length; that mean alone; or nothing (key left out)."""
    predicted = {}
    for key in keys:
        draft, seen = drafts.get(key), lengths.get(key.prompt_uid)
        if draft is not None and draft.finished:
            predicted[key] = len(draft.token_ids)
        elif draft is not None:
            predicted[key] = max(len(draft.token_ids), seen or 0)
        elif seen is not None:
            predicted[key] = seen
    return predicted
