"""Reward functions for tasks that bring their own data: built-ins, the user's own, weighted sums, a worker pool.

A reward scores one response: ``f(prompt, response, **columns) -> float``, where ``prompt`` is the dataset's
prompt as it is in the file (a string, or a list of ``{role, content}`` messages), ``response`` the decoded
response text (special tokens skipped), and ``columns`` every other column of the prompt's row by its own name
(the answer column also as ``answer``). A function with the attribute ``batched = True`` takes lists instead,
``f(prompts, responses, **columns) -> list[float]`` with one list per column, and scores many responses at once.

Rewards are named in ``task.options.reward``: one name, one ``{name: ..., weight: ..., **options}`` mapping, or a
list of them (their weighted sum). A name is a built-in (``exact``, ``math``, ``format``), an installed plugin of the
entry point group ``bubblespec.rewards``, or ``module:function`` for an importable function (never a file path).
Options other than ``name`` and ``weight`` go to the function as keyword arguments on every call.

:class:`RewardScorer` calls them: in a pool of worker processes with a per-call time limit (a call that times out
or raises scores 0 and is counted), or in this process with ``workers: 0`` (no time limit). A result that is not a
finite number is a :class:`~bubblespec.core.errors.RewardError` naming the reward and the row.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib
import logging
import math
import multiprocessing
import numbers
import re
import signal
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bubblespec.core import plugins
from bubblespec.core.errors import ConfigError, PluginNotFoundError, RewardError, did_you_mean
from bubblespec.core.interfaces import RewardFailures

BUILT_IN = ("exact", "math", "format")
"""The built-in rewards, registered as plugins of the entry point group ``bubblespec.rewards`` like any other."""


# -- built-in rewards ---------------------------------------------------------------------------------------------


def extract(response: str, pattern: str | None) -> str | None:
    """The last match of ``pattern`` in ``response`` (its first group if it has one); the whole response without
    a pattern; ``None`` if nothing matches."""
    if pattern is None:
        return response
    matches = list(re.finditer(pattern, response))
    if not matches:
        return None
    last = matches[-1]
    return last.group(1) if last.re.groups else last.group(0)


def normalise(text: str) -> str:
    """Unicode NFKC, case-folded, whitespace collapsed, surrounding whitespace and a final period removed."""
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return text.removesuffix(".").strip()


def exact(prompt, response: str, answer: Any = None, pattern: str | None = None, **columns) -> float:
    """1.0 if the response (or the last match of ``pattern`` in it) equals the answer after :func:`normalise`."""
    found = extract(response, pattern)
    return float(found is not None and answer is not None and normalise(found) == normalise(str(answer)))


exact.options = {"pattern": "regex"}


def math_answer(prompt, response: str, answer: Any = None, **columns) -> float:
    """1.0 if the response's final answer (its ``\\boxed{}``, else its last number or expression) is
    mathematically equivalent to the answer, as the ``math-verify`` package decides."""
    from math_verify import parse, verify

    if answer is None:
        return 0.0
    # No timeouts of math-verify's own: they use SIGALRM, which the pool's time limit needs. math-verify warns
    # about that on every call; the filter drops exactly that warning.
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_no_timeout_warning)
    gold = parse(_as_math(str(answer)), parsing_timeout=None)
    found = parse(response, parsing_timeout=None)
    return float(bool(gold) and bool(found) and verify(gold, found, timeout_seconds=None))


math_answer.options = {}


def _no_timeout_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Timeout is disabled")


def _as_math(answer: str) -> str:
    """An answer column as math-verify parses gold answers best: in math mode unless it already is."""
    return answer if "$" in answer or "\\boxed" in answer else f"${answer}$"


def format_match(prompt, response: str, pattern: str | None = None, **columns) -> float:
    """1.0 if the whole response matches the regular expression ``pattern`` (``re.fullmatch``, DOTALL)."""
    if pattern is None:
        raise TypeError("the format reward needs a pattern, e.g. {name: format, pattern: '<think>.*</think>.*'}")
    return float(re.fullmatch(pattern, response.strip(), re.DOTALL) is not None)


format_match.options = {"pattern": "regex, required"}


# -- naming and loading -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardSpec:
    """One reward of a task: which function, its weight in the sum, and the keyword options it gets."""

    name: str
    weight: float = 1.0
    options: Mapping[str, Any] = field(default_factory=dict)


def parse_specs(value: Any) -> tuple[RewardSpec, ...]:
    """``task.options.reward`` as specs: a name, a ``{name, weight, ...}`` mapping, or a non-empty list of them."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ConfigError("task.options.reward is an empty list; name at least one reward")
    specs = []
    for index, item in enumerate(items):
        where = f"task.options.reward[{index}]" if isinstance(value, list) else "task.options.reward"
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            raise ConfigError(
                f"{where} must be a reward name or a mapping with a 'name' (and optional 'weight' and options), "
                f"got {item!r}"
            )
        options = {k: v for k, v in item.items() if k not in ("name", "weight")}
        weight = item.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ConfigError(f"{where}.weight must be a finite number, got {weight!r}")
        specs.append(RewardSpec(item["name"], float(weight), options))
    return tuple(specs)


