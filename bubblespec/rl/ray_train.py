"""The GRPO trainer on Ray Train: one long ``TorchTrainer.fit()`` fed one batch per RL step.

``fit()`` costs seconds to start, so it runs once, in a background thread, for the whole run. The controller
talks to the workers through a small channel actor: every worker receives each command and answers it, worker 0
with the result. Gradients are averaged across workers with ``torch.distributed`` (gloo on CPU, nccl on GPU)
inside the learner. Weights travel as byte buffers in the run's dtype (bfloat16 included;
:class:`bubblespec.rollout.weights.PackedWeights`): the controller gets read-only views of its copy.

Errors: an exception of a worker's command (a bad input, a bug, out of memory) is that command's answer, and the
controller raises it as one :class:`TrainerError` naming the worker, the exception and where it was raised. The
workers stay up; a step in which one worker failed is skipped by all (the learner agrees on it before the
gradient all-reduce), so none waits in a collective for the failed one.

Faults: when a worker dies, Ray Train restarts the whole worker group (``trainer.max_restarts`` times). The new
workers join the channel, which drops what was queued for the old ones and tells the controller; the
controller's next call then raises :class:`TrainerRestarted`, and the controller rewinds the run to its last
checkpoint (the new workers hold the initial model until they are given that checkpoint's state). A collective
that fails because a peer died ends the surviving worker too, so that a death is always a restart. Commands
carry a sequence number, so an answer meant for an earlier command is never taken for the answer to a later one.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import threading
import time
import traceback
from pathlib import Path

import ray
import torch

from bubblespec.core import fault_gates
from bubblespec.core.errors import BubblespecError, TrainerError, TrainerRestarted
from bubblespec.rl.learner import GRPOLearner, LearnerSpec, PeerFailed, TrainSample
from bubblespec.rollout.weights import PackedWeights

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class TrainerChannel:
    """Commands to every worker, their answers ``(number, rank, status, payload)`` with status "ok", "error" or
    "peer_failed", and word of each (re)start of the worker group."""

    def __init__(self, num_workers: int) -> None:
        self.inboxes = [asyncio.Queue() for _ in range(num_workers)]
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.joined: set[int] = set()
        self.starts = 0
        self.placement: dict[int, dict] = {}

    async def where(self) -> list[dict]:
        """Each worker's node and GPUs, as it said when it last joined."""
        return [self.placement[rank] for rank in sorted(self.placement)]

    async def join(self, rank: int, where: dict) -> None:
        """A (new) worker starts (``where``: its node and GPUs): what was queued for its predecessor is dropped.
        Once the whole group has joined, the controller hears ("started", number of starts so far), ahead of any
        stale answer."""
        self.inboxes[rank] = asyncio.Queue()
        self.placement[rank] = where
        self.joined.add(rank)
        if len(self.joined) == len(self.inboxes):
            self.joined.clear()
            self.starts += 1
            self.outbox = asyncio.Queue()
            self.outbox.put_nowait((None, None, "started", self.starts))

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


class PeerLost(Exception):
    """A collective failed: a peer died. Not answered; it ends this worker so that Ray Train restarts the group."""


