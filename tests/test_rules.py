"""dashboards/rules.yml: promtool accepts it, every alert fires on synthetic series of the failure it names and stays
silent on healthy (or not yet known) ones, and every recording rule computes the ratio its name promises."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from tests.prometheus import prometheus_binary

RULES = Path(__file__).resolve().parents[1] / "dashboards" / "rules.yml"
INTERVAL = "1m"
"""Scrape interval of the synthetic series, and promtool's evaluation interval: values are one minute apart."""
SLOW_EVALUATION_INTERVAL = "5m"
"""Evaluation interval of the cases with four hours of series (the 3h baselines): 240 evaluations per case would take
half a second each."""
ROUNDING_DIGITS = 6
"""Recorded values are compared rounded to this many decimals: promtool 2.42 compares floats exactly, and 0.625 comes
out of a ratio of rates as 0.6250000000000001."""
RUN = "r1"
OTHER_RUN = "r2"
IDLE_RUN = "idle"
TARGET = {"job": "bubblespec", "instance": "node-0:9464"}
"""Target labels besides ``run`` that every scraped series carries."""
SEVERITIES = {"warning", "critical"}
LIVENESS_MINUTES = 90
"""Length of the liveness cases' series: an hour for the typical step time, then half an hour of stall."""


def promtool() -> str:
    return prometheus_binary("promtool")


def load_rules() -> list[dict]:
    """Every rule of dashboards/rules.yml, recording and alerting, of every group."""
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def series(name: str, values: str, run: str = RUN, **labels: str) -> dict:
    """An input series of ``name`` with the target labels of ``run``, e.g. ``series("up", "1x10")``."""
    selector = ",".join(f'{key}="{value}"' for key, value in {**TARGET, "run": run, **labels}.items())
    return {"series": f"{name}{{{selector}}}", "values": values}


def counter(*pieces: tuple[float, int]) -> str:
    """Expanding notation of a counter from 0 that grows by ``per_minute`` for ``minutes``, piece after piece."""
    value, parts = 0.0, ["0"]
    for per_minute, minutes in pieces:
        parts.append(f"{value + per_minute:g}+{per_minute:g}x{minutes - 1}")
        value += per_minute * minutes
    return " ".join(parts)


def nan(minutes: int) -> str:
    """A gauge not known yet (NaN) for ``minutes`` + 1 samples: promtool has no expanding notation for NaN."""
    return " ".join(["NaN"] * (minutes + 1))


class AlertCase(NamedTuple):
    """A scenario for one alert: synthetic series and, at each eval time, the alerts that must fire ([]: none)."""

    name: str
    input_series: list[dict]
    checks: list[tuple[str, list[dict]]]


class RecordingCase(NamedTuple):
    """A scenario for one recording rule: synthetic series and its value per label set (a ``'{run="r1"}'``
    string) at ``eval_time``."""

    name: str
    input_series: list[dict]
    eval_time: str
    expected: dict[str, float]


def firing(severity: str, summary: str, description: str, **labels: str) -> dict:
    """An alert of run r1 that promtool must see firing, with these labels besides ``run`` and ``severity``."""
    return {
        "exp_labels": {"severity": severity, "run": RUN, **labels},
        "exp_annotations": {"summary": summary, "description": description},
    }


def no_step_finished(age: str) -> dict:
    """BubblespecNoStepFinished of run r1, whose typical step is 1m, ``age`` (as humanizeDuration writes it) after
    its last step."""
    return firing(
        "critical",
        f"bubblespec run r1: no step finished for {age}",
        f"Run r1 has not finished a step for {age}, more than 3 times its typical step wall time (1m 0s over the "
        "last hour). Look for a stuck rank (BubblespecRankStuck), a hung trainer or reward service in the run's log.",
    )


def liveness() -> list[dict]:
    """A run whose one-minute steps finish every minute: a typical step of 1m."""
    return [
        series("bubblespec_step_wall_seconds", f"60x{LIVENESS_MINUTES}"),
        series("bubblespec_step_finished_timestamp_seconds", f"0+60x{LIVENESS_MINUTES}"),
    ]


def rank_activity(rank: str, state: str, progress: str) -> list[dict]:
    """Rank ``rank`` in ``state`` all along, its last progress the timestamps ``progress``."""
    return [
        *(
            series("bubblespec_rank_state", f"{int(other == state)}x{LIVENESS_MINUTES}", rank=rank, state=other)
            for other in ("generate", "draft", "idle")
        ),
        series("bubblespec_rank_last_progress_timestamp_seconds", progress, rank=rank),
    ]


