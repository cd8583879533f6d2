"""TRL's GRPOTrainer with bubblespec's rollout, on the CPU with the shipped arithmetic task and model.

Runs the same TRL GRPO training twice, speculation off and on, and compares them:

    python examples/trl_grpo.py --steps 5 --json out.json

``out.json`` holds, for each run, the decode steps, rollout seconds (of the service's clock) and a digest of every
generation batch's completions, and ``identical_completions`` / ``identical_weights`` / ``decode_step_reduction``
across the two. ``--resume-at K`` stops the speculation-on run after K steps and resumes it from its checkpoint
(``trainer.train(resume_from_checkpoint=...)``): its generations from there on must equal the uninterrupted run's.
``--save-weights FILE`` keeps the speculation-on run's final weights (``torch.save``) to compare runs.

On several processes the generation batch stays 16 completions (4 prompts x 4), split over the processes; on a CPU:

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 examples/trl_grpo.py --json out.json

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

GENERATION_BATCH = 16
"""Completions per optimizer step over all processes: 4 prompts x 4 samples."""


def train(speculation: bool, steps: int, clock: str, output_dir: str, stop_at: int | None = None) -> dict:
    """One TRL run of ``steps`` optimizer steps. With ``stop_at``, it stops after that many steps with a checkpoint
    and a second trainer resumes from it (``trainer.train(resume_from_checkpoint=...)``) to the end: the result
    describes the resumed part."""
    import torch
    from accelerate import PartialState
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from bubblespec.core.interfaces import Prompt
    from bubblespec.integrations.trl import BubblespecRollout
    from bubblespec.tasks import ArithmeticTask

    torch.manual_seed(0)
    processes = PartialState(cpu=not torch.cuda.is_available()).num_processes
    if GENERATION_BATCH % processes:
        raise SystemExit(f"{processes} processes cannot split a generation batch of {GENERATION_BATCH} completions")
    task = ArithmeticTask(seed=0, prompts_per_step=64)
    path = str(ArithmeticTask.model_path())
    rows = [{"prompt": p.text, "answer": p.answer} for p in task.batch(0)]

    def reward(completion_ids, answer, **_):
        return [task(Prompt("", (), "", a), ids) for ids, a in zip(completion_ids, answer, strict=True)]

    args = GRPOConfig(
        output_dir=output_dir,
        use_vllm=False,
        bf16=False,
        per_device_train_batch_size=GENERATION_BATCH // processes,  # 4 prompts x 4 samples per step, all processes
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
    parser.add_argument("--save-weights", type=Path, metavar="FILE", help="the speculation-on run's final weights")
    args = parser.parse_args(argv)
    import torch
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    state = PartialState(cpu=not torch.cuda.is_available())  # as TRL's GRPOConfig will see it: gloo on a CPU
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        scratch = broadcast_object_list([scratch], from_process=0)[0]  # one output_dir for every process
        for speculation in (False, True):
            stop_at = args.resume_at if speculation else None
            runs[speculation] = train(
                speculation, args.steps, args.clock, str(Path(scratch) / str(speculation)), stop_at
            )
            state.wait_for_everyone()  # no process removes the scratch folder while another still uses it
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
        "processes": state.num_processes,
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
    if state.is_main_process:
        print(json.dumps({k: v for k, v in report.items() if not k.startswith("speculation_")}, indent=2))
        if args.json:
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        if args.save_weights:
            torch.save(weights_on, args.save_weights)
    return 0 if report["identical_completions"] else 1


if __name__ == "__main__":
    sys.exit(main())
