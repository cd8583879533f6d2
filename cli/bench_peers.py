"""``bubblespec bench peers CONFIG``: the draft sources users would pick instead of ours, side by side.

Every variant is the config's run with another ``speculation.draft_sources`` (``none`` is plain decoding), on the
same keys and with coupled verification, so every variant's rollouts must equal plain decoding's, step by step
(checked: the rollout digests). Per step and variant: decode steps and their reduction against the baseline,
acceptance length (tokens per verify step), draft coverage (requests that arrived with a draft), proposal coverage
(requests that verified at least one proposed token, whatever proposed it) and the rollout throughput ratio
against the baseline (generated tokens per rollout-phase second, on the config's clock).

A variant with the suffix ``:one-hot`` (``bubble:one-hot``) runs with ``rollout.verification: one_hot``: every
policy version samples with its own noise stream, independent of the one the drafts were made with, so a draft
agrees only as often as an independent sample would (what engines that cannot take keyed noise get). Its rollouts
are other samples than coupled plain decoding's; its baseline is ``none:one-hot`` (plain decoding with the same
streams, added when a one-hot variant is asked for), whose rollouts it must equal (checked by digest).
Reductions and throughput are per generated token (for variants with identical tokens the normalisation changes
nothing). Variants without a suffix run coupled whatever the config says.

A variant may end its sources with ``*N`` (``bubble+suffix+ngram*4``): ``speculation.draft_candidates: N``, up to N
proposals of a pass verified together as a token tree (the torch backend); without it the config's setting holds.

``head`` among a variant's sources (``head``, ``bubble+head``) turns on the draft head learned online
(``speculation.draft_head``, docs/design.md §14): ``head`` alone is what TLT and FastGRPO do (a drafter trained online
on the policy's hidden states, no bubble drafts); per step it adds the head's tokens proposed and accepted.

Variants that use ``group`` run with ``prompt-grouped`` sharding (every sample of a prompt on one rank, as Seer
deploys it: siblings can only propose for each other inside one engine); the others keep the config's.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from bubblespec.cli.bench_tables import print_tables, table
from bubblespec.core.config import RunConfig
from bubblespec.core.errors import ConfigError
from bubblespec.core.interfaces import acceptance_length
from bubblespec.observe.records import StepRecord

HEAD = "head"
"""The variant name that turns on the draft head (not a draft source)."""
DEFAULT_VARIANTS = (
    "none",
    "ngram",
    "group",
    "history",
    "history+group+ngram",
    "bubble",
    "bubble+ngram",
    "bubble+group+ngram",
    "bubble:one-hot",
)


def default_variants(config: RunConfig) -> list[str]:
    """:data:`DEFAULT_VARIANTS`, and ``head`` where the config's backend drafts with a draft head."""
    from bubblespec.core import plugins
    from bubblespec.core.interfaces import Engine

    backend = plugins.load_subclass("backends", config.rollout.backend, Engine)
    head = getattr(backend, "supports_draft_head", False)
    return [*DEFAULT_VARIANTS, *([HEAD] if head else [])]


VERIFICATION_SUFFIXES = {"one-hot": "one_hot"}
"""Variant suffixes (``bubble:one-hot``) and the ``rollout.verification`` they run with; no suffix is coupled."""
_SUFFIX_OF = {verification: suffix for suffix, verification in VERIFICATION_SUFFIXES.items()}


def parse_variant(text: str) -> tuple[list[str], str]:
    """``"bubble+group+ngram"`` -> ``(["bubble", "group", "ngram"], "coupled")``; ``"bubble:one-hot"`` ->
    ``(["bubble"], "one_hot")``. Suffixes are checked here, source names with the config; a count of candidates
    (``*4``) is :func:`candidates_of`'s."""
    names, colon, suffix = text.partition(":")
    sources = [name.strip() for name in names.partition("*")[0].split("+") if name.strip()]
    if not colon:
        return sources, "coupled"
    if suffix.strip() not in VERIFICATION_SUFFIXES:
        allowed = ", ".join(map(repr, VERIFICATION_SUFFIXES))
        raise ConfigError(
            f"unknown verification suffix {suffix!r} in variant {text!r}; allowed: {allowed} (as in 'bubble:one-hot'), "
            "or no suffix for coupled verification"
        )
    return sources, VERIFICATION_SUFFIXES[suffix.strip()]


