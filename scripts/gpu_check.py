"""The first GPU run: what the CPU cannot check, in one command of at most about five minutes on one GPU.

    bash scripts/gpu_check.sh               # on a machine with one NVIDIA GPU: OUT/gpu_check.json and a table
    bash scripts/gpu_check.sh --dry-run     # the same stages at tiny shapes on the CPU, seconds (CI runs it)

Without Ray, vLLM or any download: the checkpoints are random, the 7B-shaped one made on the GPU in memory. The JSON
is written again after every stage, so a run cut off still reports the stages it finished; a stage that fails is
recorded with its error and the next one runs.

Stages:
  environment     torch, CUDA, the device's name and memory
  keyed_sampling  keyed samples on CUDA equal those on the CPU from identical logits tensors, at 32,000 and 151,936
                  tokens, for temperature 1, temperature < 1 with top-k and top-p, min-p with suppressed tokens, greedy
  engine_drafts   the torch engine on CUDA: float32 with TF32 off gives identical outputs with and without drafts of a
                  policy one step older; bfloat16's mismatch table (drafts against two plain batch compositions)
  learner_step    one GRPO step on CUDA of the same small checkpoint; its weights against the same step on the CPU
  premise         a Qwen2.5-7B-shaped model in bfloat16: seconds of one forward pass by batch size and tokens per
                  sequence (a decode pass of 1 token, verify passes of 4, 8 and 16), at a context of 1,024 tokens;
                  and the tail's token-tree passes (batch 1, 2 and 4; trees of 16, 32 and 48 tokens with their tree
                  mask, each against a decode pass of the same batch) at contexts of 1,024 and 4,096
  profile         the virtual clock's h100-7b profile's seconds for the same passes (trees included), each pass's
                  error, and a profile fitted to this GPU's passes (fixed cost, bandwidth, flops; h100-7b itself is
                  not changed)
  draft_head      a draft head over the same 7B shape (window 64, each row a full window of pairs): seconds of a
                  drafting call by rows (1, 8, 64) and draft tokens (1, 8), per call and per drafted token, against
                  a decode pass of the same rows at a context of 1,024 (both with their keyed sampling); each call's
                  FLOPs as draft_head_size counts them and the h100-7b profile's charge for it (head_seconds)
  sampling_cost   keyed sampling against torch.multinomial at 151,936 tokens
  engine_speed    the torch engine's tokens/s without and with drafts at the Qwen2.5-0.5B shape (batch 1, 16, 64)

The vLLM checks that need a GPU (its V2 model runner, sleep mode) are scripts/bench_engine_gpu.sh's: they need a
machine where vLLM is installed, and this script runs without it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QWEN25_7B = {
    "model_type": "qwen2", "vocab_size": 152_064, "hidden_size": 3584, "num_layers": 28, "num_heads": 28,
    "num_kv_heads": 4, "head_dim": 128, "intermediate_size": 18_944, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "max_position_embeddings": 32_768, "tie_word_embeddings": False, "attention_bias": True,
    "eos_token_ids": (151_643,),
}  # fmt: skip
"""Qwen2.5-7B's shape (7.6e9 parameters), the model the h100-7b profile models."""

