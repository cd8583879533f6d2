"""The learner: PPO-style updates (:mod:`bubblespec.rl.policy_loss`) on GRPO-family advantages
(:mod:`bubblespec.rl.advantages`), training the built-in decoder or a transformers model
(:mod:`bubblespec.rl.trainer_models`), on a batch prepared by :mod:`bubblespec.rl.train_batch`, scoring responses with
:mod:`bubblespec.rl.logprobs`.

One RL step (:meth:`GRPOLearner.step`)::

    check       the batch's inputs (finite rewards, one engine logprob per response token): every worker gets the
                whole batch, so all of them refuse a bad one alike, before any work or exchange
    rewards     task rewards, plus DAPO's overlong shaping and, with kl.penalty "reward", - kl.coef * KL(old || ref)
    filter      with dapo.filter_groups (dynamic sampling): only groups whose task rewards differ, train_prompts at
                most (on accuracy, not on the length-shaped rewards)
    advantages  from the whole batch's rewards; a batch whose loss has no gradient (no reward signal, no KL or
                entropy term) takes no step
    before      with more than one update per step, truncated importance sampling or a KL penalty: the old policy's
                log-probabilities (and the frozen reference model's), once, without gradient; the engine-trainer
                logprob agreement is measured here too, before any update
    updates     ppo_epochs x mini-batches of mini_batch_size samples, one optimizer step each, gradients accumulated
                over micro-batches (micro_batch_size samples, micro_batch_tokens padded tokens); a loss or gradient
                that is not finite is an error (:class:`~bubblespec.core.errors.NonFiniteError`) and no optimizer
                step is taken with it
    schedule    the learning rate moves once per RL step (warmup_steps and decay_steps count RL steps)

The learner is plain torch and knows nothing of Ray: the controller runs it in-process (virtual clock, tests) or
inside Ray Train workers (:mod:`bubblespec.rl.ray_train`). Every worker gets the whole batch and computes its share of
each mini-batch (every world-th sample); ``all_reduce`` sums gradients and statistics, so that the workers' updates
are the updates of one learner on the whole batch. Every tensor the learner exchanges lives on its device (an NCCL
group takes CUDA tensors only), and everything that can fail on one worker alone runs inside the failure agreement
(:meth:`GRPOLearner._agreed`), so that no worker waits in a collective for a peer that raised. Training sees only
the samples of the current step (invariant 1): a batch is built from rollout results, never from drafts.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bubblespec.core.config import ClipLoss, ConstantLR, TrainerConfig
from bubblespec.core.errors import NonFiniteError
from bubblespec.core.interfaces import SamplingParams
from bubblespec.models.decoder import DTYPES
from bubblespec.rl.advantages import compute_advantages
from bubblespec.rl.logprobs import padded_tokens, placed, response_logprobs, response_mask
from bubblespec.rl.policy_loss import LossSettings, aggregation_normaliser, kl_divergence, policy_loss
from bubblespec.rl.train_batch import (  # the batch's types and steps, importable from here too
    TrainSample,
    check_samples,
    filter_groups,
    group_advantages,
    micro_batches,
    sample_advantages,
    shaped_rewards,
)
from bubblespec.rl.trainer_models import load_trainer_model

__all__ = [
    "GRPOLearner", "LearnerSpec", "PeerFailed", "TrainSample", "check_samples", "filter_groups", "group_advantages",
    "lr_factor", "sample_advantages", "shaped_rewards",
]  # fmt: skip


def loss_settings(config: TrainerConfig) -> LossSettings:
    loss, policy, kl = config.loss, config.loss.policy, config.kl
    clip = isinstance(policy, ClipLoss)
    return LossSettings(
        policy_loss=policy.kind,
        importance_ratio=policy.importance_ratio if clip else "token",
        clip_low=policy.low if clip else LossSettings.clip_low,
        clip_high=policy.high if clip else policy.clip_ratio_high,
        aggregation=loss.aggregation,
        kl_coef=kl.coef if kl.penalty == "loss" else 0.0,
        kl_estimator=kl.estimator,
        entropy_coef=loss.entropy_coef,
    )


def lr_factor(config: TrainerConfig, rl_steps: int) -> float:
    """The learning rate of RL step ``rl_steps`` (0-based; every optimizer step of an RL step has it) as a share of
    ``learning_rate``: a linear warm-up over ``warmup_steps``, then constant, or a cosine decay to 0 at
    ``decay_steps``. Steps without an update (no reward signal) count too, so that ``decay_steps: num_steps`` ends
    the decay with the run."""
    schedule = config.optimizer.schedule
    if rl_steps < schedule.warmup_steps:
        return (rl_steps + 1) / schedule.warmup_steps
    if isinstance(schedule, ConstantLR):
        return 1.0
    progress = min(1.0, (rl_steps - schedule.warmup_steps) / max(schedule.decay_steps - schedule.warmup_steps, 1))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class LearnerSpec:
    """What a learner is built from, and nothing else of a run's config: the model folder, the run's dtype, the
    ``trainer`` section and the rollout's sampling (the distribution the trainer scores)."""

    model_path: str
    dtype: str
    trainer: TrainerConfig
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    suppressed_token_ids: tuple[int, ...] = ()

    @classmethod
    def of_run(cls, config, model_path: str, sampling: SamplingParams) -> LearnerSpec:
        """The learner of a run whose rollout samples with ``sampling`` (the task's suppressed tokens resolved)."""
        return cls(model_path, config.model.dtype, config.trainer, sampling.temperature, sampling.top_k,
                   sampling.top_p, sampling.suppressed_token_ids)  # fmt: skip

    def build(self, all_reduce: Callable[..., None] | None = None) -> GRPOLearner:
        return GRPOLearner(self.model_path, self.dtype, self.trainer, self.temperature, all_reduce=all_reduce,
                           top_k=self.top_k, top_p=self.top_p,
                           suppressed_token_ids=self.suppressed_token_ids)  # fmt: skip


