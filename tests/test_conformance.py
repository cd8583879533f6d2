"""The backend conformance suite (bubblespec.testing) on the built-in torch engine."""

from __future__ import annotations

import pytest

from bubblespec.testing import EngineConformance, RealVocabularyConformance


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

    from bubblespec import decoding
    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.tasks import ArithmeticTask

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


class TestMinimalExampleBackend(EngineConformance):
    """The plugin authors' example (examples/minimal_backend.py) passes the same suite."""

    dtype = "float64"
    num_prompts = 4
    engine_settings = {"max_draft_tokens_per_step": 8}  # the example's default, stated for the suite's step bound

    def make_engine(self, model_path):
        import importlib.util
        from pathlib import Path

        path = Path(__file__).parent.parent / "examples" / "minimal_backend.py"
        spec = importlib.util.spec_from_file_location("minimal_backend", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.MinimalEngine.from_pretrained(model_path, dtype=self.dtype, **self.engine_settings)


class TestTorchEngineAtARealVocabulary(RealVocabularyConformance):
    """A Qwen3-shaped checkpoint (q/k norms) with 32,000 tokens, float32."""

    backend = "torch"
    family = "qwen3"
    dtype = "float32"


@pytest.mark.slow
class TestTorchEngineAtQwenVocabulary(RealVocabularyConformance):
    """Qwen2's 151,936-token vocabulary."""

    backend = "torch"
    family = "qwen2"
    vocab_size = 151_936
    num_prompts = 4


@pytest.mark.slow
class TestTorchEngineInBfloat16(RealVocabularyConformance):
    """bfloat16: the verify pass and the decode pass round differently, so a near-tie may flip a token; the
    engine benchmark measures how often (`bubblespec bench engine`), this allows one response in six."""

    backend = "torch"
    family = "llama3"
    dtype = "bfloat16"
    max_mismatch_rate = 1 / 6
