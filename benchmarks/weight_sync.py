"""Weight sync on Ray: seconds to give every rank a new policy, by model size, rank count and node count.

    python benchmarks/weight_sync.py --ranks 1 2 4 8 --sizes-mb 128 512 --json weight-sync.json
    python benchmarks/weight_sync.py --ranks 2 4 8 --sizes-mb 512 --nodes 4   # ranks spread over 4 Ray nodes

Each configuration deploys the ranks as a run does (Ray Serve, the torch engine, bfloat16) on a random Qwen2-shaped
checkpoint (vocabulary 32,000, hidden 1,024, as many layers as the size asks), then times
``ServeRankPool.update_weights`` — the one path a run's weights take: one ``ray.put`` of the weights as byte
buffers (:class:`bubblespec.rollout.weights.PackedWeights`, in their own dtype) that every rank maps from its node's
object store, each rank loading them into its engine — ``--repeats`` times after one untimed sync, alternating with the
same sync of the plain state dict (Ray pickles its tensors one by one: what bubblespec sent before). With
``--nodes`` the ranks run on that many extra nodes of a local ``ray.cluster_utils.Cluster`` (the driver's node
holds none), so every sync crosses nodes through Ray's object manager. Prints a table; ``--json`` writes every
measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import load_file

import bubblespec.rollout.serve_ranks as serve_ranks_module
from bubblespec.core.config import ServiceConfig
from bubblespec.rollout.weights import PackedWeights
from bubblespec.run.assembly import engine_settings, load_backend
from bubblespec.run.ray_cluster import local_cluster, ray_session, serve_ranks
from bubblespec.testing.random_checkpoints import write_random_checkpoint

EMBEDDING_MB = 32_000 * 1024 * 2 / 1e6
LAYER_MB = (2 * 1024 * 1024 + 2 * 1024 * 128 + 3 * 1024 * 2816) * 2 / 1e6


def checkpoint(folder: Path, megabytes: float) -> Path:
    layers = max(1, round((megabytes - EMBEDDING_MB) / LAYER_MB))
    return write_random_checkpoint(
        folder, "qwen2", vocab_size=32_000, hidden_size=1024, num_layers=layers, num_heads=16, num_kv_heads=2,
        head_dim=64, intermediate_size=2816, dtype="bfloat16",
    )  # fmt: skip


class PickledWeights(dict):
    """The plain state dict, with the one method a rank calls on what it is sent."""

    def tensors(self) -> dict:
        return self

    @classmethod
    def pack(cls, state_dict) -> PickledWeights:
        return cls(state_dict)


def measure(path: Path, ranks: int, repeats: int) -> dict:
    config = ServiceConfig.model_validate(
        {"model": {"path": str(path), "dtype": "bfloat16"}, "rollout": {"num_ranks": ranks},
         "speculation": {"enabled": False}, "metrics": {"enabled": False}}
    )  # fmt: skip
    state = load_file(str(path / "model.safetensors"))
    gigabytes = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
    seconds: dict[str, list[float]] = {"packed": [], "pickled": []}
    backend = load_backend(config)
    with serve_ranks(config, str(path), backend, engine_settings(config, str(path))) as pool:
        nodes = len({where["node"] for where in pool.placement()})
        pool.update_weights(state, version=1)  # untimed: first calls warm Serve's handles
        for repeat in range(repeats):
            for form, packing in (("packed", PackedWeights), ("pickled", PickledWeights)):
                state = {name: tensor.clone() for name, tensor in state.items()}  # a new policy's tensors
                with mock.patch.object(serve_ranks_module, "PackedWeights", packing):
                    seconds[form].append(pool.update_weights(state, version=2 + 2 * repeat + (form == "pickled")))
    median = statistics.median(seconds["packed"])
    pickled = statistics.median(seconds["pickled"])
    return {"ranks": ranks, "nodes": nodes, "gigabytes": gigabytes, "seconds": seconds, "median_s": median,
            "s_per_gb": median / gigabytes, "delivered_gb_per_s": gigabytes * ranks / median,
            "pickled_median_s": pickled, "speedup_over_pickled": pickled / median}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[128, 512])
    parser.add_argument("--nodes", type=int, default=0, help="extra Ray nodes the ranks spread over (0: one Ray)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        paths = {mb: checkpoint(Path(folder) / f"{mb:g}mb", mb) for mb in args.sizes_mb}
        if args.nodes:
            per_node = math.ceil(max(args.ranks) / args.nodes)
            session = local_cluster([{"num_cpus": per_node} for _ in range(args.nodes)], head_cpus=0)
        else:
            session = ray_session(ServiceConfig(), num_cpus=max(args.ranks))
        with session:
            for mb, path in paths.items():
                for ranks in args.ranks:
                    start = time.perf_counter()
                    results.append(measure(path, ranks, args.repeats) | {"size_mb": mb})
                    print(f"  {ranks} ranks, {mb:g} MB: measured in {time.perf_counter() - start:.0f} s", flush=True)
    print("| model | ranks | nodes | s per sync | s per GB | GB delivered per s | state dict pickled: s | speedup |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        cells = [
            f"{r['gigabytes']:.2f} GB", r["ranks"], r["nodes"], f"{r['median_s']:.3f}", f"{r['s_per_gb']:.2f}",
            f"{r['delivered_gb_per_s']:.2f}", f"{r['pickled_median_s']:.3f}", f"{r['speedup_over_pickled']:.1f}x",
        ]  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
