"""Load: many virtual ranks and many prompts per step, with bounded memory.

    python benchmarks/load.py --ranks 64 --prompts 1000 --steps 4      # a few minutes on 2 cores
    python benchmarks/load.py --store-max-tokens 20000                  # a cap that bites: drafts are evicted

Runs the virtual clock (everything in this process) with speculation on, two steps of lookahead and drafting
while training, and reports per step: the work (generated tokens, forward passes), the host seconds it took and
seconds per thousand tokens (a step must not get slower than linear in its work), the draft store's size (drafts
and tokens: it must not grow without bound, and stays under ``--store-max-tokens``), the drafts it evicted to stay
there, and the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--store-max-tokens", type=int, default=50_000_000, help="speculation.draft_store_max_tokens")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from bubblespec.core.config import validate
    from bubblespec.observe.run_dir import RunDirectory
    from bubblespec.rl.loop import Controller
    from bubblespec.run.assembly import build_parts

    rows = []
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as stack:
        config = validate(
            {
                "name": "load",
                "output_dir": scratch,
                "num_steps": args.steps,
                "checkpoint_every": args.steps,
                "task": {"prompts_per_step": args.prompts, "samples_per_prompt": args.samples},
                "rollout": {"num_ranks": args.ranks, "sampling": {"max_new_tokens": args.max_new_tokens}},
                "speculation": {
                    "lookahead_steps": 2,
                    "draft_during_training": True,
                    "draft_store_max_tokens": args.store_max_tokens,
                },
                "clock": {"kind": "virtual", "profile": "h100-7b"},
                "metrics": {"enabled": False},
            }
        )
        parts = stack.enter_context(build_parts(config))
        run_dir = RunDirectory(config.run_dir)
        run_dir.create(config)
        controller = Controller(config, parts, run_dir)
        for step in range(args.steps):
            started = time.perf_counter()
            record = controller.step(step)
            seconds = time.perf_counter() - started
            row = {
                "step": step,
                "generated_tokens": record.generated_tokens,
                "decode_steps": record.decode_steps,
                "drafts_made": record.drafts_made,
                "host_seconds": seconds,
                "seconds_per_1k_tokens": 1000 * seconds / max(record.generated_tokens, 1),
                "draft_store_drafts": len(parts.service.store),
                "draft_store_tokens": parts.service.store.stats()["tokens"],
                "drafts_evicted": record.drafts_evicted,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "steps": rows}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
