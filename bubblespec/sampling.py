"""Keyed sampling and exact speculative verification, as pure tensor functions (DESIGN.md §4).

Keyed sampling. For response position ``i`` of rollout key ``k`` with logits ``z`` and temperature ``T > 0``:

    y_i = argmax_v( mask(z / T)[v] + G(k, i, v) )

where ``mask`` applies top-k then top-p (computed from ``z`` itself, masked entries become -inf) and ``G`` is
standard Gumbel noise from a counter-based hash of ``(k, i, v)``. This is an exact sample of
``softmax(mask(z / T))`` and needs no RNG state, so any engine, batch composition or verification pass that
computes the logits of position ``i`` of key ``k`` picks the same token. ``T == 0`` is greedy (first argmax).

Coupled verification. A draft made with the same noise is checked against the keyed samples of one forward
pass over ``[last_token, d_1 .. d_K]``: accept ``d_j`` while ``y_j == d_j``; at the first mismatch emit ``y_j``;
if all match also emit ``y_{K+1}`` (the *bonus* token). The emitted tokens are exactly the ones plain keyed
decoding emits.

One-hot verification, for samplers that cannot take keyed noise: ``y_j ~ softmax(mask(z_j / T))`` from the
engine's own RNG, accepted iff ``y_j == d_j``. Exact in distribution (a mismatching ``y_j`` is a sample of the
residual ``p`` without ``d_j``), lower acceptance.

Noise and the final selection are computed in float64 whatever the model's dtype, so float32 and float64
engines share the same noise. Shapes: B batch rows, T positions, V vocabulary, K draft tokens.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# Distinct odd constants that separate the hash streams of keys, positions and vocabulary ids.
_KEY_SALT = 0x9E3779B9
_POSITION_SALT = 0x85EBCA6B
_VOCAB_SALT_HI = 0xC2B2AE35
_VOCAB_SALT_LO = 0x27D4EB2F
_SECOND_WORD_SALT = 0x165667B1


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser ("lowbias32", C. Wellons) on int64 tensors holding values in [0, 2**32).

    The products overflow int64 for large inputs; two's-complement wrap-around keeps the low 32 bits exact.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def keyed_uniform(seeds_B2: torch.Tensor, positions_BT: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform noise in (0, 1) with 52 random bits, a pure function of (seed, position, token id).

    seeds_B2: [B, 2] int64, two 32-bit words per rollout key (``RolloutKey.noise_seed()``).
    positions_BT: [B, T] int64 response positions (0 = first generated token).
    Returns [B, T, V] float64.
    """
    device = positions_BT.device
    seeds_B2 = seeds_B2.to(device=device, dtype=torch.int64)
    key_B = hash32(seeds_B2[:, 0] ^ hash32(seeds_B2[:, 1] ^ _KEY_SALT))
    stream_BT = hash32(key_B[:, None] ^ hash32((positions_BT.to(torch.int64) + _POSITION_SALT) & _MASK32))
    stream2_BT = hash32(stream_BT ^ _SECOND_WORD_SALT)
    vocab_V = torch.arange(vocab_size, device=device, dtype=torch.int64)
    high_BTV = hash32(stream_BT[..., None] ^ hash32(vocab_V ^ _VOCAB_SALT_HI))
    low_BTV = hash32(stream2_BT[..., None] ^ hash32(vocab_V ^ _VOCAB_SALT_LO))
    # Two 26-bit halves make a 52-bit integer; + 0.5 is exact in float64 and keeps the result inside (0, 1).
    bits_BTV = (high_BTV >> 6) * (1 << 26) + (low_BTV >> 6)
    return (bits_BTV.to(torch.float64) + 0.5) / float(1 << 52)


def keyed_gumbel(seeds_B2: torch.Tensor, positions_BT: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise G(k, i, v), [B, T, V] float64."""
    return -torch.log(-torch.log(keyed_uniform(seeds_B2, positions_BT, vocab_size)))


def mask_logits(
    logits_BTV: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor
) -> torch.Tensor:
    """``mask(z / T)`` in float64: temperature, then top-k, then top-p; masked entries are -inf.

    top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are kept); ``k == 0`` keeps
    all. top-p keeps, in order of decreasing probability (ties: lower token id first), each token whose
    preceding cumulative probability is < p, so the most likely token is always kept. Rows with ``T == 0`` are
    returned unscaled (greedy ignores the filters).
    """
    scores = logits_BTV.to(torch.float64)
    batch, _, vocab = scores.shape
    temperature = temperature_B.to(scores.device, torch.float64)
    greedy_B = temperature == 0
    scores = scores / torch.where(greedy_B, 1.0, temperature)[:, None, None]

    top_k = top_k_B.to(scores.device, torch.int64)
    use_top_k_B = (top_k > 0) & (top_k < vocab) & ~greedy_B
    if use_top_k_B.any():
        sorted_desc = torch.sort(scores, dim=-1, descending=True).values
        kth_index = (top_k.clamp(1, vocab) - 1)[:, None, None].expand(batch, scores.shape[1], 1)
        threshold_BT1 = torch.gather(sorted_desc, -1, kth_index)
        drop = (scores < threshold_BT1) & use_top_k_B[:, None, None]
        scores = scores.masked_fill(drop, float("-inf"))

    top_p = top_p_B.to(scores.device, torch.float64)
    use_top_p_B = (top_p < 1.0) & ~greedy_B
    if use_top_p_B.any():
        probs = torch.softmax(scores, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        preceding = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = (preceding >= top_p[:, None, None]) & use_top_p_B[:, None, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def keyed_sample(
    logits_BTV: torch.Tensor,
    seeds_B2: torch.Tensor,
    positions_BT: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keyed samples and their log-probabilities at every position.

    Returns tokens [B, T] int64 and logprobs [B, T] float64 (under ``softmax(mask(z / T))``; under the raw
    distribution for greedy rows).
    """
    scores_BTV = mask_logits(logits_BTV, temperature_B, top_k_B, top_p_B)
    greedy_B = temperature_B.to(scores_BTV.device) == 0
    noise_BTV = keyed_gumbel(seeds_B2, positions_BT, scores_BTV.shape[-1])
    perturbed = torch.where(greedy_B[:, None, None], scores_BTV, scores_BTV + noise_BTV)
    tokens_BT = torch.argmax(perturbed, dim=-1)
    return tokens_BT, _logprobs_of(scores_BTV, tokens_BT)


def engine_sample(
    logits_BTV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples from ``softmax(mask(z / T))`` with an RNG instead of keyed noise (the one-hot verification path).
    Returns tokens [B, T] and logprobs [B, T] like :func:`keyed_sample`."""
    scores_BTV = mask_logits(logits_BTV, temperature_B, top_k_B, top_p_B)
    batch, positions, vocab = scores_BTV.shape
    probs = torch.softmax(scores_BTV, dim=-1).reshape(batch * positions, vocab)
    sampled_BT = torch.multinomial(probs, 1, generator=generator).reshape(batch, positions)
    greedy_B = temperature_B.to(scores_BTV.device) == 0
    tokens_BT = torch.where(greedy_B[:, None], scores_BTV.argmax(-1), sampled_BT)
    return tokens_BT, _logprobs_of(scores_BTV, tokens_BT)


def _logprobs_of(scores_BTV: torch.Tensor, tokens_BT: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(scores_BTV, dim=-1).gather(-1, tokens_BT[..., None]).squeeze(-1)


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
