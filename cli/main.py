"""The ``bubblespec`` command line. Heavy imports (torch, engines) happen inside commands so ``--help`` is instant."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated

import typer

from bubblespec.core.plugins import KINDS

app = typer.Typer(
    help="Faster synchronous RL rollouts: idle ranks draft the next step, the updated policy verifies exactly.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def user_errors(command):
    """Turns errors a user caused (bad config, model path, plugin name, ...) into one message and exit code 2."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from pydantic import ValidationError

        from bubblespec.core.errors import BubblespecError

        try:
            return command(*args, **kwargs)
        except (BubblespecError, ValidationError) as error:
            typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2) from None

    return wrapper


@app.command(help=f"List the installed plugins by kind: {', '.join(KINDS)}.")
@user_errors
def plugins() -> None:
    from bubblespec.core.plugins import available

    for kind in KINDS:
        typer.secho(kind, bold=True)
        found = available(kind)
        width = max((len(name) for name in found), default=0)
        for name, entry_point in found.items():
            typer.echo(f"  {name:<{width}}  {entry_point.value}")
        if not found:
            typer.echo("  (none installed)")


@app.command()
@user_errors
def validate(
    config_path: Annotated[Path, typer.Argument(help="A run config (YAML).", metavar="CONFIG")],
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a field: section.field=value.")] = None,
) -> None:
    """Check a run config: print it resolved (defaults filled in) and what the model and rewards will see (row
    counts, the first prompt fully rendered, prompt lengths, the rewards), or every error with its field path. The
    task is built, so a dataset, tokenizer or reward that does not load is reported here."""
    import yaml

    from bubblespec.core.config import load_config
    from bubblespec.observe.task_summary import summarize_task
    from bubblespec.run.assembly import checked_engine_settings, close_tasks, load_backend, make_tasks, model_path

    config = load_config(config_path, overrides or [])
    tasks = make_tasks(config)
    try:
        summary = summarize_task(*tasks)
        # the engine settings, as both clocks check them before a run starts
        checked_engine_settings(config, model_path(config, tasks[0]), load_backend(config))
    finally:
        close_tasks(*tasks)
    typer.echo(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), nl=False)
    typer.secho(f"\ntask {config.task.name!r}", bold=True)
    typer.echo("\n".join(summary.lines))
    for warning in summary.warnings:
        typer.secho(f"warning: {warning}", fg=typer.colors.YELLOW, err=True)


