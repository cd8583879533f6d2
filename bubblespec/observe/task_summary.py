"""What the model and the rewards will see: the task summary ``bubblespec validate`` prints.

Row counts, one prompt fully rendered (chat template and system prompt applied) with its reference answer, the
spread of prompt lengths in tokens, the rewards, and warnings for what usually means a wrong model or template
(prompts made mostly of the tokenizer's unknown token, rows whose own system message replaces ``system_prompt``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from bubblespec.core.interfaces import Task


@dataclass
class TaskSummary:
    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def summarize_task(task: Task, eval_task: Task | None = None) -> TaskSummary:
    """The summary of a built task (and its held-out version). Tasks over rows (the dataset and reasoning-gym
    tasks) say more than procedural ones, whose prompts are made step by step: their first step's prompts are
    shown."""
    summary = TaskSummary()
    rows = task.prompts
    prompts = rows if rows is not None else task.batch(0)
    if rows is None:
        summary.lines.append(f"train prompts: made step by step by the task ({len(prompts)} in step 0)")
    else:
        dropped = task.num_dropped_prompts
        summary.lines.append(f"train rows: {len(rows)}" + (f" ({dropped} dropped: too long)" if dropped else ""))
    if eval_task is not None:
        held_out = eval_task.prompts
        count = len(held_out) if held_out is not None else len(eval_task.batch(0))
        summary.lines.append(f"held-out rows: {count}")
    lengths = sorted(len(p.token_ids) for p in prompts)
    # 'inclusive' interpolates between the lengths seen; the default 'exclusive' extrapolates past the longest
    deciles = statistics.quantiles(lengths, n=10, method="inclusive") if len(lengths) > 1 else lengths * 9
    summary.lines.append(
        f"prompt tokens: min {lengths[0]}, median {statistics.median(lengths):g}, 90th percentile {deciles[-1]:g}, "
        f"max {lengths[-1]}"
    )
    if task.reward_names():
        summary.lines.append(f"rewards: {', '.join(task.reward_names())}")
    if task.unknown_token_share is not None:
        summary.lines.append(f"unknown tokens: {task.unknown_token_share:.1%} of prompt tokens")
        if task.unknown_tokens_warning() is not None:
            summary.warnings.append(task.unknown_tokens_warning())
    if task.own_system_prompts:
        summary.warnings.append(
            f"{task.own_system_prompts} rows begin with their own system message: task.options.system_prompt is not "
            "added to them"
        )
    first = prompts[0]
    summary.lines += [f"first prompt ({first.uid}), as the model reads it:", _indent(first.text)]
    if first.answer:
        summary.lines.append(f"its reference answer, as rewards get it: {first.answer!r}")
    return summary


def _indent(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.split("\n"))
