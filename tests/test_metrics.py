"""Prometheus metrics: served live during a run, equal to the run directory's JSONL; bad ports are clear errors."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bubblespec.config import validate
from bubblespec.errors import ConfigError
from bubblespec.launch import run
from bubblespec.metrics import TRAIN_COUNTERS, TRAIN_GAUGES, RunMetrics, metric_names
from bubblespec.run_dir import RunDirectory


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of the live endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_are_live_during_the_run_and_equal_the_jsonl(tmp_path):
    port = free_port()
    config = _config(tmp_path, "live", port)
    checked = []

    def check(record):
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
        checked.append(record.step)

    run(config, on_step=check)
    assert checked == [0, 1, 2]
    with pytest.raises(OSError):  # the endpoint is gone once the run is over
        scrape(port)


def test_a_port_in_use_names_the_port_and_the_config_key_and_writes_nothing(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = _config(tmp_path, "clash", port)
        with pytest.raises(ConfigError, match=rf"metrics\.port {port} .* in use.*metrics\.enabled: false"):
            run(config)
    assert not config.run_dir.exists()


def test_metrics_can_be_turned_off(tmp_path):
    port = free_port()
    config = _config(tmp_path, "off", port, metrics={"enabled": False, "port": port}, num_steps=1)
    run(config, on_step=lambda record: pytest.raises(OSError, scrape, port))


def test_every_metric_has_the_prefix_and_ranked_ones_the_rank_label(tmp_path):
    metrics = RunMetrics()
    config = _config(tmp_path, "names", 0, num_steps=2)
    run(config)
    metrics.observe_steps(RunDirectory(config.run_dir).read_steps())
    names = metric_names(metrics.registry)
    assert names and all(name.startswith("bubblespec_") for name in names)
    for family in metrics.registry.collect():
        for sample in family.samples:
            if family.name not in ("bubblespec_phase_seconds",) and "rank" not in sample.labels:
                assert family.name in {
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
