"""One small real run on Ray: Serve rank deployments and a Ray Train trainer, wall clock.

Faults fire at events, never after a delay: at a phase the run enters (``on_phase``, which runs before the phase
does anything), or where a rank or trainer worker holds at a point of :mod:`bubblespec.core.fault_gates` (a rank after
two forward passes of its shard, a trainer worker with its train command received) until a thread of the test
has injected the fault and released it. Each run starts its own local Ray, whose processes inherit
``BUBBLESPEC_FAULT_GATE`` from the test (the ``fault_gate`` fixture)."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file

from bubblespec.core.config import validate
from bubblespec.core.fault_gates import ENVIRONMENT_VARIABLE, FaultGate
from bubblespec.observe.run_dir import RunDirectory
from bubblespec.run.launch import run
from tests.prometheus import alert_expression, running_prometheus
from tests.scrape import scrape_run

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _small_run(tmp_path, **changes) -> dict:
    """3 float64 steps of 4 prompts x 2 samples on 2 ranks: small enough for Ray on 2 cores."""
    return {
        "output_dir": str(tmp_path),
        "num_steps": 3,
        "model": {"dtype": "float64"},
        "task": {"prompts_per_step": 4, "samples_per_prompt": 2},
        "rollout": {"num_ranks": 2, "sampling": {"max_new_tokens": 48}},
        "trainer": {"optimizer": {"learning_rate": 1e-3}},
    } | changes


@pytest.fixture
def fault_gate(monkeypatch):
    """The name of the fault gate set in the environment that the next run's local Ray (its ranks and trainer
    workers) inherits; the test makes the gate itself with ``FaultGate()``."""
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "test-ray")


def _our_ray_processes(prefix: str) -> list:
    """The live processes of this test session's Ray (descendants of this process: its raylet's workers) whose
    command line starts with ``prefix``; never another Ray's on the same machine."""
    import psutil

    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if (process.cmdline() or [""])[0].startswith(prefix):
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


