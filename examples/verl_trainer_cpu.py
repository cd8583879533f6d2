"""verl 0.9.1's own GRPO trainer with bubblespec's rollout, on a CPU: the shipped arithmetic model, a few steps.

verl's trainer assumes GPUs; ``examples/verl_cpu_platform.py`` gives it a CPU platform (see there what it patches)
and the overrides below keep it off CUDA-only paths (FSDP2 on gloo, eager attention, fake Ray GPUs). Everything else
is verl's: ``python -m verl.trainer.main_ppo`` with its FSDP actor, old-logprob and update workers, its naive weight
sync, its reward workers (the task's reward as verl's custom reward function) and bubblespec's rollout by name:

    python examples/verl_trainer_cpu.py --steps 3 --json out.json [--speculation off]

``out.json`` has each step's record as the rollout wrote it (``custom.bubblespec_records``): decode steps, draft
coverage, whether the peek matched, a digest of the responses and the weights' version the step generated with.
verl's legacy trainer (``trainer.use_v1=False``) is the one that takes an agent loop manager of
``DataProto -> DataProto``; its default (v1) trainer takes another contract (see docs/integrations.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _rollout_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("verl_rollout_example", HERE / "verl_rollout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def command(folder: Path, steps: int, speculation: bool, records: Path) -> list[str]:
    """``python -m verl.trainer.main_ppo`` with verl's settings for a CPU and bubblespec's rollout."""
    rollout = _rollout_example()
    return [
        sys.executable, "-m", "verl.trainer.main_ppo",
        # verl's legacy trainer: its agent loop manager takes and returns DataProto
        "trainer.use_v1=False",
        # a CPU: one fake Ray GPU for the one FSDP2 worker on gloo, eager attention
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "+ray_kwargs.ray_init.num_gpus=1", "+ray_kwargs.ray_init.address=local", "ray_kwargs.ray_init.num_cpus=4",
        "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.fsdp_config.strategy=fsdp2",
        "actor_rollout_ref.ref.strategy=fsdp2", "actor_rollout_ref.ref.fsdp_config.strategy=fsdp2",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
        # the run
        "trainer.logger=[console]", "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
        f"trainer.total_training_steps={steps}", "trainer.total_epochs=2", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={folder / 'checkpoints'}",
        "algorithm.adv_estimator=grpo",
        f"data.train_files={folder / 'train.parquet'}", f"data.val_files={folder / 'train.parquet'}",
        f"data.train_batch_size={rollout.BATCH}", f"data.max_prompt_length={rollout.PROMPT_LENGTH}",
        f"data.max_response_length={rollout.RESPONSE_LENGTH}", "data.dataloader_num_workers=0",
        f"reward.custom_reward_function.path={HERE / 'verl_rollout.py'}",
        "reward.custom_reward_function.name=compute_score",
        f"actor_rollout_ref.model.path={folder / 'model'}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={rollout.BATCH}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rollout.BATCH}",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.optim.lr=1e-4",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={rollout.BATCH}",
        f"actor_rollout_ref.rollout.n={rollout.N}", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        # bubblespec's rollout
        "actor_rollout_ref.rollout.name=bubblespec",
        f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={rollout.MANAGER}",
        "+actor_rollout_ref.rollout.custom.bubblespec.clock.kind=virtual",
        "+actor_rollout_ref.rollout.custom.bubblespec.clock.profile=h100-7b",
        "+actor_rollout_ref.rollout.custom.bubblespec.rollout.num_ranks=4",
        f"+actor_rollout_ref.rollout.custom.bubblespec.speculation.enabled={str(speculation).lower()}",
        f"+actor_rollout_ref.rollout.custom.bubblespec_records={records}",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="verl trainer steps")
    parser.add_argument("--speculation", choices=["on", "off"], default="on")
    parser.add_argument("--json", type=Path, help="write the steps' records here")
    parser.add_argument("--log", type=Path, help="write verl's output here (default: this process's stdout)")
    args = parser.parse_args(argv)
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "VERL_USE_EXTERNAL_MODULES": "verl_cpu_platform",
        "VERL_PLATFORM": "cpu",
        "VERL_ENGINE_DEVICE": "cuda",  # verl's FSDP engine is registered for cuda and npu: the platform maps it to cpu
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    with tempfile.TemporaryDirectory() as scratch:
        folder = _rollout_example().write_inputs(Path(scratch))
        records = folder / "records.jsonl"
        out = open(args.log, "w") if args.log else None  # noqa: SIM115 - closed below
        try:
            done = subprocess.run(
                command(folder, args.steps, args.speculation == "on", records),
                env=env,
                cwd=folder,  # hydra writes its outputs/ folder here
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                check=False,
            )
        finally:
            if out:
                out.close()
        if done.returncode != 0:
            print(f"verl's trainer failed (exit {done.returncode})", file=sys.stderr)
            return done.returncode
        steps = [json.loads(line) for line in records.read_text().splitlines()]
    report = {"speculation": args.speculation, "steps": steps}
    print(json.dumps([{k: s[k] for k in ("global_step", "weights_version", "decode_steps", "generated_tokens",
                                          "draft_coverage", "peek_matched")} for s in steps], indent=1))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
