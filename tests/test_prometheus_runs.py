"""What an operator's Prometheus sees of whole runs: two runs scraped at once stay apart on every dashboard panel, and a
run that fails and resumes keeps its counters (no reset, so no spike or dip in a per-step panel)."""

from __future__ import annotations

import threading

import pytest

from bubblespec.core.errors import BubblespecError
from bubblespec.observe.metrics import target_path
from bubblespec.observe.records import StepRecord
from bubblespec.run.launch import run
from tests.prometheus import free_port, running_prometheus
from tests.test_dashboards import expressions, grafana_to_promql, load_dashboard, run_config

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]
COUNTER_SUFFIXES = ("_total", "_count", "_sum", "_bucket")


@pytest.fixture
def prometheus(tmp_path):
    (tmp_path / "prometheus").mkdir()
    with running_prometheus(tmp_path / "prometheus", tmp_path / "runs") as server:
        yield server


def test_two_runs_scraped_at_once_stay_apart_on_every_panel(prometheus):
    """Runs "first" (2 steps) and "second" (3 steps) serve at once, each on a port of its own found through its
    target file; every dashboard query asked for one run answers with that run's series only."""
    steps = {"first": 2, "second": 3}
    first_scraped, second_done = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    seen_at: list[float] = []

    def scraped(name: str, record: StepRecord) -> None:
        seen_at.append(prometheus.wait_for_steps(name, record.step + 1))

    def up_before_the_first_step(name: str):
        """Holds the run's first phase until Prometheus scrapes it: every step is then inside the window."""
        started = []

        def on_phase(step: int, phase: str) -> None:
            if not started:
                started.append(prometheus.wait_for(f'up{{job="bubblespec", run="{name}"}}', 1))

        return on_phase

    def first_step(record: StepRecord) -> None:
        scraped("first", record)
        if record.step == steps["first"] - 1:  # stay up until the second run has been scraped to its end
            first_scraped.set()
            assert second_done.wait(timeout=300), "the second run did not finish"

    def first_run() -> None:
        try:
            config = run_config(prometheus.output_dir, "first", steps["first"], {"port": 0})
            run(config, on_step=first_step, on_phase=up_before_the_first_step("first"))
        except BaseException as error:  # reaches the test below
            errors.append(error)
            first_scraped.set()

    def second_step(record: StepRecord) -> None:
        scraped("second", record)
        if record.step == steps["second"] - 1:  # stay up until the first run has been scraped to its end too: a
            first_scraped.wait(timeout=300)  # run that ended is no longer scraped, and its series go stale

    thread = threading.Thread(target=first_run)
    thread.start()
    try:
        run(run_config(prometheus.output_dir, "second", steps["second"], {"port": 0}), on_step=second_step)
        # ask at a time both runs' last scrapes are in, while both were still up
        assert first_scraped.wait(timeout=300) and not errors, f"the first run was not scraped to its end: {errors}"
        at = max(seen_at)
        for name, num_steps in steps.items():
            assert prometheus.value(f'bubblespec_steps_total{{run="{name}"}}', at) == num_steps
            for title, ref_id, expr in expressions(load_dashboard()):
                promql = grafana_to_promql(expr, run=name)
                series = prometheus.query(promql, at=at)["result"]
                where = f"panel {title!r} query {ref_id} for run {name}: {promql}"
                assert series, f"{where} returned no series"
                assert {s["metric"].get("run") for s in series} == {name}, f"{where} mixes runs: {series}"
    finally:
        second_done.set()
        thread.join()
    assert not errors, errors


class Crash(BubblespecError):
    """Raised by the test's step listener: the run fails after a step it has checkpointed."""


def test_a_run_that_fails_and_resumes_neither_resets_nor_dips(prometheus):
    """A run on a fixed port fails after its third step (checkpointed), leaving its target file, and resumes: the
    resumed endpoint's first scrape already holds the three steps (history is replayed before the endpoint serves), no
    counter of the run ever goes down, and every series existed from the first scrape (so increase() counts step 0)."""
    port = free_port()
    config = run_config(prometheus.output_dir, "resumed", 5, {"port": port})
    config = config.model_copy(update={"checkpoint_every": 1})

    up = 'up{job="bubblespec", run="resumed"}'
    first_scrapes: list[float] = []

    def scraped_before_the_first_step(step: int, phase: str) -> None:
        if len(first_scrapes) < runs:  # each process's endpoint is scraped before its first step ends
            first_scrapes.append(prometheus.wait_for(up, 1))

    def fail_after_step_2(record: StepRecord) -> None:
        prometheus.wait_for_steps("resumed", record.step + 1)
        if record.step == 2:
            raise Crash("the test stops the run after step 2")

    runs = 1
    with pytest.raises(Crash):
        run(config, on_step=fail_after_step_2, on_phase=scraped_before_the_first_step)
    assert target_path(config.run_dir).exists(), "a failed run keeps its target, so Prometheus shows it down"
    prometheus.wait_for(up, 0)
    runs = 2
    run(config, resume_dir=config.run_dir, on_step=lambda r: prometheus.wait_for_steps("resumed", r.step + 1),
        on_phase=scraped_before_the_first_step)  # fmt: skip
    assert not target_path(config.run_dir).exists()
    at = prometheus.wait_for_steps("resumed", 5)
    assert prometheus.value('bubblespec_steps_total{run="resumed"}', first_scrapes[1]) == 3
    whole = f"{at - first_scrapes[0] + 60:.0f}s"
    names = prometheus.get("/api/v1/label/__name__/values", **{"match[]": '{run="resumed"}'})
    counters = [name for name in names if name.startswith("bubblespec_") and name.endswith(COUNTER_SUFFIXES)]
    assert "bubblespec_steps_total" in counters and "bubblespec_acceptance_length_bucket" in counters, counters
    for name in counters:
        resets = prometheus.query(f'resets({name}{{run="resumed"}}[{whole}]) > 0', at)["result"]
        assert not resets, f"{name} of the resumed run went down: {resets}"
    # every rank and phase series was there from the first scrape, at 0: increase() sees step 0's tokens
    for metric in ('bubblespec_generated_tokens_total{run="resumed"}', 'bubblespec_phase_seconds_total{run="resumed"}'):
        lowest = prometheus.query(f"min_over_time({metric}[{whole}])", at)["result"]
        assert lowest and all(float(s["value"][1]) == 0 for s in lowest), f"{metric} did not start at 0: {lowest}"