def _place_name(at_step: int | None, epoch: int, num_epochs: int, number: int, num_batches: int) -> str:
    """Where an update is, for error messages: "step 3, epoch 1 of 2, mini-batch 2 of 4"."""
    parts = [f"step {at_step}"] if at_step is not None else []
    if num_epochs > 1:
        parts.append(f"epoch {epoch + 1} of {num_epochs}")
    if num_batches > 1:
        parts.append(f"mini-batch {number + 1} of {num_batches}")
    return ", ".join(parts) or "this step"


class PeerFailed(RuntimeError):
    """Another data-parallel worker failed in this step; this one exchanged no gradient and took no step."""


SKIPPED_STEP = {
    "loss": 0.0, "grad_norm": 0.0, "mean_advantage_abs": 0.0, "trained_tokens": 0, "optimizer_steps": 0, "skipped": 1
}  # fmt: skip
"""The metrics of a step whose loss has no gradient (every group's rewards equal, no KL or entropy term): no
optimizer step is taken, and no log-probabilities are computed, so the engine-trainer logprob agreement is not
measured either."""

_SUMS = ("tokens", "ratio_sum", "clip_low", "clip_high", "kl_sum", "entropy_sum", "loss", "diff_sum", "diff_count")
_MAXIMA = ("ratio_max", "ratio_min", "diff_max")  # ratio_min is kept negated, so that every entry is a maximum


