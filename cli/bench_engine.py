"""``bubblespec bench engine``: the built-in engine on the shipped model, measured side by side in one run.

(a) Hugging Face ``generate()`` against our engine without drafts, tokens/s at several batch sizes.
(b) Our engine verifying coupled drafts from one policy step older against the same engine without drafts:
    decode steps, tokens/s, acceptance length.

The older policy is the shipped model (pi_t). The verifying policy (pi_t+1) is that model after one
policy-gradient optimizer step on its own samples: a GRPO-style loss (group-normalised rewards of the task)
and one Adam step at ``learning_rate``. Drafts are pi_t's keyed samples for exactly the keys pi_t+1 then
generates, as bubble drafting produces them.

All timings of one row run in the same process, interleaved, with the median of ``repeats`` reported: the
ratios are what to read, absolute numbers depend on the machine.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from bubblespec.backends.torch_engine import TorchEngine
from bubblespec.interfaces import Draft, GenerationRequest, GenerationResult, SamplingParams, acceptance_length
from bubblespec.rollout import step_requests
from bubblespec.tasks.arithmetic import ArithmeticTask


@dataclass(frozen=True)
class EngineBenchSettings:
    threads: int = 1
    repeats: int = 3
    quick: bool = False
    batch_sizes: tuple[int, ...] = (1, 16, 64)
    learning_rate: float = 1e-4
    """Adam learning rate of the policy step between the drafting and the verifying policy: the quickstart's."""
    policy_step_prompts: int = 16
    policy_step_samples: int = 4
    max_draft_tokens_per_step: int = 16
    seed: int = 0


def run_engine_bench(settings: EngineBenchSettings) -> dict:
    torch.set_num_threads(settings.threads)
    task = ArithmeticTask(seed=settings.seed, prompts_per_step=max(settings.batch_sizes))
    batch_sizes = (1, 16) if settings.quick else settings.batch_sizes
    path = str(ArithmeticTask.model_path())
    old = TorchEngine.from_pretrained(path, max_draft_tokens_per_step=settings.max_draft_tokens_per_step)
    new = TorchEngine.from_pretrained(path, max_draft_tokens_per_step=settings.max_draft_tokens_per_step)
    new_state, policy_step = policy_gradient_step(old, task, settings)
    new.update_weights(new_state, version=1)

    report: dict = {
        "settings": {**settings.__dict__, "batch_sizes": list(batch_sizes), "dtype": "float32"},
        "policy_update": policy_step,
        "hf_generate_tokens_per_s": {},
        "engine_tokens_per_s": {},
        "engine_tokens_per_s_with_draft": {},
        "engine_vs_hf_generate": {},
        "speedup_with_draft": {},
        "forward_passes_no_draft": {},
        "forward_passes_with_draft": {},
    }
    hf_model = _hf_model(path)
    for batch_size in batch_sizes:
        # Batch size 1 runs several prompts one at a time: one response is too noisy a sample.
        requests = _requests(task, step=1, batch_size=max(batch_size, 1 if settings.quick else 8))
        drafts = _drafts(old, requests)
        hf_rate = _median_rate(settings.repeats, lambda r=requests, b=batch_size: _hf_generate(hf_model, task, r, b))
        plain_rate, _ = _rate_and_results(settings.repeats, old, requests, batch_size)
        new_plain_rate, plain = _rate_and_results(settings.repeats, new, requests, batch_size)
        draft_rate, speculative = _rate_and_results(settings.repeats, new, _attach(requests, drafts), batch_size)
        key = str(batch_size)
        report["hf_generate_tokens_per_s"][key] = hf_rate
        report["engine_tokens_per_s"][key] = plain_rate
        report["engine_vs_hf_generate"][key] = plain_rate / hf_rate
        report["engine_tokens_per_s_with_draft"][key] = draft_rate
        report["speedup_with_draft"][key] = draft_rate / new_plain_rate
        report["forward_passes_no_draft"][key] = plain["forward_passes"]
        report["forward_passes_with_draft"][key] = speculative["forward_passes"]
        if batch_size == 16:
            report |= _draft_summary(plain["results"], speculative["results"])
    report["float64_identical"], report["float32_mismatch_rate"] = _exactness(old, new, task)
    return report


