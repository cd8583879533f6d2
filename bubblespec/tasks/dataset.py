"""The ``dataset`` task: the user's own prompts and answers from local files, the model folder's tokenizer and
chat template, and the rewards the config names.

Files are read with the ``datasets`` library (JSONL, JSON, Parquet, CSV, or a folder written by
``Dataset.save_to_disk``), never from a hub. Each row's prompt is plain text or a list of ``{role, content}``
messages; with a chat template (the tokenizer's, applied with the generation prompt added) the text becomes a
user message, and ``system_prompt`` a system message before it. The tokenizer's EOS token, the EOS ids of the
folder's ``generation_config.json`` and any ``stop_tokens`` end a response.

Steps go through the rows in epochs: epoch ``e`` is a permutation of the rows seeded by ``(seed, e)``, cut into
``len(rows) // prompts_per_step`` batches (the remainder waits for a later epoch's permutation), so ``batch(step)``
is a pure function of the step, the prompts of any later step are known in advance, and a prompt appears at most
once per step. A prompt's uid is its row's (``train-17``) in every epoch, so history drafts and length predictions
recognise it. The held-out split (``split="eval"``) is ``eval_path``, or a seeded ``eval_fraction`` of the rows
taken out of training, in file order.

See docs/tasks.md for the options with examples.
"""

from __future__ import annotations

import functools
import glob
import logging
import random
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from bubblespec.core.config import Section, format_validation_error
from bubblespec.core.errors import ConfigError
from bubblespec.core.interfaces import Prompt, Task
from bubblespec.core.model_folder import context_length, eos_token_ids
from bubblespec.tasks.rewards import RewardItem, RewardScorer, extract, parse_specs

logger = logging.getLogger(__name__)

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File suffixes the task reads, and the ``datasets`` builder of each."""


class PromptOptions(Section):
    """How rows become prompts and responses become rewards: the options every task over rows shares."""

    chat_template: bool | None = None
    """Apply the tokenizer's chat template (with the generation prompt); None: when the tokenizer has one."""
    system_prompt: str | None = None
    """A system message before each prompt (needs the chat template)."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Longest prompt in tokens (template included); None: what the model's context leaves for one new token."""
    long_prompts: Literal["drop", "error"] = "drop"
    """What a longer prompt does: dropped (counted in the run log) or an error naming the row."""
    max_new_tokens: int = Field(512, ge=1)
    """Longest response, unless ``rollout.sampling.max_new_tokens`` says otherwise."""
    stop_tokens: list[str] = []
    """Tokens (by their text, e.g. ``<|im_end|>``) that end a response, besides the tokenizer's and the generation
    config's EOS."""
    reward: Any = "exact"
    """A reward name, a ``{name, weight, ...options}`` mapping or a list of them: built-ins ``exact``, ``math``,
    ``format``, a ``bubblespec.rewards`` plugin, or ``module:function`` (see :mod:`bubblespec.tasks.rewards`)."""
    reward_workers: int = Field(2, ge=0)
    """Worker processes that run rewards, each call under ``reward_timeout_s``; 0: in the controller, no limit."""
    reward_timeout_s: float = Field(10.0, gt=0)
    """Time a reward call has to return; a call that times out or raises scores 0 and is counted."""
    reward_failure_limit: float = Field(1.0, gt=0, le=1)
    """The run stops when this share of a step's calls of one reward fail (time out or raise); 1: only when every
    call fails."""


class DatasetOptions(PromptOptions):
    """``task.options`` of the dataset task."""

    path: str | list[str]
    """Training rows: local files (a glob, or a list of files or globs) in one format (.jsonl, .json, .parquet,
    .csv), or a folder written by ``datasets``' ``save_to_disk``."""
    eval_path: str | list[str] | None = None
    """Held-out rows, in the same forms as ``path``."""
    eval_fraction: float | None = Field(None, gt=0, lt=1)
    """Without ``eval_path``: this share of the rows (a seeded choice) is held out instead of trained on."""
    prompt_column: str = "prompt"
    """The column with the prompt: plain text, or a list of ``{role, content}`` messages."""
    answer_column: str | None = "answer"
    """The column with the reference answer (given to rewards as ``answer``); None: the rows have none."""
    answer_pattern: str | None = None
    """A regular expression whose last match in the answer column (its first group, if it has one) is the answer
    rewards get, e.g. ``'####\\s*(.+)'`` for GSM8K's ``#### 72``; a row it does not match is an error."""

    @field_validator("answer_pattern")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"{pattern!r} is not a regular expression: {error}") from None
        return pattern

    @model_validator(mode="after")
    def _one_held_out_source(self) -> DatasetOptions:
        if self.eval_path is not None and self.eval_fraction is not None:
            raise ValueError("give eval_path or eval_fraction, not both")
        return self