TINY_7B = QWEN25_7B | {"vocab_size": 4096, "hidden_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                       "head_dim": 64, "intermediate_size": 512}  # fmt: skip
"""The dry run's stand-in for it."""


class Sizes:
    """Every stage's sizes: the GPU run's, or the dry run's (tiny, seconds on a CPU)."""

    def __init__(self, dry_run: bool, device: str | None = None) -> None:
        self.device = device or ("cpu" if dry_run else "cuda")
        self.vocabularies = (32_000, 151_936)
        self.sampling_rows = (4, 3) if dry_run else (16, 4)
        self.engine_requests = 6 if dry_run else 32
        self.engine_tokens = 16 if dry_run else 64
        self.premise_shape = TINY_7B if dry_run else QWEN25_7B
        self.premise_batches = (1, 8) if dry_run else (1, 8, 32, 64)
        self.premise_tokens = (1, 4) if dry_run else (1, 4, 8, 16)
        self.premise_context = 64 if dry_run else 1024
        self.tree_batches = (1, 2) if dry_run else (1, 2, 4)
        self.tree_tokens = (16, 32) if dry_run else (16, 32, 48)
        self.tree_contexts = (64, 128) if dry_run else (1024, 4096)
        self.repeats = 2 if dry_run else 5
        self.sampling_batches = (1, 4) if dry_run else (1, 16, 64)
        self.head_batches = (1, 8) if dry_run else (1, 8, 64)
        self.head_tokens = (1, 8)
        self.head_window = 64
        self.speed_preset = {"vocab_size": 4096, "hidden_size": 128, "num_layers": 2, "num_heads": 2,
                             "num_kv_heads": 1, "intermediate_size": 256, "bos_token_id": 1,
                             "eos_token_id": 2} if dry_run else {}  # fmt: skip
        self.speed_batches = (1, 4) if dry_run else (1, 16, 64)
        self.speed_tokens = 16 if dry_run else 128


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="folder of gpu_check.json")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (seconds), on the CPU unless --device")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda; cpu with --dry-run)")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated: " + ", ".join(STAGES))
    args = parser.parse_args(argv)
    unknown = sorted(set(args.stages.split(",")) - set(STAGES))
    if unknown:
        parser.error(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")

    import torch

    sizes = Sizes(args.dry_run, args.device)
    if sizes.device.startswith("cuda") and not torch.cuda.is_available():
        print("torch sees no CUDA device: run on a GPU machine, or pass --dry-run", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"dry_run": args.dry_run, "device": sizes.device, "stages": {}}
    path = args.out / "gpu_check.json"
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.stages.split(","):
            began = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                result = STAGES[name](sizes, Path(scratch), report["stages"])
                result["status"] = "ok"
            except Exception as error:  # a failed stage is recorded and the next one runs
                traceback.print_exc()
                result = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
            result["seconds"] = round(time.perf_counter() - began, 2)
            report["stages"][name] = result
            path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print_table(report)
    print(f"wrote {path}")
    return 0 if all(s["status"] == "ok" for s in report["stages"].values()) else 1


def environment(sizes: Sizes, scratch: Path, done: dict) -> dict:
    import torch

    info = {"torch": torch.__version__, "python": sys.version.split()[0], "cuda": torch.version.cuda}
    if sizes.device.startswith("cuda"):
        properties = torch.cuda.get_device_properties(torch.device(sizes.device))
        info |= {"gpu": properties.name, "gpu_memory_gib": round(properties.total_memory / 2**30, 1),
                 "multiprocessors": properties.multi_processor_count}  # fmt: skip
    return info


def keyed_sampling(sizes: Sizes, scratch: Path, done: dict) -> dict:
    """The same logits tensor on the CPU and on the device: tokens equal, logprobs within float64 rounding."""
    import torch

    from bubblespec.verify.sampling import keyed_sample

    settings = {
        "temperature 1": {"temperature": 1.0},
        "temperature 0.7, top-k 40, top-p 0.9": {"temperature": 0.7, "top_k": 40, "top_p": 0.9},
        "temperature 0.9, min-p 0.05, suppressed": {"temperature": 0.9, "min_p": 0.05, "suppressed": True},
        "greedy": {"temperature": 0.0},
    }
    batch, positions = sizes.sampling_rows
    rows = []
    for vocab in sizes.vocabularies:
        generator = torch.Generator().manual_seed(vocab)
        logits = torch.randn(batch, positions, vocab, generator=generator) * 3  # peaked like a model's
        seeds = torch.randint(2**31, (batch, 2), generator=generator)
        where = torch.arange(positions)[None].expand(batch, positions)
        for name, setting in settings.items():
            arguments = {
                "temperature_B": torch.full((batch,), setting["temperature"], dtype=torch.float64),
                "top_k_B": torch.full((batch,), setting.get("top_k", 0), dtype=torch.int64),
                "top_p_B": torch.full((batch,), setting.get("top_p", 1.0), dtype=torch.float64),
                "min_p_B": torch.full((batch,), setting.get("min_p", 0.0), dtype=torch.float64),
            }
            if setting.get("suppressed"):
                arguments["suppressed_BS"] = logits[:, 0].topk(2).indices  # each row's two likeliest first tokens
            cpu_tokens, cpu_logprobs = keyed_sample(logits, seeds, where, **arguments)
            on = {k: v.to(sizes.device) for k, v in arguments.items()}
            tokens, logprobs = keyed_sample(logits.to(sizes.device), seeds, where, **on)
            rows.append({
                "vocabulary": vocab, "setting": name, "rows": batch * positions,
                "tokens_equal": bool(torch.equal(tokens.cpu(), cpu_tokens)),
                "logprob_max_difference": float((logprobs.cpu() - cpu_logprobs).abs().max()),
            })  # fmt: skip
    if not all(r["tokens_equal"] for r in rows):
        raise AssertionError(f"keyed samples differ between the CPU and {sizes.device}: {rows}")
    return {"rows": rows}


def _policy_pair(scratch: Path) -> tuple[Path, Path]:
    from bubblespec.testing import write_policy_pair

    folder = scratch / "llama32k"
    if not (folder / "newer" / "config.json").is_file():
        write_policy_pair(folder, "llama", 32_000, 40.0, 0.02)
    return folder / "newer", folder / "older"


def _requests(sizes: Sizes, vocab: int, seed: int = 0, max_new_tokens: int | None = None):
    """``sizes.engine_requests`` random prompts of 8-48 tokens, each generating ``max_new_tokens`` (default
    ``sizes.engine_tokens``) past any EOS."""
    import random

    from bubblespec.core.interfaces import GenerationRequest, RolloutKey, SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_new_tokens=max_new_tokens or sizes.engine_tokens, ignore_eos=True)
    return [
        GenerationRequest(
            tuple(rng.randrange(3, vocab) for _ in range(rng.randint(8, 48))), RolloutKey(seed, 1, f"p{i}", 0), params
        )  # fmt: skip
        for i in range(sizes.engine_requests)
    ]


