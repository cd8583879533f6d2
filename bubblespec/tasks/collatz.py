"""A built-in long-response task: Collatz trajectories, numbers written least significant digit first.

The prompt is a number n >= 3 and ``=``, its digits reversed (``"72="`` is 27). The reference response is the
trajectory of n under the Collatz map (n / 2 when n is even, 3n + 1 when odd) down to 1, every value reversed, the
values separated by ``,``::

    prompt 72=   response 28,14,26,...,4,2,1<eos>        (27 -> 82 -> 41 -> 124 -> ... -> 4 -> 2 -> 1)

Written least significant digit first, each value is a function of a two-digit window of the value before it, in
writing order: halving gives digit i = floor(d_i / 2) + 5 when d_(i+1) is odd, and 3n + 1 is a carry that runs the
way the digits are written; the parity of the first digit picks the rule. So a tiny model can learn the step, and
the prompt alone sets the response's length: the number of steps to reach 1 (which no formula gives) times the
values' digits. With n log-uniform up to ``max_digits`` digits (8 by default) the reference responses are
long-tailed: over 2,000 prompts a median of 426 tokens, one in ten over 1,106 and the longest 3,202
(:func:`length_quantiles`). Prompts whose reference response would not fit ``max_response_tokens`` are drawn
again.

:class:`CollatzTask` is both the prompt source and the reward function. A tiny Llama model pre-trained on the
reference responses (``scripts/train_tiny_model.py --task collatz``) ships in ``assets/tiny-collatz``.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from pathlib import Path

from bubblespec.core.interfaces import Prompt
from bubblespec.tasks.arithmetic import CharacterTask, _is_integer

MAX_DIGITS = 12
"""The most digits a prompt's number may have (``max_digits``)."""
DEFAULT_MAX_DIGITS = 8
MAX_RESPONSE_TOKENS = 4000
"""The longest reference response, ``<eos>`` included; the shipped model's context holds it and the prompt."""
CONTEXT_LENGTH = 4096
"""The shipped model's ``max_position_embeddings``."""
REWARDS = ("prefix", "exact")
"""The task's reward functions, see :class:`CollatzTask`."""

_PROMPT_PATTERN = re.compile(r"([0-9]+)=")


def trajectory(n: int) -> list[int]:
    """The values after ``n`` down to 1 under the Collatz map.

    >>> trajectory(6)
    [3, 10, 5, 16, 8, 4, 2, 1]
    """
    if not _is_integer(n) or n < 2:
        raise ValueError(f"a Collatz prompt is an integer >= 2, got {n!r}")
    values = []
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        values.append(n)
    return values


def reversed_digits(n: int) -> str:
    """``n`` written least significant digit first: ``reversed_digits(27) == "72"``."""
    return str(n)[::-1]


def worked_solution(n: int) -> str:
    """The reference response (without ``<eos>``) for ``n``: its trajectory, every value reversed.

    >>> worked_solution(6)
    '3,01,5,61,8,4,2,1'
    """
    return ",".join(reversed_digits(value) for value in trajectory(n))


def response_tokens(n: int) -> int:
    """Tokens of the reference response for ``n``, ``<eos>`` included."""
    return len(worked_solution(n)) + 1


def prompt_text(n: int) -> str:
    """The prompt for ``n``: ``"72="`` for 27."""
    return f"{reversed_digits(n)}="


def parse_prompt(text: str) -> int:
    """The number of a prompt written by :func:`prompt_text`."""
    match = _PROMPT_PATTERN.fullmatch(text)
    if match is None or int(match.group(1)[::-1]) < 2:
        raise ValueError(f"not a Collatz prompt: {text!r}; expected digits of a number >= 2, reversed, and '=', "
                         "e.g. '72=' for 27")  # fmt: skip
    return int(match.group(1)[::-1])


def sample_number(rng: random.Random, max_digits: int, max_response_tokens: int) -> int:
    """One prompt's number: 10**u with u uniform on [0.5, max_digits] (log-uniform, so each order of magnitude is
    as likely), drawn again until its reference response fits ``max_response_tokens``."""
    while True:
        n = max(3, int(10 ** rng.uniform(0.5, max_digits)))
        if response_tokens(n) <= max_response_tokens:
            return n


