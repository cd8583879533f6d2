"""scripts/gpu_check.sh, the first GPU run's one command, dry-run at tiny shapes on the CPU so that it cannot rot
before a GPU runs it: every stage runs and reports, and a failed stage is recorded while the rest go on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def _gpu_check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = os.environ | {"OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    return done, json.loads((tmp_path / "out" / "gpu_check.json").read_text())


@pytest.mark.slow
def test_the_dry_run_runs_every_stage_and_writes_its_figures(tmp_path):
    done, report = _gpu_check(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stages = report["stages"]
    assert list(stages) == ["environment", "keyed_sampling", "engine_drafts", "learner_step", "premise", "profile",
                            "draft_head", "sampling_cost", "engine_speed"]  # fmt: skip
    assert all(stage["status"] == "ok" for stage in stages.values())
    assert report["device"] == "cpu" and report["dry_run"] is True
    assert {(r["vocabulary"], r["tokens_equal"]) for r in stages["keyed_sampling"]["rows"]} == {
        (32_000, True), (151_936, True)
    }  # fmt: skip
    assert stages["engine_drafts"]["float32"]["differing"] == 0
    assert stages["engine_drafts"]["float32"]["draft_tokens_accepted"] > 0
    assert len(stages["premise"]["passes"]) == 4 and all(p["seconds"] > 0 for p in stages["premise"]["passes"])
    trees = stages["premise"]["tree_passes"]  # a decode pass and trees of 16 and 32 tokens, per batch and context
    assert {(r["context"], r["batch"], r["tree_tokens"]) for r in trees} == {
        (c, b, t) for c in (64, 128) for b in (1, 2) for t in (0, 16, 32)
    }  # fmt: skip
    assert all(r["seconds"] > 0 and r["tokens_per_sequence"] == 1 + r["tree_tokens"] for r in trees)
    assert {r["attention_pairs_per_sequence"] for r in trees if r["context"] == 64} == {65, 1193, 2401}
    assert len(stages["profile"]["passes"]) == 4 + len(trees)  # the fit covers the tree passes
    assert stages["profile"]["tree_passes_fitted_median_absolute_error"] >= 0
    assert set(stages["profile"]["fitted"]) == {"fixed_s", "bandwidth_bytes_per_s", "flops_per_s"}
    head = stages["draft_head"]  # rows 1 and 8, 1 and 8 draft tokens, each row a full window of 64 pairs
    assert {(r["batch"], r["num_tokens"], r["context_pairs"]) for r in head["rows"]} == {
        (b, n, 64) for b in (1, 8) for n in (1, 8)
    }  # fmt: skip
    assert all(
        r[k] > 0 for r in head["rows"] for k in ("seconds", "seconds_per_token", "decode_pass_seconds",
                                                 "against_a_decode_pass", "flops", "h100_7b_seconds")
    )  # fmt: skip
    assert all(r["seconds_per_token"] == r["seconds"] / r["num_tokens"] for r in head["rows"])
    # By hand at the tiny shape: 63 context pairs x 393,216 + per token (1,441,792 layer + 2,097,152 output head
    # + 64 keys x 1,024).
    assert {r["flops"] for r in head["rows"] if r["batch"] == 1} == {28_377_088, 53_608_448}
    assert all(row["identical"] for row in stages["engine_speed"]["rows"])
    assert "engine_speed    ok" in done.stdout  # the table


def test_a_failed_stage_is_recorded_and_the_run_goes_on(tmp_path):
    """The profile stage alone has no measured passes to compare: it fails with its reason, the JSON says so, the
    next stage still runs and the command's exit status is 1."""
    done, report = _gpu_check(tmp_path, "--stages", "profile,environment")
    assert done.returncode == 1
    assert report["stages"]["profile"] == {
        "status": "failed", "error": "RuntimeError: the premise stage has no measured passes",
        "seconds": report["stages"]["profile"]["seconds"],
    }  # fmt: skip
    assert report["stages"]["environment"]["status"] == "ok"
    assert "profile         FAILED" in done.stdout


def test_unknown_stages_and_a_missing_gpu_are_one_clear_error(tmp_path):
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--stages", "premise,warp"], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "unknown stages ['warp']; choose from environment," in done.stderr
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "torch sees no CUDA device: run on a GPU machine, or pass --dry-run" in done.stderr
