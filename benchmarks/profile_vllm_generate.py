"""Where the time of one drafted ``generate`` of the vLLM backend goes, next to the same requests without drafts.

The requests, drafts and policy step are ``bubblespec bench engine``'s on a model folder (random prompts, pi_t's
keyed samples as drafts, pi_t+1 = pi_t moved by ``--weight-noise``). Each ``generate`` runs under cProfile, after
one untimed call of each; the table splits its time into:

- model forward: vLLM's ``_model_forward`` (the decoder layers, attention, the output head's input);
- output head: the logits of every sampled row (vLLM's ``LogitsProcessor``);
- keyed sampling: ``bubblespec.verify.sampling.keyed_sample`` on those logits;
- verifier and proposer: the rest of :class:`bubblespec.backends.vllm_glue.KeyedVerifier` (recording, vLLM's
  sampler output) and of the proposer;
- vLLM scheduling and bookkeeping: ``schedule``, ``update_from_output``, the runner's input preparation and
  bookkeeping;
- other: everything else in ``generate`` (request setup, the engine core loop, Python between them).

    python benchmarks/profile_vllm_generate.py ckpt/llama32k/newer --batch 32 --weight-noise 1e-4

cProfile's own overhead inflates the Python-heavy parts; the split, not the total, is what to read.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

for _name, _value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_name, _value)

# (label, (file suffix, function name) of each function whose cumulative time counts for it)
PARTS = {
    "model forward": [("gpu_model_runner.py", "_model_forward")],
    "output head": [("logits_processor.py", "forward")],
    "keyed sampling": [("bubblespec/verify/sampling.py", "keyed_sample")],
    "verifier and proposer": [("backends/vllm_glue.py", "sample"), ("backends/vllm_glue.py", "propose")],
    "vLLM scheduling and bookkeeping": [
        ("scheduler.py", "schedule"),
        ("scheduler.py", "update_from_output"),
        ("gpu_model_runner.py", "_prepare_inputs"),
        ("gpu_model_runner.py", "_update_states"),
        ("gpu_model_runner.py", "_bookkeeping_sync"),
    ],
}


def _cumulative(stats: pstats.Stats, file_suffix: str, function: str) -> float:
    return sum(
        entry[3]
        for (file, _, name), entry in stats.stats.items()  # entry: (calls, primitive calls, tottime, cumtime, ...)
        if name == function and file.replace(os.sep, "/").endswith(file_suffix)
    )


def _split(profile: cProfile.Profile) -> dict[str, float]:
    stats = pstats.Stats(profile)
    total = _cumulative(stats, "backends/vllm_engine.py", "generate")
    parts = {label: sum(_cumulative(stats, *where) for where in places) for label, places in PARTS.items()}
    keyed = _cumulative(stats, "bubblespec/verify/sampling.py", "keyed_sample")
    parts["verifier and proposer"] -= keyed  # keyed sampling runs inside the verifier: counted once, above
    parts["other"] = total - sum(parts.values())
    return {"total": total, **parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a Hugging Face model folder")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--weight-noise", type=float, default=1e-4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    arguments = parser.parse_args()

    import torch

    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.backends.vllm_engine import VLLMEngine
    from bubblespec.cli.bench_engine_requests import (
        RANDOM_PROMPT_LENGTHS,
        random_workload,
        with_drafts,
    )
    from bubblespec.models.decoder import read_checkpoint
    from bubblespec.testing.random_checkpoints import perturbed_weights

    torch.set_num_threads(arguments.threads)
    low, high = RANDOM_PROMPT_LENGTHS
    workload = random_workload(arguments.model, arguments.batch, (low, high), arguments.max_new_tokens, seed=0)
    requests = workload.requests
    drafts = TorchEngine.from_pretrained(arguments.model, dtype=arguments.dtype).generate(requests)
    _, weights = read_checkpoint(arguments.model)
    new_state = perturbed_weights(weights, arguments.weight_noise, seed=0)
    engine = VLLMEngine.from_pretrained(
        arguments.model,
        dtype=arguments.dtype,
        max_batch_size=arguments.batch,
        max_model_len=high + arguments.max_new_tokens + 80,
        adaptive_draft_length=True,
    )
    engine.update_weights(new_state, version=1)
    drafted = with_drafts(requests, drafts)
    rows = {}
    for name, batch in (("without drafts", requests), ("with drafts", drafted)):
        engine.generate(batch)  # untimed: first calls of each shape
        before, start = engine.num_forward_passes, time.perf_counter()
        profile = cProfile.Profile()
        profile.enable()
        results = engine.generate(batch)
        profile.disable()
        wall = time.perf_counter() - start
        rows[name] = _split(profile) | {
            "engine steps": engine.num_forward_passes - before,
            "tokens": sum(len(r.token_ids) for r in results),
            "wall s": wall,
        }
    labels = ["total", *PARTS, "other"]
    print(f"{'seconds (share of generate)':34}" + "".join(f"{name:>26}" for name in rows))
    for label in labels:
        cells = [f"{row[label]:8.3f} ({row[label] / row['total']:5.1%})" for row in rows.values()]
        print(f"{label:34}" + "".join(f"{cell:>26}" for cell in cells))
    for label in ("engine steps", "tokens"):
        print(f"{label:34}" + "".join(f"{row[label]:>26}" for row in rows.values()))


if __name__ == "__main__":
    main()
