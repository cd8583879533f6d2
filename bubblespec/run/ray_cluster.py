"""The wall-clock run on Ray: a local Ray (or the configured cluster), rank deployments on Ray Serve, the trainer
on Ray Train, and everything torn down again at the end."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from bubblespec.core.config import RunConfig
from bubblespec.core.errors import BubblespecError, ConfigError

if TYPE_CHECKING:
    from bubblespec.rollout.serve_ranks import ServeRankPool

logger = logging.getLogger(__name__)

RAY_DEFAULTS = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    # Ray Train's defaults are tuned for long jobs; a shorter health check makes start and stop snappy.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}


@contextlib.contextmanager
def ray_session(config: RunConfig, num_cpus: int | None = None) -> Iterator[bool]:
    """Connects to ``ray.address`` (or the ``RAY_ADDRESS`` environment variable, as ``ray job submit`` sets it) or
    starts a local Ray of this run's own (yielding True), even where another Ray runs on the machine: joining one
    takes ``ray.address: auto`` or its address. Stops what it started."""
    for name, value in RAY_DEFAULTS.items():
        os.environ.setdefault(name, value)
    import ray

    if ray.is_initialized():  # e.g. a test's session-wide cluster: use it, leave it running
        yield False
        return
    address = config.ray.address or os.environ.get("RAY_ADDRESS") or None
    if address:
        check_reachable(address)
    try:
        with sigterm_left_to_the_driver():
            if address:
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
            else:  # "local": a Ray of this run's own, even where another cluster runs on the machine
                _start_local_ray(num_cpus)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as error:
        where = f"the Ray at {address}" if address else "a local Ray"
        raise BubblespecError(f"cannot start or reach {where} (ray.address): {error}") from None
    try:
        yield not address  # True when this run started (and so owns) the Ray instance
    finally:
        ray.shutdown()


NODE_START_TIMED_OUT = ("timed out during startup", "Timed out waiting for file")
"""Ray's errors where a new node did not register with its GCS within Ray's fixed 30 s, or its GCS did not write its
port file in time (``ray._private.node``): both a busy machine's."""


def _start_local_ray(num_cpus: int | None) -> None:
    """``ray.init`` of a local Ray; once more where its node did not register within Ray's fixed 30 s, as on a
    machine whose cores are busy, after stopping the processes the first attempt started (with psutil, where it is
    installed; otherwise Ray's reaper stops them when this process ends)."""
    import ray

    for attempt in (1, 2):
        before = _child_processes()
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
            return
        except Exception as error:  # Ray raises a bare Exception for a node that did not register
            if attempt == 2 or not any(timed_out in str(error) for timed_out in NODE_START_TIMED_OUT):
                raise
            logger.warning("the local Ray's node did not register within Ray's 30 s (a busy machine?): starting again")
            ray.shutdown()
            _stop_new_children(before)


def _child_processes() -> set[int] | None:
    try:
        import psutil
    except ImportError:
        return None
    return {child.pid for child in psutil.Process().children(recursive=True)}


def _stop_new_children(before: set[int] | None) -> None:
    """Kills the descendants of this process that were not there ``before`` (a failed Ray start's processes)."""
    if before is None:
        return
    import psutil

    started = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
    for child in started:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(started, timeout=30)


