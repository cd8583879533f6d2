"""What a run reads from a Hugging Face model folder itself: from ``config.json`` and ``generation_config.json`` its
vocabulary size, end-of-sequence ids and context length; from its ``*.safetensors`` files its weights."""

from __future__ import annotations

import json
from pathlib import Path


def _read(path: str | Path, name: str) -> dict:
    file = Path(path) / name
    return json.loads(file.read_text()) if file.is_file() else {}


def vocab_size(path: str | Path) -> int:
    """The folder's vocabulary size (``config.json``)."""
    return int(_read(path, "config.json")["vocab_size"])


def eos_token_ids(path: str | Path) -> set[int]:
    """The end-of-sequence ids of the folder's ``config.json`` and ``generation_config.json`` (each an id or a list)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        eos = _read(path, name).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return ids


def context_length(path: str | Path) -> int:
    """The most positions the model takes (``max_position_embeddings``; unbounded where the config names none)."""
    return int(_read(path, "config.json").get("max_position_embeddings") or 2**31)


def weights(path: str | Path) -> dict:
    """Every tensor of the folder's ``*.safetensors`` files by Hugging Face name (what ``update_weights`` takes)."""
    from safetensors.torch import load_file

    tensors: dict = {}
    for file in sorted(Path(path).expanduser().glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors
