"""Reading a run's live metrics endpoint in tests: by port, or by the target file the run writes for Prometheus."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bubblespec.observe.metrics import target_path


def scrape(port: int, host: str = "127.0.0.1") -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of the live endpoint."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def target_of(run_dir: Path) -> tuple[str, int, dict]:
    """(host, port, labels) of the run's service-discovery target."""
    (group,) = json.loads(target_path(run_dir).read_text())
    (address,) = group["targets"]
    host, _, port = address.rpartition(":")
    return host, int(port), group["labels"]


def scrape_run(run_dir: Path) -> dict[tuple[str, tuple], float]:
    """The live endpoint of the run writing ``run_dir``, found as Prometheus finds it."""
    _, port, _ = target_of(run_dir)
    return scrape(port)
