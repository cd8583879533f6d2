"""``bubblespec bench``: one sub-command per benchmark, each with only its own options.

    bench CONFIG              a run config with speculation off and on (also ``bench run CONFIG``)
    bench engine              an engine backend without and with drafts, against HF generate
    bench peers CONFIG        draft sources side by side on a run config
    bench peers-async CONFIG  rollout schedules side by side (sync, async, partial rollouts, tail batching)

Every spelling of the one ``bench`` command this replaced still works: ``bench CONFIG`` runs ``bench run``, and
options given before the sub-command's name (``bench --json out.json engine``) are read as its own. An option of
another sub-command is an error naming the sub-command(s) it belongs to.

Ctrl-C and SIGTERM stop a bench as they stop ``bubblespec run``: one line on stderr, exit 130 or 143; its scratch run
directories are removed, and ``--json`` and the plots are written whole (moved into place once written) or not at all.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

from bubblespec.cli.user_errors import user_errors

RUN = "run"
"""The sub-command of ``bench CONFIG``: a first argument that names no sub-command is a run config."""


class BenchGroup(TyperGroup):
    """Reads the spellings of the one ``bench`` command: the sub-command's name after options, and a config path
    in its place."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        args = _name_first(args, _options_with_values(self))
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            args = [RUN, *args]
        return super().parse_args(ctx, args)


class BenchCommand(TyperCommand):
    """A bench sub-command: an option of another sub-command is one error line naming where it belongs."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except Exception as error:
            if type(error).__name__ != "NoSuchOption":  # typer's own click's, or click's: compared by name
                raise
            group = ctx.parent.command if ctx.parent is not None else None
            owners = [_shown(name) for name, command in _commands(group) if _takes(command, error.option_name)]
            if not owners:
                raise
            takes = sorted(_primary(option) for option in self.params if _is_option(option))
            typer.secho(
                f"error: {error.option_name} is an option of {' and '.join(owners)}, not of {_shown(self.name)}, "
                f"which takes {', '.join(takes)}",
                fg=typer.colors.RED,
                err=True,
            )
            raise typer.Exit(code=2) from None


def _is_option(param) -> bool:
    return param.param_type_name == "option"


def _shown(name: str) -> str:
    return "`bench CONFIG`" if name == RUN else f"`bench {name}`"


def _commands(group) -> list:
    """The group's sub-commands, ``bench CONFIG`` last."""
    return sorted(getattr(group, "commands", {}).items(), key=lambda item: item[0] == RUN)


def _takes(command, flag: str) -> bool:
    return any(flag in option.opts or flag in option.secondary_opts for option in command.params)


def _primary(option) -> str:
    return max(option.opts, key=len)


def _options_with_values(group: TyperGroup) -> set[str]:
    """Every flag of a sub-command that is followed by a value (``--json PATH``; not ``--quick``)."""
    return {
        flag
        for command in group.commands.values()
        for option in command.params
        if _is_option(option) and not option.is_flag and not option.count
        for flag in option.opts
    }


def _name_first(args: list[str], with_values: set[str]) -> list[str]:
    """``args`` with the first positional argument (the sub-command or the config) moved before the options that
    preceded it."""
    index = 0
    while index < len(args):
        token = args[index]
        if token == "--" or not token.startswith("-"):
            break
        index += 2 if "=" not in token and token in with_values else 1
    if index == 0 or index >= len(args) or args[index] == "--":
        return args
    return [args[index], *args[:index], *args[index + 1 :]]


def _stops_on_signals(command):
    """Ctrl-C and SIGTERM stop the bench ``command`` as they stop ``bubblespec run`` (see the module docstring)."""
    shown = _shown(command.__name__.replace("_", "-"))

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from bubblespec.cli.main import stops_on_signals as stops  # main imports this module: at call time

        with stops(lambda: f"{shown} stopped before it finished; no output file was left half-written"):
            return command(*args, **kwargs)

    return wrapper


