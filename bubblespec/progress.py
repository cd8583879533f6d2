"""What ``bubblespec run`` shows while it runs: a live per-rank table of the latest step, then a summary."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from bubblespec.config import RunConfig


class StepPrinter:
    def __init__(self, config: RunConfig, console: Console | None = None) -> None:
        self.config = config
        self.console = console or Console()
        self._live = Live(self._waiting(), console=self.console, refresh_per_second=4, transient=True)

    def __enter__(self) -> StepPrinter:
        self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._live.__exit__(*exc)

    def step(self, record: dict) -> None:
        phases = record["phase_seconds"]
        self._live.console.print(
            f"step {record['step']:>3}  reward {record['reward_mean']:.3f}  tokens {record['generated_tokens']:>6}  "
            f"decode steps {record['decode_steps']:>6}  coverage {record['draft_coverage']:.2f}  "
            f"bubble use {record['bubble_utilization']:.2f}  rollout {phases['rollout']:.2f}s  "
            f"train {phases['train']:.2f}s  sync {phases['weight_sync']:.2f}s"
            + (f"  eval reward {record['eval_reward']:.3f}" if "eval_reward" in record else "")
        )
        self._live.update(self._rank_table(record))

    def summary(self, summary: dict, run_dir: Path) -> None:
        table = Table(title=f"run {summary.get('name', '')} ({self.config.clock.kind} clock)")
        table.add_column("measure")
        table.add_column("value", justify="right")
        for name in (
            "num_steps",
            "reward_first",
            "reward_last",
            "generated_tokens",
            "decode_steps",
            "acceptance_length_mean",
            "draft_coverage_mean",
            "bubble_utilization",
            "rollout_seconds",
            "rollout_tokens_per_second",
            "wall_seconds",
        ):
            value = summary.get(name)
            table.add_row(name, f"{value:.3f}" if isinstance(value, float) else str(value))
        evals = summary.get("eval_rewards") or {}
        if evals:
            table.add_row("eval reward by step", "  ".join(f"{step}: {value:.3f}" for step, value in evals.items()))
        self.console.print(table)
        self.console.print(f"run directory: {run_dir}")

    def _waiting(self) -> Table:
        table = Table(title="waiting for the first step")
        table.add_column("rank")
        return table

    def _rank_table(self, record: dict) -> Table:
        table = Table(title=f"step {record['step']} per rank ({self.config.clock.kind} seconds)")
        for column in ("rank", "requests", "tokens", "decode", "accepted", "bubble s", "drafting s", "drafts"):
            table.add_column(column, justify="right")
        for rank in record["ranks"]:
            table.add_row(
                str(rank["rank"]),
                str(rank["num_requests"]),
                str(rank["shard_tokens"]),
                str(rank["decode_steps"]),
                f"{rank['draft_tokens_accepted']}/{rank['draft_tokens_proposed']}",
                f"{rank['bubble_seconds']:.3f}",
                f"{rank['drafting_seconds']:.3f}",
                str(rank["draft_requests"]),
            )
        return table
