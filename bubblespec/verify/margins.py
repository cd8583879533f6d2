"""The runner-up of a keyed sample and its Gumbel-max margin, exactly where the margin is small (docs/design.md §13).

With keyed sampling the noise ``G(k, i, v)`` is the same for the policy that drafted and the one that verifies, so an
update changes the sample at position ``i`` only where it reorders the top of the perturbed scores
``s(v) = mask(z / T)[v] + G(k, i, v)``, and a small update reorders only near-ties. For each position:

    winner      w  = argmax_v s(v)                  (the keyed sample; the lowest id among equal scores)
    runner-up   r  = argmax_{v != w} s(v)            (the lowest id among equal scores)
    margin      m  = s(w) - s(r) >= 0

Exact where ``m <= margin_limit``, without the noise of every token: an unlucky token (its word below the top 2**-10 of
its range) has ``G < 6.94``, so a token can reach ``s(w) - margin_limit`` only if it is lucky or its score is above
``s(w) - margin_limit - 6.94``; those candidates get their exact float64 noise, and the best of them other than ``w`` is
the runner-up if it is within the limit. Elsewhere (a margin above the limit, a greedy row, a row that keeps one token)
the runner-up is ``-1`` and the margin ``inf``: no near-tie there for a small update to flip.

Shapes: B rows, T positions, V vocabulary, R = B * T, N candidates.
"""

from __future__ import annotations

import torch

from bubblespec.verify.sampling import (
    _LUCKY_WORD,
    _UNLUCKY_GUMBEL_BOUND,
    RepetitionPenalty,
    ScoredRows,
    _gumbel_of_words,
    _words_of_rows,
    keyed_sample,
)

NOT_COMPUTED = -1
"""The runner-up where the margin is above the limit (or the row is greedy, or keeps one token)."""

REPORTED_MARGIN_LIMIT = 1.0
"""The largest margin a drafting pass reports a runner-up for (:attr:`~bubblespec.core.interfaces.GenerationRequest.
margins`). After a real GRPO step every position where the newer policy left the older one's sample sat at a margin
below 0.51, where a response's median margin was 0.85-3.2 (docs/design.md §13): a draft keeps the near-ties that
matter, not one per token."""


def keyed_runner_up(
    logits_BTV: torch.Tensor,
    seeds_B2: torch.Tensor,
    positions_BT: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    min_p_B: torch.Tensor | None = None,
    penalty: RepetitionPenalty | None = None,
    suppressed_BS: torch.Tensor | None = None,
    margin_limit: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keyed samples [B, T] int64 and their logprobs [B, T] float64 (:func:`~bubblespec.verify.sampling.keyed_sample`'s,
    same arguments), with their runner-ups [B, T] int64 and margins [B, T] float64, exact where the margin is at most
    ``margin_limit`` (``inf``: everywhere), else :data:`NOT_COMPUTED` and ``inf``. Read from the masked scores
    ``keyed_sample`` computes, block by block: the runner-up costs the candidates' noise once more, not the masking."""
    batch, num_positions = logits_BTV.shape[:2]
    device = logits_BTV.device
    runner_up_R = torch.full((batch * num_positions,), NOT_COMPUTED, dtype=torch.int64, device=device)
    margin_R = torch.full((batch * num_positions,), float("inf"), dtype=torch.float64, device=device)

    def runner_up_of(rows: slice, scored: ScoredRows) -> None:
        sampled_R = scored.temperature_R != 0  # greedy rows have no noise, so no near-tie for a small update
        if bool(sampled_R.any()):
            found_R, gap_R = _runner_up_rows(
                scored.scores_RV[sampled_R],
                scored.seeds_R2[sampled_R],
                scored.positions_R1[sampled_R],
                scored.tokens_R[sampled_R],
                margin_limit,
            )
            runner_up_R[rows][sampled_R], margin_R[rows][sampled_R] = found_R, gap_R

    tokens_BT, logprobs_BT = keyed_sample(
        logits_BTV, seeds_B2, positions_BT, temperature_B, top_k_B, top_p_B, min_p_B, penalty, suppressed_BS,
        on_scores=runner_up_of,
    )  # fmt: skip
    shape = (batch, num_positions)
    return tokens_BT, logprobs_BT, runner_up_R.view(shape), margin_R.view(shape)


def _runner_up_rows(
    scores_RV: torch.Tensor, seeds_R2: torch.Tensor, positions_R1: torch.Tensor, winners_R: torch.Tensor, limit: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runner-ups [R] int64 and margins [R] float64 of rows of masked scores whose winners are known."""
    num_rows, vocab = scores_RV.shape
    words_RV, refine_R1 = _words_of_rows(seeds_R2, positions_R1, vocab)
    rows_R = torch.arange(num_rows, device=scores_RV.device)
    best_R = scores_RV[rows_R, winners_R] + _gumbel_of_words(words_RV[rows_R, winners_R], refine_R1[:, 0])
    # below it no token reaches best - limit: unlucky noise is under the bound (less float64 rounding of s)
    floor_R = best_R - limit - _UNLUCKY_GUMBEL_BOUND - 1e-6 * (1.0 + best_R.abs())
    candidate_RV = (words_RV >= _LUCKY_WORD) | (scores_RV >= floor_R[:, None])
    candidate_RV[rows_R, winners_R] = False
    candidate_RV &= torch.isfinite(scores_RV)
    rows_N, tokens_N = candidate_RV.nonzero(as_tuple=True)
    perturbed_N = scores_RV[rows_N, tokens_N] + _gumbel_of_words(words_RV[rows_N, tokens_N], refine_R1[rows_N, 0])
    second_R = torch.full((num_rows,), float("-inf"), dtype=torch.float64, device=scores_RV.device)
    second_R.scatter_reduce_(0, rows_N, perturbed_N, "amax")
    is_second_N = perturbed_N == second_R[rows_N]
    runner_up_R = torch.full((num_rows,), vocab, dtype=torch.int64, device=scores_RV.device)
    runner_up_R.scatter_reduce_(0, rows_N[is_second_N], tokens_N[is_second_N], "amin")
    margin_R = best_R - second_R
    within_R = margin_R <= limit
    return torch.where(within_R, runner_up_R, NOT_COMPUTED), torch.where(within_R, margin_R, float("inf"))
