"""Verification from top-K log-probabilities (bubblespec.verify.verification) and the shared per-sequence bookkeeping
(bubblespec.verify.sequence): checked against loop references on the full logits, at vocabularies much larger than K."""

from __future__ import annotations

import math

import pytest
import torch

from bubblespec.core.interfaces import Draft, GenerationRequest, RolloutKey, SamplingParams
from bubblespec.verify import sampling, verification
from bubblespec.verify import sampling_reference as reference
from bubblespec.verify.sequence import ProposalSettings, Sequence


def _case(vocab: int, rows: int, spread: float, seed: int, peaked: bool = False):
    """Gaussian logits; ``peaked`` lifts 3 tokens per row by 15, as a trained model puts most mass on a few."""
    generator = torch.Generator().manual_seed(seed)
    logits_JV = torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * spread
    if peaked:
        favourites_J3 = torch.randint(0, vocab, (rows, 3), generator=generator)
        logits_JV.scatter_add_(1, favourites_J3, torch.full((rows, 3), 15.0, dtype=torch.float64))
    seeds_J2 = torch.randint(0, 2**32, (rows, 2), generator=generator)
    positions_J = torch.randint(0, 500, (rows,), generator=generator)
    return logits_JV, seeds_J2, positions_J, generator


def _known(logits_JV: torch.Tensor, num_top: int, extra_J: torch.Tensor | None):
    """What an engine returns: float32 log_softmax of the top K (shuffled), then one extra scored token."""
    logprobs_JV = torch.log_softmax(logits_JV, -1).to(torch.float32)
    top = logprobs_JV.topk(num_top, -1)
    shuffle = torch.randperm(num_top, generator=torch.Generator().manual_seed(1))
    ids, values = top.indices[:, shuffle], top.values[:, shuffle]
    if extra_J is not None:
        ids = torch.cat([ids, extra_J[:, None]], 1)
        values = torch.cat([values, logprobs_JV.gather(1, extra_J[:, None])], 1)
    return ids, values


SETTINGS = [  # temperature, top_k, top_p
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.5, 0, 1.0),
    (0.7, 8, 1.0),
    (0.7, 100, 1.0),
    (1.0, 0, 0.9),
    (0.6, 12, 0.8),
    (0.8, 0, 0.95),
    (0.0, 0, 1.0),
]


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
@pytest.mark.parametrize("spread,peaked", [(0.05, False), (1.0, False), (2.0, True)])
def test_a_decided_sample_is_the_keyed_sample_of_the_full_logits(temperature, top_k, top_p, spread, peaked):
    """K = 16 of V = 3,001, with a draft token outside the top K half the time: every decided position equals
    the keyed sample over the whole vocabulary, and exact logprobs equal its logprob."""
    vocab, rows, num_top = 3001, 96, 16
    logits_JV, seeds_J2, positions_J, generator = _case(vocab, rows, spread, int(spread * 100) + top_k, peaked)
    extra_J = torch.randint(0, vocab, (rows,), generator=generator)
    ids_JC, logprobs_JC = _known(logits_JV, num_top, extra_J)
    params = [torch.full((rows,), v) for v in (float(temperature), top_k, float(top_p))]
    tokens_J, logprobs_J, exact_J = verification.decide_keyed_samples(
        ids_JC, logprobs_JC, num_top, seeds_J2, positions_J, *params, vocab
    )
    # The truth: keyed sampling over the whole vocabulary (itself checked against the loop reference in
    # test_sampling.py), on the float32-rounded log_softmax the engine computed.
    full_JV = torch.log_softmax(logits_JV, -1).to(torch.float32)[:, None]
    expected_J, expected_logprobs_J = (
        t[:, 0] for t in sampling.keyed_sample(full_JV, seeds_J2, positions_J[:, None], *params)
    )
    decided_J = tokens_J >= 0
    decided = int(decided_J.sum())
    assert tokens_J[decided_J].tolist() == expected_J[decided_J].tolist()
    assert torch.allclose(logprobs_J[exact_J], expected_logprobs_J[exact_J], atol=1e-6, rtol=0)
    assert bool(logprobs_J[~decided_J].isnan().all()) and not bool(exact_J[~decided_J].any())
    if peaked and temperature <= 1.0:  # like a trained model's distributions: the top 16 decide nearly everything
        assert decided >= 0.85 * rows, f"only {decided} of {rows} decided"


