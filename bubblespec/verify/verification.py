"""Verification of draft tokens from what an engine returns: full logits, or only the top-K log-probabilities
(docs/design.md §4 and §9). Pure tensor functions, called by every backend.

From full logits (the torch engine), the keyed sample of every scored position is computed exactly
(:func:`bubblespec.verify.sampling.keyed_sample`) and a draft token is accepted while it equals that sample
(:func:`accepted_length`).

From top-K log-probabilities (vLLM and SGLang score ``prefix + draft`` in one prefill and return, per position,
``l_v = log_softmax(z)_v`` for the K most likely tokens, often also for the draft token). ``l`` is ``z`` shifted by
a per-position constant, so the keyed sample ``argmax_v mask(l / T)_v + G(k, i, v)`` is the same. Every token
outside the listed ones has ``l_v <= l_K``, the K-th largest of the top K (never the smallest listed value: a
listed draft token outside the top K may sit far below ``l_K`` while unlisted tokens sit between), so the sample
is *decided* by the listed tokens when the best listed candidate ``y`` satisfies

    l_y / T + G(k, i, y)  >  l_K / T + max_{v unlisted} G(k, i, v)

or when no unlisted token survives top-k / top-p. top-k and top-p need to know which tokens they keep: the
K-th largest of the top K gives top-k's threshold when ``k <= K``; top-p needs the normaliser, which is bounded
from the unlisted probability mass ``U = 1 - sum_listed exp(l_v)`` (each unlisted ``p_v <= exp(l_K)``). A listed
token is *certainly kept*, *certainly dropped* or *possibly kept* by those bounds; the sample is decided when the
best certainly-kept candidate beats every possibly-kept one. An undecided position is decoded by the engine as
one plain keyed token; verification goes on after it.

The log-probability of a decided sample is exact when the kept set's normaliser is known (temperature 1 without
top-k / top-p, or every unlisted token certainly dropped, or K >= V); otherwise it is the geometric mean of the
normaliser's bounds and ``exact`` is False for that position.

Shapes: J scored positions (rows), C known tokens per position (the top K first, then other known tokens such as
a draft token outside the top K, ``-1`` where a row has fewer), V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from bubblespec.verify import sampling

_ROWS_PER_CHUNK = 64  # rows whose whole-vocabulary noise words are held at once (bounded memory at V = 152k)
_MASS_SLACK = 1e-5  # rounding of float32 log-probabilities summed over the listed tokens
_SHARE_MARGIN = 1e-9  # top-p decisions this close to the boundary are left to the engine


def accepted_length(samples: Sequence[int | None], draft: Sequence[int]) -> int:
    """Leading draft tokens equal to the verifier's samples (``None``: undecided, never equal)."""
    accepted = 0
    for sample, proposal in zip(samples, draft, strict=False):
        if sample is None or sample != proposal:
            break
        accepted += 1
    return accepted


