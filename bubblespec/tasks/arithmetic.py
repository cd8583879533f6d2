"""A built-in synthetic task: long addition with a worked, column-by-column scratchpad.

The prompt is ``"4821+93="``; the reference response works the columns from the least significant digit up,
then gives the answer after ``;``::

    1+3=4,2+9=1c,8+0+1=9,4+0=4;4914<eos>

Each column is ``a+b[+1]=d[c]``: the two digits of that column (the shorter operand padded with ``0``), ``+1``
when the previous column carried, the sum digit ``d`` and ``c`` when this column carries. The response grows
by about eight characters per digit of the longer operand, and the number of digits is drawn from a
truncated geometric distribution, so most responses are short and a few are long: the long-tailed rollout
lengths that bubblespec is about.

:class:`ArithmeticTask` is both the prompt source and the reward function. A tiny Llama model pre-trained on
the reference responses with label smoothing (by ``scripts/train_tiny_model.py``) ships in ``assets/tiny-arith``;
it solves part of the task, and its temperature-1 samples are worse than its greedy answers, which leaves
reinforcement learning something to learn.
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from bubblespec.core.interfaces import Prompt, Task

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)  # ids 0, 1, 2, 3
ALPHABET = "0123456789+=,;c"
"""Every character a prompt or a reference response uses; one token each."""

MAX_DIGITS = 20
"""The longest operand, in digits."""
DIGITS_CONTINUE_PROBABILITY = 0.8
"""P(the longer operand has more than n digits | it has at least n): the geometric tail of problem sizes."""
CONTEXT_LENGTH = 512
"""The tiny model's ``max_position_embeddings``; prompt + response always fit in it."""

_ANSWER_PATTERN = re.compile(r"[0-9+=,c]*;([0-9]+)")  # scratchpad characters, ";", the answer
_PROMPT_PATTERN = re.compile(r"([0-9]+)\+([0-9]+)=")


def build_tokenizer() -> Tokenizer:
    """The character-level tokenizer of the task: one token per character of :data:`ALPHABET`.

    ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>`` have ids 0-3. Encoding with special tokens prepends ``<bos>``
    (so Hugging Face tokenizers loaded from the shipped ``tokenizer.json`` encode prompts as the task does);
    decoding concatenates the characters without separators.
    """
    vocab = {token: token_id for token_id, token in enumerate(SPECIAL_TOKENS)}
    for char in ALPHABET:
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    bos_id = vocab[BOS_TOKEN]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def sample_operands(
    rng: random.Random,
    max_digits: int = MAX_DIGITS,
    continue_probability: float = DIGITS_CONTINUE_PROBABILITY,
) -> tuple[int, int]:
    """Draws one problem: the longer operand's digit count is truncated-geometric on [1, max_digits] (it goes
    on past n digits with ``continue_probability``), the shorter one's uniform up to it, and either may come
    first."""
    num_digits_long = 1
    while num_digits_long < max_digits and rng.random() < continue_probability:
        num_digits_long += 1
    num_digits_short = rng.randint(1, num_digits_long)
    long_operand = _random_number(rng, num_digits_long)
    short_operand = _random_number(rng, num_digits_short)
    if rng.random() < 0.5:
        return long_operand, short_operand
    return short_operand, long_operand


def _random_number(rng: random.Random, num_digits: int) -> int:
    """A uniform random integer with exactly ``num_digits`` digits (one-digit numbers include 0)."""
    if num_digits == 1:
        return rng.randint(0, 9)
    return rng.randint(10 ** (num_digits - 1), 10**num_digits - 1)


def prompt_text(a: int, b: int) -> str:
    """The prompt for ``a + b``, e.g. ``"4821+93="``."""
    return f"{a}+{b}="


def parse_prompt(text: str) -> tuple[int, int]:
    """The operands of a prompt written by :func:`prompt_text`."""
    match = _PROMPT_PATTERN.fullmatch(text)
    if match is None:
        raise ValueError(f"not an arithmetic prompt: {text!r}; expected digits '+' digits '=', e.g. '4821+93='")
    return int(match.group(1)), int(match.group(2))


def worked_solution(a: int, b: int) -> str:
    """The reference response (without ``<eos>``) for ``a + b``: the columns, ``;``, the answer.

    >>> worked_solution(4821, 93)
    '1+3=4,2+9=1c,8+0+1=9,4+0=4;4914'
    """
    if a < 0 or b < 0:
        raise ValueError(f"operands must be non-negative integers, got {a} and {b}")
    num_columns = max(len(str(a)), len(str(b)))
    digits_a = str(a).zfill(num_columns)[::-1]  # least significant digit first
    digits_b = str(b).zfill(num_columns)[::-1]
    columns, carry = [], 0
    for digit_a, digit_b in zip(digits_a, digits_b, strict=True):
        total = int(digit_a) + int(digit_b) + carry
        carry_in = "+1" if carry else ""
        carry = total // 10
        columns.append(f"{digit_a}+{digit_b}{carry_in}={total % 10}{'c' if carry else ''}")
    return ",".join(columns) + f";{a + b}"