def test_wall_clock_run_on_ray_equals_the_virtual_simulation(tmp_path):
    """Real Ray Serve ranks drafting in real bubbles (and with a draft head they learn) and a real Ray Train trainer
    give exactly the rollouts and weights of the in-process simulation: keyed sampling makes where and when a token is
    computed irrelevant."""
    # PPO-style updates (two epochs of two mini-batches, a KL term): the workers' shares of every mini-batch, the
    # old and reference logprobs and the statistics must add up across the gloo all-reduce as in one learner.
    trainer = {"optimizer": {"learning_rate": 1e-3}, "ppo_epochs": 2, "mini_batch_size": 4, "kl": {"coef": 0.01}}
    base = _small_run(tmp_path, checkpoint_every=1, metrics={"port": 0}, trainer=trainer)
    # Two data-parallel trainer workers (gloo all-reduce), the Ray-actor draft store, drafting while the trainer runs
    # and a draft head learned on the last rank beside the trainer (proposing its most tokens every pass where the
    # bubble draft has none) on Ray; one in-process learner, the in-memory store and no head in the simulation.
    head = {"enabled": True, "window": 16, "steps_per_rollout": 4, "sizing": "fixed", "position": "after-request"}
    wall = validate(
        base
        | {
            "name": "wall",
            "clock": {"kind": "wall"},
            "trainer": trainer | {"num_workers": 2},
            "speculation": {"draft_store": "ray", "draft_during_training": True, "draft_head": head},
        }
    )
    virtual = validate(base | {"name": "virtual", "clock": {"kind": "virtual"}})
    phases, activities = [], []
    summary = run(wall, on_phase=lambda *event: phases.append(event), on_activity=lambda *e: activities.append(e))
    run(virtual)
    wall_dir, virtual_dir = RunDirectory(wall.run_dir), RunDirectory(virtual.run_dir)
    wall_steps, virtual_steps = wall_dir.read_steps(), virtual_dir.read_steps()
    assert [s.rollout_digest for s in wall_steps] == [s.rollout_digest for s in virtual_steps]
    assert [s.reward_mean for s in wall_steps] == [s.reward_mean for s in virtual_steps]
    wall_weights = load_file(str(wall_dir.latest_checkpoint() / "weights.safetensors"))
    virtual_weights = load_file(str(virtual_dir.latest_checkpoint() / "weights.safetensors"))
    # Summing two workers' gradients rounds differently from one backward pass over the whole batch.
    assert all(torch.allclose(wall_weights[k], virtual_weights[k], rtol=0, atol=1e-10) for k in virtual_weights)
    for wall_step, virtual_step in zip(wall_steps, virtual_steps, strict=True):
        assert wall_step.train["optimizer_steps"] == virtual_step.train["optimizer_steps"]
        if not virtual_step.train["skipped"]:
            assert virtual_step.train["optimizer_steps"] == 4
            assert wall_step.train["kl"] == pytest.approx(virtual_step.train["kl"], rel=1e-6, abs=1e-12)
    assert any(not step.train["skipped"] for step in virtual_steps)
    assert summary["clock"] == "wall" and summary["rollout_seconds"] > 0
    # the head learned after every rollout on the last rank, and from the second step on every rank drafted with it
    # (where its bubble drafts had no proposal)
    assert all(s.draft_head.rank == 1 and s.draft_head.steps > 0 for s in wall_steps)
    assert all(sum(s.ranks[rank].head_tokens_proposed for s in wall_steps[1:]) > 0 for rank in (0, 1))
    for step in wall_steps:
        assert all(rank.generation_seconds > 0 for rank in step.ranks)
        # bubbles are measured from the barrier: the last rank to finish has none, the others are idle or drafting
        assert min(rank.bubble_seconds for rank in step.ranks) == 0
        assert all(rank.drafting_seconds <= rank.bubble_seconds + 1e-9 for rank in step.ranks)
    # drafting while the trainer ran is recorded per rank, for the timeline picture (steps whose plan was used up
    # in the rollout bubble have none)
    training = [entry for step in wall_steps for rank in step.training_timelines or [] for entry in rank]
    assert all(kind == "draft" and 0 <= start <= end for kind, start, end in training)
    drafted = [entry for step in wall_steps for rank in step.timelines for entry in rank if entry[0] == "draft"]
    assert training or drafted, "no rank drafted at all"
    # the live display heard of every phase, of every rank generating and falling idle, and of drafting
    assert phases[:3] == [(0, "rollout"), (0, "train"), (0, "weight sync")] and len(phases) == 9
    heard = {(rank, activity) for rank, activity, _ in activities}
    assert {(rank, activity) for rank in (0, 1) for activity in ("generate", "idle")} <= heard
    assert any(activity == "draft" for _, activity in heard)


