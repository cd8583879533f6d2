"""verl's side of each rollout step around bubblespec's rollout, on the CPU with the shipped arithmetic model.

verl's FSDP trainer needs a GPU (docs/integrations.md says where; ``examples/verl_grpo.sh`` runs it on one). This
example runs everything of verl's around the rollout that runs on a CPU, as ``RayPPOTrainer.fit`` drives it: verl's
own config (``ppo_trainer.yaml`` composed with hydra and the overrides a user writes), its dataset, sampler and
``StatefulDataLoader``, its ``DataProto`` batch handling (uids, ``_get_gen_batch``, ``repeat(interleave=True)``,
``union`` with the rollout's output), and per step the workers' naive weight sync through the rollout verl builds
by name (``resume``, ``update_weights``, ``release``). The actor's updates are a stand-in: each step's weights are
the model's moved a little (:func:`policy`). It runs the steps twice, speculation off and on, and compares them:

    python examples/verl_rollout.py --steps 4 --json out.json

``out.json`` has, per run, each step's decode steps, draft coverage and a digest of its responses, and
``identical_responses`` / ``decode_step_reduction_from_step_2`` across the two.

Needs verl 0.9.1 next to bubblespec (the test command installs it: see the README).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

N = 4
"""rollout.n: samples per prompt."""
BATCH = 4
"""data.train_batch_size: prompts per step."""
ROWS = 10
"""Training prompts: two batches per epoch, the last two rows dropped as verl's dataloader drops them."""
PROMPT_LENGTH, RESPONSE_LENGTH = 64, 128
MANAGER = "bubblespec.integrations.verl.BubblespecAgentLoopManager"


