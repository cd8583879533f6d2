"""Our policy loss against TRL's: the same fixed batch (prompts, responses, advantages, old, reference and engine
log-probabilities) through ``GRPOLearner.compute_gradients`` and through TRL 1.16's ``GRPOTrainer._compute_loss``,
for every setting both have. TRL's method runs unchanged on a stand-in for the trainer object that holds the
settings it reads, with our model's log-probabilities and entropies (so both sides differentiate the same model);
the losses and the gradients on the model's weights agree within 1e-6 in float64 (in practice ~1e-15).

Where a setting has no TRL counterpart (rloo, reinforce_pp, k1/k2, the KL as a reward penalty), the test of its
equation is in ``tests/test_advantages.py`` / ``tests/test_policy_loss.py``.
"""

from __future__ import annotations

import random
import types
from collections import defaultdict

import pytest
import torch
from trl import GRPOTrainer  # the test extra has TRL 1.16
from trl.trainer.utils import nanstd

from bubblespec.rl.advantages import compute_advantages
from bubblespec.rl.learner import GRPOLearner, TrainSample, _Before

from .conftest import write_checkpoint
from .trainer_settings import trainer_config

TRL_EPSILON = 1e-4  # TRL divides advantages by std + 1e-4 (ours defaults to 1e-6)
MAX_TOKENS = 24
TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A random Llama with a 32,000-token vocabulary."""
    return str(write_checkpoint(tmp_path_factory.mktemp("trl-model"), vocab_size=32_000, context=128, seed=11))


def _batch(seed: int = 3):
    """Eight responses to four prompts, lengths 3-24 (some truncated at 24), with rewards and engine logprobs."""
    rng = random.Random(seed)
    samples = []
    for i in range(8):
        length = MAX_TOKENS if i in (2, 5) else rng.randrange(3, MAX_TOKENS)
        samples.append(
            TrainSample(
                tuple(rng.randrange(3, 32_000) for _ in range(rng.randrange(3, 7))),
                tuple(rng.randrange(3, 32_000) for _ in range(length)),
                group=i // 2,
                reward=float(rng.choice([0.0, 0.25, 1.0])) + 0.01 * i,
                engine_logprobs=tuple(-rng.uniform(8.0, 12.0) for _ in range(length)),
                truncated=length == MAX_TOKENS,
                max_response_tokens=MAX_TOKENS,
            )
        )
    return samples


def _trl_advantages(rewards: list[float], group_size: int, scale: str) -> torch.Tensor:
    """TRL 1.16's advantage lines (``_generate_and_score_completions``) for the group-relative estimator."""
    rewards_t = torch.tensor(rewards, dtype=torch.float64)
    mean = rewards_t.view(-1, group_size).mean(1).repeat_interleave(group_size)
    if scale == "batch":
        std = nanstd(rewards_t).expand_as(rewards_t)
    else:
        std = nanstd(rewards_t.view(-1, group_size), dim=1).repeat_interleave(group_size)
    advantages = rewards_t - mean
    return advantages if scale == "none" else advantages / (std + TRL_EPSILON)


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def _trl_trainer(learner: GRPOLearner, samples, trl_settings: dict):
    """A stand-in for ``GRPOTrainer`` with the attributes ``_compute_loss`` reads; its log-probabilities and
    entropies are our model's (``_get_per_token_logps_and_entropies``)."""

    def logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **_):
        logprobs, entropy = learner._response_logprobs(learner.model, samples, entropy_gradient=True)
        assert logprobs.shape[1] == logits_to_keep
        return logprobs, entropy, None

    fake = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=logps_and_entropies,
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=0.0,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        loss_type="grpo",
        epsilon_low=0.2,
        epsilon_high=0.2,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=MAX_TOKENS,
        accelerator=_Accelerator(),
        _entropy_bonus_enabled=False,
        entropy_coef=0.0,
        use_adaptive_entropy=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    for name, value in trl_settings.items():
        setattr(fake, name, value)
    return fake


def _padded(values: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(values), width, dtype=torch.float64)
    for row, value in enumerate(values):
        out[row, : len(value)] = torch.tensor(value, dtype=torch.float64)
    return out


