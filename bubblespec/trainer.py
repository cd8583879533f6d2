"""The learner: PPO-style updates (:mod:`bubblespec.policy_loss`) on GRPO-family advantages
(:mod:`bubblespec.advantages`), training the built-in decoder or a transformers model
(:mod:`bubblespec.trainer_models`).

One RL step (:meth:`GRPOLearner.step`)::

    rewards     task rewards, plus DAPO's overlong shaping and, with kl_penalty "reward", - kl_coef * KL(old || ref)
    filter      with filter_groups (DAPO's dynamic sampling): only groups whose rewards differ, train_prompts at most
    advantages  from the whole batch's rewards; a batch without signal takes no step
    before      with more than one update per step, truncated importance sampling or a KL penalty: the old policy's
                log-probabilities (and the frozen reference model's), once, without gradient
    updates     ppo_epochs x mini-batches of mini_batch_size samples, one optimizer step each, gradients accumulated
                over micro-batches of micro_batch_size

The learner is plain torch and knows nothing of Ray: the controller runs it in-process (virtual clock, tests) or
inside Ray Train workers (:mod:`bubblespec.ray_train`). Every worker gets the whole batch and computes its share of
each mini-batch (every world-th sample); ``all_reduce`` sums gradients and statistics, so that the workers' updates
are the updates of one learner on the whole batch. Training sees only the samples of the current step
(invariant 1): a batch is built from rollout results, never from drafts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bubblespec.advantages import Estimator, Scale, compute_advantages
from bubblespec.backends.torch_model import DTYPES
from bubblespec.config import TrainerConfig
from bubblespec.policy_loss import LossSettings, aggregation_normaliser, kl_divergence, policy_loss
from bubblespec.trainer_models import load_trainer_model


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


def group_advantages(samples: Sequence[TrainSample], epsilon: float = 1e-6) -> list[float]:
    """GRPO advantages: each reward minus its group's mean, divided by the group's standard deviation."""
    return sample_advantages(samples, "grpo", "group", epsilon)


def sample_advantages(
    samples: Sequence[TrainSample], estimator: Estimator = "grpo", scale: Scale = "group", epsilon: float = 1e-6
) -> list[float]:
    """The advantage of each sample by ``estimator`` (:mod:`bubblespec.advantages`)."""
    return compute_advantages([s.reward for s in samples], [s.group for s in samples], estimator, scale, epsilon)


def shaped_rewards(samples: Sequence[TrainSample], config: TrainerConfig) -> list[float]:
    """The task's rewards plus DAPO's soft overlong punishment (Yu et al. 2025): a response longer than
    ``max_response_tokens - overlong_buffer`` loses ``overlong_penalty`` times the share of the buffer it used."""
    if not config.overlong_buffer:
        return [s.reward for s in samples]
    rewards = []
    for sample in samples:
        if sample.max_response_tokens is None:
            raise ValueError("overlong_buffer needs each sample's max_response_tokens (the limit it was sampled with)")
        excess = len(sample.response_token_ids) - (sample.max_response_tokens - config.overlong_buffer)
        rewards.append(sample.reward - config.overlong_penalty * max(excess, 0) / config.overlong_buffer)
    return rewards


def filter_groups(samples: Sequence[TrainSample], rewards: Sequence[float], max_groups: int | None):
    """DAPO's dynamic-sampling filter: the samples (and rewards) of groups whose rewards are not all equal, the first
    ``max_groups`` such groups in order of first appearance; and the number of groups kept and dropped."""
    members: dict[int, list[int]] = {}
    for index, sample in enumerate(samples):
        members.setdefault(sample.group, []).append(index)
    informative = [g for g, rows in members.items() if len({rewards[i] for i in rows}) > 1]
    kept = set(informative[:max_groups] if max_groups is not None else informative)
    rows = [i for i, sample in enumerate(samples) if sample.group in kept]
    return [samples[i] for i in rows], [rewards[i] for i in rows], len(kept), len(members) - len(kept)


def loss_settings(config: TrainerConfig) -> LossSettings:
    return LossSettings(
        policy_loss=config.policy_loss,
        importance_ratio=config.importance_ratio,
        clip_low=config.clip_epsilon if config.clip_ratio_low is None else config.clip_ratio_low,
        clip_high=config.clip_epsilon if config.clip_ratio_high is None else config.clip_ratio_high,
        aggregation=config.loss_aggregation,
        kl_coef=config.kl_coef if config.kl_penalty == "loss" else 0.0,
        kl_estimator=config.kl_estimator,
        entropy_coef=config.entropy_coef,
    )


def lr_factor(config: TrainerConfig, optimizer_steps: int) -> float:
    """The learning rate of optimizer step ``optimizer_steps`` (0-based) as a share of ``learning_rate``: a linear
    warm-up over ``warmup_steps``, then constant, or a cosine decay to 0 at ``decay_steps``."""
    if optimizer_steps < config.warmup_steps:
        return (optimizer_steps + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (optimizer_steps - config.warmup_steps) / max(config.decay_steps - config.warmup_steps, 1))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class LearnerSpec:
    """What a learner is built from, and nothing else of a run's config: the model folder, the run's dtype, the
    ``trainer`` section and the rollout's sampling filters (the distribution the trainer scores)."""

    model_path: str
    dtype: str
    trainer: TrainerConfig
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def of_run(cls, config, model_path: str) -> LearnerSpec:
        sampling = config.rollout.sampling
        return cls(model_path, config.model.dtype, config.trainer, sampling.temperature, sampling.top_k, sampling.top_p)

    def build(self, all_reduce: Callable[..., None] | None = None) -> GRPOLearner:
        return GRPOLearner(self.model_path, self.dtype, self.trainer, self.temperature, all_reduce=all_reduce,
                           top_k=self.top_k, top_p=self.top_p)  # fmt: skip


