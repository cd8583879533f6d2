"""How hard a run config's held-out problems are for its model: pass@k and the mean reward of k keyed samples per
problem at the config's sampling settings, with the built-in torch engine, one process.

    python benchmarks/pass_at_k.py examples/smollm2-gsm8k.yaml --problems 40 --samples 8

For an RL task the useful difficulty leaves the model's pass@k (k = samples per prompt) well between 0 and 1: a group
whose samples all fail, or all succeed, has no reward signal. ``--reward`` names the reward part that counts as solved
(default: the first the task names, e.g. ``math``); a sample solves its problem when that part scores 1. Prints one
line per batch and a JSON summary (``--json`` writes it)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--problems", type=int, default=40, help="held-out problems (the first ones)")
    parser.add_argument("--samples", type=int, default=8, help="k: samples per problem")
    parser.add_argument("--batch", type=int, default=32, help="requests per engine call")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--reward", default=None, help="the reward part that counts as solved")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config overrides")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.core.config import load_config
    from bubblespec.core.interfaces import GenerationRequest, RolloutKey
    from bubblespec.run.assembly import make_task, model_path, sampling_params

    torch.set_num_threads(args.threads)
    config = load_config(args.config, args.overrides)
    task = make_task(config, held_out=True)
    prompts = task.batch(0)[: args.problems]
    if len(prompts) < args.problems:
        raise SystemExit(f"the held-out set has {len(prompts)} problems; ask for at most that many")
    path = model_path(config, task)
    engine = TorchEngine.from_pretrained(path, dtype=config.model.dtype)
    sampling = sampling_params(config, task, path)
    requests = [
        GenerationRequest(p.token_ids, RolloutKey(config.seed, -1, p.uid, s), sampling)
        for p in prompts
        for s in range(args.samples)
    ]
    part = args.reward
    solved, rewards, tokens, truncated = [], [], [], 0
    began = time.perf_counter()
    for start in range(0, len(requests), args.batch):
        chunk = requests[start : start + args.batch]
        results = engine.generate(chunk)
        by_uid = {p.uid: p for p in prompts}
        scores, parts = task.score_parts([by_uid[r.key.prompt_uid] for r in chunk], [r.token_ids for r in results])
        rewards += [float(s) for s in scores]
        part = part or next(iter(parts), None)  # the first named reward, e.g. math
        if part is not None and part not in parts:
            raise SystemExit(f"--reward {part!r}: the task's rewards are {sorted(parts)}")
        solved += [float(v) >= 1.0 for v in (parts[part] if part in parts else scores)]
        tokens += [len(r.token_ids) for r in results]
        truncated += sum(r.finish_reason == "length" for r in results)
        print(f"{start + len(chunk)}/{len(requests)} samples, {time.perf_counter() - began:.0f} s", file=sys.stderr)
    task.close()
    per_problem = [solved[i * args.samples : (i + 1) * args.samples] for i in range(len(prompts))]
    passed = [any(row) for row in per_problem]
    accuracy = sum(solved) / len(solved)
    report = {
        "config": str(args.config),
        "model": model_path(config, task),
        "temperature": sampling.temperature,
        "max_new_tokens": sampling.max_new_tokens,
        "problems": len(prompts),
        "samples": args.samples,
        "solved_by": part or "the whole reward",
        f"pass@{args.samples}": sum(passed) / len(passed),
        f"pass@{args.samples}_stderr": math.sqrt(max(sum(passed) / len(passed) * (1 - sum(passed) / len(passed)), 0)
                                                 / len(passed)),
        "accuracy": accuracy,
        "reward_mean": sum(rewards) / len(rewards),
        "groups_with_signal": sum(0 < sum(row) < len(row) for row in per_problem) / len(per_problem),
        "response_tokens_mean": sum(tokens) / len(tokens),
        "truncated": truncated / len(tokens),
        "seconds": time.perf_counter() - began,
    }  # fmt: skip
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
