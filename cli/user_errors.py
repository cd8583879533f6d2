"""The one way every command reports a user's mistake."""

from __future__ import annotations

import functools

import typer


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