def task_options(model: type[PromptOptions], options: Mapping[str, Any]) -> PromptOptions:
    """``options`` validated as ``model``: every problem in one :class:`ConfigError` under ``task.options``, a
    misspelled option with the closest allowed name."""
    try:
        return model(**options)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, "task.options", model)) from None


class RowsTask(Task):
    """Prompt source and reward function over rows held in memory: prompts rendered with the model folder's
    tokenizer, seeded epochs, rewards in a pool (see the module docstring). A subclass says where the rows come
    from (:meth:`_rows`) and which columns hold the prompt and the answer."""

    prompt_column: str
    answer_column: str | None

    def __init__(
        self, seed: int, prompts_per_step: int, model_path: str, split: Literal["train", "eval"], options: PromptOptions
    ) -> None:
        self.options = options
        self.seed, self.split = seed, split
        self.tokenizer = load_tokenizer(model_path)
        self.context_length = context_length(model_path)
        self.stop_token_ids = _stop_token_ids(self.tokenizer, model_path, options.stop_tokens)
        pad = self.tokenizer.pad_token_id
        self.suppressed_token_ids = () if pad is None or pad in self.stop_token_ids else (int(pad),)
        self.scorer = RewardScorer(
            parse_specs(options.reward), options.reward_workers, options.reward_timeout_s, options.reward_failure_limit
        )
        rows, source = self._rows()
        self.prompts = self._prompts(rows, source)
        if split == "eval":
            prompts_per_step = min(prompts_per_step, len(self.prompts))
        if len(self.prompts) < prompts_per_step:
            raise ConfigError(
                f"task.options: {source} has {len(self.prompts)} usable rows; task.prompts_per_step "
                f"{prompts_per_step} needs at least that many"
            )
        self.prompts_per_step = prompts_per_step
        self._orders: dict[int, list[int]] = {}

    def _rows(self) -> tuple[list[dict], str]:
        """This split's rows, in order, and a description of where they came from (for messages)."""
        raise NotImplementedError

    @property
    def max_new_tokens(self) -> int:
        return self.options.max_new_tokens

    # -- PromptSource -------------------------------------------------------------------------------------------

    def batch(self, step: int) -> list[Prompt]:
        """The prompts of ``step``: batch ``step % steps_per_epoch`` of epoch ``step // steps_per_epoch``'s
        permutation (the held-out split: in file order)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        steps_per_epoch = len(self.prompts) // self.prompts_per_step
        epoch, index = divmod(step, steps_per_epoch)
        order = self._epoch_order(epoch) if self.split == "train" else range(len(self.prompts))
        start = index * self.prompts_per_step
        return [self.prompts[i] for i in order[start : start + self.prompts_per_step]]

    def _epoch_order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s permutation of the rows; the two latest are kept (a step and the one it peeks at)."""
        if epoch not in self._orders:
            order = list(range(len(self.prompts)))
            random.Random(f"bubblespec.dataset\x1f{self.seed}\x1f{epoch}").shuffle(order)
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1} | {epoch: order}
        return self._orders[epoch]

    # -- rewards ------------------------------------------------------------------------------------------------

    def __call__(self, prompt: Prompt, response_token_ids: Sequence[int]) -> float:
        return self.score([prompt], [response_token_ids])[0]

    def score(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> list[float]:
        """The configured rewards' weighted sum for each (prompt, response token ids), in one pass over the pool."""
        return self.score_parts(prompts, responses)[0]

    def score_parts(
        self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]
    ) -> tuple[list[float], dict[str, list[float]]]:
        """The weighted sums and each configured reward's own scores, by its label."""
        return self.scorer.score([self._reward_item(p, ids) for p, ids in zip(prompts, responses, strict=True)])

    def take_reward_failures(self):
        """Reward calls that timed out or raised since the last call
        (:class:`bubblespec.core.interfaces.RewardFailures`)."""
        return self.scorer.take_failures()

    def close(self) -> None:
        self.scorer.close()

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def _reward_item(self, prompt: Prompt, response_token_ids: Sequence[int]) -> RewardItem:
        row = dict(prompt.columns)
        original = row.pop(self.prompt_column)
        if self.answer_column is not None:  # the gold answer, even where the row has another column named "answer"
            row["answer"] = prompt.answer
        return RewardItem(prompt.uid, original, self.decode(response_token_ids), row)

    # -- loading ------------------------------------------------------------------------------------------------

    def _prompts(self, rows: list[dict], source: str) -> list[Prompt]:
        options = self.options
        if not rows:
            raise ConfigError(f"task.options: {source} has no rows")
        for column in (self.prompt_column, self.answer_column):
            if column is not None and column not in rows[0]:
                raise ConfigError(
                    f"task.options: {column!r} is not a column of {source}; its columns: {', '.join(rows[0])}"
                )
        self.own_system_prompts = 0
        texts = [self._render(row[self.prompt_column], f"{self.split}-{i}") for i, row in enumerate(rows)]
        encoded = self.tokenizer(texts, add_special_tokens=not self._uses_template)["input_ids"]
        limit = min(options.max_prompt_tokens or self.context_length, self.context_length - 1)
        prompts, dropped = [], 0
        for i, (row, text, ids) in enumerate(zip(rows, texts, encoded, strict=True)):
            uid = f"{self.split}-{i}"
            if len(ids) > limit:
                if options.long_prompts == "error":
                    raise ConfigError(
                        f"task.options: row {uid} of {source} has a prompt of {len(ids)} tokens, longer than "
                        f"{limit} (max_prompt_tokens, and the model's context of {self.context_length}); set "
                        "long_prompts: drop to leave such rows out"
                    )
                dropped += 1
                continue
            prompts.append(Prompt(uid=uid, token_ids=tuple(ids), text=text, answer=self._answer(row, uid, source),
                                  columns=row))  # fmt: skip
        if dropped:
            logger.warning("dataset task: dropped %d of %d %s prompts longer than %d tokens", dropped, len(rows),
                           self.split, limit)  # fmt: skip
        if self.own_system_prompts:
            logger.warning("dataset task: %d of %d %s rows begin with their own system message; system_prompt is "
                           "not added to them", self.own_system_prompts, len(rows), self.split)  # fmt: skip
        self.num_dropped_prompts = dropped
        self.unknown_token_share = _unknown_share(self.tokenizer, [p.token_ids for p in prompts])
        if self.unknown_tokens_warning() is not None:
            logger.warning("dataset task: %s", self.unknown_tokens_warning())
        return prompts

    def reward_names(self) -> list[str]:
        return [f"{label} (weight {spec.weight:g})" for label, spec in zip(self.scorer.labels, self.scorer.specs,
                                                                           strict=True)]  # fmt: skip

    def unknown_tokens_warning(self) -> str | None:
        """A warning when more than :data:`UNKNOWN_TOKENS_WARNING` of the prompts' tokens are the unknown token."""
        if self.unknown_token_share <= UNKNOWN_TOKENS_WARNING:
            return None
        return (
            f"{self.unknown_token_share:.1%} of the {self.split} prompts' tokens are the tokenizer's unknown token "
            f"{self.tokenizer.unk_token!r}: the model's vocabulary does not cover this text (is model.path the "
            "model the data was written for?)"
        )

    def _answer(self, row: dict, uid: str, source: str) -> str:
        """The row's answer as rewards get it: the answer column, or what ``answer_pattern`` extracts from it."""
        if self.answer_column is None:
            return ""
        text = str(row[self.answer_column])
        pattern = getattr(self.options, "answer_pattern", None)
        if pattern is None:
            return text
        found = extract(text, pattern)
        if found is None:
            raise ConfigError(
                f"task.options.answer_pattern {pattern!r} does not match row {uid}'s {self.answer_column!r} of "
                f"{source}: {text[-200:]!r}"
            )
        return found.strip()

    @functools.cached_property
    def _uses_template(self) -> bool:
        wanted, available = self.options.chat_template, bool(getattr(self.tokenizer, "chat_template", None))
        if wanted and not available:
            raise ConfigError("task.options.chat_template is true, but the model folder's tokenizer has no chat "
                              "template (tokenizer_config.json or chat_template.jinja)")  # fmt: skip
        uses = available if wanted is None else wanted
        if self.options.system_prompt is not None and not uses:
            raise ConfigError("task.options.system_prompt needs a chat template, and this task applies none")
        return uses

    def _render(self, prompt: Any, uid: str) -> str:
        """The prompt as the text the model continues: through the chat template, or as it is."""
        messages = _messages(prompt, uid, self.prompt_column)
        if not self._uses_template:
            if messages is not None:
                raise ConfigError(
                    f"task.options: row {uid}'s prompt is a list of chat messages, which needs a chat template "
                    "(the tokenizer has none, or chat_template is false)"
                )
            return prompt
        if messages is None:
            messages = [{"role": "user", "content": prompt}]
        if self.options.system_prompt is not None:
            if messages[0]["role"] == "system":
                self.own_system_prompts += 1  # the row's own system message wins; counted and logged
            else:
                messages = [{"role": "system", "content": self.options.system_prompt}, *messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class DatasetTask(RowsTask):
    """The ``dataset`` task: rows from the user's local files (see the module docstring)."""

    path_options = ("path", "eval_path")

    def __init__(
        self,
        seed: int = 0,
        prompts_per_step: int = 16,
        *,
        model_path: str,
        split: Literal["train", "eval"] = "train",
        **options: Any,
    ) -> None:
        dataset_options = task_options(DatasetOptions, options)
        self.prompt_column, self.answer_column = dataset_options.prompt_column, dataset_options.answer_column
        super().__init__(seed, prompts_per_step, model_path, split, dataset_options)

    def _rows(self) -> tuple[list[dict], str]:
        """This split's rows and a description of where they came from."""
        options = self.options
        if options.eval_path is not None:
            path = options.eval_path if self.split == "eval" else options.path
            return read_rows(path), _describe(path)
        rows = read_rows(options.path)
        if options.eval_fraction is None:
            if self.split == "eval":
                raise ConfigError(
                    "eval_every needs held-out prompts: set task.options.eval_path, or task.options.eval_fraction "
                    "to hold out a share of task.options.path"
                )
            return rows, _describe(options.path)
        held_out = set(random.Random(f"bubblespec.dataset-split\x1f{self.seed}").sample(
            range(len(rows)), max(1, round(options.eval_fraction * len(rows)))
        ))  # fmt: skip
        chosen = [row for i, row in enumerate(rows) if (i in held_out) == (self.split == "eval")]
        return chosen, f"{_describe(options.path)} ({self.split} share of eval_fraction {options.eval_fraction})"


def _messages(prompt: Any, uid: str, column: str) -> list[dict] | None:
    """The prompt's chat messages, None for plain text, an error for anything else."""
    if isinstance(prompt, str):
        return None
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        )
    ):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise ConfigError(
        f"task.options: row {uid}'s {column!r} is neither text nor a list of {{role, content}} messages: {prompt!r}"
    )


