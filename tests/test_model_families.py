"""Every supported model family against Hugging Face transformers' own forward pass.

Each checkpoint is written by transformers (:mod:`bubblespec.testing.random_checkpoints`) and read back by the built-in
decoder; the logits of both are compared in the two ways the decoder is used: the trainer's (whole right-padded
sequences, no cache) and the engine's (a prompt prefilled into a :class:`KVCache`, then chunks of several tokens
at later positions, each followed by rejected draft tokens that the next chunk overwrites). Sequences are long
enough that Mistral's and Qwen2's sliding windows mask keys and that Llama 3's rotary scaling is exercised past
``original_max_position_embeddings``. Comparisons are in float32 (transformers computes rotary angles in float32
even for float64 models) and in bfloat16 with a measured, looser tolerance.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from bubblespec.backends.torch_engine import TorchEngine
from bubblespec.core.errors import ModelLoadError
from bubblespec.core.interfaces import Draft, GenerationRequest, RolloutKey, SamplingParams
from bubblespec.models.decoder import DecoderConfig, DecoderModel, KVCache, read_checkpoint
from bubblespec.verify import sampling

# Checkpoints are written in transformers 5's format (rope_parameters), which 4.x cannot write.
transformers = pytest.importorskip("transformers", minversion="5.0")

SMALL = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,  # 4 heads of 32: the attention width (128) differs from hidden_size, as in Qwen3
    "num_kv_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "initializer_range": 0.1,  # logits of a few units, not the near-zero ones of std 0.02
    "norm_and_bias_noise": 0.2,  # RMSNorm weights other than 1 and biases other than 0: a skipped one shows
}
CASES = {
    "llama": {"family": "llama"},
    "llama-bias": {"family": "llama", "attention_bias": True},
    # theta 500,000 over head_dim 32 with an original context of 32 puts rotary frequencies in all three llama3
    # regimes (kept, interpolated, divided by the factor); sequences run past position 32.
    "llama3": {"family": "llama3", "original_max_position_embeddings": 32, "max_position_embeddings": 256},
    "qwen2-tied": {"family": "qwen2", "tie_word_embeddings": True},
    "qwen2-window": {
        "family": "qwen2",
        "tie_word_embeddings": False,
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 1,  # layer 0 full attention, layer 1 a window of 8
    },
    "qwen3": {"family": "qwen3", "vocab_size": 32_000},
    "mistral": {"family": "mistral", "sliding_window": 8},
}
LENGTH = 48  # tokens per sequence: past llama3's original context (32) and six windows of 8
FLOAT32_TOLERANCE = 1e-4
# bfloat16: our engine path and transformers' each round differently (fused q/k/v and gate/up products, rotary
# angles in float64 vs float32, attention kernels). Measured (python -m benchmarks.model_families): at most 0.031
# on logits up to 4.2 (bfloat16 spacing is 0.031 between 4 and 8); each is 0.04-0.1 from transformers' float32.
BFLOAT16_TOLERANCE = 0.0625


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    from bubblespec.testing.random_checkpoints import write_random_checkpoint

    folder = tmp_path_factory.mktemp("families")
    return {
        name: write_random_checkpoint(folder / name, **(SMALL | case), seed=i)
        for i, (name, case) in enumerate(CASES.items())
    }


def _ours(path, dtype: torch.dtype) -> DecoderModel:
    config, weights = read_checkpoint(path)
    return DecoderModel(config, weights, dtype, "cpu")


def _theirs(path, dtype: torch.dtype):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _sequences(vocab_size: int, seed: int, batch: int = 3) -> torch.Tensor:
    return torch.randint(3, vocab_size, (batch, LENGTH), generator=torch.Generator().manual_seed(seed))


def _training_path_difference(model: DecoderModel, hf_model, tokens_BT: torch.Tensor, lengths: list[int]) -> float:
    """Max |ours - theirs| over the real tokens of a right-padded batch, no cache."""
    valid_BT = torch.arange(tokens_BT.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    padded_BT = torch.where(valid_BT, tokens_BT, 0)
    positions_BT = torch.arange(tokens_BT.shape[1]).expand_as(tokens_BT)
    with torch.no_grad():
        ours_BTV = model.forward(padded_BT, positions_BT)
        theirs_BTV = hf_model(input_ids=padded_BT, attention_mask=valid_BT.long()).logits
    return float((ours_BTV.float() - theirs_BTV.float()).abs()[valid_BT].max())


def _engine_path_logits(model: DecoderModel, tokens_BT: torch.Tensor, seed: int) -> torch.Tensor:
    """Logits [B, T, V] of every position, fed as the engine feeds them: each row's prompt (random length)
    prefilled, then chunks of 1-5 tokens, each followed by 0-3 random "rejected draft" tokens whose cache entries
    the next chunk overwrites; rows right-padded to the longest chunk, pads at the positions after the row's."""
    rng = random.Random(seed)
    batch, length = tokens_BT.shape
    vocab_size = model.config.vocab_size
    cache = KVCache(model.config, batch, length + 16, model.dtype, "cpu")
    logits_BTV = torch.full((batch, length, vocab_size), float("nan"), dtype=model.dtype)
    fed = [0] * batch
    sizes = [rng.randint(5, 20) for _ in range(batch)]  # the prompts
    while min(fed) < length:
        chunks, num_true = [], []
        for row in range(batch):
            true = tokens_BT[row, fed[row] : fed[row] + sizes[row]].tolist()
            rejected = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 3))]
            chunks.append(true + rejected if true else [0])  # a finished row feeds one ignored token
            num_true.append(len(true))
        width = max(len(c) for c in chunks)
        chunk_BT = torch.tensor([c + [0] * (width - len(c)) for c in chunks])
        positions_BT = torch.tensor(fed)[:, None] + torch.arange(width)
        with torch.no_grad():
            out_BTV = model.forward(chunk_BT, positions_BT, cache)
        for row in range(batch):
            logits_BTV[row, fed[row] : fed[row] + num_true[row]] = out_BTV[row, : num_true[row]]
            fed[row] += num_true[row]
        sizes = [rng.randint(1, 5) for _ in range(batch)]
    return logits_BTV


