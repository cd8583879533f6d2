"""Writes the shipped task's problems as a table of prompt and answer: the data of examples/dataset.yaml.

The same problems as examples/arithmetic.yaml's (additions of up to five digits, the task's geometric tail of sizes), as
JSONL rows ``{"prompt": "4821+93=", "answer": "4914"}``: a dataset the shipped model can learn from through the
dataset task. Deterministic; from the repository root:

    python scripts/make_arithmetic_dataset.py examples/data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bubblespec.tasks.arithmetic import ArithmeticTask

SPLITS = {"arithmetic-train.jsonl": (0, 2048), "arithmetic-eval.jsonl": (1_000_003, 512)}
"""File name: (task seed, rows). The eval seed is the held-out seed the arithmetic task itself uses."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="output folder")
    parser.add_argument("--max-digits", type=int, default=5, help="longest operand, in digits")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (seed, rows) in SPLITS.items():
        task = ArithmeticTask(seed=seed, prompts_per_step=rows, max_digits=args.max_digits)
        lines = [json.dumps({"prompt": p.text, "answer": p.answer}) for p in task.batch(0)]
        (args.out / name).write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out / name} ({rows} rows)")


if __name__ == "__main__":
    main()
