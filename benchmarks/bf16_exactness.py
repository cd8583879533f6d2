"""How often drafts change a response, against how often two plain runs of other batch compositions do: the
exactness row of ``bubblespec bench engine`` (:func:`bubblespec.cli.bench_engine_measures.exactness_row`) over several
seeds, with 95% Wilson intervals (BENCHMARKS.md, *bfloat16: drafts within batch nondeterminism*).

Per seed: random prompts of 32-128 tokens (the seed's), 64 new tokens with ``ignore_eos`` at temperature 1; pi_t+1 is
pi_t with every weight tensor moved by ``--weight-noise`` times its RMS (the seed's); pi_t (the torch engine) drafts
every request, and the engine under test, holding pi_t+1, generates them without drafts twice (all at once; reversed,
half as many per call) and once with pi_t's drafts. Keyed verification emits exactly plain keyed decoding's tokens,
so a difference is a rounding near-tie between the logits of one position computed in two pass shapes.

The checkpoint is a random ``--family`` model at ``--vocab`` (hidden 128, 2 layers, heads of 64) whose output head is
peaked on 256 tokens as a trained model's is (``bubblespec.testing.write_policy_pair``), written once to
``--folder``.

    python benchmarks/bf16_exactness.py --backend torch --vocab 32000 --requests 512 --seeds 0,1,2
    python benchmarks/bf16_exactness.py --backend vllm --family qwen2 --vocab 151936 --requests 512 --seeds 0,1,2

``--batch-invariant`` (float32 or float64, torch): the engine under test is batch-invariant
(``rollout.engine_options.batch_invariant``), so no response may differ with drafts.

    python benchmarks/bf16_exactness.py --dtype float32 --requests 512 --seeds 0,1,2 [--batch-invariant]

``--pass-cost MODEL``: what the torch engine's exact bfloat16 attention costs instead (a chunk's queries attend one
per head, ``DecoderModel._one_query_per_head``), or in float32 and float64 its batch-invariant passes: the median
seconds of a decode pass (1 token per sequence), a verify pass (17) and a prefill (128) on that model folder, with it
on and off, interleaved in one process.

    python benchmarks/bf16_exactness.py --pass-cost ckpt/qwen-body --batch 16 --context 200
    python benchmarks/bf16_exactness.py --pass-cost checkpoints/smollm2-135m-instruct-float32 --dtype float32 --batch 8

``--linear-rows``: whether a bfloat16 matrix product gives a row the same value in passes of several row counts as
alone, for the products of a hidden-128 checkpoint (the one above) and of SmolLM2-135M (hidden 576, MLP 1,536,
vocabulary 49,152); random weights and inputs, one and two threads.

    python benchmarks/bf16_exactness.py --linear-rows
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def wilson(count: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion ``count / total``."""
    if total == 0:
        return 0.0, 1.0
    share = count / total
    denominator = 1 + z * z / total
    centre = share + z * z / (2 * total)
    half = z * math.sqrt(share * (1 - share) / total + z * z / (4 * total * total))
    return (centre - half) / denominator, (centre + half) / denominator


def pass_cost(model_path: str, batch: int, context: int, dtype: str = "bfloat16", repeats: int = 10) -> None:
    """Median milliseconds per forward pass, one thread: in bfloat16 with the folded (exact) and the plain
    attention; in float32 and float64 of a batch-invariant model and a plain one."""
    import statistics

    import torch

    from bubblespec.models.decoder import DTYPES, DecoderModel, KVCache, read_checkpoint

    torch.set_num_threads(1)
    config, weights = read_checkpoint(model_path)
    torch_dtype = DTYPES[dtype]
    if dtype == "bfloat16":  # one model, its attention switched
        models = dict.fromkeys((False, True), DecoderModel(config, weights, torch_dtype, "cpu"))
    else:
        models = {
            exact: DecoderModel(config, weights, torch_dtype, "cpu", batch_invariant=exact) for exact in (False, True)
        }
    generator = torch.Generator().manual_seed(0)
    cache = KVCache(config, batch, context + 128 + 64, torch_dtype, "cpu")
    cache.keys.normal_(generator=generator)
    cache.values.normal_(generator=generator)
    lengths = torch.randint(max(1, context - 40), context + 1, (batch,), generator=generator)
    vocab = config.vocab_size
    passes = {
        "decode": (1, lengths[:, None], torch.zeros(batch, 1, dtype=torch.long)),
        "verify": (17, lengths[:, None] + torch.arange(17), torch.arange(17).expand(batch, -1)),
        "prefill": (128, torch.arange(128).expand(batch, -1), torch.full((batch, 1), 127)),
    }
    seconds: dict = {}
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            for folded in (False, True):
                model = models[folded]
                if dtype == "bfloat16":
                    model._one_query_per_head = folded
                for name, (width, positions, select) in passes.items():
                    tokens = torch.randint(3, vocab, (batch, width), generator=generator)
                    started = time.perf_counter()
                    model.forward(tokens, positions, cache, select)
                    if repeat:  # the first round warms up
                        seconds.setdefault((name, folded), []).append(time.perf_counter() - started)
    print(f"{model_path}: {dtype}, batch {batch}, context ~{context}, median of {repeats} (ms per forward pass)")
    what = "one query per head" if dtype == "bfloat16" else "batch_invariant"
    for name in passes:
        plain, folded = (statistics.median(seconds[(name, f)]) * 1e3 for f in (False, True))
        print(f"  {name:8s} {what} off {plain:8.2f}  on {folded:8.2f}  ({folded / plain:.2f}x)")