@pytest.mark.parametrize("name", list(CASES))
def test_training_path_matches_transformers(checkpoints, name):
    model, hf_model = _ours(checkpoints[name], torch.float32), _theirs(checkpoints[name], torch.float32)
    tokens_BT = _sequences(model.config.vocab_size, seed=1)
    difference = _training_path_difference(model, hf_model, tokens_BT, [LENGTH, 37, 20])
    assert difference < FLOAT32_TOLERANCE, f"{name}: max |logit difference| {difference:.2e}"


@pytest.mark.parametrize("name", list(CASES))
def test_engine_path_matches_transformers(checkpoints, name):
    model, hf_model = _ours(checkpoints[name], torch.float32), _theirs(checkpoints[name], torch.float32)
    tokens_BT = _sequences(model.config.vocab_size, seed=2)
    ours_BTV = _engine_path_logits(model, tokens_BT, seed=3)
    with torch.no_grad():
        theirs_BTV = hf_model(input_ids=tokens_BT).logits
    difference = float((ours_BTV - theirs_BTV).abs().max())
    assert difference < FLOAT32_TOLERANCE, f"{name}: max |logit difference| {difference:.2e}"


@pytest.mark.parametrize("name", list(CASES))
def test_engine_path_matches_transformers_in_bfloat16(checkpoints, name):
    """bfloat16 against bfloat16: the difference must stay within BFLOAT16_TOLERANCE and within twice what
    transformers' own bfloat16 forward pass loses against its float32 one."""
    path = checkpoints[name]
    model = _ours(path, torch.bfloat16)
    hf_model, hf_model32 = _theirs(path, torch.bfloat16), _theirs(path, torch.float32)
    tokens_BT = _sequences(model.config.vocab_size, seed=4)
    ours_BTV = _engine_path_logits(model, tokens_BT, seed=5).float()
    with torch.no_grad():
        theirs_BTV = hf_model(input_ids=tokens_BT).logits.float()
        reference_BTV = hf_model32(input_ids=tokens_BT).logits
    difference = float((ours_BTV - theirs_BTV).abs().max())
    their_rounding = float((theirs_BTV - reference_BTV).abs().max())
    our_rounding = float((ours_BTV - reference_BTV).abs().max())
    assert difference < BFLOAT16_TOLERANCE, f"{name}: max |logit difference| {difference:.3f}"
    assert our_rounding < 2 * their_rounding, f"{name}: ours {our_rounding:.3f} vs theirs {their_rounding:.3f}"


