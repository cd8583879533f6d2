"""What every trainer integration does the same way: prompt uids, evaluation keys, the records of a generation batch
and of an evaluation batch, and the stop tokens of a tokenizer and model."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

from bubblespec.core.errors import ConfigError
from bubblespec.core.interfaces import GenerationResult, Prompt
from bubblespec.observe.records import GenerationRecord
from bubblespec.rollout.step import rollout_digest


def check_version(integration: str, framework: str, version: str, supported: tuple[str, str], why: str) -> None:
    """A :class:`ConfigError` unless ``supported[0] <= version < supported[1]``: ``integration`` supports
    ``framework`` in that range only, because ``why``."""
    from packaging.version import Version

    low, high = (Version(v) for v in supported)
    if not low <= Version(version) < high:
        raise ConfigError(
            f"{integration} supports {framework} >= {supported[0]}, < {supported[1]} ({why}); this environment has "
            f"{framework} {version}"
        )


class TrainingPhases:
    """Tells a rollout service when another framework's trainer trains: from a batch's return until the next call
    (``training_starts`` / ``training_ended`` with the seconds it really trained)."""

    def __init__(self) -> None:
        self.since: float | None = None
        """When the trainer started training; None while it generates."""

    def starts(self, service) -> None:
        if service is not None and self.since is None:
            service.training_starts()
            self.since = time.perf_counter()

    def ended(self, service) -> None:
        if self.since is not None:
            service.training_ended(time.perf_counter() - self.since)
            self.since = None


def prompt_uid(position: int, token_ids: Sequence[int]) -> str:
    """A prompt's uid in a trainer's batch: its position and a digest of its tokens, so that the same prompts at the
    same point of a run have the same rollout keys in every run (with or without speculation, resumed or not)."""
    digest = hashlib.sha1(repr(tuple(token_ids)).encode()).hexdigest()[:16]
    return f"{position}-{digest}"


def evaluation_step(index: int) -> int:
    """The rollout-key step of the run's ``index``-th evaluation batch: negative, where no generation batch (0, 1,
    ...) has keys or drafts."""
    return -1 - index


def distinct(prompts: Sequence, samples: int, what: str) -> list:
    """The prompts of a batch in which each prompt comes ``samples`` times in a row, once each; ``what`` names the
    trainer's setting that says ``samples`` (for the error when the batch is not like that)."""
    if samples < 1 or len(prompts) % samples:
        raise ValueError(f"{len(prompts)} prompts for {samples} samples per prompt ({what})")
    firsts = list(prompts[::samples])
    for i, prompt in enumerate(firsts):
        if any(p != prompt for p in prompts[i * samples : (i + 1) * samples]):
            raise ValueError(f"the trainer's prompts are not each repeated {samples} times in a row ({what})")
    return firsts


def eos_ids(tokenizer, generation_config=None) -> tuple[int, ...]:
    """The stop tokens of a tokenizer and a model's generation config (its ``eos_token_id``, one or a list)."""
    ids = [getattr(tokenizer, "eos_token_id", None)]
    eos = getattr(generation_config, "eos_token_id", None)
    ids += eos if isinstance(eos, list) else [eos]
    return tuple(sorted({t for t in ids if t is not None}))


def generation_record(generation: int, global_step: int, outcome, peek_matched: bool | None) -> GenerationRecord:
    """What the ranks did for one generation batch (``outcome``: :meth:`RolloutService.generate`'s)."""
    ranks = outcome.ranks
    return GenerationRecord(
        generation=generation,
        global_step=global_step,
        generated_tokens=sum(r.shard_tokens for r in ranks),
        decode_steps=sum(r.decode_steps for r in ranks),
        draft_tokens_accepted=sum(r.draft_tokens_accepted for r in ranks),
        draft_coverage=sum(r.requests_with_draft for r in ranks) / max(len(outcome.results), 1),
        rollout_seconds=outcome.seconds,
        bubble_seconds=sum(r.bubble_seconds for r in ranks),
        completions_digest=rollout_digest(outcome.results),
        ranks=ranks,
        peek_matched=peek_matched,
    )


def evaluation_record(index: int, global_step: int, samples: int, results: Sequence[GenerationResult]) -> dict:
    """One evaluation batch: its index, the trainer's step, samples per prompt, tokens and a digest."""
    return {
        "evaluation": index,
        "global_step": global_step,
        "num_generations": samples,
        "num_completions": len(results),
        "generated_tokens": sum(len(r.token_ids) for r in results),
        "completions_digest": rollout_digest(list(results)),
    }


def peek_matched(peeked: list[str] | None, prompts: Sequence[Prompt]) -> bool | None:
    """Whether the uids peeked for a batch are those of its prompts (None: nothing was peeked). Drafts were made for
    the prompts peeked; other prompts only make them useless, never wrong."""
    return None if peeked is None else peeked == [p.uid for p in prompts]
