"""``bubblespec report RUN_DIR``: pictures and a readable summary of a run directory, written to RUN_DIR/report/.

    report/timeline.png   the last TIMELINE_STEPS steps in detail, one row per rank, the steps one after another:
                          generation, drafting in the bubble, the idle rest of the bubble, then training and weight
                          sync across all ranks; below, each rank's seconds per activity over the whole run
    report/steps.png      per step: acceptance length, decode steps vs tokens, bubble use and draft coverage,
                          reward and held-out eval reward
    report/training.png   per step, each on its own axis: loss, gradient norm, entropy, KL, importance ratio,
                          clip fractions, learning rate (those the same in every step as text)
    report/summary.md     headline numbers, a table per step and per rank, the pictures

The timeline is built by :func:`timeline_segments`, a pure function of the step records, so that what the
picture shows can be tested without looking at pixels.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bubblespec.core.errors import BubblespecError, CheckpointError
from bubblespec.core.interfaces import acceptance_length
from bubblespec.observe.records import PromptSamples, StepRecord, read_step_lines
from bubblespec.observe.summary import eval_means_by_name, summarize
from bubblespec.rollout.step import bubble_use

SegmentKind = Literal["generate", "draft", "idle", "train", "weight_sync"]
SEGMENT_LABELS: dict[str, str] = {
    "generate": "generation",
    "draft": "drafting in the bubble",
    "idle": "idle bubble",
    "train": "training",
    "weight_sync": "weight sync",
}
SEGMENT_COLORS: dict[str, str] = {
    "generate": "#1f77b4",
    "draft": "#2ca02c",
    "idle": "#f4a3a3",
    "train": "#ff7f0e",
    "weight_sync": "#9467bd",
}
ROLLOUT_ACTIVITIES = ("generate", "draft", "idle")
TIMELINE_STEPS = 12
"""Steps the timeline draws in detail (the last ones): more would make bars too thin to read."""
RUN_DIRECTORY_CONTENTS = (
    "a run directory (written by `bubblespec run`) holds config.yaml (the resolved config), steps.jsonl (one "
    "line per finished step), checkpoints/ and, once the run has finished, summary.json"
)


class ReportError(BubblespecError, ValueError):
    """A folder that is not a run directory, or a run directory with no finished step to report on."""


@dataclass(frozen=True, slots=True)
class Segment:
    """One bar of the timeline: what ``rank`` did from ``start`` to ``end`` (seconds since the first step began,
    the steps laid one after another) during step ``step``."""

    rank: int
    kind: SegmentKind
    start: float
    end: float
    step: int


def write_report(run_dir: str | Path) -> Path:
    """Writes RUN_DIR/report/ (timeline.png, steps.png, training.png, summary.md) and returns the report folder."""
    from bubblespec.observe.run_dir import RunDirectory

    path = Path(run_dir)
    records = read_step_records(path)
    config = RunDirectory(path).load_config()
    report = path / "report"
    report.mkdir(exist_ok=True)
    draw_timeline(records, config.clock.kind, report / "timeline.png")
    draw_steps(records, report / "steps.png")
    draw_training(records, report / "training.png")
    samples = RunDirectory(path).read_samples()
    (report / "summary.md").write_text(summary_markdown(config, records, _summary(path, config, records), samples))
    return report


def read_step_records(path: Path) -> list[StepRecord]:
    """The records of steps.jsonl, checked to be those of a run directory. A last line cut off by a crash in
    the middle of writing it is left out with a warning; a bad line before the last is an error."""
    if not path.exists():
        raise ReportError(f"run directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ReportError(f"{str(path)!r} is a file, not a run directory; {RUN_DIRECTORY_CONTENTS}")
    missing = [name for name in ("config.yaml", "steps.jsonl") if not (path / name).is_file()]
    if missing:
        raise ReportError(
            f"{str(path)!r} is not a run directory: it has no {' and no '.join(missing)}; {RUN_DIRECTORY_CONTENTS}"
        )
    try:
        records, torn = read_step_lines(path / "steps.jsonl")
    except CheckpointError as error:
        raise ReportError(str(error)) from None
    if torn is not None:
        warnings.warn(
            f"the last line ({torn}) of {path / 'steps.jsonl'} is incomplete, probably cut off by a crash "
            f"while it was written; reporting on the {len(records)} complete step(s) before it",
            stacklevel=2,
        )
    if not records:
        raise ReportError(
            f"{path / 'steps.jsonl'} holds no finished step: the run started but no step finished; nothing to report"
        )
    return records


def timeline_segments(records: list[StepRecord]) -> list[Segment]:
    """The bars of the timeline picture, step after step, rank by rank.

    Step t starts where step t - 1 ended (rollout + train + weight sync seconds). Within a step every rank's
    segments tile it without overlap: its rollout activities in [0, rollout] (``record.timelines[rank]``,
    sorted, clipped to the phase; uncovered time is an idle bubble), then train (with the rank's drafting while
    the trainer runs, ``record.training_timelines``, where there is any) and weight sync.
    """
    num_ranks = max(max(len(r.ranks), len(r.timelines)) for r in records)
    segments: list[Segment] = []
    offset = 0.0
    for record in records:
        step, phases, timelines = record.step, record.phase_seconds, record.timelines
        rollout, train, sync = phases.rollout, phases.train, phases.weight_sync
        for rank in range(num_ranks):
            activities = timelines[rank] if rank < len(timelines) else []
            for kind, start, end in _tile(activities, rollout, step, rank):
                segments.append(Segment(rank, kind, offset + start, offset + end, step))
            # Drafting while the trainer runs (speculation.draft_during_training) shows inside the training band.
            training = (record.training_timelines or [[]] * num_ranks)[rank] if train > 0 else []
            for kind, start, end in _tile(training, train, step, rank, gap="train"):
                segments.append(Segment(rank, kind, offset + rollout + start, offset + rollout + end, step))
            segments.append(
                Segment(rank, "weight_sync", offset + rollout + train, offset + rollout + train + sync, step)
            )
        offset += rollout + train + sync
    return [s for s in segments if s.end > s.start]


def _tile(activities: list, rollout: float, step: int, rank: int, gap: str = "idle") -> list[tuple[str, float, float]]:
    """A rank's activities in a phase sorted and clipped to [0, rollout] without overlap, gaps filled with
    ``gap`` (idle in the rollout; the training band while the trainer runs)."""
    tiled: list[tuple[str, float, float]] = []
    cursor = 0.0
    for kind, start, end in sorted(activities, key=lambda activity: activity[1]):
        if kind not in ROLLOUT_ACTIVITIES:
            raise ReportError(
                f"step {step}, rank {rank}: unknown rollout activity {kind!r}; known: {', '.join(ROLLOUT_ACTIVITIES)}"
            )
        start, end = max(start, cursor), min(end, rollout)
        if end <= start:
            continue
        if start > cursor:
            tiled.append((gap, cursor, start))
        tiled.append((kind, start, end))
        cursor = end
    if cursor < rollout:
        tiled.append((gap, cursor, rollout))
    return tiled


def rank_activity_seconds(records: list[StepRecord]) -> dict[int, dict[str, float]]:
    """Per rank, the seconds of each timeline activity summed over the steps (the timeline's bars, added up)."""
    totals: dict[int, dict[str, float]] = {}
    for segment in timeline_segments(records):
        rank = totals.setdefault(segment.rank, dict.fromkeys(SEGMENT_LABELS, 0.0))
        rank[segment.kind] += segment.end - segment.start
    return totals


def draw_timeline(records: list[StepRecord], clock: str, file: Path) -> None:
    """The last :data:`TIMELINE_STEPS` steps bar by bar, and under them every rank's seconds per activity over
    the whole run, so that the picture stays readable at any run length."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    shown_records = records[-TIMELINE_STEPS:]
    segments = timeline_segments(shown_records)
    num_ranks = 1 + max(s.rank for s in segments)
    num_steps = len(shown_records)
    size = (min(6 + 0.7 * num_steps, 16), min(4.4 + 0.7 * num_ranks, 18))
    figure = Figure(figsize=size, dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    axes, totals_axes = figure.subplots(2, 1, height_ratios=[1.4, 1])
    bounds = _step_bounds(shown_records)
    for index, (start, end) in enumerate(bounds):
        if index % 2 == 0:
            axes.axvspan(start, end, color="#ececec", zorder=0)
    for kind in SEGMENT_LABELS:
        for rank in range(num_ranks):
            bars = [(s.start, s.end - s.start) for s in segments if s.kind == kind and s.rank == rank]
            # Train and sync hold every rank: full-height bars join into one band across the rows.
            height = 1.0 if kind in ("train", "weight_sync") else 0.7
            axes.broken_barh(bars, (rank - height / 2, height), color=SEGMENT_COLORS[kind], linewidth=0, zorder=2)
    axes.set_xlim(0, bounds[-1][1])
    axes.set_ylim(num_ranks - 0.5, -0.5)  # rank 0 on top
    axes.set_yticks(range(num_ranks), [f"rank {rank}" for rank in range(num_ranks)])
    axes.set_xlabel(f"{clock} seconds (steps one after another)")
    top = axes.secondary_xaxis("top")
    top.set_xticks([(start + end) / 2 for start, end in bounds], [str(r.step) for r in shown_records])
    top.set_xlabel("step")
    which = "every step" if num_steps == len(records) else f"the last {num_steps} of {len(records)} steps"
    axes.set_title(f"what each rank did: {which} ({clock} clock)")

    totals = rank_activity_seconds(records)
    ranks = sorted(totals)
    left = [0.0] * len(ranks)
    for kind in SEGMENT_LABELS:
        widths = [totals[rank][kind] for rank in ranks]
        totals_axes.barh(ranks, widths, left=left, color=SEGMENT_COLORS[kind], height=0.7)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for rank, total in zip(ranks, left, strict=True):
        idle = totals[rank]["idle"]
        totals_axes.text(total, rank, f"  idle {idle / total:.0%}" if total else "", va="center", fontsize="small")
    totals_axes.set_ylim(len(ranks) - 0.5, -0.5)
    totals_axes.set_yticks(ranks, [f"rank {rank}" for rank in ranks])
    totals_axes.set_xlabel(f"{clock} seconds")
    totals_axes.set_title(f"seconds per activity over all {len(records)} steps")
    handles = [Patch(color=SEGMENT_COLORS[kind], label=label) for kind, label in SEGMENT_LABELS.items()]
    figure.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)
    figure.savefig(file)


TRAINING_PANELS = (
    ("loss", (("loss", "loss"),)),
    ("gradient norm", (("grad_norm", "grad norm"),)),
    ("entropy (nats/token)", (("entropy", "entropy"),)),
    ("KL to the reference", (("kl", "KL"),)),
    ("importance ratio pi / pi_old", (("ratio_min", "min"), ("ratio_mean", "mean"), ("ratio_max", "max"))),
    ("fraction of tokens clipped", (("clip_fraction_low", "low"), ("clip_fraction_high", "high"))),
    ("learning rate", (("learning_rate", "learning rate"),)),
)
"""training.png's panels: quantities of one unit and scale share a panel, every other quantity has its own."""


def training_series(records: list[StepRecord], field: str) -> list[float]:
    """A training metric per step; NaN where the step trained nothing (no reward signal) or lacks it."""
    values = []
    for record in records:
        train = record.train
        values.append(math.nan if train.get("skipped") or field not in train else float(train[field]))
    return values


def training_panels(records: list[StepRecord]) -> tuple[list[tuple[str, list]], list[str]]:
    """The panels training.png draws, each (title, [(label, series)]), and as text instead of flat lines the panels
    whose quantities are the same in every step that has them ("learning rate 0.0001 in every step"; one update per
    batch keeps the importance ratio at 1). A series the run has no value for is left out."""
    panels, constants = [], []
    for title, fields in TRAINING_PANELS:
        series = [(label, training_series(records, field)) for field, label in fields]
        drawn = [(label, values) for label, values in series if not all(math.isnan(v) for v in values)]
        known = [{v for v in values if not math.isnan(v)} for _, values in drawn]
        if len(records) > 1 and drawn and all(len(values) == 1 for values in known):
            text = ", ".join(f"{label} {values.pop():.4g}" for (label, _), values in zip(drawn, known, strict=True))
            one_named_as_panel = [label for label, _ in drawn] == [title]
            constants.append(f"{text} in every step" if one_named_as_panel else f"{title}: {text} in every step")
        elif drawn:
            panels.append((title, drawn))
    return panels, constants


def draw_training(records: list[StepRecord], file: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps = [r.step for r in records]
    panels, constants = training_panels(records)
    columns = min(3, max(len(panels), 1))
    rows = max(math.ceil(len(panels) / columns), 1)
    figure = Figure(figsize=(min(4 * columns + 0.1 * len(steps), 20), 3.2 * rows + 1), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    cells = list(figure.subplots(rows, columns, squeeze=False).flat)
    for axes, (title, drawn) in zip(cells, panels, strict=False):
        for label, series in drawn:
            axes.plot(steps, series, ".-", label=label)
        axes.set(title=title, xlabel="step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
        if len(drawn) > 1:
            axes.legend(fontsize="small")
    for axes in cells[len(panels) :]:
        axes.set_visible(False)
    title = "the policy update per step (gaps: steps without reward signal, which train nothing)"
    figure.suptitle("\n".join([title, *constants]))
    figure.savefig(file)


def _step_bounds(records: list[StepRecord]) -> list[tuple[float, float]]:
    """(start, end) of every step on the timeline, from its rollout start to its weight sync end."""
    bounds = []
    offset = 0.0
    for record in records:
        length = record.phase_seconds.total
        bounds.append((offset, offset + length))
        offset += length
    return bounds


def step_acceptance_length(record: StepRecord) -> float | None:
    """Mean acceptance length of a step; None when no decode step verified a draft."""
    verify = record.verify_steps
    return acceptance_length(record.draft_tokens_accepted, verify) if verify else None


def eval_points(records: list[StepRecord]) -> list[tuple[int, float]]:
    """(policy version, held-out eval reward): step t's eval runs after its update, i.e. on version t + 1;
    ``eval_reward_before_training`` of step 0 is version 0."""
    before = records[0].eval_reward_before_training
    points = [(0, before)] if before is not None else []
    return points + [(r.step + 1, r.eval_reward) for r in records if r.eval_reward is not None]


def draw_steps(records: list[StepRecord], file: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps = [r.step for r in records]
    figure = Figure(figsize=(min(10 + 0.1 * len(steps), 20), 7.5), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    acceptance, tokens, utilisation, reward = figure.subplots(2, 2).flat
    lengths = [step_acceptance_length(r) for r in records]
    acceptance.plot(steps, [math.nan if v is None else v for v in lengths], "o-", color="#2ca02c")
    acceptance.set(title="acceptance length (tokens per verify step)", ylabel="tokens", xlabel="step")
    tokens.plot(steps, [r.generated_tokens for r in records], "o-", label="generated tokens")
    tokens.plot(steps, [r.decode_steps for r in records], "s-", label="decode steps")
    tokens.set(title="decode steps vs tokens (equal without speculation)", xlabel="step")
    utilisation.plot(steps, [r.bubble_utilization for r in records], "o-", label="bubble utilisation")
    utilisation.plot(steps, [r.draft_coverage for r in records], "s-", label="draft coverage")
    utilisation.set(title="bubble use and draft coverage", ylim=(-0.05, 1.05), xlabel="step")
    reward.plot(steps, [r.reward_mean for r in records], "o-", label="rollout reward (policy of the step)")
    evals = eval_points(records)
    if evals:
        versions, values = zip(*evals, strict=True)
        reward.plot(versions, values, "s--", label="held-out eval (policy after the step's update)")
    reward.set(title="reward", xlabel="step (policy version)")
    for axes in (tokens, utilisation, reward):
        axes.legend(fontsize="small")
    for axes in (acceptance, tokens, utilisation, reward):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
    figure.savefig(file)


def _summary(path: Path, config, records: list[StepRecord]) -> dict:
    """summary.json when it describes these steps; else the same numbers computed from the records."""
    file = path / "summary.json"
    if file.is_file():
        summary = json.loads(file.read_text())
        if summary.get("num_steps") == len(records):
            return summary | {"source": "summary.json"}
    summary = summarize(config, records, wall_seconds=math.nan)
    summary.pop("wall_seconds")
    return summary | {"source": "steps.jsonl (no summary.json of these steps: the run has not finished)"}


HEADLINE = (
    ("num_steps", "steps"),
    ("speculation", "speculation"),
    ("reward_first", "reward, first step"),
    ("reward_last", "reward, last step"),
    ("reward_failures", "reward calls that failed (scored 0)"),
    ("steps_not_trained", "steps that trained nothing (every group's rewards equal)"),
    ("generated_tokens", "generated tokens"),
    ("decode_steps", "decode steps"),
    ("decode_steps_saved", "decode steps saved"),
    ("acceptance_length_mean", "acceptance length (mean)"),
    ("draft_coverage_mean", "draft coverage (mean over steps)"),
    ("bubble_utilization", "bubble utilisation (last step left out)"),
    ("rollout_seconds", "rollout seconds"),
    ("rollout_seconds_saved", "rollout seconds saved by drafts (estimated; negative: cost)"),
    ("rollout_tokens_per_second", "rollout tokens per second"),
    ("wall_seconds", "wall seconds of the whole run (every part of a resumed run)"),
)
STEP_COLUMNS = (
    "step",
    "reward",
    "eval after update",
    "tokens",
    "decode steps",
    "decode steps saved",
    "acceptance length",
    "coverage",
    "bubble use",
    "rollout s",
    "saved s",
    "train s",
    "sync s",
)
RANK_COLUMNS = ("rank", "requests", "tokens", "decode steps", "accepted / proposed", "bubble s", "drafting s", "use")


def summary_markdown(
    config, records: list[StepRecord], summary: dict, samples: list[PromptSamples] | None = None
) -> str:
    """summary.md: headline numbers (from ``summary``), one table row per step and one per rank, the pictures, and
    the last of the logged ``samples``."""
    clock = config.clock.kind
    lines = [
        f"# Run {config.name}",
        "",
        f"{len(records)} step(s) on the {clock} clock (seconds below are {clock} seconds); "
        f"headline numbers from {summary['source']}.",
        "",
        "| measure | value |",
        "|---|---:|",
    ]
    lines += [f"| {label} | {_format(summary[key])} |" for key, label in HEADLINE if key in summary]
    means = summary.get("reward_means") or {}
    lines += [f"| reward {name} (mean, unweighted) | {_format(mean)} |" for name, mean in means.items()]
    evals = summary.get("eval_rewards") or {}
    if evals:
        shown = "  ".join(
            f"{'before training' if k == 'start' else f'after {k}'}: {_format(v)}" for k, v in evals.items()
        )
        lines.append(f"| held-out eval reward | {shown} |")
    for name, by_step in eval_means_by_name(summary).items():
        shown = "  ".join(
            f"{'before training' if k == 'start' else f'after {k}'}: {_format(v)}" for k, v in by_step.items()
        )
        lines.append(f"| held-out eval {name} (unweighted) | {shown} |")
    if "speculation_effect" in summary:
        lines += ["", f"**Did speculation help?** {summary['speculation_effect']}."]
    lines += ["", "## Timeline", "", "![what each rank did](timeline.png)", "", "## Steps", ""]
    lines += _table(STEP_COLUMNS, [_step_row(r) for r in records])
    lines += [
        "",
        "Eval after update: held-out reward of the policy trained in that step. Decode steps saved: "
        "1 - decode steps / tokens. Acceptance length: tokens per verify step (— when no draft was verified). "
        "Saved s: rollout seconds the drafts saved (negative: cost), estimated by replaying the step's responses "
        "without drafts under the run's own forward-pass timings.",
        "",
        "![per-step measures](steps.png)",
        "",
        "## Training",
        "",
        "![the policy update per step](training.png)",
        "",
        "## Ranks over the whole run",
        "",
    ]
    uses = rank_bubble_use(records, config.num_steps)
    lines += _table(
        RANK_COLUMNS, [_rank_row(rank, totals, uses[rank]) for rank, totals in sorted(rank_totals(records).items())]
    )
    lines.append("")
    lines.append("Use: the rank's bubble seconds spent drafting, the run's last step left out (as in the headline).")
    if samples:
        lines += ["", "## Samples", "", f"The last logged prompt of the run (step {samples[-1].step}), every response "
                  "with its reward and advantage; all logged prompts are in samples.jsonl.", ""]  # fmt: skip
        lines += _samples_markdown(samples[-1])
    return "\n".join(lines) + "\n"


def rank_bubble_use(records: list[StepRecord], num_steps: int) -> dict[int, float]:
    """Per rank, :func:`~bubblespec.rollout.step.bubble_use` over the run's steps but its last."""
    by_rank: dict[int, list] = {}
    for record in records:
        for rank in record.ranks:
            by_rank.setdefault(rank.rank, [])
            if record.step < num_steps - 1:
                by_rank[rank.rank].append(rank)
    return {rank: bubble_use(ranks) for rank, ranks in by_rank.items()}


def _samples_markdown(logged: PromptSamples, width: int = 600) -> list[str]:
    lines = ["Prompt, as the model read it:", "", "```text", _cut(logged.prompt, width), "```", "",
             f"Reference answer: `{logged.answer}`", ""]  # fmt: skip
    for response in logged.responses:
        parts = ", ".join(f"{name} {score:.3f}" for name, score in response.rewards.items())
        lines += [
            f"Sample {response.sample}: reward {response.reward:.3f}{f' ({parts})' if parts else ''}, advantage "
            f"{response.advantage:+.3f}, {response.tokens} tokens ({response.finish_reason})",
            "",
            "```text",
            _cut(response.text, width),
            "```",
            "",
        ]
    return lines


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else f"{text[:width]}… ({len(text) - width} more characters)"


def rank_totals(records: list[StepRecord]) -> dict[int, dict[str, float]]:
    """Per rank, the sum over steps of its counters (requests, tokens, decode steps, drafts, seconds)."""
    fields = (
        "num_requests",
        "shard_tokens",
        "decode_steps",
        "draft_tokens_accepted",
        "draft_tokens_proposed",
        "bubble_seconds",
        "drafting_seconds",
    )
    totals: dict[int, dict[str, float]] = {}
    for record in records:
        for rank in record.ranks:
            total = totals.setdefault(rank.rank, dict.fromkeys(fields, 0))
            for name in fields:
                total[name] += getattr(rank, name)
    return totals


def _step_row(record: StepRecord) -> list[str]:
    phases, tokens = record.phase_seconds, record.generated_tokens
    length = step_acceptance_length(record)
    return [
        str(record.step),
        _format(record.reward_mean),
        "" if record.eval_reward is None else _format(record.eval_reward),
        str(tokens),
        str(record.decode_steps),
        f"{1 - record.decode_steps / tokens:.1%}" if tokens else "—",
        "—" if length is None else f"{length:.2f}",
        f"{record.draft_coverage:.2f}",
        f"{record.bubble_utilization:.2f}",
        f"{phases.rollout:.3f}",
        "—" if record.rollout_seconds_saved is None else f"{record.rollout_seconds_saved:+.3f}",
        f"{phases.train:.3f}",
        f"{phases.weight_sync:.3f}",
    ]


def _rank_row(rank: int, totals: dict[str, float], use: float) -> list[str]:
    return [
        str(rank),
        str(totals["num_requests"]),
        str(totals["shard_tokens"]),
        str(totals["decode_steps"]),
        f"{totals['draft_tokens_accepted']} / {totals['draft_tokens_proposed']}",
        f"{totals['bubble_seconds']:.3f}",
        f"{totals['drafting_seconds']:.3f}",
        f"{use:.2f}",
    ]


def _table(columns: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---:" for _ in columns) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _format(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