@pytest.mark.parametrize(
    ("name", "without_feature"),
    [
        ("llama3", {"rope_llama3": None}),
        ("mistral", {"sliding_windows": ()}),
        ("qwen2-window", {"sliding_windows": ()}),
        ("qwen3", {"qk_norm": False}),
        ("llama-bias", {"output_bias": False}),
        ("llama-bias", {"output_bias": False, "attention_bias": False}),
        ("qwen2-tied", {"attention_bias": False}),
    ],
)
def test_each_family_feature_changes_the_logits(checkpoints, name, without_feature):
    """The comparisons above can fail: the decoder with the family's feature switched off is far from
    transformers on the same sequences."""
    config, weights = read_checkpoint(checkpoints[name])
    crippled = dataclasses.replace(config, **without_feature)
    expected = crippled.parameter_shapes()
    model = DecoderModel(crippled, {n: t for n, t in weights.items() if n in expected}, torch.float32, "cpu")
    tokens_BT = _sequences(config.vocab_size, seed=1)
    difference = _training_path_difference(model, _theirs(checkpoints[name], torch.float32), tokens_BT, [LENGTH] * 3)
    assert difference > 100 * FLOAT32_TOLERANCE, f"{name} without {without_feature}: only {difference:.2e} off"


def test_llama3_inverse_frequencies_are_those_of_transformers(checkpoints):
    """All three llama3 regimes (kept, interpolated, divided by the factor) occur and match transformers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from bubblespec.models.decoder import rope_inverse_frequency

    config, _ = read_checkpoint(checkpoints["llama3"])
    ours_d = rope_inverse_frequency(config.head_dim, config.rope_theta, config.rope_llama3)
    theirs_d, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](
        transformers.AutoConfig.from_pretrained(checkpoints["llama3"])
    )
    torch.testing.assert_close(ours_d.float(), theirs_d, rtol=1e-6, atol=0)
    assert attention_factor == 1.0
    plain_d = rope_inverse_frequency(config.head_dim, config.rope_theta)
    ratio_d = plain_d / ours_d
    kept, divided = ratio_d == 1, ratio_d == config.rope_llama3.factor
    assert kept.any() and divided.any() and (~kept & ~divided).any()


def test_transformers_4_config_format_reads_alike(checkpoints):
    """transformers 4.x writes ``rope_theta`` at the top level and llama3 scaling as ``rope_scaling``; Qwen2
    configs of that time have no ``layer_types``."""
    for name in ("llama3", "qwen2-window", "qwen3"):
        config_5 = json.loads((checkpoints[name] / "config.json").read_text())
        rope = dict(config_5["rope_parameters"])
        config_4 = config_5 | {"rope_theta": rope.pop("rope_theta")}
        del config_4["rope_parameters"]
        config_4.pop("layer_types", None)
        if rope["rope_type"] != "default":
            config_4["rope_scaling"] = rope
        assert DecoderConfig.from_hf(config_4, "4.x") == DecoderConfig.from_hf(config_5, "5.x"), name


def test_sliding_windows_per_layer(checkpoints):
    configs = {name: read_checkpoint(checkpoints[name])[0] for name in ("mistral", "qwen2-window", "qwen3", "llama")}
    assert configs["mistral"].sliding_windows == (8, 8)
    assert configs["qwen2-window"].sliding_windows == (None, 8)
    assert configs["qwen3"].sliding_windows == configs["llama"].sliding_windows == ()
    hf_config = json.loads((checkpoints["qwen2-window"] / "config.json").read_text())
    off = DecoderConfig.from_hf(hf_config | {"use_sliding_window": False}, "qwen2")
    assert off.sliding_windows == ()  # Qwen2.5 configs carry a sliding_window that is not used
    mistral = json.loads((checkpoints["mistral"] / "config.json").read_text())
    assert DecoderConfig.from_hf(mistral | {"sliding_window": None}, "mistral").sliding_windows == ()
    without_key = {k: v for k, v in mistral.items() if k != "sliding_window"}  # transformers' default: 4096
    assert DecoderConfig.from_hf(without_key, "mistral").sliding_windows == (4096, 4096)


def _llama_config(**changes) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    } | changes


@pytest.mark.parametrize("model_type", ["gpt_neox", "qwen2_moe", "gemma3", "mixtral"])
def test_unsupported_architecture_names_the_supported_ones(model_type):
    with pytest.raises(ModelLoadError, match=rf"'{model_type}' is not supported.*llama, qwen2, qwen3, mistral"):
        DecoderConfig.from_hf(_llama_config(model_type=model_type), "config.json")


def test_the_torch_engine_checks_an_architecture_without_loading_weights(tmp_path):
    """What a run checks before Ray starts (a folder whose weights the check never opens)."""
    import json

    from bubblespec.backends.torch_engine import TorchEngine

    (tmp_path / "model.safetensors").write_text("not read")
    (tmp_path / "config.json").write_text(json.dumps(_llama_config(model_type="gpt_neox")))
    with pytest.raises(ModelLoadError, match=r"'gpt_neox' is not supported"):
        TorchEngine.check_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(_llama_config()))
    TorchEngine.check_model(str(tmp_path))


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
        {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
        {"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}},
        {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}},
    ],
)
def test_unsupported_rope_type_names_the_supported_ones(rope):
    rope_type = rope["rope_parameters"] or rope.get("rope_scaling")
    name = rope_type.get("rope_type", rope_type.get("type"))
    with pytest.raises(ModelLoadError, match=rf"rope type '{name}' is not supported; supported: 'default', 'llama3'"):
        DecoderConfig.from_hf(_llama_config(**rope), "config.json")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"mlp_bias": True}, "mlp_bias true is not supported"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per layer type"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "needs .*low_freq_factor"),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "layer_types": ["chunked"] * 2},
            "layer_types",
        ),
        ({"model_type": "mistral", "sliding_window": 0}, "sliding_window 0"),
    ],
)
def test_unsupported_settings_are_refused_with_the_value(changes, message):
    with pytest.raises(ModelLoadError, match=message):
        DecoderConfig.from_hf(_llama_config(**changes), "config.json")


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_engine_samples_transformers_distribution_and_own_drafts_change_nothing(checkpoints, name):
    """float64 keyed decoding: every token is the keyed sample of transformers' logits at its position, and
    drafts equal to the engine's own outputs are all accepted without changing a token."""
    engine = TorchEngine.from_pretrained(checkpoints[name], dtype="float64", max_batch_size=4)
    rng = random.Random(6)
    params = SamplingParams(temperature=1.0, top_k=50, max_new_tokens=40, ignore_eos=True)
    requests = [
        GenerationRequest(tuple(rng.randrange(3, engine.vocab_size) for _ in range(rng.randint(3, 12))), key, params)
        for key in (RolloutKey(0, 0, f"p{i}", 0) for i in range(4))
    ]
    plain = engine.generate(requests)
    drafted = [
        GenerationRequest(r.prompt_token_ids, r.key, params, Draft(r.key, tuple(p.token_ids), 0))
        for r, p in zip(requests, plain, strict=True)
    ]
    speculative = engine.generate(drafted)
    assert [r.token_ids for r in speculative] == [r.token_ids for r in plain]
    assert all(r.stats.draft_tokens_accepted == r.stats.draft_tokens_proposed > 0 for r in speculative)
    hf_model = _theirs(checkpoints[name], torch.float64)
    for request, result in zip(requests, plain, strict=True):
        prompt = list(request.prompt_token_ids)
        with torch.no_grad():
            logits_1TV = hf_model(input_ids=torch.tensor([prompt + result.token_ids])).logits
        response_logits_1WV = logits_1TV[:, len(prompt) - 1 : -1]
        width = response_logits_1WV.shape[1]
        tokens_1W, _ = sampling.keyed_sample(
            response_logits_1WV,
            torch.tensor([request.key.noise_seed()]),
            torch.arange(width)[None],
            torch.tensor([1.0], dtype=torch.float64),
            torch.tensor([50]),
            torch.tensor([1.0], dtype=torch.float64),
        )
        assert tokens_1W[0].tolist() == result.token_ids


