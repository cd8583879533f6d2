"""The runner-up of a keyed sample and its margin (bubblespec/verify/margins.py) against the full noise of every
token: exact wherever the margin is within the limit, and not computed only where the true margin is above it."""

from __future__ import annotations

import pytest
import torch

from bubblespec.verify.margins import NOT_COMPUTED, keyed_runner_up
from bubblespec.verify.sampling import keyed_gumbel, keyed_sample, mask_logits


def _reference(logits_BTV, seeds_B2, positions_BT, temperature_B, top_k_B, top_p_B):
    """Winner, runner-up (lowest id among equal perturbed scores) and margin from every token's noise, by a loop."""
    batch, num_positions, vocab = logits_BTV.shape
    scores = mask_logits(
        logits_BTV.reshape(batch * num_positions, 1, vocab),
        *(x[:, None].expand(-1, num_positions).reshape(-1) for x in (temperature_B, top_k_B, top_p_B)),
    )[:, 0].view(batch, num_positions, vocab)
    perturbed = scores + keyed_gumbel(seeds_B2, positions_BT, vocab)
    out = []
    for b in range(batch):
        for t in range(num_positions):
            row = perturbed[b, t].tolist()
            order = sorted(range(vocab), key=lambda v: (-row[v], v))
            out.append((order[0], order[1], row[order[0]] - row[order[1]]))
    return out


@pytest.mark.parametrize("vocab", [32_000, 151_936])
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 40, 0.9)])
@pytest.mark.parametrize("limit", [0.5, 2.0, float("inf")])
def test_the_runner_up_and_margin_are_the_full_noises_wherever_the_margin_is_within_the_limit(
    vocab, temperature, top_k, top_p, limit
):
    generator = torch.Generator().manual_seed(vocab + int(100 * temperature))
    batch, num_positions = 3, 4
    logits = torch.randn(batch, num_positions, vocab, generator=generator, dtype=torch.float64) * 3
    logits[0, 0, :2] = logits[0, 0].max() + 1.0  # two tokens far ahead of the rest: a near-tie between them
    seeds = torch.randint(2**31, (batch, 2), generator=generator)
    positions = torch.arange(num_positions)[None].expand(batch, -1) + 7
    params = [torch.full((batch,), value, dtype=dtype) for value, dtype in
              ((temperature, torch.float64), (top_k, torch.int64), (top_p, torch.float64))]  # fmt: skip
    winners, logprobs, runner_ups, margins = keyed_runner_up(logits, seeds, positions, *params, margin_limit=limit)
    sampled, sampled_logprobs = keyed_sample(logits, seeds, positions, *params)
    assert torch.equal(winners, sampled) and torch.equal(logprobs, sampled_logprobs)
    computed = 0
    for (b, t), (winner, runner_up, margin) in zip(
        [(b, t) for b in range(batch) for t in range(num_positions)],
        _reference(logits, seeds, positions, *params),
        strict=True,
    ):
        assert int(winners[b, t]) == winner
        if margin <= limit:
            assert (int(runner_ups[b, t]), float(margins[b, t])) == (runner_up, pytest.approx(margin, abs=1e-12))
            computed += 1
        else:
            assert (int(runner_ups[b, t]), float(margins[b, t])) == (NOT_COMPUTED, float("inf"))
    assert computed >= 1  # the planted near-tie at least
    if limit == float("inf") and top_k == 0:
        assert computed == batch * num_positions


def test_greedy_rows_and_rows_that_keep_one_token_have_no_runner_up():
    logits = torch.randn(2, 3, 1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    seeds, positions = torch.tensor([[1, 2], [3, 4]]), torch.arange(3)[None].expand(2, -1)
    temperature, top_k, top_p = torch.tensor([0.0, 1.0], dtype=torch.float64), torch.tensor([0, 1]), torch.ones(2)
    winners, _, runner_ups, margins = keyed_runner_up(logits, seeds, positions, temperature, top_k, top_p)
    assert torch.equal(winners, logits.argmax(-1))  # greedy row 0, and row 1 keeps its best token only
    assert (runner_ups == NOT_COMPUTED).all() and torch.isinf(margins).all()