def candidates_of(text: str) -> int | None:
    """The ``speculation.draft_candidates`` a variant names after its sources (``"bubble+suffix*4"`` -> 4, verified
    as token trees); None where it names none (the config's setting)."""
    names = text.partition(":")[0]
    if "*" not in names:
        return None
    count = names.partition("*")[2].strip()
    if not count.isdigit() or int(count) < 1:
        raise ConfigError(
            f"variant {text!r}: after '*' comes the number of candidates verified together (1 or more), as in "
            "'bubble+suffix+ngram*4'"
        )
    return int(count)


def canonical_variant(text: str) -> str:
    """The variant's name in reports: ``"bubble + ngram:one-hot"`` -> ``"bubble+ngram:one-hot"``."""
    sources, verification = parse_variant(text)
    candidates = candidates_of(text)
    return (
        "+".join(sources)
        + (f"*{candidates}" if candidates is not None else "")
        + (f":{_SUFFIX_OF[verification]}" if verification in _SUFFIX_OF else "")
    )


def baseline_of(variant: str) -> str:
    """Plain decoding with the variant's verification: what its speed is measured against."""
    verification = parse_variant(variant)[1]
    return f"none:{_SUFFIX_OF[verification]}" if verification in _SUFFIX_OF else "none"


def with_baselines(variants: list[str]) -> list[str]:
    """``variants`` in canonical form with ``none`` first and every other baseline just before its first user;
    a variant named twice is refused."""
    canonical = [canonical_variant(v) for v in variants]
    repeated = sorted({v for v in canonical if canonical.count(v) > 1})
    if repeated:
        raise ConfigError(f"variant(s) {', '.join(map(repr, repeated))} named more than once in {variants}")
    ordered = [] if "none" in canonical else ["none"]
    for variant in canonical:
        baseline = baseline_of(variant)
        if baseline not in ordered and baseline not in canonical:
            ordered.append(baseline)
        ordered.append(variant)
    return ordered


def _variant(config: RunConfig, variant: str, output_dir: Path) -> RunConfig:
    named, verification = parse_variant(variant)
    sources = [name for name in named if name != HEAD] or ["none"]
    options = {k: v for k, v in config.speculation.draft_source_options.items() if k in sources}
    head = config.speculation.draft_head.model_dump() | {"enabled": HEAD in named}
    update = {"enabled": True, "draft_sources": sources, "draft_source_options": options, "draft_head": head}
    if candidates_of(variant) is not None:
        update["draft_candidates"] = candidates_of(variant)
    elif sources == ["none"]:
        update["draft_candidates"] = 1  # nothing drafts: one candidate, as validation asks
    if "group" in sources:
        update["sharding_policy"] = "prompt-grouped"
    speculation = config.speculation.model_dump() | update
    suffix = "" if verification == "coupled" else f"-{verification}"
    data = config.model_dump() | {
        "speculation": speculation,
        "rollout": config.rollout.model_dump() | {"verification": verification},
        "name": f"{config.name}-{'.'.join(named)}{suffix}" + (f"-x{candidates_of(variant)}" if "*" in variant else ""),
        "output_dir": str(output_dir),
    }
    return RunConfig.model_validate(data)  # validates the source names too