# (our trainer settings, TRL's settings); clip_ratio_high 0.28 is DAPO's clip-higher, CISPO's cap is TRL's
# epsilon_high = 1 + ours.
SETTINGS = {
    "grpo": ({}, {"loss_type": "grpo"}),
    "grpo clip-higher": ({"loss.policy.clip_ratio_high": 0.28}, {"loss_type": "grpo", "epsilon_high": 0.28}),
    "bnpo": ({"loss.aggregation": "token-mean"}, {"loss_type": "bnpo"}),
    "dr_grpo": (
        {"loss.aggregation": "seq-mean-token-sum-norm", "loss.norm_tokens": MAX_TOKENS},
        {"loss_type": "dr_grpo"},
    ),
    "dapo": (
        {"loss.aggregation": "token-mean", "loss.policy.clip_ratio_low": 0.2, "loss.policy.clip_ratio_high": 0.28},
        {"loss_type": "dapo", "epsilon_high": 0.28},
    ),
    "cispo": (
        {"loss.policy.kind": "cispo", "loss.aggregation": "token-mean", "loss.policy.clip_ratio_high": 2.0},
        {"loss_type": "cispo", "epsilon_high": 3.0},
    ),
    "gspo (sequence-level)": (
        {"loss.policy.importance_ratio": "sequence"},
        {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    ),
    "grpo beta": ({"kl.coef": 0.05, "kl.estimator": "k3"}, {"loss_type": "grpo", "beta": 0.05}),
    "dapo beta": (
        {"loss.aggregation": "token-mean", "kl.coef": 0.05, "loss.policy.clip_ratio_high": 0.28},
        {"loss_type": "dapo", "beta": 0.05, "epsilon_high": 0.28},
    ),
    "gspo beta": (
        {"loss.policy.importance_ratio": "sequence", "kl.coef": 0.1},
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.1},
    ),
    "entropy_coef": (
        {"loss.entropy_coef": 0.01},
        {"loss_type": "grpo", "_entropy_bonus_enabled": True, "entropy_coef": 0.01},
    ),
    "mask_truncated": ({"dapo.mask_truncated": True}, {"loss_type": "grpo"}),
    "dapo mask_truncated": (
        {"loss.aggregation": "token-mean", "dapo.mask_truncated": True},
        {"loss_type": "dapo"},
    ),
    "tis_cap": (
        {"loss.tis_cap": 2.0},
        {"loss_type": "grpo", "use_vllm": True, "vllm_importance_sampling_correction": True},
    ),
}


# Every setting with scale_rewards "group"; "batch" and "none" with three loss types (the others do not interact).
CASES = [(name, "group") for name in SETTINGS] + [
    (name, scale) for name in ("grpo", "dapo", "dr_grpo") for scale in ("batch", "none")
]


@pytest.mark.parametrize(("name", "scale"), CASES)
def test_loss_and_gradient_equal_trl_grpo_trainer(model_path, name, scale):
    ours, theirs = SETTINGS[name]
    config = trainer_config({"loss.scale_rewards": scale} | ours)
    learner = GRPOLearner(model_path, "float64", config, TEMPERATURE)
    samples = _batch()
    lengths = [len(s.response_token_ids) for s in samples]
    width = max(lengths)

    # Old and reference policies: the current one, perturbed per token, so that ratios leave the clip range.
    current = [t.detach() for t in learner.response_logprobs(samples)]
    rng = torch.Generator().manual_seed(7)
    old = {i: c + 0.4 * torch.randn(len(c), generator=rng, dtype=torch.float64) for i, c in enumerate(current)}
    ref = {i: c + 0.3 * torch.randn(len(c), generator=rng, dtype=torch.float64) for i, c in enumerate(current)}
    before = _Before(old=old, ref=ref if config.kl.coef else {})

    rewards = [s.reward for s in samples]
    advantages = compute_advantages(rewards, [s.group for s in samples], "grpo", scale, TRL_EPSILON)
    trl_advantages = _trl_advantages(rewards, 2, scale)
    # 1e-6, not 1e-15: TRL's nanstd computes Bessel's factor count / (count - 1) from integer tensors, in float32.
    assert torch.allclose(torch.tensor(advantages, dtype=torch.float64), trl_advantages, atol=1e-6, rtol=0)

    ours_stats = learner.compute_gradients(samples, advantages, before=before)
    our_gradient = torch.cat([p.grad.flatten().clone() for p in learner.parameters])

    mask = _padded([[1.0] * n for n in lengths], width)
    if config.dapo.mask_truncated:
        mask[[i for i, s in enumerate(samples) if s.truncated]] = 0
    inputs = {
        "prompt_ids": torch.zeros(len(samples), 1, dtype=torch.long),
        "prompt_mask": torch.ones(len(samples), 1, dtype=torch.long),
        "completion_ids": torch.zeros(len(samples), width, dtype=torch.long),
        "completion_mask": mask,
        "advantages": trl_advantages,
        "old_per_token_logps": _padded([old[i].tolist() for i in range(len(samples))], width),
        "num_items_in_batch": mask.sum(),
    }
    if config.kl.coef:
        inputs["ref_per_token_logps"] = _padded([ref[i].tolist() for i in range(len(samples))], width)
    if config.loss.tis_cap:
        engine = _padded([list(s.engine_logprobs) for s in samples], width)
        inputs["importance_sampling_ratio"] = torch.exp(inputs["old_per_token_logps"] - engine).clamp(
            max=config.loss.tis_cap
        )
    for parameter in learner.parameters:
        parameter.grad = None
    trl_loss = GRPOTrainer._compute_loss(_trl_trainer(learner, samples, theirs), None, inputs)
    trl_loss.backward()
    trl_gradient = torch.cat([p.grad.flatten() for p in learner.parameters])

    assert float(ours_stats["loss"]) == pytest.approx(float(trl_loss), abs=1e-6, rel=0)
    assert torch.allclose(our_gradient, trl_gradient, atol=1e-6, rtol=0)
    assert float(trl_loss) != 0 and float(our_gradient.norm()) > 1e-3  # a comparison of something
    if name.startswith(("grpo", "dapo")) and "clip" not in name:
        assert float(ours_stats["clip_low"] + ours_stats["clip_high"]) > 0  # the perturbation did reach the clip