def engine_drafts(sizes: Sizes, scratch: Path, done: dict) -> dict:
    import torch

    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.cli.bench_engine_measures import exactness_row
    from bubblespec.cli.bench_engine_requests import with_drafts

    newer, older = _policy_pair(scratch)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    requests = _requests(sizes, 32_000)
    result: dict = {}
    for dtype in ("float32", "bfloat16"):
        drafts = TorchEngine.from_pretrained(str(older), dtype=dtype, device=sizes.device).generate(requests)
        engine = TorchEngine.from_pretrained(str(newer), dtype=dtype, device=sizes.device)
        row = exactness_row(engine, requests, drafts)
        drafted = engine.generate(with_drafts(requests, drafts))
        row["draft_tokens_accepted"] = sum(r.stats.draft_tokens_accepted for r in drafted)
        row["decode_steps_plain"] = sum(r.stats.decode_steps for r in engine.generate(requests))
        row["decode_steps_with_drafts"] = sum(r.stats.decode_steps for r in drafted)
        result[dtype] = row
    cpu = TorchEngine.from_pretrained(str(newer), dtype="float32").generate(requests)
    on_device = TorchEngine.from_pretrained(str(newer), dtype="float32", device=sizes.device).generate(requests)
    result["float32_responses_equal_to_the_cpu_engine"] = sum(
        a.token_ids == b.token_ids for a, b in zip(cpu, on_device, strict=True)
    )
    if result["float32"]["differing"]:
        raise AssertionError(f"float32 with TF32 off: {result['float32']['differing']} responses changed by drafts")
    return result


def learner_step(sizes: Sizes, scratch: Path, done: dict) -> dict:
    """One GRPO step of the small checkpoint on the device and on the CPU, from the same samples."""
    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.core.config import TrainerConfig
    from bubblespec.rl.learner import GRPOLearner
    from bubblespec.rl.train_batch import train_samples

    newer, _ = _policy_pair(scratch)
    requests = _requests(sizes, 32_000, seed=1)[:8]
    results = TorchEngine.from_pretrained(str(newer), dtype="float32").generate(requests)
    samples = train_samples(requests, results, [float(i % 2) for i in range(len(requests))], group_size=2)
    weights, metrics = {}, {}
    for device in dict.fromkeys(("cpu", sizes.device)):
        config = TrainerConfig(device=device, optimizer={"learning_rate": 1e-3})
        learner = GRPOLearner(str(newer), "float32", config, 1.0)
        metrics[device] = {k: v for k, v in learner.step(samples).items() if isinstance(v, int | float)}
        weights[device] = {n: t.detach().cpu() for n, t in learner.state_dict().items()}
    difference = max(
        float((weights[sizes.device][n] - t).abs().max() / t.abs().max().clamp_min(1e-12))
        for n, t in weights["cpu"].items()
    )
    keep = ("loss", "grad_norm", "logprob_diff_max", "trained_tokens")
    return {
        "metrics": {device: {k: m[k] for k in keep if k in m} for device, m in metrics.items()},
        "largest_relative_weight_difference_to_the_cpu_step": difference,
    }


