"""Random Hugging Face checkpoints with the shapes of real model families, written by transformers itself.

For conformance tests and benchmarks where no model hub can be reached: ``write_random_checkpoint`` builds the
family's transformers config class, the model from it (transformers' own ``_init_weights``: normal weights of
standard deviation ``initializer_range``, 0.02 unless overridden; RMSNorm weights 1) under a fixed seed, and
saves it with ``save_pretrained(safe_serialization=True)``: ``config.json`` (transformers 5's format, rotary
settings under ``rope_parameters``), ``generation_config.json`` and ``model.safetensors``. The same arguments
give the same weights, whatever the dtype (weights are drawn in float32, then cast).

Families:

- ``llama``: ``LlamaConfig``, plain RoPE (theta 10,000).
- ``llama3``: ``LlamaConfig`` with the rotary scaling Llama 3.1/3.2 ship (``rope_type: llama3``, factor 8,
  low/high frequency factors 1 and 4, theta 500,000; ``original_max_position_embeddings`` 8192 as shipped,
  capped at half of ``max_position_embeddings``, unless given).
- ``qwen2``: ``Qwen2Config``: q/k/v biases, theta 1,000,000.
- ``qwen3``: ``Qwen3Config``: per-head ``q_norm`` / ``k_norm``, no biases, ``head_dim`` independent of
  ``hidden_size / num_heads``, theta 1,000,000.
- ``mistral``: ``MistralConfig`` with ``sliding_window`` (4096 unless given), theta 10,000.

``perturbed_weights`` moves a checkpoint's weights one small random step: the older (or newer) policy of a pair, where
a random model has no task to learn.

transformers is imported inside the functions, so importing this module costs nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "mistral")
DTYPE_NAMES = ("float32", "bfloat16", "float64")

# Per family: transformers config class, rope theta, and whether small checkpoints of the family tie the output
# head to the embeddings (Llama 3.2 1B/3B, Qwen2.5 0.5B-3B and Qwen3 0.6B-4B do; Llama 2 and Mistral 7B do not).
_FAMILY_DEFAULTS: dict[str, tuple[str, float, bool]] = {
    "llama": ("LlamaConfig", 10_000.0, False),
    "llama3": ("LlamaConfig", 500_000.0, True),
    "qwen2": ("Qwen2Config", 1_000_000.0, True),
    "qwen3": ("Qwen3Config", 1_000_000.0, True),
    "mistral": ("MistralConfig", 10_000.0, False),
}

QWEN25_05B: dict[str, Any] = {
    "family": "qwen2",
    "vocab_size": 151_936,
    "hidden_size": 896,
    "num_layers": 24,
    "num_heads": 14,
    "num_kv_heads": 2,
    "head_dim": 64,
    "intermediate_size": 4864,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32_768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 151_643,
    "eos_token_id": 151_643,
}
"""The shape of Qwen2.5-0.5B (494M parameters; the RL-on-a-budget workhorse): ``write_preset_checkpoint``."""

PRESETS: dict[str, dict[str, Any]] = {"qwen2.5-0.5b": QWEN25_05B}


def perturbed_weights(weights: dict, step: float, seed: int) -> dict:
    """float32 weights ``W + step * rms(W) * N(0, 1)`` for every tensor ``W`` (by name, in the mapping's order; the
    noise drawn on the CPU from ``seed``): every tensor's root-mean-square change is ``step`` of its own."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    moved = {}
    for name, tensor in weights.items():
        weight = tensor.detach().to("cpu", torch.float32)
        rms = weight.square().mean().sqrt()
        moved[name] = weight + step * rms * torch.randn(weight.shape, generator=generator)
    return moved


def write_perturbed_copy(folder: str | Path, target: str | Path, step: float, seed: int) -> Path:
    """A copy of the model folder ``folder`` at ``target`` whose weights are :func:`perturbed_weights` of its own,
    each saved in its own dtype: a policy one small random step away."""
    import shutil

    from safetensors.torch import load_file, save_file

    from bubblespec.core import model_folder

    shutil.copytree(folder, target)
    moved = perturbed_weights(model_folder.weights(folder), step, seed)
    for file in sorted(Path(target).glob("*.safetensors")):
        names = load_file(str(file))
        save_file({n: moved[n].to(t.dtype) for n, t in names.items()}, str(file), metadata={"format": "pt"})
    return Path(target)


