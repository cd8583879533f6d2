"""The policy loss against a loop written from its equations (bubblespec/rl/policy_loss.py's docstring), and the
learner's update schedule: PPO epochs and mini-batches, old logprobs, data parallelism, the KL reward penalty,
DAPO's overlong shaping and masking. TRL's implementation is compared in tests/test_trl_loss.py."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from pydantic import ValidationError

from bubblespec.core.config import TrainerConfig
from bubblespec.rl.advantages import compute_advantages
from bubblespec.rl.learner import GRPOLearner, TrainSample, shaped_rewards
from bubblespec.rl.policy_loss import LossSettings, aggregation_normaliser, kl_divergence, policy_loss

from .conftest import write_checkpoint
from .trainer_settings import trainer_config
from .workers import run_workers


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(write_checkpoint(tmp_path_factory.mktemp("loss-model"), vocab_size=512, context=128, seed=4))


def _samples(count: int = 8, seed: int = 2, max_tokens: int = 16) -> list[TrainSample]:
    rng = random.Random(seed)
    samples = []
    for i in range(count):
        length = max_tokens if i % 3 == 0 else rng.randrange(2, max_tokens)
        samples.append(
            TrainSample(
                tuple(rng.randrange(3, 512) for _ in range(rng.randrange(2, 6))),
                tuple(rng.randrange(3, 512) for _ in range(length)),
                group=i // 4,
                reward=rng.random(),
                truncated=length == max_tokens,
                max_response_tokens=max_tokens,
            )
        )
    return samples


def _kl(log_ratio: float, estimator: str) -> float:
    return {"k1": log_ratio, "k2": log_ratio**2 / 2, "k3": math.exp(-log_ratio) + log_ratio - 1}[estimator]


def _loop_loss(logp, old, adv, lengths, settings: LossSettings, norm_tokens, ref, weights, entropy) -> float:
    """The loss, one token at a time, in Python floats."""
    per_response, all_tokens = [], []
    for b, n in enumerate(lengths):
        if settings.importance_ratio == "sequence":
            mean = sum(logp[b][t] - old[b][t] for t in range(n)) / max(n, 1)
            ratios = [math.exp(mean)] * n
        else:
            ratios = [math.exp(logp[b][t] - old[b][t]) for t in range(n)]
        terms = []
        for t, r in enumerate(ratios):
            if settings.policy_loss == "clip":
                clipped = min(max(r, 1 - settings.clip_low), 1 + settings.clip_high)
                term = -min(r * adv[b], clipped * adv[b])
            else:
                term = -min(r, 1 + settings.clip_high) * adv[b] * logp[b][t]
            term *= weights[b][t]
            term += settings.kl_coef * _kl(logp[b][t] - ref[b][t], settings.kl_estimator)
            terms.append(term)
        per_response.append(terms)
        all_tokens += terms
    if settings.aggregation == "token-mean":
        loss = sum(all_tokens) / max(len(all_tokens), 1)
    elif settings.aggregation == "seq-mean-token-mean":
        loss = sum(sum(terms) / max(len(terms), 1) for terms in per_response) / len(lengths)
    else:
        loss = sum(sum(terms) / norm_tokens for terms in per_response) / len(lengths)
    token_entropy = [entropy[b][t] for b, n in enumerate(lengths) for t in range(n)]
    return loss - settings.entropy_coef * sum(token_entropy) / max(len(token_entropy), 1)


SETTINGS = [
    LossSettings(
        policy_loss=p,
        importance_ratio=i,
        aggregation=a,
        clip_low=0.2,
        clip_high=h,
        kl_coef=k,
        kl_estimator=e,
        entropy_coef=c,
    )  # fmt: skip
    for (p, i), a, h, (k, e), c in itertools.product(
        [("clip", "token"), ("clip", "sequence"), ("cispo", "token")],
        ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
        [0.2, 0.28],
        [(0.0, "k3"), (0.1, "k1"), (0.1, "k2"), (0.1, "k3")],
        [0.0, 0.01],
    )
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.policy_loss}-{s.importance_ratio}-{s.aggregation}"
                         f"-hi{s.clip_high}-kl{s.kl_coef}{s.kl_estimator}-ent{s.entropy_coef}")  # fmt: skip
def test_the_loss_equals_a_loop_over_tokens(settings):
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 1, 7, 3]
    B, T = len(lengths), max(lengths)
    logp = -torch.rand(B, T, generator=generator, dtype=torch.float64) * 3
    old = logp + 0.5 * torch.randn(B, T, generator=generator, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(B, T, generator=generator, dtype=torch.float64)
    weights = torch.rand(B, T, generator=generator, dtype=torch.float64) * 2
    entropy = torch.rand(B, T, generator=generator, dtype=torch.float64)
    adv = torch.tensor([1.5, -0.5, -2.0, 0.7], dtype=torch.float64)
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths], dtype=torch.float64)
    loss, stats = policy_loss(logp, old, adv, mask, settings, aggregation_normaliser(settings.aggregation, lengths),
                              float(sum(lengths)), 20, ref, weights, entropy)  # fmt: skip
    expected = _loop_loss(logp.tolist(), old.tolist(), adv.tolist(), lengths, settings, 20, ref.tolist(),
                          weights.tolist(), entropy.tolist())  # fmt: skip
    assert float(loss) == pytest.approx(expected, abs=1e-12, rel=1e-12)
    assert float(stats["tokens"]) == sum(lengths)
    if settings.importance_ratio == "token" and settings.policy_loss == "clip":
        ratios = (logp - old).exp()[mask > 0]
        low = int(((ratios < 0.8) & (adv[:, None].expand(B, T)[mask > 0] < 0)).sum())
        assert int(stats["clip_low"]) == low and float(stats["ratio_max"]) == pytest.approx(float(ratios.max()))


def test_kl_estimators_are_the_definitions_and_k3_is_never_negative():
    log_ratio = torch.linspace(-3, 3, 61, dtype=torch.float64)
    zeros = torch.zeros_like(log_ratio)
    for estimator in ("k1", "k2", "k3"):
        values = kl_divergence(log_ratio, zeros, estimator)
        assert values.tolist() == pytest.approx([_kl(x, estimator) for x in log_ratio.tolist()], abs=1e-14)
    assert bool((kl_divergence(log_ratio, zeros, "k3") >= 0).all())
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl_divergence(log_ratio, zeros, "k4")


def test_one_update_per_step_has_ratio_one_and_several_updates_move_it(model_path):
    samples = _samples()
    single = GRPOLearner(model_path, "float64", TrainerConfig(optimizer={"learning_rate": 1e-2}), 1.0).step(samples)
    assert single["optimizer_steps"] == 1 and single["ratio_min"] == single["ratio_max"] == 1.0
    assert single["clip_fraction_low"] == single["clip_fraction_high"] == 0.0
    config = TrainerConfig(optimizer={"learning_rate": 1e-2}, ppo_epochs=2, mini_batch_size=3)
    several = GRPOLearner(model_path, "float64", config, 1.0).step(samples)
    assert several["optimizer_steps"] == 2 * 3  # 8 samples in mini-batches of 3, 3, 2; twice
    assert several["ratio_max"] > 1.0 > several["ratio_min"]
    assert several["clip_fraction_low"] + several["clip_fraction_high"] > 0
    assert several["trained_tokens"] == single["trained_tokens"] == sum(len(s.response_token_ids) for s in samples)
    assert several["entropy"] > 0 and several["learning_rate"] == 1e-2


@pytest.mark.parametrize(
    "settings",
    [
        {"ppo_epochs": 2, "mini_batch_size": 4, "loss.aggregation": "token-mean"},
        {"mini_batch_size": 3, "kl.coef": 0.1, "loss.entropy_coef": 0.01},
        {"ppo_epochs": 2, "kl.coef": 0.05, "kl.penalty": "reward", "loss.policy.importance_ratio": "sequence"},
    ],
)
def test_two_data_parallel_workers_take_the_updates_of_one_learner(model_path, settings):
    """Every worker computes every other sample of each mini-batch, the normalisers of the whole mini-batch: the
    summed gradients, the weights after the step and the metrics are one learner's (float64)."""
    config = trainer_config({"optimizer.learning_rate": 1e-2} | settings)
    samples = _samples(count=8)
    warm = _samples(count=8, seed=9)  # a first step, so that the policy has left the reference (a KL to see)
    alone = GRPOLearner(model_path, "float64", config, 1.0)
    alone.step(warm)
    expected = alone.step(samples)

    def work(rank, learner):
        learner.step(warm, rank=rank, world=2)
        return learner.step(samples, rank=rank, world=2), learner.master.state_dict()

    build = lambda rank, all_reduce: GRPOLearner(model_path, "float64", config, 1.0, all_reduce=all_reduce)  # noqa: E731
    for metrics, weights in run_workers(2, build, work):
        assert metrics.keys() == expected.keys()
        for name, value in expected.items():
            assert metrics[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name
        reference = alone.master.state_dict()
        # Nine Adam steps of size ~1e-2 after gradients summed in another order: 3e-12 apart (measured).
        assert all(torch.allclose(weights[n], reference[n], atol=1e-10, rtol=0) for n in reference)
    if config.kl.coef:
        assert expected["kl"] > 0


def test_the_kl_reward_penalty_is_subtracted_before_the_advantages(model_path):
    config = TrainerConfig(optimizer={"learning_rate": 1e-2}, kl={"coef": 0.5, "penalty": "reward", "estimator": "k1"})
    learner = GRPOLearner(model_path, "float64", config, 1.0)
    learner.step(_samples(seed=5))  # the policy moves away from the reference
    samples = _samples()
    current = learner.response_logprobs(samples)
    with torch.no_grad():
        reference = learner._response_logprobs(learner.reference, samples)[0]
    penalties = [float((c - reference[i, : len(c)]).sum()) for i, c in enumerate(current)]
    assert any(abs(p) > 1e-6 for p in penalties)
    rewards = [s.reward - 0.5 * p for s, p in zip(samples, penalties, strict=True)]
    expected = compute_advantages(rewards, [s.group for s in samples])
    metrics = learner.step(samples)
    assert metrics["mean_advantage_abs"] == pytest.approx(sum(map(abs, expected)) / len(expected), rel=1e-9)
    plain = compute_advantages([s.reward for s in samples], [s.group for s in samples])
    assert metrics["mean_advantage_abs"] != pytest.approx(sum(map(abs, plain)) / len(plain), rel=1e-6)


def test_dapo_overlong_shaping_and_truncated_masking(model_path):
    config = TrainerConfig(dapo={"overlong_buffer": 4, "overlong_penalty": 0.5})
    samples = [TrainSample((1,), tuple(range(3, 3 + n)), 0, 1.0, max_response_tokens=16) for n in (8, 12, 14, 16)]
    # L <= 16 - 4 keeps its reward; then - 0.5 * (L - 12) / 4
    assert shaped_rewards(samples, config) == pytest.approx([1.0, 1.0, 0.75, 0.5])
    with pytest.raises(ValueError, match="max_response_tokens"):
        shaped_rewards([TrainSample((1,), (3,), 0, 1.0)], config)
    batch = _samples()
    masked = GRPOLearner(model_path, "float64", TrainerConfig(dapo={"mask_truncated": True}), 1.0).step(batch)
    assert masked["trained_tokens"] == sum(len(s.response_token_ids) for s in batch if not s.truncated)


def test_old_logprobs_from_the_engine_and_truncated_importance_sampling(model_path):
    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.core.interfaces import GenerationRequest, RolloutKey, SamplingParams

    engine = TorchEngine.from_pretrained(model_path, dtype="float64", max_batch_size=8)
    params = SamplingParams(temperature=0.8, max_new_tokens=10, ignore_eos=True)
    requests = [GenerationRequest((1, 7 + i, 9), RolloutKey(0, 0, f"p{i // 2}", i % 2), params) for i in range(8)]
    results = engine.generate(requests)
    samples = [
        TrainSample(r.prompt_token_ids, tuple(res.token_ids), i // 2, float(i % 2), engine_logprobs=tuple(res.logprobs))
        for i, (r, res) in enumerate(zip(requests, results, strict=True))
    ]
    # float64 engine and trainer agree: the ratio against the engine's logprobs is 1 before any update
    metrics = GRPOLearner(model_path, "float64", TrainerConfig(loss={"old_logprobs": "engine"}), 0.8).step(samples)
    assert metrics["ratio_min"] == pytest.approx(1.0, abs=1e-9) and metrics["ratio_max"] == pytest.approx(1.0, abs=1e-9)
    # an engine that disagrees: truncated importance sampling weights the loss by min(pi_old / pi_engine, cap)
    shifted = [TrainSample(s.prompt_token_ids, s.response_token_ids, s.group, s.reward,
                           engine_logprobs=tuple(x - 0.5 for x in s.engine_logprobs)) for s in samples]  # fmt: skip
    capped = GRPOLearner(model_path, "float64", TrainerConfig(loss={"tis_cap": 1.2}), 0.8).step(shifted)
    plain = GRPOLearner(model_path, "float64", TrainerConfig(), 0.8).step(shifted)
    assert capped["loss"] == pytest.approx(1.2 * plain["loss"], rel=1e-9)  # every weight is exp(0.5) > 1.2
    with pytest.raises(ValueError, match="logprob of every response token"):
        GRPOLearner(model_path, "float64", TrainerConfig(loss={"tis_cap": 2.0}), 0.8).step(_samples())


def test_settings_that_contradict_each_other_are_refused():
    with pytest.raises(ValidationError, match="leave tis_cap empty"):
        TrainerConfig(loss={"old_logprobs": "engine", "tis_cap": 2.0})
    with pytest.raises(ValidationError, match=r"policy\.cispo\.importance_ratio\s+Extra inputs are not permitted"):
        TrainerConfig(loss={"policy": {"kind": "cispo", "importance_ratio": "sequence"}})
    with pytest.raises(ValidationError, match=r"loss\.aggregation\s+Input should be"):
        TrainerConfig(loss={"aggregation": "sum"})
    from bubblespec.core.config import validate
    from bubblespec.core.errors import ConfigError

    with pytest.raises(ConfigError, match="filter_groups .* needs task.samples_per_prompt >= 2"):
        validate({"task": {"samples_per_prompt": 1}, "trainer": {"dapo": {"filter_groups": True}}})


def test_dynamic_sampling_trains_on_groups_with_signal_only(model_path):
    from bubblespec.rl.learner import filter_groups

    samples = [TrainSample((1, 2), (5, 6, 7), group=g, reward=r) for g, rs in enumerate(
        [(1.0, 1.0), (0.0, 1.0), (0.0, 0.0), (0.5, 0.2), (1.0, 0.0)]) for r in rs]  # fmt: skip
    rewards = [s.reward for s in samples]
    kept, kept_rewards, num_kept, num_dropped = filter_groups(samples, rewards, max_groups=2)
    assert [s.group for s in kept] == [1, 1, 3, 3] and kept_rewards == [0.0, 1.0, 0.5, 0.2]
    assert (num_kept, num_dropped) == (2, 3)
    assert [s.group for s in filter_groups(samples, rewards, None)[0]] == [1, 1, 3, 3, 4, 4]
    config = TrainerConfig(dapo={"filter_groups": True, "train_prompts": 2})
    metrics = GRPOLearner(model_path, "float64", config, 1.0).step(samples)
    assert metrics["groups_kept"] == 2 and metrics["groups_dropped"] == 3 and metrics["trained_tokens"] == 4 * 3
    expected = compute_advantages(kept_rewards, [1, 1, 3, 3])
    assert metrics["mean_advantage_abs"] == pytest.approx(sum(map(abs, expected)) / 4)
    nothing = GRPOLearner(model_path, "float64", config, 1.0).step(samples[:2] + samples[4:6])
    assert nothing["skipped"] == 1 and nothing["groups_kept"] == 0
    with pytest.raises(ValidationError, match="set filter_groups: true"):
        TrainerConfig(dapo={"train_prompts": 4})


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.8), (20, 0.9)])
def test_sampling_filters_make_the_trainer_score_what_the_engine_sampled_from(model_path, top_k, top_p):
    """The engine samples with top-k / top-p and reports logprobs under that distribution; with
    trainer.sampling_filters the trainer's logprobs (and entropy) are the same distribution's (float64)."""
    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.core.interfaces import GenerationRequest, RolloutKey, SamplingParams

    engine = TorchEngine.from_pretrained(model_path, dtype="float64", max_batch_size=8)
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, max_new_tokens=12, ignore_eos=True)
    requests = [GenerationRequest((1, 7 + i, 9), RolloutKey(3, 0, f"p{i // 2}", i % 2), params) for i in range(8)]
    samples = [
        TrainSample(r.prompt_token_ids, tuple(res.token_ids), i // 2, float(i % 2), engine_logprobs=tuple(res.logprobs))
        for i, (r, res) in enumerate(zip(requests, engine.generate(requests), strict=True))
    ]
    filtered = GRPOLearner(
        model_path, "float64", TrainerConfig(loss={"sampling_filters": True}), 0.7, top_k=top_k, top_p=top_p
    )
    plain = GRPOLearner(model_path, "float64", TrainerConfig(), 0.7, top_k=top_k, top_p=top_p)
    exact, unfiltered = filtered.step(samples), plain.step(samples)
    assert exact["logprob_diff_max"] < 1e-10
    assert unfiltered["logprob_diff_mean"] > 1e-3  # temperature alone leaves out the filters' renormalisation
    assert 0 < exact["entropy"] < unfiltered["entropy"]  # fewer tokens kept, less entropy