def bubbles(drafting: str, bubble: str) -> list[dict]:
    """One rank's drafting and bubble seconds counters."""
    return [
        series("bubblespec_bubble_drafting_seconds_total", drafting, rank="0"),
        series("bubblespec_bubble_seconds_total", bubble, rank="0"),
    ]


def acceptance(total_length: str, verify_steps: str) -> list[dict]:
    """One rank's acceptance-length histogram sum (tokens emitted by verify steps) and count (verify steps)."""
    return [
        series("bubblespec_acceptance_length_sum", total_length, rank="0"),
        series("bubblespec_acceptance_length_count", verify_steps, rank="0"),
    ]


def generation(*per_rank: str) -> list[dict]:
    """Generation seconds counters of ranks 0, 1, ... of run r1."""
    return [series("bubblespec_generation_seconds_total", values, rank=str(r)) for r, values in enumerate(per_rank)]


NO_STEP = "BubblespecNoStepFinished"
RANK_STUCK = "BubblespecRankStuck"
BUBBLES = "BubblespecBubbleUtilizationCollapsed"
ACCEPTANCE = "BubblespecAcceptanceLengthCollapsed"
STRAGGLER = "BubblespecStragglerRank"
REWARD = "BubblespecRewardFailures"
LOGPROB = "BubblespecLogprobMismatch"
REPLICA = "BubblespecReplicaReplaced"
TRAINER = "BubblespecTrainerRestarted"
DOWN = "BubblespecTargetDown"
BUBBLES_3H = "run:bubblespec_bubble_utilization:ratio_rate3h"
ACCEPTANCE_3H = "run:bubblespec_acceptance_length:mean3h"
SLOW_CASES = {BUBBLES, ACCEPTANCE, BUBBLES_3H, ACCEPTANCE_3H}
"""Rules whose cases span four hours (3h of baseline, then an hour of change): evaluated every
:data:`SLOW_EVALUATION_INTERVAL`."""
NEW_INSTANCE = "node-1:9464"
"""Where a resumed run serves its metrics in the cases that resume one."""

