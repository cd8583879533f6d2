"""What ``bubblespec run`` shows while it runs: one line per step, a live table of what every rank is doing
now (wall clock: generating, drafting in the bubble, idle) above the per-rank table of the last step, and a
summary at the end."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from bubblespec.core.config import RunConfig
from bubblespec.observe.records import StepRecord
from bubblespec.observe.summary import eval_means_by_name


def setup_logging(console: Console, level: str) -> None:
    """bubblespec's logs (one structured line per step at INFO) through the console, above the live display."""
    handler = _ConsoleHandler(console)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%dT%H:%M:%S"))
    package = logging.getLogger("bubblespec")
    package.handlers[:] = [handler]
    package.setLevel(level)


class _ConsoleHandler(logging.Handler):
    """Writes each record as one line, never wrapped at the terminal's width (log lines are for grep)."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(self.format(record), soft_wrap=True, markup=False, highlight=False)
        except Exception:
            self.handleError(record)


class StepPrinter:
    def __init__(self, config: RunConfig, console: Console | None = None) -> None:
        self.config = config
        self.console = console or Console()
        self._lock = threading.Lock()  # drafting during training reports from another thread
        self._phase = "starting"
        self._phase_began = time.perf_counter()
        self._ranks: dict[int, tuple[str, str, float]] = {}
        self._last_step: Table | None = None
        # Live re-renders four times a second through get_renderable, so the "for" column keeps counting.
        self._live = Live(console=self.console, get_renderable=self._render, refresh_per_second=4, transient=True)

    def __enter__(self) -> StepPrinter:
        self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._live.__exit__(*exc)

    def step(self, record: StepRecord) -> None:
        """The last step's per-rank table goes live; its one-line summary is the controller's log line."""
        with self._lock:
            self._last_step = self._rank_table(record)

    def phase(self, step: int, phase: str) -> None:
        with self._lock:
            self._phase, self._phase_began = (
                f"step {step} ({step + 1}/{self.config.num_steps}): {phase}",
                time.perf_counter(),
            )

    def activity(self, rank: int, activity: str, detail: str) -> None:
        with self._lock:
            self._ranks[rank] = (activity, detail, time.perf_counter())

    def summary(self, summary: dict, run_dir: Path) -> None:
        table = Table(title=f"run {summary.get('name', '')} ({self.config.clock.kind} clock)")
        table.add_column("measure")
        table.add_column("value", justify="right")
        for name in (
            "num_steps",
            "reward_first",
            "reward_last",
            "reward_failures",
            "steps_not_trained",
            "generated_tokens",
            "decode_steps",
            "decode_steps_saved",
            "acceptance_length_mean",
            "draft_coverage_mean",
            "bubble_utilization",
            "rollout_seconds",
            "rollout_seconds_saved",
            "rollout_tokens_per_second",
            "wall_seconds",
        ):
            value = summary.get(name)
            table.add_row(name, f"{value:.3f}" if isinstance(value, float) else str(value))
        if "wall_seconds_of_parts" in summary:  # a resumed run
            parts = summary["wall_seconds_of_parts"]
            table.add_row("wall seconds of its parts", " + ".join(f"{part:.1f}" for part in parts))
        for name, mean in (summary.get("reward_means") or {}).items():
            table.add_row(f"reward {name} (mean)", f"{mean:.3f}")
        evals = summary.get("eval_rewards") or {}
        if evals:
            table.add_row("eval reward by step", "  ".join(f"{step}: {value:.3f}" for step, value in evals.items()))
        for name, by_step in eval_means_by_name(summary).items():
            table.add_row(f"eval {name} by step", "  ".join(f"{step}: {value:.3f}" for step, value in by_step.items()))
        self.console.print(table)
        if "speculation_effect" in summary:
            self.console.print(summary["speculation_effect"])
        self.console.print(f"run directory: {run_dir}")

    def _render(self) -> Group:
        with self._lock:
            return self._render_unlocked()

    def _render_unlocked(self) -> Group:
        now = time.perf_counter()
        table = Table(title=f"{self._phase} ({now - self._phase_began:.1f}s)")
        for column in ("rank", "now", "for", "detail"):
            table.add_column(column, justify="left" if column == "detail" else "right")
        for rank, (activity, detail, since) in sorted(self._ranks.items()):
            table.add_row(str(rank), activity, f"{now - since:.1f}s", detail)
        return Group(table, self._last_step) if self._last_step is not None else Group(table)

    def _rank_table(self, record: StepRecord) -> Table:
        table = Table(title=f"step {record.step} per rank ({self.config.clock.kind} seconds)")
        for column in ("rank", "requests", "tokens", "decode", "accepted", "bubble s", "drafting s", "drafts"):
            table.add_column(column, justify="right")
        for rank in record.ranks:
            table.add_row(
                str(rank.rank),
                str(rank.num_requests),
                str(rank.shard_tokens),
                str(rank.decode_steps),
                f"{rank.draft_tokens_accepted}/{rank.draft_tokens_proposed}",
                f"{rank.bubble_seconds:.3f}",
                f"{rank.drafting_seconds:.3f}",
                str(rank.draft_requests),
            )
        return table
