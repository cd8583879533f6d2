"""The learner under the settings users turn on, with responses of different lengths: padding that changes nothing
(with sampling filters, sequence ratios, KL, entropy, epochs, CISPO), non-finite numbers that stop a step with an
error naming it, the rule for steps without signal, DAPO's filter on accuracy, the logprob agreement measured
before any update, a learning-rate schedule in RL steps, and one worker's bad input refused by all of them."""

from __future__ import annotations

import collections
import math
import warnings

import pytest
import torch

from bubblespec.core.config import TrainerConfig
from bubblespec.core.errors import NonFiniteError
from bubblespec.rl.learner import GRPOLearner, TrainSample

from .conftest import write_checkpoint
from .trainer_settings import trainer_config
from .workers import run_workers

TEMPERATURE, TOP_K = 0.7, 5


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A random Llama with a 32,000-token vocabulary (top-k keeps 5 of them)."""
    return str(write_checkpoint(tmp_path_factory.mktemp("settings-model"), vocab_size=32000, context=128, seed=8))


def _engine_samples(
    model_path: str, lengths: tuple[int, ...], top_k: int = TOP_K, suppressed: tuple[int, ...] = ()
) -> list[TrainSample]:
    """Responses the float64 torch engine sampled at temperature 0.7 with top-k (and without the ``suppressed``
    tokens), of the given lengths, with its logprobs; rewards alternate within each group of two."""
    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.core.interfaces import GenerationRequest, RolloutKey, SamplingParams

    engine = TorchEngine.from_pretrained(model_path, dtype="float64", max_batch_size=len(lengths))
    requests = [
        GenerationRequest(
            (1, 7 + i, 9),
            RolloutKey(0, 0, f"p{i // 2}", i % 2),
            SamplingParams(
                temperature=TEMPERATURE, top_k=top_k, max_new_tokens=n, ignore_eos=True, suppressed_token_ids=suppressed
            ),  # fmt: skip
        )
        for i, n in enumerate(lengths)
    ]
    return [
        TrainSample(
            r.prompt_token_ids,
            tuple(res.token_ids),
            i // 2,
            float(i % 2),
            engine_logprobs=tuple(res.logprobs),
            max_response_tokens=max(lengths),
        )  # fmt: skip
        for i, (r, res) in enumerate(zip(requests, engine.generate(requests), strict=True))
    ]


def _learner(model_path: str, settings: dict | None = None) -> GRPOLearner:
    config = trainer_config({"optimizer.learning_rate": 1e-2, "loss.sampling_filters": True} | (settings or {}))
    return GRPOLearner(model_path, "float64", config, TEMPERATURE, top_k=TOP_K)


def _weights(learner: GRPOLearner) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in learner.master.state_dict().items()}


SETTINGS = [
    {},
    {"loss.policy.importance_ratio": "sequence"},
    {"kl.coef": 0.1},
    {"kl.coef": 0.1, "kl.penalty": "reward", "kl.estimator": "k1"},
    {"ppo_epochs": 2, "mini_batch_size": 2},
    {"loss.policy.kind": "cispo"},
    {"loss.entropy_coef": 0.01},
    {"loss.old_logprobs": "engine", "mini_batch_size": 2, "loss.aggregation": "token-mean"},
    {"loss.tis_cap": 2.0, "loss.aggregation": "seq-mean-token-sum-norm"},
]


SPLITS = [{"micro_batch_size": 1}, {"micro_batch_tokens": 40}, {"micro_batch_tokens": 64, "micro_batch_size": 3}]
"""Micro-batches of one sample each (no padding at all), and packed longest first by padded tokens: with prompts of
3 tokens, 40 packs two samples per pass, and 64 three where ``micro_batch_size`` stops a fourth."""


@pytest.mark.parametrize("lengths", [(12, 6, 9, 3), (12, 12, 12, 12)], ids=["padded", "equal"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "defaults")
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_padding_changes_nothing_with_sampling_filters(model_path, settings, lengths, split):
    """Two steps with top-k 5 over 32,000 tokens: the padded batch trains exactly as micro-batches (of one sample
    each, or packed longest first by ``micro_batch_tokens``), every number finite, the trainer's logprobs the
    engine's."""
    samples = _engine_samples(model_path, lengths)
    padded, unpadded = _learner(model_path, settings), _learner(model_path, settings | split)
    for step in range(2):
        metrics, alone = padded.step(samples), unpadded.step(samples)
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
        assert metrics["loss"] == pytest.approx(alone["loss"], rel=1e-9, abs=1e-12)
        assert metrics["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-9)
        if step == 0:  # the weights the engine sampled with
            assert metrics["logprob_diff_max"] < 1e-10
    weights, reference = _weights(padded), _weights(unpadded)
    assert all(torch.isfinite(weights[k]).all() for k in weights)
    assert all(torch.allclose(weights[k], reference[k], rtol=0, atol=1e-12) for k in weights)


def test_the_entropy_gradient_is_finite_at_every_filtered_token(model_path):
    samples = _engine_samples(model_path, (12, 12, 12, 12))
    learner = _learner(model_path, {"loss.entropy_coef": 0.01})
    learner.compute_gradients(samples, [1.0, -1.0, 1.0, -1.0])
    gradients = torch.cat([p.grad.flatten() for p in learner.parameters])
    assert torch.isfinite(gradients).all() and gradients.abs().sum() > 0


def test_a_sampled_token_the_trainer_would_filter_keeps_a_finite_logprob(model_path):
    """Responses sampled with top-k 20 scored under top-k 5: tokens outside the trainer's five keep their
    probability instead of -inf (the engine's filter kept them)."""
    samples = _engine_samples(model_path, (12, 6), top_k=20)
    logprobs = _learner(model_path).response_logprobs(samples)
    assert all(torch.isfinite(row).all() for row in logprobs)


@pytest.mark.parametrize("top_k", [TOP_K, 0], ids=["top-k", "temperature-only"])
def test_the_trainer_scores_without_the_suppressed_tokens_as_the_engine_sampled(model_path, top_k):
    """Suppressing the two tokens sampled most: the engine never samples them, and the trainer's logprobs are the
    engine's (top-k decided after the suppression); a trainer that ignored them would not be; a response that
    holds one is refused by name."""
    plain = _engine_samples(model_path, (12, 12, 12, 12), top_k=top_k)
    common = collections.Counter(t for s in plain for t in s.response_token_ids).most_common(2)
    suppressed = tuple(token for token, _ in common)
    samples = _engine_samples(model_path, (12, 6, 9, 3), top_k=top_k, suppressed=suppressed)
    assert not {t for s in samples for t in s.response_token_ids} & set(suppressed)
    config = trainer_config({"optimizer.learning_rate": 1e-2, "loss.sampling_filters": True})
    learner = GRPOLearner(model_path, "float64", config, TEMPERATURE, top_k=top_k, suppressed_token_ids=suppressed)
    assert learner.step(samples)["logprob_diff_max"] < 1e-10
    ignoring = GRPOLearner(model_path, "float64", config, TEMPERATURE, top_k=top_k)
    assert ignoring.step(samples)["logprob_diff_max"] > 1e-4
    with pytest.raises(ValueError, match=r"response \d+ holds token \d+ at position \d+, a suppressed token"):
        learner.response_logprobs(plain)


def test_a_non_finite_loss_is_an_error_naming_the_step_and_no_weight_changes(model_path):
    samples = _engine_samples(model_path, (12, 6, 9, 3))
    learner = _learner(model_path, {"ppo_epochs": 2, "mini_batch_size": 2})
    with torch.no_grad():
        learner.master.weights["model.norm.weight"][0] = math.nan
    before = _weights(learner)
    with pytest.raises(NonFiniteError, match=r"step 7, epoch 1 of 2, mini-batch 1 of 2: the loss of samples \[0, 1\]"):
        learner.step(samples, at_step=7)
    after = _weights(learner)
    assert all(torch.allclose(after[k], before[k], rtol=0, atol=0, equal_nan=True) for k in before)


def test_a_non_finite_gradient_is_an_error_before_the_optimizer_step(model_path):
    samples = _engine_samples(model_path, (12, 6, 9, 3))
    learner = _learner(model_path)
    learner.parameters[0].register_hook(lambda gradient: gradient * math.inf)
    before = _weights(learner)
    with pytest.raises(NonFiniteError, match="step 3: the gradient norm is (inf|nan)"):
        learner.step(samples, at_step=3)
    after = _weights(learner)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_a_reward_that_is_not_a_number_is_refused_by_name(model_path):
    samples = _engine_samples(model_path, (3, 3))
    bad = [samples[0], TrainSample(samples[1].prompt_token_ids, samples[1].response_token_ids, 0, math.nan)]
    with pytest.raises(ValueError, match="sample 1 has reward nan"):
        _learner(model_path).step(bad)


def test_non_finite_logits_are_an_engine_error_that_says_so(model_path):
    """Before, a row of NaN logits gave the out-of-vocabulary sentinel token (an IndexError further on)."""
    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.core.interfaces import GenerationRequest, RolloutKey, SamplingParams
    from bubblespec.verify.sampling import keyed_sample

    logits = torch.randn(2, 1, 32000, dtype=torch.float64)
    logits[1, 0, 7] = math.nan
    seeds, positions = torch.tensor([[1, 2], [3, 4]]), torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(NonFiniteError, match="not finite numbers in 1 of 2 rows"):
        keyed_sample(logits, seeds, positions, torch.ones(2), torch.full((2,), TOP_K), torch.ones(2))
    engine = TorchEngine.from_pretrained(model_path, dtype="float64", max_batch_size=2)
    weights = {"model.norm.weight": torch.full((32,), math.nan, dtype=torch.float64)}
    engine.update_weights(weights, version=1)
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_new_tokens=4)
    with pytest.raises(NonFiniteError, match="not finite"):
        engine.generate([GenerationRequest((1, 7, 9), RolloutKey(0, 0, "p", 0), params)])


