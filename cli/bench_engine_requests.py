"""What ``bubblespec bench engine`` runs: the requests, the policy step between drafting and verifying, and
Hugging Face ``generate`` on the same requests.

Requests. On the shipped model: the arithmetic task's prompts of step 1, responses up to the task's limit
(they end at EOS). On a model folder (``--model``): random prompts, token ids uniform over the vocabulary
without the EOS ids, lengths uniform in ``prompt_lengths`` (32-128 tokens unless told), responses up to
``max_new_tokens``; a random checkpoint almost never samples EOS, so responses run to the limit. Every request
samples at temperature 1 with no top-k / top-p and has its own rollout key.

With a run config (``--config``): its task's prompts of step 1 onwards, ``samples_per_prompt`` samples each, at the
config's sampling (temperature, top-k, top-p, suppressed tokens, the task's response limit), on its model.

The policy step from the drafting policy pi_t to the verifying policy pi_t+1:

- run config: one real GRPO step of the config's trainer (bubblespec's learner with its loss, optimizer and
  learning rate) on pi_t's own samples of the task's step 0 and their rewards, as a run's first update makes it
  (:func:`grpo_step`);
- shipped model: the same, with the run config of the arithmetic task on it (:func:`shipped_config`: the
  benchmark's seed, ``policy_step_prompts`` x ``policy_step_samples`` samples and learning rate);
- model folder: a random perturbation (:func:`perturbation`): a random model has no task to learn, and a
  policy-gradient step of a 0.5B model does not fit the benchmark's time on a CPU. Each weight tensor ``W``
  moves by ``noise * rms(W) * N(0, 1)`` per entry, so ``noise`` is the relative RMS change of every tensor.
  Random directions move the logits less per unit of weight change than a gradient step does: read the
  acceptance it gives (reported next to it), not the size, as the measure of drift.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from bubblespec.core.interfaces import Draft, GenerationRequest, GenerationResult, RolloutKey, SamplingParams

RANDOM_PROMPT_LENGTHS = (32, 128)
"""Prompt lengths of a model folder's requests, uniform in [low, high]: a chat turn or a short problem."""
RANDOM_MAX_NEW_TOKENS = 64
"""Response limit of a model folder's requests: a few minutes per row for a 0.5B model on two CPU cores."""


@dataclass(frozen=True)
class Workload:
    """The requests of a benchmark and what Hugging Face ``generate`` needs to run them too."""

    model_path: str
    requests: list[GenerationRequest]
    eos_token_id: int
    pad_token_id: int
    description: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ConfigRun:
    """A run config's task, built once for the whole benchmark (:meth:`close` it), its model folder and its
    sampling."""

    config: Any
    task: Any
    model_path: str
    sampling: SamplingParams

    @classmethod
    def of(cls, config) -> ConfigRun:
        from bubblespec.run.assembly import make_task, model_path, sampling_params

        task = make_task(config)
        try:
            path = model_path(config, task)
            return cls(config, task, path, sampling_params(config, task, path))
        except BaseException:
            task.close()
            raise

    def close(self) -> None:
        self.task.close()


def shipped_config(seed: int, num_prompts: int, num_samples: int, learning_rate: float):
    """The run config of the policy step on the shipped model: the arithmetic task with ``num_prompts`` prompts of
    ``num_samples`` samples a step, the default trainer at ``learning_rate``."""
    from bubblespec.core.config import RunConfig

    task = {"name": "arithmetic", "seed": seed, "prompts_per_step": num_prompts, "samples_per_prompt": num_samples}
    return RunConfig.model_validate(
        {"seed": seed, "task": task, "trainer": {"optimizer": {"learning_rate": learning_rate}}}
    )


def task_workload(num_requests: int, seed: int) -> Workload:
    """The shipped model on the arithmetic task's prompts of step 1 (one sample each)."""
    from bubblespec.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask(seed=seed, prompts_per_step=num_requests)
    requests = task_requests(task, step=1, num_prompts=num_requests)
    description = {"prompts": "arithmetic task, step 1", "max_new_tokens": task.max_new_tokens}
    return Workload(str(ArithmeticTask.model_path()), requests, task.eos_token_id, task.pad_token_id, description)