def _requests(task: ArithmeticTask, step: int, batch_size: int, samples: int = 1) -> list[GenerationRequest]:
    params = SamplingParams(temperature=1.0, max_new_tokens=task.max_new_tokens)
    return step_requests(
        task.batch(step)[:batch_size], run_seed=0, step=step, samples_per_prompt=samples, sampling=params
    )


def _drafts(engine: TorchEngine, requests: list[GenerationRequest]) -> list[Draft]:
    results = engine.generate(requests)
    return [
        Draft(r.key, tuple(result.token_ids), engine.policy_version)
        for r, result in zip(requests, results, strict=True)
    ]


def _attach(requests: list[GenerationRequest], drafts: list[Draft]) -> list[GenerationRequest]:
    return [GenerationRequest(r.prompt_token_ids, r.key, r.sampling, d) for r, d in zip(requests, drafts, strict=True)]


def _chunks(requests: list[GenerationRequest], batch_size: int) -> list[list[GenerationRequest]]:
    return [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]


def _median_rate(repeats: int, run) -> float:
    """Median tokens/s of ``run()``, which returns the number of tokens it generated."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = run()
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def _rate_and_results(
    repeats: int, engine: TorchEngine, requests: list[GenerationRequest], batch_size: int
) -> tuple[float, dict]:
    """Median tokens/s of the engine on ``requests`` in batches of ``batch_size``, and the last run's results."""
    outcome: dict = {}

    def run() -> int:
        passes_before = engine.num_forward_passes
        results = [result for chunk in _chunks(requests, batch_size) for result in engine.generate(chunk)]
        outcome.update(results=results, forward_passes=engine.num_forward_passes - passes_before)
        return sum(len(r.token_ids) for r in results)

    return _median_rate(repeats, run), outcome


def _draft_summary(plain: list[GenerationResult], speculative: list[GenerationResult]) -> dict:
    steps_plain = sum(r.stats.decode_steps for r in plain)
    steps_draft = sum(r.stats.decode_steps for r in speculative)
    verify_steps = sum(r.stats.verify_steps for r in speculative)
    accepted = sum(r.stats.draft_tokens_accepted for r in speculative)
    proposed = sum(r.stats.draft_tokens_proposed for r in speculative)
    return {
        "decode_steps_no_draft": steps_plain,
        "decode_steps_with_draft": steps_draft,
        "decode_step_reduction": 1 - steps_draft / steps_plain,
        "acceptance_length_mean": acceptance_length(accepted, verify_steps),
        "draft_acceptance_rate": accepted / max(proposed, 1),
        "identical_with_and_without_draft_float32": [r.token_ids for r in plain] == [r.token_ids for r in speculative],
    }


def _exactness(old: TorchEngine, new: TorchEngine, task: ArithmeticTask) -> tuple[bool, float]:
    """float64: outputs with drafts identical to outputs without? float32: the share of responses that differ."""
    requests = _requests(task, step=1, batch_size=64)
    old64 = TorchEngine.from_pretrained(old.config.model_path, dtype="float64")
    new64 = TorchEngine.from_pretrained(new.config.model_path, dtype="float64")
    new64.update_weights(new.model.weights, version=1)
    drafts64 = _drafts(old64, requests)
    identical = [r.token_ids for r in new64.generate(requests)] == [
        r.token_ids for r in new64.generate(_attach(requests, drafts64))
    ]
    plain32 = new.generate(requests)
    speculative32 = new.generate(_attach(requests, _drafts(old, requests)))
    mismatched = sum(a.token_ids != b.token_ids for a, b in zip(plain32, speculative32, strict=True))
    return identical, mismatched / len(requests)