def test_grpo_step_trains_every_qwen3_weight_by_its_hugging_face_name(checkpoints):
    """One GRPO step on a Qwen3 checkpoint moves q_norm/k_norm too, and the trained weights load into
    transformers' model by name and give our logits."""
    from bubblespec.core.config import TrainerConfig
    from bubblespec.rl.learner import GRPOLearner, TrainSample

    learner = GRPOLearner(str(checkpoints["qwen3"]), "float32", TrainerConfig(), 1.0)
    rng = random.Random(7)
    vocab_size = learner.model.config.vocab_size
    samples = [
        TrainSample(
            tuple(rng.randrange(3, vocab_size) for _ in range(6)),
            tuple(rng.randrange(3, vocab_size) for _ in range(rng.randint(4, 10))),
            group=0,
            reward=float(i % 2),
        )
        for i in range(4)
    ]
    before = learner.state_dict()
    metrics = learner.step(samples)
    after = learner.state_dict()
    assert metrics["skipped"] == 0 and metrics["trained_tokens"] > 0
    assert any(".q_norm." in name for name in after) and any(".k_norm." in name for name in after)
    unmoved = [name for name in after if torch.equal(before[name], after[name])]
    assert unmoved == []  # the tied embedding moves through the output head even where no token was fed
    hf_model = _theirs(checkpoints["qwen3"], torch.float32)
    missing, unexpected = hf_model.load_state_dict(after, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    tokens_BT = _sequences(vocab_size, seed=8)
    difference = _training_path_difference(learner.model, hf_model, tokens_BT, [LENGTH] * 3)
    assert difference < FLOAT32_TOLERANCE


def test_random_checkpoints_are_deterministic_per_seed(tmp_path):
    from safetensors.torch import load_file

    from bubblespec.testing.random_checkpoints import write_random_checkpoint

    tiny = SMALL | {"vocab_size": 64}

    def weights(name: str, **settings) -> dict[str, torch.Tensor]:
        return load_file(write_random_checkpoint(tmp_path / name, "qwen3", **(tiny | settings)) / "model.safetensors")

    first, again, other = weights("a", seed=0), weights("b", seed=0), weights("c", seed=1)
    bfloat16 = weights("d", seed=0, dtype="bfloat16")
    assert first.keys() == again.keys() == other.keys() == bfloat16.keys()
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in first)
    assert all(torch.equal(first[n].to(torch.bfloat16), bfloat16[n]) for n in first)
    with pytest.raises(ValueError, match="family 'gpt2' is not known; choose one of llama, llama3"):
        write_random_checkpoint(tmp_path / "e", "gpt2")