bench_app = typer.Typer(
    cls=BenchGroup,
    help="Measure speed side by side in one run and print a table. `bench CONFIG` is `bench run CONFIG`.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

JsonPath = Annotated[Path | None, typer.Option("--json", help="Also write the results as JSON.")]
Overrides = Annotated[list[str] | None, typer.Option("--set", help="Override a config field: section.field=value.")]
OutputDir = Annotated[Path | None, typer.Option(help="Keep the runs' directories here (default: discarded).")]
PlotDir = Annotated[Path | None, typer.Option(help="Write one PNG per question here.")]


def _config(path: Path, command: str) -> Path:
    from bubblespec.core.errors import ConfigError

    if not path.is_file():
        raise ConfigError(f"bench {command} needs an existing run config, got {str(path)!r}")
    return path


@bench_app.command(RUN, cls=BenchCommand)
@user_errors
@_stops_on_signals
def run(
    target: Annotated[
        str, typer.Argument(help="A run config (YAML) to run with speculation off and on.", metavar="CONFIG")
    ],
    json_path: JsonPath = None,
    overrides: Overrides = None,
    output_dir: OutputDir = None,
) -> None:
    """A run CONFIG with speculation off and on, side by side (also spelled `bench CONFIG`)."""
    from bubblespec.cli.bench_run import print_report, run_side_by_side
    from bubblespec.core.config import load_config
    from bubblespec.core.errors import ConfigError

    if not Path(target).is_file():
        raise ConfigError(
            f"benchmark target {target!r} is neither a bench sub-command (engine, peers, peers-async) nor an "
            "existing config file"
        )
    report = run_side_by_side(load_config(target, overrides or []), output_dir)
    print_report(report)
    _write_json(report, json_path)


@bench_app.command("engine", cls=BenchCommand)
@user_errors
@_stops_on_signals
def engine(
    json_path: JsonPath = None,
    threads: Annotated[int, typer.Option(min=1, help="torch threads per engine.")] = 1,
    repeats: Annotated[int, typer.Option(min=1, help="Timed repetitions, median reported.")] = 3,
    quick: Annotated[bool, typer.Option(help="A smoke run, not a measurement.")] = False,
    backend: Annotated[str, typer.Option(help="Engine backends side by side: torch, vllm or torch,vllm.")] = "torch",
    model: Annotated[
        Path | None,
        typer.Option(help="A Hugging Face model folder, run on random prompts; default: the shipped model."),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="A run config: its model, its task's prompts and sampling, and drafts made by the policy before one "
            "real GRPO step of its trainer on its own samples and rewards (instead of --weight-noise)."
        ),
    ] = None,
    overrides: Overrides = None,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float64 (torch only).")] = "float32",
    device: Annotated[str, typer.Option(help="Device of the torch engine and HF generate.")] = "cpu",
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,16,32",
    max_new_tokens: Annotated[int | None, typer.Option(min=1, help="Response limit with --model (default 64).")] = None,
    weight_noise: Annotated[
        float | None,
        typer.Option(min=0, help="Relative RMS weight change, drafting to verifying policy, with --model."),
    ] = None,
    adaptive_draft_length: Annotated[
        bool,
        typer.Option(
            "--adaptive-draft-length/--fixed-draft-length",
            help="Shrink proposals after a rejection, as the CPU examples do.",
        ),
    ] = True,
    exactness_requests: Annotated[
        int | None,
        typer.Option(min=0, help="Requests of the exactness table; 0 skips it (default 64, 16 with --model)."),
    ] = None,
    head_steps: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Training steps of the draft head learned from the policy step's samples, with --config (default 32).",
        ),
    ] = None,
    vllm_ngram: Annotated[
        bool,
        typer.Option(
            "--vllm-ngram",
            help="Also time vLLM's own n-gram speculative decoding (prompt lookup) and vLLM on its own sampler without "
            "drafts, beside bubble drafts on the vllm backend (needs vllm in --backend).",
        ),
    ] = False,
) -> None:
    """An engine backend without and with drafts, against Hugging Face generate()."""
    from bubblespec.cli.bench_engine import (
        EngineBenchSettings,
        parse_backends,
        parse_batch_sizes,
        print_report,
        run_engine_bench,
    )
    from bubblespec.core.errors import ConfigError

    if config is not None and (weight_noise is not None or max_new_tokens is not None):
        raise ConfigError(
            "--config takes the policy step and the response limit from the run config: leave out --weight-noise and "
            "--max-new-tokens (--set task.options.max_new_tokens=N sets the limit)"
        )
    if config is None and head_steps is not None:
        raise ConfigError("--head-steps trains the draft head on a run config's policy step: give --config")
    optional = {"max_new_tokens": max_new_tokens, "weight_noise": weight_noise, "head_training_steps": head_steps}
    settings = EngineBenchSettings(
        backends=parse_backends(backend),
        adaptive_draft_length=adaptive_draft_length,
        model_path=None if model is None else str(model),
        config_path=None if config is None else str(_config(config, "engine --config")),
        overrides=tuple(overrides or ()),
        dtype=dtype,
        device=device,
        threads=threads,
        repeats=repeats,
        quick=quick,
        batch_sizes=parse_batch_sizes(batch_sizes),
        exactness_requests=exactness_requests,
        vllm_ngram=vllm_ngram,
        **{name: value for name, value in optional.items() if value is not None},
    )
    report = run_engine_bench(settings)
    print_report(report)
    _write_json(report, json_path)