def _random_model(shape: dict, device: str):
    import torch

    from bubblespec.models.decoder import DecoderConfig, DecoderModel

    config = DecoderConfig(**shape)
    generator = torch.Generator(device=device).manual_seed(0)
    weights = {
        name: torch.randn(dims, generator=generator, device=device, dtype=torch.bfloat16) * 0.02
        if len(dims) == 2
        else torch.ones(dims, device=device, dtype=torch.bfloat16)
        for name, dims in config.parameter_shapes().items()
    }
    model = DecoderModel(config, weights, torch.bfloat16, device)
    del weights
    return model


def _timed(function, device: str, repeats: int) -> float:
    """Median seconds of ``function()`` over ``repeats`` calls after one warm-up."""
    from bubblespec.cli.bench_engine_measures import synchronize

    function()
    synchronize(device)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def premise(sizes: Sizes, scratch: Path, done: dict) -> dict:
    """Seconds of one forward pass of the 7B shape by batch size and tokens per sequence, each sequence after
    ``premise_context`` cached tokens (the cache's contents do not change the cost); then token-tree passes at the
    tail's sizes (:func:`_tree_passes`)."""
    import torch

    from bubblespec.models.decoder import KVCache

    model = _random_model(sizes.premise_shape, sizes.device)
    context = sizes.premise_context
    passes = []
    with torch.inference_mode():
        for batch in sizes.premise_batches:
            cache = KVCache(model.config, batch, context + max(sizes.premise_tokens) + 16, torch.bfloat16, model.device)
            for tokens in sizes.premise_tokens:
                ids = torch.randint(model.config.vocab_size, (batch, tokens), device=model.device)
                positions = (context + torch.arange(tokens, device=model.device))[None].expand(batch, tokens)
                seconds = _timed(functools.partial(model.forward, ids, positions, cache), sizes.device, sizes.repeats)
                passes.append({"batch": batch, "tokens_per_sequence": tokens, "context": context, "seconds": seconds})
            cache = None  # freed before the next batch size's
        tree_passes = _tree_passes(model, sizes)
    for row in passes:
        decode = next(p for p in passes if p["batch"] == row["batch"] and p["tokens_per_sequence"] == 1)
        row["against_a_decode_pass"] = row["seconds"] / decode["seconds"]
    shape = {k: v for k, v in sizes.premise_shape.items() if k != "eos_token_ids"}
    return {"shape": shape, "passes": passes, "tree_passes": tree_passes}


