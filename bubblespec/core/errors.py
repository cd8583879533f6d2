"""Exceptions for mistakes a user can make. The CLI prints these as one clear message, without a traceback."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` with the closest of ``choices`` to a misspelled ``word``, or nothing."""
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Terminated(KeyboardInterrupt):
    """SIGTERM, as SLURM, Kubernetes and ``kill`` send it, raised in the main thread: a run stops as it does on Ctrl-C
    (its checkpoints kept, its cleanup run), and ``bubblespec run`` says how to resume and exits with 143."""


class BubblespecError(Exception):
    """Base class of errors caused by user input (configs, model paths, plugin names, drafts)."""


class ModelLoadError(BubblespecError, ValueError):
    """A model folder is missing, incomplete or of an unsupported architecture."""


class PluginNotFoundError(BubblespecError, LookupError):
    """A plugin name that no installed entry point provides."""


class DraftError(BubblespecError, ValueError):
    """A malformed draft: token ids outside the vocabulary, or a key of the wrong type."""


class RequestError(BubblespecError, ValueError):
    """A generation request the engine cannot serve (prompt too long, ids outside the vocabulary, ...)."""


class ConfigError(BubblespecError, ValueError):
    """A run config that does not parse or validate; the message lists every problem with its field path."""


class CheckpointError(BubblespecError):
    """A checkpoint or step log that is missing files or cannot be read."""


class RewardError(BubblespecError, ValueError):
    """A reward function returned something that is not a finite number, or the wrong number of scores; the
    message names the reward and the row."""


class EngineError(BubblespecError, RuntimeError):
    """A rollout engine failed while serving a request; the message names the rank and the backend."""


class TrainerRestarted(BubblespecError, RuntimeError):
    """The trainer's workers were restarted after a fault and hold the initial model: the run must rewind."""


class TrainerError(BubblespecError, RuntimeError):
    """A trainer worker raised (a bad input, a bug, out of memory): the message names the worker, the exception's
    type and message and where it was raised; ``worker_traceback`` holds the worker's whole traceback."""

    def __init__(self, message: str, worker_traceback: str = "") -> None:
        super().__init__(message)
        self.worker_traceback = worker_traceback


class NonFiniteError(BubblespecError, ArithmeticError):
    """Numbers that must be finite are not (NaN or infinite): an engine's logits, a trainer's loss or gradient. The
    message says where; nothing is sampled from them and no optimizer step is taken with them."""
