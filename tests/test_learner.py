"""The GRPO learner without Ray: float32 master weights and optimizer state under a bfloat16 model, exact masks,
bfloat16 gradients against float32 ones, and checkpoints that continue a bfloat16 run exactly."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from bubblespec.core.config import TrainerConfig
from bubblespec.rl.learner import GRPOLearner, TrainSample, group_advantages
from bubblespec.rl.train_batch import micro_batches

from .conftest import write_checkpoint
from .workers import run_workers


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A random Llama with a 4,096-token vocabulary and room for 1,100 positions."""
    return str(write_checkpoint(tmp_path_factory.mktemp("trainer-model"), vocab_size=4096, context=2048, seed=5))


def _samples(vocab_size: int = 4096, count: int = 8, seed: int = 1) -> list[TrainSample]:
    rng = random.Random(seed)
    return [
        TrainSample(
            tuple(rng.randrange(3, vocab_size) for _ in range(6)),
            tuple(rng.randrange(3, vocab_size) for _ in range(rng.randrange(5, 30))),
            group=i // 4,
            reward=float(rng.random()),
        )
        for i in range(count)
    ]


def _gradient(learner: GRPOLearner) -> torch.Tensor:
    return torch.cat([parameter.grad.flatten() for parameter in learner.parameters])


def test_a_bfloat16_learner_at_lr_1e_6_moves_its_float32_master_weights(model_path):
    """Adam's first step moves every weight by about lr: 1e-6 is far below a bfloat16 weight's spacing (a weight
    near 0.5 has neighbours 2e-3 away), so the update lives in float32 master weights and float32 Adam state."""
    learner = GRPOLearner(
        model_path, "bfloat16", TrainerConfig(optimizer={"learning_rate": 1e-6, "max_grad_norm": None}), 1.0
    )
    before = learner.checkpoint_state()["master_weights"]
    assert all(t.dtype == torch.float32 for t in before.values())
    learner.step(_samples())
    state = learner.checkpoint_state()
    after = state["master_weights"]
    moved = torch.cat([(after[k] - before[k]).abs().flatten() for k in before])
    assert (moved > 0).float().mean() > 0.5, "most master weights must move"
    assert 0.5e-6 < float(moved.max()) < 1.5e-6  # Adam's first step: lr * g / |g| per weight
    adam_state = [s for s in state["optimizer"]["state"].values()]
    assert adam_state and all(s["exp_avg"].dtype == torch.float32 for s in adam_state)
    # engines get the master weights rounded to bfloat16
    sent = learner.state_dict()
    assert all(sent[k].dtype == torch.bfloat16 and torch.equal(sent[k], after[k].to(torch.bfloat16)) for k in after)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_mask_of_1001_response_tokens_counts_1001(model_path, dtype):
    """bfloat16 has 8 significant bits: 1,001 ones summed in bfloat16 are 1,000."""
    learner = GRPOLearner(model_path, dtype, TrainerConfig(optimizer={"learning_rate": 1e-6}), 1.0)
    samples = [
        TrainSample((1, 5, 6), tuple(range(3, 3 + 1001)), group=0, reward=1.0),
        TrainSample((1, 5, 6), (7, 8), group=0, reward=0.0),
    ]
    metrics = learner.step(samples)
    assert metrics["trained_tokens"] == 1001 + 2


