"""The GRPO trainer on Ray Train: one long ``TorchTrainer.fit()`` fed one batch per RL step.

``fit()`` costs seconds to start, so it runs once, in a background thread, for the whole run. The controller
talks to the workers through a small channel actor: every worker receives each command; worker 0 answers.
Gradients are averaged across workers with ``torch.distributed`` (gloo on CPU, nccl on GPU) inside the learner.

Faults: when a worker dies, Ray Train restarts the whole worker group (``trainer.max_restarts`` times). The new
workers join the channel, which drops what was queued for the old ones and tells the controller; the
controller's next call then raises :class:`TrainerRestarted`, and the controller rewinds the run to its last
checkpoint (the new workers hold the initial model until they are given that checkpoint's state). Commands carry
a sequence number, so an answer meant for an earlier command is never taken for the answer to a later one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import ray
import torch

from bubblespec.config import RunConfig
from bubblespec.errors import BubblespecError, TrainerRestarted
from bubblespec.trainer import GRPOLearner, TrainSample, group_advantages


@ray.remote(num_cpus=0)
class TrainerChannel:
    """Commands to every worker, answers from worker 0, and word of each (re)start of the worker group."""

    def __init__(self, num_workers: int) -> None:
        self.inboxes = [asyncio.Queue() for _ in range(num_workers)]
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.joined: set[int] = set()
        self.starts = 0

    async def join(self, rank: int) -> None:
        """A (new) worker starts: what was queued for its predecessor is dropped. Once the whole group has
        joined, the controller hears ("started", number of starts so far), ahead of any stale answer."""
        self.inboxes[rank] = asyncio.Queue()
        self.joined.add(rank)
        if len(self.joined) == len(self.inboxes):
            self.joined.clear()
            self.starts += 1
            self.outbox = asyncio.Queue()
            self.outbox.put_nowait((None, "started", self.starts))

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

    def new_learner() -> GRPOLearner:
        return GRPOLearner(
            loop_config["model_path"],
            loop_config["dtype"],
            loop_config["trainer"],
            loop_config["temperature"],
            all_reduce=all_reduce if world > 1 else None,
        )

    learner = new_learner()
    ray.get(channel.join.remote(rank))
    while True:
        number, kind, payload = ray.get(channel.receive.remote(rank))
        if kind == "stop":
            return
        answer = None
        if kind == "train":
            samples, advantages = payload
            metrics = learner.step(
                samples[rank::world],
                advantages[rank::world],
                num_samples_total=len(samples),
                has_signal=any(advantages),
            )
            answer = (metrics, _numpy(learner.state_dict()))
        elif kind == "checkpoint":
            answer = {"optimizer": learner.optimizer.state_dict()}
        elif kind == "load":
            learner.load_checkpoint_state(payload)
        elif kind == "reset":
            learner = new_learner()
            answer = _numpy(learner.state_dict())
        if rank == 0:
            ray.get(channel.reply.remote((number, kind, answer)))


def _numpy(state: dict) -> dict:
    return {name: t.cpu().numpy() for name, t in state.items()}


class RayTrainer:
    """The controller's side: sends each step's samples, waits for the new weights."""

    def __init__(self, config: RunConfig, model_path: str, storage: Path, cpus_per_worker: float) -> None:
        from ray.train import FailureConfig, ScalingConfig
        from ray.train import RunConfig as RayRunConfig
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
            run_config=RayRunConfig(
                name="trainer",
                storage_path=str(storage.resolve()),
                failure_config=FailureConfig(max_failures=config.trainer.max_restarts),
            ),
        )
        self._sent = 0  # sequence number of the last command
        self._starts = 0  # starts of the worker group seen so far
        self._fit_error: BaseException | None = None
        self._thread = threading.Thread(target=self._fit, args=(trainer,), daemon=True, name="ray-train-fit")
        self._thread.start()

    def _fit(self, trainer) -> None:
        try:
            trainer.fit()
        except BaseException as error:  # reported to the controller by _call
            self._fit_error = error

    def train(self, samples: list[TrainSample]) -> tuple[dict, dict, float]:
        start = time.perf_counter()
        metrics, weights = self._call("train", (samples, group_advantages(samples)))
        return metrics, _tensors(weights), time.perf_counter() - start

    def checkpoint_state(self) -> dict:
        return self._call("checkpoint")

    def load_checkpoint_state(self, state: dict) -> None:
        self._call("load", state)

    def reset(self) -> dict:
        """Back to the initial model and a fresh optimizer on every worker; returns the initial weights."""
        return _tensors(self._call("reset"))

    def close(self) -> None:
        if self._thread.is_alive():
            ray.get(self.channel.send.remote((None, "stop", None)))
            self._thread.join(timeout=60)

    def _call(self, kind: str, payload=None):
        """Sends a command to every worker and returns worker 0's answer. Raises :class:`TrainerRestarted` when
        the worker group restarted since the last call (the command may have been lost with the old workers)."""
        if self._starts == 0:
            self._await(None)  # commands sent before the workers join would be dropped by their joining
        self._sent += 1
        ray.get(self.channel.send.remote((self._sent, kind, payload)))
        return self._await(self._sent)

    def _await(self, number: int | None):
        while True:
            answer = ray.get(self.channel.answer.remote(0.5))
            if answer is None:
                if not self._thread.is_alive():
                    raise BubblespecError(f"the Ray Train trainer stopped: {self._fit_error!r}")
                continue
            got, kind, payload = answer
            if kind == "started":
                restarted = self._starts > 0
                self._starts = payload
                if restarted:
                    raise TrainerRestarted(f"Ray Train restarted the trainer's workers (start {payload})")
                if number is None:
                    return None
            elif got == number:
                return payload
            # else: the answer to a command of an earlier start, sent before this one's workers joined


def _tensors(arrays: dict) -> dict:
    return {name: torch.from_numpy(array.copy()) for name, array in arrays.items()}
