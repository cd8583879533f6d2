"""The length histogram of the collatz task's reference responses (the long-response workload of
``examples/bench-long.yaml``), and its quantiles.

    python benchmarks/collatz_lengths.py --out benchmarks/long/collatz-lengths.png

Draws ``--prompts`` numbers as the task draws them (``bubblespec.tasks.collatz.sample_number``, default options)
and plots the tokens of their reference responses (``<eos>`` included) on a linear and on a log axis; then the
spread within a step: over 200 steps of ``--step-prompts`` prompts, the step's longest reference over its median.
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from bubblespec.tasks.collatz import DEFAULT_MAX_DIGITS, MAX_RESPONSE_TOKENS, response_tokens, sample_number


def reference_lengths(rng: random.Random, prompts: int) -> list[int]:
    """Reference response tokens of ``prompts`` numbers drawn as the task draws them."""
    return [response_tokens(sample_number(rng, DEFAULT_MAX_DIGITS, MAX_RESPONSE_TOKENS)) for _ in range(prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("collatz-lengths.png"))
    parser.add_argument("--step-prompts", type=int, default=32, help="prompts of one step, for the per-step spread")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    lengths = sorted(reference_lengths(rng, args.prompts))
    quantiles = {q: lengths[min(len(lengths) - 1, int(q * len(lengths)))] for q in (0.5, 0.9, 0.99)}
    mean = statistics.fmean(lengths)
    share_of_tokens = sum(length for length in lengths if length >= quantiles[0.9]) / sum(lengths)
    print(
        f"{args.prompts} prompts: mean {mean:.0f}, median {quantiles[0.5]}, p90 {quantiles[0.9]}, "
        f"p99 {quantiles[0.99]}, max {lengths[-1]} tokens; max / median {lengths[-1] / quantiles[0.5]:.1f}; "
        f"the longest 10% hold {share_of_tokens:.0%} of the tokens"
    )

    # Within one step (the batch a rollout waits on): the longest reference over the step's median, per step drawn.
    steps = [reference_lengths(rng, args.step_prompts) for _ in range(200)]
    spreads = sorted(max(step) / statistics.median(step) for step in steps)
    print(
        f"200 steps of {args.step_prompts} prompts: a step's longest reference is {statistics.median(spreads):.1f} "
        f"times its median (median over steps; from {spreads[0]:.1f} to {spreads[-1]:.1f})"
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, log in zip(axes, (False, True), strict=True):
        ax.hist(lengths, bins=80, color="tab:blue", alpha=0.8, log=log)
        for q, value in quantiles.items():
            ax.axvline(value, color="tab:red", linestyle="--", linewidth=1)
            ax.annotate(f"p{int(q * 100)} {value}", (value, ax.get_ylim()[1]), rotation=90, va="top", ha="right",
                        fontsize=8, color="tab:red")  # fmt: skip
        ax.set_xlabel("reference response tokens")
        ax.set_ylabel("prompts (log)" if log else "prompts")
    figure.suptitle(f"collatz task: {args.prompts} prompts, max_digits {DEFAULT_MAX_DIGITS}")
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