def train_loop(loop_config: dict) -> None:
    """Runs in every Ray Train worker until told to stop."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    channel = loop_config["channel"]

    all_reduce = group_all_reduce(dist.all_reduce, rank, loop_config["learner"].trainer.device)
    worker = _Worker(loop_config, rank, world, all_reduce if world > 1 else None)
    runtime = ray.get_runtime_context()
    where = {"node": runtime.get_node_id(), "gpus": [str(g) for g in runtime.get_accelerator_ids().get("GPU", [])]}
    ray.get(channel.join.remote(rank, where))
    while True:
        number, kind, payload = ray.get(channel.receive.remote(rank))
        if kind == "stop":
            return
        fault_gates.reached(f"trainer worker {rank} {kind}")  # a testing seam: returns at once unless a test armed it
        try:
            answer = ("ok", worker.run(kind, payload))
        except PeerLost:
            raise
        except PeerFailed:
            answer = ("peer_failed", None)
        except Exception as error:
            answer = ("error", describe_failure(f"trainer worker {rank}", error))
        ray.get(channel.reply.remote((number, rank, *answer)))


def group_all_reduce(reduce, rank: int, device_type: str):
    """The learner's ``all_reduce(tensor, op)`` over ``reduce`` (``torch.distributed.all_reduce`` of the worker
    group), whose tensors must be on ``device_type``: NCCL takes CUDA tensors only. A tensor elsewhere is a bug
    of this worker, answered as its error (every worker makes it alike); a collective that fails is a lost peer."""
    import torch.distributed as dist

    def all_reduce(tensor: torch.Tensor, op: str = "sum") -> None:
        if tensor.device.type != device_type:
            raise TypeError(
                f"trainer worker {rank}: a {tensor.device.type} tensor was given to an all-reduce of the worker "
                f"group, which exchanges {device_type} tensors only (trainer.device {device_type!r})"
            )
        try:
            reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        except Exception as error:
            raise PeerLost(f"trainer worker {rank}: an all-reduce failed: {error}") from error

    return all_reduce


class _Worker:
    """One worker's learner and its answers to the controller's commands."""

    def __init__(self, loop_config: dict, rank: int, world: int, all_reduce) -> None:
        self.loop_config, self.rank, self.world, self.all_reduce = loop_config, rank, world, all_reduce
        self.learner: GRPOLearner | None = None
        self.failure: Exception | None = None
        try:
            self.learner = self._new_learner()
        except Exception as error:  # answered to the first command, as its error
            self.failure = error

    def _new_learner(self) -> GRPOLearner:
        return self.loop_config["learner"].build(all_reduce=self.all_reduce)

    def run(self, kind: str, payload):
        """The answer to one command: "train" (metrics and new weights), "checkpoint" (the learner's
        checkpoint state), "load" (a checkpoint's state) or "reset" (initial weights of a new learner). Only
        worker 0 answers with weights or state; the others answer None once done."""
        if kind == "reset":
            self.learner = None
            try:
                self.learner = self._new_learner()
            except Exception as error:
                self.failure = error
                raise
            return self._weights_from_worker_0()
        if self.learner is None:
            raise self.failure
        if kind == "train":
            step, samples = payload
            metrics = self.learner.step(samples, rank=self.rank, world=self.world, at_step=step)
            return metrics, self._weights_from_worker_0()
        if kind == "checkpoint":
            return self._from_worker_0(self.learner.checkpoint_state)
        if kind == "load":
            return self.learner.load_checkpoint_state(payload)
        raise ValueError(f"unknown trainer command {kind!r}; known: train, checkpoint, load, reset, stop")

    def _from_worker_0(self, make):
        """``make()`` with its tensors on the CPU (a CUDA trainer's answer must load anywhere), on worker 0."""
        return _on_cpu(make()) if self.rank == 0 else None

    def _weights_from_worker_0(self) -> PackedWeights | None:
        """The learner's weights as byte buffers (copied, not pickled tensor by tensor, on their way to the
        controller), on worker 0."""
        return PackedWeights.pack(self.learner.state_dict()) if self.rank == 0 else None


def describe_failure(who: str, error: BaseException) -> tuple[str, str]:
    """``"<who>: <Type>: <message> (at <file>:<line>, in <function>)"`` with the innermost frame of bubblespec's
    own code (else the innermost frame), and the whole traceback as text."""
    # The folders of the packages bubblespec ships (found without importing backends or policies).
    ours = tuple(
        str(Path(folder))
        for package in ("bubblespec", "bubblespec.backends", "bubblespec.policies")
        for folder in importlib.util.find_spec(package).submodule_search_locations
    )
    frames = traceback.extract_tb(error.__traceback__)
    own = [frame for frame in frames if frame.filename.startswith(ours)]
    frame = (own or frames or [None])[-1]
    where = f" (at {Path(frame.filename).name}:{frame.lineno}, in {frame.name})" if frame else ""
    return f"{who}: {type(error).__name__}: {error}{where}", "".join(traceback.format_exception(error))


def _on_cpu(value):
    """``value`` with every tensor in it moved to the CPU (a CUDA trainer's answer must load anywhere)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _on_cpu(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_on_cpu(item) for item in value)
    return value


class RayTrainer:
    """The controller's side: sends each step's samples, waits for the new weights."""

    def __init__(
        self,
        spec: LearnerSpec,
        storage: Path,
        cpus_per_worker: float,
        gpus_per_worker: float = 0.0,
        nodes: dict[str, str] | None = None,
    ) -> None:
        """Workers reserve ``cpus_per_worker`` CPUs and ``gpus_per_worker`` GPUs each, on nodes whose labels match
        ``nodes`` (a Ray label selector; empty: any node)."""
        from ray.train import FailureConfig, ScalingConfig
        from ray.train import RunConfig as RayRunConfig
        from ray.train.torch import TorchConfig, TorchTrainer
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        config = spec.trainer
        self.num_workers = config.num_workers
        # The channel lives on the driver's node: it goes down with the run only, never with a trainer node.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.channel = TrainerChannel.options(scheduling_strategy=here).remote(self.num_workers)
        resources = {"CPU": cpus_per_worker} | ({"GPU": gpus_per_worker} if gpus_per_worker else {})
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"channel": self.channel, "learner": spec},
            torch_config=TorchConfig(backend="nccl" if config.device == "cuda" else "gloo"),
            scaling_config=ScalingConfig(
                num_workers=self.num_workers,
                use_gpu=bool(gpus_per_worker),
                resources_per_worker=resources,
                label_selector=dict(nodes) if nodes else None,
            ),
            run_config=RayRunConfig(
                name="trainer",
                storage_path=str(storage.resolve()),
                failure_config=FailureConfig(max_failures=config.max_restarts),
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

    def train(self, samples: list[TrainSample], step: int | None = None) -> tuple[dict, dict, float]:
        start = time.perf_counter()
        metrics, weights = self._call("train", (step, samples))
        return metrics, weights.tensors(), time.perf_counter() - start

    def checkpoint_state(self) -> dict:
        return self._call("checkpoint")

    def load_checkpoint_state(self, state: dict) -> None:
        self._call("load", state)

    def reset(self) -> dict:
        """Back to the initial model and a fresh optimizer on every worker; returns the initial weights."""
        return self._call("reset").tensors()

    def placement(self) -> list[dict]:
        """Each worker's Ray node and GPUs (after the first command: the workers have joined)."""
        return ray.get(self.channel.where.remote())

    def close(self) -> None:
        if self._thread.is_alive():
            ray.get(self.channel.send.remote((None, "stop", None)))
            self._thread.join(timeout=60)

    def _call(self, kind: str, payload=None):
        """Sends a command to every worker and returns worker 0's answer once every worker answered. Raises
        :class:`TrainerError` with the first worker error, and :class:`TrainerRestarted` when the worker group
        restarted since the last call (the command may have been lost with the old workers)."""
        if self._starts == 0:
            self._await(None)  # commands sent before the workers join would be dropped by their joining
        self._sent += 1
        ray.get(self.channel.send.remote((self._sent, kind, payload)))
        return self._await(self._sent)

    def _await(self, number: int | None):
        answered: dict[int, str] = {}
        result = None
        while True:
            answer = ray.get(self.channel.answer.remote(0.5))
            if answer is None:
                if not self._thread.is_alive():
                    raise BubblespecError(f"the Ray Train trainer stopped: {self._fit_error!r}")
                continue
            got, rank, status, payload = answer
            if status == "started":
                restarted = self._starts > 0
                self._starts = payload
                if restarted:
                    raise TrainerRestarted(f"Ray Train restarted the trainer's workers (start {payload})")
                if number is None:
                    return None
                continue
            if got != number:
                continue  # the answer to a command of an earlier start, sent before this one's workers joined
            if status == "error":
                message, worker_traceback = payload
                logger.debug("%s\n%s", message, worker_traceback)
                raise TrainerError(message, worker_traceback)
            answered[rank] = status
            result = payload if rank == 0 else result
            if len(answered) == self.num_workers:
                if "peer_failed" in answered.values():  # cannot happen: a failed worker answers with its error
                    raise TrainerError(f"trainer workers {sorted(answered)} answered that a peer failed, none why")
                return result