@functools.lru_cache(maxsize=64)  # looked up for every call (in workers, per response): the entry points once
def load_reward(name: str) -> Callable[..., Any]:
    """The function a reward name stands for: a ``bubblespec.rewards`` plugin (the built-ins are plugins too) or
    ``module:function``."""
    if ":" in name:
        return _import_function(name)
    try:
        return plugins.load("rewards", name)
    except PluginNotFoundError as error:  # its message lists what is installed
        raise ConfigError(
            f"reward {name!r} is not known: use a built-in ({', '.join(BUILT_IN)}), a plugin of the entry point "
            f"group 'bubblespec.rewards', or 'module:function' for a function you can import ({error})"
        ) from None


def check_options(spec: RewardSpec, where: str = "task.options.reward") -> None:
    """Checks ``spec``'s options against those its function declares (``f.options``: name -> "regex" or
    "regex, required"; the built-ins declare theirs): an unknown option, a missing required one or a pattern that
    does not compile is a :class:`ConfigError`. A function that declares nothing gets its options unchecked."""
    declared = getattr(load_reward(spec.name), "options", None)
    if declared is None:
        return
    for option, value in spec.options.items():
        if option not in declared:
            allowed = ", ".join(declared) or "none"
            raise ConfigError(
                f"{where}: reward {spec.name!r} has no option {option!r}{did_you_mean(option, declared)}; its "
                f"options: {allowed}"
            )
        if "regex" in declared[option]:
            try:
                re.compile(value)
            except (re.error, TypeError) as error:
                raise ConfigError(f"{where}.{option}: {value!r} is not a regular expression: {error}") from None
    missing = [o for o, kind in declared.items() if "required" in kind and o not in spec.options]
    if missing:
        raise ConfigError(f"{where}: reward {spec.name!r} needs option {missing[0]!r}")


def reward_labels(specs: Sequence[RewardSpec]) -> list[str]:
    """How records and logs name each reward: its name, with ``#2``, ``#3``, ... for a name given again."""
    labels, seen = [], {}
    for spec in specs:
        seen[spec.name] = seen.get(spec.name, 0) + 1
        labels.append(spec.name if seen[spec.name] == 1 else f"{spec.name}#{seen[spec.name]}")
    return labels


