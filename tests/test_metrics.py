"""Prometheus metrics: served live during a run, equal to the run directory's JSONL; bad ports are clear errors."""

from __future__ import annotations

import json
import math
import socket
import time

import pytest

from bubblespec.core.config import validate
from bubblespec.core.errors import ConfigError
from bubblespec.observe.metrics import (
    DEFAULT_PORT,
    PHASES,
    RANK_STATES,
    TRAIN_COUNTERS,
    TRAIN_GAUGES,
    RunMetrics,
    metric_names,
    target_path,
)
from bubblespec.observe.records import REWIND
from bubblespec.observe.run_dir import RunDirectory
from bubblespec.rollout.bubble_scheduler import REPLACED
from bubblespec.run.launch import run
from tests.prometheus import free_port
from tests.scrape import scrape, scrape_run, target_of


def _config(tmp_path, name: str, port: int, **changes):
    return validate(
        {
            "name": name,
            "output_dir": str(tmp_path),
            "num_steps": 3,
            "eval_every": 2,
            "eval_prompts": 4,
            "task": {"prompts_per_step": 4, "samples_per_prompt": 2},
            "rollout": {"num_ranks": 2, "sampling": {"max_new_tokens": 48}},
            "clock": {"kind": "virtual", "profile": "h100-7b"},
            "metrics": {"port": port},
        }
        | changes
    )


def test_metrics_are_live_during_the_run_and_equal_the_jsonl(tmp_path):
    port = free_port()
    config = _config(tmp_path, "live", port)
    checked = []
    began = time.time()

    def check(record):
        assert target_of(config.run_dir) == ("127.0.0.1", port, {"run": "live"})
        steps = [json.loads(line) for line in (config.run_dir / "steps.jsonl").read_text().splitlines()]
        assert steps[-1]["step"] == record.step
        metrics = scrape(port)
        for rank in (0, 1):
            label = (("rank", str(rank)),)
            rows = [s["ranks"][rank] for s in steps]

            def total(field, rows=rows):
                return sum(row[field] for row in rows)

            assert metrics[("bubblespec_generated_tokens_total", label)] == total("shard_tokens")
            assert metrics[("bubblespec_decode_steps_total", label)] == total("decode_steps")
            assert metrics[("bubblespec_draft_tokens_accepted_total", label)] == total("draft_tokens_accepted")
            assert metrics[("bubblespec_bubble_seconds_total", label)] == total("bubble_seconds")
            assert metrics[("bubblespec_bubble_drafting_seconds_total", label)] == total("drafting_seconds")
            assert metrics[("bubblespec_draft_coverage", label)] == rows[-1]["draft_coverage"]
            verify_steps = total("verify_steps")
            if verify_steps:  # the histogram of acceptance lengths adds up to the JSONL's counts
                assert metrics[("bubblespec_acceptance_length_count", label)] == verify_steps
                emitted = total("draft_tokens_accepted") + verify_steps
                assert metrics[("bubblespec_acceptance_length_sum", label)] == emitted
        for phase in ("rollout", "train", "weight_sync"):
            assert metrics[("bubblespec_phase_seconds_total", (("phase", phase),))] == sum(
                s["phase_seconds"][phase] for s in steps
            )
        assert metrics[("bubblespec_reward", ())] == record.reward_mean
        assert metrics[("bubblespec_policy_version", ())] == record.step + 1
        assert metrics[("bubblespec_steps_total", ())] == len(steps)
        if record.eval_reward is not None:
            assert metrics[("bubblespec_eval_reward", ())] == record.eval_reward
        # liveness: the step's start and end on the wall clock, each rank's state and last progress
        started = metrics[("bubblespec_step_started_timestamp_seconds", ())]
        finished = metrics[("bubblespec_step_finished_timestamp_seconds", ())]
        assert began <= started <= finished <= time.time()
        assert metrics[("bubblespec_step_wall_seconds", ())] == pytest.approx(finished - started)
        for rank in ("0", "1"):
            states = {
                state: metrics[("bubblespec_rank_state", (("rank", rank), ("state", state)))] for state in RANK_STATES
            }
            assert states == {"generate": 0, "draft": 0, "idle": 1}  # the step is over: every rank is idle
            assert (
                started <= metrics[("bubblespec_rank_last_progress_timestamp_seconds", (("rank", rank),))] <= finished
            )
            assert metrics[("bubblespec_replica_replacements_total", (("rank", rank),))] == 0
        assert metrics[("bubblespec_trainer_restarts_total", ())] == 0
        info = [labels for name, labels in metrics if name == "bubblespec_run_info"]
        assert dict(*info) | {"version": "-"} == {
            "clock": "virtual", "profile": "h100-7b", "backend": "torch", "model": "arithmetic task's model",
            "dtype": "float32", "num_ranks": "2", "speculation": "auto", "schedule": "sync", "version": "-",
        }  # fmt: skip
        assert metrics[("process_start_time_seconds", ())] <= began
        checked.append(record.step)

    run(config, on_step=check)
    assert checked == [0, 1, 2]
    with pytest.raises(OSError):  # the endpoint is gone once the run is over, and so is its target
        scrape(port)
    assert not target_path(config.run_dir).exists()


