"""A conformance suite for engine backends: what every :class:`~bubblespec.core.interfaces.GenerationEngine` must do.

Plugin authors subclass :class:`EngineConformance` in their own tests (pytest is needed)::

    from bubblespec.testing import EngineConformance

    class TestMyEngine(EngineConformance):
        backend = "my-engine"        # the entry point name in group bubblespec.backends
        dtype = "float32"            # the most exact dtype the engine has
        max_mismatch_rate = 0.02     # share of responses allowed to differ with drafts (0 where exact)

The suite loads the engine as a run does (``from_pretrained(**settings)`` with every setting a run passes, the
suite's ``dtype`` and ``engine_settings``: :func:`run_settings`) on the tiny Llama model that ships with bubblespec
(override the ``model_path`` fixture for another checkpoint; it must be a Hugging Face folder whose weights
``update_weights`` takes by name) and checks: the same tokens, logprobs and finish reasons as the built-in torch
engine on the same checkpoint (temperature 1; temperature < 1 with top-k and top-p; greedy; stop tokens,
``ignore_eos`` and ``max_new_tokens``), each difference named with what usually causes it; keyed determinism (a
response is a function of its key, whatever the batch), drafts never change outputs and good ones save decode
steps, preemption within one forward pass with partial responses, weight updates give the new policy, and
per-request stats that add up. bubblespec's pytest plugin makes pytest rewrite the suite's asserts.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from bubblespec.core import model_folder, plugins
from bubblespec.core.errors import DraftError, RequestError
from bubblespec.core.interfaces import (
    Draft,
    DraftBranch,
    ForwardPass,
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    RolloutKey,
    SamplingParams,
)
from bubblespec.rollout.step import drafts_from, step_requests
from bubblespec.tasks.arithmetic import ArithmeticTask
from bubblespec.verify.margins import REPORTED_MARGIN_LIMIT


class EngineConformance:
    backend: str = "torch"
    """Entry point name of the backend under test."""
    dtype: str = "float64"
    max_mismatch_rate: float = 0.0
    """Share of responses that may differ between runs that must agree (0: bit-identical)."""
    engine_settings: dict = {}
    """Extra ``from_pretrained`` settings, e.g. ``{"max_draft_tokens_per_step": 8}``."""
    num_prompts: int = 8
    samples_per_prompt: int = 2
    max_new_tokens: int = 64

    # -- fixtures a subclass may override ----------------------------------------------------------------------

    # Class-scoped fixtures are class methods (pytest 9); they call the overridable ``make_*`` methods on an
    # instance, so a subclass may override those as plain methods.

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls) -> Path:
        return ArithmeticTask.model_path()

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, model_path) -> GenerationEngine:
        engine = cls().make_engine(model_path)
        yield engine
        engine.close()

    def make_engine(self, model_path: Path) -> GenerationEngine:
        """The engine under test, built as a run builds it: the backend's entry point, ``from_pretrained`` with every
        setting a run passes (:class:`bubblespec.core.config.EngineSettings`' defaults, the suite's dtype and
        ``engine_settings``)."""
        engine_class = plugins.load("backends", self.backend)
        return engine_class.from_pretrained(**run_settings(model_path, self.dtype, self.engine_settings))

    @pytest.fixture(scope="class")
    @classmethod
    def reference_engine(cls, model_path) -> GenerationEngine:
        """The built-in torch engine on the same checkpoint and dtype: what the engine under test is compared with."""
        engine = cls().make_reference_engine(model_path)
        yield engine
        engine.close()

    def make_reference_engine(self, model_path: Path) -> GenerationEngine:
        return plugins.load("backends", "torch").from_pretrained(**run_settings(model_path, self.dtype, {}))

    @pytest.fixture(scope="class")
    @classmethod
    def requests(cls) -> list[GenerationRequest]:
        return cls().make_requests()

    def make_requests(self) -> list[GenerationRequest]:
        """Prompts of the shipped task at temperature 1, several samples each."""
        task = ArithmeticTask(seed=7, prompts_per_step=self.num_prompts)
        params = SamplingParams(temperature=1.0, max_new_tokens=self.max_new_tokens)
        return step_requests(task.batch(0), 3, 0, self.samples_per_prompt, params)

    @pytest.fixture(scope="class")
    @classmethod
    def plain(cls, engine, requests) -> dict:
        """Every request in one batch, no drafts: what the other runs of the engine must give."""
        return _by_key(engine.generate(requests))

    # -- the checks ----------------------------------------------------------------------------------------------

    def test_a_response_is_a_function_of_its_key_not_of_the_batch(self, engine, requests, plain):
        shuffled = list(requests)
        random.Random(0).shuffle(shuffled)
        one_by_one = [result for request in requests[:6] for result in engine.generate([request])]
        self._assert_same(plain, _by_key(engine.generate(shuffled)), "the same requests in another order")
        self._assert_same({r.key: plain[r.key] for r in requests[:6]}, _by_key(one_by_one), "requests one at a time")

    def test_different_keys_give_different_samples(self, plain):
        assert len({tuple(r.token_ids) for r in plain.values()}) > len(plain) // 2, "keys do not change samples"

    def test_results_are_well_formed(self, engine, requests, plain):
        assert set(plain) == {r.key for r in requests}
        for request in requests:
            result = plain[request.key]
            assert 0 < len(result.token_ids) <= request.sampling.max_new_tokens
            assert all(0 <= token < engine.vocab_size for token in result.token_ids)
            assert len(result.logprobs) == len(result.token_ids) and all(p <= 1e-6 for p in result.logprobs)
            assert result.finish_reason in ("stop", "length")
            assert result.finish_reason == "stop" or len(result.token_ids) == request.sampling.max_new_tokens

    def test_drafts_never_change_outputs(self, engine, requests, plain):
        rng = random.Random(1)
        variants = {
            "its own response": lambda r: plain[r.key].token_ids,
            "its own response, cut in half": lambda r: plain[r.key].token_ids[: len(plain[r.key].token_ids) // 2],
            "random tokens": lambda r: [rng.randrange(engine.vocab_size) for _ in range(40)],
            "another key's response": lambda r: plain[requests[(requests.index(r) + 1) % len(requests)].key].token_ids,
            "its own response, one token changed": lambda r: _changed(plain[r.key].token_ids, rng, engine.vocab_size),
        }
        for name, draft_tokens in variants.items():
            drafted = [_with_draft(r, draft_tokens(r)) for r in requests]
            self._assert_same(plain, _by_key(engine.generate(drafted)), f"drafts: {name}")

    def test_good_drafts_save_decode_steps(self, engine, requests, plain):
        """With its own response as the draft, a response of L tokens takes at most ceil(L / K) + 1 decode steps,
        K being ``engine_settings["max_draft_tokens_per_step"]`` (16 unless set, the rollout default); the + 1 is for
        an engine whose prefill takes no draft, and each position the engine's top-K left undecided adds one."""
        drafted = _by_key(engine.generate([_with_draft(r, plain[r.key].token_ids) for r in requests]))
        without = sum(r.stats.decode_steps for r in plain.values())
        with_drafts = sum(r.stats.decode_steps for r in drafted.values())
        assert with_drafts <= 0.5 * without, f"decode steps {without} -> {with_drafts} with perfect drafts"
        assert sum(r.stats.draft_tokens_accepted for r in drafted.values()) > 0
        per_step = self.engine_settings.get("max_draft_tokens_per_step", 16)
        for key, result in drafted.items():
            bound = -(-len(result.token_ids) // per_step) + 1 + result.stats.undecided_steps
            assert result.stats.decode_steps <= bound, (
                f"{key}: {result.stats.decode_steps} decode steps for {len(result.token_ids)} tokens with a perfect "
                f"draft, {per_step} draft tokens per step (at most {bound})"
            )

    def test_stats_add_up(self, engine, requests, plain):
        drafted = engine.generate([_with_draft(r, plain[r.key].token_ids[:20]) for r in requests])
        for result in [*plain.values(), *drafted]:
            stats = result.stats
            # A verify step stopped by a position the engine's top-K could not decide emits only what it accepted.
            assert 1 <= stats.decode_steps <= len(result.token_ids) + stats.undecided_steps
            assert 0 <= stats.undecided_steps <= stats.verify_steps <= stats.decode_steps
            assert 0 <= stats.draft_tokens_accepted <= stats.draft_tokens_proposed
            assert sum(stats.acceptance_lengths.values()) == stats.verify_steps
            emitted = sum(length * count for length, count in stats.acceptance_lengths.items())
            assert emitted == stats.draft_tokens_accepted + stats.verify_steps - stats.undecided_steps
        assert all(r.stats.verify_steps == 0 for r in plain.values())
        assert sum(r.stats.verify_steps for r in drafted) > 0

    def test_out_of_vocabulary_drafts_are_refused(self, engine, requests):
        with pytest.raises(DraftError, match="token ids must be integers in"):
            engine.generate([_with_draft(requests[0], [engine.vocab_size])])

    def test_stop_returns_within_one_forward_pass_with_partial_responses(self, engine, requests, plain):
        passes: list[ForwardPass] = []

        class AfterTwoPasses:
            def is_set(self) -> bool:
                return len(passes) >= 2

        results = _by_key(engine.generate(requests, stop=AfterTwoPasses(), on_forward=passes.append))
        assert len(passes) == 2, f"{len(passes)} forward passes ran; the stop was set after the second"
        assert set(results) == set(plain)
        preempted = [r for r in results.values() if r.finish_reason == "preempted"]
        assert preempted, "nothing was preempted"
        for key, result in results.items():
            assert plain[key].token_ids[: len(result.token_ids)] == result.token_ids, "a partial response diverged"
            if result.finish_reason != "preempted":
                assert result.token_ids == plain[key].token_ids

    def test_a_weight_update_gives_the_new_policy(self, model_path, requests, tmp_path):
        from safetensors.torch import save_file

        weights = model_folder.weights(model_path)
        changed = {name: tensor * 1.05 if tensor.ndim == 2 else tensor for name, tensor in weights.items()}
        folder = tmp_path / "changed"
        shutil.copytree(model_path, folder)
        for file in folder.glob("*.safetensors"):
            file.unlink()
        save_file({n: t.contiguous() for n, t in changed.items()}, str(folder / "model.safetensors"))

        engine, fresh = self.make_engine(model_path), self.make_engine(folder)
        try:
            before = _by_key(engine.generate(requests))
            engine.update_weights(changed, version=5)
            assert engine.policy_version == 5
            after, expected = _by_key(engine.generate(requests)), _by_key(fresh.generate(requests))
            self._assert_same(expected, after, "after update_weights, against an engine loaded with those weights")
            assert any(before[k].token_ids != after[k].token_ids for k in before), "the update changed nothing"
        finally:
            engine.close()
            fresh.close()

    def test_a_weight_update_of_some_layers_merges_them_into_the_current_weights(
        self, engine, model_path, requests, plain, tmp_path
    ):
        """A run may send a subset of the weights (a trainer that trains some layers): the named ones change, the
        rest stay. Here layer 0's attention projections (whole fused groups: q, k, v and o), against the reference
        engine loaded with the merged weights; then the engine gets its own weights back."""
        from safetensors.torch import save_file

        weights = model_folder.weights(model_path)
        subset = {name: tensor * 1.3 for name, tensor in weights.items() if ".layers.0.self_attn." in name
                  and name.endswith("_proj.weight")}  # fmt: skip
        assert len(subset) == 4, f"expected layer 0's q, k, v and o projections, got {sorted(subset)}"
        folder = tmp_path / "merged"
        shutil.copytree(model_path, folder)
        for file in folder.glob("*.safetensors"):
            file.unlink()
        save_file({n: t.contiguous() for n, t in (weights | subset).items()}, str(folder / "model.safetensors"))
        reference = self.make_reference_engine(folder)
        try:
            engine.update_weights(subset, version=3)
            after, expected = _by_key(engine.generate(requests)), _by_key(reference.generate(requests))
            self._assert_same(expected, after, "after update_weights with layer 0's attention only, against the "
                                               "reference engine loaded with the merged weights")  # fmt: skip
            assert any(plain[k].token_ids != after[k].token_ids for k in plain), "the update changed nothing"
        finally:
            engine.update_weights(weights, version=0)  # the class's other tests share the engine
            reference.close()

    def test_release_and_resume_keep_the_weights(self, engine, requests, plain):
        engine.release()
        engine.resume()
        self._assert_same(plain, _by_key(engine.generate(requests)), "after release() and resume()")

    # -- against the reference engine ------------------------------------------------------------------------------

    logprob_tolerance: float | None = None
    """Largest |logprob - the reference's| allowed per token; None: by dtype (:data:`LOGPROB_TOLERANCES`)."""
    reference_mismatch_rate: float | None = None
    """Share of responses whose tokens may differ from the reference engine's; None: ``max_mismatch_rate``. Two
    engines that round differently (bfloat16 kernels) flip near ties more often than one engine does against itself."""

    def tolerance(self) -> float:
        if self.logprob_tolerance is not None:
            return self.logprob_tolerance
        if self.dtype not in LOGPROB_TOLERANCES:
            raise ValueError(f"no logprob tolerance for dtype {self.dtype!r}: set the suite's logprob_tolerance")
        return LOGPROB_TOLERANCES[self.dtype]

    def reference_allowance(self, num_requests: int) -> int:
        rate = self.max_mismatch_rate if self.reference_mismatch_rate is None else self.reference_mismatch_rate
        return int(rate * num_requests)

    def reference_requests(self, **sampling) -> list[GenerationRequest]:
        """The suite's prompts with ``sampling`` (:class:`SamplingParams` fields)."""
        params = SamplingParams(**({"max_new_tokens": self.max_new_tokens} | sampling))
        return [GenerationRequest(r.prompt_token_ids, r.key, params) for r in self.make_requests()]

    def assert_matches_reference(self, engine, reference_engine, requests, what: str) -> dict:
        """The engine's tokens, logprobs and finish reasons equal the reference engine's (see :func:`compare`);
        returns the engine's results by key."""
        actual = _by_key(engine.generate(requests))
        expected = _by_key(reference_engine.generate(requests))
        compare(expected, actual, self.tolerance(), self.reference_allowance(len(requests)), what)
        return actual

    def test_matches_the_reference_at_temperature_1(self, engine, reference_engine):
        self.assert_matches_reference(engine, reference_engine, self.reference_requests(), "temperature 1")

    def test_logprobs_follow_temperature_top_k_and_top_p(self, engine, reference_engine):
        """Logprobs are of the distribution the token was sampled from: temperature, top-k and top-p applied."""
        requests = self.reference_requests(temperature=0.7, top_k=5, top_p=0.9)
        self.assert_matches_reference(engine, reference_engine, requests, "temperature 0.7, top-k 5, top-p 0.9")

    def test_greedy_matches_the_reference(self, engine, reference_engine):
        """Temperature 0: the argmax, and the logprob of the raw model distribution."""
        self.assert_matches_reference(engine, reference_engine, self.reference_requests(temperature=0.0), "greedy")

    unsupported_sampling: tuple[str, ...] = ()
    """:class:`SamplingParams` fields the engine refuses (a ``RequestError`` naming them) rather than applies; every
    other setting must give the reference's samples."""

    def test_min_p_the_repetition_penalty_and_suppressed_tokens_match_the_reference(self, engine, reference_engine):
        """min-p, the repetition penalty (over the prompt and the response so far) and suppressed tokens as the
        reference applies them, greedy too; or one clear refusal naming them where the engine declares them
        unsupported."""
        settings = {"temperature": 0.9, "min_p": 0.05, "repetition_penalty": 1.3}
        requests = self.reference_requests(**settings)
        if self.unsupported_sampling:
            with pytest.raises(RequestError, match="|".join(self.unsupported_sampling)):
                engine.generate(requests)
            return
        self.assert_matches_reference(engine, reference_engine, requests, "temperature 0.9, min-p 0.05, penalty 1.3")
        greedy = self.reference_requests(temperature=0.0, repetition_penalty=1.3)
        self.assert_matches_reference(engine, reference_engine, greedy, "greedy, repetition penalty 1.3")
        without = _by_key(reference_engine.generate(self.reference_requests(temperature=0.9)))
        penalised = _by_key(reference_engine.generate(requests))
        assert any(without[k].token_ids != penalised[k].token_ids for k in without), "the settings changed nothing"
        common = collections.Counter(t for r in without.values() for t in r.token_ids[:-1]).most_common(2)
        suppressed = tuple(token for token, _ in common)  # the tokens sampled most: suppressing them shows
        for what, settings in {
            f"temperature 0.9, suppressed {suppressed}": {"temperature": 0.9},
            f"greedy, suppressed {suppressed}": {"temperature": 0.0},
        }.items():
            requests = self.reference_requests(suppressed_token_ids=suppressed, **settings)
            results = self.assert_matches_reference(engine, reference_engine, requests, what)
            sampled = {t for r in results.values() for t in r.token_ids}
            assert not sampled & set(suppressed), f"{what}: the engine sampled a suppressed token"

    def test_stop_tokens_ignore_eos_and_max_new_tokens_match_the_reference(self, engine, reference_engine):
        """Extra stop tokens end a response at their first occurrence (the token kept, finish "stop"), ``ignore_eos``
        generates past the end-of-sequence token to ``max_new_tokens`` (finish "length")."""
        plain = _by_key(reference_engine.generate(self.reference_requests()))
        common = collections.Counter(t for r in plain.values() for t in r.token_ids[1:-1]).most_common(2)
        stop_tokens = tuple(token for token, _ in common)
        for what, requests in {
            f"stop_token_ids {stop_tokens}": self.reference_requests(stop_token_ids=stop_tokens),
            "ignore_eos, max_new_tokens 24": self.reference_requests(ignore_eos=True, max_new_tokens=24),
            "max_new_tokens 3": self.reference_requests(max_new_tokens=3),
        }.items():
            self.assert_matches_reference(engine, reference_engine, requests, what)
        ignoring = _by_key(engine.generate(self.reference_requests(ignore_eos=True, max_new_tokens=24)))
        assert all(len(r.token_ids) == 24 and r.finish_reason == "length" for r in ignoring.values()), (
            "ignore_eos: every response must run to max_new_tokens (24) and finish with 'length'"
        )

    # -- helpers -------------------------------------------------------------------------------------------------

    def _assert_same(self, expected: dict, actual: dict, what: str) -> None:
        assert set(expected) == set(actual), f"{what}: other keys came back"
        differing = [key for key in expected if expected[key].token_ids != actual[key].token_ids]
        allowed = int(self.max_mismatch_rate * len(expected))
        assert len(differing) <= allowed, (
            f"{what}: {len(differing)} of {len(expected)} responses differ (allowed {allowed}), e.g. {differing[0]}"
        )


LOGPROB_TOLERANCES = {"float64": 1e-5, "float32": 1e-3, "bfloat16": 0.5}
"""Per-token |logprob - the reference's| an engine may show in each dtype. float64: transformers-style float32 rotary
tables alone differ by ~1e-6. bfloat16 keeps 8 bits of mantissa, so a logit of 40 (a peaked, trained-like head) is
off by up to 0.16 from one kernel to another, and a logprob carries that of its logit and of the normaliser (vLLM's
CPU kernels against the torch engine: 0.19 measured at 32,000 tokens); a wrong logprob path is off by O(1)."""
LOGPROB_DEFINITION = (
    "logprobs[i] must be the log-probability of token_ids[i] under the distribution it was sampled from: logits / "
    "temperature, then top-k and top-p, renormalised (bubblespec.verify.sampling.keyed_sample returns it); under "
    "greedy (temperature 0) the raw model distribution (docs/plugins.md, Logprobs)"
)


def compare(expected: dict, actual: dict, tolerance: float, allowed_mismatches: int, what: str) -> None:
    """Fails (AssertionError) where ``actual`` (results by key) differs from ``expected`` (the reference engine's):
    a logprob off by more than ``tolerance`` where the tokens still agree; more than ``allowed_mismatches`` responses
    whose tokens differ; a different finish reason for the same tokens. Each message names the first difference and
    what usually causes it."""
    assert set(actual) == set(expected), f"{what}: results for other keys came back than were asked for"
    logprob_errors, token_errors = [], []
    for key, want in expected.items():
        got = actual[key]
        assert len(got.logprobs) == len(got.token_ids), (
            f"{what}: {key} has {len(got.token_ids)} tokens and {len(got.logprobs)} logprobs; one per token, please"
        )
        agree = _common_prefix(want.token_ids, got.token_ids)
        for i in range(agree):
            if not abs(got.logprobs[i] - want.logprobs[i]) <= tolerance:  # a NaN fails too
                logprob_errors.append((key, i, want.token_ids[i], want.logprobs[i], got.logprobs[i]))
                break
        if agree < max(len(want.token_ids), len(got.token_ids)):
            token_errors.append((key, agree, want, got))
        else:
            assert got.finish_reason == want.finish_reason, (
                f"{what}: {key} has the reference's tokens but finish reason {got.finish_reason!r}, not "
                f"{want.finish_reason!r} ('stop': it ended on an end-of-sequence or stop token; 'length': it reached "
                "max_new_tokens)"
            )
    if logprob_errors:
        key, i, token, want_lp, got_lp = logprob_errors[0]
        everything = [lp for r in actual.values() for lp in r.logprobs]
        hint = (
            "every logprob is 0.0: the engine returns no logprobs"
            if everything and all(lp == 0.0 for lp in everything)
            else LOGPROB_DEFINITION + "; a different model computation (logit scale, norm epsilon, rotary "
            "embedding, dtype) shows here too"
        )
        raise AssertionError(
            f"{what}: the logprobs of {len(logprob_errors)} of {len(expected)} responses differ from the reference "
            f"engine's (the built-in torch engine on the same checkpoint) by more than {tolerance:g} where their "
            f"tokens agree; first: {key} position {i}, token {token}: expected {want_lp:.6g}, got {got_lp:.6g}. {hint}"
        )
    if len(token_errors) > allowed_mismatches:
        key, i, want, got = token_errors[0]
        expected_token = want.token_ids[i] if i < len(want.token_ids) else f"the end ({want.finish_reason})"
        got_token = got.token_ids[i] if i < len(got.token_ids) else f"the end ({got.finish_reason})"
        raise AssertionError(
            f"{what}: {len(token_errors)} of {len(expected)} responses differ from the reference engine's (allowed "
            f"{allowed_mismatches}); first: {key} at position {i}: expected {expected_token}, got {got_token}. The "
            "logprobs of the tokens before agree, so the distribution is right and the choice is not: the token at "
            "response position i of key k must be the keyed sample (bubblespec.verify.sampling.keyed_sample with "
            "key.noise_seed() and position i), never an RNG draw (torch.multinomial, a seeded generator) or a "
            "sampler of the engine's own; a stop token, ignore_eos or max_new_tokens not honoured shows here too. "
            "In a dtype that rounds, a near tie flips a token now and then: set reference_mismatch_rate to the share "
            "your engine shows"
        )


def run_settings(model_path: Path | str, dtype: str, settings: dict) -> dict:
    """What ``from_pretrained`` gets in a run with the default rollout settings
    (:func:`bubblespec.run.assembly.engine_settings`), then ``dtype`` and ``settings``."""
    from bubblespec.core.config import ServiceConfig
    from bubblespec.run.assembly import engine_settings

    return engine_settings(ServiceConfig.model_validate({"model": {"dtype": dtype}}), str(model_path)) | settings


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _by_key(results: Sequence[GenerationResult]) -> dict:
    return {result.key: result for result in results}


def _with_draft(request: GenerationRequest, tokens: Sequence[int]) -> GenerationRequest:
    draft = Draft(request.key, tuple(tokens), policy_version=0)
    return GenerationRequest(request.prompt_token_ids, request.key, request.sampling, draft)


def _other(token: int, rng: random.Random, vocab_size: int) -> int:
    """A token id other than ``token``."""
    return (token + rng.randrange(1, vocab_size)) % vocab_size


def _changed(tokens: Sequence[int], rng: random.Random, vocab_size: int) -> list[int]:
    changed = list(tokens)
    if changed:
        position = rng.randrange(len(changed))
        changed[position] = (changed[position] + 1) % vocab_size
    return changed


class RealVocabularyConformance:
    """The same promises at the scale users bring: a random checkpoint written by transformers with a real
    vocabulary (32,000 by default), temperature 1 and temperature < 1 with top-k and top-p, and drafts of the kinds
    a run produces: from a policy one small step older, random, truncated and over-long. Every generate call runs
    under a time limit, and outputs with drafts must equal plain keyed decoding (up to ``max_mismatch_rate``).

    Subclass it like :class:`EngineConformance`; ``make_engine(model_path)`` builds the engine under test. The
    checkpoint's output head is scaled on a few hundred tokens so that its distributions are peaked like a trained
    model's (a freshly initialised head gives nearly uniform ones, which no top-K scoring can decide); the older
    policy is the same checkpoint with every weight matrix moved by ``policy_step`` of its standard deviation.
    """

    backend: str = "torch"
    dtype: str = "float32"
    family: str = "llama"
    vocab_size: int = 32_000
    max_mismatch_rate: float = 0.0
    engine_settings: dict = {}
    num_prompts: int = 6
    samples_per_prompt: int = 2
    max_new_tokens: int = 24
    time_limit_s: float = 120.0
    head_scale: float = 40.0
    policy_step: float = 0.02
    sampling_settings: dict[str, dict] = {
        "t1": {"temperature": 1.0},
        "t0.7-topk40-topp0.9": {"temperature": 0.7, "top_k": 40, "top_p": 0.9},
        "t0.9-minp0.05-penalty1.2-suppressed": {
            "temperature": 0.9, "min_p": 0.05, "repetition_penalty": 1.2, "suppressed_token_ids": (0, 1, 3),
        },
    }  # fmt: skip

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoints(cls, tmp_path_factory) -> tuple[Path, Path]:
        """(newer, older) policy folders."""
        folder = tmp_path_factory.mktemp(f"{cls.family}-{cls.vocab_size}")
        return write_policy_pair(folder, cls.family, cls.vocab_size, cls.head_scale, cls.policy_step)

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, checkpoints) -> Path:
        return checkpoints[0]

    engine = EngineConformance.engine
    make_engine = EngineConformance.make_engine
    reference_engine = EngineConformance.reference_engine
    make_reference_engine = EngineConformance.make_reference_engine
    logprob_tolerance: float | None = None
    reference_mismatch_rate: float | None = None
    reference_allowance = EngineConformance.reference_allowance
    tolerance = EngineConformance.tolerance

    @pytest.fixture(scope="class")
    @classmethod
    def older_samples(cls, checkpoints) -> dict:
        """The older policy's keyed samples for every setting's requests: the drafts bubble drafting makes."""
        older = plugins.load("backends", "torch").from_pretrained(str(checkpoints[1]), dtype="float32")
        suite = cls()
        return {name: _by_key(older.generate(suite.make_requests(name))) for name in cls.sampling_settings}

    def make_requests(self, setting: str) -> list[GenerationRequest]:
        rng = random.Random(3)
        params = SamplingParams(max_new_tokens=self.max_new_tokens, ignore_eos=True, **self.sampling_settings[setting])
        return [
            GenerationRequest(
                tuple(rng.randrange(3, self.vocab_size) for _ in range(rng.randint(4, 24))),
                RolloutKey(11, 1, f"prompt-{p}", s),
                params,
            )
            for p in range(self.num_prompts)
            for s in range(self.samples_per_prompt)
        ]

    def test_drafts_of_every_kind_never_change_outputs(self, engine, older_samples):
        rng = random.Random(5)
        vocab = engine.vocab_size
        for setting in self.sampling_settings:
            requests = self.make_requests(setting)
            plain = _by_key(self._timed(engine, requests, f"{setting}, no drafts"))
            for name, drafts in self._draft_variants(requests, older_samples[setting], plain, rng, vocab).items():
                drafted = self._timed(engine, [_with_draft(r, drafts[r.key]) for r in requests], f"{setting}, {name}")
                self._assert_same(plain, _by_key(drafted), f"{setting}, drafts: {name}")

    def test_matches_the_reference_at_every_setting(self, engine, reference_engine):
        """Tokens, logprobs and finish reasons equal the built-in torch engine's at this vocabulary, for every
        sampling setting (see :meth:`EngineConformance.assert_matches_reference`)."""
        for setting in self.sampling_settings:
            requests = self.make_requests(setting)
            expected = _by_key(self._timed(reference_engine, requests, f"{setting}, the reference engine"))
            actual = _by_key(self._timed(engine, requests, f"{setting}, the engine under test"))
            compare(expected, actual, self.tolerance(), self.reference_allowance(len(requests)), setting)

    def test_candidates_verified_together_never_change_outputs(self, model_path, older_samples):
        """Several candidates per sequence and pass (``draft_candidates``: the request's draft, each sibling's
        response, prompt lookup), at every sampling setting, beside the older policy's drafts and random ones:
        plain decoding's outputs. An engine that builds token trees verifies them together; one that does not
        verifies the first."""
        engine_class = plugins.load("backends", self.backend)
        if not engine_class.supports_draft_chain:
            pytest.skip(f"the {self.backend} backend runs no dynamic draft sources, so it has one candidate a pass")
        settings = self.engine_settings | {"draft_chain": ("request", "group", "ngram"), "draft_candidates": 3}
        engine = engine_class.from_pretrained(**run_settings(model_path, self.dtype, settings))
        rng = random.Random(6)
        try:
            for setting in self.sampling_settings:
                requests = self.make_requests(setting)
                plain = _by_key(self._timed(engine, requests, f"{setting}, no drafts"))
                variants = self._draft_variants(requests, older_samples[setting], plain, rng, engine.vocab_size)
                for name in ("older policy", "random"):
                    drafted = [_with_draft(r, variants[name][r.key]) for r in requests]
                    drafted = self._timed(engine, drafted, f"{setting}, {name}, candidates")
                    self._assert_same(plain, _by_key(drafted), f"{setting}, candidates beside drafts: {name}")
        finally:
            engine.close()

    def _draft_variants(self, requests, older: dict, plain: dict, rng: random.Random, vocab: int) -> dict:
        """Draft tokens by key for each kind of draft a run can produce."""
        keys = [r.key for r in requests]
        return {
            "older policy": {k: older[k].token_ids for k in keys},
            "random": {k: [rng.randrange(vocab) for _ in range(self.max_new_tokens)] for k in keys},
            "older policy, truncated": {k: older[k].token_ids[: self.max_new_tokens // 3] for k in keys},
            "own response, over-long": {k: [*plain[k].token_ids, *rng.choices(range(vocab), k=30)] for k in keys},
        }

    @pytest.fixture(scope="class")
    @classmethod
    def older_tries(cls, checkpoints) -> dict:
        """Draft tries of the first sampling setting's requests (docs/design.md §13): the older policy's drafts with
        their near-ties and a branch at each draft's two nearest ones, drafted by the torch engine, which drafts tries
        whichever engine verifies them."""
        from bubblespec.verify.tries import branch_from, branch_request, open_ties, with_branch

        older = plugins.load("backends", "torch").from_pretrained(str(checkpoints[1]), dtype="float32")
        setting = next(iter(cls.sampling_settings))
        requests = [dataclasses.replace(r, margins=True) for r in cls().make_requests(setting)]
        tries = {draft.key: draft for draft in drafts_from(older.generate(requests), 0)}
        by_key = {r.key: r for r in requests}
        nearest = {key: sorted(open_ties(d), key=lambda t: t.tie.margin)[:2] for key, d in tries.items()}
        opened = [(key, tie) for key, ties in nearest.items() for tie in ties]
        branches = older.generate([branch_request(by_key[key], tie) for key, tie in opened])
        for (key, tie), result in zip(opened, branches, strict=True):
            tries[key] = with_branch(tries[key], tie.route, branch_from(result, tie.tie.index))
        older.close()
        return tries

    def test_draft_tries_never_change_outputs(self, engine, older_tries):
        """Drafts with branches at their near-ties, as bubble drafting makes them with draft tries: every backend
        follows a branch whose first token it emits (:class:`~bubblespec.verify.sequence.Sequence`). With the
        branches as drafted, and with every branch's tokens after its first replaced by random ones: plain
        decoding's outputs, and with the branches as drafted some response takes one."""
        setting = next(iter(self.sampling_settings))
        requests = self.make_requests(setting)
        plain = _by_key(self._timed(engine, requests, f"{setting}, no drafts"))
        rng = random.Random(8)

        def wrong(branch):
            noise = rng.choices(range(engine.vocab_size), k=len(branch.token_ids) - 1)
            return dataclasses.replace(branch, token_ids=(branch.token_ids[0], *noise))

        def nested(draft: Draft) -> Draft:  # a random branch inside each branch, one position after its start
            inner = [
                DraftBranch(b.index + 1, (_other(b.token_ids[1], rng, engine.vocab_size), *rng.choices(range(9), k=4)))
                for b in draft.branches
                if len(b.token_ids) > 1
            ]
            return dataclasses.replace(draft, branches=tuple(
                dataclasses.replace(b, branches=(i,)) for b, i in zip(draft.branches, inner, strict=False)
            ))  # fmt: skip

        def past_the_end(key) -> Draft:  # the response, more tokens, and a branch off those
            path = (*plain[key].token_ids, *rng.choices(range(engine.vocab_size), k=6))
            return Draft(key, path, 0, branches=(DraftBranch(len(path) - 3, (_other(path[-3], rng, 9), 1, 2)),))

        assert any(t.branches for t in older_tries.values()), "no draft had a near-tie to branch from"
        variants = {
            "tries": older_tries,
            "tries, every branch wrong": {
                key: dataclasses.replace(d, branches=tuple(map(wrong, d.branches))) for key, d in older_tries.items()
            },
            "tries, a wrong branch in each branch": {key: nested(d) for key, d in older_tries.items()},
            "a branch past the response's end": {key: past_the_end(key) for key in older_tries},
        }
        followed = {}
        for name, tries in variants.items():
            drafted = [dataclasses.replace(r, draft=tries[r.key]) for r in requests]
            drafted = _by_key(self._timed(engine, drafted, f"{setting}, {name}"))
            self._assert_same(plain, drafted, f"{setting}, drafts: {name}")
            followed[name] = sum(r.stats.branches_followed for r in drafted.values())
        assert followed["tries"] > 0, f"no response took a branch: {followed}"

    def test_drafting_tries_reports_near_ties_and_takes_response_prefixes(self, engine):
        """What drafting branches needs of an engine (docs/plugins.md, *Draft tries*). One with
        ``supports_draft_tries``: asked for margins, the same outputs, and each sampled token's runner-up and margin
        where the margin is at most ``REPORTED_MARGIN_LIMIT`` (-1 and inf elsewhere); the runner-up is what the engine
        samples at that position, given the response before it as a prefix, with the winner suppressed; a response
        prefix of its own tokens gives the same response, the given tokens with logprob 0. Any other engine refuses
        a response prefix by name."""
        setting = next(iter(self.sampling_settings))
        requests = self.make_requests(setting)
        if not getattr(engine, "supports_draft_tries", False):
            prefixed = [dataclasses.replace(requests[0], response_prefix=(5, 6))]
            with pytest.raises(RequestError, match="has a response prefix, which this engine does not take"):
                engine.generate(prefixed)
            return
        plain = _by_key(self._timed(engine, requests, f"{setting}, no drafts"))
        asked = [dataclasses.replace(r, margins=True) for r in requests]
        reported = _by_key(self._timed(engine, asked, f"{setting}, margins asked for"))
        self._assert_same(plain, reported, f"{setting}, margins asked for")
        checks = []
        for request in asked:
            result = reported[request.key]
            assert len(result.runner_up_ids) == len(result.margins) == len(result.token_ids), (
                f"{request.key}: one runner-up and margin per token"
            )
            for index, (winner, runner_up, margin) in enumerate(
                zip(result.token_ids, result.runner_up_ids, result.margins, strict=True)
            ):
                if runner_up < 0:
                    assert margin == float("inf"), f"{request.key} position {index}: no runner-up, margin {margin}"
                    continue
                assert runner_up != winner and 0 <= margin <= REPORTED_MARGIN_LIMIT, (
                    f"{request.key} position {index}: runner-up {runner_up} (winner {winner}) at margin {margin}"
                )
                if len(checks) < 8 and index > 0:
                    sampling = dataclasses.replace(
                        request.sampling,
                        suppressed_token_ids=(*request.sampling.suppressed_token_ids, winner),
                        max_new_tokens=index + 1,
                    )
                    prefix = tuple(result.token_ids[:index])
                    again = dataclasses.replace(request, sampling=sampling, response_prefix=prefix, margins=False)
                    checks.append((again, index, runner_up))
        assert len(checks) >= 4, f"{setting}: too few near-ties to check ({len(checks)})"
        halves = [
            dataclasses.replace(
                r, draft=Draft(r.key, tuple(plain[r.key].token_ids[: len(plain[r.key].token_ids) // 2]), 0)
            )
            for r in asked
        ]
        drafted = _by_key(self._timed(engine, halves, f"{setting}, margins asked for, half of each response drafted"))
        self._assert_same(plain, drafted, f"{setting}, margins asked for, half of each response drafted")
        moved = [key for key, result in drafted.items() if result.runner_up_ids != reported[key].runner_up_ids]
        assert len(moved) <= int(self.max_mismatch_rate * len(drafted)), (
            f"{setting}: with drafts verified, other runner-ups were reported than without, e.g. {moved[:1]}"
        )
        suppressed = self._timed(engine, [again for again, _, _ in checks], f"{setting}, the winner suppressed")
        wrong = [(c[0].key, c[1]) for c, r in zip(checks, suppressed, strict=True) if r.token_ids[c[1]] != c[2]]
        assert len(wrong) <= int(self.max_mismatch_rate * len(checks)), (
            f"{setting}: with the winner suppressed, the engine did not sample the reported runner-up at {wrong}"
        )
        given = [
            dataclasses.replace(r, response_prefix=tuple(plain[r.key].token_ids[: 2 + i % 5]))
            for i, r in enumerate(requests)
        ]
        prefixed = _by_key(self._timed(engine, given, f"{setting}, a response prefix of its own tokens"))
        self._assert_same(plain, prefixed, f"{setting}, a response prefix of its own tokens")
        for i, request in enumerate(given):
            result = prefixed[request.key]
            assert result.logprobs[: 2 + i % 5] == [0.0] * (2 + i % 5), f"{request.key}: given tokens, logprob 0"
            assert result.stats.given_tokens == 2 + i % 5

    def test_older_policy_drafts_are_accepted(self, engine, older_samples):
        """Coupled drafts of a policy one small step older are mostly right; the engine must take them."""
        setting = next(iter(self.sampling_settings))
        requests = self.make_requests(setting)
        older = older_samples[setting]
        plain = self._timed(engine, requests, "no drafts")
        drafted = self._timed(engine, [_with_draft(r, older[r.key].token_ids) for r in requests], "older drafts")
        agreeing = sum(
            a == b
            for r, p in zip(requests, plain, strict=True)
            for a, b in zip(older[r.key].token_ids, p.token_ids, strict=False)
        )
        accepted = sum(r.stats.draft_tokens_accepted for r in drafted)
        assert agreeing > 0.3 * sum(len(p.token_ids) for p in plain), "the older policy is not one small step older"
        assert accepted > 0, f"no draft token accepted ({sum(r.stats.undecided_steps for r in drafted)} undecided)"
        assert sum(r.stats.decode_steps for r in drafted) < sum(r.stats.decode_steps for r in plain)

    def test_weight_updates_between_calls(self, engine, checkpoints, older_samples):
        """The weights change between generate calls, as between RL steps: after an update to the older policy the
        engine verifies the newer policy's responses as drafts and gives the older policy's samples (float32
        engines: the torch engine's, the reference); after updating back it gives the newer policy's again."""
        setting = list(self.sampling_settings)[-1]
        requests = self.make_requests(setting)
        newer = _by_key(self._timed(engine, requests, "newer policy"))
        try:
            engine.update_weights(model_folder.weights(checkpoints[1]), version=1)
            older = _by_key(self._timed(engine, requests, "older policy"))
            drafted = self._timed(engine, [_with_draft(r, newer[r.key].token_ids) for r in requests], "older, drafts")
            self._assert_same(older, _by_key(drafted), f"{setting}, the older policy with the newer one's drafts")
            assert any(older[k].token_ids != newer[k].token_ids for k in older), "the update changed nothing"
            if self.dtype == "float32":
                self._assert_same(older_samples[setting], older, f"{setting}, the older policy after an update")
        finally:
            engine.update_weights(model_folder.weights(checkpoints[0]), version=2)
        again = _by_key(self._timed(engine, requests, "newer policy again"))
        self._assert_same(newer, again, f"{setting}, after updating back to the newer policy")

    def _timed(self, engine, requests, what: str) -> list[GenerationResult]:
        """``engine.generate(requests)`` under the time limit: a hang fails the test instead of stalling CI. (An
        alarm in this thread, not a second thread: vLLM's CPU kernels must run in the thread that built them.)"""

        def expire(signum, frame):
            raise TimeoutError(f"{what}: generate did not return within {self.time_limit_s:g} s")

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, self.time_limit_s)
        try:
            return engine.generate(requests)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    _assert_same = EngineConformance._assert_same


_COMMON_TOKENS = 256


def write_policy_pair(
    folder: Path, family: str, vocab_size: int, head_scale: float, policy_step: float, **checkpoint_options
) -> tuple[Path, Path]:
    """A random ``family`` checkpoint with a peaked output head (``newer``) and a copy of it one small random step
    away (``older``: :func:`~bubblespec.testing.random_checkpoints.write_perturbed_copy` by ``policy_step``); returns
    (newer, older). ``checkpoint_options``: more arguments of
    :func:`~bubblespec.testing.random_checkpoints.write_random_checkpoint` (sizes, ``initializer_range``)."""
    from safetensors.torch import load_file, save_file

    from bubblespec.testing.random_checkpoints import write_perturbed_copy, write_random_checkpoint

    newer = write_random_checkpoint(
        folder / "newer", family, vocab_size=vocab_size, tie_word_embeddings=False, **checkpoint_options
    )
    weights_file = newer / "model.safetensors"
    weights = load_file(str(weights_file))
    # A trained model's next-token mass sits on a few hundred likely tokens far above the rest of the vocabulary;
    # a freshly initialised head is nearly uniform. Scale the head's rows of a random set of "common" tokens.
    common = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(2))[:_COMMON_TOKENS]
    head = weights["lm_head.weight"].clone()
    head[common] *= head_scale
    weights["lm_head.weight"] = head
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    older = write_perturbed_copy(newer, folder / "older", policy_step, seed=1)
    return newer, older
