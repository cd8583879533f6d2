"""Runs on a Ray cluster of several nodes (Ray's own ``ray.cluster_utils.Cluster`` on this machine: a raylet and
an object store per node, fake GPU counts): placement by labels and GPUs, colocated release/resume, and nodes
lost mid-run, each run compared with the in-process simulation of the same config.

How the node faults fire: never after a delay (a shard that takes 50 ms here takes 5 ms on a faster machine, or
500 ms beside a busy process). The test arms a point of :mod:`bubblespec.core.fault_gates` from an ``on_phase``
callback; the rank (or trainer worker) that reaches it holds there, in the middle of its shard (or with its train
command received), and tells the gate its node. The run runs in a background thread, while the test's main thread
waits for the hold, removes that node and adds its replacement (Ray's ``Cluster`` starts and stops nodes with
signal handlers, which only the main thread may set), then releases the gate. The retried call passes through."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file

from bubblespec.core.config import validate
from bubblespec.core.fault_gates import ENVIRONMENT_VARIABLE, FaultGate
from bubblespec.observe.run_dir import RunDirectory
from bubblespec.run.launch import run
from tests.ray_turns import ray_turn

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.cluster]

ROLLOUT = {"num_cpus": 2, "num_gpus": 2, "labels": {"role": "rollout"}}
TRAINER = {"num_cpus": 1, "num_gpus": 1, "labels": {"role": "trainer"}}
STORE = {"num_cpus": 0, "labels": {"role": "store"}}
PLACED = {"rollout_nodes": {"role": "rollout"}, "trainer_nodes": {"role": "trainer"}}


@pytest.fixture(scope="module")
def cluster(monkeypatch_module, tmp_path_factory):
    """A head node (the driver, Serve's controller) with two rollout nodes of 2 fake GPUs, two trainer nodes of 1
    and a node for the draft store: as few nodes as the tests need (each node is a raylet and two agent processes,
    and a node that cannot register within Ray's 30 s fails the start-up; on 2 busy cores every node counts).
    Nodes detect a dead peer within about a second."""
    from bubblespec.run.ray_cluster import local_cluster

    # a removed node is declared dead after 3 missed health checks 0.2 s apart (the default takes 15 s)
    monkeypatch_module.setenv("RAY_health_check_period_ms", "200")
    monkeypatch_module.setenv("RAY_health_check_failure_threshold", "3")
    monkeypatch_module.setenv(ENVIRONMENT_VARIABLE, "test-cluster")  # ranks and trainer workers consult the gate
    # no other worker starts a Ray while the cluster lives (a local ray.init would find it)
    with ray_turn(tmp_path_factory), local_cluster([ROLLOUT] * 2 + [TRAINER] * 2 + [STORE], head_cpus=1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _small_run(tmp_path, name: str, **changes) -> dict:
    """3 float64 steps of 4 prompts x 2 samples on 2 ranks with 1 fake GPU each and a trainer worker with 1."""
    return {
        "name": name,
        "output_dir": str(tmp_path),
        "num_steps": 3,
        "checkpoint_every": 1,
        "metrics": {"enabled": False},
        "model": {"dtype": "float64"},
        "task": {"prompts_per_step": 4, "samples_per_prompt": 2},
        "rollout": {"num_ranks": 2, "gpus_per_rank": 1, "sampling": {"max_new_tokens": 48}},
        "trainer": {"optimizer": {"learning_rate": 1e-3}, "gpus_per_worker": 1},
        "ray": PLACED,
    } | changes


def _assert_equals_the_simulation(tmp_path, wall) -> None:
    """Rollouts and final weights of the wall-clock run on the cluster equal those of the same config simulated
    in this process (no Ray, one learner, the in-memory store)."""
    virtual = validate(
        wall.model_dump()
        | {
            "name": f"{wall.name}-simulated",
            "clock": {"kind": "virtual"},
            "speculation": {"draft_during_training": wall.speculation.draft_during_training},
            "ray": {},
        }
    )
    run(virtual)
    wall_dir, virtual_dir = RunDirectory(wall.run_dir), RunDirectory(virtual.run_dir)
    wall_steps, virtual_steps = wall_dir.read_steps(), virtual_dir.read_steps()
    assert [s.step for s in wall_steps] == list(range(wall.num_steps))
    assert [s.rollout_digest for s in wall_steps] == [s.rollout_digest for s in virtual_steps]
    assert [s.num_samples for s in wall_steps] == [s.num_samples for s in virtual_steps]
    wall_weights = load_file(str(wall_dir.latest_checkpoint() / "weights.safetensors"))
    virtual_weights = load_file(str(virtual_dir.latest_checkpoint() / "weights.safetensors"))
    assert all(torch.allclose(wall_weights[k], virtual_weights[k], rtol=0, atol=1e-12) for k in virtual_weights)


def _nodes(labels: dict) -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and all(n["Labels"].get(k) == v for k, v in labels.items())}


def _remove_node_of(cluster, node_id: str, replacement: dict) -> None:
    """Kills a node's raylet and every process on it (as when the machine dies), then adds a fresh node of the
    same kind so that the cluster keeps its shape for the next test."""
    (node,) = [node for node in cluster.worker_nodes if node.node_id == node_id]
    cluster.remove_node(node, allow_graceful=False)
    cluster.add_node(**replacement)


def _at(step: int, phase: str, action: Callable[[], None]) -> Callable[[int, str], None]:
    """An ``on_phase`` callback that runs ``action`` once, as the run enters (step, phase), before it goes on."""
    done = []

    def on_phase(at_step, at_phase):
        if (at_step, at_phase) == (step, phase) and not done:
            done.append(True)
            action()

    return on_phase


class _Background:
    """``run(config, on_phase=...)`` in a thread, so that the main thread is free to change the cluster."""

    def __init__(self, config, on_phase) -> None:
        self.summary: dict | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(config, on_phase), name="run", daemon=True)
        self.thread.start()

    def _run(self, config, on_phase) -> None:
        try:
            self.summary = run(config, on_phase=on_phase)
        except BaseException as error:  # raised in the test by result()
            self.error = error

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def result(self, timeout_s: float = 600.0) -> dict:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the run did not end within {timeout_s} s"
        if self.error is not None:
            raise self.error
        return self.summary


def _lose_a_node_at(cluster, config, at, point: str, replacement: dict, after_passes=0, node=None) -> tuple:
    """Runs ``config``; the call that reaches ``point`` (armed as the run enters ``at``: (step, phase)) holds there
    while the main thread removes a node (the holder's, or ``node(where)``) and adds ``replacement``. Returns the
    summary and the lost node's id."""
    with FaultGate() as gate:
        background = _Background(config, _at(*at, lambda: gate.arm(point, after_passes)))
        try:
            where = gate.wait_held(point, running=background.is_alive)
            lost = where["node"] if node is None else node(where)
            _remove_node_of(cluster, lost, replacement)
        finally:
            gate.release()
        return background.result(), lost


def test_ranks_spread_over_labelled_nodes_with_their_gpus_and_the_trainer_on_its_own(cluster, tmp_path):
    """Separate hardware: two ranks of one GPU on two different rollout nodes (Serve spreads them though one
    node has room for both), the trainer worker with its GPU on a trainer node; ranks draft while it trains.
    The run equals its simulation."""
    config = validate(
        _small_run(tmp_path, "placed", clock={"kind": "wall"}, speculation={"draft_during_training": True})
    )
    summary = run(config)
    ranks, workers = summary["placement"]["ranks"], summary["placement"]["trainer_workers"]
    assert len({rank["node"] for rank in ranks}) == 2
    assert {rank["node"] for rank in ranks} <= _nodes({"role": "rollout"})
    assert all(len(rank["gpus"]) == 1 and rank["releases"] == 0 for rank in ranks)
    assert [worker["node"] in _nodes({"role": "trainer"}) for worker in workers] == [True]
    assert len(workers[0]["gpus"]) == 1
    _assert_equals_the_simulation(tmp_path, config)


def test_bubblespec_run_on_an_existing_cluster_leaves_it_running_without_its_ranks(cluster, tmp_path):
    """`bubblespec run` in another process with ray.address naming the cluster: the run uses the cluster's nodes
    and, at its end, removes its Serve applications only; the cluster stays up for the next user."""
    import subprocess
    import sys

    import ray
    import yaml
    from ray import serve

    config = _small_run(tmp_path, "on-a-cluster", num_steps=2, clock={"kind": "wall"})
    config["ray"] = PLACED | {"address": cluster.address}
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "bubblespec.cli.main", "run", "--quiet", str(config_file)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "on-a-cluster" / "summary.json").read_text())
    assert {rank["node"] for rank in summary["placement"]["ranks"]} <= _nodes({"role": "rollout"})
    assert len(_nodes({})) == 6  # every node still up
    assert not [name for name in serve.status().applications if name.startswith("bubblespec-rank-")]
    assert ray.is_initialized()


def test_labels_no_node_carries_are_a_clear_error_before_anything_is_deployed(cluster, tmp_path):
    """Ray would keep a rank or a trainer worker pending forever on a label selector no node matches."""
    from bubblespec.core.errors import ConfigError

    for key in ("rollout_nodes", "trainer_nodes"):
        config = validate(
            _small_run(tmp_path, f"no-{key}", clock={"kind": "wall"}, ray=PLACED | {key: {"role": "gpu"}})
        )
        with pytest.raises(ConfigError, match=rf"ray.{key} {{'role': 'gpu'}} matches no node of the Ray cluster "
                           r"\(its nodes' labels: role=rollout, role=store, role=trainer\)"):  # fmt: skip
            run(config)
        assert not config.run_dir.exists()


def test_colocated_ranks_share_gpus_with_the_trainer_and_release_them_while_it_trains(cluster, tmp_path):
    """Shared hardware: ranks and trainer worker take half a GPU each on the rollout nodes; every rank releases
    its engine's memory before each training phase (and resumes after). The run equals its simulation."""
    ray_section = {"colocated": True, "rollout_nodes": {"role": "rollout"}, "trainer_nodes": {"role": "rollout"}}
    config = validate(
        _small_run(
            tmp_path,
            "colocated",
            clock={"kind": "wall"},
            rollout={"num_ranks": 2, "gpus_per_rank": 0.5, "sampling": {"max_new_tokens": 48}},
            trainer={"optimizer": {"learning_rate": 1e-3}, "gpus_per_worker": 0.5},
            ray=ray_section,
        )
    )
    summary = run(config)
    ranks, workers = summary["placement"]["ranks"], summary["placement"]["trainer_workers"]
    assert [rank["releases"] for rank in ranks] == [config.num_steps] * 2
    rollout_nodes = _nodes({"role": "rollout"})
    assert {rank["node"] for rank in ranks} | {workers[0]["node"]} <= rollout_nodes
    _assert_equals_the_simulation(tmp_path, config)


def test_a_node_lost_mid_rollout_moves_its_rank_and_nothing_changes(cluster, tmp_path, caplog):
    """The node holding rank 1 dies while rank 1 generates step 1's shard (held after two forward passes until
    the node is gone): Serve starts the rank on a surviving rollout node, the pool gives it the current policy and
    retries its shard; the run equals its simulation."""
    config = validate(_small_run(tmp_path, "rank-node-lost", clock={"kind": "wall"}))
    summary, lost = _lose_a_node_at(cluster, config, (1, "rollout"), "rank 1 generate", ROLLOUT, after_passes=2)
    assert "rank 1 lost its replica" in caplog.text
    assert summary["placement"]["ranks"][1]["node"] != lost
    _assert_equals_the_simulation(tmp_path, config)


def test_the_draft_store_node_lost_mid_rollout_costs_drafts_only(cluster, tmp_path, caplog):
    """The `ray` draft store's actor runs on a node of its own, which dies during step 1's rollout (after the
    step took its drafts from the store, while rank 0 is held in its shard): the run goes on without stored drafts
    and equals its simulation."""
    (store_node,) = _nodes({"role": "store"})
    speculation = {"draft_store": "ray", "draft_store_options": {"label_selector": {"role": "store"}}}
    config = validate(_small_run(tmp_path, "store-node-lost", clock={"kind": "wall"}, speculation=speculation))
    summary, _ = _lose_a_node_at(
        cluster, config, (1, "rollout"), "rank 0 generate", STORE, after_passes=2, node=lambda where: store_node
    )
    assert "the draft store (RayDraftStore) failed and is given up" in caplog.text
    steps = RunDirectory(config.run_dir).read_steps()
    assert steps[-1].draft_coverage == 0
    assert summary["num_steps"] == 3
    _assert_equals_the_simulation(tmp_path, config)


def test_a_trainer_node_lost_mid_step_restarts_the_trainer_elsewhere_and_nothing_changes(cluster, tmp_path, caplog):
    """The node holding the trainer worker dies while step 2 trains (the worker holds its train command until the
    node is gone; after step 1's checkpoint): Ray Train restarts the worker on the other trainer node, the run
    rewinds to that checkpoint and replays; it equals its simulation."""
    config = validate(_small_run(tmp_path, "trainer-node-lost", clock={"kind": "wall"}))
    summary, lost = _lose_a_node_at(cluster, config, (2, "train"), "trainer worker 0 train", TRAINER)
    assert "in step 2: the run rewinds to its last checkpoint and replays from step 2" in caplog.text
    assert summary["placement"]["trainer_workers"][0]["node"] != lost
    _assert_equals_the_simulation(tmp_path, config)