def prefix_credit(values: Sequence[str], expected: Sequence[str]) -> float:
    """The share of the trajectory written right before the first wrong value: values that match the reference
    from the start, over the longer of the two (a missing or an extra value costs one).

    >>> prefix_credit(["3", "01", "6"], ["3", "01", "5", "61"])
    0.5
    """
    matching = 0
    for got, want in zip(values, expected, strict=False):
        if got != want:
            break
        matching += 1
    return matching / max(len(values), len(expected))


class CollatzTask(CharacterTask):
    """Prompts of Collatz trajectories (long, long-tailed responses), and the reward for writing them.

    ``batch(step)`` is a pure function of ``(seed, step)`` (and the options), so the source is peekable.

    The reward (``reward``) reads the values of the response (up to its first ``<eos>``, split at ``,``):

    * ``"prefix"`` (the default): partial credit, the share of the trajectory written right from the start
      (:func:`prefix_credit`); 1.0 exactly when the response is the whole trajectory. A response that goes wrong
      late scores more than one that goes wrong early, so groups the policy never fully solves carry signal.
    * ``"exact"``: 1.0 when the response is the whole trajectory, else 0.0.

    A response without ``<eos>`` is scored as it stands; a malformed one scores 0.0 without raising.

    ``max_digits`` (1 to 12) sets the largest prompt number; ``max_response_tokens`` (8 to 4000) the longest
    reference response (longer ones are drawn again) and the response limit.
    """

    def __init__(
        self,
        seed: int = 0,
        prompts_per_step: int = 16,
        reward: str = "prefix",
        max_digits: int = DEFAULT_MAX_DIGITS,
        max_response_tokens: int = MAX_RESPONSE_TOKENS,
    ) -> None:
        super().__init__(seed, prompts_per_step)
        self._check_choice("reward", reward, REWARDS)
        self._check_integer_in("max_digits", max_digits, 1, MAX_DIGITS)
        self._check_integer_in("max_response_tokens", max_response_tokens, 8, MAX_RESPONSE_TOKENS)
        self.reward = reward
        self.max_digits = max_digits
        self.max_response_tokens = max_response_tokens

    @staticmethod
    def model_path() -> Path:
        """The folder of the shipped pre-trained model (Hugging Face format, tokenizer included)."""
        return Path(__file__).parent / "assets" / "tiny-collatz"

    @property
    def max_new_tokens(self) -> int:
        return self.max_response_tokens

    def batch(self, step: int) -> list[Prompt]:
        """The prompts of ``step``: a pure function of ``(seed, step)``."""
        if not _is_integer(step) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        rng = random.Random(f"bubblespec.collatz\x1f{self.seed}\x1f{step}")
        return [
            self.make_prompt(sample_number(rng, self.max_digits, self.max_response_tokens),
                             uid=f"collatz-{self.seed}-{step}-{i}")
            for i in range(self.prompts_per_step)
        ]  # fmt: skip

    def make_prompt(self, n: int, uid: str) -> Prompt:
        """The prompt for ``n``, its ids starting with ``<bos>``; its answer is the number of steps to reach 1."""
        text = prompt_text(n)
        return Prompt(uid=uid, token_ids=(self.bos_token_id, *self.encode(text)), text=text,
                      answer=str(len(trajectory(n))))  # fmt: skip

    def reference_response(self, prompt: Prompt | str) -> str:
        """The trajectory of a prompt (text, without ``<eos>``): the pre-training target."""
        return worked_solution(parse_prompt(prompt.text if isinstance(prompt, Prompt) else prompt))

    def __call__(self, prompt: Prompt, response_token_ids: Sequence[int]) -> float:
        text = self._text_until_eos(response_token_ids)
        if text is None:
            return 0.0
        expected = self.reference_response(prompt).split(",")
        values = text.split(",") if text else []
        if self.reward == "exact":
            return 1.0 if values == expected else 0.0
        return prefix_credit(values, expected)


def length_quantiles(task: CollatzTask, num_prompts: int = 2000, seed: int = 0) -> dict[str, float]:
    """Median, 0.9 and 0.99 quantiles and maximum of the reference response lengths (tokens) of ``num_prompts``
    prompts drawn as the task draws them."""
    rng = random.Random(f"bubblespec.collatz.lengths\x1f{seed}")
    lengths = sorted(
        response_tokens(sample_number(rng, task.max_digits, task.max_response_tokens)) for _ in range(num_prompts)
    )

    def quantile(q: float) -> float:
        return float(lengths[min(len(lengths) - 1, math.ceil(q * len(lengths)) - 1)])

    return {"median": quantile(0.5), "p90": quantile(0.9), "p99": quantile(0.99), "max": float(lengths[-1])}