@dataclass
class _Before:
    """What the learner computes before this step's updates, for the samples this worker owns: log-probabilities
    of the old policy and of the reference (per sample index, response-aligned), the KL reward penalties [N] (0 for
    samples of other workers), and the engine-trainer logprob difference (sum, count, max)."""

    old: dict[int, torch.Tensor]
    ref: dict[int, torch.Tensor]
    penalties: torch.Tensor | None = None
    difference: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class GRPOLearner:
    """Holds the policy being trained, its optimizer and (with ``kl.coef``) a frozen reference model; one
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
        suppressed_token_ids: Sequence[int] = (),
    ) -> None:
        self.dtype = DTYPES[dtype]
        self.master_dtype = torch.promote_types(self.dtype, torch.float32)
        # LoRA: the base stays in the run's dtype and frozen, the adapters train in float32 (no copy needed).
        single = self.master_dtype == self.dtype or config.lora is not None
        self.master = load_trainer_model(
            model_path, self.dtype if config.lora else self.master_dtype, config.model, config.device
        )
        self.device = torch.device(self.master.device)
        self.parameters = self.master.trainable_parameters()
        if single:
            self.model, self._model_parameters = self.master, self.parameters
        else:
            self.model = load_trainer_model(model_path, self.dtype, config.model, config.device)
            self._model_parameters = self.model.trainable_parameters()
            assert [p.shape for p in self._model_parameters] == [p.shape for p in self.parameters]
        # The reference: the initial policy, frozen (no LoRA: the folder's weights are the initial policy).
        self.reference = None
        if config.kl.coef:
            plain = config.model.model_copy(update={"lora": None}) if config.lora else config.model
            self.reference = load_trainer_model(model_path, self.dtype, plain, config.device)
        optimizer = config.optimizer
        self.optimizer = torch.optim.AdamW(
            self.parameters, lr=optimizer.learning_rate, weight_decay=optimizer.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, functools.partial(lr_factor, config))
        self.config = config
        self.settings = loss_settings(config)
        self.temperature = temperature if temperature > 0 else 1.0
        # The rollout's filters, applied to the trainer's distribution with trainer.loss.sampling_filters (not greedy).
        filtered = config.loss.sampling_filters and temperature > 0 and (top_k > 0 or top_p < 1.0)
        self.filters = (top_k, top_p) if filtered else None
        self.suppressed = tuple(suppressed_token_ids)  # never sampled: out of the trainer's distribution, always
        self.all_reduce = all_reduce

    @property
    def has_master_copy(self) -> bool:
        """Whether the master weights are a more precise copy of the model's (a bfloat16 run)."""
        return self.model is not self.master

    def step(
        self, samples: Sequence[TrainSample], rank: int = 0, world: int = 1, at_step: int | None = None
    ) -> dict[str, float]:
        """One RL step's updates on the whole batch ``samples``; with data parallelism each worker passes the same
        batch and its ``rank`` of ``world``, and computes every world-th sample of each mini-batch. ``at_step``: the
        run's step, for error messages."""
        samples, config = list(samples), self.config
        check_samples(samples, config)
        rewards = shaped_rewards(samples, config)
        kept = {}
        if config.dapo.filter_groups:
            samples, rewards, groups_kept, groups_dropped = filter_groups(samples, rewards, config.dapo.train_prompts)
            kept = {"groups_kept": groups_kept, "groups_dropped": groups_dropped}
        size = config.mini_batch_size or max(len(samples), 1)
        batches = [list(range(start, min(start + size, len(samples)))) for start in range(0, len(samples), size)]
        shares = [batch[rank::world] for batch in batches]
        owned = sorted(i for share in shares for i in share)
        penalised = bool(config.kl.coef) and config.kl.penalty == "reward"
        advantages = self._advantages(samples, rewards)
        if not samples or not (penalised or self._has_gradient(advantages)):
            # The loss is 0 with a zero gradient, and an Adam step would still move the weights by its momentum.
            return self._skipped() | kept  # all workers decide alike: they all see the whole batch
        self._copy_master_to_model()
        num_updates = config.ppo_epochs * len(batches)
        before = self._agreed(lambda: self._before_updates(samples, owned, num_updates))
        if penalised:
            if self.all_reduce is not None:  # every worker has agreed that none failed: this cannot hang
                self.all_reduce(before.penalties)
            rewards = [r - config.kl.coef * p for r, p in zip(rewards, before.penalties.tolist(), strict=True)]
            advantages = self._advantages(samples, rewards)
            if not self._has_gradient(advantages):
                return self._skipped() | kept
        sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=self.device)
        maxima = torch.full((len(_MAXIMA),), float("-inf"), dtype=torch.float64, device=self.device)
        if before.difference is not None:
            diff_sum, diff_count, diff_max = before.difference
            sums[_SUMS.index("diff_sum")], sums[_SUMS.index("diff_count")] = diff_sum, diff_count
            maxima[_MAXIMA.index("diff_max")] = diff_max
        grad_norms, learning_rate = [], self.scheduler.get_last_lr()[0]
        for epoch in range(config.ppo_epochs):
            for number, (batch, share) in enumerate(zip(batches, shares, strict=True)):
                where = _place_name(at_step, epoch, config.ppo_epochs, number, len(batches))
                measure = num_updates == 1  # this pass is before the update (with more, _before_updates measured)
                stats = self._agreed(lambda b=batch, s=share, m=measure, w=where: self.compute_gradients(
                    samples, advantages, b, s, before, measure_engine_agreement=m, where=w))  # fmt: skip
                sums += torch.stack([stats[name] for name in _SUMS])
                maxima = maxima.maximum(torch.stack([stats[name] for name in _MAXIMA]))
                grad_norms.append(self.apply_gradients(where))
        self.scheduler.step()
        return self._metrics(samples, advantages, sums, maxima, grad_norms, learning_rate) | kept

    def _has_gradient(self, advantages: Sequence[float]) -> bool:
        """Whether the loss can have a gradient: some advantage is not 0 (advantages of groups whose rewards are all
        equal are exactly 0), or a KL term in the loss or an entropy bonus pulls the policy regardless."""
        return any(advantages) or bool(self.settings.kl_coef) or bool(self.config.loss.entropy_coef)

    def _skipped(self) -> dict[str, float]:
        with warnings.catch_warnings():  # torch warns when a schedule moves before any optimizer step: here it must
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()` before"), UserWarning)
            self.scheduler.step()  # the schedule counts RL steps, with or without an update
        return dict(SKIPPED_STEP)

    def _advantages(self, samples: Sequence[TrainSample], rewards: Sequence[float]) -> list[float]:
        groups = [s.group for s in samples]
        return compute_advantages(rewards, groups, self.config.loss.advantage, self.config.loss.scale_rewards)

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
        flag = torch.tensor([1.0 if failed else 0.0], device=self.device)
        self.all_reduce(flag)
        return bool(flag.item() > 0)

    def _before_updates(self, samples: Sequence[TrainSample], owned: Sequence[int], num_updates: int) -> _Before:
        """For the owned samples, before any update: the old policy's log-probabilities when the updates need them
        and the trainer computes them (more than one optimizer step, truncated importance sampling, a KL reward
        penalty), the reference model's when there is a KL term, the KL reward penalties, and the engine-trainer
        logprob difference when there is more than one update (with one, its own pass measures it)."""
        config = self.config
        needs_old = config.loss.old_logprobs == "trainer" and (
            num_updates > 1 or config.loss.tis_cap is not None or config.kl.penalty == "reward"
        )
        measure = num_updates > 1 and any(samples[i].engine_logprobs for i in owned)
        before = _Before({}, {})
        if needs_old or measure or self.reference is not None:
            current: dict[int, torch.Tensor] = {}
            with torch.no_grad():
                for rows in self._micro_batches(samples, owned):
                    if needs_old or measure:
                        current |= self._logprobs_of(self.model, samples, rows)
                    if self.reference is not None:
                        before.ref |= self._logprobs_of(self.reference, samples, rows)
            before.old = current if needs_old else {}
            if num_updates > 1:
                before.difference = self._logprob_difference(samples, owned, current)
        if config.kl.coef and config.kl.penalty == "reward":
            before.penalties = self._kl_penalties(samples, before)
        return before

    def _logprobs_of(self, model, samples: Sequence[TrainSample], rows: Sequence[int]) -> dict[int, torch.Tensor]:
        logprobs_BR = self._response_logprobs(model, [samples[i] for i in rows])[0]
        return {i: logprobs_BR[row, : len(samples[i].response_token_ids)] for row, i in enumerate(rows)}

    def _kl_penalties(self, samples: Sequence[TrainSample], before: _Before) -> torch.Tensor:
        """Per response [N]: the sum over its tokens of KL(old || ref) for the samples this worker owns, 0 for the
        others (the workers' penalties are summed)."""
        penalties = torch.zeros(len(samples), dtype=torch.float64, device=self.device)
        for i, ref in before.ref.items():
            old = before.old.get(i)
            if old is None:  # old_logprobs "engine"
                old = self._engine_logprobs(samples[i])
            penalties[i] = kl_divergence(old, ref, self.config.kl.estimator).sum()
        return penalties

    def _micro_batches(self, samples: Sequence[TrainSample], rows: Sequence[int]) -> list[list[int]]:
        """``rows`` in forward/backward passes: :func:`~bubblespec.rl.train_batch.micro_batches`."""
        lengths = [len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples]
        return micro_batches(rows, lengths, self.config.micro_batch_size, self.config.micro_batch_tokens)

    def _lengths(self, samples: Sequence[TrainSample], indices) -> list[int]:
        """Trained response tokens per sample: 0 for a truncated one under ``mask_truncated``."""
        masked = self.config.dapo.mask_truncated
        return [0 if masked and samples[i].truncated else len(samples[i].response_token_ids) for i in indices]

    def compute_gradients(
        self,
        samples: Sequence[TrainSample],
        advantages: Sequence[float],
        batch: Sequence[int] | None = None,
        share: Sequence[int] | None = None,
        before: _Before | None = None,
        measure_engine_agreement: bool = True,
        where: str = "this update",
    ) -> dict[str, torch.Tensor]:
        """Sets the master weights' gradients to those of this worker's ``share`` of the mini-batch ``batch``'s
        loss (indices into ``samples``; both default to all of them), not yet reduced across workers. Returns the
        share's statistics (:func:`bubblespec.rl.policy_loss.policy_loss`) and ``loss`` as float64 tensors on the
        learner's device, and, with ``measure_engine_agreement``, the sum/count/max of |engine logprob - trainer
        logprob|. Raises :class:`~bubblespec.core.errors.NonFiniteError` (naming ``where``) for a loss that is not a
        finite number. The samples are :func:`check_samples`' (:meth:`step` checks them once per step)."""
        config, before = self.config, before or _Before({}, {})
        batch = list(range(len(samples))) if batch is None else list(batch)
        share = batch if share is None else list(share)
        lengths = self._lengths(samples, batch)
        normaliser = aggregation_normaliser(config.loss.aggregation, lengths)
        token_normaliser = float(max(sum(lengths), 1))
        norm_tokens = None
        if config.loss.aggregation == "seq-mean-token-sum-norm":
            norm_tokens = config.loss.norm_tokens or max(samples[i].max_response_tokens or 0 for i in batch)
            if not norm_tokens:
                raise ValueError("seq-mean-token-sum-norm needs trainer.loss.norm_tokens or the samples' token limit")
        self._copy_master_to_model()
        self.optimizer.zero_grad(set_to_none=False)
        totals = self._no_statistics()
        for rows in self._micro_batches(samples, share):  # gradients accumulate over micro-batches
            stats = self._backward(samples, rows, advantages, before, normaliser, token_normaliser, norm_tokens,
                                   measure_engine_agreement, where)  # fmt: skip
            for name, value in stats.items():
                totals[name] = totals[name].maximum(value) if name in _MAXIMA else totals[name] + value
        self._gradients_to_master()
        return totals

    def _no_statistics(self) -> dict[str, torch.Tensor]:
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        return {name: zero for name in _SUMS} | {name: zero - math.inf for name in _MAXIMA}

    def _backward(self, samples, rows, advantages, before, normaliser, token_normaliser, norm_tokens, measure, where):
        """Back-propagates one micro-batch's share of the loss; returns its statistics."""
        part = [samples[i] for i in rows]
        wants_entropy_gradient = bool(self.config.loss.entropy_coef)
        logprobs_BR, entropy_BR = self._response_logprobs(self.model, part, wants_entropy_gradient)
        mask_BR = response_mask(self._lengths(samples, rows), logprobs_BR.shape[1], self.master_dtype, self.device)
        advantages_B = torch.tensor([advantages[i] for i in rows], dtype=self.master_dtype, device=self.device)
        engine_BR = None
        if self.config.loss.old_logprobs == "engine" or self.config.loss.tis_cap is not None:
            engine_BR = placed([self._engine_logprobs(s) for s in part], logprobs_BR)
        if self.config.loss.old_logprobs == "engine":
            old_BR = engine_BR
        elif before.old:
            old_BR = placed([before.old[i] for i in rows], logprobs_BR)
        else:
            old_BR = logprobs_BR.detach()  # one update per step: the old policy is the current one
        ref_BR = placed([before.ref[i] for i in rows], logprobs_BR) if before.ref else None
        is_weights_BR = None
        if self.config.loss.tis_cap is not None:
            is_weights_BR = torch.exp(old_BR - engine_BR).clamp(max=self.config.loss.tis_cap) * mask_BR
        loss, stats = policy_loss(logprobs_BR, old_BR, advantages_B, mask_BR, self.settings, normaliser,
                                  token_normaliser, norm_tokens, ref_BR, is_weights_BR, entropy_BR)  # fmt: skip
        if not torch.isfinite(loss):
            raise NonFiniteError(
                f"{where}: the loss of samples {list(rows)} is {loss.item()} (not a finite number); no optimizer step "
                "was taken with it"
            )
        loss.backward()
        stats = {name: value.detach().to(torch.float64) for name, value in stats.items()}
        stats["ratio_min"] = -stats["ratio_min"]
        stats["loss"] = loss.detach().to(torch.float64)
        if measure:
            responses = {
                i: logprobs_BR[row, : len(samples[i].response_token_ids)].detach() for row, i in enumerate(rows)
            }
            stats["diff_sum"], stats["diff_count"], stats["diff_max"] = self._logprob_difference(
                samples, rows, responses
            )
        return stats

    def _engine_logprobs(self, sample: TrainSample) -> torch.Tensor:
        """The engine's logprobs of a sample's response tokens (:func:`check_samples` has checked them)."""
        return torch.tensor(sample.engine_logprobs or (), dtype=self.master_dtype, device=self.device)

    def _logprob_difference(self, samples, rows, logprobs: dict[int, torch.Tensor]):
        """Sum, count and max of |engine - trainer| over the response tokens of the ``rows`` with engine logprobs,
        as float64 tensors on the learner's device."""
        with_engine = [i for i in rows if samples[i].engine_logprobs]
        if not with_engine:
            zero = torch.zeros((), dtype=torch.float64, device=self.device)
            return zero, zero, zero - math.inf
        engine = torch.cat([self._engine_logprobs(samples[i]).to(torch.float64) for i in with_engine])
        trainer = torch.cat([logprobs[i].to(torch.float64) for i in with_engine])
        difference = (trainer - engine).abs()
        return difference.sum(), difference.new_tensor(float(len(difference))), difference.max()

    @torch.no_grad()
    def response_logprobs(self, samples: Sequence[TrainSample]) -> list[torch.Tensor]:
        """The current policy's log-probability of each response token, per sample (master dtype)."""
        self._copy_master_to_model()
        logprobs_BR = self._response_logprobs(self.model, samples)[0]
        return [logprobs_BR[row, : len(s.response_token_ids)] for row, s in enumerate(samples)]

    def _response_logprobs(
        self, model, samples: Sequence[TrainSample], entropy_gradient: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities [B, R] of each response token and entropies [B, R] (:func:`bubblespec.rl.logprobs.
        response_logprobs`) under the sampling temperature (and filters), in the master dtype; the forward pass
        runs in the model's dtype. Padding positions hold 0."""
        tokens_BW = padded_tokens([s.prompt_token_ids + s.response_token_ids for s in samples], self.device)
        positions_BW = torch.arange(tokens_BW.shape[1], device=self.device).expand_as(tokens_BW)
        logits_BWV = model.forward(tokens_BW, positions_BW)
        return response_logprobs(
            logits_BWV,
            tokens_BW,
            [len(s.prompt_token_ids) for s in samples],
            [len(s.response_token_ids) for s in samples],
            self.temperature,
            self.master_dtype,
            self.filters,
            entropy_gradient,
            self.suppressed,
        )

    def apply_gradients(self, where: str = "this update") -> float:
        """Sums the gradients across workers (``all_reduce``), clips their norm to ``max_grad_norm`` and takes
        one Adam step on the master weights. Returns the gradient norm before clipping. A norm that is not
        finite is a :class:`~bubblespec.core.errors.NonFiniteError` naming ``where``, raised before the step."""
        if self.all_reduce is not None:
            for parameter in self.parameters:
                self.all_reduce(parameter.grad)
        return self._agreed(lambda: self._optimizer_step(where))

    def _optimizer_step(self, where: str) -> float:
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self.parameters, self.config.optimizer.max_grad_norm or float("inf"))
        )
        if not math.isfinite(grad_norm):
            raise NonFiniteError(
                f"{where}: the gradient norm is {grad_norm} (not a finite number); no optimizer step was taken with it"
            )
        self.optimizer.step()
        return grad_norm

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