def tail_tree(tree_tokens: int):
    """A draft trie of ``tree_tokens`` nodes shaped like the tail's: a main draft of half the nodes and branches of
    8 tokens off it at depths 2, 4, 6, ... (where a newer policy would take the runner-up)."""
    from bubblespec.verify.tree import DraftTree

    main = [3 + i for i in range(tree_tokens // 2)]
    branches = [main[:depth] + [2] * 8 for depth in range(2, 2 * (tree_tokens - len(main)) // 8 + 1, 2)]
    tree = DraftTree.of([("bubble", main), *(("branch", b) for b in branches)], tree_tokens)
    assert len(tree) == tree_tokens, (len(tree), tree_tokens)
    return tree


def _tree_passes(model, sizes: Sizes) -> list[dict]:
    """Seconds of a token-tree pass (the torch engine's ``_tree_step``: each sequence feeds its last token and a
    :func:`tail_tree` of ``tree_tokens`` nodes, with the tree mask) and of a decode pass of the same batch and
    context, at each of ``tree_batches`` x ``tree_contexts``."""
    import torch

    from bubblespec.models.decoder import KVCache, TokenTree

    rows = []
    for context in sizes.tree_contexts:
        for batch in sizes.tree_batches:
            cache = KVCache(model.config, batch, context + 1 + max(sizes.tree_tokens), torch.bfloat16, model.device)
            decode = None
            for tree_tokens in (0, *sizes.tree_tokens):
                draft = tail_tree(tree_tokens)
                fed = 1 + tree_tokens
                ids = torch.randint(model.config.vocab_size, (batch, fed), device=model.device)
                stored = (context + torch.arange(fed, device=model.device))[None].expand(batch, fed)
                depths = torch.tensor(draft.chunk_positions(1), device=model.device)
                tree = TokenTree(
                    (context + depths)[None].expand(batch, fed),
                    draft.chunk_visible(1).to(model.device)[None].expand(batch, fed, fed),
                )  # fmt: skip
                call = functools.partial(model.forward, ids, stored, cache, None, tree if tree_tokens else None)
                seconds = _timed(call, sizes.device, sizes.repeats)
                decode = decode or seconds
                rows.append({
                    "batch": batch, "tree_tokens": tree_tokens, "tokens_per_sequence": fed, "context": context,
                    "attention_pairs_per_sequence": draft.attention_pairs(1, context), "seconds": seconds,
                    "against_a_decode_pass": seconds / decode,
                })  # fmt: skip
            cache = None
    return rows


def _forward_pass(row: dict):
    """The pass a premise row timed: a causal chunk of ``tokens_per_sequence`` after ``context`` cached tokens per
    sequence, or a tree pass where the row counts its attended pairs."""
    from bubblespec.core.interfaces import ForwardPass

    batch, tokens, context = row["batch"], row["tokens_per_sequence"], row["context"]
    pairs = row.get("attention_pairs_per_sequence") or sum(context + t + 1 for t in range(tokens))
    return ForwardPass(
        num_sequences=batch,
        num_tokens=batch * tokens,
        context_tokens=batch * (context + tokens),
        attention_pairs=batch * pairs,
    )


def profile(sizes: Sizes, scratch: Path, done: dict) -> dict:
    """h100-7b's forward cost (sampling excluded: the premise times the model's pass alone) against the measured
    passes, and a roofline fitted to them: fixed + max(bytes / bandwidth, flops / peak), the bytes and flops
    h100-7b counts. The fit: bandwidth and fixed cost from the passes h100-7b calls memory-bound, by least squares,
    then the flops rate from the rest (their seconds less the fixed cost). A dry run's tiny model is not the 7B shape
    these bytes and flops count: its errors mean nothing."""
    from dataclasses import replace

    from bubblespec.rollout.clocks import PROFILES

    premise_stage = done.get("premise", {})
    passes = premise_stage.get("passes", []) + premise_stage.get("tree_passes", [])
    if not passes:
        raise RuntimeError("the premise stage has no measured passes")
    h100 = PROFILES["h100-7b"]
    rows = []
    for row in passes:
        forward = _forward_pass(row)
        memory_bytes = h100.weight_bytes + h100.kv_bytes_per_context_token * forward.context_tokens
        flops = h100.flops_per_token * forward.num_tokens + h100.attention_flops_per_pair * forward.attention_pairs
        predicted = h100.forward_seconds(forward)
        rows.append(row | {"bytes": memory_bytes, "flops": flops, "h100_7b_seconds": predicted,
                           "h100_7b_error": predicted / row["seconds"] - 1,
                           "memory_bound": memory_bytes / h100.bandwidth_bytes_per_s
                           >= flops / h100.flops_per_s})  # fmt: skip
    memory_rows = [r for r in rows if r["memory_bound"]] or rows
    x, y = [r["bytes"] for r in memory_rows], [r["seconds"] for r in memory_rows]
    # A line (fixed cost + bytes / bandwidth), or one through the origin where the bytes vary too little for the
    # line's intercept (the weights dominate them), whichever fits the memory-bound passes better.
    candidates = [(0.0, sum(a * b for a, b in zip(x, y, strict=True)) / sum(a * a for a in x))]
    fixed, per_byte = _line(x, y)
    if fixed >= 0 and per_byte > 0:
        candidates.append((fixed, per_byte))

    def error(candidate: tuple[float, float]) -> float:
        return statistics.median(abs((candidate[0] + candidate[1] * a) / b - 1) for a, b in zip(x, y, strict=True))

    fixed, per_byte = min(candidates, key=error)
    compute_rows = [r for r in rows if not r["memory_bound"]]
    rates = [r["flops"] / (r["seconds"] - fixed) for r in compute_rows if r["seconds"] > fixed]
    fitted = replace(
        h100,
        name="fitted",
        description="fitted to this GPU's passes by scripts/gpu_check.py",
        fixed_s=fixed,
        bandwidth_bytes_per_s=1 / per_byte,
        flops_per_s=statistics.median(rates) if rates else h100.flops_per_s,
    )
    for row in rows:
        row["fitted_seconds"] = fitted.forward_seconds(_forward_pass(row))
        row["fitted_error"] = row["fitted_seconds"] / row["seconds"] - 1
    trees = [r for r in rows if r.get("tree_tokens")] or rows
    return {
        "h100_7b_median_absolute_error": statistics.median(abs(r["h100_7b_error"]) for r in rows),
        "fitted_median_absolute_error": statistics.median(abs(r["fitted_error"]) for r in rows),
        "tree_passes_h100_7b_median_absolute_error": statistics.median(abs(r["h100_7b_error"]) for r in trees),
        "tree_passes_fitted_median_absolute_error": statistics.median(abs(r["fitted_error"]) for r in trees),
        "fitted": {
            "fixed_s": fitted.fixed_s,
            "bandwidth_bytes_per_s": fitted.bandwidth_bytes_per_s,
            "flops_per_s": fitted.flops_per_s,
        },  # fmt: skip
        "h100_7b": {
            "fixed_s": h100.fixed_s,
            "bandwidth_bytes_per_s": h100.bandwidth_bytes_per_s,
            "flops_per_s": h100.flops_per_s,
        },  # fmt: skip
        "passes": rows,
    }


def _line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of y against x (a flat line through the mean where x does not vary)."""
    mean_x, mean_y = statistics.fmean(x), statistics.fmean(y)
    spread = sum((a - mean_x) ** 2 for a in x)
    slope = sum((a - mean_x) * (b - mean_y) for a, b in zip(x, y, strict=True)) / spread if spread else 0.0
    return mean_y - slope * mean_x, slope


def draft_head(sizes: Sizes, scratch: Path, done: dict) -> dict:
    """Seconds of :meth:`~bubblespec.models.draft_head.DraftHead.draft` over the 7B shape (an untrained head: its
    cost does not depend on its weights) by rows and draft tokens, every row holding a full window of pairs, against
    a decode pass of the policy of the same rows at ``premise_context`` cached tokens; both include the keyed
    sampling of their logits (temperature 1, each row its own seeds), as an engine's calls do. ``flops``: the
    call's matrix-product FLOPs, :meth:`~bubblespec.models.draft_head.DraftHeadSize.drafting_call_flops` times the
    rows; ``h100_7b_seconds``: what the virtual clock's h100-7b profile charges for the call
    (:meth:`~bubblespec.rollout.clocks.CostProfile.head_seconds`)."""
    import torch

    from bubblespec.models.draft_head import DraftHead, draft_head_size
    from bubblespec.rollout.clocks import PROFILES
    from bubblespec.verify.sampling import keyed_sample

    model = _random_model(sizes.premise_shape, sizes.device)
    config, device, context = model.config, model.device, sizes.premise_context
    head = DraftHead(model, window=sizes.head_window)
    size = draft_head_size(config)
    rows = []
    with torch.inference_mode():
        for batch in sizes.head_batches:
            seeds_B2 = torch.randint(2**31, (batch, 2), device=device)
            settings = (
                torch.ones(batch, dtype=torch.float64, device=device),
                torch.zeros(batch, dtype=torch.int64, device=device),
                torch.ones(batch, dtype=torch.float64, device=device),
            )

            def sample(logits_B1V, positions_B1, seeds_B2=seeds_B2, settings=settings):
                return keyed_sample(logits_B1V, seeds_B2, positions_B1, *settings)[0]

            decode_seconds = _decode_pass_seconds(model, batch, context, sample, sizes)
            pairs = head.window
            hidden_BCH = torch.randn(batch, pairs, config.hidden_size, device=device, dtype=torch.bfloat16)
            tokens_BC = torch.randint(config.vocab_size, (batch, pairs), device=device)
            lengths_B = torch.full((batch,), pairs, device=device)
            first_positions_B = torch.full((batch,), context, device=device)
            for num_tokens in sizes.head_tokens:
                call = functools.partial(head.draft, hidden_BCH, tokens_BC, lengths_B, first_positions_B, num_tokens,
                                         sample)  # fmt: skip
                seconds = _timed(call, sizes.device, sizes.repeats)
                flops = batch * size.drafting_call_flops(pairs, num_tokens, head.window)
                predicted = PROFILES["h100-7b"].head_seconds(_head_call(batch, num_tokens, pairs, head.window, config))
                rows.append({
                    "batch": batch, "num_tokens": num_tokens, "context_pairs": pairs, "seconds": seconds,
                    "seconds_per_token": seconds / num_tokens, "decode_pass_seconds": decode_seconds,
                    "against_a_decode_pass": seconds / decode_seconds, "flops": flops, "flops_per_s": flops / seconds,
                    "h100_7b_seconds": predicted, "h100_7b_error": predicted / seconds - 1,
                })  # fmt: skip
    shape = {k: v for k, v in sizes.premise_shape.items() if k != "eos_token_ids"}
    return {
        "shape": shape, "window": head.window, "decode_context": context,
        "num_parameters": size.num_parameters, "num_shared_parameters": size.num_shared_parameters,
        "flops_per_token": size.flops_per_token(head.window), "rows": rows,
    }  # fmt: skip


def _head_call(batch: int, num_tokens: int, pairs: int, window: int, config):
    """A :class:`~bubblespec.core.interfaces.ForwardPass` of nothing but the draft-head call the stage timed:
    ``batch`` rows of ``pairs`` pairs each drafting ``num_tokens`` tokens, nothing given, counted as the engine counts
    it (:func:`~bubblespec.models.draft_head.drafting_call_counts`)."""
    from bubblespec.core.interfaces import ForwardPass
    from bubblespec.models.draft_head import drafting_call_counts

    counts = drafting_call_counts([pairs] * batch, [0] * batch, num_tokens, window, config.vocab_size)
    return ForwardPass(num_sequences=0, num_tokens=0, context_tokens=0, attention_pairs=0, **counts)


def _decode_pass_seconds(model, batch: int, context: int, sample, sizes: Sizes) -> float:
    """Seconds of a decode pass of ``batch`` rows after ``context`` cached tokens each, with ``sample`` of its
    logits."""
    import torch

    from bubblespec.models.decoder import KVCache

    cache = KVCache(model.config, batch, context + 1, torch.bfloat16, model.device)
    ids_B1 = torch.randint(model.config.vocab_size, (batch, 1), device=model.device)
    positions_B1 = torch.full((batch, 1), context, device=model.device)
    return _timed(lambda: sample(model.forward(ids_B1, positions_B1, cache), positions_B1), sizes.device, sizes.repeats)


def sampling_cost(sizes: Sizes, scratch: Path, done: dict) -> dict:
    """Seconds of keyed sampling (temperature 1, and with top-k 40 and top-p 0.9) against softmax +
    torch.multinomial on the same [rows, 151,936] logits."""
    import torch

    from bubblespec.verify.sampling import keyed_sample

    vocab, rows = sizes.vocabularies[-1], []
    for batch in sizes.sampling_batches:
        logits = torch.randn(batch, 1, vocab, device=sizes.device)
        seeds = torch.randint(2**31, (batch, 2))
        where = torch.zeros(batch, 1, dtype=torch.int64)
        plain = {
            "temperature_B": torch.ones(batch, dtype=torch.float64),
            "top_k_B": torch.zeros(batch, dtype=torch.int64),
            "top_p_B": torch.ones(batch, dtype=torch.float64),
        }
        filtered = plain | {"top_k_B": torch.full((batch,), 40), "top_p_B": torch.full((batch,), 0.9)}
        probabilities = torch.softmax(logits[:, 0], -1)
        calls = {
            "keyed": functools.partial(keyed_sample, logits, seeds, where, **plain),
            "keyed_top_k_top_p": functools.partial(keyed_sample, logits, seeds, where, **filtered),
            "multinomial": functools.partial(torch.multinomial, probabilities, 1),
        }
        timings = {name: _timed(call, sizes.device, sizes.repeats) for name, call in calls.items()}
        ratio = timings["keyed"] / timings["multinomial"]
        rows.append({"rows": batch, "vocabulary": vocab, **timings, "keyed_over_multinomial": ratio})
    return {"rows": rows}


def engine_speed(sizes: Sizes, scratch: Path, done: dict) -> dict:
    """Tokens/s of the torch engine in bfloat16 without and with drafts of a policy one small step older (every
    weight moved by 1e-4 of its RMS), the runs interleaved, at the Qwen2.5-0.5B shape."""
    import torch

    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.cli.bench_engine_requests import with_drafts
    from bubblespec.core import model_folder
    from bubblespec.testing.random_checkpoints import perturbed_weights, write_preset_checkpoint

    folder = write_preset_checkpoint(scratch / "qwen25-05b", "qwen2.5-0.5b", dtype="bfloat16", seed=0,
                                     **sizes.speed_preset)  # fmt: skip
    newer = perturbed_weights(model_folder.weights(folder), 1e-4, seed=0)
    vocab = model_folder.vocab_size(folder)
    rows = []
    for batch in sizes.speed_batches:
        requests = _requests(sizes, vocab, seed=batch, max_new_tokens=sizes.speed_tokens)[:batch]
        engine = TorchEngine.from_pretrained(str(folder), dtype="bfloat16", device=sizes.device, max_batch_size=64)
        drafts = engine.generate(requests)
        engine.update_weights(newer, version=1)
        drafted = with_drafts(requests, drafts)
        out: dict = {}

        def run(name, batch_requests, engine=engine, out=out):
            out[name] = engine.generate(batch_requests)

        seconds = {
            "plain": _timed(functools.partial(run, "plain", requests), sizes.device, sizes.repeats),
            "drafts": _timed(functools.partial(run, "drafts", drafted), sizes.device, sizes.repeats),
        }
        tokens = sum(len(r.token_ids) for r in out["plain"])
        rows.append({
            "batch": batch, "tokens": tokens,
            "tokens_per_s": tokens / seconds["plain"], "tokens_per_s_with_drafts": tokens / seconds["drafts"],
            "speedup_with_drafts": seconds["plain"] / seconds["drafts"],
            "decode_steps": sum(r.stats.decode_steps for r in out["plain"]),
            "decode_steps_with_drafts": sum(r.stats.decode_steps for r in out["drafts"]),
            "identical": [r.token_ids for r in out["plain"]] == [r.token_ids for r in out["drafts"]],
        })  # fmt: skip
        engine = None
        if sizes.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return {"rows": rows}


STAGES = {
    "environment": environment,
    "keyed_sampling": keyed_sampling,
    "engine_drafts": engine_drafts,
    "learner_step": learner_step,
    "premise": premise,
    "profile": profile,
    "draft_head": draft_head,
    "sampling_cost": sampling_cost,
    "engine_speed": engine_speed,
}


def print_table(report: dict) -> None:
    """One line per stage with its headline figures."""
    stages = report["stages"]
    lines = []
    for name, stage in stages.items():
        if stage["status"] != "ok":
            lines.append(f"{name:15s} FAILED ({stage['seconds']} s): {stage['error']}")
            continue
        if name == "keyed_sampling":
            summary = f"{sum(r['tokens_equal'] for r in stage['rows'])} of {len(stage['rows'])} settings equal"
        elif name == "engine_drafts":
            f32, bf16 = stage["float32"], stage["bfloat16"]
            summary = (
                f"float32 differing with drafts {f32['differing']}/{f32['responses']}; bfloat16 {bf16['differing']} "
                f"with drafts, {bf16['differing_between_plain_batches']} between batches"
            )
        elif name == "premise":
            passes = stage["passes"]
            summary = ", ".join(f"b{r['batch']}x{r['tokens_per_sequence']} {r['seconds'] * 1e3:.1f} ms" for r in passes)
            largest = max(r["tree_tokens"] for r in stage["tree_passes"])
            widest = [r for r in stage["tree_passes"] if r["tree_tokens"] == largest]
            summary += "; trees of " + ", ".join(
                f"{r['tree_tokens']} (b{r['batch']}, context {r['context']}) {r['against_a_decode_pass']:.2f}x a decode"
                for r in widest
            )
        elif name == "profile":
            h100, fitted = stage["h100_7b_median_absolute_error"], stage["fitted_median_absolute_error"]
            trees = (
                stage["tree_passes_h100_7b_median_absolute_error"],
                stage["tree_passes_fitted_median_absolute_error"],
            )
            summary = (
                f"h100-7b median error {h100:.0%}, fitted {fitted:.0%}; tree passes {trees[0]:.0%}, {trees[1]:.0%}"
            )
        elif name == "draft_head":
            summary = ", ".join(
                f"b{r['batch']}x{r['num_tokens']} {r['seconds_per_token'] * 1e3:.2f} ms/token, "
                f"{r['against_a_decode_pass']:.2f}x a decode, h100-7b error {r['h100_7b_error']:.0%}"
                for r in stage["rows"]
            )
        elif name == "sampling_cost":
            summary = ", ".join(
                f"{r['rows']} rows: keyed {r['keyed'] * 1e3:.2f} ms, {r['keyed_over_multinomial']:.1f}x multinomial"
                for r in stage["rows"]
            )
        elif name == "engine_speed":
            summary = ", ".join(
                f"b{r['batch']} {r['speedup_with_drafts']:.2f}x ({'identical' if r['identical'] else 'DIFFERENT'})"
                for r in stage["rows"]
            )
        else:
            shown = {k: v for k, v in stage.items() if k not in ("status", "seconds", "rows", "metrics")}
            summary = ", ".join(f"{k}={v}" for k, v in shown.items())
        lines.append(f"{name:15s} ok ({stage['seconds']} s): {summary}")
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
