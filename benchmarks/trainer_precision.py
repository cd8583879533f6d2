"""bfloat16 training: the learner's bfloat16 copy of float32 master weights against torch.autocast.

For one GRPO batch sampled by the bfloat16 torch engine from a random checkpoint, each way of running the
forward and backward pass in bfloat16 is compared with the float32 learner (relative L2 error of the gradient,
error of the response tokens' log-probabilities) and with the engine that sampled the tokens (error of the
log-probabilities it reported), with its seconds per optimizer step. The bfloat16 copy is what
:class:`GRPOLearner` does; autocast runs a float32 learner under ``torch.autocast(dtype=torch.bfloat16)``.

    python benchmarks/trainer_precision.py --vocab 32000 --hidden 256 --layers 4 --batch 8 --length 128
"""

from __future__ import annotations

import argparse
import contextlib
import random
import tempfile
import time
from pathlib import Path

import torch

from bubblespec.core.config import TrainerConfig
from bubblespec.rl.learner import GRPOLearner, TrainSample, group_advantages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128, help="most response tokens per sample")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        path = _random_llama(Path(folder), args.vocab, args.hidden, args.layers)
        samples, engine_logprobs = _engine_samples(str(path), args.vocab, args.batch, args.length)
        advantages = group_advantages(samples)
        reference = GRPOLearner(str(path), "float32", TrainerConfig(), temperature=1.0)
        gradient, logprobs, seconds = _measure(reference, samples, advantages, args.repeats, autocast=False)
        print(f"{'float32':<17} {seconds:8.3f} s/step  |d logprob| vs engine {_mean_max(logprobs, engine_logprobs)}")
        ways = [("bfloat16 copy", "bfloat16", False), ("float32 autocast", "float32", True)]
        for name, dtype, autocast in ways:
            learner = GRPOLearner(str(path), dtype, TrainerConfig(), temperature=1.0)
            other_gradient, other_logprobs, seconds = _measure(learner, samples, advantages, args.repeats, autocast)
            error = float((other_gradient - gradient).norm() / gradient.norm())
            print(
                f"{name:<17} {seconds:8.3f} s/step  |d logprob| vs engine {_mean_max(other_logprobs, engine_logprobs)}"
                f"  vs float32 {_mean_max(other_logprobs, logprobs)}  gradient rel. error vs float32 {error:.4f}"
            )


def _engine_samples(path: str, vocab_size: int, batch: int, length: int):
    """``batch`` responses of up to ``length`` tokens to random prompts, sampled by the bfloat16 torch engine
    (temperature 1), in groups of 4 with random rewards; and the log-probabilities the engine reported."""
    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.core.interfaces import Prompt, SamplingParams
    from bubblespec.rollout.step import step_requests

    rng = random.Random(0)
    prompts = [Prompt(f"p{i}", tuple(rng.randrange(3, vocab_size) for _ in range(16)), "", "") for i in range(batch)]
    requests = step_requests(prompts, 0, 0, 1, SamplingParams(temperature=1.0, max_new_tokens=length))
    results = TorchEngine.from_pretrained(path, dtype="bfloat16").generate(requests)
    samples = [
        TrainSample(tuple(request.prompt_token_ids), tuple(result.token_ids), group=i // 4, reward=rng.random())
        for i, (request, result) in enumerate(zip(requests, results, strict=True))
    ]
    return samples, torch.tensor([p for result in results for p in result.logprobs], dtype=torch.float32)


def _mean_max(a: torch.Tensor, b: torch.Tensor) -> str:
    difference = (a - b).abs()
    return f"mean {float(difference.mean()):.4f} max {float(difference.max()):.4f}"


def _random_llama(folder: Path, vocab_size: int, hidden_size: int, num_layers: int) -> Path:
    """A randomly initialised Llama (transformers' own initialisation, seed 0) saved with ``save_pretrained``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=max(hidden_size // 128, 1),
        max_position_embeddings=4096,
    )
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def _measure(learner: GRPOLearner, samples, advantages, repeats: int, autocast: bool):
    """The first step's gradient (flattened) and response log-probabilities; the median seconds per step."""
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        logprobs = torch.cat(learner.response_logprobs(samples)).float()
    times = []
    gradient = None
    for _ in range(repeats):
        start = time.perf_counter()
        with context:
            learner.compute_gradients(samples, advantages)
        if gradient is None:
            gradient = torch.cat([p.grad.flatten().float() for p in learner.parameters])
        learner.apply_gradients()
        times.append(time.perf_counter() - start)
    return gradient, logprobs, sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
