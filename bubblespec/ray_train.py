"""The GRPO trainer on Ray Train: one long ``TorchTrainer.fit()`` fed one batch per RL step.

``fit()`` costs seconds to start, so it runs once, in a background thread, for the whole run. The controller
talks to the workers through a small channel actor: every worker receives each command; worker 0 answers.
Gradients are averaged across workers with ``torch.distributed`` (gloo on CPU, nccl on GPU) inside the learner.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import ray
import torch

from bubblespec.config import RunConfig
from bubblespec.errors import BubblespecError
from bubblespec.trainer import GRPOLearner, TrainSample, group_advantages


@ray.remote(num_cpus=0)
class TrainerChannel:
    """Commands to every worker, answers from worker 0."""

    def __init__(self, num_workers: int) -> None:
        self.inboxes = [asyncio.Queue() for _ in range(num_workers)]
        self.outbox: asyncio.Queue = asyncio.Queue()

    async def send(self, message) -> None:
        for inbox in self.inboxes:
            inbox.put_nowait(message)

    async def receive(self, rank: int):
        return await self.inboxes[rank].get()

    async def reply(self, answer) -> None:
        self.outbox.put_nowait(answer)

    async def answer(self, timeout_s: float):
        try:
            return await asyncio.wait_for(self.outbox.get(), timeout_s)
        except TimeoutError:
            return None


def train_loop(loop_config: dict) -> None:
    """Runs in every Ray Train worker until told to stop."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    channel = loop_config["channel"]

    def all_reduce(tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    learner = GRPOLearner(
        loop_config["model_path"],
        loop_config["dtype"],
        loop_config["trainer"],
        loop_config["temperature"],
        all_reduce=all_reduce if world > 1 else None,
    )
    while True:
        kind, payload = ray.get(channel.receive.remote(rank))
        if kind == "stop":
            return
        if kind == "train":
            samples, advantages = payload
            metrics = learner.step(
                samples[rank::world],
                advantages[rank::world],
                num_samples_total=len(samples),
                has_signal=any(advantages),
            )
            if rank == 0:
                weights = {name: t.cpu().numpy() for name, t in learner.state_dict().items()}
                ray.get(channel.reply.remote(("weights", (metrics, weights))))
        elif kind == "checkpoint" and rank == 0:
            ray.get(channel.reply.remote(("checkpoint", {"optimizer": learner.optimizer.state_dict()})))
        elif kind == "load":
            learner.load_checkpoint_state(payload)
            if rank == 0:
                ray.get(channel.reply.remote(("loaded", None)))


class RayTrainer:
    """The controller's side: sends each step's samples, waits for the new weights."""

    def __init__(self, config: RunConfig, model_path: str, storage: Path, cpus_per_worker: float) -> None:
        from ray.train import RunConfig as RayRunConfig
        from ray.train import ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        workers = config.trainer.num_workers
        self.channel = TrainerChannel.remote(workers)
        use_gpu = config.trainer.device == "cuda"
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={
                "channel": self.channel,
                "model_path": model_path,
                "dtype": config.model.dtype,
                "trainer": config.trainer,
                "temperature": config.rollout.sampling.temperature,
            },
            torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
            scaling_config=ScalingConfig(
                num_workers=workers, use_gpu=use_gpu, resources_per_worker={"CPU": cpus_per_worker}
            ),
            run_config=RayRunConfig(name="trainer", storage_path=str(storage.resolve())),
        )
        self._fit_error: BaseException | None = None
        self._thread = threading.Thread(target=self._fit, args=(trainer,), daemon=True, name="ray-train-fit")
        self._thread.start()

    def _fit(self, trainer) -> None:
        try:
            trainer.fit()
        except BaseException as error:  # reported to the controller by _wait
            self._fit_error = error

    def train(self, samples: list[TrainSample]) -> tuple[dict, dict, float]:
        start = time.perf_counter()
        ray.get(self.channel.send.remote(("train", (samples, group_advantages(samples)))))
        metrics, weights = self._wait("weights")
        state = {name: torch.from_numpy(array.copy()) for name, array in weights.items()}
        return metrics, state, time.perf_counter() - start

    def checkpoint_state(self) -> dict:
        ray.get(self.channel.send.remote(("checkpoint", None)))
        return self._wait("checkpoint")

    def load_checkpoint_state(self, state: dict) -> None:
        ray.get(self.channel.send.remote(("load", state)))
        self._wait("loaded")

    def close(self) -> None:
        if self._thread.is_alive():
            ray.get(self.channel.send.remote(("stop", None)))
            self._thread.join(timeout=60)

    def _wait(self, kind: str):
        while True:
            answer = ray.get(self.channel.answer.remote(0.5))
            if answer is not None:
                got, payload = answer
                assert got == kind, f"trainer answered {got!r} to a {kind!r} request"
                return payload
            if not self._thread.is_alive():
                raise BubblespecError(f"the Ray Train trainer stopped: {self._fit_error!r}")
