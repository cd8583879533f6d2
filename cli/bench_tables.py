"""The one table printer of every ``bench`` sub-command: tables of figures that fit 80 columns, then notes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def table(title: str, columns: Sequence[str], justify: str = "right", first: str | None = None):
    """An empty rich table: ``columns`` justified ``justify`` (figures right), the first one ``first`` when given
    (names left, unwrapped)."""
    from rich.table import Table

    made = Table(title=title)
    for index, column in enumerate(columns):
        if index == 0 and first is not None:
            made.add_column(column, justify=first, no_wrap=True)
        else:
            made.add_column(column, justify=justify)
    return made


def print_tables(tables: Iterable, notes: Iterable[str] = (), console=None) -> None:
    """``tables``, then each line of ``notes``, on ``console`` (standard output by default)."""
    from rich.console import Console

    console = console or Console()
    for made in tables:
        console.print(made)
    for note in notes:
        console.print(note)


def figure(value, pattern: str = "{:.3f}") -> str:
    """A report value as a table shows it: ``pattern`` for a float, "—" for a value not measured."""
    return pattern.format(value) if isinstance(value, float) else "—" if value is None else str(value)