class PeerFailed(RuntimeError):
    """Another data-parallel worker failed in this step; this one exchanged no gradient and took no step."""


SKIPPED_STEP = {
    "loss": 0.0, "grad_norm": 0.0, "mean_advantage_abs": 0.0, "trained_tokens": 0, "optimizer_steps": 0, "skipped": 1
}  # fmt: skip
"""The metrics of a step without reward signal (every group's rewards equal): no optimizer step is taken, and no
log-probabilities are computed, so the engine-trainer logprob agreement is not measured either."""

_SUMS = ("tokens", "ratio_sum", "clip_low", "clip_high", "kl_sum", "entropy_sum", "loss", "diff_sum", "diff_count")
_MAXIMA = ("ratio_max", "ratio_min", "diff_max")  # ratio_min is kept negated, so that every entry is a maximum


@dataclass
class _Before:
    """Log-probabilities of the policy before this step's updates, per sample index, response-aligned."""

    old: dict[int, torch.Tensor]
    ref: dict[int, torch.Tensor]


class GRPOLearner:
    """Holds the policy being trained, its optimizer and (with ``kl_coef``) a frozen reference model; one
    :meth:`step` per RL step.

    Precision. Adam updates *master weights* of dtype ``promote(dtype, float32)`` and keeps its state in that
    dtype: float32 in a bfloat16 run, where an update of lr 1e-6 is far below a bfloat16 weight's spacing
    (2^-8 relative) and would round away. Forward and backward run in the run's ``dtype`` on a copy of the
    master weights rounded to it, which are exactly the weights the engines receive (:meth:`state_dict`): the
    trainer scores the policy the engines sample from. Masks, advantages, log-probabilities and the loss are
    in the master dtype. In a float32 or float64 run the model's own weights are the master weights and
    nothing is copied.
    """

    def __init__(
        self,
        model_path: str,
        dtype: str,
        config: TrainerConfig,
        temperature: float,
        all_reduce: Callable[..., None] | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> None:
        self.dtype = DTYPES[dtype]
        self.master_dtype = torch.promote_types(self.dtype, torch.float32)
        # LoRA: the base stays in the run's dtype and frozen, the adapters train in float32 (no copy needed).
        single = self.master_dtype == self.dtype or config.lora is not None
        self.master = load_trainer_model(model_path, self.dtype if config.lora else self.master_dtype, config)
        self.parameters = self.master.trainable_parameters()
        if single:
            self.model, self._model_parameters = self.master, self.parameters
        else:
            self.model = load_trainer_model(model_path, self.dtype, config)
            self._model_parameters = self.model.trainable_parameters()
            assert [p.shape for p in self._model_parameters] == [p.shape for p in self.parameters]
        # The reference: the initial policy, frozen (no LoRA: the folder's weights are the initial policy).
        self.reference = None
        if config.kl_coef:
            self.reference = load_trainer_model(model_path, self.dtype, config.model_copy(update={"lora": None}))
        self.optimizer = torch.optim.AdamW(self.parameters, lr=config.learning_rate, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, functools.partial(lr_factor, config))
        self.config = config
        self.settings = loss_settings(config)
        self.temperature = temperature if temperature > 0 else 1.0
        # The rollout's filters, applied to the trainer's distribution with trainer.sampling_filters (not greedy).
        filtered = config.sampling_filters and temperature > 0 and (top_k > 0 or top_p < 1.0)
        self.filters = (top_k, top_p) if filtered else None
        self.all_reduce = all_reduce

    @property
    def has_master_copy(self) -> bool:
        """Whether the master weights are a more precise copy of the model's (a bfloat16 run)."""
        return self.model is not self.master

    def step(self, samples: Sequence[TrainSample], rank: int = 0, world: int = 1) -> dict[str, float]:
        """One RL step's updates on the whole batch ``samples``; with data parallelism each worker passes the same
        batch and its ``rank`` of ``world``, and computes every world-th sample of each mini-batch."""
        samples, config = list(samples), self.config
        rewards = shaped_rewards(samples, config)
        kept = {}
        if config.filter_groups:
            samples, rewards, groups_kept, groups_dropped = filter_groups(samples, rewards, config.train_prompts)
            kept = {"groups_kept": groups_kept, "groups_dropped": groups_dropped}
            if not samples:
                return dict(SKIPPED_STEP) | kept
        size = config.mini_batch_size or max(len(samples), 1)
        batches = [list(range(start, min(start + size, len(samples)))) for start in range(0, len(samples), size)]
        shares = [batch[rank::world] for batch in batches]
        owned = sorted(i for share in shares for i in share)
        penalised = bool(config.kl_coef) and config.kl_penalty == "reward"
        advantages = self._advantages(samples, rewards)
        if not penalised and not any(advantages):
            # Every group's rewards were equal: the gradient is zero, and an Adam step would still move the
            # weights by its momentum. Skip it (all workers decide alike: they all see the whole batch).
            return dict(SKIPPED_STEP) | kept
        self._copy_master_to_model()
        before = self._agreed(lambda: self._before_updates(samples, owned, len(batches)))
        if penalised:
            rewards = [
                r - config.kl_coef * p for r, p in zip(rewards, self._kl_penalties(samples, before), strict=True)
            ]
            advantages = self._advantages(samples, rewards)
        sums = torch.zeros(len(_SUMS), dtype=torch.float64)
        maxima = torch.full((len(_MAXIMA),), float("-inf"), dtype=torch.float64)
        if before.old:
            difference = self._logprob_difference(samples, owned, before.old)
            sums[_SUMS.index("diff_sum")], sums[_SUMS.index("diff_count")], maxima[_MAXIMA.index("diff_max")] = (
                difference
            )
        grad_norms, learning_rate = [], self.scheduler.get_last_lr()[0]
        for epoch in range(config.ppo_epochs):
            for batch, share in zip(batches, shares, strict=True):
                first = epoch == 0 and not before.old  # the logprobs of this pass are the old policy's
                stats = self._agreed(lambda b=batch, s=share, f=first: self.compute_gradients(
                    samples, advantages, b, s, before, measure_engine_agreement=f))  # fmt: skip
                sums += torch.stack([stats[name] for name in _SUMS]).to(torch.float64).cpu()
                maxima = maxima.maximum(torch.stack([stats[name] for name in _MAXIMA]).to(torch.float64).cpu())
                grad_norms.append(self.apply_gradients())
        return self._metrics(samples, advantages, sums, maxima, grad_norms, learning_rate) | kept

    def _advantages(self, samples: Sequence[TrainSample], rewards: Sequence[float]) -> list[float]:
        groups = [s.group for s in samples]
        return compute_advantages(rewards, groups, self.config.advantage, self.config.scale_rewards)

    def _metrics(self, samples, advantages, sums, maxima, grad_norms, learning_rate) -> dict[str, float]:
        """The step's metrics from the statistics summed (and maximised) over every worker's share."""
        if self.all_reduce is not None:  # every worker has agreed that none failed: these cannot hang
            self.all_reduce(sums)
            self.all_reduce(maxima, op="max")
        total = dict(zip(_SUMS, sums.tolist(), strict=True)) | dict(zip(_MAXIMA, maxima.tolist(), strict=True))
        tokens = max(total["tokens"], 1.0)
        metrics = {
            "loss": total["loss"] / len(grad_norms),
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "grad_norm_max": max(grad_norms),
            "learning_rate": learning_rate,
            "optimizer_steps": len(grad_norms),
            "mean_advantage_abs": sum(abs(a) for a in advantages) / max(len(advantages), 1),
            "trained_tokens": sum(self._lengths(samples, range(len(samples)))),
            "entropy": total["entropy_sum"] / tokens,
            "ratio_mean": total["ratio_sum"] / tokens,
            "ratio_max": total["ratio_max"],
            "ratio_min": -total["ratio_min"],
            "clip_fraction_low": total["clip_low"] / tokens,
            "clip_fraction_high": total["clip_high"] / tokens,
            "skipped": 0,
        }
        if self.reference is not None:
            metrics["kl"] = total["kl_sum"] / tokens
        if total["diff_count"]:
            metrics |= {
                "logprob_diff_mean": total["diff_sum"] / total["diff_count"],
                "logprob_diff_max": total["diff_max"],
            }
        return metrics

    def _agreed(self, compute: Callable[[], object]):
        """``compute()``; with data parallelism the workers then agree, by one all-reduce of a failure flag, that
        all of them succeeded before the next exchange. A worker that failed (a bad input, out of memory) would
        otherwise leave the others waiting in the gradient all-reduce for good. Raises :class:`PeerFailed` on
        the workers that did not fail themselves."""
        if self.all_reduce is None:
            return compute()
        try:
            result = compute()
        except Exception:
            self._any_worker_failed(failed=True)  # the peers learn of it and skip the step; the error goes on up
            raise
        if self._any_worker_failed(failed=False):
            raise PeerFailed("another trainer worker failed in this step; this one took no optimizer step")
        return result

    def _any_worker_failed(self, failed: bool) -> bool:
        flag = torch.tensor([1.0 if failed else 0.0], device=self.master.device)
        self.all_reduce(flag)
        return bool(flag.item() > 0)

    def _before_updates(self, samples: Sequence[TrainSample], owned: Sequence[int], num_batches: int) -> _Before:
        """The old policy's log-probabilities of the owned samples when the updates need them (more than one
        optimizer step, truncated importance sampling, a KL reward penalty) and the trainer computes them, and the
        reference model's when there is a KL term."""
        config = self.config
        needs_old = config.old_logprobs == "trainer" and (
            config.ppo_epochs * num_batches > 1 or config.tis_cap is not None or config.kl_penalty == "reward"
        )
        before = _Before({}, {})
        if not needs_old and self.reference is None:
            return before
        size = config.micro_batch_size or max(len(owned), 1)
        with torch.no_grad():
            for start in range(0, len(owned), size):
                rows = list(owned[start : start + size])
                part = [samples[i] for i in rows]
                if needs_old:
                    old = self._response_logprobs(self.model, part)[0]
                    before.old |= {i: old[row, : len(samples[i].response_token_ids)] for row, i in enumerate(rows)}
                if self.reference is not None:
                    ref = self._response_logprobs(self.reference, part)[0]
                    before.ref |= {i: ref[row, : len(samples[i].response_token_ids)] for row, i in enumerate(rows)}
        return before

    def _kl_penalties(self, samples: Sequence[TrainSample], before: _Before) -> list[float]:
        """Per response: the sum over its tokens of KL(old || ref), summed across workers (each has its own)."""
        penalties = torch.zeros(len(samples), dtype=torch.float64)
        for i, ref in before.ref.items():
            old = before.old.get(i)
            if old is None:  # old_logprobs "engine"
                old = self._engine_logprobs(samples[i]).to(ref.device)
            penalties[i] = float(kl_divergence(old, ref, self.config.kl_estimator).sum())
        if self.all_reduce is not None:
            self.all_reduce(penalties)
        return penalties.tolist()

    def _lengths(self, samples: Sequence[TrainSample], indices) -> list[int]:
        """Trained response tokens per sample: 0 for a truncated one under ``mask_truncated``."""
        masked = self.config.mask_truncated
        return [0 if masked and samples[i].truncated else len(samples[i].response_token_ids) for i in indices]

    def compute_gradients(
        self,
        samples: Sequence[TrainSample],
        advantages: Sequence[float],
        batch: Sequence[int] | None = None,
        share: Sequence[int] | None = None,
        before: _Before | None = None,
        measure_engine_agreement: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Sets the master weights' gradients to those of this worker's ``share`` of the mini-batch ``batch``'s
        loss (indices into ``samples``; both default to all of them), not yet reduced across workers. Returns the
        share's statistics (:func:`bubblespec.policy_loss.policy_loss`) and ``loss``, and, with
        ``measure_engine_agreement``, the sum/count/max of |engine logprob - trainer logprob|."""
        config, before = self.config, before or _Before({}, {})
        batch = list(range(len(samples))) if batch is None else list(batch)
        share = batch if share is None else list(share)
        lengths = self._lengths(samples, batch)
        normaliser = aggregation_normaliser(config.loss_aggregation, lengths)
        token_normaliser = float(max(sum(lengths), 1))
        norm_tokens = None
        if config.loss_aggregation == "seq-mean-token-sum-norm":
            norm_tokens = config.loss_norm_tokens or max(samples[i].max_response_tokens or 0 for i in batch)
            if not norm_tokens:
                raise ValueError("seq-mean-token-sum-norm needs trainer.loss_norm_tokens or the samples' token limit")
        self._copy_master_to_model()
        self.optimizer.zero_grad(set_to_none=False)
        size = config.micro_batch_size or max(len(share), 1)
        totals: dict[str, torch.Tensor] = {}
        for start in range(0, len(share), size):  # gradients accumulate over micro-batches
            rows = share[start : start + size]
            stats = self._backward(samples, rows, advantages, before, normaliser, token_normaliser, norm_tokens,
                                   measure_engine_agreement)  # fmt: skip
            for name, value in stats.items():
                if name in totals:
                    totals[name] = totals[name].maximum(value) if name in _MAXIMA else totals[name] + value
                else:
                    totals[name] = value
        if not share:
            zero = torch.zeros((), dtype=torch.float64)
            totals = {name: zero for name in _SUMS} | {name: zero - math.inf for name in _MAXIMA}
        self._gradients_to_master()
        return totals

    def _backward(self, samples, rows, advantages, before, normaliser, token_normaliser, norm_tokens, measure):
        """Back-propagates one micro-batch's share of the loss; returns its statistics."""
        part = [samples[i] for i in rows]
        wants_entropy_gradient = bool(self.config.entropy_coef)
        logprobs_BR, entropy_BR = self._response_logprobs(self.model, part, wants_entropy_gradient)
        mask_BR = self._mask(part, logprobs_BR.shape[1], self._lengths(samples, rows))
        advantages_B = torch.tensor([advantages[i] for i in rows], dtype=self.master_dtype, device=logprobs_BR.device)
        engine_BR = None
        if self.config.old_logprobs == "engine" or self.config.tis_cap is not None:
            engine_BR = self._place(part, [self._engine_logprobs(s) for s in part], logprobs_BR)
        if self.config.old_logprobs == "engine":
            old_BR = engine_BR
        elif before.old:
            old_BR = self._place(part, [before.old[i] for i in rows], logprobs_BR)
        else:
            old_BR = logprobs_BR.detach()  # one update per step: the old policy is the current one
        ref_BR = self._place(part, [before.ref[i] for i in rows], logprobs_BR) if before.ref else None
        is_weights_BR = None
        if self.config.tis_cap is not None:
            is_weights_BR = torch.exp(old_BR - engine_BR).clamp(max=self.config.tis_cap) * mask_BR
        loss, stats = policy_loss(logprobs_BR, old_BR, advantages_B, mask_BR, self.settings, normaliser,
                                  token_normaliser, norm_tokens, ref_BR, is_weights_BR, entropy_BR)  # fmt: skip
        loss.backward()
        stats = {name: value.detach().to(torch.float64).cpu() for name, value in stats.items()}
        stats["ratio_min"] = -stats["ratio_min"]
        stats["loss"] = loss.detach().to(torch.float64).cpu()
        zero = torch.zeros((), dtype=torch.float64)
        stats |= {"diff_sum": zero, "diff_count": zero, "diff_max": zero - math.inf}
        if measure:
            responses = {
                i: logprobs_BR[row, : len(samples[i].response_token_ids)].detach() for row, i in enumerate(rows)
            }
            stats["diff_sum"], stats["diff_count"], stats["diff_max"] = self._logprob_difference(
                samples, rows, responses
            )
        return stats

    def _engine_logprobs(self, sample: TrainSample) -> torch.Tensor:
        if not sample.engine_logprobs or len(sample.engine_logprobs) != len(sample.response_token_ids):
            raise ValueError(
                "old_logprobs: engine and tis_cap need the rollout engine's logprob of every response token"
            )
        return torch.tensor(sample.engine_logprobs, dtype=self.master_dtype)

    def _logprob_difference(self, samples, rows, logprobs: dict[int, torch.Tensor]):
        """Sum, count and max of |engine - trainer| over the response tokens of the ``rows`` with engine logprobs."""
        differences = [
            (logprobs[i].to(torch.float64).cpu() - torch.tensor(samples[i].engine_logprobs, dtype=torch.float64)).abs()
            for i in rows
            if samples[i].engine_logprobs
        ]
        if not differences:
            zero = torch.zeros((), dtype=torch.float64)
            return zero, zero, zero - math.inf
        flat = torch.cat(differences)
        return flat.sum(), torch.tensor(float(len(flat)), dtype=torch.float64), flat.max()

    @torch.no_grad()
    def response_logprobs(self, samples: Sequence[TrainSample]) -> list[torch.Tensor]:
        """The current policy's log-probability of each response token, per sample (master dtype)."""
        self._copy_master_to_model()
        logprobs_BR = self._response_logprobs(self.model, samples)[0]
        return [logprobs_BR[row, : len(s.response_token_ids)] for row, s in enumerate(samples)]

    def _tokens(self, samples: Sequence[TrainSample]) -> torch.Tensor:
        """Right-padded prompt + response tokens [B, W] (W >= 2)."""
        width = max([len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples] + [2])
        tokens = torch.zeros(len(samples), width, dtype=torch.int64)
        for row, sample in enumerate(samples):
            sequence = sample.prompt_token_ids + sample.response_token_ids
            tokens[row, : len(sequence)] = torch.tensor(sequence)
        return tokens

    def _response_logprobs(
        self, model, samples: Sequence[TrainSample], entropy_gradient: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities [B, R] of each response token under the sampling temperature and the entropy [B, R]
        of the distribution it was drawn from, in the master dtype (the forward pass runs in the run's dtype); R is
        the longest response, positions past a response's end hold padding. The entropy has a gradient only with
        ``entropy_gradient``."""
        tokens_BW = self._tokens(samples)
        positions_BW = torch.arange(tokens_BW.shape[1]).expand_as(tokens_BW)
        logits_BWV = model.forward(tokens_BW.to(model.device), positions_BW.to(model.device))
        width = max([len(s.response_token_ids) for s in samples] + [1])
        starts_B = torch.tensor([len(s.prompt_token_ids) - 1 for s in samples])  # logits at i predict token i + 1
        index_BR = (starts_B[:, None] + torch.arange(width)[None]).clamp(max=tokens_BW.shape[1] - 2)
        index_BR = index_BR.to(logits_BWV.device)
        logits_BRV = logits_BWV.gather(1, index_BR[..., None].expand(-1, -1, logits_BWV.shape[-1]))
        scores_BRV = logits_BRV.to(self.master_dtype) / self.temperature
        if self.filters is not None:  # the tokens the rollout's top-k / top-p kept, exactly as sampling decides them
            scores_BRV = scores_BRV.masked_fill(~self._kept(logits_BRV.detach()), float("-inf"))
        logprobs_BRV = torch.log_softmax(scores_BRV, dim=-1)
        targets_BR = tokens_BW.to(logits_BWV.device).gather(1, index_BR + 1)
        logprobs_BR = logprobs_BRV.gather(-1, targets_BR[..., None]).squeeze(-1)
        source_BRV = logprobs_BRV if entropy_gradient else logprobs_BRV.detach()
        plogp_BRV = source_BRV.exp() * source_BRV
        if self.filters is not None:
            plogp_BRV = plogp_BRV.masked_fill(torch.isinf(source_BRV), 0.0)  # 0 * log 0 = 0, not NaN
        return logprobs_BR, -plogp_BRV.sum(-1)

    def _kept(self, logits_BRV: torch.Tensor) -> torch.Tensor:
        """[B, R, V] True where the rollout's top-k / top-p keep a token (:func:`bubblespec.sampling.mask_logits`)."""
        from bubblespec.sampling import mask_logits

        top_k, top_p = self.filters
        rows = logits_BRV.shape[0]
        temperature_B = torch.full((rows,), self.temperature, dtype=torch.float64)
        top_k_B, top_p_B = torch.full((rows,), top_k), torch.full((rows,), top_p, dtype=torch.float64)
        return torch.isfinite(mask_logits(logits_BRV, temperature_B, top_k_B, top_p_B))

    def _mask(self, samples: Sequence[TrainSample], width: int, lengths: Sequence[int]) -> torch.Tensor:
        """[B, R] ones on the trained response tokens, in the master dtype (a bfloat16 mask of 1,001 ones would
        sum to 1,000)."""
        mask = torch.zeros(len(samples), width, dtype=self.master_dtype)
        for row, length in enumerate(lengths):
            mask[row, :length] = 1
        return mask.to(self.master.device)

    def _place(self, samples, values: Sequence[torch.Tensor], like_BR: torch.Tensor) -> torch.Tensor:
        """Per-response values as a [B, R] tensor like ``like_BR`` (zeros past each response's end)."""
        placed = torch.zeros_like(like_BR, requires_grad=False)
        for row, value in enumerate(values):
            placed[row, : len(value)] = value.to(placed.dtype)
        return placed

    def apply_gradients(self) -> float:
        """Sums the gradients across workers (``all_reduce``), clips their norm to ``max_grad_norm`` and takes
        one Adam step on the master weights. Returns the gradient norm before clipping."""
        if self.all_reduce is not None:
            for parameter in self.parameters:
                self.all_reduce(parameter.grad)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters, self.config.max_grad_norm or float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        return float(grad_norm)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights engines receive, by Hugging Face name: the master weights rounded to the run's dtype."""
        return {name: tensor.to(self.dtype) for name, tensor in self.master.state_dict().items()}

    def checkpoint_state(self) -> dict:
        """The optimizer state; in a bfloat16 run also ``master_weights`` (float32), which a checkpoint saves as
        its weights so that a resumed run continues exactly."""
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.has_master_copy:
            state["master_weights"] = self.master.state_dict()
        if self.config.lora is not None:  # the base never changes: the adapters are the trained state
            state["adapters"] = self.master.adapter_state()
        return state

    def load_checkpoint_state(self, state: dict) -> None:
        """``state``: a :meth:`checkpoint_state` plus the checkpoint's ``weights`` (master weights, or weights
        in the run's dtype from an older checkpoint). Under LoRA the weights are merged ones, for the engines; the
        learner keeps its base (the model folder's, never trained) and takes the adapters."""
        if "adapters" in state:
            self.master.load_adapter_state(state["adapters"])
        else:
            self.master.load_weights(state["weights"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:  # checkpoints written before schedules existed: constant, nothing to restore
            self.scheduler.load_state_dict(state["scheduler"])

    def _copy_master_to_model(self) -> None:
        if self.has_master_copy:
            with torch.no_grad():
                for weight, master in zip(self._model_parameters, self.parameters, strict=True):
                    weight.copy_(master)

    def _gradients_to_master(self) -> None:
        """Every master weight gets a gradient (zeros where the loss did not reach it), in the master dtype."""
        for master, weight in zip(self.parameters, self._model_parameters, strict=True):
            if weight is master:
                if master.grad is None:
                    master.grad = torch.zeros_like(master)
                continue
            master.grad = torch.zeros_like(master) if weight.grad is None else weight.grad.to(self.master_dtype)
            weight.grad = None
