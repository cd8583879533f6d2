"""Keyed sampling and exact speculative verification, as pure tensor functions (docs/design.md §4).

Keyed sampling. For response position ``i`` of rollout key ``k`` with logits ``z`` and temperature ``T > 0``:

    y_i = argmax_v( mask(z / T)[v] + G(k, i, v) )

where ``mask`` removes the suppressed tokens, then applies top-k, top-p and min-p (computed from ``z`` itself,
masked entries become -inf), ``z``
has the repetition penalty applied first (a deterministic function of the logits and the tokens before position
``i``: prompt, response so far, and the draft tokens fed before it in a verify pass), and ``G`` is
standard Gumbel noise from a counter-based hash of ``(k, i, v)``. This is an exact sample of
``softmax(mask(z / T))`` and needs no RNG state, so any engine, batch composition or verification pass that
computes the logits of position ``i`` of key ``k`` picks the same token. ``T == 0`` is greedy (first argmax over
the tokens that are not suppressed). Suppressing a token changes no sample where it did not win: the others keep
their perturbed scores (top-p and min-p aside, which renormalise without it).
Ties in the perturbed scores go to the lowest token id.

The noise. The key's 64-bit seed ``(w0, w1)`` and the position ``i`` give a 64-bit stream state
``fmix64(seed64 ^ fmix64(i ^ salt))`` (MurmurHash3's finaliser, a bijection), whose halves are the words
``(a, b)``; for a fixed position two keys never share a state. Token ``v`` gets the 32-bit word
``h = f2(f1(a ^ t(v)) ^ b)``, with ``t(v)`` a hash of the token id (computed once per vocabulary size) and
``f1``, ``f2`` the two halves of the "lowbias32" finaliser (C. Wellons), in wrap-around int32 arithmetic; for a
fixed stream ``v -> h`` is a bijection. A second word ``l = lowbias32(h ^ a)`` refines it:

    U = ((h ^ 2**31) * 2**20 + (l >> 12) + 0.5) / 2**52,    G = -log(-log U)

``h ^ 2**31`` is the word read as a signed 32-bit integer plus 2**31, so the signed order of ``h`` is the order
of ``U``. Why 52 random bits suffice: U is an exact uniform rounded to the midpoint of its cell of width 2**-52,
so G is exact Gumbel noise moved by at most ``2**-52 / (U (-log U))`` (and capped at 36.7 in the last cell). A
sample can only change if the two best perturbed scores are closer than their noise moved, or if some token's
U falls in the last cell (probability ``V * 2**-52``, 3e-11 at V = 152k). The winner's U is typically within
``~1/V`` of 1, so its noise moves by ~``V * 2**-52``: the bias is of order 1e-10 per sample, which would take
some 1e20 samples to measure.

Cheap exact selection. ``keyed_sample`` does not compute G for every token. A token whose word is below the
top 2**-10 of its range ("not lucky") has ``U < 1 - 2**-10`` hence ``G < 6.94``; the lucky tokens (about
V / 1024) and the best-scoring token give a score ``L`` that the winner reaches, so the winner is lucky or has
``mask(z / T)[v] > L - 6.94``. Only those candidates get the exact float64 noise, and the result is the argmax
over every token, bit for bit (a test checks it against the full noise). Noise and selection are computed
from the logits converted to float64 whatever the model's dtype, so float32 and float64 engines share the
noise; greedy rows draw no noise. For top-K verification, ``keyed_gumbel_at`` gives G at chosen token ids and
``keyed_gumbel_max_outside`` the largest G outside a set of ids, without the float64 noise of every token.

Independent streams. ``stream_seeds(seeds, s)`` gives the seeds of stream ``s`` of each key: stream 0 is the
key itself, other streams are independent noise for the same key and positions (e.g. one-hot verification).

Coupled verification. A draft made with the same noise is checked against the keyed samples of one forward
pass over ``[last_token, d_1 .. d_K]``: accept ``d_j`` while ``y_j == d_j``; at the first mismatch emit ``y_j``;
if all match also emit ``y_{K+1}`` (the *bonus* token). The emitted tokens are exactly the ones plain keyed
decoding emits.

One-hot verification, for samplers that cannot take keyed noise: ``y_j ~ softmax(mask(z_j / T))`` from
randomness independent of the draft's, accepted iff ``y_j == d_j``. Exact in distribution (a mismatching
``y_j`` is a sample of the residual ``p`` without ``d_j``), lower acceptance.

This module imports torch and the standard library only: the SGLang backend ships its source to a server.
Shapes: B batch rows, T positions, V vocabulary, K draft tokens, R = B * T flattened rows, N candidates.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from bubblespec.core.errors import NonFiniteError

_MASK32 = 0xFFFFFFFF
_BIT31 = 1 << 31


def _signed(constant: int, bits: int) -> int:
    """The signed ``bits``-bit integer with the bits of ``constant`` (in [0, 2**bits))."""
    return constant - (1 << bits) if constant >= 1 << (bits - 1) else constant


# Multipliers of lowbias32 (C. Wellons) and of MurmurHash3's fmix64, and distinct salts that separate the hash
# streams of positions, token ids and noise streams.
_LOWBIAS_1, _LOWBIAS_2 = _signed(0x7FEB352D, 32), _signed(0x846CA68B, 32)
_FMIX_1, _FMIX_2 = _signed(0xFF51AFD7ED558CCD, 64), _signed(0xC4CEB9FE1A85EC53, 64)
_POSITION_SALT = 0x85EBCA6B27D4EB2F
_STREAM_SALT = 0x9E3779B97F4A7C15
_VOCAB_SALT = 0x165667B1
# A token is lucky when its word is in the top 2**-10 of its range: the signed word is >= this.
_LUCKY_BITS = 10
_LUCKY_WORD = _BIT31 - (1 << (32 - _LUCKY_BITS))
# Bound on G for the other tokens (U < 1 - 2**-10), rounded up for float64 rounding of log.
_UNLUCKY_GUMBEL_BOUND = -math.log(-math.log1p(-(2.0**-_LUCKY_BITS))) + 1e-9
# keyed_sample draws the noise of every token when a block has at most this many logits (fewer operations).
_FULL_NOISE_MAX_LOGITS = 4096
# keyed_sample draws the noise of the kept tokens only in blocks whose rows all keep at most this many (top-k).
_FEW_KEPT_TOKENS = 4096
# keyed_sample on CPU: rows per block such that a block holds about this many logits.
_CPU_BLOCK_ELEMENTS = 1 << 20


def _xorshift_(x: torch.Tensor, shift: int, scratch: torch.Tensor) -> None:
    """``x ^= x >>> shift`` in place on int32 or int64: the logical shift is the arithmetic one and a mask."""
    torch.bitwise_right_shift(x, shift, out=scratch)
    scratch.bitwise_and_((1 << (8 * x.element_size() - shift)) - 1)
    x.bitwise_xor_(scratch)


def _mix_first_(x: torch.Tensor, scratch: torch.Tensor) -> None:
    """First half of lowbias32 in place on int32: ``x ^= x >>> 16; x *= M1; x ^= x >>> 15`` (products wrap)."""
    _xorshift_(x, 16, scratch)
    x.mul_(_LOWBIAS_1)
    _xorshift_(x, 15, scratch)


def _mix_second_(x: torch.Tensor, scratch: torch.Tensor) -> None:
    """Second half of lowbias32 in place on int32: ``x *= M2; x ^= x >>> 16``."""
    x.mul_(_LOWBIAS_2)
    _xorshift_(x, 16, scratch)


def hash32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit finaliser lowbias32, a bijection, on int32 tensors (bits as two's complement)."""
    x = x.to(torch.int32, copy=True)
    scratch = torch.empty_like(x)
    _mix_first_(x, scratch)
    _mix_second_(x, scratch)
    return x