@contextlib.contextmanager
def sigterm_left_to_the_driver() -> Iterator[None]:
    """Around ``ray.init``, where this process handles SIGTERM itself (``bubblespec run`` stops the run as on Ctrl-C):
    Ray installs a native SIGTERM handler in the driver (a stack dump, then abort), and this process's handler is
    put back after; and a local Ray's processes, which inherit the signal mask, start with SIGTERM blocked, so that
    a SIGTERM sent to the whole job (SLURM signals every process of a job step, ``kill -- -PGID`` a process group)
    does not kill them under the run (they block SIGINT themselves, which is why Ctrl-C works). The run then stops
    Ray itself; stopping it takes about 4 s more, since Ray kills a process that ignores its SIGTERM a second
    later. A SIGTERM to this process meanwhile is delivered when ``ray.init`` returns."""
    handler = signal.getsignal(signal.SIGTERM)
    if not callable(handler) or threading.current_thread() is not threading.main_thread():
        yield
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fails fast, with the config key, when ``ray.address`` names a host:port nobody listens on (``ray.init``
    would retry for minutes). "auto" (the cluster running on this machine) and "local" (a new one) are left to Ray,
    which answers at once."""
    if address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"ray.address {address!r} is not host:port, ray://host:port or auto; leave it empty to start a local Ray"
        )
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise ConfigError(
            f"ray.address {address!r} cannot be reached ({error}); start Ray there (ray start --head) or leave "
            "ray.address empty to start a local Ray"
        ) from None


@contextlib.contextmanager
def serve_ranks(
    config, path: str, backend, settings: dict, extra_cpus: int = 0, check=lambda: None
) -> Iterator[ServeRankPool]:
    """``rollout.num_ranks`` Ray Serve rank deployments of ``backend`` with engine ``settings`` on the model folder
    ``path``, on ``ray.address`` or a local Ray with room for ``extra_cpus`` more (trainer workers); removed on
    exit. ``config``: a run's or a service's config (``rollout``, ``ray``). ``check`` runs once Ray is up, on a
    local Ray this call started."""
    from ray import serve

    from bubblespec.rollout.serve_ranks import ServeRankPool, deploy_ranks

    rollout = config.rollout
    backend.check_model(path)  # an architecture the engine cannot run: the same
    # Logical CPUs for the local Ray: enough for every rank and worker (each pins its own torch threads).
    needed = rollout.num_ranks * rollout.threads_per_rank + extra_cpus
    with ray_session(config, num_cpus=max(os.cpu_count() or 1, needed)) as owns_ray:
        if owns_ray:
            check()
        for key in ("rollout_nodes", "trainer_nodes"):  # before anything is deployed
            check_nodes(getattr(config.ray, key), f"ray.{key}")
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        serve.start(
            proxy_location="EveryNode" if config.ray.http_proxy else "Disabled",
            logging_config={"log_level": "WARNING"},
        )
        try:
            handles = deploy_ranks(rollout.num_ranks, rollout.backend, settings, rank_resources(config))
            yield ServeRankPool(handles)
        finally:
            if not owns_ray:  # on a shared cluster remove only our applications; a local Ray goes down whole
                for rank in range(rollout.num_ranks):
                    serve.delete(f"bubblespec-rank-{rank}")


def rank_resources(config) -> dict:
    """The Ray resources of one rank's replica: its CPUs (torch threads), GPUs and the nodes it may run on."""
    resources: dict = {"num_cpus": float(config.rollout.threads_per_rank)}
    if config.rollout.gpus_per_rank:
        resources["num_gpus"] = config.rollout.gpus_per_rank
    if config.ray.rollout_nodes:
        resources["label_selector"] = dict(config.ray.rollout_nodes)
    return resources


def check_nodes(selector: dict[str, str], key: str) -> None:
    """Ray would wait forever for a node that matches ``selector``: fail at once when no live node does. (Values
    with Ray's operators, such as ``in(a,b)`` or ``!a``, are left to Ray.)"""
    import ray

    if not selector or any(any(c in value for c in "()!,") for value in selector.values()):
        return
    nodes = [node for node in ray.nodes() if node["Alive"]]
    if not any(all(node.get("Labels", {}).get(k) == v for k, v in selector.items()) for node in nodes):
        seen = sorted({f"{k}={v}" for node in nodes for k, v in node.get("Labels", {}).items() if "/" not in k})
        raise ConfigError(
            f"{key} {selector} matches no node of the Ray cluster (its nodes' labels: {', '.join(seen) or 'none'}); "
            "start nodes with `ray start --labels key=value` or leave it empty for any node"
        )


def check_local_gpus(config: RunConfig) -> None:
    """The GPUs ranks and trainer workers reserve must exist: on the local Ray this run started none appear later,
    and Ray would wait for them forever. (A cluster given by ray.address may add GPU nodes on demand: it is not
    checked.)"""
    import ray

    trainer = config.trainer
    needed = config.rollout.num_ranks * config.rollout.gpus_per_rank + trainer.num_workers * trainer.worker_gpus
    gpus = ray.cluster_resources().get("GPU", 0)
    if needed > gpus:
        rollout, wanted = config.rollout, []
        if rollout.gpus_per_rank:
            wanted.append(f"rollout.num_ranks {rollout.num_ranks} x rollout.gpus_per_rank {rollout.gpus_per_rank:g}")
        if trainer.worker_gpus:
            cuda = " (trainer.device 'cuda')" if trainer.device == "cuda" else ""
            wanted.append(f"trainer.num_workers {trainer.num_workers} x {trainer.worker_gpus:g} GPUs per worker{cuda}")
        raise ConfigError(
            f"{' plus '.join(wanted)} need {needed:g} GPUs; this machine's Ray has {gpus:g}. Use fewer GPUs "
            "(trainer.device: cpu), or ray.address of a cluster with GPUs"
        )


@contextlib.contextmanager
def local_cluster(nodes: list[dict], head_cpus: float = 2) -> Iterator:
    """A Ray cluster of several nodes on this machine (Ray's own ``ray.cluster_utils.Cluster``: a raylet and an
    object store per node), connected to, for tests and benchmarks of what spans nodes. The head node, with
    ``head_cpus`` CPUs, holds the driver and Serve's controller; each entry of ``nodes`` is one more node, as
    ``Cluster.add_node``'s arguments (``num_cpus``, ``num_gpus`` — any count, no GPU needed —, ``labels``,
    ``resources``). Yields the Cluster (``remove_node`` takes one of ``cluster.worker_nodes``)."""
    for name, value in RAY_DEFAULTS.items():
        os.environ.setdefault(name, value)
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "include_dashboard": False})
    try:
        for node in nodes:
            cluster.add_node(**node)
        with sigterm_left_to_the_driver():
            ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
