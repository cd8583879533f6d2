"""The ``bubblespec`` command line. Heavy imports (torch, engines) happen inside commands so ``--help`` is instant."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated

import typer

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

        from bubblespec.errors import BubblespecError

        try:
            return command(*args, **kwargs)
        except (BubblespecError, ValidationError) as error:
            typer.secho(f"error: {error}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2) from None

    return wrapper


@app.command()
@user_errors
def plugins() -> None:
    """List the installed plugins (engine backends, draft stores, policies, tasks) by kind."""
    from rich.console import Console
    from rich.table import Table

    from bubblespec.plugins import KINDS, available

    table = Table("kind", "name", "provided by")
    for kind in KINDS:
        found = available(kind)
        if not found:
            table.add_row(kind, "-", "(none installed)")
        for name, entry_point in found.items():
            table.add_row(kind, name, entry_point.value)
    Console().print(table)


@app.command()
@user_errors
def bench(
    target: Annotated[
        str, typer.Argument(help='What to benchmark: "engine" (the built-in engine on the shipped model).')
    ],
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the results as JSON to this file.")
    ] = None,
    threads: Annotated[int, typer.Option(min=1, help="torch threads for every engine compared.")] = 1,
    repeats: Annotated[
        int, typer.Option(min=1, help="Timed repetitions per measurement (the median is reported).")
    ] = 3,
    quick: Annotated[bool, typer.Option(help="Fewer prompts and repetitions: a smoke run, not a measurement.")] = False,
) -> None:
    """Measure speed side by side in one run and print a table."""
    if target != "engine":
        from bubblespec.errors import BubblespecError

        raise BubblespecError(f"unknown benchmark target {target!r}; available: engine")
    from bubblespec.cli.bench_engine import EngineBenchSettings, print_report, run_engine_bench

    settings = EngineBenchSettings(threads=threads, repeats=1 if quick else repeats, quick=quick)
    report = run_engine_bench(settings)
    print_report(report)
    if json_path is not None:
        import json

        json_path.write_text(json.dumps(report, indent=2) + "\n")
        typer.echo(f"wrote {json_path}")


if __name__ == "__main__":
    app()
