"""Fits the ``cpu-tiny`` cost profile of the virtual clock (bubblespec/clocks.py) on this machine.

Times real forward passes of the built-in engine on the shipped model (1 torch thread) over a grid of batch
sizes, tokens per sequence and context lengths, and fits ``seconds = fixed + a * tokens + b * attention pairs``
by least squares; then times GRPO training steps and fits ``seconds = fixed + c * tokens``. Prints the
constants to put in ``_cpu_tiny()`` and how well the fit explains the measurements.

    python benchmarks/calibrate_cpu.py
"""

from __future__ import annotations

import statistics
import time

import torch

from bubblespec.backends.torch_engine import TorchEngine
from bubblespec.backends.torch_model import KVCache
from bubblespec.config import TrainerConfig
from bubblespec.tasks import ArithmeticTask
from bubblespec.trainer import GRPOLearner, TrainSample


def time_forward(engine: TorchEngine, batch: int, tokens: int, context: int, repeats: int = 7) -> float:
    cache = KVCache(engine.model_config, batch, context + tokens, engine.model.dtype, "cpu")
    token_ids = torch.randint(3, engine.vocab_size, (batch, tokens))
    positions = (context + torch.arange(tokens)).repeat(batch, 1)
    select = torch.arange(tokens).repeat(batch, 1)
    samples = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            engine.model.forward(token_ids, positions, cache, select)
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def fit(rows: list[list[float]], targets: list[float]) -> list[float]:
    solution = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64), torch.tensor(targets, dtype=torch.float64))
    return solution.solution.flatten().tolist()


def main() -> None:
    torch.set_num_threads(1)
    engine = TorchEngine.from_pretrained(str(ArithmeticTask.model_path()))
    rows, targets = [], []
    for batch in (1, 4, 16, 64):
        for tokens in (1, 8, 17, 33):
            for context in (16, 64, 160):
                seconds = time_forward(engine, batch, tokens, context)
                pairs = batch * (tokens * context + tokens * (tokens + 1) // 2)
                rows.append([1.0, batch * tokens, pairs])
                targets.append(seconds)
    fixed, per_token, per_pair = fit(rows, targets)
    predicted = [fixed + per_token * r[1] + per_pair * r[2] for r in rows]
    errors = [abs(p - t) / t for p, t in zip(predicted, targets, strict=True)]
    print(f"forward: fixed_s={fixed:.3e} flops_per_token={per_token:.3e} attention_flops_per_pair={per_pair:.3e}")
    print(f"  median relative error {statistics.median(errors):.1%}, max {max(errors):.1%} over {len(rows)} shapes")

    task = ArithmeticTask(seed=0, prompts_per_step=64)
    learner = GRPOLearner(str(ArithmeticTask.model_path()), "float32", TrainerConfig(), temperature=1.0)
    train_rows, train_targets = [], []
    for num_prompts in (4, 16, 32, 64):
        samples = [
            TrainSample(p.token_ids, tuple(task.reference_response_ids(p)), i // 2, float(i % 2))
            for i, p in enumerate(task.batch(0)[:num_prompts])
        ]
        start = time.perf_counter()
        metrics = learner.step(samples)
        train_rows.append([1.0, metrics["trained_tokens"]])
        train_targets.append(time.perf_counter() - start)
    train_fixed, train_per_token = fit(train_rows, train_targets)
    print(f"train: train_fixed_s={train_fixed:.3e} train_flops_per_token={train_per_token:.3e}")


if __name__ == "__main__":
    main()
