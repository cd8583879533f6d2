"""``bubblespec report``: the pictures and summary of a real short run on the virtual clock, the timeline
segments they are drawn from, and the errors for folders that are not (finished) run directories."""

from __future__ import annotations

import math
import shutil
import struct
from pathlib import Path

import pytest

from bubblespec.core.errors import BubblespecError
from bubblespec.core.interfaces import acceptance_length
from bubblespec.observe.records import PhaseSeconds, StepRecord
from bubblespec.observe.report import (
    ReportError,
    Segment,
    eval_points,
    rank_totals,
    step_acceptance_length,
    timeline_segments,
    write_report,
)
from bubblespec.observe.run_dir import RunDirectory
from bubblespec.rollout.step import RankRecord
from tests.step_records import step_record

NUM_STEPS, NUM_RANKS = 3, 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from bubblespec.core.config import validate
    from bubblespec.run.launch import run

    config = validate(
        {
            "name": "r",
            "output_dir": str(tmp_path_factory.mktemp("runs")),
            "num_steps": NUM_STEPS,
            "model": {"dtype": "float32"},
            "task": {"prompts_per_step": 4, "samples_per_prompt": 2},
            "rollout": {"num_ranks": NUM_RANKS, "sampling": {"max_new_tokens": 48}},
            "clock": {"kind": "virtual", "profile": "h100-7b"},
            "metrics": {"enabled": False},
            "eval_every": 1,
            "eval_prompts": 4,
        }
    )
    run(config)
    return config.run_dir


@pytest.fixture(scope="module")
def records(run_dir) -> list[StepRecord]:
    return RunDirectory(run_dir).read_steps()


@pytest.fixture(scope="module")
def report(run_dir) -> Path:
    return write_report(run_dir)


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "report"))
    return copy


def png_size(file: Path) -> tuple[int, int]:
    data = file.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{file} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_report_has_the_three_files_and_valid_images(run_dir, report):
    import matplotlib.image

    assert report == run_dir / "report"
    assert sorted(p.name for p in report.iterdir()) == ["steps.png", "summary.md", "timeline.png", "training.png"]
    for name in ("timeline.png", "steps.png", "training.png"):
        width, height = png_size(report / name)
        assert 400 <= width <= 4000 and 200 <= height <= 2000, (name, width, height)
        pixels = matplotlib.image.imread(report / name)
        assert pixels.shape[:2] == (height, width)
        assert len({tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::37]}) > 10  # not a blank canvas
    summary = (report / "summary.md").read_text()
    assert "](timeline.png)" in summary and "](steps.png)" in summary and "](training.png)" in summary


def test_the_timeline_stays_readable_at_any_run_length(records, tmp_path):
    """80 steps: the picture draws the last TIMELINE_STEPS in detail (it was 3,080 pixels wide before) and every
    rank's seconds per activity over the whole run, which add up to the run's seconds."""
    from bubblespec.observe.report import TIMELINE_STEPS, draw_timeline, rank_activity_seconds

    long_run = [r.model_copy(update={"step": i}) for i, r in enumerate(records * 27)][:80]
    draw_timeline(long_run, "virtual", tmp_path / "timeline.png")
    width, height = png_size(tmp_path / "timeline.png")
    assert width <= 16 * 110 and height <= 2000, (width, height)
    shown = {s.step for s in timeline_segments(long_run[-TIMELINE_STEPS:])}
    assert shown == set(range(80 - TIMELINE_STEPS, 80))
    totals = rank_activity_seconds(long_run)
    run_seconds = sum(r.phase_seconds.total for r in long_run)
    for rank in range(NUM_RANKS):
        assert sum(totals[rank].values()) == pytest.approx(run_seconds)
        generated = sum(r.ranks[rank].generation_seconds for r in long_run)
        assert totals[rank]["generate"] == pytest.approx(generated)


def test_training_series_leave_gaps_for_steps_that_trained_nothing():
    from bubblespec.observe.report import training_series

    trains = [{"loss": 0.5, "kl": 0.1}, {"loss": 0.0, "skipped": 1}, {"loss": 0.2}]
    records = [step_record(step, train=train) for step, train in enumerate(trains)]
    loss, kl = training_series(records, "loss"), training_series(records, "kl")
    assert loss[0] == 0.5 and math.isnan(loss[1]) and loss[2] == 0.2
    assert kl[0] == 0.1 and math.isnan(kl[1]) and math.isnan(kl[2])


def test_training_picture_gives_each_quantity_its_own_axis_and_a_constant_as_text():
    """The loss (about 0.01) is not drawn on the gradient norm's axis (about 10), where it looked flat at 0."""
    from bubblespec.observe.report import training_panels

    trains = [{"loss": 0.01 * s, "grad_norm": 10.0 + s, "learning_rate": 1e-4, "ratio_mean": 1.0} for s in range(3)]
    panels, constants = training_panels([step_record(step, train=train) for step, train in enumerate(trains)])
    assert [(title, [label for label, _ in drawn]) for title, drawn in panels] == [
        ("loss", ["loss"]),
        ("gradient norm", ["grad norm"]),
    ]
    assert constants == ["importance ratio pi / pi_old: mean 1 in every step", "learning rate 0.0001 in every step"]