def read_rows(path: str | list[str]) -> list[dict]:
    """Every row of a dataset given as files (globs) or a ``save_to_disk`` folder, as dicts, in file order."""
    import datasets

    paths = [path] if isinstance(path, str) else list(path)
    if len(paths) == 1 and Path(paths[0]).expanduser().is_dir():
        folder = Path(paths[0]).expanduser()
        try:
            loaded = datasets.load_from_disk(str(folder))
        except FileNotFoundError as error:
            raise ConfigError(f"task.options: {folder} is a folder but not one save_to_disk wrote: {error}") from None
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ConfigError(f"task.options: {folder} holds splits {list(loaded)}, none named 'train'")
            loaded = loaded["train"]
        return loaded.to_list()
    files = []
    for pattern in paths:
        found = sorted(glob.glob(str(Path(pattern).expanduser())))
        if not found:
            raise ConfigError(f"task.options: no file matches {pattern!r}")
        files += found
    suffixes = {Path(f).suffix.lower() for f in files}
    unknown = suffixes - set(FORMATS)
    if unknown or len({FORMATS[s] for s in suffixes - unknown}) > 1:
        raise ConfigError(
            f"task.options: files of {_describe(path)} must share one format of {', '.join(FORMATS)}; got "
            f"{', '.join(sorted(suffixes))}"
        )
    builder = FORMATS[suffixes.pop()]
    if all(Path(f).stat().st_size == 0 for f in files):
        return []  # datasets' builders fail on empty files with no message of their own
    try:
        loaded = datasets.load_dataset(builder, data_files=files, split="train")
    except (ValueError, datasets.exceptions.DatasetGenerationError) as error:
        raise ConfigError(f"task.options: {_describe(path)} does not read as {builder}: {error}") from None
    return loaded.to_list()


