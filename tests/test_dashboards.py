"""dashboards/: the Grafana dashboard names only metrics the code exports, keeps every run apart (variables job and run
on every selector, every aggregation by run), marks the seconds of the run's clock, and every one of its queries
returns plausible numbers, each series of the run asked for, on a real Prometheus that scraped a real (virtual-clock)
run through the shipped scrape config."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from bubblespec.core.config import RunConfig, validate
from bubblespec.observe.metrics import ACCEPTANCE_LENGTH_BUCKETS, RUN_CLOCK, TARGETS_DIR, RunMetrics, metric_names
from bubblespec.observe.records import StepRecord
from bubblespec.run.launch import run
from tests.prometheus import DASHBOARDS, prometheus_binary, running_prometheus

METRIC_NAME = re.compile(r"\b(?:bubblespec|process)_[a-z_]+")
SELECTOR = re.compile(r"(?<![\w:])(bubblespec_\w+|process_\w+|up)\b(?!\s*\()(\{[^}]*\})?")
"""A metric name (not a function call such as ``max_over_time(``) and its label matchers, if any."""
AGGREGATION = re.compile(
    r"\b(sum|avg|min|max|count|group|stddev|stdvar|quantile|topk|bottomk|count_values)\b\s*(?:(by|without)\s*\(([^)]*)\))?\s*\("
)
"""An aggregation operator and its grouping, written before its parentheses (``sum by (run) (...)``): a word with
``_`` after it (``max_over_time``, ``group_left``) or before it (``clamp_min``, ``histogram_quantile``, ``_count``)
is no operator. A grouping written after (``sum(...) by (run)``) reads as none, and fails."""
VECTOR_MATCHING = re.compile(r"\bon\s*\(([^)]*)\)")
VARIABLE = re.compile(r"\$\{?(\w+)\}?")
LABEL_VALUES = re.compile(r"label_values\((\w+)(\{[^}]*\})?,\s*(\w+)\)")
QUERY_RESULT = re.compile(r"query_result\((.*)\)")
JS_REGEX = re.compile(r"/(.*)/([gimsuy]*)")
GRAFANA_RANGES = {"__rate_interval", "__interval", "__range"}
"""Grafana's built-in range variables; the test substitutes a window that covers the whole run."""
WINDOW = "5m"
DEFAULT_WINDOW_SECONDS = 300
"""The window variable's value where a test does not ask Prometheus for it: more than a test run lasts."""
JOB_AND_RUN = ('job=~"$job"', 'run=~"$run"')
CLOCK_MARK = "run clock (simulated under clock.kind virtual)"
CLOCK_JOIN = re.compile(r"\* on \(run\) group_left \(clock\) group by \(run, clock\) \(bubblespec_run_info\{[^}]*\}\)")
CLOCK_FREE_RATIOS = {
    # panels that divide seconds of the run's clock by seconds of the same clock: the same number on either clock
    "Bubble utilisation (run)",
    "Bubble utilisation (fleet and lowest 3 ranks)",
    "Bubble utilisation by rank",
    "Rank generation time / median rank",
}
LOG_AXES = {"Learning rate", "Engine-trainer logprob agreement"}
INSTANT_PANELS = {"stat", "bargauge", "table"}
"""Panels that show one value per series: instant queries (a range query's last point can be a step old)."""
LIVENESS = {
    "Run info",
    "Seconds since last step",
    "Last step wall seconds",
    "Target up",
    "Ranks by state",
    "Replica replacements and trainer restarts",
    "Process resident memory",
    "Process CPU",
    "Working rank silence (in longest recent steps)",
}
NUM_STEPS = 4
NUM_RANKS = 3
MAX_DRAFT_TOKENS = 16
RUN = "dashboard"
POSITIVE = math.ulp(0.0)
PLAUSIBLE = {
    # panel title: (lowest, highest) value of every series of every query, for the run of run_config()
    "Run info": (1, 1),
    "Seconds since last step": (0, 60),  # read right after the last step's scrape
    "Last step wall seconds": (POSITIVE, 600),
    "Target up": (1, 1),
    "Ranks by state": (0, NUM_RANKS),
    "Replica replacements and trainer restarts": (0, 0),  # none in a local run
    "Process resident memory": (1e6, 1e12),
    "Process CPU": (0, 1024),
    "Working rank silence (in longest recent steps)": (0, 100),
    "Steps done": (NUM_STEPS, NUM_STEPS),
    "Policy version": (NUM_STEPS, NUM_STEPS),
    "Steps per minute (wall clock)": (POSITIVE, math.inf),
    "Bubble utilisation (run)": (0, 1),
    "Decode steps saved (run)": (0, 1),
    "Acceptance length (run)": (1, MAX_DRAFT_TOKENS + 1),
    "Bubble utilisation (fleet and lowest 3 ranks)": (0, 1),
    "Bubble utilisation by rank": (0, 1),
    "Bubble seconds per step": (0, math.inf),
    "Preemption latency": (POSITIVE, math.inf),
    "Phase seconds per step": (POSITIVE, math.inf),
    "Generation seconds per step (median and slowest 3 ranks)": (POSITIVE, math.inf),
    "Rank generation time / median rank": (POSITIVE, 100),
    # quantiles interpolate inside the histogram bucket that holds the longest acceptance (up to le=24)
    "Acceptance length": (1, min(b for b in ACCEPTANCE_LENGTH_BUCKETS if b >= MAX_DRAFT_TOKENS + 1)),
    "Decode steps saved (fleet and lowest 3 ranks)": (0, 1),
    "Decode steps saved per step": (0, math.inf),
    "Draft coverage (fleet and lowest 3 ranks)": (0, 1),
    "Draft tokens accepted (fleet and lowest 3 ranks)": (0, 1),
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


def variables(dashboard: dict) -> dict[str, dict]:
    return {variable["name"]: variable for variable in dashboard["templating"]["list"]}


def variable_queries(dashboard: dict) -> dict[str, str]:
    """Variable name: query, of every query variable."""
    return {name: v["query"]["query"] for name, v in variables(dashboard).items() if v["type"] == "query"}


def families() -> list:
    """The metric families a run exports (one rank's series created)."""
    return list(RunMetrics(num_ranks=1).registry.collect())


def sample_names(family) -> set[str]:
    return {family.name} | {family.name + suffix for suffix in ("_total", "_info", "_bucket", "_sum", "_count")}


def run_config(output_dir: Path, name: str, num_steps: int, metrics: dict, num_ranks: int = NUM_RANKS):
    """A short virtual-clock run on the h100-7b profile: with 3 ranks some rank is still drafting at most
    barriers, so the preemption histogram gets observations. Each rank gets at least two responses."""
    return validate(
        {
            "name": name,
            "output_dir": str(output_dir),
            "num_steps": num_steps,
            "eval_every": 1,
            "eval_prompts": 4,
            "task": {"prompts_per_step": max(4, num_ranks), "samples_per_prompt": 2},
            "rollout": {
                "num_ranks": num_ranks,
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
    panel_types = {panel["type"] for panel in dashboard["panels"]} - {"row"}
    assert panel_types <= {r["id"] for r in dashboard["__requires"] if r["type"] == "panel"}
    panels = query_panels(dashboard)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), f"panel ids repeat: {sorted(ids)}"
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    for panel in panels:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert panel["datasource"] == datasource, panel["title"]
        for target in panel["targets"]:
            assert target["expr"] and target["refId"] and target["datasource"] == datasource, panel["title"]
            assert "{{run}}" in target["legendFormat"], f"panel {panel['title']!r}: the legend must name the run"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
    assert {panel["title"] for panel in panels} == set(PLAUSIBLE), "PLAUSIBLE must name every panel exactly"


def test_panels_tile_a_24_column_grid_and_liveness_comes_first():
    dashboard = load_dashboard()
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert set(grid) == {"x", "y", "w", "h"} and grid["x"] >= 0 and grid["w"] > 0 and grid["h"] > 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, f"panel {panel['title']!r} is wider than the grid: {grid}"
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"panels {cells[x, y]!r} and {panel['title']!r} overlap at {(x, y)}"
                cells[x, y] = panel["title"]
    ordered = sorted(dashboard["panels"], key=lambda panel: (panel["gridPos"]["y"], panel["gridPos"]["x"]))
    assert ordered == dashboard["panels"], "panels must be listed in reading order (Grafana groups them under rows)"
    first, *rest = ordered
    assert first["type"] == "row" and first["title"].startswith("Liveness") and first["gridPos"]["y"] == 0
    next_row = next(i for i, panel in enumerate(rest) if panel["type"] == "row")
    assert {panel["title"] for panel in rest[:next_row]} == LIVENESS


def test_variables_select_job_run_rank_and_a_window_of_about_four_steps():
    dashboard = load_dashboard()
    defined = variables(dashboard)
    assert list(defined) == ["datasource", "job", "run", "rank", "window"]
    assert defined["datasource"]["type"] == "datasource" and defined["datasource"]["query"] == "prometheus"
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    for name in ("job", "run", "rank", "window"):
        assert defined[name]["type"] == "query" and defined[name]["datasource"] == datasource, name
        assert defined[name]["refresh"] == 2, f"{name} must follow the time range"
    queries = variable_queries(dashboard)
    assert queries["job"] == "label_values(bubblespec_steps_total, job)"
    assert queries["run"] == 'label_values(bubblespec_steps_total{job=~"$job"}, run)'
    assert queries["rank"] == 'label_values(bubblespec_generated_tokens_total{job=~"$job",run=~"$run"}, rank)'
    for name in ("run", "rank"):
        assert defined[name]["multi"] and defined[name]["includeAll"] and defined[name]["allValue"] == ".*", name
    window = defined["window"]
    assert QUERY_RESULT.fullmatch(queries["window"]) and JS_REGEX.fullmatch(window["regex"])
    inner = QUERY_RESULT.fullmatch(queries["window"]).group(1)
    assert "bubblespec_step_wall_seconds" in inner and "4 *" in inner and "60" in inner
    assert "four" in window["description"] and "60 s" in window["description"]
    # Grafana's query_result writes each series as "NAME{LABELS} VALUE TIMESTAMP_MS"; the regex keeps VALUE
    regex = python_regex(window["regex"])
    assert regex.search("{} 300 1700000000000").group(1) == "300"
    assert regex.search("{} 60 1700000000123.0002").group(1) == "60"
    for expr in (expr for _, _, expr in expressions(dashboard) if "window" in VARIABLE.findall(expr)):
        assert "[${window}s]" in expr and not re.search(r"\$window|\$\{window\}(?!s\])", expr), expr


def test_every_variable_a_query_uses_is_defined():
    dashboard = load_dashboard()
    defined = set(variables(dashboard)) | GRAFANA_RANGES
    queries = [*expressions(dashboard), *(("(variable)", name, q) for name, q in variable_queries(dashboard).items())]
    for title, ref_id, expr in queries:
        unknown = set(VARIABLE.findall(expr)) - defined
        assert not unknown, f"panel {title!r} query {ref_id} uses undefined variables {sorted(unknown)}"


def test_every_selector_filters_job_run_and_rank_and_every_aggregation_keeps_the_run():
    """Runs never mix: each metric selector carries job=~"$job" and run=~"$run" (and rank=~"$rank" for per-rank
    metrics), each aggregation groups by run (per-rank views by run and rank), and each vector match is on run.
    Ratios are then of sums of one run. A textual check, not a parser: the real-Prometheus test below checks that
    every series of every query carries the run."""
    dashboard = load_dashboard()
    per_rank = {
        name
        for family in families()
        if any("rank" in sample.labels for sample in family.samples)
        for name in sample_names(family)
    }
    queries = expressions(dashboard)
    queries += [("(variable)", name, q) for name, q in variable_queries(dashboard).items() if name != "job"]
    for title, ref_id, expr in queries:
        where = f"panel {title!r} query {ref_id}: {expr}"
        selectors = SELECTOR.findall(expr)
        assert selectors, where
        needed = JOB_AND_RUN[:1] if (title, ref_id) == ("(variable)", "run") else JOB_AND_RUN
        for name, matchers in selectors:
            missing = [m for m in needed if m not in matchers]
            assert not missing, f"{where}: selector {name}{matchers} lacks {missing}"
            if name in per_rank and title != "(variable)":
                assert 'rank=~"$rank"' in matchers, f"{where}: selector {name}{matchers} lacks $rank"
        if title == "(variable)":
            continue
        aggregations = [match.groups() for match in AGGREGATION.finditer(expr)]
        assert aggregations, f"{where}: aggregate by run (one series per run, whatever the instance)"
        for operator, grouping, labels in aggregations:
            assert grouping == "by", f"{where}: write `{operator} by (run, ...) (...)`"
            assert "run" in re.split(r"\s*,\s*", labels.strip()), f"{where}: {operator} by ({labels}) drops the run"
        for labels in VECTOR_MATCHING.findall(expr):
            assert "run" in re.split(r"\s*,\s*", labels.strip()), f"{where}: on ({labels}) ignores the run"


def test_one_value_panels_are_instant_and_learning_rate_and_logprobs_are_on_log_axes():
    for panel in query_panels(load_dashboard()):
        instant = panel["type"] in INSTANT_PANELS
        for target in panel["targets"]:
            assert (target["instant"], target["range"]) == (instant, not instant), panel["title"]
        scale = panel["fieldConfig"]["defaults"].get("custom", {}).get("scaleDistribution")
        if panel["title"] in LOG_AXES:
            assert scale == {"type": "log", "log": 10}, panel["title"]
        else:
            assert scale in (None, {"type": "linear"}), panel["title"]
    assert LOG_AXES <= {panel["title"] for panel in query_panels(load_dashboard())}


def test_seconds_of_the_run_clock_are_labelled_with_the_clock():
    """A panel that shows seconds of the run's clock (simulated under clock.kind virtual; bubblespec/observe/metrics.py
    marks them in their help) says so and joins the run's clock into every legend, unless it divides them by seconds of
    the same clock."""
    run_clock = {
        name for family in families() if RUN_CLOCK.strip() in family.documentation for name in sample_names(family)
    }
    assert "bubblespec_phase_seconds_total" in run_clock and "bubblespec_rollout_tokens_per_second" in run_clock
    clock_panels = set()
    for panel in query_panels(load_dashboard()):
        named = {name for target in panel["targets"] for name in METRIC_NAME.findall(target["expr"])}
        if not named & run_clock or panel["title"] in CLOCK_FREE_RATIOS:
            continue
        clock_panels.add(panel["title"])
        assert CLOCK_MARK in panel["description"], f"panel {panel['title']!r} must say its seconds are the run clock"
        for target in panel["targets"]:
            assert CLOCK_JOIN.search(target["expr"]), f"panel {panel['title']!r} query {target['refId']}"
            assert "{{clock}}" in target["legendFormat"], f"panel {panel['title']!r} query {target['refId']}"
    assert {"Phase seconds per step", "Bubble seconds per step", "Preemption latency", "Rollout tokens per second"} <= (
        clock_panels
    )


def test_every_metric_the_dashboard_names_is_exported(exported_names):
    dashboard = load_dashboard()
    named = [
        (title, ref_id, name) for title, ref_id, expr in expressions(dashboard) for name in METRIC_NAME.findall(expr)
    ]
    named += [
        ("(variables)", name, metric)
        for name, query in variable_queries(dashboard).items()
        for metric in METRIC_NAME.findall(query)
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


def grafana_to_promql(expr: str, run: str = ".*", window: int = DEFAULT_WINDOW_SECONDS) -> str:
    """Substitutes the dashboard's variables as Grafana would with job bubblespec, runs matching ``run`` (".*": all),
    every rank and a window of ``window`` seconds."""
    values = {"rank": ".*", "run": run, "job": "bubblespec", "window": str(window)}
    values |= dict.fromkeys(GRAFANA_RANGES, WINDOW)
    return VARIABLE.sub(lambda match: values[match.group(1)], expr)


def python_regex(grafana_regex: str) -> re.Pattern:
    """A variable's regex, written /PATTERN/FLAGS as Grafana takes it (JavaScript syntax; the patterns used here mean
    the same in Python)."""
    pattern, flags = JS_REGEX.fullmatch(grafana_regex).groups()
    return re.compile(pattern, re.IGNORECASE if "i" in flags else 0)


def query_result_texts(answer: dict) -> list[str]:
    """What Grafana's query_result() makes of an instant query's answer: one "NAME{LABELS} VALUE TIMESTAMP_MS" text
    per series (public/app/plugins/datasource/prometheus/metric_find_query.ts)."""
    texts = []
    for series in answer["result"]:
        labels = dict(series["metric"])
        name = labels.pop("__name__", "")
        timestamp, value = series["value"]
        text = name + "{" + ",".join(f'{key}="{label}"' for key, label in labels.items()) + "}"
        texts.append(f"{text} {value} {timestamp * 1000:.0f}")
    return texts


def window_seconds(prometheus, dashboard: dict, at: float) -> int:
    """The window variable as Grafana would compute it at ``at``: its query_result() asked of the real Prometheus,
    its regex applied to each text."""
    variable = variables(dashboard)["window"]
    inner = QUERY_RESULT.fullmatch(variable["query"]["query"]).group(1)
    texts = query_result_texts(prometheus.query(grafana_to_promql(inner), at=at))
    options = [match.group(1) for match in map(python_regex(variable["regex"]).search, texts) if match]
    assert len(options) == 1, f"the window variable's query gave {texts}, options {options}"
    return int(options[0])


@pytest.mark.prometheus
@pytest.mark.slow
def test_every_dashboard_query_returns_plausible_values_from_a_real_run(prometheus, tmp_path):
    records, seen_at = [], []

    def wait_for_scrape(record: StepRecord) -> None:
        # The run's endpoint goes away when it ends: hold each step until Prometheus has scraped it, which also
        # gives every counter one sample per step for increase() and rate().
        records.append(record)
        seen_at.append(prometheus.wait_for_steps(RUN, record.step + 1))

    run(run_config(prometheus.output_dir, RUN, NUM_STEPS, {"port": 0}), on_step=wait_for_scrape)
    assert len(records) == NUM_STEPS
    assert_preempted(records)
    at = seen_at[-1]  # the last scrape of the live endpoint; later ones find it gone and mark the series stale

    dashboard = load_dashboard()
    expected = {"job": ["bubblespec"], "run": [RUN], "rank": [str(rank) for rank in range(NUM_RANKS)]}
    for name, query in variable_queries(dashboard).items():
        if name == "window":
            continue
        metric, matchers, label = LABEL_VALUES.fullmatch(query).groups()
        match = grafana_to_promql(metric + (matchers or ""))
        values = prometheus.get(f"/api/v1/label/{label}/values", **{"match[]": match, "start": at - 300, "end": at})
        assert sorted(values) == expected[name], query
    window = window_seconds(prometheus, dashboard, at)
    longest = prometheus.value(grafana_to_promql("max(max_over_time(bubblespec_step_wall_seconds[1h]))"), at)
    assert window == max(60, math.ceil(4 * longest)), (window, longest)
    assert at - seen_at[0] < window, "the run took longer than the window: some panels would miss its first steps"

    for title, ref_id, expr in expressions(dashboard):
        promql = grafana_to_promql(expr, window=window)
        answer = prometheus.query(promql, at=at)
        where = f"panel {title!r} query {ref_id}: {promql}"
        assert answer["resultType"] == "vector", where
        assert answer["result"], f"{where} returned no series"
        low, high = PLAUSIBLE[title]
        for series in answer["result"]:
            value = float(series["value"][1])
            assert math.isfinite(value) and low <= value <= high, f"{where} gave {value} for {series['metric']}"
            assert series["metric"].get("run") == RUN, f"{where} gave a series without the run: {series['metric']}"


FLEET_AND_FEW = 3
"""The most series a time-series query draws per run: a fleet line, or the slowest (lowest) 3 ranks."""


@pytest.mark.prometheus
@pytest.mark.slow
def test_at_64_ranks_a_time_series_draws_the_fleet_and_3_ranks_and_a_bar_gauge_one_bar_per_rank(prometheus):
    """A 64-rank run (virtual clock): no time-series query draws a line per rank; each per-rank bar gauge has one
    bar for each of the 64 ranks; the rank variable lists them all. (That each query gives plausible values is the
    3-rank test's job.)"""
    num_ranks, seen_at = 64, []
    config = run_config(prometheus.output_dir, "wide", 2, {"port": 0}, num_ranks=num_ranks)
    run(config, on_step=lambda record: seen_at.append(prometheus.wait_for_steps("wide", record.step + 1)))
    at = seen_at[-1]

    dashboard = load_dashboard()
    window = {"match[]": 'bubblespec_requests_total{run="wide"}', "start": at - 300, "end": at}
    ranks = prometheus.get("/api/v1/label/rank/values", **window)
    assert sorted(map(int, ranks)) == list(range(num_ranks))
    drawn = {}
    for panel in query_panels(dashboard):
        for target in panel["targets"]:
            promql = grafana_to_promql(target["expr"], run="wide")
            series = prometheus.query(promql, at=at)["result"]
            drawn[panel["title"], target["refId"]] = len(series)
            where = f"panel {panel['title']!r} query {target['refId']} ({panel['type']}) at {num_ranks} ranks"
            if panel["type"] == "timeseries":
                assert len(series) <= FLEET_AND_FEW, f"{where} draws {len(series)} lines: {promql}"
            elif panel["type"] == "bargauge" and "sum by (run, rank)" in target["expr"]:
                # a ratio leaves out a rank whose denominator is 0 (slowest at every barrier: no bubble)
                assert {s["metric"]["rank"] for s in series} <= set(ranks), f"{where}: bars {len(series)}"
    assert max(drawn.values()) == num_ranks, drawn  # the per-rank bar gauges did run
