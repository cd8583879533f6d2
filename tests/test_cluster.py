"""Runs on a Ray cluster of several nodes (Ray's own ``ray.cluster_utils.Cluster`` on this machine: a raylet and
an object store per node, fake GPU counts): placement by labels and GPUs, colocated release/resume, and nodes
lost mid-run, each run compared with the in-process simulation of the same config."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import load_file

from bubblespec.config import validate
from bubblespec.launch import run
from bubblespec.run_dir import RunDirectory

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.cluster]

ROLLOUT = {"num_cpus": 2, "num_gpus": 2, "labels": {"role": "rollout"}}
TRAINER = {"num_cpus": 1, "num_gpus": 1, "labels": {"role": "trainer"}}
STORE = {"num_cpus": 0, "labels": {"role": "store"}}
PLACED = {"rollout_nodes": {"role": "rollout"}, "trainer_nodes": {"role": "trainer"}}


@pytest.fixture(scope="module")
def cluster(monkeypatch_module):
    """A head node (the driver, Serve's controller) with three rollout nodes of 2 fake GPUs, two trainer nodes
    of 1 and a node for the draft store. Nodes detect a dead peer within about a second."""
    from bubblespec.ray_cluster import local_cluster

    # a removed node is declared dead after 3 missed health checks 0.2 s apart (the default takes 15 s)
    monkeypatch_module.setenv("RAY_health_check_period_ms", "200")
    monkeypatch_module.setenv("RAY_health_check_failure_threshold", "3")
    with local_cluster([ROLLOUT] * 3 + [TRAINER] * 2 + [STORE], head_cpus=1) as cluster:
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
        "trainer": {"learning_rate": 1e-3, "gpus_per_worker": 1},
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
    assert [s["step"] for s in wall_steps] == list(range(wall.num_steps))
    assert [s["rollout_digest"] for s in wall_steps] == [s["rollout_digest"] for s in virtual_steps]
    assert [s["num_samples"] for s in wall_steps] == [s["num_samples"] for s in virtual_steps]
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


def _when(step: int, phase: str, action, delay_s: float = 0.05):
    """An ``on_phase`` callback that runs ``action`` once, ``delay_s`` after the run enters (step, phase)."""
    done = []

    def on_phase(at_step, at_phase):
        if (at_step, at_phase) == (step, phase) and not done:
            done.append(True)
            threading.Timer(delay_s, action).start()

    return on_phase


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
    assert len(_nodes({})) == 7  # every node still up
    assert not [name for name in serve.status().applications if name.startswith("bubblespec-rank-")]
    assert ray.is_initialized()


def test_labels_no_node_carries_are_a_clear_error_before_anything_is_deployed(cluster, tmp_path):
    """Ray would keep a rank or a trainer worker pending forever on a label selector no node matches."""
    from bubblespec.errors import ConfigError

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
            trainer={"learning_rate": 1e-3, "gpus_per_worker": 0.5},
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
    """The node holding rank 1 dies while step 1's rollout runs: Serve starts the rank on a surviving rollout
    node, the pool gives it the current policy and retries its shard; the run equals its simulation."""
    from ray import serve

    def kill_rank_1_node():
        where = serve.get_app_handle("bubblespec-rank-1").placement.remote().result()
        lost.append(where["node"])
        _remove_node_of(cluster, where["node"], ROLLOUT)

    lost: list[str] = []
    config = validate(_small_run(tmp_path, "rank-node-lost", clock={"kind": "wall"}))
    summary = run(config, on_phase=_when(1, "rollout", kill_rank_1_node))
    assert lost, "no node was removed"
    assert "rank 1 lost its replica" in caplog.text, "the node died after the shard came back"
    assert summary["placement"]["ranks"][1]["node"] != lost[0]
    _assert_equals_the_simulation(tmp_path, config)


def test_the_draft_store_node_lost_mid_rollout_costs_drafts_only(cluster, tmp_path, caplog):
    """The `ray` draft store's actor runs on a node of its own, which dies during step 1's rollout: the run goes
    on without stored drafts and equals its simulation."""
    store_nodes = _nodes({"role": "store"})
    speculation = {"draft_store": "ray", "draft_store_options": {"label_selector": {"role": "store"}}}
    config = validate(_small_run(tmp_path, "store-node-lost", clock={"kind": "wall"}, speculation=speculation))
    summary = run(config, on_phase=_when(1, "rollout", lambda: _remove_node_of(cluster, store_nodes.pop(), STORE)))
    assert "the draft store (RayDraftStore) failed and is given up" in caplog.text
    steps = RunDirectory(config.run_dir).read_steps()
    assert steps[-1]["draft_coverage"] == 0
    assert summary["num_steps"] == 3
    _assert_equals_the_simulation(tmp_path, config)


def test_a_trainer_node_lost_mid_step_restarts_the_trainer_elsewhere_and_nothing_changes(cluster, tmp_path, caplog):
    """The node holding the trainer worker dies while step 2 trains (after step 1's checkpoint): Ray Train
    restarts the worker on the other trainer node, the run rewinds to that checkpoint and replays; it equals
    its simulation."""
    lost: list[str] = []

    def kill_trainer_node():
        node = _node_running(cluster, "ray::RayTrainWorker")
        lost.append(node)
        _remove_node_of(cluster, node, TRAINER)

    config = validate(_small_run(tmp_path, "trainer-node-lost", clock={"kind": "wall"}))
    summary = run(config, on_phase=_when(2, "train", kill_trainer_node, delay_s=0.0))
    assert lost, "no node was removed"
    assert "the run rewinds to its last checkpoint and replays from step 2" in caplog.text
    assert summary["placement"]["trainer_workers"][0]["node"] != lost[0]
    _assert_equals_the_simulation(tmp_path, config)


def _node_running(cluster, prefix: str) -> str:
    """The id of the worker node one of whose processes' command line starts with ``prefix``."""
    import psutil

    for node in cluster.worker_nodes:
        raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
        for process in raylet.children(recursive=True):
            try:
                if (process.cmdline() or [""])[0].startswith(prefix):
                    return node.node_id
            except psutil.NoSuchProcess:
                continue
    raise AssertionError(f"no node runs a process {prefix!r}")