def table_rows(summary: str, heading: str) -> list[list[str]]:
    """The body rows of the first markdown table after ``heading``."""
    section = summary.split(heading, 1)[1].split("\n\n", 2)[1]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()[2:]]


def test_summary_numbers_match_the_step_records(report, records):
    summary = (report / "summary.md").read_text()
    assert "# Run r" in summary and "virtual clock" in summary
    total_tokens = sum(r.generated_tokens for r in records)
    assert f"| generated tokens | {total_tokens} |" in summary
    assert f"| decode steps | {sum(r.decode_steps for r in records)} |" in summary

    steps = table_rows(summary, "## Steps")
    assert [int(row[0]) for row in steps] == list(range(NUM_STEPS))
    for row, record in zip(steps, records, strict=True):
        assert int(row[3]) == record.generated_tokens and int(row[4]) == record.decode_steps
        assert float(row[1]) == pytest.approx(record.reward_mean, abs=5e-4)
        length = acceptance_length(record.draft_tokens_accepted, record.verify_steps)
        assert row[6] == ("—" if record.verify_steps == 0 else f"{length:.2f}")
        assert float(row[9]) == pytest.approx(record.phase_seconds.rollout, abs=5e-4)

    ranks = table_rows(summary, "## Ranks over the whole run")
    assert [int(row[0]) for row in ranks] == list(range(NUM_RANKS))
    assert sum(int(row[2]) for row in ranks) == total_tokens
    for row in ranks:
        rank = int(row[0])
        assert int(row[2]) == sum(r.ranks[rank].shard_tokens for r in records)
        accepted = sum(r.ranks[rank].draft_tokens_accepted for r in records)
        proposed = sum(r.ranks[rank].draft_tokens_proposed for r in records)
        assert row[4] == f"{accepted} / {proposed}"


def test_summary_without_summary_json_is_computed_from_the_steps(run_dir, records, tmp_path):
    copy = copy_run(run_dir, tmp_path)
    (copy / "summary.json").unlink()
    summary = (write_report(copy) / "summary.md").read_text()
    assert "from steps.jsonl" in summary
    assert f"| generated tokens | {sum(r.generated_tokens for r in records)} |" in summary


def segments_of(segments: list[Segment], rank: int, step: int) -> list[Segment]:
    return sorted((s for s in segments if s.rank == rank and s.step == step), key=lambda s: s.start)


def test_timeline_segments_tile_each_step_per_rank(records):
    segments = timeline_segments(records)
    assert {s.rank for s in segments} == set(range(NUM_RANKS))
    step_start = 0.0
    for record in records:
        phases = record.phase_seconds
        rollout_end = step_start + phases.rollout
        step_end = rollout_end + phases.train + phases.weight_sync
        for rank in range(NUM_RANKS):
            mine = segments_of(segments, rank, record.step)
            assert mine[0].start == pytest.approx(step_start) and mine[-1].end == pytest.approx(step_end)
            for before, after in zip(mine, mine[1:], strict=False):
                assert after.start == pytest.approx(before.end)  # no gap, no overlap
            assert [s.kind for s in mine[-2:]] == ["train", "weight_sync"]
            assert mine[-2].start == pytest.approx(rollout_end)
            rollout = mine[:-2]
            assert {s.kind for s in rollout} <= {"generate", "draft", "idle"}
            assert sum(s.end - s.start for s in rollout) == pytest.approx(phases.rollout)
            generated = sum(s.end - s.start for s in rollout if s.kind == "generate")
            assert generated == pytest.approx(record.ranks[rank].generation_seconds)
            drafted = sum(s.end - s.start for s in rollout if s.kind == "draft")
            assert drafted >= record.ranks[rank].drafting_seconds - 1e-12  # the record stops at the barrier
        step_start = step_end


def record(step: int, timelines: list, rollout: float = 10.0, train: float = 4.0, sync: float = 1.0, **fields):
    return step_record(
        step,
        ranks=[RankRecord(rank) for rank in range(len(timelines))],
        timelines=timelines,
        phase_seconds=PhaseSeconds(rollout=rollout, train=train, weight_sync=sync),
        **fields,
    )


