"""GRPO on the built-in decoder: group-normalised advantages and a clipped ratio.

The learner is plain torch and knows nothing of Ray: the controller runs it in-process (virtual clock, tests)
or inside Ray Train workers (:mod:`bubblespec.ray_train`), where ``all_reduce`` averages gradients across
data-parallel workers. Training sees only the samples of the current step (invariant 1): a batch is built from
rollout results, never from drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bubblespec.backends.torch_model import DTYPES, DecoderModel, read_checkpoint
from bubblespec.config import TrainerConfig


@dataclass(frozen=True)
class TrainSample:
    """One response of the current policy, with its prompt, group and reward."""

    prompt_token_ids: tuple[int, ...]
    response_token_ids: tuple[int, ...]
    group: int
    reward: float


def group_advantages(samples: Sequence[TrainSample], epsilon: float = 1e-6) -> list[float]:
    """GRPO advantages: each reward minus its group's mean, divided by the group's standard deviation."""
    groups: dict[int, list[float]] = {}
    for sample in samples:
        groups.setdefault(sample.group, []).append(sample.reward)
    stats = {}
    for group, rewards in groups.items():
        mean = sum(rewards) / len(rewards)
        variance = sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1)
        stats[group] = (mean, variance**0.5)
    return [(s.reward - stats[s.group][0]) / (stats[s.group][1] + epsilon) for s in samples]


class GRPOLearner:
    """Holds the policy being trained and its optimizer; one :meth:`step` per RL step."""

    def __init__(
        self,
        model_path: str,
        dtype: str,
        config: TrainerConfig,
        temperature: float,
        all_reduce: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        model_config, weights = read_checkpoint(model_path)
        self.model = DecoderModel(model_config, weights, DTYPES[dtype], config.device)
        self.parameters = self.model.trainable_parameters()
        self.optimizer = torch.optim.Adam(self.parameters, lr=config.learning_rate)
        self.config = config
        self.temperature = temperature if temperature > 0 else 1.0
        self.all_reduce = all_reduce

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
        total = num_samples_total or len(samples)
        advantages = group_advantages(samples) if advantages is None else list(advantages)
        if has_signal is None:
            has_signal = any(advantages)
        if not has_signal:
            # Every group's rewards were equal: the gradient is zero, and an Adam step would still move the
            # weights by its momentum. Skip it (all workers decide alike: has_signal covers the whole batch).
            return {"loss": 0.0, "grad_norm": 0.0, "mean_advantage_abs": 0.0, "trained_tokens": 0, "skipped": 1}
        tokens, response_mask, advantage_per_token = self._batch(samples, advantages)
        self.optimizer.zero_grad(set_to_none=False)
        loss = torch.zeros((), dtype=self.model.dtype)
        if samples:
            logprobs = self._logprobs(tokens)
            # One optimizer step per RL step: the "old" policy is the current one, so the ratio is 1 with the
            # gradient of the policy-gradient loss; the clip matters once steps use several mini-batches.
            ratio = torch.exp(logprobs - logprobs.detach())
            clipped = ratio.clamp(1 - self.config.clip_epsilon, 1 + self.config.clip_epsilon)
            per_token = -torch.minimum(ratio * advantage_per_token, clipped * advantage_per_token)
            per_sequence = (per_token * response_mask).sum(1) / response_mask.sum(1).clamp(min=1)
            loss = per_sequence.sum() / total
            loss.backward()
        for parameter in self.parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            if self.all_reduce is not None:
                self.all_reduce(parameter.grad)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters, self.config.max_grad_norm or float("inf"))
        self.optimizer.step()
        return {
            "loss": loss.item(),
            "grad_norm": float(grad_norm),
            "mean_advantage_abs": sum(abs(a) for a in advantages) / max(len(advantages), 1),
            "trained_tokens": int(response_mask.sum()),
            "skipped": 0,
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def checkpoint_state(self) -> dict:
        return {"weights": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_checkpoint_state(self, state: dict) -> None:
        self.model.load_weights(state["weights"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])

    def _batch(self, samples: Sequence[TrainSample], advantages: Sequence[float]):
        """Right-padded token matrix, a mask of the positions that predict response tokens, and advantages."""
        lengths = [len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples]
        width = max(lengths, default=1)
        tokens = torch.zeros(len(samples), width, dtype=torch.int64)
        mask = torch.zeros(len(samples), width - 1, dtype=self.model.dtype)
        for row, sample in enumerate(samples):
            sequence = sample.prompt_token_ids + sample.response_token_ids
            tokens[row, : len(sequence)] = torch.tensor(sequence)
            # logits at index i predict token i + 1: responses start at index len(prompt) - 1.
            mask[row, len(sample.prompt_token_ids) - 1 : len(sequence) - 1] = 1
        advantage = torch.tensor(advantages, dtype=self.model.dtype)[:, None]
        return tokens, mask, advantage

    def _logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [B, T - 1] of each next token under the sampling temperature."""
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = self.model.forward(tokens.to(self.model.device), positions.to(self.model.device))[:, :-1]
        logprobs = torch.log_softmax(
            logits.to(torch.float32 if logits.dtype == torch.bfloat16 else logits.dtype) / self.temperature, dim=-1
        )
        return logprobs.gather(-1, tokens[:, 1:, None].to(logits.device)).squeeze(-1)