def _import_function(name: str) -> Callable[..., Any]:
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute or "/" in module_name or module_name.endswith(".py"):
        raise ConfigError(
            f"reward {name!r}: a user reward is 'module:function' with an importable module (e.g. "
            "'my_rewards:correct'), not a file path"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or whatever the module raised while importing
        raise ConfigError(f"reward {name!r}: module {module_name!r} does not import: {error!r}") from None
    function = module
    for part in attribute.split("."):
        function = getattr(function, part, None)
        if function is None:
            raise ConfigError(f"reward {name!r}: module {module_name!r} has no attribute {attribute!r}")
    if not callable(function):
        raise ConfigError(f"reward {name!r} is not callable (it is a {type(function).__name__})")
    return function


# -- scoring ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardItem:
    """What a reward scores: one response to one prompt, with the prompt's row."""

    row: str  # the prompt's uid, for error messages
    prompt: Any
    response: str
    columns: Mapping[str, Any]


class _Timeout(BaseException):
    """A reward call's time limit. Not an ``Exception``: rewards (math-verify among them) catch ``Exception`` around
    their own work, and would swallow it and run on without a limit."""


_REPEAT_S = 0.05
"""After the limit, the alarm fires again this often until the call ends: code that catches even a BaseException
once cannot run on for long."""


def _call_reward(name: str, options: Mapping[str, Any], items: Sequence[RewardItem], limit_s: float | None):
    """Scores ``items`` with reward ``name`` (batched when the function says so); in a worker, under a time limit.
    Returns ("ok", scores) or ("timeout" | "error", message). A call past its limit is a timeout whatever it
    returns or raises afterwards."""
    function = load_reward(name)
    alarm = {"armed": limit_s is not None, "fired": False}
    if alarm["armed"]:

        def expire(signum, frame):
            alarm["fired"] = True
            if alarm["armed"]:
                raise _Timeout

        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, limit_s, _REPEAT_S)
    try:
        outcome = "ok", _apply(function, items, options)
    except _Timeout:
        outcome = "timeout", ""
    except Exception as error:  # the user's function failing is data for the step record, not a crash
        outcome = "error", f"reward {name!r} raised {error!r}"
    finally:
        if alarm["armed"]:
            alarm["armed"] = False  # from here on the alarm only notes that it fired
            signal.setitimer(signal.ITIMER_REAL, 0)
    if alarm["fired"]:
        return "timeout", f"reward {name!r} did not return within {limit_s:g} s"
    return outcome


def _apply(function: Callable[..., Any], items: Sequence[RewardItem], options: Mapping[str, Any]) -> list:
    """``function``'s scores of ``items``: one call with lists for a batched reward, else one call per item."""
    if not getattr(function, "batched", False):
        return [function(i.prompt, i.response, **i.columns, **options) for i in items]
    names: dict[str, None] = {}
    for item in items:
        names.update(dict.fromkeys(item.columns))
    columns = {key: [item.columns.get(key) for item in items] for key in names}
    return list(function([i.prompt for i in items], [i.response for i in items], **columns, **options))