def test_the_end_to_end_run_with_sampling_filters_trains_finite_steps(tmp_path):
    """The arithmetic task on the virtual clock with trainer.sampling_filters and top-k 5: two steps, finite."""
    from bubblespec.core.config import validate
    from bubblespec.observe.run_dir import RunDirectory
    from bubblespec.run.launch import run

    config = validate({
        "name": "filters", "output_dir": str(tmp_path), "num_steps": 2, "metrics": {"enabled": False},
        "task": {"prompts_per_step": 4, "samples_per_prompt": 4},
        "rollout": {"num_ranks": 2, "sampling": {"top_k": 5}},
        "clock": {"kind": "virtual"},
        "trainer": {"loss": {"sampling_filters": True}, "optimizer": {"learning_rate": 1e-3}},
    })  # fmt: skip
    run(config)
    steps = RunDirectory(config.run_dir).read_steps()
    assert [s.step for s in steps] == [0, 1]
    assert all(math.isfinite(s.train["loss"]) and math.isfinite(s.train["grad_norm"]) for s in steps)


# -- which steps train ---------------------------------------------------------------------------------------------


def _groups(rewards: list[tuple[float, ...]], length: int = 4) -> list[TrainSample]:
    return [
        TrainSample((1, 5 + g), tuple(range(10 + i, 10 + i + length)), group=g, reward=r)
        for g, group in enumerate(rewards)
        for i, r in enumerate(group)
    ]