ALERT_CASES: dict[str, list[AlertCase]] = {
    NO_STEP: [
        AlertCase(
            "steps stop after an hour of one-minute steps",
            [
                series("bubblespec_step_wall_seconds", "60x90"),
                series("bubblespec_step_finished_timestamp_seconds", "0+60x60 3600x30"),
            ],
            # at 68m over 3 typical steps since 64m, not yet for 5m
            [("68m", []), ("70m", [no_step_finished("10m 0s")])],
        ),
        AlertCase(
            "a resumed run's new process hangs in its first step",
            [
                series("bubblespec_step_wall_seconds", "60x30 stale"),
                series("bubblespec_step_finished_timestamp_seconds", "0+60x30 stale"),
                # the new process started its first step at 35m (2100 s) and finished none
                series("bubblespec_step_wall_seconds", nan(60), instance=NEW_INSTANCE),
                series("bubblespec_step_finished_timestamp_seconds", nan(60), instance=NEW_INSTANCE),
                series("bubblespec_step_started_timestamp_seconds", f"{nan(34)} 2100x25", instance=NEW_INSTANCE),
            ],
            [("50m", [no_step_finished("15m 0s")])],
        ),
        AlertCase("steps keep finishing", liveness(), [("90m", [])]),
        AlertCase(
            "no step finished yet: step times are NaN",
            [
                series("bubblespec_step_wall_seconds", nan(90)),
                series("bubblespec_step_finished_timestamp_seconds", nan(90)),
                series("bubblespec_step_started_timestamp_seconds", "0x90"),
            ],
            [("30m", []), ("90m", [])],
        ),
    ],
    RANK_STUCK: [
        AlertCase(
            "rank 1 generates without progress since 10m",
            [
                *liveness(),
                *rank_activity("0", "idle", "0+60x90"),
                *rank_activity("1", "generate", "0+60x10 600x80"),
            ],
            [
                ("20m", []),  # older than a typical step since 11m, not yet for 10m
                (
                    "30m",
                    [
                        firing(
                            "warning",
                            "bubblespec run r1: rank 1 made no progress for 20m 0s",
                            "Rank 1 of run r1 is generating or drafting but reported no activity for 20m 0s, longer "
                            "than the run's typical step wall time. Its engine replica may be hung: check that rank's "
                            "process and accelerator.",
                            rank="1",
                        )
                    ],
                ),
            ],
        ),
        AlertCase(
            "ranks keep reporting progress while they generate and draft",
            [*liveness(), *rank_activity("0", "generate", "0+60x90"), *rank_activity("1", "draft", "0+60x90")],
            [("60m", [])],
        ),
        AlertCase(
            "an idle rank needs no progress",
            [*liveness(), *rank_activity("0", "idle", "0+60x10 600x80")],
            [("60m", [])],
        ),
    ],
    BUBBLES: [
        AlertCase(
            "drafting falls from 80% to 20% of the bubbles at 3h",
            bubbles(counter((48, 180), (12, 60)), counter((60, 240))),
            [
                (
                    "240m",
                    [
                        firing(
                            "warning",
                            "bubblespec run r1: bubble utilisation fell to 20%",
                            # the baseline, 30m to 3h30m ago, holds 2h30m at 80% and 30m at 20%
                            "Ranks of run r1 drafted in 20% of their bubble seconds over the last 30m, under half of "
                            "the 70% of the 3h before. Drafting stopped or is preempted early: check the draft source "
                            "and the draft store.",
                        )
                    ],
                )
            ],
        ),
        AlertCase("stable at 80%", bubbles(counter((48, 240)), counter((60, 240))), [("240m", [])]),
        AlertCase(
            "slowly varying: 80% down to 45% in 30m steps",
            bubbles(counter(*((per_minute, 30) for per_minute in range(48, 26, -3))), counter((60, 240))),
            [("240m", [])],
        ),
        AlertCase(
            "the bubbles vanish at 3h (balanced shards)",
            bubbles(counter((48, 180), (0, 60)), counter((60, 180), (0, 60))),
            [("240m", [])],
        ),
        AlertCase("never any bubble", bubbles("0x240", "0x240"), [("240m", [])]),
        AlertCase(
            "drafting was rare: 8% down to 2%",
            bubbles(counter((4.8, 180), (1.2, 60)), counter((60, 240))),
            [("240m", [])],
        ),
    ],
    ACCEPTANCE: [
        AlertCase(
            "acceptance length falls from 4 to 1.5 at 3h",
            acceptance(counter((400, 180), (150, 60)), counter((100, 240))),
            [
                (
                    "240m",
                    [
                        firing(
                            "warning",
                            "bubblespec run r1: acceptance length fell to 1.50",
                            # the baseline holds 2h30m at 4 and 30m at 1.5: 3.58
                            "Verify steps of run r1 emitted 1.50 tokens on average over the last 30m, against 3.58 in "
                            "the 3h before: the drafts stopped matching the policy (stale drafts, a changed task or "
                            "sampling settings).",
                        )
                    ],
                )
            ],
        ),
        AlertCase("stable at 4", acceptance(counter((400, 240)), counter((100, 240))), [("240m", [])]),
        AlertCase(
            "slowly varying: 4 down to 2.6 in 30m steps",
            acceptance(counter(*((per_minute, 30) for per_minute in range(400, 250, -20))), counter((100, 240))),
            [("240m", [])],
        ),
        AlertCase(
            "drafts were barely accepted: 1.3 down to 1.1",
            acceptance(counter((130, 180), (110, 60)), counter((100, 240))),
            [("240m", [])],
        ),
    ],
    STRAGGLER: [
        AlertCase(
            "rank 2 generates 40 s/min from 30m, the median rank 22",
            generation(counter((20, 90)), counter((22, 90)), counter((22, 30), (40, 60))),
            [
                ("70m", []),  # over 1.5x from 49m (19m of straggling in the window), not yet for 30m
                (
                    "90m",
                    [
                        firing(
                            "warning",
                            "bubblespec run r1: rank 2 is a straggler",
                            "Rank 2 of run r1 spent 1.82 times the median rank's generation seconds over the last "
                            "30m, and every step waits for it. Check its accelerator (clocks, other jobs) and the "
                            "sharding policy.",
                            rank="2",
                        )
                    ],
                ),
            ],
        ),
        AlertCase("balanced ranks", generation(counter((20, 90)), counter((22, 90)), counter((24, 90))), [("70m", [])]),
        AlertCase(
            "rank 2 straggles for 20 minutes only",
            generation(counter((20, 90)), counter((22, 90)), counter((22, 30), (40, 20), (22, 40))),
            [("60m", []), ("70m", []), ("90m", [])],
        ),
    ],
    REWARD: [
        AlertCase(
            "two reward timeouts at 20m",
            [
                series("bubblespec_reward_failures_total", "0x19 2x40", kind="timeout"),
                series("bubblespec_reward_failures_total", "0x60", kind="error"),
            ],
            [
                (
                    "30m",
                    [
                        firing(
                            "warning",
                            "bubblespec run r1: reward timeout failures",
                            "2 reward computations of run r1 failed (timeout) in the last 30m. Check the reward "
                            "function or service and its timeout.",
                            kind="timeout",
                        )
                    ],
                ),
                ("60m", []),  # out of the window again
            ],
        ),
        AlertCase(
            "no reward failures",
            [series("bubblespec_reward_failures_total", "0x60", kind=kind) for kind in ("timeout", "error")],
            [("60m", [])],
        ),
    ],
    LOGPROB: [
        AlertCase(
            "a wrong logprob path from 30m",
            [series("bubblespec_logprob_diff_mean", "0.005x29 0.3x30")],
            [
                (
                    "50m",
                    [
                        firing(
                            "critical",
                            "bubblespec run r1: engine and trainer logprobs disagree",
                            "The engine's logprobs of run r1 differ from the trainer's by 0.300 per token on average "
                            "(numerical noise is 0.001 to 0.01): importance ratios and the policy loss are wrong. "
                            "Check that engine and trainer load the same weights, sampling temperature and tokenizer.",
                        )
                    ],
                )
            ],
        ),
        AlertCase("bfloat16 noise", [series("bubblespec_logprob_diff_mean", "0.01x60")], [("60m", [])]),
        AlertCase(
            "one bad step, shown for 5 minutes",
            [series("bubblespec_logprob_diff_mean", "0.005x29 0.3x4 0.005x26")],
            [("34m", []), ("45m", [])],
        ),
        AlertCase("no trained step yet", [series("bubblespec_logprob_diff_mean", nan(60))], [("60m", [])]),
    ],
    REPLICA: [
        AlertCase(
            "rank 1's replica replaced at 10m",
            [
                series("bubblespec_replica_replacements_total", "0x60", rank="0"),
                series("bubblespec_replica_replacements_total", "0x9 1x50", rank="1"),
            ],
            [
                (
                    "15m",
                    [
                        firing(
                            "warning",
                            "bubblespec run r1: rank 1's engine replica was replaced",
                            "The engine replica of rank 1 of run r1 died and was replaced 1 time(s) in the last 30m. "
                            "Check the node's health if it repeats.",
                            rank="1",
                        )
                    ],
                ),
                ("50m", []),  # out of the window again
            ],
        ),
        AlertCase(
            "no replacements",
            [series("bubblespec_replica_replacements_total", "0x60", rank=rank) for rank in ("0", "1")],
            [("60m", [])],
        ),
    ],
    TRAINER: [
        AlertCase(
            "the trainer restarts at 10m",
            [series("bubblespec_trainer_restarts_total", "0x9 1x50")],
            [
                (
                    "15m",
                    [
                        firing(
                            "warning",
                            "bubblespec run r1: trainer restarted",
                            "The trainer of run r1 restarted 1 time(s) in the last 30m and rewound to its last "
                            "checkpoint. Check the trainer workers' logs.",
                        )
                    ],
                ),
                ("50m", []),  # out of the window again
            ],
        ),
        AlertCase("no restarts", [series("bubblespec_trainer_restarts_total", "0x60")], [("60m", [])]),
    ],
    DOWN: [
        AlertCase(
            "the run's endpoint stops answering at 10m",
            [series("up", "1x9 0x20")],
            [
                ("14m", []),  # down, not yet for 5m
                (
                    "20m",
                    [
                        firing(
                            "critical",
                            "bubblespec run r1: metrics endpoint down",
                            "Prometheus has not scraped run r1 at node-0:9464 for 5m: the run crashed or its machine "
                            "is unreachable. A run that ended normally removes its target instead.",
                            **TARGET,
                        )
                    ],
                ),
            ],
        ),
        AlertCase("up all along", [series("up", "1x30")], [("30m", [])]),
        AlertCase("down for two scrapes only", [series("up", "1x9 0 0 1x18")], [("12m", []), ("20m", [])]),
    ],
}

