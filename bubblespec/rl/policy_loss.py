"""The policy loss of one mini-batch, as a pure function of per-token log-probabilities (shapes ``[B, T]``: B
responses, T response positions, ``mask`` 1 on real response tokens).

Importance ratio, per token or per sequence (GSPO, Zheng et al. 2025)::

    token     r_bt = exp(log pi(y_bt) - log pi_old(y_bt))
    sequence  r_b  = exp(1/|b| sum_t (log pi(y_bt) - log pi_old(y_bt)))          the same for every token of b

Per-token loss, A_b the advantage of response b::

    clip   l_bt = -min(r A_b, clip(r, 1 - eps_low, 1 + eps_high) A_b)            PPO; DAPO's clip-higher: eps_high >
                                                                                  eps_low (Yu et al. 2025)
    cispo  l_bt = -sg(min(r, 1 + eps_high)) A_b log pi(y_bt)                      MiniMax-M1 (2025): the clipped
                                                                                  ratio weights every token's gradient
    then   l_bt <- w_bt l_bt + beta KL_bt          w_bt = min(exp(log pi_old - log pi_engine), tis_cap): truncated
                                                   importance sampling against the rollout engine (Yao et al. 2025)
    KL_bt  k1: log pi - log pi_ref    k2: (log pi - log pi_ref)^2 / 2    k3: exp(log pi_ref - log pi) - (log pi_ref -
           log pi) - 1   (Schulman 2020, "Approximating KL divergence")

Aggregation over the mini-batch (N responses of the whole mini-batch, across data-parallel workers)::

    token-mean                sum_bt l_bt / sum_b |b|                    DAPO; TRL's dapo, bnpo (one process)
    seq-mean-token-mean       1/N sum_b (1/|b| sum_t l_bt)               GRPO; TRL's grpo
    seq-mean-token-sum-norm   1/N sum_b (1/C sum_t l_bt), C a constant   Dr. GRPO; TRL's dr_grpo (C: max tokens)

and an entropy bonus, ``- entropy_coef * sum_bt H_bt / sum_b |b|`` (the token mean whatever the aggregation).

Each worker calls :func:`policy_loss` on its share of a mini-batch with ``normaliser`` computed from the whole
mini-batch (:func:`aggregation_normaliser`), so that the sum of the workers' losses is the mini-batch's loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LossSettings:
    """What :func:`policy_loss` computes (the trainer's config, resolved)."""

    policy_loss: Literal["clip", "cispo"] = "clip"
    importance_ratio: Literal["token", "sequence"] = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    aggregation: Aggregation = "seq-mean-token-mean"
    kl_coef: float = 0.0
    """beta of the KL term in the loss (0: none)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0


def kl_divergence(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probabilities."""
    log_ratio = logprobs_BT - ref_logprobs_BT
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    raise ValueError(f"KL estimator {estimator!r} is not known; choose k1, k2 or k3")


def aggregation_normaliser(
    aggregation: Aggregation, response_lengths: list[int], norm_tokens: int | None = None
) -> float:
    """The divisor of the summed loss of a whole mini-batch (``response_lengths``: its responses' token counts,
    after masking): its tokens (token-mean) or its responses (the two seq-mean aggregations)."""
    if aggregation == "token-mean":
        return float(max(sum(response_lengths), 1))
    if aggregation in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        return float(max(len(response_lengths), 1))
    raise ValueError(f"loss_aggregation {aggregation!r} is not known; choose one of {', '.join(AGGREGATIONS)}")


def policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    settings: LossSettings,
    normaliser: float,
    token_normaliser: float,
    norm_tokens: int | None = None,
    ref_logprobs_BT: torch.Tensor | None = None,
    is_weights_BT: torch.Tensor | None = None,
    entropy_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This share's loss (a scalar with gradient) and its statistics as sums over its tokens, to be added up
    across micro-batches and workers: ``tokens``, ``ratio_sum``, ``ratio_max``, ``ratio_min``, ``clip_low``,
    ``clip_high`` (tokens whose ratio the clip cut off, per side), ``kl_sum``, ``entropy_sum``.

    ``normaliser``: :func:`aggregation_normaliser` of the whole mini-batch; ``token_normaliser``: its masked
    tokens (the entropy bonus's divisor); ``norm_tokens``: the constant C of seq-mean-token-sum-norm;
    ``is_weights_BT``: truncated importance weights (no gradient); ``entropy_BT``: per-token entropy, with
    gradient when ``settings.entropy_coef`` is not 0."""
    advantages_B1 = advantages_B[:, None]
    lengths_B = mask_BT.sum(1)
    log_ratio_BT = logprobs_BT - old_logprobs_BT
    if settings.importance_ratio == "sequence":
        log_ratio_BT = ((log_ratio_BT * mask_BT).sum(1) / lengths_B.clamp(min=1))[:, None].expand_as(mask_BT)
    elif settings.importance_ratio != "token":
        raise ValueError(f"importance_ratio {settings.importance_ratio!r} is not known; choose token or sequence")
    ratio_BT = torch.exp(log_ratio_BT)

    if settings.policy_loss == "clip":
        clipped_BT = ratio_BT.clamp(1 - settings.clip_low, 1 + settings.clip_high)
        per_token_BT = -torch.minimum(ratio_BT * advantages_B1, clipped_BT * advantages_B1)
        clip_low_BT = (ratio_BT < 1 - settings.clip_low) & (advantages_B1 < 0)
        clip_high_BT = (ratio_BT > 1 + settings.clip_high) & (advantages_B1 > 0)
    elif settings.policy_loss == "cispo":
        weight_BT = ratio_BT.clamp(max=1 + settings.clip_high).detach()
        per_token_BT = -weight_BT * advantages_B1 * logprobs_BT
        clip_low_BT = torch.zeros_like(mask_BT, dtype=torch.bool)
        clip_high_BT = (ratio_BT > 1 + settings.clip_high) & (advantages_B1 > 0)
    else:
        raise ValueError(f"policy_loss {settings.policy_loss!r} is not known; choose clip or cispo")
    if is_weights_BT is not None:
        per_token_BT = per_token_BT * is_weights_BT
    kl_BT = None
    if ref_logprobs_BT is not None:
        kl_BT = kl_divergence(logprobs_BT, ref_logprobs_BT, settings.kl_estimator)
        if settings.kl_coef:
            per_token_BT = per_token_BT + settings.kl_coef * kl_BT

    masked_BT = per_token_BT * mask_BT
    if settings.aggregation == "token-mean":
        loss = masked_BT.sum() / normaliser
    elif settings.aggregation == "seq-mean-token-mean":
        loss = (masked_BT.sum(1) / lengths_B.clamp(min=1)).sum() / normaliser
    elif settings.aggregation == "seq-mean-token-sum-norm":
        if not norm_tokens:
            raise ValueError("seq-mean-token-sum-norm needs norm_tokens (the constant each response is divided by)")
        loss = (masked_BT.sum(1) / norm_tokens).sum() / normaliser
    else:
        raise ValueError(f"loss_aggregation {settings.aggregation!r} is not known; choose one of {AGGREGATIONS}")
    if settings.entropy_coef and entropy_BT is not None:
        loss = loss - settings.entropy_coef * (entropy_BT * mask_BT).sum() / token_normaliser

    real = mask_BT > 0
    detached = ratio_BT.detach()
    stats = {
        "tokens": mask_BT.sum().detach(),
        "ratio_sum": (detached * mask_BT).sum(),
        "ratio_max": detached[real].max() if real.any() else detached.new_tensor(float("-inf")),
        "ratio_min": detached[real].min() if real.any() else detached.new_tensor(float("inf")),
        "clip_low": (clip_low_BT & real).sum().to(mask_BT.dtype),
        "clip_high": (clip_high_BT & real).sum().to(mask_BT.dtype),
        "kl_sum": (kl_BT.detach() * mask_BT).sum() if kl_BT is not None else mask_BT.new_tensor(0.0),
        "entropy_sum": (entropy_BT.detach() * mask_BT).sum() if entropy_BT is not None else mask_BT.new_tensor(0.0),
    }
    return loss, stats
