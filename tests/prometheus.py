"""A real Prometheus for tests: started on a free port with the shipped scrape config (dashboards/prometheus.yml)
and alert rules (dashboards/rules.yml), scraping every second the runs that write their targets under one
output_dir."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from bubblespec.observe.metrics import TARGETS_DIR

DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Prometheus:
    """A Prometheus answering at ``url`` that scrapes every run writing its target under ``output_dir``."""

    def __init__(self, url: str, output_dir: Path) -> None:
        self.url = url
        self.output_dir = output_dir

    def get(self, path: str, **params) -> dict:
        address = f"{self.url}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(address, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:
            pytest.fail(f"Prometheus answered {error.code} to {path} {params}: {error.read().decode()}")
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> dict:
        return self.get("/api/v1/query", query=expr, **({} if at is None else {"time": f"{at:.3f}"}))

    def value(self, expr: str, at: float | None = None) -> float | None:
        """The value of a query that gives at most one series (None: no series)."""
        result = self.query(expr, at)["result"]
        assert len(result) <= 1, f"{expr} gave {len(result)} series: {result}"
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, expected: float, timeout_s: float = 20.0) -> float:
        """Waits until ``expr`` (one series) equals ``expected``; returns the evaluation time that saw it."""
        deadline = time.monotonic() + timeout_s
        answer = None
        while time.monotonic() < deadline:
            answer = self.query(expr)["result"]
            if len(answer) == 1 and float(answer[0]["value"][1]) == expected:
                return float(answer[0]["value"][0])
            time.sleep(0.1)
        pytest.fail(f"Prometheus did not see {expr} == {expected} within {timeout_s:.0f} s; its last answer: {answer}")

    def wait_for_series(self, expr: str, timeout_s: float = 20.0) -> list[dict]:
        """Waits until ``expr`` gives at least one series; returns them."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = self.query(expr)["result"]
            if result:
                return result
            time.sleep(0.2)
        pytest.fail(f"Prometheus gave no series for {expr} within {timeout_s:.0f} s")

    def wait_for_steps(self, run: str, num_steps: int, timeout_s: float = 20.0) -> float:
        """Waits until a scrape of run ``run`` has seen ``num_steps`` finished steps."""
        return self.wait_for(f'bubblespec_steps_total{{run="{run}"}}', num_steps, timeout_s)


def alert_expression(alert: str) -> str:
    """The PromQL of ``alert`` in dashboards/rules.yml (without its ``for``: true as soon as the condition is)."""
    groups = yaml.safe_load((DASHBOARDS / "rules.yml").read_text())["groups"]
    (expr,) = [rule["expr"] for group in groups for rule in group["rules"] if rule.get("alert") == alert]
    return expr


def prometheus_binary(name: str = "prometheus") -> str:
    """The path of ``prometheus`` (or ``promtool``, which comes with it)."""
    binary = shutil.which(name)
    if binary is not None:
        return binary
    if os.environ.get("BUBBLESPEC_SKIP_PROMETHEUS") == "1":
        pytest.skip(f"no {name} binary on PATH and BUBBLESPEC_SKIP_PROMETHEUS=1")
    pytest.fail(
        f"no {name} binary on PATH: install Prometheus (apt-get install -y prometheus) or set "
        "BUBBLESPEC_SKIP_PROMETHEUS=1 to skip the tests that need a real Prometheus"
    )


def scrape_config_for(output_dir: Path) -> dict:
    """The shipped scrape config, finding the targets of runs under ``output_dir``, scraping and evaluating its
    rules every second."""
    scrape = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    scrape["global"] |= {"scrape_interval": "1s", "evaluation_interval": "1s"}
    scrape["rule_files"] = [str(DASHBOARDS / name) for name in scrape["rule_files"]]
    (job,) = [job for job in scrape["scrape_configs"] if job["job_name"] == "bubblespec"]
    (discovery,) = job["file_sd_configs"]
    discovery["files"] = [str(output_dir / TARGETS_DIR / "*.json")]
    discovery["refresh_interval"] = "1s"
    return scrape


@contextlib.contextmanager
def running_prometheus(workdir: Path, output_dir: Path) -> Iterator[Prometheus]:
    binary = prometheus_binary()
    web_port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config_for(output_dir)))
    log = workdir / "prometheus.log"
    url = f"http://127.0.0.1:{web_port}"
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{web_port}",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while not _ready(url):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"Prometheus did not become ready at {url}; its log:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield Prometheus(url, output_dir)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as response:
            return response.status == 200
    except OSError:  # not listening yet, or 503 while it starts
        return False
