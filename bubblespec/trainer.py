"""The learner: a clipped policy-gradient step on GRPO-family advantages (:mod:`bubblespec.advantages`), training the
built-in decoder or a transformers model (:mod:`bubblespec.trainer_models`).

The learner is plain torch and knows nothing of Ray: the controller runs it in-process (virtual clock, tests)
or inside Ray Train workers (:mod:`bubblespec.ray_train`), where ``all_reduce`` averages gradients across
data-parallel workers. Training sees only the samples of the current step (invariant 1): a batch is built from
rollout results, never from drafts.
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
from bubblespec.trainer_models import load_trainer_model


@dataclass(frozen=True)
class TrainSample:
    """One response of the current policy, with its prompt, group and reward."""

    prompt_token_ids: tuple[int, ...]
    response_token_ids: tuple[int, ...]
    group: int
    reward: float
    engine_logprobs: tuple[float, ...] | None = None
    """The rollout engine's log-probability of each response token, to measure how far the trainer's are."""


def group_advantages(samples: Sequence[TrainSample], epsilon: float = 1e-6) -> list[float]:
    """GRPO advantages: each reward minus its group's mean, divided by the group's standard deviation."""
    return sample_advantages(samples, "grpo", "group", epsilon)


def sample_advantages(
    samples: Sequence[TrainSample], estimator: Estimator = "grpo", scale: Scale = "group", epsilon: float = 1e-6
) -> list[float]:
    """The advantage of each sample by ``estimator`` (:mod:`bubblespec.advantages`)."""
    return compute_advantages([s.reward for s in samples], [s.group for s in samples], estimator, scale, epsilon)


def lr_factor(config: TrainerConfig, optimizer_steps: int) -> float:
    """The learning rate of optimizer step ``optimizer_steps`` (0-based) as a share of ``learning_rate``: a linear
    warm-up over ``warmup_steps``, then constant, or a cosine decay to 0 at ``decay_steps``."""
    if optimizer_steps < config.warmup_steps:
        return (optimizer_steps + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (optimizer_steps - config.warmup_steps) / max(config.decay_steps - config.warmup_steps, 1))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class PeerFailed(RuntimeError):
    """Another data-parallel worker failed in this step; this one exchanged no gradient and took no step."""


SKIPPED_STEP = {"loss": 0.0, "grad_norm": 0.0, "mean_advantage_abs": 0.0, "trained_tokens": 0, "skipped": 1}
"""The metrics of a step without reward signal (every group's rewards equal): no optimizer step is taken, and no
log-probabilities are computed, so the engine-trainer logprob agreement is not measured either."""


class GRPOLearner:
    """Holds the policy being trained and its optimizer; one :meth:`step` per RL step.

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
        self.optimizer = torch.optim.AdamW(self.parameters, lr=config.learning_rate, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, functools.partial(lr_factor, config))
        self.config = config
        self.temperature = temperature if temperature > 0 else 1.0
        self.all_reduce = all_reduce

    @property
    def has_master_copy(self) -> bool:
        """Whether the master weights are a more precise copy of the model's (a bfloat16 run)."""
        return self.model is not self.master

    def step(
        self,
        samples: Sequence[TrainSample],
        advantages: Sequence[float] | None = None,
        num_samples_total: int | None = None,
        has_signal: bool | None = None,
    ) -> dict[str, float]:
        """One optimizer step on ``samples``. With data parallelism each worker passes its own slice, the
        advantages computed over the whole batch (groups may straddle workers) and the total batch size, so
        that the all-reduced gradient is the gradient of the whole batch's loss."""
        if advantages is None:
            advantages = sample_advantages(samples, self.config.advantage, self.config.scale_rewards)
        advantages = list(advantages)
        if has_signal is None:
            has_signal = any(advantages)
        if not has_signal:
            # Every group's rewards were equal: the gradient is zero, and an Adam step would still move the
            # weights by its momentum. Skip it (all workers decide alike: has_signal covers the whole batch).
            return dict(SKIPPED_STEP)
        metrics = self._compute_gradients_with_peers(samples, advantages, num_samples_total or len(samples))
        metrics |= self._logprob_agreement(metrics.pop("logprob_difference"))
        return {"loss": metrics["loss"], "grad_norm": self.apply_gradients()} | metrics | {"skipped": 0}

    def _logprob_agreement(self, local: torch.Tensor) -> dict[str, float]:
        """Mean and max |engine logprob - trainer logprob| over the batch's response tokens, every worker's share
        (the peers have agreed that none failed, so these reductions cannot hang). ``local``: [sum of |diff|,
        tokens compared, max |diff|] over this worker's samples that carry engine logprobs."""
        total, maximum = local[:2].clone(), local[2:].clone()
        if self.all_reduce is not None:
            self.all_reduce(total)
            self.all_reduce(maximum, op="max")
        if total[1] == 0:
            return {}
        return {"logprob_diff_mean": float(total[0] / total[1]), "logprob_diff_max": float(maximum[0])}

    def _compute_gradients_with_peers(
        self, samples: Sequence[TrainSample], advantages: Sequence[float], num_samples_total: int
    ) -> dict[str, float]:
        """:meth:`compute_gradients`; with data parallelism the workers then agree, by one all-reduce of a
        failure flag, that all of them succeeded before any gradient is exchanged. A worker that failed (a bad
        input, out of memory) would otherwise leave the others waiting in the gradient all-reduce for good.
        Raises :class:`PeerFailed` on the workers that did not fail themselves."""
        if self.all_reduce is None:
            return self.compute_gradients(samples, advantages, num_samples_total)
        try:
            metrics = self.compute_gradients(samples, advantages, num_samples_total)
        except Exception:
            self._any_worker_failed(failed=True)  # the peers learn of it and skip the step; the error goes on up
            raise
        if self._any_worker_failed(failed=False):
            raise PeerFailed("another trainer worker failed in this step; this one took no optimizer step")
        return metrics

    def _any_worker_failed(self, failed: bool) -> bool:
        flag = torch.tensor([1.0 if failed else 0.0], device=self.master.device)
        self.all_reduce(flag)
        return bool(flag.item() > 0)

    def compute_gradients(
        self, samples: Sequence[TrainSample], advantages: Sequence[float], num_samples_total: int
    ) -> dict[str, float]:
        """Sets the master weights' gradients to those of this worker's share of the loss (not yet reduced
        across workers)::

            L = 1/N sum_s 1/|s| sum_(t in s) -min(r_t A_s, clip(r_t, 1 - eps, 1 + eps) A_s)

        with N = ``num_samples_total``, |s| the response tokens of sample s, A_s its advantage and
        r_t = exp(log pi(y_t) - log pi_old(y_t)). Returns the loss, the mean |A_s|, the trained tokens and, as a
        tensor, this worker's ``logprob_difference`` from the engine's logprobs (see :meth:`_logprob_agreement`)."""
        self._copy_master_to_model()
        self.optimizer.zero_grad(set_to_none=False)
        size = self.config.micro_batch_size or max(len(samples), 1)
        loss, trained_tokens = 0.0, 0
        difference = torch.zeros(3, dtype=torch.float64, device=self.master.device)
        for start in range(0, len(samples), size):  # gradients accumulate over micro-batches
            part_loss, part_tokens, part_difference = self._backward(
                samples[start : start + size], advantages[start : start + size], num_samples_total
            )
            loss, trained_tokens = loss + part_loss, trained_tokens + part_tokens
            difference = torch.cat([difference[:2] + part_difference[:2], difference[2:].maximum(part_difference[2:])])
        self._gradients_to_master()
        return {
            "loss": loss,
            "mean_advantage_abs": sum(abs(a) for a in advantages) / max(len(advantages), 1),
            "trained_tokens": trained_tokens,
            "logprob_difference": difference,
        }

    def _backward(
        self, samples: Sequence[TrainSample], advantages: Sequence[float], num_samples_total: int
    ) -> tuple[float, int, torch.Tensor]:
        """Back-propagates one micro-batch's share of the loss; returns it, its response tokens and its logprob
        difference from the engine's."""
        tokens, response_mask, advantage_per_token = self._batch(samples, advantages)
        logprobs = self._logprobs(tokens)
        # One optimizer step per RL step: the "old" policy is the current one, so the ratio is 1 with the
        # gradient of the policy-gradient loss; the clip matters once steps use several mini-batches.
        ratio = torch.exp(logprobs - logprobs.detach())
        clipped = ratio.clamp(1 - self.config.clip_epsilon, 1 + self.config.clip_epsilon)
        per_token = -torch.minimum(ratio * advantage_per_token, clipped * advantage_per_token)
        per_sequence = (per_token * response_mask).sum(1) / response_mask.sum(1).clamp(min=1)
        loss = per_sequence.sum() / num_samples_total
        loss.backward()
        return loss.item(), int(response_mask.sum()), self._logprob_difference(samples, logprobs.detach())

    def _logprob_difference(self, samples: Sequence[TrainSample], logprobs: torch.Tensor) -> torch.Tensor:
        """[sum of |engine - trainer|, tokens compared, max] over the response tokens of samples with engine
        logprobs. ``logprobs``: [B, T - 1], row b's response tokens at [len(prompt) - 1, len(prompt) - 1 + len)."""
        differences = [
            (logprobs[row, len(s.prompt_token_ids) - 1 :][: len(s.engine_logprobs)].to(torch.float64)
             - torch.tensor(s.engine_logprobs, dtype=torch.float64, device=logprobs.device)).abs()
            for row, s in enumerate(samples)
            if s.engine_logprobs
        ]  # fmt: skip
        if not differences:
            return torch.zeros(3, dtype=torch.float64, device=logprobs.device)
        flat = torch.cat(differences)
        return torch.stack([flat.sum(), torch.tensor(float(len(flat)), dtype=torch.float64), flat.max()])

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

    def _batch(self, samples: Sequence[TrainSample], advantages: Sequence[float]):
        """Right-padded token matrix, a mask of the positions that predict response tokens, and advantages; the
        mask and advantages in the master dtype (a bfloat16 mask of 1,001 ones would sum to 1,000)."""
        lengths = [len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples]
        width = max(lengths, default=1)
        tokens = torch.zeros(len(samples), width, dtype=torch.int64)
        mask = torch.zeros(len(samples), width - 1, dtype=self.master_dtype)
        for row, sample in enumerate(samples):
            sequence = sample.prompt_token_ids + sample.response_token_ids
            tokens[row, : len(sequence)] = torch.tensor(sequence)
            # logits at index i predict token i + 1: responses start at index len(prompt) - 1.
            mask[row, len(sample.prompt_token_ids) - 1 : len(sequence) - 1] = 1
        advantage = torch.tensor(advantages, dtype=self.master_dtype)[:, None]
        return tokens, mask, advantage

    def _logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [B, T - 1] of each next token under the sampling temperature, in the master dtype
        (the forward pass runs in the run's dtype)."""
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = self.model.forward(tokens.to(self.model.device), positions.to(self.model.device))[:, :-1]
        logprobs = torch.log_softmax(logits.to(self.master_dtype) / self.temperature, dim=-1)
        return logprobs.gather(-1, tokens[:, 1:, None].to(logits.device)).squeeze(-1)