RECORDING_CASES: dict[str, list[RecordingCase]] = {
    "run:bubblespec_bubble_utilization:ratio_rate30m": [
        RecordingCase(
            "a ratio of the ranks' sums, per run",
            [
                series("bubblespec_bubble_drafting_seconds_total", counter((45, 30)), rank="0"),
                series("bubblespec_bubble_seconds_total", counter((60, 30)), rank="0"),
                series("bubblespec_bubble_drafting_seconds_total", counter((5, 30)), rank="1"),
                series("bubblespec_bubble_seconds_total", counter((20, 30)), rank="1"),
                series("bubblespec_bubble_drafting_seconds_total", counter((1, 30)), run=OTHER_RUN, rank="0"),
                series("bubblespec_bubble_seconds_total", counter((10, 30)), run=OTHER_RUN, rank="0"),
                series("bubblespec_bubble_drafting_seconds_total", "0x30", run=IDLE_RUN, rank="0"),
                series("bubblespec_bubble_seconds_total", "0x30", run=IDLE_RUN, rank="0"),
            ],
            "30m",
            # (45 + 5) / (60 + 20), not the mean of 0.75 and 0.25; the run without bubbles has no value
            {'{run="r1"}': 0.625, '{run="r2"}': 0.1},
        )
    ],
    BUBBLES_3H: [
        RecordingCase(
            "over the last 3h",
            bubbles(counter((30, 60), (48, 180)), counter((60, 240))),
            "240m",
            {'{run="r1"}': 0.8},
        )
    ],
    "run:bubblespec_decode_steps_saved:ratio_rate30m": [
        RecordingCase(
            "1 - decode steps / tokens, summed over ranks",
            [
                series("bubblespec_decode_steps_total", counter((40, 30)), rank="0"),
                series("bubblespec_generated_tokens_total", counter((100, 30)), rank="0"),
                series("bubblespec_decode_steps_total", counter((50, 30)), rank="1"),
                series("bubblespec_generated_tokens_total", counter((50, 30)), rank="1"),
            ],
            "30m",
            {'{run="r1"}': 0.4},  # 1 - 90 / 150
        )
    ],
    "run:bubblespec_acceptance_length:mean30m": [
        RecordingCase(
            "histogram sum / count, summed over ranks",
            [
                series("bubblespec_acceptance_length_sum", counter((400, 30)), rank="0"),
                series("bubblespec_acceptance_length_count", counter((100, 30)), rank="0"),
                series("bubblespec_acceptance_length_sum", counter((100, 30)), rank="1"),
                series("bubblespec_acceptance_length_count", counter((100, 30)), rank="1"),
            ],
            "30m",
            {'{run="r1"}': 2.5},  # 500 tokens / 200 verify steps
        )
    ],
    ACCEPTANCE_3H: [
        RecordingCase(
            "over the last 3h",
            acceptance(counter((200, 60), (300, 180)), counter((100, 240))),
            "240m",
            {'{run="r1"}': 3},
        )
    ],
    "run:bubblespec_step_wall_seconds:max": [
        RecordingCase(
            "one series per run across instances, none before a first step",
            [
                series("bubblespec_step_wall_seconds", "30x10"),
                series("bubblespec_step_wall_seconds", nan(10), instance=NEW_INSTANCE),
                series("bubblespec_step_wall_seconds", nan(10), run=OTHER_RUN),
            ],
            "10m",
            {'{run="r1"}': 30},
        )
    ],
    "run:bubblespec_step_wall_seconds:avg_over_time1h": [
        RecordingCase(
            "the hour's average, NaN samples (no step finished yet) left out",
            [series("bubblespec_step_wall_seconds", f"{nan(20)} 30x19 90x19")],
            "60m",
            {'{run="r1"}': 60},  # 20 minutes at 30 s, 20 at 90 s
        )
    ],
    "run_rank:bubblespec_generation_seconds:rate30m": [
        RecordingCase(
            "seconds per second per rank",
            generation(counter((30, 30)), counter((45, 30))),
            "30m",
            {'{run="r1",rank="0"}': 0.5, '{run="r1",rank="1"}': 0.75},
        )
    ],
    "run_rank:bubblespec_generation_seconds_per_run_median:ratio_rate30m": [
        RecordingCase(
            "each rank over the median rank of its run",
            [
                *generation(counter((20, 30)), counter((30, 30)), counter((60, 30))),
                series("bubblespec_generation_seconds_total", counter((10, 30)), run=OTHER_RUN, rank="0"),
                series("bubblespec_generation_seconds_total", "0x30", run=IDLE_RUN, rank="0"),
            ],
            "30m",
            # the median of 20, 30 and 60 is 30; a run of one rank is its own median; an idle run has none
            {
                '{run="r1",rank="0"}': 2 / 3,
                '{run="r1",rank="1"}': 1,
                '{run="r1",rank="2"}': 2,
                '{run="r2",rank="0"}': 1,
            },
        )
    ],
}


