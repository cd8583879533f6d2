"""The ``reasoning-gym`` task: procedural reasoning problems from the ``reasoning-gym`` package, scored by each
dataset's own verifier, so that runs get real reasoning tasks without downloading anything.

``task.options.datasets`` names one or more of its procedural datasets (``reasoning_gym.factory.DATASETS``), each
with its configuration; ``size`` problems are drawn from them (shared out evenly, in order) with the task's seed,
and the held-out split draws ``eval_size`` more with another seed. Prompts are the problems' questions, rendered
like the dataset task's (chat template, system prompt; see :mod:`bubblespec.tasks.dataset`), and the default
reward ``reasoning-gym`` asks the problem's own dataset to score the answer (``score_answer``): the text inside
``<answer>...</answer>`` when the response has one, else the whole response.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import Field, field_validator

from bubblespec.core.errors import ConfigError
from bubblespec.tasks.dataset import PromptOptions, RowsTask, task_options
from bubblespec.tasks.rewards import extract

EVAL_SEED_OFFSET = 1_000_003
"""The held-out split's seed is the task's seed plus this (reasoning-gym draws problems from the seed)."""
DEFAULT_SYSTEM_PROMPT = (
    "Think about the problem step by step, then give only the final answer between <answer> and </answer>."
)


class ReasoningGymOptions(PromptOptions):
    """``task.options`` of the reasoning-gym task."""

    datasets: str | list[str] | dict[str, dict[str, Any]]
    """The procedural datasets: a name, a list of names, or names with their configuration
    (``{basic_arithmetic: {max_terms: 4}}``)."""
    size: int = Field(1000, ge=1)
    """Training problems, shared out evenly among the datasets."""
    eval_size: int = Field(200, ge=1)
    """Held-out problems, drawn with another seed."""
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    reward: Any = "reasoning-gym"

    @field_validator("datasets")
    @classmethod
    def _as_mapping(cls, value):
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            value = {name: {} for name in value}
        if not value:
            raise ValueError("name at least one reasoning-gym dataset")
        return value


class ReasoningGymTask(RowsTask):
    """Problems of reasoning-gym's procedural datasets (see the module docstring)."""

    prompt_column = "question"
    answer_column = "answer"

    def __init__(
        self,
        seed: int = 0,
        prompts_per_step: int = 16,
        *,
        model_path: str,
        split: Literal["train", "eval"] = "train",
        **options: Any,
    ) -> None:
        super().__init__(seed, prompts_per_step, model_path, split, task_options(ReasoningGymOptions, options))

    def _rows(self) -> tuple[list[dict], str]:
        import reasoning_gym

        options = self.options
        size = options.size if self.split == "train" else options.eval_size
        seed = self.seed if self.split == "train" else self.seed + EVAL_SEED_OFFSET
        names = list(options.datasets)
        rows = []
        for index, name in enumerate(names):
            count = size // len(names) + (index < size % len(names))
            if count == 0:
                continue
            try:
                dataset = reasoning_gym.create_dataset(name, seed=seed + index, size=count, **options.datasets[name])
            except ValueError as error:  # an unknown name, or a configuration the dataset refuses
                known = ", ".join(sorted(reasoning_gym.factory.DATASETS))
                raise ConfigError(f"task.options.datasets: {name!r}: {error} (datasets: {known})") from None
            except TypeError as error:  # an option the dataset's configuration does not have
                raise ConfigError(f"task.options.datasets: {name!r}: {error}") from None
            rows += [{"question": e["question"], "answer": e["answer"], "metadata": e["metadata"]} for e in dataset]
        return rows, f"reasoning-gym {', '.join(names)} ({self.split}, seed {seed})"


def score(prompt, response: str, answer=None, metadata=None, answer_tag: str | None = "answer", **columns) -> float:
    """The reward of the reasoning-gym task: the problem's own dataset scores the answer (the text of the last
    ``<answer_tag>...</answer_tag>`` in the response, else the whole response) against the problem."""
    if not isinstance(metadata, dict) or "source_dataset" not in metadata:
        raise TypeError("the reasoning-gym reward needs the rows of the reasoning-gym task (their metadata)")
    found = extract(response, rf"<{answer_tag}>(.*?)</{answer_tag}>") if answer_tag else None
    entry = {"question": prompt, "answer": answer, "metadata": metadata}
    return float(
        _scorer(metadata["source_dataset"])(answer=(found if found is not None else response).strip(), entry=entry)
    )


@functools.cache
def _scorer(name: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)
