"""``bubblespec bench engine``'s draft-head measure (cli/bench_engine_head.py) on a random Llama checkpoint with a
32,000-token vocabulary and its copy one small random step away (pi_t), in float64: the hidden states it learns from
are the policy's own, the four arms decode the same outputs, the counts add up, and a head trained from nothing on
pi_t's samples is accepted more than the untrained one."""

from __future__ import annotations

import random

import pytest
import torch

from bubblespec.cli.bench_engine_head import ARMS, head_batch, measure
from bubblespec.core.interfaces import GenerationRequest, RolloutKey, SamplingParams
from bubblespec.testing.conformance import write_policy_pair

VOCAB = 32_000
HEAD_SCALE = 200.0
"""The output head's rows of a random set of "common" tokens are scaled by this, so the policy's mass sits on a few
likely tokens (as a trained model's does) and a head can learn where it sits."""
INIT_RANGE = 0.005
"""The checkpoints' initialiser standard deviation: the policy's last hidden state is mostly the fed token's
embedding, a function a one-layer head learns within a test's few steps."""
WINDOW = 16
TRAINING_STEPS = 32


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(pi_t, pi_t+1): float64 torch engines (verification gives plain decoding's tokens bit for bit)."""
    from bubblespec.backends.torch_engine import TorchEngine

    newer, older = write_policy_pair(
        tmp_path_factory.mktemp("head-bench"), "llama", VOCAB, HEAD_SCALE, 0.05, hidden_size=64, num_layers=1,
        num_heads=1, head_dim=64, initializer_range=INIT_RANGE,
    )  # fmt: skip
    made = [TorchEngine.from_pretrained(str(path), dtype="float64", max_batch_size=16) for path in (older, newer)]
    yield made
    for engine in made:
        engine.close()


def requests_of(step: int, num: int, seed: int) -> list[GenerationRequest]:
    """``num`` requests of ``step``, 4 samples a prompt, prompts of 4-12 random tokens, responses of 24 tokens."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    prompts = [tuple(rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 12))) for _ in range(num // 4)]
    return [GenerationRequest(prompts[i // 4], RolloutKey(seed, step, f"p{i // 4}", i % 4), params) for i in range(num)]


def test_the_hidden_states_are_the_policys_along_prompt_and_response(engines):
    """Each response's pairs: the policy's last hidden state at the prompt's last position and then at each response
    token but the last, as one row's forward pass computes them (padding and batching change nothing), and the
    response's tokens; right-padded."""
    older, _ = engines
    requests = requests_of(0, 8, seed=5)
    results = older.generate(requests)
    batch = head_batch(older.model, requests, results)
    assert batch.lengths_B.tolist() == [len(r.token_ids) for r in results]
    for row, (request, result) in enumerate(zip(requests, results, strict=True)):
        tokens = torch.tensor([[*request.prompt_token_ids, *result.token_ids]])
        with torch.no_grad():
            _, hidden_1TH = older.model.forward(tokens, torch.arange(tokens.shape[1])[None], return_hidden=True)
        first, length = len(request.prompt_token_ids) - 1, len(result.token_ids)
        torch.testing.assert_close(batch.hidden_BTH[row, :length], hidden_1TH[0, first : first + length])
        assert batch.tokens_BT[row, :length].tolist() == result.token_ids


def test_the_four_arms_decode_the_same_and_a_trained_head_is_accepted_more_than_an_untrained_one(engines):
    """pi_t's 32 samples of step 0 teach a head from nothing (0 or :data:`TRAINING_STEPS` steps); pi_t+1 decodes 8
    requests of step 1 without drafts, with pi_t's drafts, with the head alone and with both: the same tokens in all
    four; decode steps at most the tokens; the head's counts only where it drafts, its accepted tokens at most its
    proposed; in the head arm every draft token is the head's and its acceptance length is the mean tokens per verify
    step; the trained head is accepted more and saves decode steps over the untrained one."""
    older, newer = engines
    training, requests = requests_of(0, 32, seed=1), requests_of(1, 8, seed=2)
    found = {steps: measure(older, newer, training, requests, steps, window=WINDOW) for steps in (0, TRAINING_STEPS)}
    for steps, report in found.items():
        arms, training_summary = report["arms"], report["training"]
        print(f"{steps} steps: loss {training_summary['first_loss']} -> {training_summary['final_loss']}, "
              f"head acceptance length {report['head_acceptance_length']:.3f}, "
              + ", ".join(f"{a} {arms[a]['decode_steps']} steps ({arms[a]['head_tokens_accepted']} of "
                          f"{arms[a]['head_tokens_proposed']} head tokens)" for a in ARMS))  # fmt: skip
        assert report["identical"] and report["differing_responses"] == 0
        assert training_summary["steps"] == steps and training_summary["responses"] == 32
        tokens = arms["plain"]["tokens"]
        assert arms["plain"]["decode_steps"] == tokens == 8 * 24
        for name in ARMS:
            arm = arms[name]
            assert arm["tokens"] == tokens
            assert arm["slowest_response_decode_steps"] <= arm["decode_steps"] <= tokens
            assert arm["head_tokens_accepted"] <= arm["head_tokens_proposed"] <= arm["draft_tokens_proposed"]
            assert arm["draft_tokens_accepted"] <= arm["draft_tokens_proposed"]
            assert arm["decode_steps"] + arm["draft_tokens_accepted"] == tokens  # each step emits one sampled token
            assert (arm["head_tokens_proposed"] > 0) == (name in ("head", "drafts_and_head")), name
        head, both = arms["head"], arms["drafts_and_head"]
        assert head["draft_tokens_proposed"] == head["head_tokens_proposed"]
        assert head["verify_steps"] > 0
        expected = (head["head_tokens_accepted"] + head["verify_steps"]) / head["verify_steps"]
        assert report["head_acceptance_length"] == pytest.approx(expected, rel=1e-12)
        share = both["head_tokens_accepted"] / max(both["draft_tokens_accepted"], 1)
        assert report["head_share_of_accepted_draft_tokens"] == pytest.approx(share, rel=1e-12)
        assert arms["drafts"]["decode_steps"] < tokens  # pi_t's drafts are accepted in part
    untrained, trained = found[0], found[TRAINING_STEPS]
    assert untrained["training"]["final_loss"] is None
    assert trained["training"]["final_loss"] < trained["training"]["first_loss"] / 2
    assert trained["arms"]["head"]["head_tokens_accepted"] > 2 * untrained["arms"]["head"]["head_tokens_accepted"] + 5
    assert trained["head_acceptance_length"] > untrained["head_acceptance_length"]
    assert trained["arms"]["head"]["decode_steps"] < untrained["arms"]["head"]["decode_steps"]