def test_timeline_segments_fill_gaps_with_idle_and_clip_to_the_rollout():
    # Wall-clock timelines record no idle entries; entries may come out of order, overlap or outlast the phase.
    records = [
        record(0, [[["draft", 7.0, 12.0], ["generate", 0.0, 5.0]], [["generate", 0.0, 10.0]]]),
        record(1, [[["generate", 0.0, 2.0], ["draft", 1.0, 3.0]], [["generate", 0.0, 8.0], ["idle", 8.0, 10.0]]]),
    ]
    rank0 = [(s.kind, s.start, s.end, s.step) for s in timeline_segments(records) if s.rank == 0]
    assert rank0 == [
        ("generate", 0.0, 5.0, 0),
        ("idle", 5.0, 7.0, 0),
        ("draft", 7.0, 10.0, 0),
        ("train", 10.0, 14.0, 0),
        ("weight_sync", 14.0, 15.0, 0),
        ("generate", 15.0, 17.0, 1),
        ("draft", 17.0, 18.0, 1),
        ("idle", 18.0, 25.0, 1),
        ("train", 25.0, 29.0, 1),
        ("weight_sync", 29.0, 30.0, 1),
    ]
    rank1 = [(s.kind, s.start, s.end) for s in timeline_segments(records) if s.rank == 1 and s.step == 1]
    assert rank1[:2] == [("generate", 15.0, 23.0), ("idle", 23.0, 25.0)]


def test_drafting_while_training_shows_inside_the_training_band():
    training = [[["draft", 0.5, 3.0]], []]
    drafting = record(0, [[["generate", 0.0, 10.0]], [["generate", 0.0, 10.0]]], training_timelines=training)
    rank0 = [(s.kind, s.start, s.end) for s in timeline_segments([drafting]) if s.rank == 0]
    assert rank0 == [
        ("generate", 0.0, 10.0),
        ("train", 10.0, 10.5),
        ("draft", 10.5, 13.0),
        ("train", 13.0, 14.0),
        ("weight_sync", 14.0, 15.0),
    ]
    rank1 = [(s.kind, s.start, s.end) for s in timeline_segments([drafting]) if s.rank == 1]
    assert rank1[1] == ("train", 10.0, 14.0)


def test_unknown_rollout_activity_is_a_clear_error():
    with pytest.raises(ReportError, match=r"step 0, rank 0: unknown rollout activity 'nap'; known: generate"):
        timeline_segments([record(0, [[["nap", 0.0, 1.0]]])])


def test_acceptance_length_and_eval_points():
    assert step_acceptance_length(step_record(0, verify_steps=0, draft_tokens_accepted=0)) is None
    assert step_acceptance_length(step_record(0, verify_steps=4, draft_tokens_accepted=6)) == 2.5
    records = [
        step_record(0, eval_reward_before_training=0.1, eval_reward=0.2),
        step_record(1),
        step_record(2, eval_reward=0.4),
    ]
    assert eval_points(records) == [(0, 0.1), (1, 0.2), (3, 0.4)]


def test_rank_totals_sum_over_steps(records):
    totals = rank_totals(records)
    assert sorted(totals) == list(range(NUM_RANKS))
    assert sum(t["decode_steps"] for t in totals.values()) == sum(r.decode_steps for r in records)


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ReportError, match="does not exist"):
        write_report(tmp_path / "nope")


def test_folder_that_is_not_a_run_directory(tmp_path):
    with pytest.raises(ReportError, match=r"not a run directory: it has no config.yaml and no steps.jsonl") as error:
        write_report(tmp_path)
    assert isinstance(error.value, BubblespecError)
    assert "summary.json" in str(error.value)  # says what a run directory holds
    (tmp_path / "steps.jsonl").write_text("")
    with pytest.raises(ReportError, match=r"it has no config.yaml;"):
        write_report(tmp_path)


def test_empty_steps_file_says_no_step_finished(run_dir, tmp_path):
    copy = copy_run(run_dir, tmp_path)
    (copy / "steps.jsonl").write_text("")
    with pytest.raises(ReportError, match="no step finished"):
        write_report(copy)


def test_truncated_last_line_is_left_out_with_a_warning(run_dir, records, tmp_path):
    copy = copy_run(run_dir, tmp_path)
    lines = (copy / "steps.jsonl").read_text().splitlines()
    (copy / "steps.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    (copy / "summary.json").unlink()  # the crash came before the summary
    with pytest.warns(UserWarning, match=r"last line \(3\) .* incomplete"):
        report = write_report(copy)
    steps = table_rows((report / "summary.md").read_text(), "## Steps")
    assert [int(row[0]) for row in steps] == [0, 1]
    assert (
        f"| generated tokens | {sum(r.generated_tokens for r in records[:2])} |" in (report / "summary.md").read_text()
    )


def test_bad_line_before_the_last_is_an_error(run_dir, tmp_path):
    copy = copy_run(run_dir, tmp_path)
    lines = (copy / "steps.jsonl").read_text().splitlines()
    lines[0] = lines[0][:40]
    (copy / "steps.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError, match=r"steps.jsonl line 1 is not JSON"):
        write_report(copy)