def task_requests(task, step: int, num_prompts: int, samples: int = 1) -> list[GenerationRequest]:
    from bubblespec.rollout.step import step_requests

    params = SamplingParams(
        temperature=1.0, max_new_tokens=task.max_new_tokens, suppressed_token_ids=tuple(task.suppressed_token_ids)
    )
    return step_requests(
        task.batch(step)[:num_prompts], run_seed=0, step=step, samples_per_prompt=samples, sampling=params
    )


def random_workload(
    model_path: str, num_requests: int, prompt_lengths: tuple[int, int], max_new_tokens: int, seed: int
) -> Workload:
    """Random prompts of lengths uniform in ``prompt_lengths`` over the model's vocabulary without EOS."""
    from bubblespec.core.model_folder import eos_token_ids
    from bubblespec.core.model_folder import vocab_size as folder_vocab_size

    vocab_size = folder_vocab_size(model_path)
    eos_ids = sorted(eos_token_ids(model_path))
    low, high = prompt_lengths
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (num_requests,), generator=generator).tolist()
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[eos_ids] = False
    choices = allowed.nonzero()[:, 0]
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    requests = []
    for index, length in enumerate(lengths):
        tokens = choices[torch.randint(len(choices), (length,), generator=generator)]
        key = RolloutKey(seed, 1, f"random-{index}", 0)
        requests.append(GenerationRequest(tuple(tokens.tolist()), key, params))
    description = {
        "prompts": f"random token ids, lengths uniform in [{low}, {high}]",
        "prompt_tokens_mean": sum(lengths) / len(lengths),
        "max_new_tokens": max_new_tokens,
        "vocab_size": vocab_size,
    }
    eos_id = eos_ids[0] if eos_ids else -1
    return Workload(model_path, requests, eos_id, max(eos_id, 0), description)


def config_workload(run: ConfigRun, num_requests: int) -> Workload:
    """A run config's task on its model: the prompts of step 1 (and later steps while more requests are needed),
    ``samples_per_prompt`` each, sampled as the run samples them."""
    from bubblespec.core.model_folder import eos_token_ids
    from bubblespec.rollout.step import step_requests

    config, sampling = run.config, run.sampling
    requests, step = [], 1
    while len(requests) < num_requests:
        requests += step_requests(run.task.batch(step), config.seed, step, config.task.samples_per_prompt, sampling)
        step += 1
    eos = sorted(set(sampling.stop_token_ids) | eos_token_ids(run.model_path))
    description = {
        "prompts": f"task {config.task.name!r}, steps 1-{step - 1}, {config.task.samples_per_prompt} samples each",
        "prompt_tokens_mean": sum(len(r.prompt_token_ids) for r in requests) / len(requests),
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "suppressed_token_ids": list(sampling.suppressed_token_ids),
    }
    return Workload(run.model_path, requests[:num_requests], eos[0] if eos else -1, eos[0] if eos else 0, description)


