"""A run on a shared machine: beside another user's Ray and metrics port, stopped by SIGTERM as by Ctrl-C (to its
process, and to its whole process group as SLURM does), resumed with the settings that do not change its results,
and a run name that is taken refused before anything starts, with a hint that works."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

import bubblespec.run.launch
from bubblespec.cli.main import app
from bubblespec.core.config import RESUMABLE, check_resumable, validate
from bubblespec.core.errors import ConfigError
from bubblespec.observe.metrics import DEFAULT_PORT
from bubblespec.observe.run_dir import RunDirectory
from tests.scrape import target_of

RUN = [sys.executable, "-m", "bubblespec.cli.main", "run"]


def _config(tmp_path: Path, name: str, **changes) -> dict:
    """A small float64 run on the virtual clock (seconds per run), metrics on a free port."""
    return {
        "name": name,
        "output_dir": str(tmp_path),
        "num_steps": 2,
        "checkpoint_every": 1,
        "model": {"dtype": "float64"},
        "task": {"prompts_per_step": 4, "samples_per_prompt": 2},
        "rollout": {"num_ranks": 2, "sampling": {"max_new_tokens": 24}},
        "clock": {"kind": "virtual", "profile": "h100-7b"},
        "metrics": {"port": 0},
    } | changes


def _write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / f"{config['name']}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _invoke(*args: str):
    return CliRunner().invoke(app, ["run", "--quiet", *args])


def _last_weights(run_dir: Path) -> dict:
    checkpoint = RunDirectory(run_dir).latest_checkpoint()
    return load_file(str(checkpoint / "weights.safetensors"))


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"metrics": {"port": 0, "host": "0.0.0.0"}}, None),
        ({"ray": {"address": "auto"}, "checkpoint_every": 3, "logged_prompts": 0}, None),
        ({"num_steps": 5}, None),
        ({"task": {"prompts_per_step": 8, "samples_per_prompt": 2}}, "task.prompts_per_step would change them"),
        ({"seed": 1, "trainer": {"optimizer": {"learning_rate": 0.1}}}, "seed, trainer.optimizer.learning_rate"),
        ({"num_steps": 1}, "num_steps 1 is below the run's 2: a resume may only extend a run"),
    ],
)
def test_a_resume_may_change_what_keeps_its_results_and_nothing_else(tmp_path, change, refused):
    saved = validate(_config(tmp_path, "r"))
    changed = validate(_config(tmp_path, "r") | change)
    if refused is None:
        check_resumable(saved, changed)
        return
    with pytest.raises(ConfigError, match=refused) as error:
        check_resumable(saved, changed)
    assert "\n" not in str(error.value)
    if "would change them" in refused:
        assert all(key in str(error.value) for key in RESUMABLE)


def test_a_schedule_that_ends_its_last_step_differently_cannot_be_extended(tmp_path):
    cut = {"schedule": {"kind": "partial", "cut_tokens": 8}}
    with pytest.raises(ConfigError, match=r"num_steps: schedule.kind 'partial' .* cannot be extended"):
        check_resumable(validate(_config(tmp_path, "r") | cut), validate(_config(tmp_path, "r", num_steps=3) | cut))


def test_a_finished_run_resumed_with_more_steps_and_another_port_equals_the_longer_run(tmp_path):
    short = _write(tmp_path, _config(tmp_path, "extended"))
    assert _invoke(str(short)).exit_code == 0
    resumed = _invoke("--resume", str(tmp_path / "extended"), "--set", "num_steps=3", "--set", "metrics.port=0")
    assert resumed.exit_code == 0, resumed.output
    assert _invoke(str(_write(tmp_path, _config(tmp_path, "long", num_steps=3)))).exit_code == 0
    extended, long = RunDirectory(tmp_path / "extended"), RunDirectory(tmp_path / "long")
    assert [(r.rollout_digest, r.rewards_checksum) for r in extended.read_steps()] == [
        (r.rollout_digest, r.rewards_checksum) for r in long.read_steps()
    ]
    assert extended.latest_checkpoint().name == "step-000002"
    weights, expected = _last_weights(extended.path), _last_weights(long.path)
    assert all((weights[name] == expected[name]).all() for name in expected)
    assert extended.load_config().num_steps == 3  # a later resume continues from there
    refused = _invoke("--resume", str(tmp_path / "extended"), "--set", "task.samples_per_prompt=4")
    assert refused.exit_code == 2 and "task.samples_per_prompt would change them" in refused.output


def test_a_taken_run_name_fails_before_anything_starts_and_the_suggested_name_works(tmp_path, monkeypatch):
    path = _write(tmp_path, _config(tmp_path, "taken", num_steps=1))
    assert _invoke(str(path)).exit_code == 0
    started = []
    build_parts = bubblespec.run.launch.build_parts
    monkeypatch.setattr(bubblespec.run.launch, "build_parts", lambda config: started.append(1) or build_parts(config))
    result = _invoke(str(path))
    assert result.exit_code == 2 and not started, result.output  # neither Ray nor an engine started
    message = result.output.strip().splitlines()[-1]
    assert message.startswith(f"error: run directory {str(tmp_path / 'taken')!r} already exists")
    suggested = message.split("--set ", 1)[1].split(" ", 1)[0]  # name=taken-2
    assert suggested == "name=taken-2"
    again = _invoke(str(path), "--set", suggested)
    assert again.exit_code == 0 and started, again.output
    assert (tmp_path / "taken-2" / "steps.jsonl").is_file()


def test_a_run_that_fails_while_starting_leaves_no_directory_behind(tmp_path, monkeypatch):
    """A port that is taken: the same command works again once it is free, with no `--resume` needed."""

    def fails(config):
        raise ConfigError("metrics.port 1 is already in use")

    monkeypatch.setattr(bubblespec.run.launch, "build_parts", fails)
    result = _invoke(str(_write(tmp_path, _config(tmp_path / "runs", "failed"))))
    assert result.exit_code == 2 and "already in use" in result.output
    assert not (tmp_path / "runs").exists()  # made for the run, removed with it


def _start(config_file: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [*RUN, str(config_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )


def _wait_for_steps(process: subprocess.Popen, run_dir: Path, steps: int, timeout_s: float = 300.0) -> None:
    """Until the run has written ``steps`` step lines (the event the signal is sent at)."""
    steps_file = run_dir / "steps.jsonl"
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline:
        if steps_file.exists() and steps_file.read_text().count("\n") >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {steps}: {process.communicate()[1][-2000:]}")


def _stopped_cleanly(process: subprocess.Popen, run_dir: Path) -> None:
    """Exit 143, one line saying how to resume, no traceback or stack dump, a checkpoint to resume from."""
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "SIGTERM received" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("terminated (SIGTERM): ")]
    assert f"`bubblespec run --resume {run_dir}` continues from it exactly" in line
    assert RunDirectory(run_dir).latest_checkpoint() is not None


def test_sigterm_to_the_run_stops_it_as_ctrl_c_does(tmp_path):
    """(That a resume from the checkpoint kept equals the uninterrupted run: test_rl_loop.py.)"""
    config = _config(tmp_path, "term", num_steps=200)
    process = _start(_write(tmp_path, config))
    _wait_for_steps(process, tmp_path / "term", 2)
    process.send_signal(signal.SIGTERM)
    _stopped_cleanly(process, tmp_path / "term")


@contextlib.contextmanager
def _another_users_ray_and_metrics_port():
    """Someone's Ray cluster started with ``ray start --head`` as a user would, in Ray's default temp dir, where a
    ``ray.init()`` without an address finds and joins it; and port 9464 held, as on a shared machine. Yields their
    cluster's address; stops it at the end (its processes are those that name its GCS port)."""
    from tests.prometheus import free_port

    port = free_port()
    try:
        started = subprocess.run(
            ["ray", "start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
             "--disable-usage-stats"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert started.returncode == 0, started.stderr[-2000:]
        with socket.socket() as holder:
            with contextlib.suppress(OSError):  # held by another process already: the same case
                holder.bind(("127.0.0.1", DEFAULT_PORT))
                holder.listen()
            yield f"127.0.0.1:{port}"
    finally:
        processes = [p for p in psutil.process_iter(["cmdline"]) if _names_port(p.info["cmdline"] or [], port)]
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(processes, timeout=30)
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"  # where ray.init() looks: theirs
        if current.is_file() and f":{port}" in current.read_text():
            current.unlink()


def _names_port(arguments: list[str], port: int) -> bool:
    return any(a.endswith(f":{port}") or a == f"--gcs_server_port={port}" for a in arguments)


@pytest.mark.ray
@pytest.mark.slow
def test_beside_another_users_ray_a_run_starts_its_own_and_sigterm_to_its_group_stops_it_and_only_it(tmp_path):
    """A shared machine: someone's Ray runs and port 9464 is taken. A wall-clock run without ray.address starts a Ray
    of its own instead of joining theirs (which failed: Ray refuses num_cpus when joining) and serves its metrics
    elsewhere. Then, as SLURM stops a job, every process of its group gets SIGTERM, its local Ray's too: the run stops
    as on Ctrl-C, leaves no Ray process of its own behind, and their cluster runs on."""
    config = _config(tmp_path, "group", num_steps=50) | {"clock": {"kind": "wall"}, "eval_every": 0, "metrics": {}}
    with _another_users_ray_and_metrics_port() as theirs:
        process = _start(_write(tmp_path, config), start_new_session=True)
        _wait_for_steps(process, tmp_path / "group", 2)
        _, port, _ = target_of(tmp_path / "group")
        assert port != DEFAULT_PORT
        ray_processes = psutil.Process(process.pid).children(recursive=True)
        assert any("raylet" in " ".join(p.cmdline()) for p in ray_processes)  # its own, started by the run
        os.killpg(process.pid, signal.SIGTERM)
        _stopped_cleanly(process, tmp_path / "group")
        _, alive = psutil.wait_procs(ray_processes, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
        status = subprocess.run(["ray", "status", f"--address={theirs}"], capture_output=True, timeout=120)
        assert status.returncode == 0  # their cluster runs on