def test_a_bfloat16_step_agrees_with_a_float32_step(model_path):
    """The same batch through a bfloat16 and a float32 learner: the gradients (in float32 master weights)
    differ by at most 20% in L2 norm and point the same way (cosine > 0.98); the response tokens'
    log-probabilities differ by less than 0.1 on average. (Measured on this model: 9.2%, 0.996 and 0.043; the
    fixture's weights are large, so its logits are large and bfloat16 rounds them coarsely.)"""
    samples = _samples()
    advantages = group_advantages(samples)
    gradients, logprobs = {}, {}
    for dtype in ("float32", "bfloat16"):
        learner = GRPOLearner(model_path, dtype, TrainerConfig(), 1.0)
        metrics = learner.compute_gradients(samples, advantages)
        assert metrics["loss"].dtype == torch.float64 and metrics["tokens"] == sum(
            len(s.response_token_ids) for s in samples
        )
        gradients[dtype] = _gradient(learner)
        assert gradients[dtype].dtype == torch.float32
        logprobs[dtype] = torch.cat(learner.response_logprobs(samples))
    reference, other = gradients["float32"], gradients["bfloat16"]
    assert float((other - reference).norm() / reference.norm()) < 0.2
    assert float(torch.nn.functional.cosine_similarity(other, reference, dim=0)) > 0.98
    assert float((logprobs["bfloat16"] - logprobs["float32"]).abs().mean()) < 0.1


def test_a_bfloat16_learner_resumed_from_its_checkpoint_continues_exactly(model_path):
    """The checkpoint's weights are the float32 master weights: a learner that loads them (and the optimizer
    state) takes the very step the uninterrupted one takes."""
    first, second = _samples(seed=1), _samples(seed=2)
    whole = GRPOLearner(model_path, "bfloat16", TrainerConfig(optimizer={"learning_rate": 1e-4}), 1.0)
    whole.step(first)
    saved = copy.deepcopy(whole.checkpoint_state())  # as written to disk: the optimizer's state is live
    saved["weights"] = saved.pop("master_weights")
    whole.step(second)
    resumed = GRPOLearner(model_path, "bfloat16", TrainerConfig(optimizer={"learning_rate": 1e-4}), 1.0)
    resumed.load_checkpoint_state(saved)
    resumed.step(second)
    expected, got = whole.checkpoint_state()["master_weights"], resumed.checkpoint_state()["master_weights"]
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_float32_and_float64_learners_train_their_own_weights(model_path, dtype):
    """No copy where the run's dtype is at least float32: the model's weights are the master weights, the
    checkpoint has no separate master weights, and the weights sent are the trained ones."""
    learner = GRPOLearner(model_path, dtype, TrainerConfig(optimizer={"learning_rate": 1e-3}), 1.0)
    assert learner.model is learner.master and not learner.has_master_copy
    learner.step(_samples())
    assert "master_weights" not in learner.checkpoint_state()
    sent = learner.state_dict()
    assert all(sent[k].dtype == getattr(torch, dtype) for k in sent)
    assert all(torch.equal(sent[k], learner.master.weights[k]) for k in sent)


def test_a_worker_that_fails_stops_its_peer_before_the_gradient_exchange(model_path):
    """Two data-parallel learners; worker 1's share holds a token outside the vocabulary. Worker 1 raises its
    own error, worker 0 learns of it in the all-reduce that precedes the gradient exchange and raises
    PeerFailed instead of waiting for gradients that never come; neither takes a step."""
    from bubblespec.rl.learner import PeerFailed

    # Worker 0 computes sample 0, worker 1 sample 1 (every world-th sample of the batch).
    batch = [TrainSample((1, 5), (6, 2), group=0, reward=1.0), TrainSample((1, 5), (10**6, 2), group=0, reward=0.0)]

    def build(rank, all_reduce):
        return GRPOLearner(
            model_path, "bfloat16", TrainerConfig(optimizer={"learning_rate": 1e-3}), 1.0, all_reduce=all_reduce
        )

    def work(rank, learner):
        before = learner.checkpoint_state()["master_weights"]
        with pytest.raises(IndexError if rank == 1 else PeerFailed):
            learner.step(batch, rank=rank, world=2)
        after = learner.checkpoint_state()["master_weights"]
        return all(torch.equal(after[k], before[k]) for k in before)

    assert run_workers(2, build, work) == [True, True]


