"""Keyed sampling and verification: vectorised code against the loop reference, and distribution tests."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from bubblespec.core.interfaces import RolloutKey
from bubblespec.verify import sampling
from bubblespec.verify import sampling_reference as reference


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


@pytest.mark.parametrize("block_logits", [1 << 20, 40])  # one block; blocks of two rows (the penalty per block)
def test_min_p_and_the_repetition_penalty_match_the_reference(monkeypatch, block_logits):
    """min-p and the repetition penalty (transformers' order: the penalty on the raw logits, then temperature, top-k,
    top-p, min-p) against the loop reference, with mixed settings per row; each position sees the row's context and
    the draft tokens fed before it, a token once however often, and greedy rows get the penalty too."""
    monkeypatch.setattr(sampling, "_CPU_BLOCK_ELEMENTS", block_logits)
    rows = [(1.0, 0, 1.0, 0.0, 1.0), (0.7, 0, 1.0, 0.2, 2.5), (1.2, 5, 0.9, 0.05, 3.0), (0.0, 0, 1.0, 0.3, 2.0),
            (1.0, 3, 1.0, 0.5, 0.8), (0.9, 0, 0.7, 0.1, 1.0)]  # fmt: skip
    batch, num_positions, vocab = len(rows), 4, 19
    logits = torch.randn(batch, num_positions, vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    logits = logits * 3
    seeds = _random_seeds(random.Random(13), batch)
    positions = torch.randint(0, 300, (batch, num_positions), generator=torch.Generator().manual_seed(5))
    best = logits.argmax(-1).tolist()  # seen tokens among the likeliest, so that the penalty shows in the samples
    seen = [[1, 2, 2, best[0][0]], [best[1][0]], [5, 5, best[2][0], 18, 3, 4], [best[3][0]], [9, 10, 11], [6]]
    fed = [[3, 3, 12], [1, best[1][1]], [], [best[3][1], 4, 4], [9], [17, 2, 8]]  # draft tokens the pass was fed
    pad = lambda lists: torch.tensor([ids + [-1] * (max(map(len, lists)) - len(ids)) for ids in lists])  # noqa: E731
    columns = [torch.tensor(column, dtype=torch.float64) for column in zip(*rows, strict=True)]
    temperature, top_k, top_p, min_p, penalty = columns
    tokens, logprobs = sampling.keyed_sample(
        logits, seeds, positions, temperature, top_k.long(), top_p, min_p,
        sampling.RepetitionPenalty(penalty, pad(seen), pad(fed)),
    )  # fmt: skip
    for b, t in itertools.product(range(batch), range(num_positions)):
        t_value, k_value, p_value, min_p_value, penalty_value = rows[b]
        token, logprob = reference.keyed_sample(
            logits[b, t].tolist(), tuple(seeds[b].tolist()), int(positions[b, t]), t_value, k_value, p_value,
            min_p_value, penalty_value, seen[b] + fed[b][:t],
        )  # fmt: skip
        assert tokens[b, t].item() == token, (b, t)
        assert logprobs[b, t].item() == pytest.approx(logprob, abs=1e-9)
    unpenalised, _ = sampling.keyed_sample(logits, seeds, positions, temperature, top_k.long(), top_p, min_p)
    assert (unpenalised != tokens).any(), "the penalty changed no sample: the test would not see it ignored"
    plain, _ = sampling.keyed_sample(logits, seeds, positions, temperature, top_k.long(), top_p)
    assert (plain != unpenalised).any(), "min-p changed no sample"


@pytest.mark.parametrize("block_logits", [1 << 20, 40])
def test_suppressed_tokens_match_the_reference_and_are_never_sampled(monkeypatch, block_logits):
    """Suppressed tokens (per row, the likeliest among them so that it shows) against the loop reference with every
    other setting beside them, greedy rows too; no row ever samples one."""
    monkeypatch.setattr(sampling, "_CPU_BLOCK_ELEMENTS", block_logits)
    rows = [(1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (0.7, 5, 0.9, 0.0), (1.3, 0, 0.8, 0.1), (1.0, 0, 1.0, 0.0)]
    batch, num_positions, vocab = len(rows), 6, 23
    generator = torch.Generator().manual_seed(8)
    logits = 3 * torch.randn(batch, num_positions, vocab, dtype=torch.float64, generator=generator)
    seeds = _random_seeds(random.Random(17), batch)
    positions = torch.randint(0, 300, (batch, num_positions), generator=torch.Generator().manual_seed(9))
    best = logits.argmax(-1)
    suppressed = [[int(best[0, 0]), 4], [int(best[1, 0]), int(best[1, 1])], [int(best[2, 2])], [], [0, 1, 2, 3, 4, 5]]
    padded = torch.tensor([ids + [-1] * (6 - len(ids)) for ids in suppressed])
    temperature, top_k, top_p, min_p = (torch.tensor(c, dtype=torch.float64) for c in zip(*rows, strict=True))
    params = (temperature, top_k.long(), top_p, min_p)
    tokens, logprobs = sampling.keyed_sample(logits, seeds, positions, *params, None, padded)
    for b, t in itertools.product(range(batch), range(num_positions)):
        token, logprob = reference.keyed_sample(
            logits[b, t].tolist(), tuple(seeds[b].tolist()), int(positions[b, t]), *rows[b], suppressed=suppressed[b]
        )
        assert tokens[b, t].item() == token, (b, t)
        assert logprobs[b, t].item() == pytest.approx(logprob, abs=1e-9)
        assert token not in suppressed[b]
    plain, _ = sampling.keyed_sample(logits, seeds, positions, *params)
    assert (plain[:3] != tokens[:3]).any(), "the suppression changed no sample: the test would not see it ignored"


def test_suppressing_a_token_changes_only_the_samples_it_won_at_a_large_vocabulary():
    """Without top-p and min-p (which renormalise), a suppressed token takes only its own wins: every other keyed
    sample stays, at 32k tokens and in bfloat16 logits."""
    batch, num_positions, vocab = 4, 64, 32_000
    generator = torch.Generator().manual_seed(3)
    logits = (2 * torch.randn(batch, num_positions, vocab, generator=generator)).to(torch.bfloat16)
    logits[..., 0] = 12.0  # a "pad" token that wins about a third of the samples
    seeds = _random_seeds(random.Random(5), batch)
    positions = torch.arange(num_positions).expand(batch, -1)
    params = (torch.ones(batch, dtype=torch.float64), torch.zeros(batch, dtype=torch.int64), torch.ones(batch))
    plain, _ = sampling.keyed_sample(logits, seeds, positions, *params)
    suppressed, logprobs = sampling.keyed_sample(logits, seeds, positions, *params, None, None, torch.zeros(batch, 1))
    won = plain == 0
    assert 0 < int(won.sum()) < won.numel()
    assert not bool((suppressed == 0).any())
    assert torch.equal(suppressed[~won], plain[~won])
    renormalised = torch.log_softmax(logits.double().index_fill(-1, torch.tensor([0]), -math.inf), -1)
    assert torch.allclose(logprobs, renormalised.gather(-1, suppressed[..., None])[..., 0], atol=1e-9)


def test_min_p_keeps_the_tokens_within_its_share_of_the_best():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.12, 0.08]]], dtype=torch.float64))
    one = torch.ones(1, dtype=torch.float64)
    for min_p, kept in [(0.0, 4), (0.2, 3), (0.25, 2), (0.59, 2), (0.61, 1), (1.0, 1)]:
        scores = sampling.mask_logits(logits, one, torch.zeros(1, dtype=torch.int64), one, torch.tensor([min_p]))
        assert int(torch.isfinite(scores).sum()) == kept, (min_p, scores)
    # after top-p, as transformers applies it: top-p 0.85 keeps 0.5, 0.3 and 0.12; min-p 0.2 keeps all three
    scores = sampling.mask_logits(logits, one, torch.zeros(1, dtype=torch.int64), torch.tensor([0.85]),
                                  torch.tensor([0.2]))  # fmt: skip
    assert torch.isfinite(scores).flatten().tolist() == [True, True, True, False]


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


def _keyed_stream_sampler(stream: int):
    """One-hot verification with counter-based randomness: keyed samples of an independent noise stream."""

    def sample(logits, temperature, seeds, positions):
        rows = logits.shape[0]
        no_top_k, no_top_p = torch.zeros(rows, dtype=torch.int64), torch.ones(rows, dtype=torch.float64)
        stream_seeds = sampling.stream_seeds(seeds, stream)
        return sampling.keyed_sample(logits, stream_seeds, positions, temperature, no_top_k, no_top_p)[0]

    return sample


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
    sample = _keyed_stream_sampler(7)
    trial_seeds = _random_seeds(random.Random(8), trials)
    # All trials advance together; rows that share an emitted prefix share the verifier's logits.
    pending: dict[tuple[int, ...], list[int]] = {(): list(range(trials))}
    counts: dict[tuple[int, ...], int] = {}
    while pending:
        prefix, trial_ids = pending.popitem()
        rows = len(trial_ids)
        proposal = draft[len(prefix) : length - 1]  # leave room for the token sampled after the draft
        logits = torch.stack([target_logits(list(prefix) + proposal[:j]) for j in range(len(proposal) + 1)])
        positions = torch.arange(len(prefix), len(prefix) + len(proposal) + 1).repeat(rows, 1)
        tokens = sample(logits.expand(rows, -1, -1), temperature.expand(rows), trial_seeds[trial_ids], positions)
        accepted = sampling.count_accepted(
            tokens, torch.tensor([proposal] * rows).reshape(rows, -1), torch.full((rows,), len(proposal))
        )
        for row, trial in enumerate(trial_ids):
            emitted = prefix + tuple(tokens[row, : int(accepted[row]) + 1].tolist())
            if len(emitted) >= length:
                counts[emitted[:length]] = counts.get(emitted[:length], 0) + 1
            else:
                pending.setdefault(emitted, []).append(trial)
    exact = _exact_sequence_distribution(probs_fn, length, vocab)
    total_variation = 0.5 * sum(abs(counts.get(s, 0) / trials - p) for s, p in exact.items())
    chi_square = sum((counts.get(s, 0) - trials * p) ** 2 / (trials * p) for s, p in exact.items() if p > 1e-6)
    assert total_variation < 0.02
    assert chi_square < 60.0  # 26 degrees of freedom: p ~ 2e-4
    # And the check has teeth: accepting the draft unconditionally would be far off.
    assert 0.5 * sum(abs((1.0 if s == tuple(draft) else 0.0) - p) for s, p in exact.items()) > 0.2


def test_bad_sampling_params_are_refused_with_the_value():
    from bubblespec.core.interfaces import SamplingParams

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


def _old_folded_key(seed: tuple[int, int]) -> int:
    """The 32-bit key the noise used before it took all 64 bits of the seed: hash32(w0 ^ hash32(w1 ^ salt))."""
    return reference.hash32(seed[0] ^ reference.hash32(seed[1] ^ 0x9E3779B9))


def test_noise_uses_all_64_bits_of_the_seed():
    """Two seeds whose old 32-bit fold collides get different noise (they shared all noise before)."""
    first = (0x12345678, 1)
    second = (first[0] ^ reference.hash32(1 ^ 0x9E3779B9) ^ reference.hash32(2 ^ 0x9E3779B9), 2)
    assert _old_folded_key(first) == _old_folded_key(second)
    seeds = torch.tensor([first, second], dtype=torch.int64)
    positions = torch.arange(4).repeat(2, 1)
    noise = sampling.keyed_gumbel(seeds, positions, 1000)
    assert (noise[0] != noise[1]).float().mean() > 0.99
    # Same-position stream states of distinct seeds are distinct: the seed -> state map is a bijection.
    states = {reference.stream_state(seed, 3)[:2] for seed in [first, second, (first[0], 2), (second[0], 1)]}
    assert len(states) == 4


def test_token_words_are_a_bijection_of_token_ids_per_stream():
    """For one (key, position), no two token ids share a word, so U never ties within a row."""
    seeds = _random_seeds(random.Random(2), 2)
    words, _ = sampling._words_of_rows(seeds, torch.tensor([[0], [12345]]), 1 << 18)
    assert all(row.unique().numel() == 1 << 18 for row in words)


def _brute_force_sample(logits, seeds, positions, temperature, top_k, top_p):
    """argmax of mask(z / T) + G with the noise of every token (greedy rows: argmax of the logits)."""
    scores = sampling.mask_logits(logits, temperature, top_k, top_p)
    noise = sampling.keyed_gumbel(seeds, positions, logits.shape[-1])
    return torch.where((temperature == 0)[:, None, None], scores, scores + noise).argmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scale", [0.05, 3.0, 30.0])
@pytest.mark.parametrize("top_k_column", [(0, 40, 0, 0), (50, 1, 4096, 40)], ids=["mixed", "all-top-k"])
def test_keyed_sample_at_real_vocabulary_equals_the_full_noise_argmax(dtype, scale, top_k_column):
    """Selecting among lucky and high-scoring tokens (or among the few that top-k keeps) gives exactly the
    argmax over every token, with logits from nearly flat to nearly one-hot and mixed sampling parameters."""
    vocab, batch, num_positions = 151_936, 4, 2
    generator = torch.Generator().manual_seed(int(scale * 10))
    logits = (torch.randn(batch, num_positions, vocab, generator=generator) * scale).to(dtype)
    seeds = _random_seeds(random.Random(3), batch)
    positions = torch.randint(0, 5000, (batch, num_positions), generator=generator)
    temperature = torch.tensor([1.0, 0.6, 1.4, 0.0 if top_k_column[0] == 0 else 2.0], dtype=torch.float64)
    top_k = torch.tensor(top_k_column)
    top_p = torch.tensor([1.0, 0.9, 0.97, 1.0], dtype=torch.float64)
    tokens, logprobs = sampling.keyed_sample(logits, seeds, positions, temperature, top_k, top_p)
    assert torch.equal(tokens, _brute_force_sample(logits.double(), seeds, positions, temperature, top_k, top_p))
    scores = sampling.mask_logits(logits.double(), temperature, top_k, top_p)
    expected = torch.log_softmax(scores, -1).gather(-1, tokens[..., None])[..., 0]
    assert torch.allclose(logprobs, expected, rtol=0, atol=1e-12)  # float64-accurate


def test_keyed_sample_is_exact_when_every_token_nearly_ties():
    """Logits equal to c - G (plus 1e-13 jitter) make every token's perturbed score tie to rounding: the bound
    must keep them all as candidates, and exact ties go to the lowest id."""
    seeds = _random_seeds(random.Random(4), 3)
    positions = torch.tensor([[0, 1], [7, 8], [100, 101]])
    noise = sampling.keyed_gumbel(seeds, positions, 20_000)
    params = _params(3, 1.0, 0, 1.0)
    jitter = 1e-13 * torch.randn(noise.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for logits in (5.0 - noise, 5.0 - noise + jitter):
        tokens, _ = sampling.keyed_sample(logits, seeds, positions, *params)
        assert torch.equal(tokens, _brute_force_sample(logits, seeds, positions, *params))


def test_noise_and_samples_do_not_depend_on_the_logits_dtype_or_the_batch():
    vocab = 32_000
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 3, vocab, generator=generator) * 4
    seeds = _random_seeds(random.Random(6), 6)
    positions = torch.randint(0, 100, (6, 3), generator=generator)
    params = _params(6, 0.8, 0, 0.95)
    tokens, logprobs = sampling.keyed_sample(logits, seeds, positions, *params)
    tokens64, logprobs64 = sampling.keyed_sample(logits.double(), seeds, positions, *params)
    assert torch.equal(tokens, tokens64) and torch.equal(logprobs, logprobs64)
    position_major = logits.transpose(0, 1).contiguous().transpose(0, 1)  # the same logits, not contiguous
    for same_logits in (position_major, position_major.double()):
        assert torch.equal(sampling.keyed_sample(same_logits, seeds, positions, *params)[0], tokens)
        for mask_params in (params, _params(6, 1.0, 5, 0.9)):
            assert torch.equal(
                sampling.mask_logits(same_logits, *mask_params), sampling.mask_logits(logits, *mask_params)
            )
    for row in (4, 1):
        alone, _ = sampling.keyed_sample(
            logits[row : row + 1], seeds[row : row + 1], positions[row : row + 1], *(p[row : row + 1] for p in params)
        )
        assert torch.equal(alone[0], tokens[row])


@pytest.mark.parametrize("vocab, scale", [(3000, 1.0), (3000, 0.0), (200, 3.0)])
def test_top_k_and_top_p_match_the_reference_with_ties_at_the_cut(vocab, scale):
    """Logits on a 0.5 grid tie by the hundred, so top-k and top-p cuts fall inside groups of equal
    probability (lower ids kept first); a flat row needs the full sort."""
    generator = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(3, 2, vocab, generator=generator, dtype=torch.float64) * scale * 2).round() / 2
    for temperature, top_k, top_p in [(1.0, 0, 0.5), (0.7, 0, 0.9), (1.0, 100, 0.8), (1.3, 0, 0.999), (1.0, 7, 1.0)]:
        scores = sampling.mask_logits(logits, *_params(3, temperature, top_k, top_p))
        for b, t in itertools.product(range(3), range(2)):
            expected = reference.mask_logits(logits[b, t].tolist(), temperature, top_k, top_p)
            assert torch.isfinite(scores[b, t]).tolist() == [math.isfinite(x) for x in expected]


def test_keyed_gumbel_at_and_max_outside_match_the_full_noise():
    vocab = 5000
    seeds = _random_seeds(random.Random(7), 3)
    positions = torch.tensor([[0, 3], [10, 11], [999, 2**31 + 5]])
    noise = sampling.keyed_gumbel(seeds, positions, vocab)
    excluded = noise.topk(20, -1).indices  # the hardest case: the largest noises are excluded
    excluded[0, 0] = excluded[0, 0, :1]  # repeats are allowed
    best_outside = sampling.keyed_gumbel_max_outside(seeds, positions, vocab, excluded)
    assert torch.equal(best_outside, noise.scatter(-1, excluded, float("-inf")).max(-1).values)
    assert torch.equal(sampling.keyed_gumbel_at(seeds, positions, excluded), noise.gather(-1, excluded))
    everything = torch.arange(4).expand(3, 2, 4)
    assert (sampling.keyed_gumbel_max_outside(seeds, positions, 4, everything) == float("-inf")).all()
    expected = reference.keyed_gumbel_max_outside(tuple(seeds[2].tolist()), 999, 50, [3, 4])
    got = sampling.keyed_gumbel_max_outside(seeds[2:], positions[2:, :1], 50, torch.tensor([[[3, 4]]]))
    assert got.item() == pytest.approx(expected, rel=1e-12)


def test_stream_seeds_match_reference_and_stream_zero_is_the_key():
    seeds = _random_seeds(random.Random(9), 5)
    assert torch.equal(sampling.stream_seeds(seeds, 0), seeds)
    streams = torch.tensor([0, 1, 2, 2**31, 2**32 - 1])
    derived = sampling.stream_seeds(seeds, streams)
    for b in range(5):
        assert tuple(derived[b].tolist()) == reference.stream_seeds(tuple(seeds[b].tolist()), int(streams[b]))
    assert torch.equal(derived, sampling.stream_seeds(seeds, streams))  # a pure function
    assert len({tuple(row) for row in sampling.stream_seeds(seeds[:1].expand(5, 2), streams).tolist()}) == 5
    for bad in (-1, 2**32, torch.tensor([3, -2, 0, 0, 0])):
        with pytest.raises(ValueError, match=r"stream must be in \[0, 2\*\*32\)"):
            sampling.stream_seeds(seeds, bad)


def test_noise_streams_are_independent():
    """Over many keys, samples of stream 0 and of streams 1 and 2**31 at the same positions are independent
    (chi-square on the joint counts) and each follows softmax (chi-square against it)."""
    vocab, num_keys = 4, 40_000
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    logits = probs.log().expand(num_keys, 2, vocab)
    seeds = _random_seeds(random.Random(10), num_keys)
    positions = torch.tensor([0, 1]).repeat(num_keys, 1)
    params = _params(num_keys, 1.0, 0, 1.0)
    samples = {
        s: sampling.keyed_sample(logits, sampling.stream_seeds(seeds, s), positions, *params)[0] for s in (0, 1, 2**31)
    }
    for stream, tokens in samples.items():
        counts = torch.bincount(tokens.flatten(), minlength=vocab).double()
        expected = probs * tokens.numel()
        assert ((counts - expected) ** 2 / expected).sum() < 16.3, stream  # 3 degrees of freedom, p = 1e-3
    for first, second in [(0, 1), (0, 2**31), (1, 2**31)]:
        assert _independence_chi_square(samples[first][:, 0], samples[second][:, 0], vocab) < 27.9  # 9 dof, p = 1e-3
        agreeing = float((samples[first] == samples[second]).double().mean())
        assert agreeing == pytest.approx(float((probs**2).sum()), abs=0.01)
    # The check has teeth: a stream against itself, or two positions of one key sampled with one noise, fail it.
    assert _independence_chi_square(samples[0][:, 0], samples[0][:, 0], vocab) > 1000
    same_noise, _ = sampling.keyed_sample(logits, seeds, positions[:, :1].expand(-1, 2), *params)
    assert _independence_chi_square(same_noise[:, 0], same_noise[:, 1], vocab) > 1000


def _independence_chi_square(first: torch.Tensor, second: torch.Tensor, vocab: int) -> float:
    """Pearson's chi-square of the joint counts of two token samples against the product of their marginals."""
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    joint.index_put_((first, second), torch.ones(first.numel(), dtype=torch.float64), accumulate=True)
    expected = joint.sum(1, keepdim=True) * joint.sum(0, keepdim=True) / first.numel()
    return ((joint - expected) ** 2 / expected).sum().item()