def fmix64(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 64-bit finaliser, a bijection, on int64 tensors (bits as two's complement):
    ``x ^= x >>> 33; x *= F1; x ^= x >>> 33; x *= F2; x ^= x >>> 33``."""
    x = x.to(torch.int64, copy=True)
    scratch = torch.empty_like(x)
    _xorshift_(x, 33, scratch)
    x.mul_(_FMIX_1)
    _xorshift_(x, 33, scratch)
    x.mul_(_FMIX_2)
    _xorshift_(x, 33, scratch)
    return x


def _seed64(seeds_B2: torch.Tensor) -> torch.Tensor:
    """Seeds (w0, w1) in [0, 2**32) as one 64-bit word ``w0 * 2**32 + w1``, [B] int64 (two's complement)."""
    seeds_B2 = seeds_B2.to(torch.int64)
    return torch.bitwise_left_shift(seeds_B2[:, 0], 32) | seeds_B2[:, 1]


@functools.lru_cache(maxsize=16)
def _hashed_token_ids(vocab_size: int, device: torch.device) -> torch.Tensor:
    """t(v) = hash32(v ^ VOCAB_SALT) for v < vocab_size, [V] int32: the same for every key, so computed once."""
    token_ids_V = torch.arange(vocab_size, device=device, dtype=torch.int64) ^ _VOCAB_SALT
    return hash32(token_ids_V.to(torch.int32))


def _stream_state(seeds_B2: torch.Tensor, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stream words (a, b) of every (key, position), each [B, T] int32: the high and low halves of
    ``fmix64(seed64 ^ fmix64(i ^ POSITION_SALT))``, a bijection of the 64-bit seed for each position i."""
    if seeds_B2.dim() != 2 or seeds_B2.shape[1] != 2 or seeds_B2.shape[0] != positions_BT.shape[0]:
        raise ValueError(
            f"seeds must have shape [batch, 2] with batch = {positions_BT.shape[0]}, got {tuple(seeds_B2.shape)}"
        )
    seed_B1 = _seed64(seeds_B2.to(positions_BT.device))[:, None]
    state_BT = fmix64(seed_B1 ^ fmix64(positions_BT.to(torch.int64) ^ _signed(_POSITION_SALT, 64)))
    return torch.bitwise_right_shift(state_BT, 32).to(torch.int32), state_BT.to(torch.int32)


def _token_words(a_R1: torch.Tensor, b_R1: torch.Tensor, hashed_ids: torch.Tensor) -> torch.Tensor:
    """h = f2(f1(a ^ t(v)) ^ b) for rows of stream words a, b [R, 1] and hashed token ids [V] (or [R, N]):
    [R, V] int32."""
    words = torch.bitwise_xor(a_R1, hashed_ids)
    scratch = torch.empty_like(words)
    _mix_first_(words, scratch)
    words.bitwise_xor_(b_R1)
    _mix_second_(words, scratch)
    return words


def _uniform_of_words(words: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """U in (0, 1), float64, from token words h and the stream word a (broadcastable shapes)."""
    low_bits = (hash32(words ^ a).to(torch.int64) & _MASK32) >> 12
    high_bits = words.to(torch.int64) + _BIT31  # = h ^ 2**31 read unsigned
    # A 52-bit integer; + 0.5 is exact in float64 and keeps U inside (0, 1).
    return ((high_bits * (1 << 20) + low_bits).to(torch.float64) + 0.5) / float(1 << 52)


def _gumbel_of_words(words: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """G = -log(-log U), float64."""
    return -torch.log(-torch.log(_uniform_of_words(words, a)))


def stream_seeds(seeds_B2: torch.Tensor, stream: int | torch.Tensor) -> torch.Tensor:
    """Seeds of noise stream ``stream`` of each key: [B, 2] int64 words in [0, 2**32).

    Stream 0 is the key's own noise (the seeds are returned unchanged); stream ``s > 0`` is independent noise for
    the same key and positions: the halves of ``fmix64(seed64 ^ fmix64(s ^ STREAM_SALT))``, a bijection of the
    64-bit seed for each s, so keys never share a stream. ``stream`` is an int or a [B] integer tensor with
    values in [0, 2**32).
    """
    if isinstance(stream, int) and not 0 <= stream <= _MASK32:
        raise ValueError(f"stream must be in [0, 2**32), got {stream!r}")
    stream_B = torch.as_tensor(stream, dtype=torch.int64, device=seeds_B2.device).expand(seeds_B2.shape[0])
    if stream_B.numel() and (int(stream_B.min()) < 0 or int(stream_B.max()) > _MASK32):
        raise ValueError(f"stream must be in [0, 2**32), got {stream!r}")
    derived_B = fmix64(_seed64(seeds_B2) ^ fmix64(stream_B ^ _signed(_STREAM_SALT, 64)))
    derived_B2 = torch.stack([torch.bitwise_right_shift(derived_B, 32) & _MASK32, derived_B & _MASK32], dim=1)
    return torch.where((stream_B == 0)[:, None], seeds_B2.to(torch.int64), derived_B2)


def _words_of_rows(
    seeds_B2: torch.Tensor, positions_BT: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token words h [R, V] int32 and stream words a [R, 1] int32 (which seed the refining word) of every row."""
    a_BT, b_BT = _stream_state(seeds_B2, positions_BT.to(torch.int64))
    hashed_ids_V = _hashed_token_ids(vocab_size, positions_BT.device)
    return _token_words(a_BT.reshape(-1, 1), b_BT.reshape(-1, 1), hashed_ids_V), a_BT.reshape(-1, 1)


def keyed_uniform(seeds_B2: torch.Tensor, positions_BT: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform noise U(k, i, v) in (0, 1) with 52 random bits, a pure function of (seed, position, token id).

    seeds_B2: [B, 2] int64, two 32-bit words per rollout key (``RolloutKey.noise_seed()``).
    positions_BT: [B, T] int64 response positions (0 = first generated token).
    Returns [B, T, V] float64.
    """
    words_RV, refine_R1 = _words_of_rows(seeds_B2, positions_BT, vocab_size)
    return _uniform_of_words(words_RV, refine_R1).reshape(*positions_BT.shape, vocab_size)


def keyed_gumbel(seeds_B2: torch.Tensor, positions_BT: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise G(k, i, v) = -log(-log U(k, i, v)) for every token, [B, T, V] float64."""
    return -torch.log(-torch.log(keyed_uniform(seeds_B2, positions_BT, vocab_size)))


def keyed_gumbel_at(seeds_B2: torch.Tensor, positions_BT: torch.Tensor, token_ids_BTK: torch.Tensor) -> torch.Tensor:
    """G(k_b, i_bt, v) at the given token ids only, [B, T, K] float64: ``keyed_gumbel(...).gather(-1, ids)``
    without the noise of the rest of the vocabulary."""
    a_BT, b_BT = _stream_state(seeds_B2, positions_BT.to(torch.int64))
    hashed_ids_BTK = hash32((token_ids_BTK.to(a_BT.device, torch.int64) ^ _VOCAB_SALT).to(torch.int32))
    words_BTK = _token_words(a_BT[..., None], b_BT[..., None], hashed_ids_BTK)
    return _gumbel_of_words(words_BTK, a_BT[..., None])


def keyed_gumbel_max_outside(
    seeds_B2: torch.Tensor, positions_BT: torch.Tensor, vocab_size: int, excluded_BTK: torch.Tensor
) -> torch.Tensor:
    """``max over v not in excluded[b, t] of G(k_b, i_bt, v)``, [B, T] float64 (-inf if every token is excluded).

    Equal to ``keyed_gumbel(...).scatter(-1, excluded, -inf).max(-1)`` but computes one 32-bit word per token and
    one logarithm pair per row: G is increasing in U, U is ordered by the signed word h (the refining bits only
    break ties within a word), and for a fixed stream no two tokens share a word. The bound of top-K
    verification (docs/design.md §4) uses it. excluded_BTK: [B, T, K] int64 token ids (repeats allowed).
    """
    batch, num_positions = positions_BT.shape
    words_RV, refine_R1 = _words_of_rows(seeds_B2, positions_BT, vocab_size)
    excluded_RK = excluded_BTK.to(words_RV.device, torch.int64).reshape(batch * num_positions, -1)
    outside_RV = torch.ones_like(words_RV, dtype=torch.bool).scatter_(1, excluded_RK, False)
    lowest = torch.iinfo(torch.int32).min
    best_word_R = words_RV.masked_fill(~outside_RV, lowest).max(-1).values
    gumbel_R = _gumbel_of_words(best_word_R[:, None], refine_R1)[:, 0]
    any_outside_R = outside_RV.any(-1)
    return torch.where(any_outside_R, gumbel_R, float("-inf")).reshape(batch, num_positions)


def mask_logits(
    logits_BTV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    min_p_B: torch.Tensor | None = None,
    penalty: RepetitionPenalty | None = None,
    suppressed_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """``mask(z / T)`` in float64: the repetition penalty, temperature, the suppressed tokens, then top-k, top-p and
    min-p; masked entries are -inf. The order of transformers' ``generate`` (and so of TRL's own generation): the
    penalty on the raw logits, the temperature, ``suppress_tokens``, then the filters.

    ``suppressed_BS``: [B, S] int64 token ids each row never samples, -1 (or an id outside the vocabulary) where
    padded; their score is -inf in every row, greedy rows too.

    The repetition penalty (``penalty``, see :class:`RepetitionPenalty`) divides the logit of every token seen before
    the position by the row's penalty where it is positive and multiplies it where it is not. top-k keeps every
    token whose logit is >= the k-th largest (ties at the boundary are kept); ``k == 0`` keeps all. top-p keeps, in
    order of decreasing probability (ties: lower token id first), each token whose preceding cumulative probability
    (summed in that order) is < p, so the most likely token is always kept. min-p keeps the tokens whose probability
    is at least ``min_p`` times the most likely one's (``min_p == 0`` keeps all). Rows with ``T == 0`` get the penalty
    and the suppression but are otherwise returned unscaled (greedy ignores the filters). Returns a new tensor.
    """
    batch, num_positions, vocab = logits_BTV.shape
    device = logits_BTV.device
    temperature_B = temperature_B.to(device, torch.float64)
    greedy_B = temperature_B == 0
    divisor_B = torch.where(greedy_B, 1.0, temperature_B)
    penalised = penalty is not None and penalty.active
    if bool((divisor_B == 1.0).all()) or penalised:
        scores_BTV = logits_BTV.to(torch.float64, copy=True)  # z / 1 == z exactly
    else:  # a float64 divisor promotes the logits: one float64 division, as float(z) / T
        scores_BTV = logits_BTV / divisor_B[:, None, None]
    scores_BTV = scores_BTV.contiguous()  # the filters mask in place through views
    if penalised:
        penalty.apply_(scores_BTV)
        if not bool((divisor_B == 1.0).all()):
            scores_BTV.div_(divisor_B[:, None, None])
    if suppressed_BS is not None and suppressed_BS.numel():
        scores_BTV.masked_fill_(suppressed_rows(suppressed_BS, vocab).to(device)[:, None, :], -math.inf)

    top_k_B = top_k_B.to(device, torch.int64)
    use_top_k_B = (top_k_B > 0) & (top_k_B < vocab) & ~greedy_B
    if bool(use_top_k_B.any()):
        _on_rows_(scores_BTV, use_top_k_B, lambda scores_STV, rows: _top_k_(scores_STV, top_k_B[rows]))
    top_p_B = top_p_B.to(device, torch.float64)
    use_top_p_B = (top_p_B < 1.0) & ~greedy_B
    if bool(use_top_p_B.any()):
        _on_rows_(scores_BTV, use_top_p_B, lambda scores, rows: _top_p_(scores, top_p_B[rows], use_top_k_B[rows]))
    if min_p_B is not None:
        min_p_B = min_p_B.to(device, torch.float64)
        use_min_p_B = (min_p_B > 0) & ~greedy_B
        if bool(use_min_p_B.any()):
            _on_rows_(scores_BTV, use_min_p_B, lambda scores, rows: _min_p_(scores, min_p_B[rows]))
    return scores_BTV


def suppressed_rows(suppressed_BS: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] bool, True at each row's suppressed token ids (``suppressed_BS``: [B, S] int64, -1 pads; ids outside
    the vocabulary are ignored)."""
    ids_BS = suppressed_BS.to(torch.int64)
    index_BS = torch.where((ids_BS >= 0) & (ids_BS < vocab_size), ids_BS, vocab_size)
    rows_BW = torch.zeros(ids_BS.shape[0], vocab_size + 1, dtype=torch.bool, device=ids_BS.device)
    return rows_BW.scatter_(-1, index_BS, True)[:, :vocab_size]


class RepetitionPenalty:
    """The repetition penalty of rows of logits: per batch row a penalty (1: none) and the token ids each position
    has seen.

    penalty_B: [B] float64 > 0. seen_BS: [B, S] int64, the ids before the first position of the row (prompt and
    response so far), -1 where padded. fed_BK (optional): [B, K] int64, the tokens fed at the positions of a verify
    pass (a draft), -1 where padded; position t also sees ``fed[:, :t]``. A token counts once however often it was
    seen (transformers' ``RepetitionPenaltyLogitsProcessor``, vLLM's ``repetition_penalty``).
    """

    def __init__(self, penalty_B: torch.Tensor, seen_BS: torch.Tensor, fed_BK: torch.Tensor | None = None) -> None:
        self.penalty_B = penalty_B.to(torch.float64)
        self.seen_BS = seen_BS.to(torch.int64)
        self.fed_BK = fed_BK.to(torch.int64) if fed_BK is not None else None
        self.active = bool((self.penalty_B != 1.0).any())

    def rows(self, start: int, stop: int, num_positions: int) -> RepetitionPenalty:
        """The penalty of rows ``[start, stop)`` of the flattened [B * T] rows, as rows of one position each."""
        batch_rows = torch.arange(start, stop) // num_positions
        offsets = torch.arange(start, stop) % num_positions
        seen = self.seen_BS[batch_rows.to(self.seen_BS.device)]
        if self.fed_BK is not None and self.fed_BK.shape[1]:
            fed = self.fed_BK[batch_rows.to(self.fed_BK.device)]
            visible = torch.arange(fed.shape[1], device=fed.device)[None, :] < offsets.to(fed.device)[:, None]
            seen = torch.cat([seen, fed.masked_fill(~visible, -1)], dim=1)
        return RepetitionPenalty(self.penalty_B[batch_rows.to(self.penalty_B.device)], seen)

    def apply_(self, scores_BTV: torch.Tensor) -> None:
        """Penalises ``scores_BTV`` (float64, raw logits) in place."""
        batch, num_positions, vocab = scores_BTV.shape
        device = scores_BTV.device
        ids_BTS = self.seen_BS.to(device)[:, None, :].expand(batch, num_positions, -1)
        if self.fed_BK is not None and self.fed_BK.shape[1]:
            fed_BK = self.fed_BK.to(device)
            visible_TK = (
                torch.arange(fed_BK.shape[1], device=device)[None, :]
                < torch.arange(num_positions, device=device)[:, None]
            )
            fed_BTK = fed_BK[:, None, :].expand(-1, num_positions, -1).masked_fill(~visible_TK[None], -1)
            ids_BTS = torch.cat([ids_BTS, fed_BTK], dim=-1)  # fmt: skip
        index_BTS = torch.where(ids_BTS >= 0, ids_BTS, vocab)  # padding lands in a column of its own
        seen_BTW = torch.zeros(batch, num_positions, vocab + 1, dtype=torch.bool, device=device)
        seen_BTV = seen_BTW.scatter_(-1, index_BTS, True)[..., :vocab]
        penalty_BTV = self.penalty_B.to(device)[:, None, None].expand_as(scores_BTV)
        penalised_BTV = torch.where(scores_BTV > 0, scores_BTV / penalty_BTV, scores_BTV * penalty_BTV)
        scores_BTV.copy_(torch.where(seen_BTV, penalised_BTV, scores_BTV))


def _min_p_(scores_STV: torch.Tensor, min_p_S: torch.Tensor) -> None:
    """Masks, in place, the tokens whose probability is below ``min_p`` times the row's largest (0 < min_p <= 1):
    ``score < best + log(min_p)``, the normaliser cancelling out."""
    best_ST1 = scores_STV.max(-1, keepdim=True).values
    threshold_ST1 = best_ST1 + torch.log(min_p_S)[:, None, None]
    scores_STV.masked_fill_(scores_STV < threshold_ST1, float("-inf"))


def _on_rows_(scores_BTV: torch.Tensor, selected_B: torch.Tensor, mask_) -> None:
    """Applies the in-place ``mask_(scores[rows], rows)`` to the selected rows (all of them without a copy)."""
    if bool(selected_B.all()):
        mask_(scores_BTV, torch.arange(len(selected_B), device=scores_BTV.device))
        return
    rows = selected_B.nonzero()[:, 0]
    selected_STV = scores_BTV[rows]
    mask_(selected_STV, rows)
    scores_BTV[rows] = selected_STV


def _top_k_(scores_STV: torch.Tensor, top_k_S: torch.Tensor) -> None:
    """Masks, in place, the tokens below the k-th largest score of each row (k per batch row, 0 < k < V)."""
    largest_STW = torch.topk(scores_STV, int(top_k_S.max()), dim=-1).values
    kth_index_ST1 = (top_k_S - 1)[:, None, None].expand(-1, scores_STV.shape[1], 1)
    scores_STV.masked_fill_(scores_STV < largest_STW.gather(-1, kth_index_ST1), float("-inf"))


def _top_p_(scores_STV: torch.Tensor, top_p_S: torch.Tensor, after_top_k_S: torch.Tensor) -> None:
    """Masks, in place, the tokens outside each row's nucleus (top-p per batch row, 0 < p < 1). Rows cut by top-k
    look at their kept tokens (the smallest positive probability is the threshold), others at an estimate."""
    batch, num_positions, vocab = scores_STV.shape
    scores_RV = scores_STV.view(batch * num_positions, vocab)
    top_p_R = _per_position(top_p_S, num_positions)
    after_top_k_R = _per_position(after_top_k_S, num_positions)
    probs_RV = torch.softmax(scores_RV, dim=-1)
    if bool(after_top_k_R.all()):
        tau_R = probs_RV.masked_fill(probs_RV == 0, 1.0).min(-1).values
    else:
        tau_R = _nucleus_threshold(scores_RV, probs_RV, top_p_R)
    keep_RV, decided_R = _nucleus_within(probs_RV, tau_R, top_p_R)
    if not bool(decided_R.all()):  # float rounding of the estimate: look at every token of those rows
        rows = (~decided_R).nonzero()[:, 0]
        keep_RV[rows] = _nucleus_within(probs_RV[rows], torch.zeros_like(top_p_R[rows]), top_p_R[rows])[0]
    scores_RV.masked_fill_(~keep_RV, float("-inf"))


def _nucleus_threshold(scores_RV: torch.Tensor, probs_RV: torch.Tensor, top_p_R: torch.Tensor) -> torch.Tensor:
    """A probability ``tau`` per row such that the tokens with ``p >= tau`` likely hold mass >= top_p, [R] float64.

    One pass: a histogram of the probability mass by distance below the best score, in bins of 1/4 nat.
    A token in bin ``b`` has ``p > p_max * exp(-(b + 1) / 4)``, so ``tau`` is that bound at the first bin where the
    cumulative mass reaches top-p (0, i.e. every token, if none does within 40 nats).
    """
    bins_per_nat, num_bins = 4.0, 160
    best_R = scores_RV.max(-1).values
    distance_RV = torch.sub(best_R[:, None], scores_RV).mul_(bins_per_nat).clamp_(max=num_bins - 1)
    mass_RN = torch.zeros(scores_RV.shape[0], num_bins, dtype=probs_RV.dtype, device=probs_RV.device)
    mass_RN.scatter_add_(1, distance_RV.to(torch.int64), probs_RV)
    reached_RN = mass_RN.cumsum(-1) >= top_p_R[:, None]
    first_bin_R = torch.where(reached_RN.any(-1), reached_RN.to(torch.int8).argmax(-1), num_bins - 1)
    tau_R = probs_RV.max(-1).values * torch.exp(-(first_bin_R + 1) / bins_per_nat) * (1 - 1e-9)
    return torch.where(first_bin_R < num_bins - 1, tau_R, 0.0)


def _nucleus_within(
    probs_RV: torch.Tensor, tau_R: torch.Tensor, top_p_R: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p keep mask [R, V] bool from the tokens with ``p >= tau`` only, and whether that decided it [R].

    Those tokens are a prefix of the full (probability desc, id asc) order, and the preceding cumulative
    probability (an exclusive running sum in that order) never decreases along it, so every later token is
    dropped once the prefix's total reaches p. Only the prefix is sorted.
    """
    num_rows, vocab = probs_RV.shape
    # Flat indices r * V + v (faster to gather with than pairs), ascending: by row, then by token id.
    flat_N = (probs_RV >= tau_R[:, None]).view(-1).nonzero()[:, 0]
    probs_N = probs_RV.reshape(-1)[flat_N]
    # Rows, then probability desc, id asc: two stable sorts of integers (the bits of a non-negative float64 are
    # ordered as its value), which torch sorts much faster than floats.
    order_N = torch.sort(-probs_N.view(torch.int64), stable=True).indices
    order_N = order_N[torch.sort(flat_N[order_N] // vocab, stable=True).indices]
    flat_N, probs_N = flat_N[order_N], probs_N[order_N]
    rows_N = flat_N // vocab
    counts_R = torch.bincount(rows_N, minlength=num_rows)
    slots_N = torch.arange(len(rows_N), device=probs_RV.device) - (counts_R.cumsum(0) - counts_R)[rows_N]
    width = int(counts_R.max()) + 1 if len(rows_N) else 1
    running_RW = torch.zeros(num_rows, width, dtype=probs_RV.dtype, device=probs_RV.device)
    running_at_N = rows_N * width + slots_N
    running_RW.view(-1)[running_at_N + 1] = probs_N
    running_RW = running_RW.cumsum(-1)  # running_RW[r, j]: probability before slot j of row r
    keep_RV = torch.zeros_like(probs_RV, dtype=torch.bool)
    keep_RV.view(-1)[flat_N] = running_RW.view(-1)[running_at_N] < top_p_R[rows_N]
    decided_R = (tau_R == 0) | (running_RW.gather(-1, counts_R[:, None])[:, 0] >= top_p_R)
    return keep_RV, decided_R


def keyed_sample(
    logits_BTV: torch.Tensor,
    seeds_B2: torch.Tensor,
    positions_BT: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    min_p_B: torch.Tensor | None = None,
    penalty: RepetitionPenalty | None = None,
    suppressed_BS: torch.Tensor | None = None,
    on_scores: Callable[[slice, ScoredRows], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keyed samples ``argmax_v(mask(z / T)[v] + G(k, i, v))`` and their log-probabilities at every position.

    Returns tokens [B, T] int64 and logprobs [B, T] float64 (under ``softmax(mask(z / T))``, the distribution
    sampled, penalty and filters included; under the penalised but otherwise raw distribution for greedy rows); a row
    whose logits are not all finite numbers (one NaN, +inf, or no finite logit at all) is a
    :class:`~bubblespec.core.errors.NonFiniteError`. ``min_p_B`` (None: 0), ``penalty`` and ``suppressed_BS`` (None:
    none) as in :func:`mask_logits`. Rows (b, t) are independent; on CPU they are processed a few at a time so that
    the float64 temporaries stay small (fresh large allocations cost more than the arithmetic there).
    ``on_scores(rows, scored)`` is called with each block's flat rows (``b * T + t``) and their
    :class:`ScoredRows`, so that what else is read from the masked scores (a runner-up,
    :mod:`bubblespec.verify.margins`) is computed from them once.
    """
    batch, num_positions, vocab = logits_BTV.shape
    device = logits_BTV.device
    num_rows = batch * num_positions
    if min_p_B is None:
        min_p_B = torch.zeros(batch, dtype=torch.float64)
    per_row = [
        seeds_B2.to(device, torch.int64)[:, None].expand(batch, num_positions, 2).reshape(num_rows, 2),
        positions_BT.to(device, torch.int64).reshape(num_rows, 1),
        *(_per_position(x.to(device), num_positions) for x in (temperature_B, top_k_B, top_p_B, min_p_B)),
    ]
    if suppressed_BS is None:
        suppressed_BS = torch.empty(batch, 0, dtype=torch.int64)
    per_row.append(suppressed_BS.to(device, torch.int64).repeat_interleave(num_positions, dim=0))
    penalised = penalty is not None and penalty.active
    logits_R1V = logits_BTV.reshape(num_rows, 1, vocab)
    tokens_R = torch.empty(num_rows, dtype=torch.int64, device=device)
    logprobs_R = torch.empty(num_rows, dtype=torch.float64, device=device)
    block = num_rows if device.type != "cpu" else max(1, _CPU_BLOCK_ELEMENTS // vocab)
    for start in range(0, num_rows, block):
        rows = slice(start, start + block)
        block_penalty = penalty.rows(start, min(start + block, num_rows), num_positions) if penalised else None
        scored = _keyed_sample_rows(logits_R1V[rows], *(x[rows] for x in per_row), block_penalty)
        tokens_R[rows], logprobs_R[rows] = scored.tokens_R, scored.logprobs_R
        if on_scores is not None:
            on_scores(rows, scored)
    return tokens_R.view(batch, num_positions), logprobs_R.view(batch, num_positions)


class ScoredRows(NamedTuple):
    """One block of :func:`keyed_sample`'s rows: the masked scores ``mask(z / T)`` in float64 and each row's key
    stream, temperature, sample and logprob."""

    scores_RV: torch.Tensor
    seeds_R2: torch.Tensor
    positions_R1: torch.Tensor
    temperature_R: torch.Tensor
    tokens_R: torch.Tensor
    logprobs_R: torch.Tensor


def _per_position(values_B: torch.Tensor, num_positions: int) -> torch.Tensor:
    """[B] -> [B * T]: each row's value repeated for its positions."""
    return values_B[:, None].expand(-1, num_positions).reshape(-1)


def _keyed_sample_rows(
    logits_R1V, seeds_R2, positions_R1, temperature_R, top_k_R, top_p_R, min_p_R, suppressed_RS, penalty
) -> ScoredRows:
    """:func:`keyed_sample` for rows of one position each: tokens [R] int64, logprobs [R] float64."""
    scores_R1V = mask_logits(logits_R1V, temperature_R, top_k_R, top_p_R, min_p_R, penalty, suppressed_RS)
    scores_RV = scores_R1V[:, 0]
    best_R, tokens_R = scores_RV.max(-1)  # the first argmax: greedy rows' token
    if not bool(torch.isfinite(best_R).all()):  # a NaN anywhere in a row makes its maximum NaN
        raise NonFiniteError(
            f"keyed sampling got logits that are not finite numbers in {int((~torch.isfinite(best_R)).sum())} of "
            f"{len(best_R)} rows (NaN, infinite, or no finite logit): the model's weights or activations are not "
            "finite, e.g. after a training update that diverged"
        )
    log_normaliser_R = torch.sub(scores_RV, best_R[:, None]).exp_().sum(-1).log_().add_(best_R)
    sampled_R = temperature_R != 0
    if bool((sampled_R & (top_k_R > 0) & (top_k_R <= _FEW_KEPT_TOKENS)).all()):
        tokens_R = _perturbed_argmax_of_kept(scores_RV, seeds_R2, positions_R1)
    elif bool(sampled_R.all()):
        tokens_R = _perturbed_argmax(scores_RV, seeds_R2, positions_R1, tokens_R)
    elif bool(sampled_R.any()):
        tokens_R[sampled_R] = _perturbed_argmax(
            scores_RV[sampled_R], seeds_R2[sampled_R], positions_R1[sampled_R], tokens_R[sampled_R]
        )
    logprobs_R = scores_RV.gather(-1, tokens_R[:, None])[:, 0] - log_normaliser_R
    return ScoredRows(scores_RV, seeds_R2, positions_R1, temperature_R, tokens_R, logprobs_R)


def _perturbed_argmax(
    scores_RV: torch.Tensor, seeds_B2: torch.Tensor, positions_BT: torch.Tensor, best_token_R: torch.Tensor
) -> torch.Tensor:
    """``argmax_v(scores[r, v] + G[r, v])`` (first on ties) for rows r = (b, t), [R] int64, with the exact float64
    noise of the lucky tokens and of those whose score is within the unlucky-noise bound of the best known.

    Lucky tokens and the best-scoring one give ``L_r = max(score + G)``, reached by the winner; an unlucky token
    has ``G < 6.94``, so it can only win if ``score > L_r - 6.94`` (less a margin for float64 rounding of
    ``score + G``). Among candidates sorted by token id the first maximum is the first maximum overall.
    """
    num_rows, vocab = scores_RV.shape
    words_RV, refine_R1 = _words_of_rows(seeds_B2, positions_BT, vocab)
    if num_rows * vocab <= _FULL_NOISE_MAX_LOGITS:  # small blocks: fewer operations with every token's noise
        return (scores_RV + _gumbel_of_words(words_RV, refine_R1)).argmax(-1)
    lucky_rows, lucky_tokens = (words_RV >= _LUCKY_WORD).nonzero(as_tuple=True)
    all_rows = torch.arange(num_rows, device=scores_RV.device)
    rows_N, tokens_N = torch.cat([lucky_rows, all_rows]), torch.cat([lucky_tokens, best_token_R])
    reached_R = _row_max(_candidate_scores(scores_RV, words_RV, refine_R1, rows_N, tokens_N), rows_N, num_rows)
    threshold_R = reached_R - _UNLUCKY_GUMBEL_BOUND - 1e-6 * (1.0 + reached_R.abs())
    close_rows, close_tokens = (scores_RV >= threshold_R[:, None]).nonzero(as_tuple=True)
    rows_N, tokens_N = torch.cat([rows_N, close_rows]), torch.cat([tokens_N, close_tokens])
    perturbed_N = _candidate_scores(scores_RV, words_RV, refine_R1, rows_N, tokens_N)
    return _first_best(perturbed_N, rows_N, tokens_N, num_rows, vocab)


def _perturbed_argmax_of_kept(scores_RV: torch.Tensor, seeds_R2: torch.Tensor, positions_R1: torch.Tensor):
    """``argmax_v(scores[r, v] + G[r, v])`` (first on ties), [R] int64, for rows that top-k cut to a few tokens:
    the exact noise of the finite-score tokens only."""
    num_rows, vocab = scores_RV.shape
    rows_N, tokens_N = torch.isfinite(scores_RV).nonzero(as_tuple=True)
    a_R1, b_R1 = _stream_state(seeds_R2, positions_R1)
    words_N = _token_words(a_R1[rows_N, 0], b_R1[rows_N, 0], _hashed_token_ids(vocab, scores_RV.device)[tokens_N])
    perturbed_N = scores_RV[rows_N, tokens_N] + _gumbel_of_words(words_N, a_R1[rows_N, 0])
    return _first_best(perturbed_N, rows_N, tokens_N, num_rows, vocab)


def _first_best(perturbed_N, rows_N, tokens_N, num_rows: int, vocab: int) -> torch.Tensor:
    """Per row, the lowest token id among the candidates with the row's largest perturbed score, [R] int64."""
    is_best_N = perturbed_N == _row_max(perturbed_N, rows_N, num_rows)[rows_N]
    first_R = torch.full((num_rows,), vocab, dtype=torch.int64, device=perturbed_N.device)
    return first_R.scatter_reduce_(0, rows_N[is_best_N], tokens_N[is_best_N], "amin")


def _candidate_scores(scores_RV, words_RV, refine_R1, rows_N, tokens_N) -> torch.Tensor:
    """``scores[r, v] + G[r, v]`` at the candidate (row, token) pairs, [N] float64."""
    gumbel_N = _gumbel_of_words(words_RV[rows_N, tokens_N], refine_R1[rows_N, 0])
    return scores_RV[rows_N, tokens_N] + gumbel_N


def _row_max(values_N: torch.Tensor, rows_N: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Per-row maximum of values at (row-indexed) candidates, [R] float64 (-inf for rows without candidates)."""
    initial_R = torch.full((num_rows,), float("-inf"), dtype=values_N.dtype, device=values_N.device)
    return initial_R.scatter_reduce_(0, rows_N, values_N, "amax")


def count_accepted(sampled_BT: torch.Tensor, draft_BK: torch.Tensor, num_draft_B: torch.Tensor) -> torch.Tensor:
    """Number of leading draft tokens equal to the verifier's samples (coupled and one-hot verification alike).

    sampled_BT: [B, T] with T >= K + 1; ``sampled[:, j]`` is the sample at the position of ``draft[:, j]``.
    draft_BK: [B, K] proposed tokens (entries at j >= num_draft[b] are padding and ignored).
    num_draft_B: [B] proposed tokens per row (0 means a plain decode step).
    Returns [B] int64: accepted tokens a; the row then emits ``sampled[:, :a + 1]`` (a accepted + 1 sampled).
    """
    num_slots = draft_BK.shape[1]
    if num_slots == 0:
        return torch.zeros(sampled_BT.shape[0], dtype=torch.int64, device=sampled_BT.device)
    in_draft_BK = torch.arange(num_slots, device=draft_BK.device)[None, :] < num_draft_B[:, None]
    match_BK = (sampled_BT[:, :num_slots] == draft_BK) & in_draft_BK
    return torch.cumprod(match_BK.to(torch.int64), dim=1).sum(dim=1)