@bench_app.command("peers", cls=BenchCommand)
@user_errors
@_stops_on_signals
def peers(
    config: Annotated[Path, typer.Argument(help="A run config (YAML).", metavar="CONFIG")],
    json_path: JsonPath = None,
    overrides: Overrides = None,
    output_dir: OutputDir = None,
    sources: Annotated[
        list[str] | None,
        typer.Option(
            "--sources",
            help="A draft-source variant, e.g. bubble+group+ngram, bubble+suffix+ngram*4 for four candidates "
            "verified together (token trees), or bubble:one-hot for one-hot verification; repeat it.",
        ),
    ] = None,
    plot_dir: PlotDir = None,
    plot_prefix: Annotated[str, typer.Option(help="File name prefix of the PNGs: PREFIX-decode-steps.png, ...")] = (
        "peers"
    ),
) -> None:
    """Draft sources side by side on a run CONFIG."""
    from bubblespec.cli import bench_peers
    from bubblespec.core.config import load_config

    run_config = load_config(_config(config, "peers"), overrides or [])
    variants = list(sources or bench_peers.default_variants(run_config))
    report = bench_peers.run_peers(run_config, variants, output_dir)
    bench_peers.print_report(report)
    if plot_dir is not None:
        _write_plots(bench_peers.plot_report, report, plot_dir, plot_prefix)
    _write_json(report, json_path)
    if not report["identical_rollouts"]:
        typer.secho("error: a draft source changed a rollout (coupled verification)", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1)


@bench_app.command("peers-async", cls=BenchCommand)
@user_errors
@_stops_on_signals
def peers_async(
    config: Annotated[Path, typer.Argument(help="A run config (YAML).", metavar="CONFIG")],
    json_path: JsonPath = None,
    overrides: Overrides = None,
    output_dir: OutputDir = None,
    methods: Annotated[
        list[str] | None,
        typer.Option(
            "--methods",
            help="A schedule (sync, async-K, partial, exact-partial, tail-batching), +bubblespec for speculation on; "
            "repeat it.",
        ),
    ] = None,
    seeds: Annotated[int, typer.Option(min=1, help="Runs per method, seeds CONFIG's seed on.")] = 1,
    jobs: Annotated[int, typer.Option(min=1, help="Runs at a time, each in its own process with one thread.")] = 1,
    cut_quantile: Annotated[
        float | None,
        typer.Option(
            help="Token budget of the cutting schedules: this quantile of the last step's response lengths "
            "(default 0.9)."
        ),
    ] = None,
    cut_tokens: Annotated[int | None, typer.Option(min=1, help="Token budget of the cutting schedules, fixed.")] = None,
    plot_dir: PlotDir = None,
) -> None:
    """Rollout schedules side by side on a run CONFIG (sync, async, partial, tail batching; bubblespec off, on)."""
    from bubblespec.cli import bench_schedules
    from bubblespec.core.config import load_config
    from bubblespec.core.errors import ConfigError

    _config(config, "peers-async")
    if cut_quantile is not None and cut_tokens is not None:
        raise ConfigError("give one of --cut-quantile and --cut-tokens, not both")
    if cut_quantile is not None and not 0 < cut_quantile <= 1:
        raise ConfigError(f"--cut-quantile must be in (0, 1], got {cut_quantile}")
    cut = {"cut_tokens": cut_tokens} if cut_tokens is not None else {"cut_quantile": cut_quantile or 0.9}
    report = bench_schedules.run_methods(
        load_config(config, overrides or []), list(methods or bench_schedules.DEFAULT_METHODS), cut, seeds,
        output_dir, jobs,
    )  # fmt: skip
    bench_schedules.print_report(report)
    if plot_dir is not None:
        _write_plots(bench_schedules.plot_report, report, plot_dir, "peers-async")
    _write_json(report, json_path)
    if not report["identical_rollouts"]:
        typer.secho("error: speculation changed a rollout of an exact schedule", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1)


def _write_json(report: dict, json_path: Path | None) -> None:
    """The report as JSON, written beside ``json_path`` then moved onto it: never a half-written file."""
    if json_path is None:
        return
    import json

    scratch = json_path.with_name(f".{json_path.name}.{os.getpid()}.partial")
    try:
        scratch.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(scratch, json_path)
    finally:
        scratch.unlink(missing_ok=True)
    typer.echo(f"wrote {json_path}")


def _write_plots(plot_report, report: dict, plot_dir: Path, prefix: str) -> None:
    """``plot_report``'s PNGs, each drawn in a scratch folder inside ``plot_dir`` and moved into it once whole."""
    import tempfile

    plot_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".bench-plots-", dir=plot_dir) as scratch:
        for drawn in plot_report(report, Path(scratch), prefix):
            path = plot_dir / drawn.name
            os.replace(drawn, path)
            typer.echo(f"wrote {path}")
