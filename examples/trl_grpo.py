"""TRL's GRPOTrainer with bubblespec's rollout, on the CPU with the shipped arithmetic task and model.

Runs the same TRL GRPO training twice, speculation off and on, and compares them:

    python examples/trl_grpo.py --steps 5 --json out.json

``out.json`` holds, for each run, the decode steps, rollout seconds (of the service's clock) and a digest of every
generation batch's completions, and ``identical_completions`` / ``identical_weights`` / ``decode_step_reduction``
across the two. ``--resume-at K`` stops the speculation-on run after K steps and resumes it from its checkpoint
(``trainer.train(resume_from_checkpoint=...)``): its generations from there on must equal the uninterrupted run's.
Needs the test extra (TRL): ``pip install -e ".[dev]"``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16


def train(speculation: bool, steps: int, clock: str, output_dir: str, stop_at: int | None = None) -> dict:
    """One TRL run of ``steps`` optimizer steps. With ``stop_at``, it stops after that many steps with a checkpoint
    and a second trainer resumes from it (``trainer.train(resume_from_checkpoint=...)``) to the end: the result
    describes the resumed part."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from bubblespec.integrations.trl import BubblespecRollout
    from bubblespec.interfaces import Prompt
    from bubblespec.tasks import ArithmeticTask

    torch.manual_seed(0)
    task = ArithmeticTask(seed=0, prompts_per_step=64)
    path = str(ArithmeticTask.model_path())
    rows = [{"prompt": p.text, "answer": p.answer} for p in task.batch(0)]

    def reward(completion_ids, answer, **_):
        return [task(Prompt("", (), "", a), ids) for ids, a in zip(completion_ids, answer, strict=True)]

    args = GRPOConfig(
        output_dir=output_dir,
        use_vllm=False,
        bf16=False,
        per_device_train_batch_size=16,  # 4 prompts x 4 samples per step
        num_generations=4,
        max_completion_length=task.max_new_tokens,
        learning_rate=1e-4,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no" if stop_at is None else "steps",
        save_steps=stop_at or 500,
        report_to="none",
        seed=0,
        disable_tqdm=True,
    )
    # float64 on both sides: completions are bit-identical with and without drafts (float32 may break near-ties)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    service = {
        "model": {"dtype": "float64"},
        "rollout": {"num_ranks": 4},
        "speculation": {"enabled": speculation},
        "clock": {"kind": clock, "profile": "h100-7b"},
        "metrics": {"enabled": False},
    }

    def trainer_with(rollout, model):
        return GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=AutoTokenizer.from_pretrained(path),
            rollout_func=rollout,
        )

    if stop_at is not None:  # the first part, stopped with a checkpoint as a crash after a save would leave it
        with BubblespecRollout(service, path) as rollout:
            trainer = trainer_with(rollout, model)
            trainer.add_callback(stop_after(stop_at))
            trainer.train()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    with BubblespecRollout(service, path) as rollout:
        trainer = trainer_with(rollout, model)
        checkpoint = None if stop_at is None else str(Path(output_dir) / f"checkpoint-{stop_at}")
        trainer.train(resume_from_checkpoint=checkpoint)
        steps_done = rollout.steps
    weights = {name: t.detach().clone() for name, t in trainer.model.state_dict().items()}
    return {
        "generations": [s.model_dump(exclude={"ranks"}) for s in steps_done],
        "decode_steps": sum(s.decode_steps for s in steps_done),
        "generated_tokens": sum(s.generated_tokens for s in steps_done),
        "rollout_seconds": sum(s.rollout_seconds for s in steps_done),
        "_weights": weights,
    }


def stop_after(step: int):
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= step:
                control.should_training_stop = True

    return StopAt()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="TRL optimizer steps per run")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    clock_help = "virtual: ranks in this process, seconds of an 8xH100 cost model; wall: Ray Serve ranks"
    parser.add_argument("--clock", choices=["virtual", "wall"], default="virtual", help=clock_help)
    resume_help = "stop the speculation-on run after K steps and resume it from its checkpoint"
    parser.add_argument("--resume-at", type=int, metavar="K", help=resume_help)
    args = parser.parse_args(argv)
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        for speculation in (False, True):
            stop_at = args.resume_at if speculation else None
            runs[speculation] = train(
                speculation, args.steps, args.clock, str(Path(scratch) / str(speculation)), stop_at
            )
    if args.resume_at is not None:  # the resumed run describes its generations from the checkpoint on
        first = runs[True]["generations"][0]["generation"]
        off = runs[False]
        off["generations"] = [g for g in off["generations"] if g["generation"] >= first]
        for name in ("decode_steps", "generated_tokens", "rollout_seconds"):
            off[name] = sum(g[name] for g in off["generations"])
    off, on = runs[False], runs[True]
    weights_off, weights_on = off.pop("_weights"), on.pop("_weights")
    report = {
        "steps": args.steps,
        "resumed_at": args.resume_at,
        "clock": args.clock,
        "speculation_off": off,
        "speculation_on": on,
        "identical_completions": [g["completions_digest"] for g in off["generations"]]
        == [g["completions_digest"] for g in on["generations"]],
        "identical_weights": all(bool((weights_off[k] == weights_on[k]).all()) for k in weights_off),
        "decode_step_reduction": 1 - on["decode_steps"] / off["decode_steps"],
        "decode_step_reduction_from_step_2": 1
        - sum(g["decode_steps"] for g in on["generations"][1:])
        / max(sum(g["decode_steps"] for g in off["generations"][1:]), 1),
        "rollout_seconds": {"off": off["rollout_seconds"], "on": on["rollout_seconds"]},
    }
    print(json.dumps({k: v for k, v in report.items() if not k.startswith("speculation_")}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["identical_completions"] else 1


if __name__ == "__main__":
    sys.exit(main())