def grpo_step(run: ConfigRun, drafter) -> tuple[dict, dict]:
    """pi_t+1 from one GRPO step of the run config's trainer (:class:`bubblespec.rl.learner.GRPOLearner`: its loss,
    optimizer and learning rate) on the drafting policy's own samples of the task's step 0, ``samples_per_prompt``
    each, and their rewards: what a run's first update does. Returns the new weights by Hugging Face name and a
    summary of the step."""
    from bubblespec.rl.learner import LearnerSpec
    from bubblespec.rl.train_batch import train_samples
    from bubblespec.rollout.step import step_requests

    config = run.config
    prompts = run.task.batch(0)
    requests = step_requests(prompts, config.seed, 0, config.task.samples_per_prompt, run.sampling)
    results = drafter.generate(requests)
    by_uid = {prompt.uid: prompt for prompt in prompts}
    rewards = run.task.score([by_uid[r.key.prompt_uid] for r in requests], [r.token_ids for r in results])
    learner = LearnerSpec.of_run(config, run.model_path, run.sampling).build()
    before = {name: tensor.detach().clone() for name, tensor in learner.state_dict().items()}
    metrics = learner.step(train_samples(requests, results, rewards, config.task.samples_per_prompt), at_step=0)
    if metrics.get("skipped"):
        from bubblespec.core.errors import ConfigError

        raise ConfigError(
            f"the GRPO step had no reward signal: in each of step 0's {len(prompts)} groups every sample scored the "
            "same, so the policy did not change and the drafts would be its own; give the step more problems (--set "
            "task.prompts_per_step=N) or easier ones"
        )
    state = {name: tensor.detach().to(torch.float32) for name, tensor in learner.state_dict().items()}
    change = max(((state[n] - before[n].float()).norm() / before[n].float().norm()).item() for n in before)
    summary = {
        "method": "one GRPO step of the config's trainer on the drafting policy's own samples of the task's step 0",
        "learning_rate": config.trainer.optimizer.learning_rate,
        "samples": len(requests),
        "mean_reward": sum(rewards) / len(rewards),
        "loss": metrics.get("loss"),
        "grad_norm": metrics.get("grad_norm"),
        "max_relative_weight_change": change,
    }
    return state, summary


def with_drafts(requests: list[GenerationRequest], drafts: list[GenerationResult], version: int = 0):
    """The requests with the drafting policy's responses for the same keys attached as drafts."""
    return [
        GenerationRequest(r.prompt_token_ids, r.key, r.sampling, Draft(r.key, tuple(d.token_ids), version))
        for r, d in zip(requests, drafts, strict=True)
    ]


def perturbation(weights: dict[str, torch.Tensor], noise: float, seed: int) -> tuple[dict, dict]:
    """The next policy of a model folder: :func:`~bubblespec.testing.random_checkpoints.perturbed_weights`, and a
    summary of the step."""
    from bubblespec.testing.random_checkpoints import perturbed_weights

    summary = {
        "method": "random perturbation: every weight tensor W moves by noise * rms(W) * N(0, 1) per entry "
        "(a real-sized random model has no task to learn; a policy-gradient step does not fit the benchmark)",
        "relative_rms_change": noise,
        "seed": seed,
    }
    return perturbed_weights(weights, noise, seed), summary


def hf_model(path: str, dtype: str, device: str, state: dict[str, torch.Tensor]):
    """transformers' model of ``path`` holding ``state`` (the verifying policy), in ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.load_state_dict(state, strict=False)
    return model.to(device).eval()


@torch.inference_mode()
def hf_generate(model, workload: Workload, requests: list[GenerationRequest], batch_size: int) -> int:
    """Hugging Face ``generate`` (do_sample, temperature 1, no top-k / top-p, the requests' length limit) on the
    requests in batches of ``batch_size``, prompts left-padded; returns the tokens generated up to each EOS."""
    tokens = 0
    for start in range(0, len(requests), batch_size):
        tokens += _hf_generate_batch(model, workload, requests[start : start + batch_size])
    return tokens


def _hf_generate_batch(model, workload: Workload, requests: list[GenerationRequest]) -> int:
    longest = max(len(r.prompt_token_ids) for r in requests)
    pad, eos = workload.pad_token_id, workload.eos_token_id
    input_ids = torch.tensor([[pad] * (longest - len(r.prompt_token_ids)) + list(r.prompt_token_ids) for r in requests])
    lengths = torch.tensor([len(r.prompt_token_ids) for r in requests])
    attention_mask = (torch.arange(longest)[None, :] >= (longest - lengths)[:, None]).long()
    output = model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=attention_mask.to(model.device),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=requests[0].sampling.max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    tokens = 0
    for row in output[:, longest:].tolist():
        tokens += row.index(eos) + 1 if eos in row else len(row)
    return tokens
