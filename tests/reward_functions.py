"""User reward functions for the reward tests, importable as ``tests.reward_functions:NAME``."""

from __future__ import annotations

import time


def length_bonus(prompt, response, answer=None, scale=1.0, **columns):
    return scale * len(response)


def uses_columns(prompt, response, answer=None, level=None, **columns):
    return float(level) if response.strip() == str(answer) else 0.0


def batched_contains(prompts, responses, answer=None, **columns):
    return [float(str(a) in r) for r, a in zip(responses, answer, strict=True)]


batched_contains.batched = True


def sleeps_on_slow(prompt, response, **columns):
    if "slow" in response:
        time.sleep(60)
    return 1.0


def swallows_exceptions(prompt, response, **columns):
    """As math-verify does: a broad ``except Exception`` around slow work."""
    try:
        time.sleep(60)
    except Exception:
        pass
    return 1.0


def swallows_everything(prompt, response, **columns):
    """Catches even a BaseException once, then goes on working."""
    try:
        time.sleep(60)
    except BaseException:
        time.sleep(60)
    return 1.0


def raises_on_bad(prompt, response, **columns):
    if "bad" in response:
        raise RuntimeError("cannot score this one")
    return 1.0


def returns_text(prompt, response, **columns):
    return "high"


NOT_CALLABLE = 3


def digit_share(prompt, response, **columns):
    """A reward any response earns some of (a random model's too): the share of its characters that are digits."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def always_raises(prompt, response, **columns):
    raise KeyError("no column 'solution' in this row")