def test_every_series_exists_from_the_start_so_increase_counts_the_first_step():
    """Prometheus' increase() needs a sample before the first increment: every rank, phase and failure-kind series
    is exported at 0 (a gauge not known yet: NaN) before any step."""
    metrics = RunMetrics(num_ranks=3)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in metrics.registry.collect() for s in f.samples
    }
    for rank in ("0", "1", "2"):
        assert samples[("bubblespec_generated_tokens_total", (("rank", rank),))] == 0
        assert samples[("bubblespec_acceptance_length_count", (("rank", rank),))] == 0
        assert samples[("bubblespec_replica_replacements_total", (("rank", rank),))] == 0
        assert math.isnan(samples[("bubblespec_draft_coverage", (("rank", rank),))])
        assert samples[("bubblespec_rank_state", (("rank", rank), ("state", "idle")))] == 1
    for phase in PHASES:
        assert samples[("bubblespec_phase_seconds_total", (("phase", phase),))] == 0
    for kind in ("timeout", "error"):
        assert samples[("bubblespec_reward_failures_total", (("kind", kind),))] == 0
    assert math.isnan(samples[("bubblespec_step_finished_timestamp_seconds", ())])


def test_a_replayed_step_counts_once_and_faults_count(tmp_path):
    """After a trainer restart the run replays steps since its checkpoint: their records move the liveness gauges,
    not the counters. A rewind and a replaced replica are counted."""
    config = _config(tmp_path, "replay", 0, num_steps=2, metrics={"enabled": False})
    run(config)
    records = RunDirectory(config.run_dir).read_steps()
    metrics = RunMetrics(num_ranks=2)
    for record in records:
        metrics.phase(record.step, "rollout")
        metrics.observe_step(record)
    metrics.phase(1, REWIND)
    metrics.activity(1, REPLACED, "")
    metrics.phase(1, "rollout")
    metrics.observe_step(records[1])  # the replay of step 1
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in metrics.registry.collect() for s in f.samples
    }
    assert samples[("bubblespec_steps_total", ())] == 2
    tokens = sum(rank.shard_tokens for record in records for rank in record.ranks if rank.rank == 0)
    assert samples[("bubblespec_generated_tokens_total", (("rank", "0"),))] == tokens
    assert samples[("bubblespec_trainer_restarts_total", ())] == 1
    assert samples[("bubblespec_replica_replacements_total", (("rank", "1"),))] == 1
    assert samples[("bubblespec_replica_replacements_total", (("rank", "0"),))] == 0
    assert samples[("bubblespec_rank_state", (("rank", "1"), ("state", "idle")))] == 1  # a replacement is no state


def test_a_port_in_use_names_the_port_and_the_config_key_and_writes_nothing(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = _config(tmp_path, "clash", port)
        with pytest.raises(ConfigError, match=rf"metrics\.port {port} .* in use.*metrics\.enabled: false"):
            run(config)
    assert not config.run_dir.exists()


def test_with_no_port_set_a_taken_default_port_gives_a_free_one_named_in_the_target(tmp_path):
    """A shared machine: another process holds 9464. The run serves elsewhere and says where."""
    with socket.socket() as taken:
        try:
            taken.bind(("127.0.0.1", DEFAULT_PORT))
            taken.listen()
        except OSError:
            pass  # another process holds it already: the case under test
        config = _config(tmp_path, "shared", None, num_steps=1, eval_every=0)
        seen = []
        run(config, on_step=lambda record: seen.append((target_of(config.run_dir), scrape_run(config.run_dir))))
    (_, port, labels), metrics = seen[0]
    assert port != DEFAULT_PORT and labels == {"run": "shared"}
    assert metrics[("bubblespec_steps_total", ())] == 1  # the run's own counters are served there


def test_metrics_can_be_turned_off(tmp_path):
    port = free_port()
    config = _config(tmp_path, "off", port, metrics={"enabled": False, "port": port}, num_steps=1)
    run(config, on_step=lambda record: pytest.raises(OSError, scrape, port))


def test_every_metric_has_the_prefix_and_ranked_ones_the_rank_label(tmp_path):
    metrics = RunMetrics()
    config = _config(tmp_path, "names", 0, num_steps=2)
    run(config)
    metrics.observe_history(RunDirectory(config.run_dir).read_steps())
    names = {name for name in metric_names(metrics.registry) if not name.startswith(("process_", "python_"))}
    assert names and all(name.startswith("bubblespec_") for name in names)
    for family in metrics.registry.collect():
        if family.name.startswith(("process_", "python_")):
            continue
        for sample in family.samples:
            if family.name not in ("bubblespec_phase_seconds",) and "rank" not in sample.labels:
                assert family.name in {
                    "bubblespec_run",
                    "bubblespec_step_started_timestamp_seconds",
                    "bubblespec_step_finished_timestamp_seconds",
                    "bubblespec_step_wall_seconds",
                    "bubblespec_trainer_restarts",
                    "bubblespec_steps",
                    "bubblespec_policy_version",
                    "bubblespec_eval_reward",
                    "bubblespec_reward",
                    "bubblespec_rollout_tokens_per_second",
                    "bubblespec_draft_store_tokens",
                    "bubblespec_drafts_evicted",
                    "bubblespec_reward_failures",
                    *TRAIN_GAUGES,
                    *TRAIN_COUNTERS,
                }, family.name


def test_values_not_yet_known_are_nan_not_zero():
    import math

    metrics = RunMetrics()
    values = {s.name: s.value for family in metrics.registry.collect() for s in family.samples}
    assert math.isnan(values["bubblespec_eval_reward"]) and math.isnan(values["bubblespec_reward"])
    assert values["bubblespec_policy_version"] == 0  # the policy before any update is version 0