@pytest.mark.prometheus
def test_a_rank_replica_killed_mid_rollout_is_replaced_and_nothing_changes(tmp_path, caplog, fault_gate):
    """Kill rank 1's Serve replica while it generates step 1's shard (held after two forward passes until it is
    killed): Serve starts a new one, the pool gives it the current policy and retries the shard; keyed sampling
    makes every sample the one the lost replica would have made, so the run equals the simulation, with no sample
    lost or duplicated. While it is held, a real Prometheus with dashboards/rules.yml shows rank 1 (and no other)
    stuck within one typical step time; the replacement is counted."""
    import ray

    base = _small_run(tmp_path, checkpoint_every=3, metrics={"enabled": False})
    wall = validate(base | {"name": "faulty", "clock": {"kind": "wall"}, "metrics": {"port": 0}})
    virtual = validate(base | {"name": "reference", "clock": {"kind": "virtual"}})
    killed, stuck, replacements = [], [], []

    def kill_rank_1(where: dict) -> None:
        held = time.time()
        stuck.append(prometheus.wait_for_series(alert_expression("BubblespecRankStuck"), timeout_s=120))
        typical = prometheus.value('run:bubblespec_step_wall_seconds:avg_over_time1h{run="faulty"}')
        stuck.append((time.time() - held, typical))
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if actor["name"].startswith("SERVE_REPLICA::bubblespec-rank-1#"):
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
                killed.append(actor["name"])

    def on_phase(step, phase):
        if (step, phase) == (1, "rollout"):
            gate.arm("rank 1 generate", after_passes=2)
            gate.inject_when_held("rank 1 generate", kill_rank_1)

    def on_step(record) -> None:
        if record.step == 2:
            replacements.append(scrape_run(wall.run_dir)[("bubblespec_replica_replacements_total", (("rank", "1"),))])

    (tmp_path / "prometheus").mkdir()
    with running_prometheus(tmp_path / "prometheus", tmp_path) as prometheus, FaultGate() as gate:
        run(wall, on_phase=on_phase, on_step=on_step)
    run(virtual)
    assert len(killed) == 1, killed
    assert "rank 1 lost its replica" in caplog.text
    (series, (waited, typical)) = stuck
    assert [s["metric"] for s in series] == [{"run": "faulty", "rank": "1"}], series
    assert waited < typical + 10, (
        f"rank 1 showed as stuck {waited:.1f} s after it hung; a typical step: {typical:.1f} s"
    )
    assert replacements == [1]
    wall_steps = RunDirectory(wall.run_dir).read_steps()
    virtual_steps = RunDirectory(virtual.run_dir).read_steps()
    assert [s.rollout_digest for s in wall_steps] == [s.rollout_digest for s in virtual_steps]
    assert [s.num_samples for s in wall_steps] == [8, 8, 8]
    wall_weights = load_file(str(RunDirectory(wall.run_dir).latest_checkpoint() / "weights.safetensors"))
    virtual_weights = load_file(str(RunDirectory(virtual.run_dir).latest_checkpoint() / "weights.safetensors"))
    assert all(torch.allclose(wall_weights[k], virtual_weights[k], rtol=0, atol=1e-12) for k in virtual_weights)


def test_trainer_workers_killed_mid_step_rewind_to_the_last_checkpoint_and_nothing_changes(
    tmp_path, caplog, fault_gate
):
    """Kill the Ray Train worker process as step 1 starts (before any checkpoint; it waits for its next command)
    and again while step 2 trains (after the checkpoint of step 1; it holds its train command until killed): Ray
    Train restarts the worker group, the run rewinds to its start and then to that checkpoint, replays, and ends
    with the rollouts and weights of a run without faults."""
    import os
    import signal

    base = _small_run(tmp_path, num_steps=4, checkpoint_every=2, metrics={"enabled": False})
    wall = validate(base | {"name": "trainer-faults", "clock": {"kind": "wall"}, "metrics": {"port": 0}})
    virtual = validate(base | {"name": "reference", "clock": {"kind": "virtual"}})
    counted = {}

    def on_step(record) -> None:  # the metrics at the end: two restarts, each step counted once
        if record.step == 3:
            metrics = scrape_run(wall.run_dir)
            counted.update(restarts=metrics[("bubblespec_trainer_restarts_total", ())],
                           steps=metrics[("bubblespec_steps_total", ())])  # fmt: skip

    faults = {(1, "rollout"), (2, "train")}  # the worker exists by step 1: it trained step 0
    killed: list[tuple[int, str]] = []

    def on_phase(step, phase):
        if (step, phase) not in faults:
            return
        faults.discard((step, phase))  # once: the run replays these steps
        if phase == "rollout":
            for process in _our_ray_processes("ray::RayTrainWorker"):
                os.kill(process.pid, signal.SIGKILL)
                killed.append((step, phase))
        else:
            gate.arm("trainer worker 0 train")
            gate.inject_when_held("trainer worker 0 train", lambda where: kill_the_worker(where, step, phase))

    def kill_the_worker(where: dict, step: int, phase: str) -> None:
        os.kill(where["pid"], signal.SIGKILL)
        killed.append((step, phase))

    with FaultGate() as gate:
        run(wall, on_phase=on_phase, on_step=on_step)
    run(virtual)
    assert killed == [(1, "rollout"), (2, "train")], killed
    assert counted == {"restarts": 2, "steps": 4}
    assert "in step 1: the run rewinds to its last checkpoint and replays from step 0" in caplog.text
    assert "in step 2: the run rewinds to its last checkpoint and replays from step 2" in caplog.text
    wall_dir, virtual_dir = RunDirectory(wall.run_dir), RunDirectory(virtual.run_dir)
    wall_steps, virtual_steps = wall_dir.read_steps(), virtual_dir.read_steps()
    assert [s.step for s in wall_steps] == [0, 1, 2, 3]  # replayed steps are recorded once
    assert [s.rollout_digest for s in wall_steps] == [s.rollout_digest for s in virtual_steps]
    wall_weights = load_file(str(wall_dir.latest_checkpoint() / "weights.safetensors"))
    virtual_weights = load_file(str(virtual_dir.latest_checkpoint() / "weights.safetensors"))
    assert all(torch.allclose(wall_weights[k], virtual_weights[k], rtol=0, atol=1e-12) for k in virtual_weights)