def run_peers(config: RunConfig, variants: list[str], output_dir: Path | None = None) -> dict:
    from bubblespec.observe.run_dir import RunDirectory
    from bubblespec.run.assembly import load_backend
    from bubblespec.run.launch import run

    variants = with_baselines(variants)
    configs = {v: _variant(config, v, Path(".")) for v in variants}  # fail before any run
    for variant_config in configs.values():
        load_backend(variant_config)  # what a backend cannot run (a head on vLLM), too
    scratch = output_dir is None
    output_dir = Path(tempfile.mkdtemp(prefix="bubblespec-peers-")) if scratch else output_dir
    steps: dict[str, list[StepRecord]] = {}
    try:
        for variant in variants:
            variant_config = configs[variant].model_copy(update={"output_dir": str(output_dir)})
            run(variant_config)
            steps[variant] = RunDirectory(variant_config.run_dir).read_steps()
    finally:
        if scratch:
            shutil.rmtree(output_dir, ignore_errors=True)
    epoch = _epoch_steps(config)
    baselines = {v: baseline_of(v) for v in variants}
    report = {
        "config": config.name,
        "clock": config.clock.kind,
        "profile": config.clock.profile if config.clock.kind == "virtual" else None,
        "num_ranks": config.rollout.num_ranks,
        "num_steps": config.num_steps,
        "epoch_steps": epoch,
        "variants": variants,
        "baselines": baselines,
        "verification": {v: parse_variant(v)[1] for v in variants},
        "per_step": {
            v: [_compare(off, on, v) for off, on in zip(steps[baselines[v]], steps[v], strict=True)] for v in variants
        },
        "from_step_2": {v: _aggregate(steps[baselines[v]][1:], steps[v][1:]) for v in variants},
        "steady_state": {v: _aggregate(steps[baselines[v]][epoch:], steps[v][epoch:]) for v in variants},
    }
    report["identical_rollouts"] = all(s["identical_rollouts"] for v in variants for s in report["per_step"][v])
    return report


