"""The backend conformance suite (bubblespec.testing) on the built-in torch engine."""

from __future__ import annotations

import pytest

from bubblespec.core.errors import ConfigError
from bubblespec.testing import EngineConformance, RealVocabularyConformance, run_settings


class TestTorchEngine(EngineConformance):
    backend = "torch"
    dtype = "float64"


class TestTorchEngineFloat32(EngineConformance):
    """float32: a rounding near-tie could flip a token in principle; none is allowed on this small set."""

    backend = "torch"
    dtype = "float32"
    engine_settings = {"max_draft_tokens_per_step": 4, "adaptive_draft_length": True}


def test_the_suite_fails_an_engine_that_trusts_drafts_or_ignores_stop(monkeypatch):
    """The suite has teeth: an engine that accepts draft tokens without verifying them, or that runs on after a
    stop, fails it."""
    import pytest

    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.tasks import ArithmeticTask
    from bubblespec.verify import sequence as decoding

    suite = TestTorchEngine()
    engine = TorchEngine.from_pretrained(str(ArithmeticTask.model_path()), dtype="float64")
    requests = suite.make_requests()
    plain = {r.key: r for r in engine.generate(requests)}
    with monkeypatch.context() as patch:
        patch.setattr(decoding, "accepted_length", lambda samples, draft: len(draft))
        with pytest.raises(AssertionError, match="responses differ"):
            suite.test_drafts_never_change_outputs(engine, requests, plain)
    with monkeypatch.context() as patch:
        generate = engine.generate
        patch.setattr(engine, "generate", lambda reqs, stop=None, on_forward=None: generate(reqs, None, on_forward))
        with pytest.raises(AssertionError, match="forward passes ran"):
            suite.test_stop_returns_within_one_forward_pass_with_partial_responses(engine, requests, plain)


def _broken_engines():
    """Engines wrong in ways that matter to RL, each the built-in torch engine with its sampling step changed."""
    import torch

    from bubblespec.backends.torch_engine import TorchEngine

    class ZeroLogprobs(TorchEngine):
        def _sample(self, active, logits, drafts):
            tokens, logprobs, near_ties = super()._sample(active, logits, drafts)
            return tokens, [[0.0] * len(row) for row in logprobs], near_ties

    class LogprobsWithoutTemperature(TorchEngine):
        """Samples right, but reports logprobs of the raw distribution whatever the temperature and filters."""

        def _sample(self, active, logits, drafts):
            tokens, _, near_ties = super()._sample(active, logits, drafts)
            raw = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(tokens)[..., None])[..., 0]
            return tokens, raw.tolist(), near_ties

    class HalfLogits(TorchEngine):
        def _sample(self, active, logits, drafts):
            return super()._sample(active, logits * 0.5, drafts)

    class MultinomialSampler(TorchEngine):
        """The right distribution (temperature 1, no filters), sampled with torch.multinomial instead of keyed noise."""

        def _sample(self, active, logits, drafts):
            probabilities = torch.softmax(logits.double(), -1)
            tokens = torch.multinomial(probabilities.reshape(-1, probabilities.shape[-1]), 1).reshape(logits.shape[:2])
            return tokens.tolist(), probabilities.log().gather(-1, tokens[..., None])[..., 0].tolist(), None

    return ZeroLogprobs, LogprobsWithoutTemperature, HalfLogits, MultinomialSampler


@pytest.mark.parametrize(
    ("broken", "failing_test", "message"),
    [
        ("ZeroLogprobs", "test_matches_the_reference_at_temperature_1", r"every logprob is 0\.0"),
        (
            "LogprobsWithoutTemperature",
            "test_logprobs_follow_temperature_top_k_and_top_p",
            r"logprobs of \d+ of 16 responses differ .* expected .*, got .* under the distribution it was sampled from",
        ),
        ("HalfLogits", "test_matches_the_reference_at_temperature_1", r"logprobs of \d+ of 16 responses differ"),
        (
            "MultinomialSampler",
            "test_matches_the_reference_at_temperature_1",
            r"responses differ .* at position \d+: expected \d+, got \d+\. .* never an RNG draw \(torch\.multinomial",
        ),
    ],
)
def test_the_reference_check_names_what_is_wrong(broken, failing_test, message):
    """Each deliberate break fails a named test of the suite, with a message that says what differs and what
    usually causes it; the engine that only ignores temperature still passes at temperature 1."""
    from bubblespec.tasks import ArithmeticTask

    engine_class = {cls.__name__: cls for cls in _broken_engines()}[broken]
    suite = TestTorchEngine()
    path = ArithmeticTask.model_path()
    engine, reference = (
        engine_class.from_pretrained(**run_settings(path, "float64", {})),
        suite.make_reference_engine(path),
    )
    with pytest.raises(AssertionError, match=message):
        getattr(suite, failing_test)(engine, reference)
    if broken == "LogprobsWithoutTemperature":
        suite.test_matches_the_reference_at_temperature_1(engine, reference)


class TestTorchEngineAtARealVocabulary(RealVocabularyConformance):
    """A Qwen3-shaped checkpoint (q/k norms) with 32,000 tokens, float32."""

    backend = "torch"
    family = "qwen3"
    dtype = "float32"


class TestTorchEngineBatchInvariantAtARealVocabulary(RealVocabularyConformance):
    """The same in float32 with ``batch_invariant``: a sequence's logits do not depend on the pass (tested in
    tests/test_torch_engine.py), so every draft, tree and batch gives plain decoding's responses bit for bit."""

    backend = "torch"
    family = "qwen3"
    dtype = "float32"
    engine_settings = {"batch_invariant": True}
    max_mismatch_rate = 0.0
    num_prompts = 4

    def test_candidates_verified_together_never_change_outputs(self, model_path, older_samples):
        """Replaced: ``batch_invariant`` refuses token trees by name before an engine loads (a tree's later
        candidates round otherwise than plain decoding; tests/test_draft_trees.py)."""
        from bubblespec.backends.torch_engine import TorchEngine

        settings = run_settings(model_path, self.dtype, self.engine_settings | {"draft_candidates": 3})
        with pytest.raises(ConfigError, match="batch_invariant verifies one candidate per pass"):
            TorchEngine.from_pretrained(**settings)


@pytest.mark.slow
class TestTorchEngineAtQwenVocabulary(RealVocabularyConformance):
    """Qwen2's 151,936-token vocabulary."""

    backend = "torch"
    family = "qwen2"
    vocab_size = 151_936
    num_prompts = 4

    # Drafts of every kind and candidates verified together do not depend on the vocabulary's size: the 32,000-token
    # suite runs them. At 151,936 tokens the older policy's drafts, weight updates and every sampling setting against
    # the reference engine check verification.
    test_drafts_of_every_kind_never_change_outputs = None
    test_candidates_verified_together_never_change_outputs = None


@pytest.mark.slow
class TestTorchEngineInBfloat16(RealVocabularyConformance):
    """bfloat16 on the CPU, exact: a row's attention is computed the same way in a verify pass as in a decode pass
    and whatever the batch (bubblespec/models/decoder.py: aligned key spans, one query per head), so its logits are
    bit-identical and no draft flips a token (before: up to one response in six was allowed;
    benchmarks/bf16_exactness.py measured 3.2% of responses flipped by drafts). At this checkpoint's sizes only: at a
    real model's the bfloat16 matrix products of verify passes round differently (benchmarks/conformance_smollm2.py,
    BENCHMARKS.md)."""

    backend = "torch"
    family = "llama3"
    dtype = "bfloat16"
    max_mismatch_rate = 0.0