def _top_k_rule_reference(logits, num_top, extra, seed, position, temperature, top_k, vocab):
    """The decided-sample rule without top-p, one scalar at a time: the best listed candidate (after top-k) must
    beat l_K / T + the largest noise of any unlisted token that top-k might keep."""
    logprobs = torch.log_softmax(torch.tensor(logits), -1).to(torch.float32).to(torch.float64).tolist()
    top = sorted(range(vocab), key=lambda v: -logprobs[v])[:num_top]
    l_K = min(logprobs[v] for v in top)
    listed = set(top) | {extra}
    threshold = sorted((logprobs[v] for v in top), reverse=True)[top_k - 1] if 0 < top_k <= num_top else None
    unlisted_survive = threshold is None or threshold <= l_K
    best, best_score = None, -math.inf
    rival = -math.inf
    for v in listed:
        score = logprobs[v] / temperature + reference.keyed_gumbel(seed, position, v)
        if threshold is not None and logprobs[v] < threshold:
            continue  # dropped by top-k
        if top_k > num_top and v not in top and logprobs[v] < l_K:
            rival = max(rival, score)  # only possibly kept
            continue
        if score > best_score:
            best, best_score = v, score
    outside = -math.inf
    if unlisted_survive:
        outside = l_K / temperature + max(
            reference.keyed_gumbel(seed, position, v) for v in range(vocab) if v not in listed
        )
    return best if best_score > max(rival, outside) else -1


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.5, 0), (1.3, 0), (0.8, 4), (0.8, 10), (0.9, 40)])
def test_the_decided_set_matches_a_loop_reference_of_the_bound(temperature, top_k):
    vocab, rows, num_top = 400, 24, 10
    logits_JV, seeds_J2, positions_J, generator = _case(vocab, rows, 3.0, seed=top_k)
    extra_J = torch.randint(0, vocab, (rows,), generator=generator)
    ids_JC, logprobs_JC = _known(logits_JV, num_top, extra_J)
    tokens_J, _, _ = verification.decide_keyed_samples(
        ids_JC,
        logprobs_JC,
        num_top,
        seeds_J2,
        positions_J,
        torch.full((rows,), temperature),
        torch.full((rows,), top_k),
        torch.ones(rows),
        vocab,
    )
    expected = [
        _top_k_rule_reference(
            logits_JV[j].tolist(),
            num_top,
            int(extra_J[j]),
            tuple(seeds_J2[j].tolist()),
            int(positions_J[j]),
            temperature,
            top_k,
            vocab,
        )
        for j in range(rows)
    ]
    assert tokens_J.tolist() == expected


def test_a_listed_token_outside_the_top_k_never_sets_the_threshold():
    """The draft token's own logprob, far below the K-th largest, must not lower the bound: here the keyed sample
    is an unlisted token just below the top K, so the position must stay undecided (the bound of the smallest
    returned logprob would have called the best listed token the sample)."""
    vocab, num_top, draft = 50, 4, 49
    logits = torch.full((vocab,), -30.0, dtype=torch.float64)
    logits[:num_top] = torch.tensor([2.0, 1.9, 1.8, 1.7])
    seed = (123, 456)
    for position in range(200):  # find a position where the unlisted token 10 wins the Gumbel race
        logits[10] = 1.69
        truth, _ = reference.keyed_sample(torch.log_softmax(logits, -1).tolist(), seed, position, 1.0, 0, 1.0)
        if truth == 10:
            break
    assert truth == 10
    ids_JC, logprobs_JC = _known(logits[None], num_top, torch.tensor([draft]))
    tokens_J, _, _ = verification.decide_keyed_samples(
        ids_JC,
        logprobs_JC,
        num_top,
        torch.tensor([seed]),
        torch.tensor([position]),
        torch.ones(1),
        torch.zeros(1, dtype=torch.int64),
        torch.ones(1),
        vocab,
    )
    assert int(tokens_J[0]) == -1


def test_complete_scoring_decides_everything():
    vocab, rows = 19, 30
    logits_JV, seeds_J2, positions_J, _ = _case(vocab, rows, 0.01, seed=5)
    ids_JC, logprobs_JC = _known(logits_JV, vocab, None)
    params = (torch.full((rows,), 1.0), torch.full((rows,), 5), torch.full((rows,), 0.7))
    tokens_J, _, exact_J = verification.decide_keyed_samples(
        ids_JC, logprobs_JC, vocab, seeds_J2, positions_J, *params, vocab
    )
    expected, _ = sampling.keyed_sample(logits_JV[:, None], seeds_J2, positions_J[:, None], *params)
    assert tokens_J.tolist() == expected[:, 0].tolist() and bool(exact_J.all())