def test_replicas_replaced_between_calls_and_a_lost_draft_store_change_nothing(tmp_path, caplog, fault_gate):
    """Three faults in one run: rank 0's replica killed while the ranks draft during training; rank 1's replica
    killed after a weight sync and replaced by Serve before the next rollout (the replacement holds the initial
    model and must refuse to generate with it); the Ray draft store's actor killed during a rollout. The ranks
    get the current policy again, the run goes on without stored drafts, and the rollouts and weights are those
    of the simulation without faults."""
    import os
    import signal
    import time

    import ray
    from ray import serve

    base = _small_run(tmp_path, num_steps=4, checkpoint_every=4, metrics={"enabled": False})
    speculation = {"draft_store": "ray", "draft_during_training": True, "lookahead_steps": 2}
    wall = validate(base | {"name": "faults", "clock": {"kind": "wall"}, "speculation": speculation})
    virtual = validate(base | {"name": "reference", "clock": {"kind": "virtual"}})
    killed = []

    def replicas(rank: int) -> list[str]:
        prefix = f"SERVE_REPLICA::bubblespec-rank-{rank}#"
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]

    def kill_replica(rank: int) -> str:
        (name,) = replicas(rank)
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        killed.append(f"replica {rank}")
        return name

    def kill_store(where: dict) -> None:  # rank 0 holds its shard: the store was asked for this step's drafts
        for process in _our_ray_processes("ray::InMemoryDraftStore"):
            os.kill(process.pid, signal.SIGKILL)
            killed.append("store")

    def on_phase(step, phase):
        if (step, phase) == (1, "train"):
            kill_replica(0)
        if (step, phase) == (2, "rollout"):
            gate.arm("rank 0 generate", after_passes=2)
            gate.inject_when_held("rank 0 generate", kill_store)

    def on_step(record):
        if record.step == 1:  # weights of version 2 are synced; replace rank 1's replica before step 2
            old = kill_replica(1)
            deadline = time.monotonic() + 60
            while replicas(1) in ([], [old]) and time.monotonic() < deadline:
                time.sleep(0.1)
            # the replacement has started once it answers (and Serve routes the pool's next call to it)
            serve.get_app_handle("bubblespec-rank-1").placement.remote().result(timeout_s=120)

    with FaultGate() as gate:
        run(wall, on_phase=on_phase, on_step=on_step)
    run(virtual)
    assert killed == ["replica 0", "replica 1", "store"], killed
    wall_steps = RunDirectory(wall.run_dir).read_steps()
    virtual_steps = RunDirectory(virtual.run_dir).read_steps()
    assert [s.rollout_digest for s in wall_steps] == [s.rollout_digest for s in virtual_steps]
    assert "rank 1 holds policy version 0, the call expects 2" in caplog.text
    assert "without drafts" in caplog.text
    assert wall_steps[3].draft_coverage == 0  # the store's drafts were lost with it
    wall_weights = load_file(str(RunDirectory(wall.run_dir).latest_checkpoint() / "weights.safetensors"))
    virtual_weights = load_file(str(RunDirectory(virtual.run_dir).latest_checkpoint() / "weights.safetensors"))
    assert all(torch.allclose(wall_weights[k], virtual_weights[k], rtol=0, atol=1e-12) for k in virtual_weights)