def max_response_tokens(max_digits: int = MAX_DIGITS) -> int:
    """The longest possible reference response, ``<eos>`` included: ``9+9=8c,9+9+1=9c,...;199...98<eos>``."""
    scratchpad = len("9+9=8c") + (max_digits - 1) * len(",9+9+1=9c")
    answer = max_digits + 1
    return scratchpad + len(";") + answer + 1  # + <eos>


def answer_digits_credit(answer: str, expected: str) -> float:
    """The fraction of digit positions, aligned at the units digit, where ``answer`` agrees with ``expected``;
    the longer of the two sets the count, so a missing or an extra digit costs one position.

    >>> answer_digits_credit("4924", "4914")
    0.75
    """
    matches = sum(got == want for got, want in zip(reversed(answer), reversed(expected), strict=False))
    return matches / max(len(answer), len(expected))


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


REWARDS = ("answer", "digits")
"""The task's reward functions, see :class:`ArithmeticTask`."""


class CharacterTask(Task):
    """A procedural task on the character-level tokenizer of :func:`build_tokenizer` (the shipped tiny models'
    vocabulary): its seed, its prompts per step, and text to token ids and back. Subclasses draw the prompts
    and score the responses."""

    def __init__(self, seed: int, prompts_per_step: int) -> None:
        if not _is_integer(seed):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if not _is_integer(prompts_per_step) or prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be an integer >= 1, got {prompts_per_step!r}")
        self.seed = seed
        self.prompts_per_step = prompts_per_step
        self._tokenizer = build_tokenizer()

    @property
    def pad_token_id(self) -> int:
        return self._tokenizer.token_to_id(PAD_TOKEN)

    @property
    def bos_token_id(self) -> int:
        return self._tokenizer.token_to_id(BOS_TOKEN)

    @property
    def suppressed_token_ids(self) -> tuple[int, ...]:
        """``<pad>``, ``<bos>`` and ``<unk>``: never part of a response (the shipped models give them a little
        probability, and a response that sampled ``<pad>`` showed it in its text)."""
        return tuple(self._tokenizer.token_to_id(token) for token in (PAD_TOKEN, BOS_TOKEN, UNK_TOKEN))

    @property
    def eos_token_id(self) -> int:
        return self._tokenizer.token_to_id(EOS_TOKEN)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, one per character, no ``<bos>``."""
        unknown = sorted(set(text) - set(ALPHABET))
        if unknown:
            raise ValueError(f"characters {unknown!r} are not in the task's alphabet {ALPHABET!r}")
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``; special tokens are written out (``<eos>``), not skipped."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def reference_response(self, prompt: Prompt | str) -> str:
        """The pre-training target of a prompt (text, without ``<eos>``)."""
        raise NotImplementedError

    def reference_response_ids(self, prompt: Prompt | str) -> list[int]:
        """Token ids of :meth:`reference_response`, ending with ``<eos>``."""
        return [*self.encode(self.reference_response(prompt)), self.eos_token_id]

    @staticmethod
    def _check_choice(name: str, value: object, allowed: Sequence[str]) -> None:
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")

    @staticmethod
    def _check_integer_in(name: str, value: object, low: int, high: int) -> None:
        if not _is_integer(value) or not low <= value <= high:
            raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")

    def _text_until_eos(self, response_token_ids: Sequence[int]) -> str | None:
        """The text of a response up to its first ``<eos>``; None if it holds anything but token ids of the
        vocabulary (a malformed response scores 0 rather than raising)."""
        try:
            token_ids = [operator.index(token_id) for token_id in response_token_ids]
        except TypeError:
            return None
        if self.eos_token_id in token_ids:
            token_ids = token_ids[: token_ids.index(self.eos_token_id)]
        if any(not 0 <= token_id < self.vocab_size for token_id in token_ids):
            return None
        return self.decode(token_ids)


class ArithmeticTask(CharacterTask):
    """Prompts of long additions, and the reward for answering them.

    ``batch(step)`` is a pure function of ``(seed, step)`` (and the options), so the source is peekable.

    The reward (``reward``) looks at the answer after ``;``:

    * ``"answer"`` (the default): 1.0 when it equals the sum and 0.0 otherwise.
    * ``"digits"``: partial credit, the fraction of the sum's digits it gets right (aligned at the units digit,
      see :func:`answer_digits_credit`); 1.0 exactly when the answer is right. A long problem that the model
      gets almost right scores more than one it gets badly wrong, so GRPO groups of problems the policy never
      fully solves still carry signal.

    Anything after the first ``<eos>`` is ignored and a malformed response scores 0.0 without raising. A
    response without ``<eos>`` is scored as it stands (an engine may strip the stop token), so one cut off
    inside the answer loses the digits it lacks.

    ``max_digits`` and ``digits_continue_probability`` set the problem sizes: the longer operand has n digits
    with probability ``p**(n-1) * (1-p)``, truncated at ``max_digits``. Smaller problems are easier and give
    shorter responses. The defaults reproduce the task the shipped model was trained on.

    ``dataset_size`` makes the prompts repeat, as in a finite RL dataset: an epoch is ``dataset_size /
    prompts_per_step`` steps, and step ``s`` gets the prompts (and prompt uids) of epoch position ``s mod`` that.
    None (the default) draws new prompts at every step.
    """

    def __init__(
        self,
        seed: int = 0,
        prompts_per_step: int = 16,
        reward: str = "answer",
        max_digits: int = MAX_DIGITS,
        digits_continue_probability: float = DIGITS_CONTINUE_PROBABILITY,
        dataset_size: int | None = None,
    ) -> None:
        super().__init__(seed, prompts_per_step)
        self._check_choice("reward", reward, REWARDS)
        self._check_integer_in("max_digits", max_digits, 1, MAX_DIGITS)
        if isinstance(digits_continue_probability, bool) or not isinstance(digits_continue_probability, int | float):
            raise ValueError(f"digits_continue_probability must be a number, got {digits_continue_probability!r}")
        if not 0 <= digits_continue_probability < 1:
            raise ValueError(f"digits_continue_probability must be in [0, 1), got {digits_continue_probability!r}")
        if dataset_size is not None and (
            not _is_integer(dataset_size) or dataset_size < 1 or dataset_size % prompts_per_step
        ):
            raise ValueError(
                f"dataset_size must be a positive multiple of prompts_per_step ({prompts_per_step}), "
                f"got {dataset_size!r}"
            )
        self.dataset_size = dataset_size
        self.reward = reward
        self.max_digits = max_digits
        self.digits_continue_probability = float(digits_continue_probability)

    @staticmethod
    def model_path() -> Path:
        """The folder of the shipped pre-trained model (Hugging Face format, tokenizer included)."""
        return Path(__file__).parent / "assets" / "tiny-arith"

    @property
    def max_new_tokens(self) -> int:
        """Enough new tokens for the longest reference response, ``<eos>`` included."""
        return max_response_tokens(self.max_digits)

    def batch(self, step: int) -> list[Prompt]:
        """The prompts of ``step``: a pure function of ``(seed, step)`` (of the epoch position with
        ``dataset_size``)."""
        if not _is_integer(step) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        if self.dataset_size is not None:
            step %= self.dataset_size // self.prompts_per_step
        rng = random.Random(f"bubblespec.arithmetic\x1f{self.seed}\x1f{step}")
        return [
            self.make_prompt(
                *sample_operands(rng, self.max_digits, self.digits_continue_probability),
                uid=f"arith-{self.seed}-{step}-{i}",
            )
            for i in range(self.prompts_per_step)
        ]

    def make_prompt(self, a: int, b: int, uid: str) -> Prompt:
        """The prompt for ``a + b``, its ids starting with ``<bos>``."""
        text = prompt_text(a, b)
        return Prompt(uid=uid, token_ids=(self.bos_token_id, *self.encode(text)), text=text, answer=str(a + b))

    def reference_response(self, prompt: Prompt | str) -> str:
        """The worked solution of a prompt (text, without ``<eos>``): the pre-training target."""
        text = prompt.text if isinstance(prompt, Prompt) else prompt
        return worked_solution(*parse_prompt(text))

    def __call__(self, prompt: Prompt, response_token_ids: Sequence[int]) -> float:
        """The reward of a response: with ``reward="answer"`` 1.0 if its final answer equals ``prompt.answer``,
        else 0.0; with ``reward="digits"`` the fraction of the answer's digits that are right."""
        answer = self.parse_answer(response_token_ids)
        if answer is None:
            return 0.0
        if self.reward == "digits":
            return answer_digits_credit(answer, prompt.answer)
        return 1.0 if answer == prompt.answer else 0.0

    def parse_answer(self, response_token_ids: Sequence[int]) -> str | None:
        """The answer after ``;`` in a response (up to its first ``<eos>``); ``None`` if it is malformed."""
        text = self._text_until_eos(response_token_ids)
        match = None if text is None else _ANSWER_PATTERN.fullmatch(text)
        return None if match is None else match.group(1)
