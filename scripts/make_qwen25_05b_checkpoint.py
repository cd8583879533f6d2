"""Writes a random checkpoint with the exact shape of Qwen2.5-0.5B, for benchmarks where no model hub is reachable.

24 layers, hidden size 896, 14 query heads and 2 key/value heads of 64, MLP 4864, vocabulary 151,936, tied
embeddings, rope theta 1e6: 494M parameters, about 1 GB in bfloat16. The weights are random (transformers'
initialisation, seeded), so the model's outputs are noise; its cost per token is the real model's.

    python scripts/make_qwen25_05b_checkpoint.py checkpoints/qwen25-05b-random --dtype bfloat16 --seed 0
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bubblespec.testing.random_checkpoints import DTYPE_NAMES, write_preset_checkpoint


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="output folder (created; config.json + model.safetensors)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16", help="dtype of the saved weights")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialisation")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    folder = write_preset_checkpoint(args.out, "qwen2.5-0.5b", dtype=args.dtype, seed=args.seed)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"wrote {folder} ({size / 2**30:.2f} GiB of weights) in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
