"""Measures how far the built-in decoder's logits are from transformers', per model family.

The checkpoints, sequences and feeding schedules of ``tests/test_model_families.py`` (the same helpers), so the
numbers printed are those the tests bound. Per family: the training path (right-padded batch, no cache) and the
engine path (prefill, then chunks with rejected draft tokens) in float32; the engine path in bfloat16 against
transformers in bfloat16, and each bfloat16 forward pass against transformers' float32 one; and how far the
decoder is with the family's feature switched off (what the float32 tolerance has to tell apart). Prints a
Markdown table. Run from the repository root:

    HF_HUB_OFFLINE=1 python -m benchmarks.model_families
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import torch

from bubblespec.models.decoder import DecoderModel, read_checkpoint
from bubblespec.testing.random_checkpoints import write_random_checkpoint
from tests.test_model_families import (
    CASES,
    LENGTH,
    SMALL,
    _engine_path_logits,
    _ours,
    _sequences,
    _theirs,
    _training_path_difference,
)

FEATURES = {
    "llama3": {"rope_llama3": None},
    "llama-bias": {"output_bias": False, "attention_bias": False},
    "qwen2-tied": {"attention_bias": False},
    "qwen2-window": {"sliding_windows": ()},
    "qwen3": {"qk_norm": False},
    "mistral": {"sliding_windows": ()},
}


def measure(name: str, path: Path) -> dict[str, float]:
    model, hf_model = _ours(path, torch.float32), _theirs(path, torch.float32)
    vocab_size = model.config.vocab_size
    tokens_BT = _sequences(vocab_size, seed=2)
    with torch.no_grad():
        reference_BTV = hf_model(input_ids=tokens_BT).logits
        engine = float((_engine_path_logits(model, tokens_BT, seed=3) - reference_BTV).abs().max())
        training = _training_path_difference(model, hf_model, _sequences(vocab_size, seed=1), [LENGTH, 37, 20])
        ours16_BTV = _engine_path_logits(_ours(path, torch.bfloat16), tokens_BT, seed=3).float()
        theirs16_BTV = _theirs(path, torch.bfloat16)(input_ids=tokens_BT).logits.float()
    row = {
        "f32 training": training,
        "f32 engine": engine,
        "max abs logit": float(reference_BTV.abs().max()),
        "bf16 engine vs transformers bf16": float((ours16_BTV - theirs16_BTV).abs().max()),
        "transformers bf16 vs f32": float((theirs16_BTV - reference_BTV).abs().max()),
        "bf16 engine vs transformers f32": float((ours16_BTV - reference_BTV).abs().max()),
    }
    if name in FEATURES:
        config, weights = read_checkpoint(path)
        crippled = dataclasses.replace(config, **FEATURES[name])
        expected = crippled.parameter_shapes()
        without = DecoderModel(crippled, {n: t for n, t in weights.items() if n in expected}, torch.float32, "cpu")
        row["feature off"] = _training_path_difference(without, hf_model, _sequences(vocab_size, seed=1), [LENGTH] * 3)
    return row


def main() -> None:
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp())
    rows = {}
    for seed, (name, case) in enumerate(CASES.items()):
        path = write_random_checkpoint(folder / name, **(SMALL | case), seed=seed)
        rows[name] = measure(name, path)
    columns = list(next(iter(rows.values())))
    columns.append("feature off")
    print("| case | " + " | ".join(columns) + " |")
    print("|" + "---|" * (len(columns) + 1))
    for name, row in rows.items():
        cells = [f"{row[c]:.2g}" if c in row else "-" for c in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