def policy_gradient_step(engine: TorchEngine, task: ArithmeticTask, settings: EngineBenchSettings) -> tuple[dict, dict]:
    """One GRPO-style policy-gradient step on the engine's own samples; returns the new weights and a summary.

    Loss: -mean over samples of advantage * (sum of token log-probs) / response tokens, with advantages the
    rewards normalised within each prompt's group. One Adam step at ``settings.learning_rate``.
    """
    from transformers import AutoModelForCausalLM

    requests = _requests(task, step=0, batch_size=settings.policy_step_prompts, samples=settings.policy_step_samples)
    results = engine.generate(requests)
    prompts = {p.uid: p for p in task.batch(0)}
    rewards = torch.tensor([task(prompts[r.key.prompt_uid], r.token_ids) for r in results])
    grouped = rewards.view(settings.policy_step_prompts, settings.policy_step_samples)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).flatten()

    model = AutoModelForCausalLM.from_pretrained(engine.config.model_path, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.learning_rate)
    losses = []
    for request, result, advantage in zip(requests, results, advantages.tolist(), strict=True):
        if advantage == 0 or not result.token_ids:
            continue
        sequence = torch.tensor([list(request.prompt_token_ids) + result.token_ids])
        logits = model(sequence).logits[0, len(request.prompt_token_ids) - 1 : -1]
        logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(result.token_ids)[:, None])
        losses.append(-advantage * logprobs.mean())
    if losses:
        (torch.stack(losses).sum() / len(requests)).backward()
        optimizer.step()
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    original = engine.model.weights
    relative_change = max(((state[n] - original[n]).norm() / original[n].norm()).item() for n in original if n in state)
    summary = {
        "method": "one Adam step of a GRPO-style policy-gradient loss on the drafting policy's own samples",
        "learning_rate": settings.learning_rate,
        "samples": len(requests),
        "mean_reward": rewards.mean().item(),
        "samples_with_nonzero_advantage": len(losses),
        "max_relative_weight_change": relative_change,
    }
    return state, summary


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def _hf_generate(model, task: ArithmeticTask, requests: list[GenerationRequest], batch_size: int) -> int:
    """Hugging Face generate() on the same prompts in batches of ``batch_size``; returns tokens up to each EOS."""
    return sum(_hf_generate_batch(model, task, chunk) for chunk in _chunks(requests, batch_size))


def _hf_generate_batch(model, task: ArithmeticTask, requests: list[GenerationRequest]) -> int:
    longest = max(len(r.prompt_token_ids) for r in requests)
    pad = task.pad_token_id
    input_ids = torch.tensor([[pad] * (longest - len(r.prompt_token_ids)) + list(r.prompt_token_ids) for r in requests])
    lengths = torch.tensor([len(r.prompt_token_ids) for r in requests])
    attention_mask = (torch.arange(longest)[None, :] >= (longest - lengths)[:, None]).long()
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=task.max_new_tokens,
        eos_token_id=task.eos_token_id,
        pad_token_id=pad,
    )
    generated = output[:, longest:]
    tokens = 0
    for row in generated.tolist():
        tokens += row.index(task.eos_token_id) + 1 if task.eos_token_id in row else len(row)
    return tokens


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    speed = Table(
        "batch",
        "HF generate tok/s",
        "engine tok/s",
        "engine / HF",
        "engine + drafts tok/s",
        "speedup with drafts",
        "forward passes (no draft -> draft)",
        title="Engine speed",
    )
    for key in report["engine_tokens_per_s"]:
        speed.add_row(
            key,
            f"{report['hf_generate_tokens_per_s'][key]:.0f}",
            f"{report['engine_tokens_per_s'][key]:.0f}",
            f"{report['engine_vs_hf_generate'][key]:.2f}x",
            f"{report['engine_tokens_per_s_with_draft'][key]:.0f}",
            f"{report['speedup_with_draft'][key]:.2f}x",
            f"{report['forward_passes_no_draft'][key]} -> {report['forward_passes_with_draft'][key]}",
        )
    console.print(speed)
    drafts = Table("measure", "value", title="Drafts from one policy step older (batch 16)")
    for name in (
        "decode_steps_no_draft",
        "decode_steps_with_draft",
        "decode_step_reduction",
        "acceptance_length_mean",
        "draft_acceptance_rate",
        "float64_identical",
        "float32_mismatch_rate",
    ):
        value = report.get(name)
        drafts.add_row(name, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(drafts)
    console.print(f"policy update: {report['policy_update']}")
