"""Data-parallel learners in threads of this process, exchanging over real gloo process groups.

The group stands in for a GPU cluster's NCCL group. NCCL takes only tensors on the learner's device (CUDA), and a
tensor that the learner creates without naming a device lands on the CPU, where NCCL refuses it ("No backend type
associated with device type cpu"). On this CPU-only machine the learner's device is the CPU, so the workers run
their steps with torch's *default* device set to "meta": a tensor created without a device lands on meta, and gloo
refuses it ("unsupported device type meta") just as NCCL refuses the CPU one. A learner passes only where every
tensor it exchanges is on its own device, as on a GPU.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from bubblespec.rl.ray_train import group_all_reduce


def run_workers(world: int, build: Callable, work: Callable, timeout_s: float = 120.0) -> list:
    """``build(rank, all_reduce)`` -> a learner, then ``work(rank, learner)`` with the default device "meta", in a
    thread per worker; returns each worker's result by rank, or raises the first exception a worker raised."""
    store = dist.HashStore()
    results: dict = {}

    def worker(rank: int) -> None:
        group = dist.ProcessGroupGloo(
            dist.PrefixStore("workers", store), rank, world, datetime.timedelta(seconds=timeout_s)
        )

        def reduce(tensor, op):
            options = dist.AllreduceOptions()
            options.reduceOp = op
            group.allreduce([tensor], options).wait()

        try:
            learner = build(rank, group_all_reduce(reduce, rank, "cpu"))
            with torch.device("meta"):  # where a tensor created without a device goes: not the learner's device
                results[rank] = work(rank, learner)
        except Exception as error:  # the caller checks what each worker raised
            results[rank] = error

    threads = [threading.Thread(target=worker, args=(rank,), daemon=True) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s)
    assert not any(thread.is_alive() for thread in threads), "a worker hangs in a collective"
    for rank in range(world):
        if isinstance(results[rank], Exception):
            raise results[rank]
    return [results[rank] for rank in range(world)]