# -- the shared per-sequence bookkeeping --------------------------------------------------------------------------


def _sequence(draft: list[int] | None, max_new_tokens: int = 20, stop: tuple[int, ...] = ()) -> Sequence:
    key = RolloutKey(0, 1, "p", 0)
    request = GenerationRequest(
        (1, 2, 3),
        key,
        SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stop),
        None if draft is None else Draft(key, tuple(draft), 0),
    )
    return Sequence.admit(0, request, vocab_size=100, context_length=1000, eos_ids=())


def test_an_undecided_position_is_decoded_plainly_and_verification_goes_on_after_it():
    settings = ProposalSettings(max_draft_tokens_per_step=4, draft_alignment="position")
    sequence = _sequence(list(range(10, 30)))
    chunk = sequence.propose(settings)
    assert chunk == [10, 11, 12, 13]
    # Two accepted, the third position undecided: the two are kept, nothing is sampled there.
    assert sequence.record(chunk, [10, 11, None, 99, 98], [-0.1, -0.2, math.nan, -0.4, -0.5], settings) == 2
    assert sequence.tokens == [10, 11] and sequence.stats.undecided_steps == 1
    assert sequence.propose(settings) == [], "the undecided position is decoded plainly, never resubmitted"
    sequence.record([], [55], [-0.3], settings)  # not the draft's token: the held scores do not apply
    assert sequence.tokens == [10, 11, 55]
    assert sequence.propose(settings) == [13, 14, 15, 16], "verification goes on after the decoded token"
    stats = sequence.stats
    assert (stats.decode_steps, stats.verify_steps, stats.draft_tokens_accepted) == (2, 1, 2)
    assert stats.acceptance_lengths == {2: 1}


def test_a_plainly_decoded_draft_token_continues_with_the_scores_held_after_it():
    """The verify step scored the positions after the undecided one given the draft token there; when the plain
    step decodes exactly that token, those scores hold and the same step accepts what follows."""
    settings = ProposalSettings(max_draft_tokens_per_step=4, draft_alignment="suffix")
    sequence = _sequence(list(range(10, 30)))
    sequence.record(sequence.propose(settings), [10, 11, None, 13, 77], [-0.1] * 5, settings)
    assert sequence.propose(settings) == []
    sequence.record([], [12], [-0.3], settings)
    assert sequence.tokens == [10, 11, 12, 13, 77] and sequence.logprobs == [-0.1, -0.1, -0.3, -0.1, -0.1]
    stats = sequence.stats
    assert (stats.decode_steps, stats.verify_steps, stats.draft_tokens_proposed) == (2, 2, 4)
    assert stats.draft_tokens_accepted == 4 and stats.acceptance_lengths == {2: 1, 3: 1}
    emitted = sum(length * count for length, count in stats.acceptance_lengths.items())
    assert emitted == len(sequence.tokens) == stats.draft_tokens_accepted + stats.verify_steps - stats.undecided_steps


def test_stops_and_the_length_limit_cut_emitted_tokens():
    settings = ProposalSettings(max_draft_tokens_per_step=8)
    sequence = _sequence([4, 5, 99, 7], stop=(99,))
    sequence.record(sequence.propose(settings), [4, 5, 99, 7, 8], [0.0] * 5, settings)
    assert sequence.tokens == [4, 5, 99] and sequence.finish == "stop"
    assert sequence.stats.draft_tokens_accepted == 3
    short = _sequence([1, 2, 3, 4, 5, 6], max_new_tokens=4)
    assert short.propose(settings) == [1, 2, 3], "one position stays for the sampled token"
    short.record([1, 2, 3], [1, 2, 3, 9], [0.0] * 4, settings)
    assert short.tokens == [1, 2, 3, 9] and short.finish == "length"


def test_adaptive_length_shrinks_after_a_rejection_and_grows_after_full_acceptance():
    settings = ProposalSettings(max_draft_tokens_per_step=8, adaptive_draft_length=True, draft_alignment="position")
    sequence = _sequence(list(range(10, 40)), max_new_tokens=40)
    chunk = sequence.propose(settings)
    sequence.record(chunk, [10, 99] + [0] * 7, [0.0] * 9, settings)  # 1 accepted
    assert len(sequence.propose(settings)) == 2
    chunk = sequence.propose(settings)
    sequence.record(chunk, [*chunk, 1], [0.0] * 3, settings)
    assert len(sequence.propose(settings)) == 4