def decide_keyed_samples(
    known_ids_JC: torch.Tensor,
    known_logprobs_JC: torch.Tensor,
    num_top: int,
    seeds_J2: torch.Tensor,
    positions_J: torch.Tensor,
    temperature_J: torch.Tensor,
    top_k_J: torch.Tensor,
    top_p_J: torch.Tensor,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keyed samples at J positions from their known log-probabilities; ``-1`` where the sample is not decided.

    known_ids_JC: [J, C] int64; columns ``[0, num_top)`` hold the engine's top ``num_top`` tokens (any order),
        later columns other tokens whose log-probability is known (e.g. the draft token); ``-1`` pads.
    known_logprobs_JC: [J, C] ``log_softmax(z)`` of those tokens (raw: no temperature, no filters).
    seeds_J2, positions_J: the rollout key's noise seed and the response position of each row.
    temperature_J, top_k_J, top_p_J: the sampling parameters of each row.
    Returns tokens_J int64 (-1: undecided), logprobs_J float64 (NaN where undecided) under
    ``softmax(mask(z / T))`` (the raw distribution for greedy rows), and exact_J bool (is the logprob exact).
    """
    device = known_ids_JC.device
    num_rows = known_ids_JC.shape[0]
    num_top = min(num_top, vocab_size)
    ids_JC = known_ids_JC.to(torch.int64)
    valid_JC = (ids_JC >= 0) & ~_repeats_a_top_token(ids_JC, num_top)
    ids_JC = ids_JC.clamp(min=0)
    logprobs_JC = known_logprobs_JC.to(torch.float64).masked_fill(~valid_JC, -math.inf)
    is_top_C = torch.arange(ids_JC.shape[1], device=device) < num_top
    l_K_J = logprobs_JC[:, :num_top].masked_fill(~valid_JC[:, :num_top], math.inf).min(-1).values
    num_unlisted_J = (vocab_size - valid_JC.sum(-1)).clamp(min=0)
    complete_J = num_unlisted_J == 0

    temperature = temperature_J.to(device, torch.float64)
    greedy_J = temperature == 0
    scale_J = torch.where(greedy_J, 1.0, temperature)
    scores_JC = logprobs_JC / scale_J[:, None]

    top_k = top_k_J.to(device, torch.int64)
    use_top_k_J = (top_k > 0) & (top_k < vocab_size) & ~greedy_J
    certain_JC, possible_JC, unlisted_J = _top_k_status(logprobs_JC, valid_JC, is_top_C, l_K_J, top_k, use_top_k_J)
    unlisted_J = torch.where(complete_J, _DROPPED, unlisted_J)
    mass_lo_J, mass_hi_J = _unlisted_mass_bounds(logprobs_JC, valid_JC, l_K_J, num_unlisted_J, scale_J)
    top_p = torch.where(greedy_J, 1.0, top_p_J.to(device, torch.float64))
    status = (certain_JC, possible_JC, unlisted_J)
    certain_JC, possible_JC, unlisted_J = _top_p_status(
        scores_JC, ids_JC, is_top_C, status, (mass_lo_J, mass_hi_J), l_K_J / scale_J, top_p
    )

    noise_JC, unlisted_noise_J = _noise_at_and_outside(ids_JC, valid_JC, seeds_J2, positions_J, vocab_size)
    perturbed_JC = torch.where(greedy_J[:, None], scores_JC, scores_JC + noise_JC)
    best_col_J, best_value_J = _best_certain(perturbed_JC, certain_JC, ids_JC)
    rival_J = torch.where(possible_JC, perturbed_JC, -math.inf).max(-1).values
    outside_J = torch.where(greedy_J, l_K_J, l_K_J / scale_J + unlisted_noise_J)
    beats_outside_J = (unlisted_J == _DROPPED) | (best_value_J > outside_J)
    decided_J = (best_value_J > rival_J) & beats_outside_J & torch.isfinite(best_value_J)
    tokens_J = torch.where(decided_J, ids_JC.gather(1, best_col_J[:, None])[:, 0], -1)

    logprobs_J, exact_J = _logprob_of_best(
        scores_JC, logprobs_JC, (certain_JC, possible_JC, unlisted_J), (mass_lo_J, mass_hi_J), best_col_J, scale_J
    )
    exact_J = exact_J | greedy_J
    logprobs_J = logprobs_J.masked_fill(~decided_J, math.nan)
    assert tokens_J.shape == (num_rows,)
    return tokens_J, logprobs_J, exact_J & decided_J


def _repeats_a_top_token(ids_JC: torch.Tensor, num_top: int) -> torch.Tensor:
    """[J, C] True for a column after the top ``num_top`` whose id is also among them (counted once)."""
    repeats_JC = torch.zeros_like(ids_JC, dtype=torch.bool)
    if ids_JC.shape[1] > num_top:
        extra_JE = ids_JC[:, num_top:]
        repeats_JC[:, num_top:] = (extra_JE[:, :, None] == ids_JC[:, None, :num_top]).any(-1)
    return repeats_JC


# Status of the unlisted tokens as a group.
_DROPPED, _KEPT, _MAYBE = 0, 1, 2


def _top_k_status(logprobs_JC, valid_JC, is_top_C, l_K_J, top_k_J, use_top_k_J):
    """Which known tokens top-k certainly keeps / possibly keeps, and what it does to the unlisted tokens.

    top-k keeps every token whose logit is >= the k-th largest. For k <= K that threshold is known (the k-th of
    the top K) and decides every known token; an unlisted token (``l <= l_K``) survives only on a tie with it.
    For k > K the top K all survive, other tokens possibly.
    """
    num_top = int(is_top_C.sum())
    top_sorted_JK = logprobs_JC[:, :num_top].sort(-1, descending=True).values
    k_index_J = (top_k_J.clamp(1, num_top) - 1)[:, None]
    threshold_J = top_sorted_JK.gather(1, k_index_J)[:, 0]
    inside_J = use_top_k_J & (top_k_J <= num_top)
    beyond_J = use_top_k_J & (top_k_J > num_top)
    kept_by_threshold_JC = logprobs_JC >= threshold_J[:, None]
    certain_JC = valid_JC & torch.where(
        inside_J[:, None],
        kept_by_threshold_JC,
        torch.where(beyond_J[:, None], is_top_C[None, :] | (logprobs_JC >= l_K_J[:, None]), True),
    )
    possible_JC = valid_JC & beyond_J[:, None] & ~certain_JC
    unlisted_J = torch.full_like(top_k_J, _KEPT)
    unlisted_J = torch.where(inside_J, torch.where(threshold_J > l_K_J, _DROPPED, _MAYBE), unlisted_J)
    unlisted_J = torch.where(beyond_J, _MAYBE, unlisted_J)
    return certain_JC, possible_JC, unlisted_J


def _unlisted_mass_bounds(logprobs_JC, valid_JC, l_K_J, num_unlisted_J, scale_J):
    """Bounds on ``sum_{v unlisted} exp(l_v / T)``, as logs.

    With ``U = 1 - sum_listed exp(l_v)`` and each unlisted ``p_v <= p_K``, for ``a = 1 / T``:
    ``U p_K^(a - 1)`` and ``n^(1 - a) U^a`` (n unlisted tokens, Jensen) bound it from either side, and ``U^a``
    from above when ``a >= 1``.
    """
    listed_mass_J = torch.where(valid_JC, logprobs_JC.exp(), 0.0).sum(-1)
    mass_J = (1.0 - listed_mass_J).clamp(min=0.0)
    log_hi_U = (mass_J + _MASS_SLACK).log()
    log_lo_U = (mass_J - _MASS_SLACK).clamp(min=0.0).log()
    a_J = 1.0 / scale_J
    log_n = num_unlisted_J.clamp(min=1).to(torch.float64).log()

    def bounds(log_u):
        by_largest = log_u + (a_J - 1) * l_K_J
        by_jensen = (1 - a_J) * log_n + a_J * log_u
        return by_largest, by_jensen

    largest_hi, jensen_hi = bounds(log_hi_U)
    largest_lo, jensen_lo = bounds(log_lo_U)
    sharp_J = a_J >= 1
    log_hi_J = torch.where(sharp_J, torch.minimum(largest_hi, a_J * log_hi_U), jensen_hi)
    log_lo_J = torch.where(sharp_J, jensen_lo, largest_lo)
    none_J = num_unlisted_J == 0
    return log_lo_J.masked_fill(none_J, -math.inf), log_hi_J.masked_fill(none_J, -math.inf)


def _top_p_status(scores_JC, ids_JC, is_top_C, status, unlisted_mass, l_K_scaled_J, top_p_J):
    """Refines the kept sets by top-p, applied to what top-k kept.

    Tokens in order of decreasing probability are kept while the mass before them is < p. The normaliser Z and
    the mass before a token are known only within bounds (unlisted mass, possibly-kept tokens); a token is
    certainly kept when even the largest share before it is < p, certainly dropped when even the smallest is >= p.
    """
    certain_JC, possible_JC, unlisted_J = status
    use_top_p_J = top_p_J < 1.0
    if not bool(use_top_p_J.any()):
        return status
    weight_JC, (unlisted_lo_J, unlisted_hi_J), (z_lo_J, z_hi_J) = _normaliser_bounds(scores_JC, status, unlisted_mass)

    order_JC = _probability_order(scores_JC, ids_JC)
    sorted_weight_JC = weight_JC.gather(1, order_JC)
    sorted_certain_JC = certain_JC.gather(1, order_JC)
    sorted_any_JC = (certain_JC | possible_JC).gather(1, order_JC)
    before_lo_JC = _exclusive_cumsum(torch.where(sorted_certain_JC, sorted_weight_JC, 0.0))
    before_hi_JC = _exclusive_cumsum(torch.where(sorted_any_JC, sorted_weight_JC, 0.0))
    # Unlisted tokens (l <= l_K) may come before a known token that is not strictly above l_K.
    above_K_JC = is_top_C[None, :] & (scores_JC > l_K_scaled_J[:, None])
    before_hi_JC = before_hi_JC + torch.where(above_K_JC.gather(1, order_JC), 0.0, unlisted_hi_J[:, None])
    p = top_p_J[:, None]
    keep_sorted_JC = before_hi_JC < p * z_lo_J[:, None] * (1 - _SHARE_MARGIN)
    drop_sorted_JC = before_lo_JC >= p * z_hi_J[:, None] * (1 + _SHARE_MARGIN)
    keep_JC = torch.zeros_like(keep_sorted_JC).scatter(1, order_JC, keep_sorted_JC)
    drop_JC = torch.zeros_like(drop_sorted_JC).scatter(1, order_JC, drop_sorted_JC)
    apply_JC = use_top_p_J[:, None]
    certain_after_JC = torch.where(apply_JC, certain_JC & keep_JC, certain_JC)
    possible_after_JC = torch.where(apply_JC, (certain_JC | possible_JC) & ~drop_JC & ~certain_after_JC, possible_JC)
    # Every unlisted token has the certainly kept top-K tokens above l_K before it.
    before_unlisted_J = torch.where(above_K_JC & certain_JC, weight_JC, 0.0).sum(-1)
    unlisted_dropped_J = before_unlisted_J >= top_p_J * z_hi_J * (1 + _SHARE_MARGIN)
    unlisted_after_J = torch.where(unlisted_dropped_J, _DROPPED, torch.where(unlisted_J == _DROPPED, _DROPPED, _MAYBE))
    unlisted_J = torch.where(use_top_p_J, unlisted_after_J, unlisted_J)
    return certain_after_JC, possible_after_JC, unlisted_J


def _probability_order(scores_JC, ids_JC):
    """Column order by decreasing score, ties by increasing token id (the order top-p walks)."""
    by_id_JC = torch.sort(ids_JC, dim=-1, stable=True).indices
    by_score_JC = torch.sort(scores_JC.gather(1, by_id_JC), dim=-1, descending=True, stable=True).indices
    return by_id_JC.gather(1, by_score_JC)


def _exclusive_cumsum(x_JC: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x_JC, -1) - x_JC


def _noise_at_and_outside(ids_JC, valid_JC, seeds_J2, positions_J, vocab_size):
    """G(k, i, v) at the known tokens [J, C], and the largest G over every other token [J] (-inf if none)."""
    seeds_J2 = seeds_J2.to(ids_JC.device, torch.int64)
    positions_J1 = positions_J.to(ids_JC.device, torch.int64)[:, None]
    at_JC = sampling.keyed_gumbel_at(seeds_J2, positions_J1, ids_JC[:, None, :])[:, 0]
    # Padding columns repeat a listed token, so that they exclude nothing else.
    excluded_JC = torch.where(valid_JC, ids_JC, ids_JC[:, :1])
    outside_J = torch.empty(ids_JC.shape[0], dtype=torch.float64, device=ids_JC.device)
    for start in range(0, ids_JC.shape[0], _ROWS_PER_CHUNK):
        rows = slice(start, start + _ROWS_PER_CHUNK)
        outside_J[rows] = sampling.keyed_gumbel_max_outside(
            seeds_J2[rows], positions_J1[rows], vocab_size, excluded_JC[rows, None, :]
        )[:, 0]
    return at_JC, outside_J


def _normaliser_bounds(scores_JC, status, unlisted_mass):
    """Weights ``exp(s - max s)`` of the known tokens, the unlisted tokens' share and the normaliser Z of the kept
    tokens, each as (lower, upper) bounds in the same units."""
    certain_JC, possible_JC, unlisted_J = status
    mass_lo_J, mass_hi_J = unlisted_mass
    reference_J = scores_JC.max(-1).values
    weight_JC = (scores_JC - reference_J[:, None]).exp()
    unlisted_lo_J = torch.where(unlisted_J == _KEPT, (mass_lo_J - reference_J).exp(), 0.0)
    unlisted_hi_J = torch.where(unlisted_J == _DROPPED, 0.0, (mass_hi_J - reference_J).exp())
    z_lo_J = torch.where(certain_JC, weight_JC, 0.0).sum(-1) + unlisted_lo_J
    z_hi_J = torch.where(certain_JC | possible_JC, weight_JC, 0.0).sum(-1) + unlisted_hi_J
    return weight_JC, (unlisted_lo_J, unlisted_hi_J), (z_lo_J, z_hi_J)


def _best_certain(perturbed_JC, certain_JC, ids_JC):
    """Column and value of the largest perturbed score among certainly-kept tokens; ties go to the lowest token id,
    as an argmax over the whole vocabulary does."""
    masked_JC = torch.where(certain_JC, perturbed_JC, -math.inf)
    best_value_J = masked_JC.max(-1).values
    at_best_JC = (masked_JC == best_value_J[:, None]) & certain_JC
    best_col_J = torch.where(at_best_JC, ids_JC, torch.iinfo(torch.int64).max).argmin(-1)
    return best_col_J, best_value_J


def _logprob_of_best(scores_JC, logprobs_JC, status, unlisted_mass, best_J, scale_J):
    """log q(y) under softmax(mask(z / T)) and whether it is exact.

    Exact when the kept set's normaliser is known: every kept token is listed (unlisted dropped, nothing only
    possibly kept), or temperature 1 without filters (then q = p, the engine's own log-probability). Otherwise
    the geometric mean of the normaliser's bounds.
    """
    certain_JC, possible_JC, unlisted_J = status
    _, _, (z_lo_J, z_hi_J) = _normaliser_bounds(scores_JC, status, unlisted_mass)
    reference_J = scores_JC.max(-1).values
    best_score_J = scores_JC.gather(1, best_J[:, None])[:, 0]
    estimate_J = best_score_J - reference_J - 0.5 * (z_lo_J.log() + z_hi_J.log())
    nothing_possible_J = ~possible_JC.any(-1)
    listed_only_J = nothing_possible_J & (unlisted_J == _DROPPED)
    untouched_J = nothing_possible_J & (unlisted_J == _KEPT) & (scale_J == 1.0)
    raw_J = logprobs_JC.gather(1, best_J[:, None])[:, 0]
    logprob_J = torch.where(untouched_J, raw_J, estimate_J)
    return logprob_J, listed_only_J | untouched_J