class RewardScorer:
    """Scores responses with the weighted sum of a task's rewards.

    ``workers`` > 0: each reward call (one response, or one batch for a batched reward) runs in a pool of that many
    worker processes with ``timeout_s`` to return; a call that times out or raises scores 0 and is counted
    (:meth:`take_failures`). ``workers == 0``: in this process, without a time limit, and an exception propagates.
    """

    def __init__(
        self, specs: Sequence[RewardSpec], workers: int = 2, timeout_s: float = 10.0, failure_limit: float = 1.0
    ) -> None:
        for spec in specs:
            check_options(spec)  # fails now, with the reward's name, if it cannot be loaded or is misconfigured
        self.specs = tuple(specs)
        self.labels = reward_labels(self.specs)
        self.workers, self.timeout_s, self.failure_limit = workers, timeout_s, failure_limit
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._failures = RewardFailures()

    def __call__(self, items: Sequence[RewardItem]) -> list[float]:
        return self.score(items)[0]

    def score(self, items: Sequence[RewardItem]) -> tuple[list[float], dict[str, list[float]]]:
        """The weighted sums of ``items``' rewards, and each reward's own (unweighted) scores by its label. A
        reward whose calls fail (time out or raise) on ``failure_limit`` or more of them raises a
        :class:`RewardError`: a broken reward stops the run instead of training on zeros."""
        totals = [0.0] * len(items)
        parts = {}
        for spec, label in zip(self.specs, self.labels, strict=True):
            parts[label] = self._scores(spec, items)
            for index, score in enumerate(parts[label]):
                totals[index] += spec.weight * score
        return totals, parts

    def take_failures(self) -> RewardFailures:
        failures, self._failures = self._failures, RewardFailures()
        return failures

    def close(self) -> None:
        if self._pool is not None:
            _kill(self._pool)
            self._pool = None

    def _scores(self, spec: RewardSpec, items: Sequence[RewardItem]) -> list[float]:
        batched = getattr(load_reward(spec.name), "batched", False)
        calls = [list(items)] if batched else [[item] for item in items]
        outcomes = self._run(spec, calls)
        scores: list[float] = []
        failed, first = 0, None
        for call, (status, value) in zip(calls, outcomes, strict=True):
            if status == "ok":
                scores += self._checked(spec.name, call, value)
                continue
            if status == "timeout":
                self._failures.timeouts += 1
            else:
                self._failures.errors += 1
            failed, first = failed + 1, first or f"{value} on row {call[0].row!r}"
            self._failures.first_error = self._failures.first_error or first
            scores += [0.0] * len(call)
        self._failures.calls += len(calls)
        if calls and failed / len(calls) >= self.failure_limit:
            raise RewardError(
                f"reward {spec.name!r} failed (timed out or raised) on {failed} of its {len(calls)} calls for "
                f"{len(items)} responses; the first: {first}. Fix the reward, or let a run go on past a share of "
                f"failures with task.options.reward_failure_limit (now {self.failure_limit:g}: the run stops when "
                "that share of a step's calls fail)"
            )
        return scores

    def _run(self, spec: RewardSpec, calls: list[list[RewardItem]]) -> list[tuple[str, Any]]:
        if self.workers == 0:
            function = load_reward(spec.name)
            return [("ok", _apply(function, call, spec.options)) for call in calls]
        pool = self._ensure_pool()
        futures = [pool.submit(_call_reward, spec.name, spec.options, call, self.timeout_s) for call in calls]
        # A call's own alarm ends it; this backstop catches one that ignores it (stuck in C code) or a dead worker.
        backstop_s = self.timeout_s * (1 + len(calls) / self.workers) + 30
        done, stuck = concurrent.futures.wait(futures, timeout=backstop_s)
        outcomes = []
        for future in futures:
            if future in stuck:
                outcomes.append(("timeout", f"reward {spec.name!r} did not return (its worker was stopped)"))
            elif future.exception() is not None:  # the worker died, or a result that does not pickle
                outcomes.append(("error", f"reward {spec.name!r}: {future.exception()!r}"))
            else:
                outcomes.append(future.result())
        if stuck or any(isinstance(f.exception(), concurrent.futures.process.BrokenProcessPool) for f in done):
            self.close()  # a fresh pool for the next call
        return outcomes

    def _ensure_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            # spawn: the controller's process has threads (Ray, the metrics server), which fork does not copy.
            context = multiprocessing.get_context("spawn")
            self._pool = concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=context)
        return self._pool

    @staticmethod
    def _checked(name: str, call: list[RewardItem], scores: Any) -> list[float]:
        if len(scores) != len(call):
            raise RewardError(f"reward {name!r} returned {len(scores)} scores for {len(call)} responses")
        checked = []
        for item, score in zip(call, scores, strict=True):
            if isinstance(score, bool) or not isinstance(score, numbers.Real) or not math.isfinite(score):
                raise RewardError(
                    f"reward {name!r} returned {score!r} for row {item.row!r}; a reward must return a finite number"
                )
            checked.append(float(score))
        return checked


def _kill(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Stops a pool whose workers may be stuck: shutdown alone would wait for them."""
    for process in list(getattr(pool, "_processes", {}).values()):
        process.terminate()
    pool.shutdown(wait=False, cancel_futures=True)