def _engine_samples(model_path: str, dtype: str, count: int = 8) -> list[TrainSample]:
    """Samples the torch engine generated, with its logprobs, and alternating rewards (a signal to train on)."""
    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.core.interfaces import GenerationRequest, RolloutKey, SamplingParams

    engine = TorchEngine.from_pretrained(model_path, dtype=dtype, max_batch_size=count)
    params = SamplingParams(temperature=0.8, max_new_tokens=12, ignore_eos=True)
    requests = [GenerationRequest((1, 7 + i, 9), RolloutKey(0, 0, f"p{i // 2}", i % 2), params) for i in range(count)]
    results = engine.generate(requests)
    return [
        TrainSample(r.prompt_token_ids, tuple(res.token_ids), i // 2, float(i % 2), engine_logprobs=tuple(res.logprobs))
        for i, (r, res) in enumerate(zip(requests, results, strict=True))
    ]


def test_the_logprob_agreement_of_engine_and_trainer_is_measured(model_path):
    exact = GRPOLearner(model_path, "float64", TrainerConfig(optimizer={"learning_rate": 1e-3}), 0.8).step(
        _engine_samples(model_path, "float64")
    )
    assert exact["logprob_diff_mean"] < 1e-12 and exact["logprob_diff_max"] < 1e-11
    rounded = GRPOLearner(model_path, "float32", TrainerConfig(optimizer={"learning_rate": 1e-3}), 0.8).step(
        _engine_samples(model_path, "bfloat16")
    )
    assert 1e-4 < rounded["logprob_diff_mean"] < rounded["logprob_diff_max"] < 1.0
    without = GRPOLearner(model_path, "float32", TrainerConfig(optimizer={"learning_rate": 1e-3}), 0.8).step(_samples())
    assert "logprob_diff_mean" not in without  # samples without engine logprobs: nothing to compare


def test_the_logprob_agreement_covers_every_worker_s_share(model_path):
    samples = _engine_samples(model_path, "bfloat16")
    alone = GRPOLearner(model_path, "float32", TrainerConfig(optimizer={"learning_rate": 1e-3}), 0.8).step(samples)
    metrics = run_workers(
        2,
        lambda rank, all_reduce: GRPOLearner(
            model_path, "float32", TrainerConfig(optimizer={"learning_rate": 1e-3}), 0.8, all_reduce
        ),
        lambda rank, learner: learner.step(samples, rank=rank, world=2),
    )
    for rank in range(2):
        assert metrics[rank]["logprob_diff_mean"] == pytest.approx(alone["logprob_diff_mean"], rel=1e-9)
        assert metrics[rank]["logprob_diff_max"] == pytest.approx(alone["logprob_diff_max"], rel=1e-9)


def test_the_transformers_learner_scores_and_trains_like_the_built_in_one(qwen2_path):
    from bubblespec.backends.torch_engine import TorchEngine

    samples = _samples(vocab_size=40, count=8)
    builtin = GRPOLearner(qwen2_path, "float32", TrainerConfig(optimizer={"learning_rate": 1e-3}), 0.9)
    hf = GRPOLearner(
        qwen2_path, "float32", TrainerConfig(optimizer={"learning_rate": 1e-3}, model={"kind": "transformers"}), 0.9
    )
    assert torch.allclose(
        torch.cat(builtin.response_logprobs(samples)), torch.cat(hf.response_logprobs(samples)), atol=1e-5
    )
    first, second = builtin.step(samples), hf.step(samples)
    assert (
        first["loss"] == pytest.approx(second["loss"], abs=1e-6) and first["trained_tokens"] == second["trained_tokens"]
    )
    before, after = builtin.state_dict(), hf.state_dict()
    assert set(after) >= set(before)  # Hugging Face names, as the engines take them
    engine = TorchEngine.from_pretrained(qwen2_path, dtype="float32")
    initial = engine.model.state_dict()
    assert any(not torch.equal(after[n], initial[n]) for n in before)  # the step trained the weights
    engine.update_weights(after, version=1)


@pytest.mark.parametrize(
    ("size", "tokens", "passes"),
    [
        (None, None, [[0, 1, 2, 3, 4, 5]]),  # all at once, in order: what a run without either setting did before
        (4, None, [[0, 1, 2, 3], [4, 5]]),
        (None, 100, [[3], [1, 4], [2, 5, 0]]),  # 60 alone (2 x 60 > 100); 40 + 30; then 3 x 20 <= 100
        (None, 50, [[3], [1], [4], [2, 5], [0]]),  # 60 is over the bound: a pass alone
        (2, 100, [[3], [1, 4], [2, 5], [0]]),
    ],
)
def test_micro_batches_are_packed_longest_first_up_to_their_padded_tokens(size, tokens, passes):
    lengths = [10, 40, 20, 60, 30, 20]
    assert micro_batches(range(6), lengths, size, tokens) == passes
    for batch in micro_batches(range(6), lengths, size, tokens):
        assert len(batch) == 1 or len(batch) * max(lengths[r] for r in batch) <= (tokens or float("inf"))
    assert micro_batches([4, 1], lengths, None, 100) == [[1, 4]]  # a worker's share: only its rows


def test_micro_batches_and_gradient_checkpointing_leave_the_gradient_unchanged(model_path, qwen2_path):
    samples, advantages = _samples(count=8), [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.1, -0.1]
    whole = GRPOLearner(model_path, "float64", TrainerConfig(optimizer={"learning_rate": 1e-3}), 1.0)
    parts = GRPOLearner(
        model_path, "float64", TrainerConfig(optimizer={"learning_rate": 1e-3}, micro_batch_size=3), 1.0
    )
    first = whole.compute_gradients(samples, advantages)
    second = parts.compute_gradients(samples, advantages)
    assert torch.allclose(_gradient(whole), _gradient(parts), atol=1e-12, rtol=0)
    assert (
        float(first["loss"]) == pytest.approx(float(second["loss"]), abs=1e-12) and first["tokens"] == second["tokens"]
    )
    small = _samples(vocab_size=40, count=4)
    plain = GRPOLearner(qwen2_path, "float32", TrainerConfig(model={"kind": "transformers"}), 1.0)
    checkpointed = GRPOLearner(
        qwen2_path, "float32", TrainerConfig(model={"kind": "transformers", "gradient_checkpointing": True}), 1.0
    )
    plain.compute_gradients(small, advantages[:4])
    checkpointed.compute_gradients(small, advantages[:4])
    assert torch.allclose(_gradient(plain), _gradient(checkpointed), atol=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_trains_the_adapters_and_engines_get_merged_weights(qwen2_path, dtype):
    from bubblespec.core.config import LoraSettings

    config = TrainerConfig(
        optimizer={"learning_rate": 1e-2},
        model={"kind": "transformers", "lora": LoraSettings(rank=4, target_modules=["q_proj", "down_proj"])},
    )
    learner = GRPOLearner(qwen2_path, dtype, config, 1.0)
    base = {n: t.clone() for n, t in learner.master._base_state().items()}
    assert all(p.dtype == torch.float32 for p in learner.parameters) and len(learner.parameters) == 2 * 2 * 2
    learner.step(_samples(vocab_size=40, count=8))
    merged = learner.state_dict()
    changed = {n for n in base if not torch.equal(merged[n], base[n].to(merged[n].dtype))}
    assert changed and all(n.endswith(("q_proj.weight", "down_proj.weight")) for n in changed)
    assert all(torch.equal(t, base[n]) for n, t in learner.master._base_state().items())  # the base is not trained
    assert all(t.dtype == getattr(torch, dtype) for t in merged.values())
    resumed = GRPOLearner(qwen2_path, dtype, config, 1.0)
    resumed.load_checkpoint_state(learner.checkpoint_state() | {"weights": merged})
    assert all(torch.equal(resumed.state_dict()[n], merged[n]) for n in merged)


def test_lora_adapters_start_the_same_in_every_learner(qwen2_path):
    """A run must be reproducible: peft draws A from the global RNG, which differs between two learners of a
    process (and between processes) unless the adapters' initialisation is seeded."""
    from bubblespec.core.config import LoraSettings

    config = TrainerConfig(model={"kind": "transformers", "lora": LoraSettings(rank=4, target_modules=["q_proj"])})
    first = GRPOLearner(qwen2_path, "float32", config, 1.0).master.adapter_state()
    torch.rand(100)  # the global RNG moves on, as anything else in the process would make it
    second = GRPOLearner(qwen2_path, "float32", config, 1.0).master.adapter_state()
    assert first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)
    other = TrainerConfig(
        model={"kind": "transformers", "lora": LoraSettings(rank=4, target_modules=["q_proj"], init_seed=1)}
    )
    third = GRPOLearner(qwen2_path, "float32", other, 1.0).master.adapter_state()
    assert any(not torch.equal(first[n], third[n]) for n in first)


def test_lora_and_gradient_checkpointing_are_settings_of_the_transformers_model():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"model\.builtin\.lora\s+Extra inputs are not permitted"):
        TrainerConfig(model={"lora": {"rank": 4}})
    with pytest.raises(ValidationError, match=r"model\.builtin\.gradient_checkpointing\s+Extra inputs"):
        TrainerConfig(model={"kind": "builtin", "gradient_checkpointing": True})
    assert TrainerConfig(model={"kind": "transformers", "lora": {"rank": 4}}).lora.rank == 4


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_the_learner_trains_on_the_configured_advantages(model_path, advantage):
    from bubblespec.rl.learner import sample_advantages

    samples = _samples(count=8)
    metrics = GRPOLearner(model_path, "float32", TrainerConfig(loss={"advantage": advantage}), 1.0).step(samples)
    expected = sample_advantages(samples, advantage)
    assert metrics["mean_advantage_abs"] == pytest.approx(sum(map(abs, expected)) / len(expected))