def write_inputs(folder: Path) -> Path:
    """The shipped arithmetic model with a chat template that renders a prompt as the task writes it
    (``<bos>4821+93=``), and a parquet training set of its prompts in verl's format (data_source, prompt as chat
    messages, reward_model, extra_info); returns ``folder``."""
    import pandas as pd

    from bubblespec.tasks import ArithmeticTask

    shutil.copytree(ArithmeticTask.model_path(), folder / "model", dirs_exist_ok=True)
    settings = json.loads((folder / "model" / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{{ bos_token }}{{ messages[-1]['content'] }}"
    (folder / "model" / "tokenizer_config.json").write_text(json.dumps(settings))
    rows = [
        {
            "data_source": "arithmetic",
            "prompt": [{"role": "user", "content": prompt.text}],
            "reward_model": {"style": "rule", "ground_truth": prompt.answer},
            "extra_info": {"index": i},
        }
        for i, prompt in enumerate(ArithmeticTask(seed=0, prompts_per_step=ROWS).batch(0))
    ]
    pd.DataFrame(rows).to_parquet(folder / "train.parquet")
    return folder


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """The task's reward as a verl reward function (``reward.custom_reward_function.path`` / ``name``): 1 for the
    right sum, else 0."""
    from bubblespec.core.interfaces import Prompt
    from bubblespec.tasks import ArithmeticTask

    task = ArithmeticTask(seed=0)
    try:
        ids = task.encode(solution_str)
    except ValueError:  # a character outside the task's alphabet
        return 0.0
    return float(task(Prompt("", (), "", ground_truth), ids))


def verl_config(folder: Path, *overrides: str):
    """verl's own trainer config (``ppo_trainer.yaml``) with the overrides a user of bubblespec's rollout writes."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(
            config_name="ppo_trainer",
            overrides=[
                f"data.train_files={folder / 'train.parquet'}",
                f"data.val_files={folder / 'train.parquet'}",
                f"data.train_batch_size={BATCH}",
                f"data.max_prompt_length={PROMPT_LENGTH}",
                f"data.max_response_length={RESPONSE_LENGTH}",
                "trainer.total_epochs=2",
                "trainer.use_v1=False",  # verl's legacy trainer: its agent loop manager takes and returns DataProto
                f"reward.custom_reward_function.path={Path(__file__).resolve()}",
                "reward.custom_reward_function.name=compute_score",
                f"actor_rollout_ref.model.path={folder / 'model'}",
                f"actor_rollout_ref.rollout.n={N}",
                "actor_rollout_ref.rollout.calculate_log_probs=true",
                # bubblespec's rollout: its name, its agent loop manager, its settings
                "actor_rollout_ref.rollout.name=bubblespec",
                f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER}",
                "+actor_rollout_ref.rollout.custom.bubblespec.clock.kind=virtual",
                "+actor_rollout_ref.rollout.custom.bubblespec.clock.profile=h100-7b",
                "+actor_rollout_ref.rollout.custom.bubblespec.rollout.num_ranks=4",
                # float64: responses are bit-identical with and without drafts (float32 may break near-ties)
                "+actor_rollout_ref.rollout.custom.bubblespec.model.dtype=float64",
                *overrides,
            ],
        )


def train_loader(config):
    """verl's training dataloader, built as ``RayPPOTrainer._create_dataloader`` builds it."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler
    from verl.utils import hf_tokenizer
    from verl.utils.dataset.rl_dataset import collate_fn

    tokenizer = hf_tokenizer(config.actor_rollout_ref.model.path)
    dataset = create_rl_dataset(config.data.train_files, config.data, tokenizer, None)
    return StatefulDataLoader(
        dataset=dataset,
        batch_size=config.data.train_batch_size,
        num_workers=0,
        drop_last=True,
        collate_fn=collate_fn,
        sampler=create_rl_sampler(config.data, dataset),
    )


def gen_batch(batch, step: int, samples: int = N):
    """What ``RayPPOTrainer.fit`` hands the rollout manager: uids added, ``_get_gen_batch``, ``global_steps``, each
    prompt ``rollout.n`` times in a row."""
    import numpy as np

    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
    reward_keys = {"data_source", "reward_model", "extra_info", "uid"} & batch.non_tensor_batch.keys()
    gen = batch.pop(batch_keys=[], non_tensor_batch_keys=list(set(batch.non_tensor_batch) - reward_keys))
    gen.non_tensor_batch.update(batch.non_tensor_batch)
    gen.meta_info["global_steps"] = step
    return gen.repeat(repeat_times=samples, interleave=True)


def policy(folder: Path, step: int) -> dict:
    """The actor's weights after ``step - 1`` updates: the model folder's, moved a little each step (a stand-in for
    GRPO's updates: the next policy is close to the last, as a trained one is)."""
    import torch
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float64).state_dict()
    generator = torch.Generator().manual_seed(0)
    for name, tensor in weights.items():
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
        weights[name] = tensor + 0.002 * (step - 1) * noise * tensor.abs().mean()
    return weights


def run(folder: Path, *overrides: str, steps: int = 4):
    """``steps`` steps of verl's loop around the rollout; returns each step's responses as the trainer would train on
    them (the batch merged with the rollout's output) and the manager (its ``steps`` records)."""
    from verl import DataProto

    from bubblespec.integrations.verl import BubblespecAgentLoopManager, BubblespecServerAdapter

    config = verl_config(folder, *overrides)
    manager = BubblespecAgentLoopManager.create(config=config, llm_client=None)
    rollout, model = config.actor_rollout_ref.rollout, config.actor_rollout_ref.model
    adapter = BubblespecServerAdapter(config=rollout, model_config=model)  # what verl builds by rollout.name
    responses = []
    try:
        step, loader = 0, train_loader(config)  # one dataloader: a later epoch goes on with its sampler's generator
        for _ in range(int(config.trainer.total_epochs)):
            for batch_dict in loader:
                step += 1
                if step > steps:
                    return responses, manager
                # checkpoint_manager.update_weights(global_steps), naive backend, in each trainer worker
                asyncio.run(adapter.resume(tags=["weights"]))
                asyncio.run(adapter.update_weights(iter(policy(folder, step).items()), global_steps=step))
                asyncio.run(adapter.resume(tags=["kv_cache"]))
                batch = DataProto.from_single_dict(batch_dict)
                output = manager.generate_sequences(gen_batch(batch, step))
                asyncio.run(adapter.release())  # checkpoint_manager.sleep_replicas(): the trainer trains now
                merged = batch.repeat(repeat_times=N, interleave=True).union(output)  # what the trainer trains on
                responses.append(merged.batch["responses"].clone())
    finally:
        manager.close()
    return responses, manager


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per run (two epochs hold four)")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    args = parser.parse_args(argv)
    import torch

    key = "+actor_rollout_ref.rollout.custom.bubblespec.speculation.enabled"
    with tempfile.TemporaryDirectory() as scratch:
        folder = write_inputs(Path(scratch))
        off, off_manager = run(folder, f"{key}=false", steps=args.steps)
        on, on_manager = run(folder, f"{key}=true", steps=args.steps)

    def steps(manager) -> list[dict]:
        return [record.model_dump(exclude={"ranks"}) for record in manager.steps]

    later_off = sum(r.decode_steps for r in off_manager.steps[1:])
    later_on = sum(r.decode_steps for r in on_manager.steps[1:])
    report = {
        "steps": args.steps,
        "speculation_off": steps(off_manager),
        "speculation_on": steps(on_manager),
        "identical_responses": len(off) == len(on) and all(torch.equal(a, b) for a, b in zip(off, on, strict=True)),
        "decode_step_reduction_from_step_2": 1 - later_on / max(later_off, 1),
    }
    summary = {k: v for k, v in report.items() if not k.startswith("speculation_")}
    summary["decode_steps"] = {"off": [r.decode_steps for r in off_manager.steps],
                               "on": [r.decode_steps for r in on_manager.steps]}  # fmt: skip
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["identical_responses"] else 1


if __name__ == "__main__":
    sys.exit(main())
