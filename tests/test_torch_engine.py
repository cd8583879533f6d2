"""The built-in torch engine: exactness of speculative decoding, batching, preemption, weights and bad input."""

from __future__ import annotations

import itertools
import json
import random
import shutil

import pytest
import torch

from bubblespec.backends.torch_engine import TorchEngine, TorchEngineConfig
from bubblespec.core.errors import DraftError, ModelLoadError, RequestError
from bubblespec.core.interfaces import Draft, GenerationRequest, RolloutKey, SamplingParams
from bubblespec.models.decoder import DecoderConfig, DecoderModel, KVCache
from bubblespec.verify import sampling_reference as reference

from .conftest import EOS, VOCAB, write_checkpoint


def _requests(num: int, seed: int = 0, max_new_tokens: int = 60, **sampling) -> list[GenerationRequest]:
    """Requests with prompts of 1-15 tokens and mixed response budgets."""
    rng = random.Random(seed)
    requests = []
    for i in range(num):
        prompt = tuple(rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 15)))
        params = SamplingParams(max_new_tokens=rng.randint(max_new_tokens // 4, max_new_tokens), **sampling)
        requests.append(GenerationRequest(prompt, RolloutKey(seed, 0, f"prompt-{i}", i % 3), params))
    return requests


def _with_drafts(requests, drafts_by_index) -> list[GenerationRequest]:
    return [
        GenerationRequest(r.prompt_token_ids, r.key, r.sampling, drafts_by_index.get(i)) for i, r in enumerate(requests)
    ]


def _draft(request: GenerationRequest, tokens) -> Draft:
    return Draft(request.key, tuple(tokens), policy_version=0)


def _naive_decode(engine: TorchEngine, request: GenerationRequest) -> list[int]:
    """Reference decoding: recompute the whole sequence every step (no cache reuse, batch of one) and pick each
    token with the loop reference of keyed sampling."""
    params, tokens = request.sampling, []
    while len(tokens) < params.max_new_tokens:
        sequence = torch.tensor([list(request.prompt_token_ids) + tokens])
        positions = torch.arange(sequence.shape[1])[None]
        cache = KVCache(engine.model_config, 1, sequence.shape[1], engine.model.dtype, "cpu")
        logits = engine.model.forward(sequence, positions, cache, positions[:, -1:])[0, -1]
        token, _ = reference.keyed_sample(
            logits.tolist(), request.key.noise_seed(), len(tokens), params.temperature, params.top_k, params.top_p
        )
        tokens.append(token)
        if token == EOS:
            break
    return tokens


@pytest.fixture(scope="module")
def engine64(llama_path) -> TorchEngine:
    return TorchEngine.from_pretrained(llama_path, dtype="float64", max_batch_size=8)


def test_logits_match_transformers(llama_path, qwen2_path):
    transformers = pytest.importorskip("transformers")
    for path in (llama_path, qwen2_path):
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
        engine = TorchEngine.from_pretrained(path, dtype="float64")
        tokens = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(11).repeat(3, 1)
        cache = KVCache(engine.model_config, 3, 11, torch.float64, "cpu")
        ours = engine.model.forward(tokens, positions, cache, positions)
        with torch.no_grad():
            theirs = hf_model(tokens).logits
        # Hugging Face computes rotary angles in float32, hence not 1e-12.
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_batched_engine_equals_naive_decoding(engine64):
    requests = _requests(6, seed=1, max_new_tokens=30, temperature=0.9, top_k=20, top_p=0.95)
    results = engine64.generate(requests)
    for request, result in zip(requests, results, strict=True):
        assert result.token_ids == _naive_decode(engine64, request)


def test_logprobs_are_those_of_the_sampling_distribution(engine64):
    request = _requests(1, seed=2, max_new_tokens=12, temperature=0.8, top_k=10)[0]
    result = engine64.generate([request])[0]
    prefix = list(request.prompt_token_ids)
    for i, (token, logprob) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        sequence = torch.tensor([prefix + result.token_ids[:i]])
        positions = torch.arange(sequence.shape[1])[None]
        cache = KVCache(engine64.model_config, 1, sequence.shape[1], torch.float64, "cpu")
        logits = engine64.model.forward(sequence, positions, cache, positions[:, -1:])[0, -1].tolist()
        expected_token, expected_logprob = reference.keyed_sample(logits, request.key.noise_seed(), i, 0.8, 10, 1.0)
        assert token == expected_token
        assert logprob == pytest.approx(expected_logprob, abs=1e-9)


def test_foreign_model_drafts_give_identical_outputs_in_float64(engine64, other_llama_path):
    """Coupled drafts from a different model: more than 1,000 generated tokens, all identical."""
    requests = _requests(48, seed=3, max_new_tokens=80)
    drafter = TorchEngine.from_pretrained(other_llama_path, dtype="float64", max_batch_size=48)
    drafts = {
        i: _draft(r, d.token_ids) for i, (r, d) in enumerate(zip(requests, drafter.generate(requests), strict=True))
    }
    plain = engine64.generate(requests)
    speculative = engine64.generate(_with_drafts(requests, drafts))
    assert sum(len(r.token_ids) for r in plain) >= 1000
    assert [r.token_ids for r in speculative] == [r.token_ids for r in plain]
    for a, b in zip(plain, speculative, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-9)
        assert a.finish_reason == b.finish_reason
    assert sum(r.stats.verify_steps for r in speculative) > 0


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_float32_mismatch_rate_is_measured_and_small(llama_path, batch_invariant):
    """float32: verification over a chunk rounds differently from one-token decoding, so a near-tie may flip a
    token. Measure how often outputs differ at all, with drafts from a slightly perturbed model; none may differ
    where the engine is batch-invariant."""
    engine = TorchEngine.from_pretrained(
        llama_path, dtype="float32", max_batch_size=64, batch_invariant=batch_invariant
    )
    requests = _requests(64, seed=4, max_new_tokens=80)
    plain = engine.generate(requests)
    drafts = {i: _draft(r, p.token_ids) for i, (r, p) in enumerate(zip(requests, plain, strict=True))}
    generator = torch.Generator().manual_seed(0)
    perturbed = {n: w * (1 + 1e-3 * torch.randn(w.shape, generator=generator)) for n, w in engine.model.weights.items()}
    engine.update_weights(perturbed, version=1)
    plain_new = engine.generate(requests)
    speculative = engine.generate(_with_drafts(requests, drafts))
    mismatched = sum(a.token_ids != b.token_ids for a, b in zip(plain_new, speculative, strict=True))
    print(f"float32 mismatch rate (batch_invariant={batch_invariant}): {mismatched}/{len(requests)} responses")
    assert mismatched / len(requests) <= (0 if batch_invariant else 0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 100])
def test_a_rows_attention_is_the_same_in_every_pass(dtype, window):
    """A query's attention output is bit-identical whether its row is decoded next to rows of other lengths or
    alone and, in bfloat16, whether it feeds one token (a decode pass) or a chunk of draft tokens (a verify pass).
    Otherwise bfloat16 verification flips near-tie tokens that plain decoding samples (torch's CPU attention sums a
    row's keys in an order set by the key span, the key blocks' start and the number of queries per head), more
    often than two plain runs of other batch compositions differ from each other. float32 chunks keep the faster
    attention unless the model is batch-invariant (test_a_batch_invariant_rows_logits_are_the_same_in_every_pass)."""
    config = DecoderConfig(
        model_type="mistral", vocab_size=VOCAB, hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=64, intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=1024,
        tie_word_embeddings=False, attention_bias=False, eos_token_ids=(EOS,), sliding_windows=(window,),
    )  # fmt: skip
    model = DecoderModel(config, {n: torch.zeros(s) for n, s in config.parameter_shapes().items()}, dtype, "cpu")
    generator = torch.Generator().manual_seed(0)
    batch, chunk = 6, 17
    lengths = torch.tensor([20, 90, 333, 500, 650, 700])  # keys already cached per row; windows start at 0 or 512
    start_cache = KVCache(config, batch, 800, dtype, "cpu")
    start_cache.keys.normal_(generator=generator)
    start_cache.values.normal_(generator=generator)
    q, k, v = (torch.randn(batch, chunk, n, 64, generator=generator).to(dtype) for n in (4, 2, 2))

    def attend(rows, first, count, cache):
        positions = lengths[rows, None] + torch.arange(first, first + count)
        slots = torch.arange(len(rows))[:, None].expand(-1, count)
        mask = model._mask(positions, cache, window)
        part = slice(first, first + count)
        return model._attention(0, q[rows, part], k[rows, part], v[rows, part], cache, (slots, positions), mask)

    def copy(rows):
        cache = KVCache(config, len(rows), 800, dtype, "cpu")
        cache.keys.copy_(start_cache.keys[:, rows])
        cache.values.copy_(start_cache.values[:, rows])
        return cache

    every = list(range(batch))
    verify_BNTD = attend(every, 0, chunk, copy(every))
    cache = copy(every)
    decode_BNTD = torch.cat([attend(every, t, 1, cache) for t in range(chunk)], dim=2)
    alone = [copy([row]) for row in every]
    alone_BNTD = torch.cat([torch.cat([attend([r], t, 1, alone[r]) for t in range(chunk)], dim=2) for r in every])
    assert torch.equal(decode_BNTD, alone_BNTD)
    if dtype == torch.bfloat16:
        assert torch.equal(verify_BNTD, decode_BNTD)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_batch_invariant_rows_logits_are_the_same_in_every_pass(dtype, family):
    """A batch-invariant model (float32, float64 on a CPU): a sequence's logits are bit-identical whether its tokens
    are fed one per decode pass (alone, or beside 1-2 other sequences) or as a chunk of a verify pass beside other
    sequences' chunks. Without it the matrix products of passes of 1-3 rows and attention over a chunk of queries
    round otherwise, and a draft can flip a near-tie that plain decoding samples."""
    config = DecoderConfig(
        model_type=family, vocab_size=32_000, hidden_size=192, num_layers=2, num_heads=3, num_kv_heads=1,
        head_dim=64, intermediate_size=320, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=512,
        tie_word_embeddings=family == "qwen2", attention_bias=family == "qwen2", eos_token_ids=(EOS,),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    weights = {n: 0.05 * torch.randn(s, generator=generator) for n, s in config.parameter_shapes().items()}
    model = DecoderModel(config, weights, dtype, "cpu", batch_invariant=True)
    prompts = [torch.randint(3, 32_000, (n,), generator=generator) for n in (7, 20, 33, 50, 61)]
    chunk = 9
    continuations = torch.randint(3, 32_000, (len(prompts), chunk), generator=generator)

    def prefilled(rows):
        cache = KVCache(config, len(rows), 128, dtype, "cpu")
        for slot, row in enumerate(rows):  # each prompt alone, so every mode starts from the same keys
            alone = KVCache(config, 1, 128, dtype, "cpu")
            model.forward(prompts[row][None], torch.arange(len(prompts[row]))[None], alone)
            cache.keys[:, slot], cache.values[:, slot] = alone.keys[:, 0], alone.values[:, 0]
        return cache

    def decode(rows):  # [rows, chunk, V]: one token per pass
        cache, steps = prefilled(rows), []
        for t in range(chunk):
            positions = torch.tensor([[len(prompts[r]) + t] for r in rows])
            steps.append(model.forward(continuations[rows, t : t + 1], positions, cache))
        return torch.cat(steps, dim=1)

    every = list(range(len(prompts)))
    positions = torch.stack([len(prompts[r]) + torch.arange(chunk) for r in every])
    with torch.no_grad():
        verify = model.forward(continuations, positions, prefilled(every))
        for rows in ([0], [3], [1, 4], [0, 2, 3], every):
            assert torch.equal(decode(rows), verify[rows]), f"rows {rows}"


@pytest.mark.parametrize("kind", ["random", "empty", "too_long", "other_key", "truncated"])
def test_garbage_drafts_never_change_outputs(engine64, kind):
    requests = _requests(10, seed=5, max_new_tokens=40)
    plain = engine64.generate(requests)
    rng = random.Random(kind)
    drafts = {}
    for i, (request, result) in enumerate(zip(requests, plain, strict=True)):
        if kind == "random":
            tokens = [rng.randrange(VOCAB) for _ in range(40)]
        elif kind == "empty":
            tokens = []
        elif kind == "too_long":
            tokens = result.token_ids[:-1] + [rng.randrange(VOCAB) for _ in range(200)]
        elif kind == "other_key":
            tokens = plain[(i + 1) % len(plain)].token_ids
        else:
            tokens = result.token_ids[: len(result.token_ids) // 2]
        drafts[i] = _draft(request, tokens)
    speculative = engine64.generate(_with_drafts(requests, drafts))
    assert [r.token_ids for r in speculative] == [r.token_ids for r in plain]
    assert all(len(r.token_ids) <= q.sampling.max_new_tokens for r, q in zip(speculative, requests, strict=True))


def test_own_drafts_are_accepted_in_one_verify_step_each(engine64):
    requests = _requests(8, seed=6, max_new_tokens=14)
    plain = engine64.generate(requests)
    drafts = {i: _draft(r, p.token_ids) for i, (r, p) in enumerate(zip(requests, plain, strict=True))}
    speculative = engine64.generate(_with_drafts(requests, drafts))
    for result in speculative:
        assert result.stats.decode_steps == 1
        assert result.stats.draft_tokens_accepted == result.stats.draft_tokens_proposed


def test_outputs_do_not_depend_on_batch_composition(llama_path):
    requests = _requests(12, seed=7, max_new_tokens=40, temperature=1.1)
    big = TorchEngine.from_pretrained(llama_path, dtype="float64", max_batch_size=12).generate(requests)
    small = TorchEngine.from_pretrained(llama_path, dtype="float64", max_batch_size=3)
    alone = [small.generate([r])[0] for r in requests[:4]]
    shuffled = small.generate(requests[::-1])[::-1]
    assert [r.token_ids for r in shuffled] == [r.token_ids for r in big]
    assert [r.token_ids for r in alone] == [r.token_ids for r in big[:4]]


def test_a_long_prompt_with_a_draft_joining_a_sequence_near_its_end_fits_the_cache(llama_path):
    """A chunk is padded to the batch's longest (a new sequence's prompt + draft), so a sequence deep into its
    response feeds padding past its own length: the cache must hold that, not only the longest real position."""
    prompt = tuple(range(3, 3 + 18))
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    running = GenerationRequest(prompt, RolloutKey(0, 0, "running", 0), params)
    short = GenerationRequest(prompt, RolloutKey(0, 0, "short", 0), SamplingParams(max_new_tokens=18, ignore_eos=True))
    joining = GenerationRequest(prompt, RolloutKey(0, 0, "joining", 0), params)
    engine = TorchEngine.from_pretrained(llama_path, dtype="float64", max_batch_size=2, max_draft_tokens_per_step=16)
    plain = engine.generate([running, short, joining])
    drafted = [running, short, GenerationRequest(prompt, joining.key, params, _draft(joining, [3] * 16))]
    assert [r.token_ids for r in engine.generate(drafted)] == [r.token_ids for r in plain]


class _StopAfter:
    """A stop signal that becomes set once the engine has run ``passes`` more forward passes."""

    def __init__(self, engine: TorchEngine, passes: int) -> None:
        self.engine, self.target = engine, engine.num_forward_passes + passes
        self.set_at: int | None = None

    def is_set(self) -> bool:
        if self.set_at is None and self.engine.num_forward_passes >= self.target:
            self.set_at = self.engine.num_forward_passes
        return self.set_at is not None


def test_preemption_returns_partial_results_within_one_forward_pass(engine64):
    requests = _requests(16, seed=8, max_new_tokens=60)  # 16 requests, 8 slots: some never start
    full = engine64.generate(requests)
    stop = _StopAfter(engine64, passes=5)
    partial = engine64.generate(requests, stop=stop)
    assert engine64.num_forward_passes - stop.set_at == 0  # no pass after the signal was seen
    assert any(r.finish_reason == "preempted" for r in partial)
    for whole, part in zip(full, partial, strict=True):
        assert whole.token_ids[: len(part.token_ids)] == part.token_ids
        assert part.finish_reason in ("preempted", whole.finish_reason)


def test_stop_ids_eos_and_max_new_tokens(engine64):
    request = _requests(1, seed=9, max_new_tokens=50)[0]
    free = GenerationRequest(request.prompt_token_ids, request.key, SamplingParams(max_new_tokens=50, ignore_eos=True))
    tokens = engine64.generate([free])[0].token_ids
    assert len(tokens) == 50
    stop_token = tokens[10]
    stopped = GenerationRequest(
        request.prompt_token_ids,
        request.key,
        SamplingParams(max_new_tokens=50, ignore_eos=True, stop_token_ids=(stop_token,)),
    )
    result = engine64.generate([stopped])[0]
    assert result.finish_reason == "stop"
    assert result.token_ids == tokens[: tokens.index(stop_token) + 1]
    short = GenerationRequest(request.prompt_token_ids, request.key, SamplingParams(max_new_tokens=7, ignore_eos=True))
    result = engine64.generate([short])[0]
    assert (result.token_ids, result.finish_reason) == (tokens[:7], "length")


def test_generation_stops_at_the_context_length(tmp_path):
    engine = TorchEngine.from_pretrained(write_checkpoint(tmp_path / "m", context=24), dtype="float64")
    request = GenerationRequest(tuple(range(3, 13)), RolloutKey(0, 0, "p", 0), SamplingParams(ignore_eos=True))
    result = engine.generate([request])[0]
    assert (len(result.token_ids), result.finish_reason) == (14, "length")


def test_update_weights_switches_to_the_new_policy(llama_path, other_llama_path):
    requests = _requests(6, seed=10, max_new_tokens=30)
    engine = TorchEngine.from_pretrained(llama_path, dtype="float64")
    other = TorchEngine.from_pretrained(other_llama_path, dtype="float64")
    before = engine.generate(requests)
    engine.update_weights(other.model.weights, version=3)
    assert engine.policy_version == 3
    after = engine.generate(requests)
    assert [r.token_ids for r in after] == [r.token_ids for r in other.generate(requests)]
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    with pytest.raises(ValueError, match="unknown weight names"):
        engine.update_weights({"model.nonsense": torch.zeros(1)}, version=4)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({"model.norm.weight": torch.zeros(3)}, version=4)


def test_bfloat16_generates(llama_path):
    engine = TorchEngine.from_pretrained(llama_path, dtype="bfloat16")
    results = engine.generate(_requests(4, seed=11, max_new_tokens=20))
    assert all(len(r.token_ids) > 0 for r in results)


def test_one_hot_verification_runs_and_accepts_own_drafts(llama_path):
    engine = TorchEngine.from_pretrained(llama_path, dtype="float64", verification="one_hot")
    requests = _requests(8, seed=12, max_new_tokens=30)
    plain = engine.generate(requests)
    assert all(0 < len(r.token_ids) <= q.sampling.max_new_tokens for r, q in zip(plain, requests, strict=True))
    greedy = [
        GenerationRequest(r.prompt_token_ids, r.key, SamplingParams(temperature=0, max_new_tokens=20)) for r in requests
    ]
    greedy_plain = engine.generate(greedy)
    drafts = {i: _draft(r, p.token_ids) for i, (r, p) in enumerate(zip(greedy, greedy_plain, strict=True))}
    greedy_spec = engine.generate(_with_drafts(greedy, drafts))
    assert [r.token_ids for r in greedy_spec] == [r.token_ids for r in greedy_plain]
    assert all(r.stats.decode_steps <= 2 for r in greedy_spec)


def test_one_hot_samples_are_counter_based_per_policy_version(llama_path):
    """One-hot verification draws from an independent noise stream per policy version: reproducible on any rank
    and after a resume (no RNG state), identical with and without drafts, and a draft of the previous version is
    accepted only as often as an independent sample agrees (far less than a coupled draft)."""

    def engine(version: int, rank: int = 0, verification: str = "one_hot") -> TorchEngine:
        built = TorchEngine.from_pretrained(llama_path, dtype="float64", verification=verification, rank=rank)
        built.update_weights({}, version)
        return built

    requests = _requests(8, seed=3, max_new_tokens=20)
    new = engine(1).generate(requests)
    assert [r.token_ids for r in new] == [r.token_ids for r in engine(1, rank=3).generate(requests)]
    old = engine(0).generate(requests)
    assert [r.token_ids for r in old] != [r.token_ids for r in new], "versions share one stream"
    coupled = engine(1, verification="coupled").generate(requests)
    assert [r.token_ids for r in coupled] != [r.token_ids for r in new], "one-hot used the key's own noise"
    drafted = engine(1).generate(
        _with_drafts(requests, {i: _draft(r, o.token_ids) for i, (r, o) in enumerate(zip(requests, old, strict=True))})
    )
    assert [r.token_ids for r in drafted] == [r.token_ids for r in new]
    coupled_old = engine(0, verification="coupled").generate(requests)  # same weights: the policy did not move
    coupled_drafts = {i: _draft(r, c.token_ids) for i, (r, c) in enumerate(zip(requests, coupled_old, strict=True))}
    coupled_drafted = engine(1, verification="coupled").generate(_with_drafts(requests, coupled_drafts))
    one_hot_accepted = sum(r.stats.draft_tokens_accepted for r in drafted)
    assert one_hot_accepted < sum(r.stats.draft_tokens_accepted for r in coupled_drafted)


def test_out_of_vocabulary_drafts_are_refused(engine64):
    request = _requests(1)[0]
    for bad in ([VOCAB], [-1], [3, 4, VOCAB + 100]):
        with pytest.raises(DraftError, match=rf"token ids must be integers in \[0, {VOCAB}\)"):
            engine64.generate(_with_drafts([request], {0: _draft(request, bad)}))
    with pytest.raises(TypeError, match="RolloutKey"):
        Draft(("not", "a", "key"), (1, 2), policy_version=0)


def test_bad_requests_are_refused_with_the_value(engine64):
    key = RolloutKey(0, 0, "p", 0)
    with pytest.raises(RequestError, match="outside"):
        engine64.generate([GenerationRequest((3, VOCAB), key)])
    with pytest.raises(RequestError, match="empty prompt"):
        engine64.generate([GenerationRequest((), key)])
    with pytest.raises(RequestError, match="256 tokens"):
        engine64.generate([GenerationRequest(tuple([3] * 300), key)])


def test_bad_model_paths_and_settings_are_refused(tmp_path, llama_path):
    with pytest.raises(ModelLoadError, match="not a directory"):
        TorchEngine.from_pretrained(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="no config.json"):
        TorchEngine.from_pretrained(tmp_path)
    unsupported = tmp_path / "gpt2"
    shutil.copytree(llama_path, unsupported)
    config = json.loads((unsupported / "config.json").read_text())
    (unsupported / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported.*llama, qwen2"):
        TorchEngine.from_pretrained(unsupported)
    with pytest.raises(ValueError, match="dtype"):
        TorchEngineConfig(model_path=str(llama_path), dtype="float16")
    with pytest.raises(ValueError, match="max_batch_size"):
        TorchEngineConfig(model_path=str(llama_path), max_batch_size=0)
    with pytest.raises(ValueError, match="batch_invariant is for float32 or float64 on a CPU, not bfloat16"):
        TorchEngineConfig(model_path=str(llama_path), dtype="bfloat16", batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant is for float32 or float64 on a CPU, not float32 on 'cuda'"):
        TorchEngineConfig(model_path=str(llama_path), device="cuda", batch_invariant=True)
    # one thread: with two, decode and verify passes round differently; unset pins one
    with pytest.raises(ValueError, match=r"batch_invariant runs on one torch thread, got num_threads 2 \(rollout"):
        TorchEngineConfig(model_path=str(llama_path), batch_invariant=True, num_threads=2)
    assert TorchEngineConfig(model_path=str(llama_path), batch_invariant=True).num_threads == 1
    assert TorchEngineConfig(model_path=str(llama_path)).num_threads is None
    if not torch.cuda.is_available():
        with pytest.raises(RequestError, match="no CUDA device"):
            TorchEngine.from_pretrained(llama_path, device="cuda")


def test_one_hot_engine_with_drafts_matches_the_exact_sequence_distribution(tmp_path):
    """The engine's one-hot verification against exact enumeration on a 4-token vocabulary."""
    path = write_checkpoint(tmp_path / "tiny-vocab", vocab_size=4, seed=5, weight_scale=0.3)
    engine = TorchEngine.from_pretrained(path, dtype="float64", verification="one_hot", max_batch_size=1024)
    prompt, length, trials = (1, 3), 3, 12_000
    params = SamplingParams(temperature=1.0, max_new_tokens=length, ignore_eos=True)
    draft_tokens = (3, 3, 0)
    requests = [
        GenerationRequest(prompt, key := RolloutKey(0, 0, "p", i), params, Draft(key, draft_tokens, 0))
        for i in range(trials)
    ]
    counts: dict[tuple[int, ...], int] = {}
    for result in engine.generate(requests):
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
    assert sum(r for r in counts.values()) == trials

    def probs(prefix: list[int]) -> list[float]:
        sequence = torch.tensor([list(prompt) + prefix])
        positions = torch.arange(sequence.shape[1])[None]
        cache = KVCache(engine.model_config, 1, sequence.shape[1], torch.float64, "cpu")
        return torch.softmax(engine.model.forward(sequence, positions, cache, positions[:, -1:])[0, -1], -1).tolist()

    exact = {}
    for sequence in itertools.product(range(4), repeat=length):
        probability = 1.0
        for i in range(length):
            probability *= probs(list(sequence[:i]))[sequence[i]]
        exact[sequence] = probability
    total_variation = 0.5 * sum(abs(counts.get(s, 0) / trials - p) for s, p in exact.items())
    chi_square = sum((counts.get(s, 0) - trials * p) ** 2 / (trials * p) for s, p in exact.items() if trials * p > 5)
    assert total_variation < 0.04
    assert chi_square < 110  # about 63 degrees of freedom: p ~ 2e-4
    assert counts.get(draft_tokens, 0) / trials < 0.5  # the draft was not simply accepted


def test_realign_finds_where_the_draft_continues():
    from bubblespec.verify.drafts import realign

    draft = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    # the response inserted one token (4) before the draft's 8: the draft continues one position earlier
    response = [5, 6, 7, 4, 8, 9, 10, 11, 12]
    offset = realign(response, draft, offset=0, match_length=4)
    assert offset == -1 and draft[len(response) + offset] == 13
    assert realign([1, 1, 1, 1], draft, offset=0, match_length=4) is None
    assert realign([5, 6], draft, offset=0, match_length=4) is None


def test_adaptive_proposals_change_cost_not_outputs(llama_path, other_llama_path):
    requests = _requests(24, seed=13, max_new_tokens=60)
    drafter = TorchEngine.from_pretrained(other_llama_path, dtype="float64")
    drafts = {
        i: _draft(r, d.token_ids) for i, (r, d) in enumerate(zip(requests, drafter.generate(requests), strict=True))
    }
    fixed = TorchEngine.from_pretrained(llama_path, dtype="float64")
    adaptive = TorchEngine.from_pretrained(llama_path, dtype="float64", adaptive_draft_length=True)
    with_fixed = fixed.generate(_with_drafts(requests, drafts))
    with_adaptive = adaptive.generate(_with_drafts(requests, drafts))
    assert [r.token_ids for r in with_adaptive] == [r.token_ids for r in fixed.generate(requests)]
    assert [r.token_ids for r in with_adaptive] == [r.token_ids for r in with_fixed]
    # a foreign model's drafts are mostly rejected: adaptive proposals waste fewer tokens on them
    proposed = [sum(r.stats.draft_tokens_proposed for r in results) for results in (with_fixed, with_adaptive)]
    assert proposed[1] < proposed[0]