def load_tokenizer(model_path: str):
    """The model folder's tokenizer (transformers' ``AutoTokenizer``), or an error saying it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, TypeError) as error:
        raise ConfigError(
            f"the dataset task needs the model folder's tokenizer, and {model_path} has none that transformers can "
            f"load (tokenizer.json and tokenizer_config.json): {error}"
        ) from None


def _stop_token_ids(tokenizer, model_path: str, stop_tokens: Sequence[str]) -> tuple[int, ...]:
    ids = eos_token_ids(model_path)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for token in stop_tokens:
        if token not in vocab:
            raise ConfigError(f"task.options.stop_tokens: {token!r} is not a token of the model's tokenizer")
        ids.add(vocab[token])
    return tuple(sorted(ids))


UNKNOWN_TOKENS_WARNING = 0.02
"""Share of prompt tokens that are the unknown token above which the task warns (and ``validate`` says so)."""


def _unknown_share(tokenizer, prompts: Sequence[Sequence[int]]) -> float:
    unknown = tokenizer.unk_token_id
    total = sum(len(ids) for ids in prompts)
    if unknown is None or not total:
        return 0.0
    return sum(ids.count(unknown) for ids in prompts) / total


def _describe(path: str | list[str]) -> str:
    return path if isinstance(path, str) else ", ".join(path)
