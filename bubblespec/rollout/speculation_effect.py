"""What speculation saved or cost in a run, estimated from the run itself (docs/design.md §8).

Verification is exact, so a shard decoded without drafts produces the very same tokens: only the forward passes
differ. Each rank therefore replays its shard as plain decoding would run it (:func:`plain_decode_passes`: the
built-in engine's continuous batching, up to ``max_batch_size`` sequences, one token per sequence per pass) and
charges every replayed pass with a cost model of its own passes:

- on the virtual clock, the clock's cost profile (the replay is what a run without drafts would have been charged,
  up to the engine's own scheduling);
- on the wall clock, a least-squares fit of the rank's measured pass times in this shard to the passes' sizes
  (tokens fed, positions and attention pairs computed with the engine's padding, logits sampled), with non-negative
  coefficients (:func:`fit_pass_cost`); the replay pads as the engine does.

A rank's ``seconds_saved_by_drafts`` is the cost of the replay's passes minus the cost of those it ran (both under the
same cost, so that a warm-up or a stall common to both cancels): negative when verifying drafts cost more than it
saved, and 0 for a shard without drafts on the built-in engine (whose schedule the replay is).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator, Sequence

from bubblespec.core.interfaces import ForwardPass, GenerationRequest, GenerationResult

PassCost = Callable[[ForwardPass], float]
FEATURES = ("num_tokens", "computed_tokens", "computed_attention_pairs", "sampled_logits")
"""What a pass's wall seconds are fitted to. Not the sequence count: a drafted pass spends time per sequence that a
plain one does not (proposing, verifying each draft token), and a fit that learns it from drafted passes would charge
it to every pass of the plain replay (measured: an estimate 54% too high on the collatz task with the ``suffix``
source, 10% with these features; BENCHMARKS.md)."""


def plain_decode_passes(
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    max_batch_size: int,
    vocab_size: int,
    padded: bool = False,
) -> Iterator[ForwardPass]:
    """The forward passes of decoding these requests without drafts: requests join in order as slots free up, a
    new one feeds its prompt and every other one its last token, each pass samples one token per sequence.
    ``padded``: as an engine that pads its batch computes them (:attr:`ForwardPass.padded_tokens`)."""
    waiting = list(zip(prompt_lengths, response_lengths, strict=True))[::-1]
    # (the pass after which it is done, its cache length then, its prompt length less the pass it joined in: its
    # context after a pass is that plus the pass's index)
    finishing: list[tuple[int, int, int]] = []
    decoding, cache, passes = 0, 0, 0  # sequences past their first pass, their cache lengths summed; passes run
    while waiting or finishing:
        new = []
        while waiting and len(finishing) < max_batch_size:
            prompt, response = waiting.pop()
            new.append(prompt)
            heapq.heappush(finishing, (passes + max(response, 1), prompt + max(response, 1) - 1, prompt - passes))
        rows = decoding + len(new)
        padded_tokens = rows * max(new, default=1) if padded else 0
        longest = max(offset for _, _, offset in finishing) + passes if padded else 0
        yield ForwardPass(
            num_sequences=rows,
            num_tokens=decoding + sum(new),
            context_tokens=cache + decoding + sum(new),
            attention_pairs=cache + decoding + sum(p * (p + 1) // 2 for p in new),
            sampled_logits=rows * vocab_size,
            padded_tokens=padded_tokens,
            padded_attention_pairs=padded_tokens * longest,
        )
        passes += 1
        cache += decoding + sum(new)
        decoding += len(new)
        while finishing and finishing[0][0] == passes:
            decoding, cache = decoding - 1, cache - heapq.heappop(finishing)[1]


class TimedPasses:
    """An ``on_forward`` listener that keeps each forward pass of a call with the wall seconds since the previous
    one (the first: since the listener was made, just before the call), less the seconds of the draft-head call
    that ran before it, which :attr:`head_seconds` sums (``head_clock``: the engine's running total of its head
    calls' seconds, ``TorchEngine.head_call_seconds``; None: an engine without a head)."""

    def __init__(self, head_clock: Callable[[], float] | None = None) -> None:
        self.passes: list[tuple[ForwardPass, float]] = []
        self.head_seconds = 0.0
        self._head_clock = head_clock
        self._last = time.perf_counter()
        self._last_head = head_clock() if head_clock else 0.0

    def __call__(self, forward: ForwardPass) -> None:
        now = time.perf_counter()
        head = self._head_clock() - self._last_head if self._head_clock else 0.0
        self.passes.append((forward, now - self._last - head))
        self.head_seconds += head
        self._last, self._last_head = now, self._last_head + head


class PassCostFit:
    """:func:`fit_pass_cost` over a call's timed passes, topped up with the latest passes of this rank's earlier
    calls to at least ``min_passes``: a shard that ran few passes (most of them long drafted chunks) says little about
    what a plain pass costs, and its fit alone extrapolated to the plain replay by up to a quarter (measured on the
    collatz task with the ``suffix`` source: 10% mean error per shard alone, 6.5% topped up to 1,024 passes)."""

    def __init__(self, min_passes: int = 1024) -> None:
        self.min_passes = min_passes
        self._earlier: list[tuple[ForwardPass, float]] = []

    def __call__(self, passes: Sequence[tuple[ForwardPass, float]]) -> PassCost:
        missing = max(self.min_passes - len(passes), 0)
        fitted = [*(self._earlier[len(self._earlier) - missing :] if missing else []), *passes]
        self._earlier = [*self._earlier, *passes][-self.min_passes :]
        return fit_pass_cost(fitted)


def fit_pass_cost(passes: Sequence[tuple[ForwardPass, float]]) -> PassCost:
    """Seconds of a pass as a non-negative combination of a constant and :data:`FEATURES`, fitted by least squares
    to measured passes: features that would get a negative weight are left out and the rest fitted again, then
    passes far slower than the fit says (a first call's warm-up, another process taking the core) are left out and
    it is fitted once more."""
    import numpy as np

    if not passes:
        return lambda forward: 0.0
    rows = np.array([[1.0, *(getattr(f, name) for name in FEATURES)] for f, _ in passes])
    seconds = np.array([s for _, s in passes])
    coefficients = _non_negative_fit(rows, seconds)
    residuals = seconds - rows @ coefficients
    spread = np.median(np.abs(residuals - np.median(residuals)))
    typical = residuals <= np.median(residuals) + 5 * max(spread, 1e-9)
    if typical.sum() >= rows.shape[1]:
        coefficients = _non_negative_fit(rows[typical], seconds[typical])

    def cost(forward: ForwardPass) -> float:
        return float(coefficients[0] + sum(coefficients[i + 1] * getattr(forward, n) for i, n in enumerate(FEATURES)))

    return cost


def _non_negative_fit(rows, seconds):
    import numpy as np

    scale = np.maximum(rows.max(axis=0), 1.0)
    kept = list(range(rows.shape[1]))
    while True:
        weights, *_ = np.linalg.lstsq(rows[:, kept] / scale[kept], seconds, rcond=None)
        negative = [k for k, w in zip(kept, weights, strict=True) if w < 0]
        if not negative:
            break
        kept.remove(min(negative, key=lambda k: weights[kept.index(k)]))
    coefficients = np.zeros(rows.shape[1])
    coefficients[kept] = weights / scale[kept]
    return coefficients


def seconds_saved(
    requests: Sequence[GenerationRequest],
    results: Sequence[GenerationResult],
    seconds: float,
    max_batch_size: int,
    vocab_size: int,
    cost: PassCost,
    padded: bool = False,
) -> float:
    """The plain-decoding replay's seconds under ``cost`` minus ``seconds``, those of generating ``results`` with
    drafts (under ``cost``): what the drafts saved (negative: what they cost). Preempted results count with the tokens
    they had. ``padded``: the engine pads its batches (:func:`plain_decode_passes`)."""
    plain = plain_decode_passes(
        [len(r.prompt_token_ids) for r in requests],
        [len(r.token_ids) for r in results],
        max_batch_size,
        vocab_size,
        padded,
    )
    return sum(cost(forward) for forward in plain) - seconds