@app.command()
@user_errors
def run(
    config_path: Annotated[Path | None, typer.Argument(help="A run config (YAML).", metavar="CONFIG")] = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a field: section.field=value.")] = None,
    resume: Annotated[Path | None, typer.Option(help="Continue the run in this run directory.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No live display or step lines; warnings only.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also debug logs.")] = False,
) -> None:
    """Run synchronous RL with bubble-time drafting, as the config says."""
    from bubblespec.core.config import load_config
    from bubblespec.observe.run_dir import RunDirectory
    from bubblespec.run.launch import run as run_config

    if quiet and verbose:
        raise typer.BadParameter("--quiet and --verbose exclude each other")
    if resume is not None:
        if config_path is not None or overrides:
            raise typer.BadParameter("--resume takes the config saved in the run directory; give no CONFIG or --set")
        config = RunDirectory(resume).load_config()
    elif config_path is None:
        raise typer.BadParameter("give a CONFIG file, or --resume RUN_DIR")
    else:
        config = load_config(config_path, overrides or [])
    from rich.console import Console

    from bubblespec.observe.progress import StepPrinter, setup_logging
    from bubblespec.observe.report import write_report

    console = Console()
    setup_logging(console, "WARNING" if quiet else "DEBUG" if verbose else "INFO")
    run_dir = resume or config.run_dir
    try:
        if quiet:
            run_config(config, resume_dir=resume)
            write_report(run_dir)
            typer.echo(f"run directory: {run_dir}")
            return
        with StepPrinter(config, console) as printer:
            summary = run_config(
                config, resume_dir=resume, on_step=printer.step, on_phase=printer.phase, on_activity=printer.activity
            )
    except KeyboardInterrupt:
        typer.secho(f"interrupted: {_where_it_stopped(Path(run_dir))}", fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(code=130) from None
    printer.summary(summary, run_dir)
    typer.echo(f"report: {write_report(run_dir) / 'summary.md'}")


def _where_it_stopped(run_dir: Path) -> str:
    from bubblespec.observe.run_dir import RunDirectory

    folder = RunDirectory(run_dir)
    if not (run_dir / "config.yaml").is_file():
        return "before the run directory was written; nothing to resume"
    steps = len(folder.read_steps())
    checkpoint = folder.latest_checkpoint()
    if checkpoint is None:
        resume = f"`bubblespec run --resume {run_dir}`"
        return f"{steps} steps done, none checkpointed yet (see checkpoint_every); {resume} starts over"
    return (
        f"{steps} steps done, the last checkpoint is {checkpoint.name}; `bubblespec run --resume {run_dir}` continues "
        "from it exactly"
    )


@app.command()
@user_errors
def report(run_dir: Annotated[Path, typer.Argument(help="A run directory written by `bubblespec run`.")]) -> None:
    """Write RUN_DIR/report/: a per-rank timeline picture, per-step plots and a summary (markdown)."""
    from bubblespec.observe.report import write_report

    folder = write_report(run_dir)
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        typer.echo(str(path))


BENCH_MODE_OPTIONS = {
    "engine": {"threads", "repeats", "quick", "backend", "model", "dtype", "device", "batch_sizes", "max_new_tokens",
               "weight_noise", "adaptive_draft_length", "exactness_requests"},
    "peers": {"overrides", "output_dir", "sources", "plot_dir", "plot_prefix"},
    "peers-async": {"overrides", "output_dir", "methods", "seeds", "jobs", "cut_quantile", "cut_tokens", "plot_dir"},
    "CONFIG": {"overrides", "output_dir"},
}  # fmt: skip
"""The options each ``bench`` mode takes besides ``--json``: any other given on the command line is an error."""


def _check_bench_options(ctx: typer.Context, mode: str) -> None:
    """One line naming an option given to a mode that does not take it, and the modes that do."""
    from bubblespec.core.errors import ConfigError

    for param in ctx.command.params:
        name = param.name
        if param.param_type_name != "option" or name == "json_path" or name in BENCH_MODE_OPTIONS[mode]:
            continue
        source = ctx.get_parameter_source(name)  # typer's own click or click's: compared by name
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            owners = " and ".join(f"`bench {m}`" for m, names in BENCH_MODE_OPTIONS.items() if name in names)
            raise ConfigError(
                f"{param.opts[0]} is an option of {owners}, not of `bench {mode}`, which takes "
                f"{', '.join(sorted(_flag(ctx, n) for n in BENCH_MODE_OPTIONS[mode] | {'json_path'}))}"
            )


def _flag(ctx: typer.Context, name: str) -> str:
    return next(p.opts[0] for p in ctx.command.params if p.name == name)


@app.command()
@user_errors
def bench(
    ctx: typer.Context,
    target: Annotated[
        str,
        typer.Argument(
            help='"engine" (an engine backend without and with drafts, against HF generate), "peers" (draft sources '
            'side by side on the run CONFIG that follows), "peers-async" (rollout schedules side by side: sync, async, '
            "partial rollouts, tail batching, with and without bubblespec, on the run CONFIG that follows) or a run "
            "CONFIG to run with speculation off and on.",
            metavar="engine|peers|peers-async|CONFIG",
        ),
    ],
    peers_config: Annotated[
        Path | None, typer.Argument(help="The run config of `bench peers` / `bench peers-async`.", metavar="[CONFIG]")
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Also write the results as JSON.")] = None,
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="Override a config field (CONFIG, peers, peers-async).")
    ] = None,
    output_dir: Annotated[
        Path | None,
        typer.Option(help="Keep the runs' directories here (CONFIG, peers, peers-async; default: discarded)."),
    ] = None,
    threads: Annotated[int, typer.Option(min=1, help="torch threads per engine (engine only).")] = 1,
    repeats: Annotated[int, typer.Option(min=1, help="Timed repetitions, median reported (engine only).")] = 3,
    quick: Annotated[bool, typer.Option(help="A smoke run, not a measurement (engine only).")] = False,
    backend: Annotated[
        str, typer.Option(help="Engine backends side by side: torch, vllm or torch,vllm (engine only).")
    ] = "torch",
    model: Annotated[
        Path | None,
        typer.Option(
            help="A Hugging Face model folder, run on random prompts; default: the shipped model (engine only)."
        ),
    ] = None,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float64 (torch only) (engine only).")] = "float32",
    device: Annotated[str, typer.Option(help="Device of the torch engine and HF generate (engine only).")] = "cpu",
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes (engine only).")] = "1,16,32",
    max_new_tokens: Annotated[
        int | None, typer.Option(min=1, help="Response limit with --model (default 64; engine only).")
    ] = None,
    weight_noise: Annotated[
        float | None,
        typer.Option(
            min=0, help="Relative RMS weight change, drafting to verifying policy, with --model (engine only)."
        ),
    ] = None,
    adaptive_draft_length: Annotated[
        bool,
        typer.Option(
            "--adaptive-draft-length/--fixed-draft-length",
            help="Shrink proposals after a rejection, as the CPU examples do (engine only).",
        ),
    ] = True,
    exactness_requests: Annotated[
        int | None,
        typer.Option(
            min=0, help="Requests of the exactness table; 0 skips it (default 64, 16 with --model; engine only)."
        ),
    ] = None,
    sources: Annotated[
        list[str] | None,
        typer.Option(
            "--sources",
            help="A draft-source variant, e.g. bubble+group+ngram, or bubble:one-hot for one-hot verification; "
            "repeat it (peers only).",
        ),
    ] = None,
    methods: Annotated[
        list[str] | None,
        typer.Option(
            "--methods",
            help="A schedule (sync, async-K, partial, exact-partial, tail-batching), +bubblespec for speculation on; "
            "repeat it (peers-async only).",
        ),
    ] = None,
    seeds: Annotated[int, typer.Option(min=1, help="Runs per method, seeds CONFIG's seed on (peers-async only).")] = 1,
    jobs: Annotated[
        int, typer.Option(min=1, help="Runs at a time, each in its own process with one thread (peers-async only).")
    ] = 1,
    cut_quantile: Annotated[
        float | None,
        typer.Option(
            help="Token budget of the cutting schedules: this quantile of the last step's response lengths "
            "(default 0.9; peers-async only)."
        ),
    ] = None,
    cut_tokens: Annotated[
        int | None, typer.Option(min=1, help="Token budget of the cutting schedules, fixed (peers-async only).")
    ] = None,
    plot_dir: Annotated[
        Path | None, typer.Option(help="Write one PNG per question here (peers and peers-async).")
    ] = None,
    plot_prefix: Annotated[
        str, typer.Option(help="File name prefix of the PNGs: PREFIX-decode-steps.png, ... (peers only).")
    ] = "peers",
) -> None:
    """Measure speed side by side in one run and print a table."""
    _check_bench_options(ctx, target if target in ("engine", "peers", "peers-async") else "CONFIG")
    if target == "peers-async":
        _bench_schedules(peers_config, overrides, methods, seeds, jobs, cut_quantile, cut_tokens, output_dir,
                         plot_dir, json_path)  # fmt: skip
        return
    if target == "peers":
        from bubblespec.cli import bench_peers
        from bubblespec.core.config import load_config
        from bubblespec.core.errors import ConfigError

        if peers_config is None or not peers_config.is_file():
            raise ConfigError(f"bench peers needs an existing run config, got {str(peers_config)!r}")
        variants = list(sources or bench_peers.DEFAULT_VARIANTS)
        report = bench_peers.run_peers(load_config(peers_config, overrides or []), variants, output_dir)
        bench_peers.print_report(report)
        if plot_dir is not None:
            for path in bench_peers.plot_report(report, plot_dir, plot_prefix):
                typer.echo(f"wrote {path}")
        _write_json(report, json_path)
        if not report["identical_rollouts"]:
            typer.secho("error: a draft source changed a rollout (coupled verification)", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=1)
        return
    if peers_config is not None:
        from bubblespec.core.errors import ConfigError

        raise ConfigError(
            f"a second argument ({str(peers_config)!r}) is only for `bench peers CONFIG` and `bench peers-async CONFIG`"
        )
    if target == "engine":
        from bubblespec.cli.bench_engine import (
            EngineBenchSettings,
            parse_backends,
            parse_batch_sizes,
            print_report,
            run_engine_bench,
        )

        optional = {"max_new_tokens": max_new_tokens, "weight_noise": weight_noise}
        settings = EngineBenchSettings(
            backends=parse_backends(backend),
            adaptive_draft_length=adaptive_draft_length,
            model_path=None if model is None else str(model),
            dtype=dtype,
            device=device,
            threads=threads,
            repeats=repeats,
            quick=quick,
            batch_sizes=parse_batch_sizes(batch_sizes),
            exactness_requests=exactness_requests,
            **{name: value for name, value in optional.items() if value is not None},
        )
        report = run_engine_bench(settings)
    else:
        from bubblespec.cli.bench_run import print_report, run_side_by_side
        from bubblespec.core.config import load_config

        if not Path(target).is_file():
            from bubblespec.core.errors import ConfigError

            raise ConfigError(f"benchmark target {target!r} is neither 'engine' nor an existing config file")
        report = run_side_by_side(load_config(target, overrides or []), output_dir)
    print_report(report)
    _write_json(report, json_path)


