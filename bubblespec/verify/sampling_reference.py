"""Loop-based reference implementations of :mod:`bubblespec.verify.sampling`, written for reading, not speed.

Plain Python integers and floats, one scalar at a time, following docs/design.md §4 literally. The tests check the
vectorised functions against these on random inputs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from bubblespec.verify import sampling as _vectorised

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1


def _mix_first(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    return x ^ (x >> 15)


def _mix_second(x: int) -> int:
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def hash32(x: int) -> int:
    """lowbias32 on an integer in [0, 2**32)."""
    return _mix_second(_mix_first(x))


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finaliser on an integer in [0, 2**64)."""
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _MASK64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _MASK64
    return x ^ (x >> 33)


def stream_state(seed: tuple[int, int], position: int) -> tuple[int, int]:
    """The stream words (a, b) of one key seed (w0, w1) at one response position."""
    state = fmix64(((seed[0] << 32) | seed[1]) ^ fmix64((position & _MASK64) ^ _vectorised._POSITION_SALT))
    return state >> 32, state & _MASK32


def token_word(seed: tuple[int, int], position: int, token: int) -> int:
    """The 32-bit word h of one token: ``f2(f1(a ^ t(v)) ^ b)``, unsigned."""
    a, b = stream_state(seed, position)
    return _mix_second(_mix_first(a ^ hash32(token ^ _vectorised._VOCAB_SALT)) ^ b)


def keyed_uniform(seed: tuple[int, int], position: int, token: int) -> float:
    """U(k, i, v): 32 bits of the token word (top bit flipped) then 20 bits of the refining word hash32(h ^ a)."""
    word = token_word(seed, position, token)
    refine = hash32(word ^ stream_state(seed, position)[0])
    return (((word ^ (1 << 31)) << 20) + (refine >> 12) + 0.5) / float(1 << 52)


def keyed_gumbel(seed: tuple[int, int], position: int, token: int) -> float:
    """G(k, i, v) for one key seed, one response position and one token id."""
    return -math.log(-math.log(keyed_uniform(seed, position, token)))


def keyed_gumbel_max_outside(seed: tuple[int, int], position: int, vocab: int, excluded: Sequence[int]) -> float:
    """The largest G(k, i, v) over tokens v not in ``excluded``."""
    outside = set(range(vocab)) - set(excluded)
    return max((keyed_gumbel(seed, position, v) for v in outside), default=-math.inf)


def stream_seeds(seed: tuple[int, int], stream: int) -> tuple[int, int]:
    """The seed of noise stream ``stream`` of a key: itself for stream 0."""
    if stream == 0:
        return seed
    derived = fmix64(((seed[0] << 32) | seed[1]) ^ fmix64(stream ^ _vectorised._STREAM_SALT))
    return derived >> 32, derived & _MASK32


def mask_logits(
    logits: Sequence[float],
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    seen: Sequence[int] = (),
    suppressed: Sequence[int] = (),
) -> list[float]:
    """``mask(z / T)`` for one position: the repetition penalty on the tokens in ``seen``, temperature, the
    ``suppressed`` tokens removed (greedy too), top-k, top-p, then min-p."""
    logits = [float(z) for z in logits]
    for v in set(seen):
        logits[v] = logits[v] / repetition_penalty if logits[v] > 0 else logits[v] * repetition_penalty
    for v in suppressed:
        logits[v] = -math.inf
    if temperature == 0:
        return logits
    scores = [z / temperature for z in logits]
    vocab = len(scores)
    if 0 < top_k < vocab:
        kth_largest = sorted(scores, reverse=True)[top_k - 1]
        scores = [s if s >= kth_largest else -math.inf for s in scores]
    if top_p < 1.0:
        probs = _softmax(scores)
        order = sorted(range(vocab), key=lambda v: -probs[v])  # stable: ties keep the lower id first
        preceding = 0.0
        for v in order:
            if preceding >= top_p:
                scores[v] = -math.inf
            preceding += probs[v]
    if min_p > 0:
        probs = _softmax(scores)
        largest = max(probs)
        scores = [s if probs[v] >= min_p * largest else -math.inf for v, s in enumerate(scores)]
    return scores


def keyed_sample(
    logits: Sequence[float],
    seed: tuple[int, int],
    position: int,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    seen: Sequence[int] = (),
    suppressed: Sequence[int] = (),
) -> tuple[int, float]:
    """The keyed sample at one position and its log-probability."""
    scores = mask_logits(logits, temperature, top_k, top_p, min_p, repetition_penalty, seen, suppressed)
    if temperature == 0:
        token = max(range(len(scores)), key=lambda v: (scores[v], -v))
    else:
        token = max(range(len(scores)), key=lambda v: scores[v] + keyed_gumbel(seed, position, v))
    return token, _log_softmax(scores)[token]


def count_accepted(sampled: Sequence[int], draft: Sequence[int]) -> int:
    """Leading draft tokens equal to the verifier's samples."""
    accepted = 0
    for sample, proposal in zip(sampled, draft, strict=False):
        if sample != proposal:
            break
        accepted += 1
    return accepted


def one_hot_verify(
    probs_per_position: Sequence[Sequence[float]], draft: Sequence[int], rng: random.Random
) -> list[int]:
    """One-hot verification of ``draft`` against exact per-position distributions: the emitted tokens.

    ``probs_per_position[j]`` is the verifier's distribution at the position of ``draft[j]`` given the draft
    prefix; it has one more entry than ``draft`` (the bonus position).
    """
    emitted = []
    for j, probs in enumerate(probs_per_position):
        token = rng.choices(range(len(probs)), weights=probs)[0]
        emitted.append(token)
        if j >= len(draft) or token != draft[j]:
            break
    return emitted


def _softmax(scores: Sequence[float]) -> list[float]:
    top = max(scores)
    weights = [math.exp(s - top) if s != -math.inf else 0.0 for s in scores]
    total = sum(weights)
    return [w / total for w in weights]


def _log_softmax(scores: Sequence[float]) -> list[float]:
    top = max(scores)
    log_total = top + math.log(sum(math.exp(s - top) for s in scores if s != -math.inf))
    return [s - log_total for s in scores]
