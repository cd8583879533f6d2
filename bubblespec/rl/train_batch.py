"""A step's training batch before the learner's updates: the samples, the checks every worker makes alike, DAPO's
overlong shaping and group filter, and the advantages of each sample. Plain Python, no tensors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from bubblespec.core.config import TrainerConfig
from bubblespec.core.interfaces import GenerationRequest, GenerationResult
from bubblespec.rl.advantages import Estimator, Scale, compute_advantages


@dataclass(frozen=True)
class TrainSample:
    """One response of the current policy, with its prompt, group and reward."""

    prompt_token_ids: tuple[int, ...]
    response_token_ids: tuple[int, ...]
    group: int
    reward: float
    engine_logprobs: tuple[float, ...] | None = None
    """The rollout engine's log-probability of each response token (the old policy's, for ``old_logprobs:
    engine`` and truncated importance sampling; and to measure how far the trainer's are)."""
    truncated: bool = False
    """The response reached its token limit instead of stopping."""
    max_response_tokens: int | None = None
    """The token limit it was sampled with (DAPO's overlong shaping, Dr. GRPO's constant)."""


def train_samples(
    requests: Sequence[GenerationRequest],
    results: Sequence[GenerationResult],
    rewards: Sequence[float],
    group_size: int,
) -> list[TrainSample]:
    """The samples of a step's responses: ``results[i]`` answers ``requests[i]``, prompt by prompt, each prompt's
    ``group_size`` samples in a row (one group each), with the engine's logprobs and its token limit."""
    return [
        TrainSample(
            tuple(request.prompt_token_ids),
            tuple(result.token_ids),
            i // group_size,
            reward,
            engine_logprobs=tuple(result.logprobs),
            truncated=result.finish_reason == "length",
            max_response_tokens=request.sampling.max_new_tokens,
        )
        for i, (request, result, reward) in enumerate(zip(requests, results, rewards, strict=True))
    ]


def group_advantages(samples: Sequence[TrainSample], epsilon: float = 1e-6) -> list[float]:
    """GRPO advantages: each reward minus its group's mean, divided by the group's standard deviation."""
    return sample_advantages(samples, "grpo", "group", epsilon)


def sample_advantages(
    samples: Sequence[TrainSample], estimator: Estimator = "grpo", scale: Scale = "group", epsilon: float = 1e-6
) -> list[float]:
    """The advantage of each sample by ``estimator`` (:mod:`bubblespec.rl.advantages`)."""
    return compute_advantages([s.reward for s in samples], [s.group for s in samples], estimator, scale, epsilon)


def check_samples(samples: Sequence[TrainSample], config: TrainerConfig) -> None:
    """Refuses a batch the updates cannot use, naming the sample: a reward that is not a finite number, engine
    logprobs that are not one per response token, none where ``old_logprobs: engine`` or ``tis_cap`` needs them."""
    needs_engine = config.loss.old_logprobs == "engine" or config.loss.tis_cap is not None
    for index, sample in enumerate(samples):
        length, engine = len(sample.response_token_ids), sample.engine_logprobs
        if not math.isfinite(sample.reward):
            raise ValueError(f"sample {index} has reward {sample.reward!r}; rewards must be finite numbers")
        if engine and len(engine) != length:
            raise ValueError(
                f"sample {index} has {len(engine)} engine logprobs for its {length} response tokens; an engine "
                "returns one log-probability per response token"
            )
        if needs_engine and length and not engine:
            raise ValueError(
                f"sample {index} has no engine logprobs: old_logprobs: engine and tis_cap need the rollout engine's "
                "logprob of every response token"
            )


def shaped_rewards(samples: Sequence[TrainSample], config: TrainerConfig) -> list[float]:
    """The task's rewards plus DAPO's soft overlong punishment (Yu et al. 2025): a response longer than
    ``max_response_tokens - overlong_buffer`` loses ``overlong_penalty`` times the share of the buffer it used."""
    dapo = config.dapo
    if not dapo.overlong_buffer:
        return [s.reward for s in samples]
    rewards = []
    for sample in samples:
        if sample.max_response_tokens is None:
            raise ValueError("overlong_buffer needs each sample's max_response_tokens (the limit it was sampled with)")
        excess = len(sample.response_token_ids) - (sample.max_response_tokens - dapo.overlong_buffer)
        rewards.append(sample.reward - dapo.overlong_penalty * max(excess, 0) / dapo.overlong_buffer)
    return rewards


def filter_groups(samples: Sequence[TrainSample], rewards: Sequence[float], max_groups: int | None):
    """DAPO's dynamic-sampling filter: the samples (and their ``rewards``, shaped or not) of the groups whose task
    rewards (``sample.reward``: accuracy, before any length shaping) are not all equal, the first ``max_groups``
    such groups in order of first appearance; and the number of groups kept and dropped."""
    members: dict[int, list[int]] = {}
    for index, sample in enumerate(samples):
        members.setdefault(sample.group, []).append(index)
    informative = [g for g, rows in members.items() if len({samples[i].reward for i in rows}) > 1]
    kept = set(informative[:max_groups] if max_groups is not None else informative)
    rows = [i for i, sample in enumerate(samples) if sample.group in kept]
    return [samples[i] for i in rows], [rewards[i] for i in rows], len(kept), len(members) - len(kept)


def micro_batches(rows: Sequence[int], lengths: Sequence[int], size: int | None, tokens: int | None) -> list[list[int]]:
    """``rows`` (indices into ``lengths``, each sample's prompt + response tokens) in the forward/backward passes of
    ``trainer.micro_batch_size`` (``size``) and ``trainer.micro_batch_tokens`` (``tokens``): without a token bound,
    ``size`` rows at a time in their order (all at once without either); with one, the rows longest first (ties in
    their order), each pass as many as fit ``tokens`` padded tokens (rows x the longest) and ``size``, at least one.

    >>> micro_batches([0, 1, 2, 3], [10, 40, 12, 38], None, 80)
    [[1, 3], [2, 0]]
    """
    rows = list(rows)
    if tokens is None:
        step = size or max(len(rows), 1)
        return [rows[start : start + step] for start in range(0, len(rows), step)]
    batches: list[list[int]] = []
    for row in sorted(rows, key=lambda r: -lengths[r]):
        batch = batches[-1] if batches else None
        # longest first: a batch's first row is its longest
        if batch is not None and (size is None or len(batch) < size) and (len(batch) + 1) * lengths[batch[0]] <= tokens:
            batch.append(row)
        else:
            batches.append([row])
    return batches
