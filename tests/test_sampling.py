"""Keyed sampling and verification: vectorised code against the loop reference, and distribution tests."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from bubblespec import sampling
from bubblespec import sampling_reference as reference
from bubblespec.interfaces import RolloutKey


def _random_seeds(rng: random.Random, batch: int) -> torch.Tensor:
    return torch.tensor([[rng.getrandbits(32), rng.getrandbits(32)] for _ in range(batch)], dtype=torch.int64)


def _params(batch: int, temperature: float, top_k: int, top_p: float) -> list[torch.Tensor]:
    return [
        torch.full((batch,), temperature, dtype=torch.float64),
        torch.full((batch,), top_k, dtype=torch.int64),
        torch.full((batch,), top_p, dtype=torch.float64),
    ]


def test_keyed_gumbel_matches_reference():
    rng = random.Random(0)
    seeds = _random_seeds(rng, 4)
    positions = torch.tensor([[0, 1, 7], [3, 4, 5], [100, 200, 300], [0, 0, 2**20]])
    noise = sampling.keyed_gumbel(seeds, positions, 13)
    for b, t, v in itertools.product(range(4), range(3), range(13)):
        expected = reference.keyed_gumbel(tuple(seeds[b].tolist()), int(positions[b, t]), v)
        assert noise[b, t, v].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_keyed_uniform_is_uniform_and_independent_of_batch_composition():
    seeds = _random_seeds(random.Random(1), 64)
    positions = torch.arange(32).repeat(64, 1)
    uniform = sampling.keyed_uniform(seeds, positions, 50)
    assert 0 < uniform.min() and uniform.max() < 1
    # 102,400 draws: mean and variance of U(0, 1) within a few standard errors.
    assert abs(uniform.mean().item() - 0.5) < 0.005
    assert abs(uniform.var().item() - 1 / 12) < 0.002
    # Counts per decile: chi-square with 9 degrees of freedom, p < 1e-4 rejects at 33.7.
    counts = torch.histc(uniform.float(), bins=10, min=0, max=1)
    expected = uniform.numel() / 10
    assert ((counts - expected) ** 2 / expected).sum().item() < 33.7
    # The same rows in a different batch, order and position set give the same noise.
    subset = sampling.keyed_uniform(seeds[[5, 2]], positions[[5, 2]][:, 10:20], 50)
    assert torch.equal(subset, uniform[[5, 2]][:, 10:20])


def test_noise_seed_is_stable_and_key_sensitive():
    key = RolloutKey(run_seed=7, step=3, prompt_uid="p-1", sample_index=0)
    assert key.noise_seed() == RolloutKey(7, 3, "p-1", 0).noise_seed()
    others = [
        RolloutKey(8, 3, "p-1", 0),
        RolloutKey(7, 4, "p-1", 0),
        RolloutKey(7, 3, "p-2", 0),
        RolloutKey(7, 3, "p-1", 1),
    ]
    assert len({key.noise_seed(), *(k.noise_seed() for k in others)}) == 5


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.9, 7, 0.6), (0.0, 3, 0.5), (1.0, 1, 1.0)],
)
def test_keyed_sample_matches_reference(temperature, top_k, top_p):
    rng = random.Random(hash((temperature, top_k, top_p)) & 0xFFFF)
    batch, positions, vocab = 6, 5, 17
    logits = torch.randn(batch, positions, vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 2
    seeds = _random_seeds(rng, batch)
    positions_bt = torch.randint(0, 1000, (batch, positions))
    params = _params(batch, temperature, top_k, top_p)
    tokens, logprobs = sampling.keyed_sample(logits, seeds, positions_bt, *params)
    for b, t in itertools.product(range(batch), range(positions)):
        token, logprob = reference.keyed_sample(
            logits[b, t].tolist(), tuple(seeds[b].tolist()), int(positions_bt[b, t]), temperature, top_k, top_p
        )
        assert tokens[b, t].item() == token
        assert logprobs[b, t].item() == pytest.approx(logprob, abs=1e-9)


def test_mixed_sampling_params_in_one_batch_match_per_row_reference():
    rng = random.Random(5)
    rows = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.5, 4, 1.0), (1.5, 0, 0.5), (1.0, 2, 0.9)]
    logits = torch.randn(len(rows), 3, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    seeds = _random_seeds(rng, len(rows))
    positions = torch.arange(3).repeat(len(rows), 1)
    temperature_column, top_k_column, top_p_column = zip(*rows, strict=True)
    temperature = torch.tensor(temperature_column, dtype=torch.float64)
    top_k, top_p = torch.tensor(top_k_column), torch.tensor(top_p_column, dtype=torch.float64)
    tokens, _ = sampling.keyed_sample(logits, seeds, positions, temperature, top_k, top_p)
    for b, (t_value, k_value, p_value) in enumerate(rows):
        for t in range(3):
            expected, _ = reference.keyed_sample(
                logits[b, t].tolist(), tuple(seeds[b].tolist()), t, t_value, k_value, p_value
            )
            assert tokens[b, t].item() == expected


def test_keyed_sample_distribution_matches_softmax():
    """Over many keys, keyed samples follow softmax(mask(z / T)) exactly (chi-square against enumeration)."""
    vocab, num_keys = 6, 60_000
    logits_v = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0], dtype=torch.float64)
    temperature, top_k, top_p = 0.8, 5, 0.95
    seeds = _random_seeds(random.Random(11), num_keys)
    logits = logits_v.expand(num_keys, 1, vocab)
    params = _params(num_keys, temperature, top_k, top_p)
    tokens, _ = sampling.keyed_sample(logits, seeds, torch.zeros(num_keys, 1, dtype=torch.int64), *params)
    probs = reference._softmax(reference.mask_logits(logits_v.tolist(), temperature, top_k, top_p))
    counts = torch.bincount(tokens.flatten(), minlength=vocab).tolist()
    support = [v for v in range(vocab) if probs[v] > 0]
    assert all(counts[v] == 0 for v in range(vocab) if probs[v] == 0)
    chi_square = sum((counts[v] - num_keys * probs[v]) ** 2 / (num_keys * probs[v]) for v in support)
    assert chi_square < 20.5  # p = 1e-3 at 4 degrees of freedom (up to 5 kept tokens)


def test_count_accepted_matches_reference_on_random_inputs():
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        batch, num_slots = 8, 6
        sampled = torch.randint(0, 3, (batch, num_slots + 1), generator=generator)
        draft = torch.randint(0, 3, (batch, num_slots), generator=generator)
        num_draft = torch.randint(0, num_slots + 1, (batch,), generator=generator)
        accepted = sampling.count_accepted(sampled, draft, num_draft)
        for b in range(batch):
            n = int(num_draft[b])
            assert accepted[b].item() == reference.count_accepted(sampled[b].tolist(), draft[b, :n].tolist())


def _exact_sequence_distribution(probs_fn, length: int, vocab: int) -> dict[tuple[int, ...], float]:
    """Probability of every token sequence of ``length`` under the autoregressive ``probs_fn(prefix)``."""
    table = {}
    for sequence in itertools.product(range(vocab), repeat=length):
        probability = 1.0
        for i in range(length):
            probability *= probs_fn(sequence[:i])[sequence[i]]
        table[sequence] = probability
    return table


def test_one_hot_verification_is_exact_in_distribution():
    """One-hot verification of a fixed, wrong-ish draft yields exactly the target's sequence distribution."""
    vocab, length, trials = 3, 3, 30_000
    generator = torch.Generator().manual_seed(21)
    table_logits = torch.randn(vocab**length, vocab, dtype=torch.float64, generator=generator) * 1.5

    def target_logits(prefix):
        index = sum(token * vocab**i for i, token in enumerate(prefix)) + len(prefix) * 7
        return table_logits[index % len(table_logits)]

    temperature = torch.tensor([0.9], dtype=torch.float64)

    def probs_fn(prefix):
        return torch.softmax(target_logits(prefix) / temperature, -1).tolist()

    draft = [2, 0, 1]
    rng_generator = torch.Generator().manual_seed(4)
    # All trials advance together; rows that share an emitted prefix share the verifier's logits.
    pending: dict[tuple[int, ...], int] = {(): trials}
    counts: dict[tuple[int, ...], int] = {}
    while pending:
        prefix, rows = pending.popitem()
        proposal = draft[len(prefix) : length - 1]  # leave room for the token sampled after the draft
        logits = torch.stack([target_logits(list(prefix) + proposal[:j]) for j in range(len(proposal) + 1)])
        tokens, _ = sampling.engine_sample(
            logits.expand(rows, -1, -1),
            temperature.expand(rows),
            torch.zeros(rows, dtype=torch.int64),
            torch.ones(rows, dtype=torch.float64),
            generator=rng_generator,
        )
        accepted = sampling.count_accepted(
            tokens, torch.tensor([proposal] * rows).reshape(rows, -1), torch.full((rows,), len(proposal))
        )
        for row in range(rows):
            emitted = prefix + tuple(tokens[row, : int(accepted[row]) + 1].tolist())
            table = counts if len(emitted) >= length else pending
            table[emitted[:length]] = table.get(emitted[:length], 0) + 1
    exact = _exact_sequence_distribution(probs_fn, length, vocab)
    total_variation = 0.5 * sum(abs(counts.get(s, 0) / trials - p) for s, p in exact.items())
    chi_square = sum((counts.get(s, 0) - trials * p) ** 2 / (trials * p) for s, p in exact.items() if p > 1e-6)
    assert total_variation < 0.02
    assert chi_square < 60.0  # 26 degrees of freedom: p ~ 2e-4
    # And the check has teeth: accepting the draft unconditionally would be far off.
    assert 0.5 * sum(abs((1.0 if s == tuple(draft) else 0.0) - p) for s, p in exact.items()) > 0.2


def test_bad_sampling_params_are_refused_with_the_value():
    from bubblespec.interfaces import SamplingParams

    for kwargs, fragment in [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            SamplingParams(**kwargs)
