"""Killing a `bubblespec run` process partway and resuming it, for the crash tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import yaml

from bubblespec.core.config import RunConfig
from bubblespec.observe.run_dir import RunDirectory

RUN = [sys.executable, "-m", "bubblespec.cli.main", "run", "--quiet"]


def kill_after_steps(config: RunConfig, num_steps: int, timeout_s: float = 300.0) -> None:
    """Starts ``bubblespec run`` on ``config`` and SIGKILLs it once ``num_steps`` step lines are in its log."""
    config_file = config.run_dir.parent / f"{config.name}.yaml"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    # metrics on a free port: another test may run at the same time (two pytest workers)
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json") | {"metrics": {"port": 0}}))
    process = subprocess.Popen([*RUN, str(config_file)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    steps = RunDirectory(config.run_dir).steps_file
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline:
        if steps.exists() and steps.read_text().count("\n") >= num_steps:
            break
        time.sleep(0.01)
    assert process.poll() is None, f"the run ended before it could be killed: {process.stderr.read().decode()}"
    # As when its machine dies: the process and everything it started (a local Ray's processes; some of Ray's
    # agents outlive a killed driver and would load the next test's Ray).
    tree = psutil.Process(process.pid).children(recursive=True)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    for child in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(tree, timeout=30)


def resume(config: RunConfig) -> None:
    """``bubblespec run --resume`` on the run directory of ``config``; it must succeed."""
    resumed = subprocess.run([*RUN, "--resume", str(config.run_dir)], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