def test_a_killed_wall_clock_run_resumes_on_a_new_ray_to_an_identical_run(tmp_path):
    """SIGKILL `bubblespec run` on the wall clock and the local Ray it started (as when its machine dies) after a
    few steps, then `bubblespec run --resume` on a fresh Ray: the run ends as the simulation without the fault."""
    from tests.crash import kill_after_steps, resume

    base = _small_run(tmp_path, num_steps=4, checkpoint_every=2, metrics={"enabled": False})
    head = {"draft_head": {"enabled": True, "window": 16, "steps_per_rollout": 4}}  # its state in the checkpoint
    wall = validate(base | {"name": "killed", "clock": {"kind": "wall"}, "speculation": head})
    virtual = validate(base | {"name": "reference", "clock": {"kind": "virtual"}})
    kill_after_steps(wall, 3)
    run_dir = RunDirectory(wall.run_dir)
    assert len(run_dir.read_steps()) == 3  # steps 0-2 logged; the checkpoint of step 1 is the newest
    assert (run_dir.latest_checkpoint() / "draft_head.pt").exists()
    resume(wall)
    run(virtual)
    wall_steps = run_dir.read_steps()
    virtual_steps = RunDirectory(virtual.run_dir).read_steps()
    assert [s.step for s in wall_steps] == [0, 1, 2, 3]
    assert all(s.draft_head is not None and s.draft_head.steps > 0 for s in wall_steps)  # also after the resume
    assert [s.rollout_digest for s in wall_steps] == [s.rollout_digest for s in virtual_steps]
    wall_weights = load_file(str(run_dir.latest_checkpoint() / "weights.safetensors"))
    virtual_weights = load_file(str(RunDirectory(virtual.run_dir).latest_checkpoint() / "weights.safetensors"))
    assert all(torch.allclose(wall_weights[k], virtual_weights[k], rtol=0, atol=1e-12) for k in virtual_weights)


def test_a_rank_that_cannot_load_its_model_is_one_clear_error(tmp_path):
    """The replica's own error (here: weights that do not read), not Serve's "failed to update". A folder whose
    architecture or files the engine can tell are wrong fails before Ray starts."""
    import shutil

    from bubblespec.core.errors import EngineError, ModelLoadError
    from bubblespec.tasks.arithmetic import ArithmeticTask

    missing = tmp_path / "no-weights"
    missing.mkdir()
    (missing / "config.json").write_text('{"model_type": "llama", "vocab_size": 19}')
    base = _small_run(tmp_path, name="broken", metrics={"enabled": False}) | {"clock": {"kind": "wall"}}
    config = validate(base | {"model": {"path": str(missing)}, "rollout": {"num_ranks": 1}})
    with pytest.raises(ModelLoadError, match=r"model path .* has no \*\.safetensors weights"):
        run(config)  # before Ray starts: the engine's check_model
    corrupt = tmp_path / "corrupt-weights"
    shutil.copytree(ArithmeticTask.model_path(), corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    config = validate(base | {"model": {"path": str(corrupt)}, "rollout": {"num_ranks": 1}})
    with pytest.raises(EngineError, match=r"rank 0 could not start its engine \(backend 'torch'\): "):
        run(config)
    assert not config.run_dir.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"trainer": {"device": "cuda"}},
         r"trainer.num_workers 1 x 1 GPUs per worker \(trainer.device 'cuda'\) need 1 GPUs; this machine's Ray has 0"),
        ({"rollout": {"num_ranks": 2, "gpus_per_rank": 0.5}, "trainer": {"gpus_per_worker": 1}},
         r"rollout.num_ranks 2 x rollout.gpus_per_rank 0.5 plus trainer.num_workers 1 x 1 GPUs per worker need 2 "
         r"GPUs; this machine's Ray has 0"),
    ],
)  # fmt: skip
def test_gpus_a_local_ray_lacks_fail_at_once(tmp_path, changes, message):
    """Ray would keep ranks or trainer workers waiting for GPUs forever: the local Ray this run started will never
    have them."""
    from bubblespec.core.errors import ConfigError

    config = validate(
        _small_run(tmp_path, name="no-gpu", metrics={"enabled": False}) | {"clock": {"kind": "wall"}} | changes
    )
    with pytest.raises(ConfigError, match=message):
        run(config)
    assert not config.run_dir.exists()