@pytest.mark.parametrize("full_noise_max_logits, block_logits", [(0, 1), (0, 1 << 30), (1 << 30, 1 << 30)])
def test_selection_paths_and_blocks_give_the_same_samples(monkeypatch, full_noise_max_logits, block_logits):
    """The bounded candidate selection, the every-token noise used for small blocks, and any blocking of rows
    all give the reference's samples (here at a toy vocabulary, where most rows have no lucky token)."""
    monkeypatch.setattr(sampling, "_FULL_NOISE_MAX_LOGITS", full_noise_max_logits)
    monkeypatch.setattr(sampling, "_CPU_BLOCK_ELEMENTS", block_logits)
    batch, num_positions, vocab = 8, 4, 19
    logits = torch.randn(batch, num_positions, vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    seeds = _random_seeds(random.Random(12), batch)
    positions = torch.randint(0, 300, (batch, num_positions), generator=torch.Generator().manual_seed(2))
    params = _params(batch, 1.0, 0, 1.0)
    params[0][::3] = 0.0  # greedy rows among sampled ones
    tokens, _ = sampling.keyed_sample(logits * 3, seeds, positions, *params)
    for b, t in itertools.product(range(batch), range(num_positions)):
        expected, _ = reference.keyed_sample(
            (logits[b, t] * 3).tolist(), tuple(seeds[b].tolist()), int(positions[b, t]), float(params[0][b]), 0, 1.0
        )
        assert tokens[b, t].item() == expected


def test_a_wrong_nucleus_estimate_costs_speed_only(monkeypatch):
    """The top-p threshold estimate only decides how many tokens are sorted: a far too high one (a single
    token) leaves the cut undecided and the whole row is sorted, with the reference's result."""
    monkeypatch.setattr(sampling, "_nucleus_threshold", lambda scores, probs, top_p: probs.max(-1).values)
    logits = torch.randn(2, 3, 500, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    scores = sampling.mask_logits(logits, *_params(2, 1.0, 0, 0.9))
    for b, t in itertools.product(range(2), range(3)):
        expected = reference.mask_logits(logits[b, t].tolist(), 1.0, 0, 0.9)
        assert torch.isfinite(scores[b, t]).tolist() == [math.isfinite(x) for x in expected]
        assert torch.isfinite(scores[b, t]).sum() > 1