def write_random_checkpoint(
    folder: str | Path,
    family: str,
    *,
    vocab_size: int = 32_000,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    intermediate_size: int = 256,
    tie_word_embeddings: bool | None = None,
    max_position_embeddings: int = 4096,
    dtype: str = "float32",
    seed: int = 0,
    norm_and_bias_noise: float = 0.0,
    **config_overrides: Any,
) -> Path:
    """Writes a randomly initialised checkpoint of ``family`` (one of :data:`FAMILIES`) into ``folder``.

    ``tie_word_embeddings=None`` takes the family's small-model default (tied for llama3, qwen2, qwen3).
    ``norm_and_bias_noise`` adds normal noise of that standard deviation to every RMSNorm weight and every bias
    (transformers initialises them to 1 and 0, which would hide a skipped or swapped norm or bias from a
    conformance test).
    ``config_overrides`` go to the config class as they are (``bos_token_id``/``eos_token_id``, default 1 and 2;
    ``initializer_range``; ``sliding_window``; ``use_sliding_window``; ...), except ``rope_theta`` and, for
    llama3, ``original_max_position_embeddings``, which go into the rotary parameters. Returns the folder.
    """
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not known; choose one of {', '.join(FAMILIES)}")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPE_NAMES)}")
    class_name, default_theta, default_tied = _FAMILY_DEFAULTS[family]
    settings: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "tie_word_embeddings": default_tied if tie_word_embeddings is None else tie_word_embeddings,
        "max_position_embeddings": max_position_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_parameters": _rope_parameters(family, config_overrides, default_theta, max_position_embeddings),
    }
    if family == "mistral":
        settings["sliding_window"] = 4096
    config = getattr(transformers, class_name)(**(settings | config_overrides))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if norm_and_bias_noise:
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if name.endswith(("norm.weight", ".bias")):
                        parameter.add_(norm_and_bias_noise * torch.randn_like(parameter))
    folder = Path(folder)
    model.to(getattr(torch, dtype)).save_pretrained(folder, safe_serialization=True)
    return folder


def write_preset_checkpoint(
    folder: str | Path, preset: str, *, dtype: str = "bfloat16", seed: int = 0, **overrides: Any
) -> Path:
    """Writes a random checkpoint with the exact shape of ``preset`` (a key of :data:`PRESETS`)."""
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r} is not known; choose one of {', '.join(PRESETS)}")
    settings = PRESETS[preset] | overrides
    return write_random_checkpoint(folder, dtype=dtype, seed=seed, **settings)


def _rope_parameters(
    family: str, overrides: dict[str, Any], default_theta: float, max_position_embeddings: int
) -> dict[str, Any]:
    """transformers 5's ``rope_parameters``; takes ``rope_theta`` (and ``original_max_position_embeddings`` for
    llama3) out of ``overrides``."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(overrides.pop("rope_theta", default_theta))}
    if family == "llama3":
        original = overrides.pop("original_max_position_embeddings", min(8192, max_position_embeddings // 2))
        rope |= {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": int(original),
        }
    return rope


CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen's ChatML chat template (without its tool-calling parts)."""
CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def write_chat_tokenizer(folder: str | Path, vocab_size: int, chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """Writes a Qwen-style tokenizer with ``vocab_size`` tokens into a model folder, for tests and examples where no
    real tokenizer can be downloaded: byte-level BPE as Qwen2's (without merges: one token per byte), the special
    tokens ``<|endoftext|>`` (EOS, id 0), ``<|im_start|>`` and ``<|im_end|>`` (end of turn, also an EOS of the
    folder's generation config), then filler tokens ``<t123>`` up to ``vocab_size`` (so that every id a model of that
    vocabulary samples decodes). ``chat_template=None`` writes none. Returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = [*CHAT_SPECIAL_TOKENS, *sorted(pre_tokenizers.ByteLevel.alphabet())]
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size must be at least {len(tokens)}, got {vocab_size}")
    tokens += [f"<t{i}>" for i in range(len(tokens), vocab_size)]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    folder = Path(folder)
    fast.save_pretrained(folder)
    generation = {"eos_token_id": [0, tokens.index("<|im_end|>")], "bos_token_id": None}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return folder


def write_chat_model(folder: str | Path, vocab_size: int = 512, family: str = "qwen2", **shape: Any) -> Path:
    """A small random chat model in ``folder``: :func:`write_random_checkpoint` of ``family`` (hidden size 64, two
    layers, one head of 64, 2,048 positions unless ``shape`` says otherwise) with :func:`write_chat_tokenizer`'s
    byte-level ChatML tokenizer, for trying a config on your own data before a real model is at hand. It generates
    random text: its rewards stay near 0."""
    shape = {"hidden_size": 64, "num_heads": 1, "num_kv_heads": 1, "head_dim": 64, "intermediate_size": 128,
             "max_position_embeddings": 2048, "bos_token_id": None, "eos_token_id": 0} | shape  # fmt: skip
    write_random_checkpoint(folder, family, vocab_size=vocab_size, **shape)
    return write_chat_tokenizer(folder, vocab_size)
