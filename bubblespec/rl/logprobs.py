"""The trainer's log-probabilities and entropies of response tokens: one forward pass over right-padded rows of
prompt + response, as pure functions of the model's logits.

Shapes: B responses, W tokens of the longest prompt + response, R tokens of the longest response, V the vocabulary.
The logits at position i predict token i + 1, so response token j of row b is scored by the logits at
``len(prompt_b) - 1 + j``.

Padding. Positions past a response's end (and rows shorter than W) are padding. Every value this module returns
at a padding position is a finite 0, never whatever the model said there: a mask multiplies, and ``0 * inf`` or
``0 * nan`` is NaN, in the loss and in its gradient alike.

Sampling filters. With ``filters = (top_k, top_p)`` the distribution is the rollout's: tokens outside the top-k /
top-p of ``logits / T`` get probability 0 (score -inf), decided exactly as keyed sampling decides them
(:func:`bubblespec.verify.sampling.mask_logits`). The sampled token is always kept: the engine sampled it, so its filter
kept it; where the trainer's logits differ in the last bits (another dtype or kernel) and would drop it, it keeps
a finite log-probability instead of -inf. Entropy ``-sum_v p log p`` counts a filtered token as 0 (``0 log 0 =
0``), computed so that its gradient is 0 there too (``exp(x) * x`` at ``x = -inf`` has a NaN derivative).

Suppressed tokens (``SamplingParams.suppressed_token_ids``): the rollout never samples them, so they get score -inf
in every row whether or not the filters apply, before top-k / top-p decide (as keyed sampling orders them). A
response that holds one was not sampled under this distribution: a ``ValueError`` naming it, not a -inf logprob.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bubblespec.verify.sampling import mask_logits, suppressed_rows


def padded_tokens(sequences: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """[B, W] int64, each sequence right-padded with 0 (W >= 2)."""
    width = max([len(s) for s in sequences] + [2])
    rows = [list(s) + [0] * (width - len(s)) for s in sequences]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def response_mask(lengths: Sequence[int], width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[B, R] ones on each row's first ``lengths[b]`` positions, zeros after (in ``dtype``: use float32 or wider; a
    bfloat16 mask of 1,001 ones would sum to 1,000)."""
    lengths_B1 = torch.tensor(lengths, dtype=torch.int64, device=device)[:, None]
    return (torch.arange(width, device=device)[None, :] < lengths_B1).to(dtype)


def placed(values: Sequence[torch.Tensor], like_BR: torch.Tensor) -> torch.Tensor:
    """Per-response values as a [B, R] tensor like ``like_BR``, zeros past each response's end, no gradient."""
    rows = torch.zeros_like(like_BR, requires_grad=False)
    for row, value in enumerate(values):
        rows[row, : len(value)] = value.to(rows.device, rows.dtype)
    return rows


def response_logprobs(
    logits_BWV: torch.Tensor,
    tokens_BW: torch.Tensor,
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    temperature: float,
    dtype: torch.dtype,
    filters: tuple[int, float] | None = None,
    entropy_gradient: bool = False,
    suppressed: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities [B, R] of each response token under ``softmax(logits / temperature)`` (without the
    ``suppressed`` tokens, restricted by ``filters``), and the entropy [B, R] of the distribution each was drawn from,
    in ``dtype``; both 0 at padding. The entropy has a gradient only with ``entropy_gradient``."""
    device = logits_BWV.device
    width = max(list(response_lengths) + [1])
    starts_B = torch.tensor([n - 1 for n in prompt_lengths], dtype=torch.int64, device=device)
    index_BR = (starts_B[:, None] + torch.arange(width, device=device)[None]).clamp(max=tokens_BW.shape[1] - 2)
    logits_BRV = logits_BWV.gather(1, index_BR[..., None].expand(-1, -1, logits_BWV.shape[-1]))
    targets_BR = tokens_BW.gather(1, index_BR + 1)
    real_BR = response_mask(response_lengths, width, torch.bool, device)
    scores_BRV = logits_BRV.to(dtype) / temperature
    dropped_V = None  # the suppressed tokens, broadcast over rows: no [B, R, V] mask where no filter needs one
    if suppressed:
        dropped_V = suppressed_rows(torch.tensor([list(suppressed)], device=device), logits_BRV.shape[-1])[0]
        _refuse_suppressed_targets(targets_BR, real_BR, dropped_V)
        scores_BRV = scores_BRV.masked_fill(dropped_V, float("-inf"))
    kept_BRV = None
    if filters is not None:
        kept_BRV = _kept(logits_BRV.detach(), temperature, *filters, suppressed)
        kept_BRV.scatter_(-1, targets_BR[..., None], True)  # the sampled token: the engine's filter kept it
        scores_BRV = scores_BRV.masked_fill(~kept_BRV, float("-inf"))
    logprobs_BRV = torch.log_softmax(scores_BRV, dim=-1)
    logprobs_BR = logprobs_BRV.gather(-1, targets_BR[..., None]).squeeze(-1)
    source_BRV = logprobs_BRV if entropy_gradient else logprobs_BRV.detach()
    if kept_BRV is not None:
        source_BRV = source_BRV.masked_fill(~kept_BRV, 0.0)  # exp(0) * 0 = 0, with a gradient of 0 through the fill
    elif dropped_V is not None:
        source_BRV = source_BRV.masked_fill(dropped_V, 0.0)
    entropy_BR = -(source_BRV.exp() * source_BRV).sum(-1)
    zero = logprobs_BR.new_zeros(())
    return torch.where(real_BR, logprobs_BR, zero), torch.where(real_BR, entropy_BR, zero)


def _kept(
    logits_BRV: torch.Tensor, temperature: float, top_k: int, top_p: float, suppressed: Sequence[int] = ()
) -> torch.Tensor:
    """[B, R, V] True where the rollout's suppression, top-k and top-p keep a token."""
    rows, device = logits_BRV.shape[0], logits_BRV.device
    temperature_B = torch.full((rows,), temperature, dtype=torch.float64, device=device)
    top_k_B = torch.full((rows,), top_k, dtype=torch.int64, device=device)
    top_p_B = torch.full((rows,), top_p, dtype=torch.float64, device=device)
    suppressed_BS = torch.tensor([list(suppressed)] * rows, dtype=torch.int64).reshape(rows, len(suppressed))
    return torch.isfinite(mask_logits(logits_BRV, temperature_B, top_k_B, top_p_B, None, None, suppressed_BS))


def _refuse_suppressed_targets(targets_BR: torch.Tensor, real_BR: torch.Tensor, dropped_V: torch.Tensor) -> None:
    found_BR = dropped_V[targets_BR] & real_BR
    if bool(found_BR.any()):
        row, position = (int(i) for i in found_BR.nonzero()[0])
        raise ValueError(
            f"response {row} holds token {int(targets_BR[row, position])} at position {position}, a suppressed token "
            "(sampling.suppressed_token_ids) the rollout never samples: the trainer scores responses of this "
            "rollout's sampling only"
        )
