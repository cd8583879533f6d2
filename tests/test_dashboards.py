"""dashboards/: the Grafana dashboard names only metrics the code exports, and every one of its queries returns
plausible numbers on a real Prometheus that scraped a real (virtual-clock) run through the shipped scrape config."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from bubblespec.config import RunConfig, validate
from bubblespec.launch import run
from bubblespec.metrics import ACCEPTANCE_LENGTH_BUCKETS, TARGETS_DIR, RunMetrics, metric_names
from bubblespec.records import StepRecord
from tests.prometheus import DASHBOARDS, prometheus_binary, running_prometheus

METRIC_NAME = re.compile(r"bubblespec_[a-z_]+")
VARIABLE = re.compile(r"\$\{?(\w+)\}?")
LABEL_VALUES = re.compile(r"label_values\((\w+),\s*(\w+)\)")
GRAFANA_RANGES = {"__rate_interval", "__interval", "__range"}
"""Grafana's built-in range variables; the test substitutes a window that covers the whole run."""
WINDOW = "5m"
NUM_STEPS = 4
NUM_RANKS = 3
MAX_DRAFT_TOKENS = 16
POSITIVE = math.ulp(0.0)
PLAUSIBLE = {
    # panel title: (lowest, highest) value of every series of every query, for the run of run_config()
    "Steps done": (NUM_STEPS, NUM_STEPS),
    "Policy version": (NUM_STEPS, NUM_STEPS),
    "Steps per minute (wall clock)": (POSITIVE, math.inf),
    "Bubble utilisation (run)": (0, 1),
    "Decode steps saved (run)": (0, 1),
    "Acceptance length (run)": (1, MAX_DRAFT_TOKENS + 1),
    "Bubble utilisation per rank": (0, 1),
    "Bubble seconds per step": (0, math.inf),
    "Preemption latency": (POSITIVE, math.inf),
    "Phase seconds per step": (POSITIVE, math.inf),
    # quantiles interpolate inside the histogram bucket that holds the longest acceptance (up to le=24)
    "Acceptance length": (1, min(b for b in ACCEPTANCE_LENGTH_BUCKETS if b >= MAX_DRAFT_TOKENS + 1)),
    "Decode steps saved": (0, 1),
    "Decode steps saved per step": (0, math.inf),
    "Draft coverage": (0, 1),
    "Draft tokens accepted": (0, 1),
    "Rank work per step": (0, math.inf),
    "Rollout tokens per second": (POSITIVE, math.inf),
    "Reward": (0, 1),  # the arithmetic task's reward is 0 or 1 per sample
    "Policy version and steps": (1, NUM_STEPS),
    "Draft store": (0, 1e6),  # tokens held (a few thousand in this run) and evictions (none under the default cap)
    "Loss and gradient norm": (-10, 100),
    "Learning rate": (POSITIVE, 1e-2),
    "Entropy and KL": (0, 10),  # nats per token: the shipped vocabulary has 19 tokens (log 19 = 2.94)
    "Importance ratio": (POSITIVE, 100),  # two epochs: the second moves it off 1 (to 0.06 for one token here)
    "Clip fractions": (0, 1),
    "Trained tokens and optimizer steps": (0, math.inf),
    "Engine-trainer logprob agreement": (0, 1),
}


def load_dashboard() -> dict:
    return json.loads((DASHBOARDS / "bubblespec.json").read_text())