def test_warm_up_then_cosine_schedule_and_it_resumes(model_path):
    import math

    config = TrainerConfig(
        optimizer={"learning_rate": 1e-3, "schedule": {"warmup_steps": 2, "kind": "cosine", "decay_steps": 6}}
    )
    learner = GRPOLearner(model_path, "float32", config, 1.0)
    rates = []
    for step in range(4):
        rates.append(learner.optimizer.param_groups[0]["lr"])
        learner.step(_samples(count=4, seed=step))
    # the cosine starts from the peak right after the warm-up
    expected = [0.5e-3, 1e-3, 1e-3, 1e-3 * 0.5 * (1 + math.cos(math.pi / 4))]
    assert rates == pytest.approx(expected, rel=1e-12)
    resumed = GRPOLearner(model_path, "float32", config, 1.0)
    resumed.load_checkpoint_state(learner.checkpoint_state() | {"weights": learner.master.state_dict()})
    assert resumed.optimizer.param_groups[0]["lr"] == learner.optimizer.param_groups[0]["lr"]
    with pytest.raises(ValueError, match=r"schedule\.cosine\.decay_steps\s+Field required"):
        TrainerConfig(optimizer={"schedule": {"kind": "cosine"}})
    with pytest.raises(ValueError, match="decay_steps 2 must be above warmup_steps 2"):
        TrainerConfig(optimizer={"schedule": {"kind": "cosine", "warmup_steps": 2, "decay_steps": 2}})


def test_weight_decay_shrinks_the_weights_adamw_style(model_path):
    samples = _samples(count=4)
    plain = GRPOLearner(model_path, "float64", TrainerConfig(optimizer={"learning_rate": 1e-3}), 1.0)
    decayed = GRPOLearner(
        model_path, "float64", TrainerConfig(optimizer={"learning_rate": 1e-3, "weight_decay": 0.1}), 1.0
    )
    before = plain.master.state_dict()
    plain.step(samples)
    decayed.step(samples)
    after_plain, after_decayed = plain.master.state_dict(), decayed.master.state_dict()
    for name in before:  # decoupled: w <- w * (1 - lr * wd) then the same Adam update
        assert torch.allclose(after_decayed[name], after_plain[name] - 1e-3 * 0.1 * before[name], atol=1e-15)