def _bench_schedules(
    config_path, overrides, methods, seeds, jobs, cut_quantile, cut_tokens, output_dir, plot_dir, json_path
):
    from bubblespec.cli import bench_schedules
    from bubblespec.core.config import load_config
    from bubblespec.core.errors import ConfigError

    if config_path is None or not config_path.is_file():
        raise ConfigError(f"bench peers-async needs an existing run config, got {str(config_path)!r}")
    if cut_quantile is not None and cut_tokens is not None:
        raise ConfigError("give one of --cut-quantile and --cut-tokens, not both")
    if cut_quantile is not None and not 0 < cut_quantile <= 1:
        raise ConfigError(f"--cut-quantile must be in (0, 1], got {cut_quantile}")
    cut = {"cut_tokens": cut_tokens} if cut_tokens is not None else {"cut_quantile": cut_quantile or 0.9}
    config = load_config(config_path, overrides or [])
    report = bench_schedules.run_methods(
        config, list(methods or bench_schedules.DEFAULT_METHODS), cut, seeds, output_dir, jobs
    )
    bench_schedules.print_report(report)
    if plot_dir is not None:
        for path in bench_schedules.plot_report(report, plot_dir, "peers-async"):
            typer.echo(f"wrote {path}")
    _write_json(report, json_path)
    if not report["identical_rollouts"]:
        typer.secho("error: speculation changed a rollout of an exact schedule", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=1)


def _write_json(report: dict, json_path: Path | None) -> None:
    if json_path is not None:
        import json

        json_path.write_text(json.dumps(report, indent=2) + "\n")
        typer.echo(f"wrote {json_path}")


if __name__ == "__main__":
    app()
