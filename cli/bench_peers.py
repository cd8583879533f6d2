"""``bubblespec bench peers CONFIG``: the draft sources users would pick instead of ours, side by side.

Every variant is the config's run with another ``speculation.draft_sources`` (``none`` is plain decoding), on the
same keys, so every variant's rollouts must equal plain decoding's, step by step (checked: the rollout digests).
Per step and variant: decode steps and their reduction against ``none``, acceptance length (tokens per verify
step), draft coverage (requests that arrived with a draft), proposal coverage (requests that verified at least
one proposed token, whatever proposed it) and the rollout throughput ratio against ``none`` (rollout-phase
seconds, on the config's clock).

Variants that use ``group`` run with ``prompt-grouped`` sharding (every sample of a prompt on one rank, as Seer
deploys it: siblings can only propose for each other inside one engine); the others keep the config's.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from bubblespec.config import RunConfig
from bubblespec.interfaces import acceptance_length

DEFAULT_VARIANTS = (
    "none",
    "ngram",
    "group",
    "history",
    "history+group+ngram",
    "bubble",
    "bubble+ngram",
    "bubble+group+ngram",
)


def parse_variant(text: str) -> list[str]:
    """``"bubble+group+ngram"`` -> ``["bubble", "group", "ngram"]`` (validated with the config)."""
    return [name.strip() for name in text.split("+") if name.strip()]


def _variant(config: RunConfig, sources: list[str], output_dir: Path) -> RunConfig:
    options = {k: v for k, v in config.speculation.draft_source_options.items() if k in sources}
    update = {"enabled": True, "draft_sources": sources, "draft_source_options": options}
    if "group" in sources:
        update["sharding_policy"] = "prompt-grouped"
    speculation = config.speculation.model_dump() | update
    data = config.model_dump() | {
        "speculation": speculation,
        "name": f"{config.name}-{'.'.join(sources)}",
        "output_dir": str(output_dir),
    }
    return RunConfig.model_validate(data)  # validates the source names too


def run_peers(config: RunConfig, variants: list[str], output_dir: Path | None = None) -> dict:
    from bubblespec.launch import run
    from bubblespec.run_dir import RunDirectory

    if "none" not in variants:
        variants = ["none", *variants]
    configs = {v: _variant(config, parse_variant(v), Path(".")) for v in variants}  # fail before any run
    scratch = output_dir is None
    output_dir = Path(tempfile.mkdtemp(prefix="bubblespec-peers-")) if scratch else output_dir
    steps: dict[str, list[dict]] = {}
    try:
        for variant in variants:
            variant_config = configs[variant].model_copy(update={"output_dir": str(output_dir)})
            run(variant_config)
            steps[variant] = RunDirectory(variant_config.run_dir).read_steps()
    finally:
        if scratch:
            shutil.rmtree(output_dir, ignore_errors=True)
    epoch = _epoch_steps(config)
    plain = steps["none"]
    report = {
        "config": config.name,
        "clock": config.clock.kind,
        "profile": config.clock.profile if config.clock.kind == "virtual" else None,
        "num_ranks": config.rollout.num_ranks,
        "num_steps": config.num_steps,
        "epoch_steps": epoch,
        "variants": variants,
        "per_step": {v: [_compare(off, on) for off, on in zip(plain, steps[v], strict=True)] for v in variants},
        "from_step_2": {v: _aggregate(plain[1:], steps[v][1:]) for v in variants},
        "steady_state": {v: _aggregate(plain[epoch:], steps[v][epoch:]) for v in variants},
    }
    report["identical_rollouts"] = all(s["identical_rollouts"] for v in variants for s in report["per_step"][v])
    return report


def _epoch_steps(config: RunConfig) -> int:
    """Steps until prompts repeat (history has drafts from then on); 1 when they never repeat."""
    size = config.task.options.get("dataset_size")
    return max(1, size // config.task.prompts_per_step) if size else 1


def _compare(off: dict, on: dict) -> dict:
    return {
        "step": on["step"],
        "decode_steps": on["decode_steps"],
        "decode_step_reduction": 1 - on["decode_steps"] / off["decode_steps"] if off["decode_steps"] else 0.0,
        "acceptance_length_mean": acceptance_length(on["draft_tokens_accepted"], on["verify_steps"]),
        "draft_coverage": on["draft_coverage"],
        "proposal_coverage": on.get("proposal_coverage", 0.0),
        "rollout_seconds": on["phase_seconds"]["rollout"],
        "throughput_ratio": off["phase_seconds"]["rollout"] / on["phase_seconds"]["rollout"],
        "identical_rollouts": off["rollout_digest"] == on["rollout_digest"] and off["reward_mean"] == on["reward_mean"],
    }


def _aggregate(off: list[dict], on: list[dict]) -> dict:
    if not on:
        return {}
    seconds_off = sum(s["phase_seconds"]["rollout"] for s in off)
    seconds_on = sum(s["phase_seconds"]["rollout"] for s in on)
    return {
        "decode_step_reduction": 1 - sum(s["decode_steps"] for s in on) / sum(s["decode_steps"] for s in off),
        "acceptance_length_mean": acceptance_length(
            sum(s["draft_tokens_accepted"] for s in on), sum(s["verify_steps"] for s in on)
        ),
        "draft_coverage": sum(s["draft_coverage"] for s in on) / len(on),
        "proposal_coverage": sum(s.get("proposal_coverage", 0.0) for s in on) / len(on),
        "throughput_ratio": seconds_off / seconds_on,  # same tokens: the ratio of tokens per second
    }


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    title = f"{report['config']}: draft sources per step (from 1), against none ({report['clock']} clock)"
    table = Table(title=title)
    for column in ("source", "step", "decode steps", "reduction", "acceptance", "draft cov", "proposal cov", "speed"):
        table.add_column(column, justify="right")
    for variant in report["variants"]:
        for s in report["per_step"][variant]:
            table.add_row(
                variant,
                str(s["step"] + 1),
                str(s["decode_steps"]),
                f"{s['decode_step_reduction']:.1%}",
                f"{s['acceptance_length_mean']:.2f}",
                f"{s['draft_coverage']:.2f}",
                f"{s['proposal_coverage']:.2f}",
                f"{s['throughput_ratio']:.2f}x" + ("" if s["identical_rollouts"] else " DIFFERENT"),
            )
    console.print(table)
    for label in ("from_step_2", "steady_state"):
        first = 2 if label == "from_step_2" else report["epoch_steps"] + 1
        summary = Table(title=f"{label.replace('_', ' ')}: steps {first} to {report['num_steps']}")
        for column in ("source", "reduction", "acceptance", "draft cov", "proposal cov", "throughput"):
            summary.add_column(column, justify="right")
        for variant, a in report[label].items():
            summary.add_row(
                variant,
                f"{a['decode_step_reduction']:.1%}",
                f"{a['acceptance_length_mean']:.2f}",
                f"{a['draft_coverage']:.2f}",
                f"{a['proposal_coverage']:.2f}",
                f"{a['throughput_ratio']:.2f}x",
            )
        console.print(summary)
    console.print(f"identical_rollouts={report['identical_rollouts']}")


def plot_report(report: dict, folder: Path) -> list[Path]:
    """One PNG per question: decode-step reduction per step, and rollout throughput ratio per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for field, label, name in (
        ("decode_step_reduction", "decode steps saved vs none", "peers-decode-steps.png"),
        ("throughput_ratio", "rollout throughput vs none (x)", "peers-throughput.png"),
    ):
        figure, axes = plt.subplots(figsize=(7, 4))
        for variant in report["variants"]:
            rows = report["per_step"][variant]
            axes.plot([r["step"] + 1 for r in rows], [r[field] for r in rows], "o-", label=variant)
        axes.set_xlabel("step")
        axes.set_ylabel(label)
        title = f"{report['config']}: {report['num_ranks']} ranks, {report['profile'] or report['clock']}"
        axes.set_title(title)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        path = folder / name
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written