def alert_test_group(alert: str, case: AlertCase) -> dict:
    """``case`` as a promtool test group: ``alert``'s firing alerts at each eval time."""
    return {
        "name": case.name,
        "interval": INTERVAL,
        "input_series": case.input_series,
        "alert_rule_test": [
            {"eval_time": at, "alertname": alert, "exp_alerts": expected} for at, expected in case.checks
        ],
    }


def recording_test_group(record: str, case: RecordingCase) -> dict:
    """Compares ``record`` rounded to :data:`ROUNDING_DIGITS` (``round()`` also drops the metric name)."""
    return {
        "name": case.name,
        "interval": INTERVAL,
        "input_series": case.input_series,
        "promql_expr_test": [
            {
                "expr": f"round({record}, 1e-{ROUNDING_DIGITS})",
                "eval_time": case.eval_time,
                "exp_samples": [
                    {"labels": labels, "value": round(value, ROUNDING_DIGITS)}
                    for labels, value in case.expected.items()
                ],
            }
        ],
    }


def run_promtool_tests(tmp_path: Path, rule: str, groups: list[dict]) -> None:
    """Runs ``groups`` with ``promtool test rules`` against dashboards/rules.yml; fails with promtool's output."""
    interval = SLOW_EVALUATION_INTERVAL if rule in SLOW_CASES else INTERVAL
    test_file = tmp_path / "rules_test.yml"
    test_file.write_text(
        yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": interval, "tests": groups}, sort_keys=False)
    )
    result = subprocess.run(
        [promtool(), "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"promtool test rules {test_file} ({rule}) failed:\n{result.stdout}{result.stderr}"


@pytest.mark.prometheus
def test_promtool_accepts_the_rules():
    result = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"promtool check rules {RULES} failed:\n{result.stdout}{result.stderr}"


@pytest.mark.prometheus
@pytest.mark.parametrize("alert", sorted(ALERT_CASES))
def test_alert(alert, tmp_path):
    run_promtool_tests(tmp_path, alert, [alert_test_group(alert, case) for case in ALERT_CASES[alert]])


@pytest.mark.prometheus
@pytest.mark.parametrize("record", sorted(RECORDING_CASES))
def test_recording_rule(record, tmp_path):
    run_promtool_tests(tmp_path, record, [recording_test_group(record, case) for case in RECORDING_CASES[record]])


def test_every_alert_has_a_firing_and_a_silent_case():
    alerts = {rule["alert"] for rule in load_rules() if "alert" in rule}
    assert alerts == set(ALERT_CASES), (
        f"alerts without test cases: {sorted(alerts - set(ALERT_CASES))}; "
        f"test cases of no alert: {sorted(set(ALERT_CASES) - alerts)}"
    )
    for alert, cases in ALERT_CASES.items():
        expected = [must_fire for case in cases for _, must_fire in case.checks]
        assert any(expected), f"no case where {alert} must fire"
        assert not all(expected), f"no case where {alert} must stay silent"


def test_every_recording_rule_has_a_case():
    records = {rule["record"] for rule in load_rules() if "record" in rule}
    assert records == set(RECORDING_CASES), (
        f"recording rules without test cases: {sorted(records - set(RECORDING_CASES))}; "
        f"test cases of no recording rule: {sorted(set(RECORDING_CASES) - records)}"
    )


def test_every_alert_has_a_severity_a_summary_and_a_description():
    problems = []
    for rule in load_rules():
        if "alert" in rule:
            if rule.get("labels", {}).get("severity") not in SEVERITIES:
                problems.append(f"{rule['alert']}: label severity not one of {sorted(SEVERITIES)}")
            problems += [
                f"{rule['alert']}: no {name} annotation"
                for name in ("summary", "description")
                if name not in rule.get("annotations", {})
            ]
    assert not problems, "\n".join(problems)