LINEAR_SHAPES = {"hidden 128, head 32,000": (128, 32_000), "q, k, v 576 -> 960": (576, 960),
                 "gate and up 576 -> 3,072": (576, 3072), "down 1,536 -> 576": (1536, 576),
                 "head 576 -> 49,152": (576, 49_152)}  # fmt: skip
"""(inputs, outputs) of the products ``--linear-rows`` checks."""


def linear_rows(row_counts=(8, 16, 136, 520)) -> None:
    """Per product and thread count: of the first ``m`` rows of a pass of ``m`` rows, how many differ from the same
    row computed alone (a decode pass of 8 or 16 sequences; a verify pass of 8 x 17; a prefill of 8 x 65)."""
    import torch
    import torch.nn.functional as F

    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, (k, n) in LINEAR_SHAPES.items():
            generator = torch.Generator().manual_seed(0)
            w = torch.randn(n, k, generator=generator).bfloat16()
            x = torch.randn(max(row_counts), k, generator=generator).bfloat16()
            alone = torch.cat([F.linear(x[i : i + 1], w) for i in range(len(x))])
            counts = [f"{m}: {int((F.linear(x[:m], w) != alone[:m]).any(1).sum())}" for m in row_counts]
            print(f"{threads} thread(s), {name:26s} rows differing from alone in a pass of " + ", ".join(counts))


def main() -> None:
    import torch

    from bubblespec.cli.bench_engine_measures import exactness_row, make_engine
    from bubblespec.cli.bench_engine_requests import random_workload
    from bubblespec.models.decoder import read_checkpoint
    from bubblespec.testing import write_policy_pair
    from bubblespec.testing.random_checkpoints import perturbed_weights

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("torch", "vllm"), default="torch")
    parser.add_argument("--family", default="llama")
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--weight-noise", type=float, default=1e-3)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--folder", type=Path, default=None, help="Where the checkpoint is (written if missing).")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--pass-cost", default=None, metavar="MODEL", help="Time the exact attention instead.")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--linear-rows", action="store_true", help="Check the matrix products' rows instead.")
    parser.add_argument(
        "--batch-invariant", action="store_true", help="The torch engine under test is batch-invariant."
    )
    args = parser.parse_args()
    if args.linear_rows:
        linear_rows()
        return
    if args.pass_cost is not None:
        pass_cost(args.pass_cost, args.batch, args.context, args.dtype)
        return
    torch.set_num_threads(1)
    folder = args.folder or Path("ckpt") / f"{args.family}{args.vocab // 1000}k"
    if not (folder / "newer" / "config.json").is_file():
        write_policy_pair(folder, args.family, args.vocab, 40.0, 0.02)
    model = str(folder / "newer")
    max_new_tokens = 64
    settings = SimpleNamespace(max_batch_size=args.max_batch_size, max_draft_tokens_per_step=16,
                               adaptive_draft_length=True, device="cpu",
                               max_model_len=128 + 2 * max_new_tokens + 16)  # fmt: skip
    _, weights = read_checkpoint(model)
    engine = make_engine(args.backend, model, args.dtype, settings) if args.backend == "vllm" else None
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        started = time.perf_counter()
        workload = random_workload(model, args.requests, (32, 128), max_new_tokens, seed)
        new_state = perturbed_weights(weights, args.weight_noise, seed)
        drafts = make_engine("torch", model, args.dtype, settings).generate(workload.requests)
        if args.backend == "torch":  # a fresh engine per seed; vLLM engines live as long as the process
            engine = make_engine("torch", model, args.dtype, settings, args.batch_invariant)
        engine.update_weights(new_state, version=seed + 1)
        row = exactness_row(engine, workload.requests, drafts) | {"seed": seed}
        row["seconds"] = round(time.perf_counter() - started, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    total = sum(r["responses"] for r in rows)
    drafted = sum(r["differing"] for r in rows)
    between = sum(r["differing_between_plain_batches"] for r in rows)
    summary = {
        "backend": args.backend, "family": args.family, "vocab": args.vocab, "dtype": args.dtype,
        "batch_invariant": args.batch_invariant,
        "responses": total, "differing_with_drafts": drafted, "differing_with_drafts_ci95": wilson(drafted, total),
        "differing_between_plain_batches": between, "differing_between_plain_batches_ci95": wilson(between, total),
        "seeds": [r["seed"] for r in rows], "rows": rows,
    }  # fmt: skip
    low, high = summary["differing_with_drafts_ci95"]
    low2, high2 = summary["differing_between_plain_batches_ci95"]
    print(f"{args.backend} {args.family} {args.vocab} {args.dtype}: {total} responses; with drafts {drafted} "
          f"({drafted / total:.1%}, 95% CI {low:.1%}-{high:.1%}); between plain batches {between} "
          f"({between / total:.1%}, 95% CI {low2:.1%}-{high2:.1%})")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