def test_equal_rewards_that_do_not_add_up_exactly_take_no_step(model_path):
    """Groups of three rewards of 0.1: their mean is not exactly 0.1, and before, advantages of 1e-11 let Adam move
    the weights by a whole learning rate. The schedule still moves, without torch's warning about it."""
    learner = GRPOLearner(model_path, "float64", TrainerConfig(optimizer={"learning_rate": 1e-2}), 1.0)
    before = _weights(learner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the schedule's step before any optimizer step warned on every such step
        assert learner.step(_groups([(0.1, 0.1, 0.1), (0.3, 0.3, 0.3)]))["skipped"] == 1
    after = _weights(learner)
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("settings", [{"kl.coef": 0.5}, {"loss.entropy_coef": 0.1}], ids=["kl in the loss", "entropy"])
def test_a_kl_or_entropy_term_trains_even_without_reward_signal(model_path, settings):
    learner = GRPOLearner(model_path, "float64", trainer_config({"optimizer.learning_rate": 1e-2} | settings), 1.0)
    learner.step(_groups([(0.0, 1.0), (1.0, 0.0)]))  # the policy leaves the reference: a KL to pull it back
    before = _weights(learner)
    metrics = learner.step(_groups([(1.0, 1.0), (0.0, 0.0)]))
    assert metrics["skipped"] == 0 and metrics["grad_norm"] > 0
    after = _weights(learner)
    assert any(not torch.equal(after[k], before[k]) for k in before)


def test_dapo_filters_groups_on_accuracy_not_on_length_shaped_rewards(model_path):
    """Group 0 is all wrong, with lengths 8 and 16 in a 4-token overlong buffer: its shaped rewards differ
    (0 and -1) but it carries no accuracy signal, and DAPO drops it."""
    samples = [
        TrainSample((1, 5), tuple(range(10, 10 + n)), group=g, reward=r, max_response_tokens=16)
        for g, pairs in enumerate([((8, 0.0), (16, 0.0)), ((8, 1.0), (8, 0.0))])
        for n, r in pairs
    ]
    config = TrainerConfig(dapo={"filter_groups": True, "overlong_buffer": 4})
    metrics = GRPOLearner(model_path, "float64", config, 1.0).step(samples)
    assert (metrics["groups_kept"], metrics["groups_dropped"]) == (1, 1)
    assert metrics["trained_tokens"] == 16


def test_the_logprob_agreement_is_measured_before_any_update(model_path):
    """Four mini-batches against the engine's old logprobs: the float64 engine and trainer agree to 1e-10 before
    the first update; measured after the first updates, as before, they differed by the updates."""
    samples = _engine_samples(model_path, (12, 6, 9, 3, 12, 6, 9, 3))
    learner = _learner(model_path, {"loss.old_logprobs": "engine", "mini_batch_size": 2})
    metrics = learner.step(samples)
    assert metrics["optimizer_steps"] == 4 and metrics["logprob_diff_max"] < 1e-10
    assert metrics["ratio_max"] - metrics["ratio_min"] > 1e-3  # the updates did move the policy


def test_the_schedule_counts_rl_steps_whatever_the_optimizer_steps(model_path):
    """Two epochs of two mini-batches (four optimizer steps per RL step) and a step without signal: warm-up and
    cosine advance once per RL step, so decay_steps: num_steps ends the decay with the run."""
    config = TrainerConfig(
        optimizer={"learning_rate": 1e-3, "schedule": {"kind": "cosine", "warmup_steps": 2, "decay_steps": 6}},
        ppo_epochs=2,
        mini_batch_size=2,
    )
    learner = GRPOLearner(model_path, "float64", config, 1.0)
    signal, none = _groups([(0.0, 1.0), (1.0, 0.0)]), _groups([(1.0, 1.0), (0.0, 0.0)])
    rates = []
    for batch in (signal, none, signal, signal):
        rates.append(learner.optimizer.param_groups[0]["lr"])
        metrics = learner.step(batch)
        assert metrics["optimizer_steps"] == (4 if batch is signal else 0)
    assert rates == pytest.approx([0.5e-3, 1e-3, 1e-3, 1e-3 * 0.5 * (1 + math.cos(math.pi / 4))], rel=1e-12)
    assert learner.step(signal)["learning_rate"] == pytest.approx(0.5e-3, rel=1e-12)


# -- one worker's bad input ----------------------------------------------------------------------------------------


def test_engine_logprobs_two_tokens_short_are_one_clear_error_on_every_worker(model_path):
    """Sample 1 (worker 1's share) has engine logprobs two tokens short. Before, worker 1 raised while measuring
    the agreement outside the failure agreement and worker 0 waited in an all-reduce until the timeout."""
    samples = _engine_samples(model_path, (6, 6, 6, 6))
    short = samples[1]
    samples[1] = TrainSample(short.prompt_token_ids, short.response_token_ids, short.group, short.reward,
                             engine_logprobs=short.engine_logprobs[:-2])  # fmt: skip
    config = TrainerConfig(kl={"coef": 0.1, "penalty": "reward"}, ppo_epochs=2)
    raised = []

    def work(rank, learner):
        with pytest.raises(ValueError, match="sample 1 has 4 engine logprobs for its 6 response tokens"):
            learner.step(samples, rank=rank, world=2)
        raised.append(rank)

    build = lambda rank, all_reduce: GRPOLearner(model_path, "float64", config, 1.0, all_reduce=all_reduce)  # noqa: E731
    run_workers(2, build, work, timeout_s=60)
    assert sorted(raised) == [0, 1]


@pytest.mark.parametrize("settings", [{}, {"ppo_epochs": 2, "kl.coef": 0.1, "kl.penalty": "reward"}],
                         ids=["in the update", "before the updates"])  # fmt: skip
def test_a_failure_on_one_worker_stops_its_peer_wherever_it_happens(model_path, settings):
    from bubblespec.rl.learner import PeerFailed

    batch = [TrainSample((1, 5), (6, 2, 7), group=0, reward=1.0), TrainSample((1, 5), (10**6, 2), group=0, reward=0.0)]

    def work(rank, learner):
        with pytest.raises(IndexError if rank == 1 else PeerFailed):
            learner.step(batch, rank=rank, world=2)

    build = lambda rank, all_reduce: GRPOLearner(  # noqa: E731
        model_path, "float64", trainer_config(settings), 1.0, all_reduce=all_reduce
    )
    run_workers(2, build, work, timeout_s=60)