def test_a_trainer_worker_error_is_one_error_naming_it_and_the_workers_stay_up(tmp_path):
    """Two bfloat16 Ray Train workers; worker 1's share of a batch holds a token outside the vocabulary. The
    caller gets worker 1's own exception, not a restart loop; the next batch trains, and weights come back as
    bfloat16 tensors, float32 master weights in the checkpoint state."""
    from bubblespec.core.errors import TrainerError
    from bubblespec.core.interfaces import SamplingParams
    from bubblespec.rl.learner import LearnerSpec, TrainSample
    from bubblespec.rl.ray_train import RayTrainer
    from bubblespec.run.ray_cluster import ray_session
    from bubblespec.tasks import ArithmeticTask

    config = validate({"model": {"dtype": "bfloat16"}, "trainer": {"num_workers": 2, "max_restarts": 1}})
    with ray_session(config, num_cpus=3):
        spec = LearnerSpec.of_run(config, str(ArithmeticTask.model_path()), SamplingParams())
        trainer = RayTrainer(spec, tmp_path, cpus_per_worker=1.0)
        try:
            good = [TrainSample((1, 5), (6, 2), 0, 1.0), TrainSample((1, 5), (7, 2), 0, 0.0)]
            bad = [good[0], TrainSample((1, 5), (10**6, 2), 0, 0.0)]  # samples[1::2] go to worker 1
            with pytest.raises(TrainerError, match=r"^trainer worker 1: IndexError: index out of range in self \(at "):
                trainer.train(bad)
            metrics, weights, _ = trainer.train(good)
            assert metrics["skipped"] == 0 and metrics["trained_tokens"] == 4  # the whole batch's
            assert all(weight.dtype == torch.bfloat16 for weight in weights.values())
            master = trainer.checkpoint_state()["master_weights"]
            assert all(weight.dtype == torch.float32 for weight in master.values())
            assert all(torch.equal(master[k].to(torch.bfloat16), weights[k]) for k in weights)
        finally:
            trainer.close()


@pytest.mark.parametrize(
    "timed_out",
    [
        "The current node timed out during startup. This could happen because ...",
        "Timed out waiting for file /tmp/ray/session_x/gcs_server_port_0",
    ],
)
def test_a_local_ray_whose_node_did_not_register_in_time_is_started_once_more(monkeypatch, caplog, tmp_path, timed_out):
    """Ray gives a new node 30 s to register, fixed; on two busy cores it can take longer. The run's own local Ray is
    started again once, after the first attempt's processes are stopped; any other failure is the user's error."""
    import subprocess

    import ray

    from bubblespec.core.errors import BubblespecError
    from bubblespec.run.ray_cluster import ray_session

    attempts: list[subprocess.Popen] = []

    def init(**settings):
        attempts.append(subprocess.Popen(["sleep", "600"]))  # what a failed start leaves: a child process
        if len(attempts) == 1:
            raise TimeoutError(timed_out) if timed_out.startswith("Timed out") else Exception(timed_out)

    monkeypatch.setattr(ray, "init", init)
    with ray_session(validate({"output_dir": str(tmp_path)})):
        pass
    assert len(attempts) == 2 and attempts[0].poll() is not None  # the first attempt's process was stopped
    assert "did not register within Ray's 30 s" in caplog.text
    attempts[1].kill()

    def fails(**settings):
        raise RuntimeError("no space left for the object store")

    monkeypatch.setattr(ray, "init", fails)
    with pytest.raises(BubblespecError, match="cannot start or reach a local Ray .*no space left"):
        with ray_session(validate({"output_dir": str(tmp_path)})):
            pass