def _epoch_steps(config: RunConfig) -> int:
    """Steps until prompts repeat (history has drafts from then on); 1 when they never repeat."""
    size = config.task.options.get("dataset_size")
    return max(1, size // config.task.prompts_per_step) if size else 1


def _per_token(decode_steps: int, generated_tokens: int) -> float:
    return decode_steps / generated_tokens if generated_tokens else 1.0


def _compare(off: StepRecord, on: StepRecord, variant: str) -> dict:
    """One step of ``variant`` (``on``) against the same step of its baseline (``off``)."""
    same = off.rollout_digest == on.rollout_digest and off.reward_mean == on.reward_mean
    steps_per_token_off = _per_token(off.decode_steps, off.generated_tokens)
    tokens_per_second_off = off.generated_tokens / off.phase_seconds.rollout
    return {
        "step": on.step,
        "decode_steps": on.decode_steps,
        "generated_tokens": on.generated_tokens,
        "decode_step_reduction": 1 - _per_token(on.decode_steps, on.generated_tokens) / steps_per_token_off,
        "acceptance_length_mean": acceptance_length(on.draft_tokens_accepted, on.verify_steps),
        "draft_coverage": on.draft_coverage,
        "proposal_coverage": on.proposal_coverage,
        "rollout_seconds": on.phase_seconds.rollout,
        "throughput_ratio": on.generated_tokens / on.phase_seconds.rollout / tokens_per_second_off,
        "identical_rollouts": same,  # against the variant's own baseline (none, or none:one-hot)
        "head_tokens_proposed": sum(rank.head_tokens_proposed for rank in on.ranks),
        "head_tokens_accepted": sum(rank.head_tokens_accepted for rank in on.ranks),
    }


def _aggregate(off: list[StepRecord], on: list[StepRecord]) -> dict:
    if not on:
        return {}

    def total(steps: list[StepRecord], field: str) -> int:
        return sum(getattr(s, field) for s in steps)

    def rollout_seconds(steps: list[StepRecord]) -> float:
        return sum(s.phase_seconds.rollout for s in steps)

    tokens_off, tokens_on = total(off, "generated_tokens"), total(on, "generated_tokens")
    steps_per_token_off = _per_token(total(off, "decode_steps"), tokens_off)
    return {
        "decode_step_reduction": 1 - _per_token(total(on, "decode_steps"), tokens_on) / steps_per_token_off,
        "acceptance_length_mean": acceptance_length(total(on, "draft_tokens_accepted"), total(on, "verify_steps")),
        "draft_coverage": sum(s.draft_coverage for s in on) / len(on),
        "proposal_coverage": sum(s.proposal_coverage for s in on) / len(on),
        "generated_tokens": tokens_on,
        "throughput_ratio": tokens_on / rollout_seconds(on) / (tokens_off / rollout_seconds(off)),
    }


def _rollouts(identical: bool | None) -> str:
    return "in distribution" if identical is None else "identical" if identical else "DIFFERENT"


def print_report(report: dict, console=None) -> None:
    """Per step, then steps 2 to N and the steady state: decode steps and speed in one table, drafts in another
    (each fits 80 columns); then what each variant is measured against."""
    speed = table(
        f"{report['config']} ({report['clock']} clock): decode steps and speed per step (from 1)",
        ("source", "step", "decode steps", "tokens", "reduction", "speed"),
    )
    drafts = table("drafts per step", ("source", "step", "acceptance", "draft\ncov", "proposal\ncov", "rollouts"))
    first = {"from_step_2": 2, "steady_state": report["epoch_steps"] + 1}
    shown = {"from_step_2": "from the second step", "steady_state": "steady state"}
    ranges = ", ".join(f"{shown[label]}: {n}-{report['num_steps']}" for label, n in first.items())
    speed_summary = table(
        f"decode steps and speed ({ranges})", ("source", "steps", "tokens", "reduction", "throughput")
    )
    drafts_summary = table(f"drafts ({ranges})", ("source", "steps", "acceptance", "draft cov", "proposal cov"))
    for variant in report["variants"]:
        for s in report["per_step"][variant]:
            step = str(s["step"] + 1)
            speed.add_row(
                variant,
                step,
                str(s["decode_steps"]),
                str(s["generated_tokens"]),
                f"{s['decode_step_reduction']:.1%}",
                f"{s['throughput_ratio']:.2f}x",
            )
            drafts.add_row(
                variant,
                step,
                f"{s['acceptance_length_mean']:.2f}",
                f"{s['draft_coverage']:.2f}",
                f"{s['proposal_coverage']:.2f}",
                _rollouts(s["identical_rollouts"]),
            )
    for label, n in first.items():
        steps = f"{n}-{report['num_steps']}"
        for variant, a in report[label].items():
            speed_summary.add_row(
                variant,
                steps,
                str(a["generated_tokens"]),
                f"{a['decode_step_reduction']:.1%}",
                f"{a['throughput_ratio']:.2f}x",
            )
            drafts_summary.add_row(
                variant,
                steps,
                f"{a['acceptance_length_mean']:.2f}",
                f"{a['draft_coverage']:.2f}",
                f"{a['proposal_coverage']:.2f}",
            )
        speed_summary.add_section()
        drafts_summary.add_section()
    notes = []
    users: dict[str, list[str]] = {}
    for variant, baseline in report["baselines"].items():
        if variant != baseline:
            users.setdefault(baseline, []).append(variant)
    if users:
        notes.append("; ".join(f"against {baseline}: {', '.join(variants)}" for baseline, variants in users.items()))
    if any(v != "coupled" for v in report["verification"].values()):
        notes.append(
            "one-hot variants sample each policy version with its own noise stream: their rollouts are other "
            "samples than coupled decoding's and are compared with none:one-hot"
        )
    notes.append(f"identical_rollouts={report['identical_rollouts']} (every variant against its baseline)")
    print_tables((speed, drafts, speed_summary, drafts_summary), notes, console)


def plot_report(report: dict, folder: Path, prefix: str = "peers") -> list[Path]:
    """One PNG per question: decode-step reduction per step, and rollout throughput ratio per step, each against
    the variant's baseline (one-hot variants dashed): ``{prefix}-decode-steps.png``, ``{prefix}-throughput.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for field, label, name in (
        ("decode_step_reduction", "decode steps saved vs baseline (per token)", "decode-steps"),
        ("throughput_ratio", "rollout throughput vs baseline (x)", "throughput"),
    ):
        figure, axes = plt.subplots(figsize=(9, 4))
        for variant in report["variants"]:
            rows = report["per_step"][variant]
            baseline = report["baselines"][variant]
            legend = variant if baseline in ("none", variant) else f"{variant} (vs {baseline})"
            style = "o-" if report["verification"][variant] == "coupled" else "s--"
            axes.plot([r["step"] + 1 for r in rows], [r[field] for r in rows], style, label=legend)
        axes.set_xlabel("step")
        axes.set_ylabel(label)
        title = f"{report['config']}: {report['num_ranks']} ranks, {report['profile'] or report['clock']}"
        axes.set_title(title)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: the lines stay readable
        figure.tight_layout()
        path = folder / f"{prefix}-{name}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written