def query_panels(dashboard: dict) -> list[dict]:
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def expressions(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, refId, PromQL) of every target of every panel."""
    return [
        (panel["title"], target["refId"], target["expr"])
        for panel in query_panels(dashboard)
        for target in panel["targets"]
    ]


def variable_queries(dashboard: dict) -> list[str]:
    return [variable["query"]["query"] for variable in dashboard["templating"]["list"] if variable["type"] == "query"]


def run_config(output_dir: Path, name: str, num_steps: int, metrics: dict):
    """A short virtual-clock run on the h100-7b profile: with 3 ranks some rank is still drafting at most
    barriers, so the preemption histogram gets observations."""
    return validate(
        {
            "name": name,
            "output_dir": str(output_dir),
            "num_steps": num_steps,
            "eval_every": 1,
            "eval_prompts": 4,
            "task": {"prompts_per_step": 4, "samples_per_prompt": 2},
            "rollout": {
                "num_ranks": NUM_RANKS,
                "max_draft_tokens_per_step": MAX_DRAFT_TOKENS,
                "sampling": {"max_new_tokens": 48},
            },
            "speculation": {"enabled": True},
            "trainer": {"ppo_epochs": 2, "kl": {"coef": 0.01}},  # every training panel has a series
            "clock": {"kind": "virtual", "profile": "h100-7b"},
            "metrics": metrics,
        }
    )


def assert_preempted(records: list[StepRecord]) -> None:
    preempted = [rank.rank for record in records for rank in record.ranks if rank.preemption_latency_seconds]
    assert preempted, "no rank was drafting at any barrier, so the preemption histogram is empty; change run_config()"


@pytest.fixture(scope="module")
def exported_names(tmp_path_factory) -> set[str]:
    """Every sample name of a registry fed with a real run's step records (histogram and labelled counter
    samples exist only after an observation)."""
    records = []
    run(run_config(tmp_path_factory.mktemp("names"), "names", 2, {"enabled": False}), on_step=records.append)
    assert_preempted(records)
    metrics = RunMetrics()
    metrics.observe_history(records)
    return metric_names(metrics.registry)


def test_dashboard_is_an_importable_grafana_dashboard():
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 36 and dashboard["title"] and dashboard["uid"]
    assert [(i["name"], i["type"], i["pluginId"]) for i in dashboard["__inputs"]] == [
        ("DS_PROMETHEUS", "datasource", "prometheus")
    ]
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    rank = variables["rank"]
    assert rank["type"] == "query" and rank["multi"] and rank["includeAll"]
    assert rank["query"]["query"] == "label_values(bubblespec_generated_tokens_total, rank)"
    panels = query_panels(dashboard)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {sorted(ids)}"
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    assert rank["datasource"] == datasource
    for panel in panels:
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert panel["datasource"] == datasource, panel["title"]
        for target in panel["targets"]:
            assert target["expr"] and target["refId"] and target["datasource"] == datasource, panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
    assert {panel["title"] for panel in panels} == set(PLAUSIBLE), "PLAUSIBLE must name every panel exactly"


def test_every_variable_a_query_uses_is_defined():
    dashboard = load_dashboard()
    defined = {variable["name"] for variable in dashboard["templating"]["list"]} | GRAFANA_RANGES
    for title, ref_id, expr in expressions(dashboard):
        unknown = set(VARIABLE.findall(expr)) - defined
        assert not unknown, f"panel {title!r} query {ref_id} uses undefined variables {sorted(unknown)}"
        if METRIC_NAME.search(expr) and "rank" in expr:
            assert 'rank=~"$rank"' in expr, f"panel {title!r} query {ref_id} filters ranks without $rank"


def test_every_metric_the_dashboard_names_is_exported(exported_names):
    dashboard = load_dashboard()
    named = [
        (title, ref_id, name) for title, ref_id, expr in expressions(dashboard) for name in METRIC_NAME.findall(expr)
    ]
    named += [
        ("(variables)", "-", name) for query in variable_queries(dashboard) for name in METRIC_NAME.findall(query)
    ]
    assert named
    missing = [f"panel {title!r} query {ref_id}: {name}" for title, ref_id, name in named if name not in exported_names]
    assert not missing, "the dashboard names metrics that bubblespec does not export:\n" + "\n".join(missing)


def test_scrape_config_finds_the_targets_of_runs_in_the_default_output_dir():
    """The shipped config's file-based discovery reads the target of every run under the default output_dir of this
    checkout (paths relative to the config file), loads the alert rules, and promtool accepts it."""
    scrape = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    (job,) = [job for job in scrape["scrape_configs"] if job["job_name"] == "bubblespec"]
    (discovery,) = job["file_sd_configs"]
    output_dir = DASHBOARDS.parent / RunConfig.model_fields["output_dir"].default
    assert [(DASHBOARDS / pattern).resolve() for pattern in discovery["files"]] == [
        (output_dir / TARGETS_DIR / "*.json").resolve()
    ]
    assert scrape["rule_files"] == ["rules.yml"]
    check = subprocess.run(
        [prometheus_binary("promtool"), "check", "config", str(DASHBOARDS / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr


# --- A real Prometheus ------------------------------------------------------------------------------------------


@pytest.fixture
def prometheus(tmp_path):
    (tmp_path / "prometheus").mkdir()
    with running_prometheus(tmp_path / "prometheus", tmp_path / "runs") as server:
        yield server


def grafana_to_promql(expr: str) -> str:
    """Substitutes the dashboard's variables as Grafana would with every rank selected and a run-long window."""
    values = {"rank": ".*", "run": ".*", "job": "bubblespec", "window": WINDOW} | dict.fromkeys(GRAFANA_RANGES, WINDOW)
    return VARIABLE.sub(lambda match: values[match.group(1)], expr)


@pytest.mark.prometheus
@pytest.mark.slow
def test_every_dashboard_query_returns_plausible_values_from_a_real_run(prometheus, tmp_path):
    records, seen_at = [], []

    def wait_for_scrape(record: StepRecord) -> None:
        # The run's endpoint goes away when it ends: hold each step until Prometheus has scraped it, which also
        # gives every counter one sample per step for increase() and rate().
        records.append(record)
        seen_at.append(prometheus.wait_for_steps("dashboard", record.step + 1))

    run(run_config(prometheus.output_dir, "dashboard", NUM_STEPS, {"port": 0}), on_step=wait_for_scrape)
    assert len(records) == NUM_STEPS
    assert_preempted(records)
    at = seen_at[-1]  # the last scrape of the live endpoint; later ones find it gone and mark the series stale

    dashboard = load_dashboard()
    for query in variable_queries(dashboard):
        metric, label = LABEL_VALUES.fullmatch(query).groups()
        values = prometheus.get(f"/api/v1/label/{label}/values", **{"match[]": metric, "start": at - 300, "end": at})
        assert sorted(values) == [str(rank) for rank in range(NUM_RANKS)], query
    for title, ref_id, expr in expressions(dashboard):
        promql = grafana_to_promql(expr)
        answer = prometheus.query(promql, at=at)
        where = f"panel {title!r} query {ref_id}: {promql}"
        assert answer["resultType"] == "vector", where
        assert answer["result"], f"{where} returned no series"
        low, high = PLAUSIBLE[title]
        for series in answer["result"]:
            value = float(series["value"][1])
            assert math.isfinite(value) and low <= value <= high, f"{where} gave {value} for {series['metric']}"
