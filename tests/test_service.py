"""The rollout service on its own, as a trainer of another framework uses it: generate, train elsewhere,
update_weights, generate again; drafts from the bubble make the next step faster and change no response."""

from __future__ import annotations

import pytest

from bubblespec.core.config import ServiceConfig, TrainerConfig, validate
from bubblespec.rl.learner import GRPOLearner, TrainSample
from bubblespec.run.assembly import start_service
from bubblespec.tasks import ArithmeticTask

SAMPLES = 2


def _service_config(enabled: bool, **speculation) -> ServiceConfig:
    return ServiceConfig(
        seed=3,
        model={"dtype": "float64"},
        rollout={"num_ranks": 2},
        speculation={"enabled": enabled} | speculation,
        clock={"kind": "virtual", "profile": "h100-7b"},
    )


def _three_steps(enabled: bool):
    """Three steps of a trainer outside bubblespec: prompts from the task, rewards from it, a learner of its own."""
    from bubblespec.core.interfaces import SamplingParams

    task = ArithmeticTask(seed=0, prompts_per_step=6)
    path = str(ArithmeticTask.model_path())
    sampling = SamplingParams(max_new_tokens=48)  # the engine stops at the model's EOS
    learner = GRPOLearner(path, "float64", TrainerConfig(optimizer={"learning_rate": 1e-3}), 1.0)
    outcomes = []
    with start_service(_service_config(enabled), path, sampling, SAMPLES, peek=task.peek) as service:
        for step in range(3):
            prompts = task.batch(step)
            outcome = service.generate(step, prompts, SAMPLES)
            requests = service.requests(step, prompts, SAMPLES)
            by_uid = {p.uid: p for p in prompts}
            samples = [
                TrainSample(
                    tuple(q.prompt_token_ids),
                    tuple(r.token_ids),
                    i // SAMPLES,
                    float(task(by_uid[r.key.prompt_uid], r.token_ids)),
                )  # fmt: skip
                for i, (q, r) in enumerate(zip(requests, outcome.results, strict=True))
            ]
            learner.step(samples)
            service.update_weights(learner.state_dict(), version=step + 1)
            outcomes.append(outcome)
    return outcomes


def test_a_trainer_outside_bubblespec_gets_the_same_responses_faster():
    plain, drafted = _three_steps(False), _three_steps(True)
    for off, on in zip(plain, drafted, strict=True):
        assert [(r.key, r.token_ids) for r in off.results] == [(r.key, r.token_ids) for r in on.results]
    decode = [sum(rank.decode_steps for rank in outcome.ranks) for outcome in drafted]
    plain_decode = [sum(rank.decode_steps for rank in outcome.ranks) for outcome in plain]
    assert decode[0] == plain_decode[0]  # nothing drafted before the first step
    assert all(d < p for d, p in zip(decode[1:], plain_decode[1:], strict=True))
    assert all(sum(rank.requests_with_draft for rank in outcome.ranks) > 0 for outcome in drafted[1:])


def test_a_service_config_takes_its_sections_from_a_run_config():
    run = validate({"seed": 7, "rollout": {"num_ranks": 3}, "speculation": {"lookahead_steps": 2}})
    service = ServiceConfig.of_run(run)
    assert service.seed == 7 and service.rollout.num_ranks == 3 and service.speculation.lookahead_steps == 2
    with pytest.raises(ValueError, match="trainer"):
        ServiceConfig(trainer={})


def test_colocated_ranks_release_their_memory_while_the_trainer_trains_and_nothing_changes(tmp_path):
    """ray.colocated: every training phase is framed by release() and resume() of the engines, nothing drafts
    then, and the run's rollouts equal those of ranks on hardware of their own."""
    from unittest import mock

    from bubblespec.observe.run_dir import RunDirectory
    from bubblespec.run.launch import run

    base = {"output_dir": str(tmp_path), "num_steps": 3, "model": {"dtype": "float64"}, "metrics": {"enabled": False},
            "task": {"prompts_per_step": 4, "samples_per_prompt": 2}, "clock": {"kind": "virtual"},
            "rollout": {"sampling": {"max_new_tokens": 48}}}  # fmt: skip
    calls: list[str] = []

    def recorded(name):
        def call(engine):
            calls.append(name)

        return call

    with mock.patch("bubblespec.backends.torch_engine.TorchEngine.release", recorded("release")), \
         mock.patch("bubblespec.backends.torch_engine.TorchEngine.resume", recorded("resume")):  # fmt: skip
        run(validate(base | {"name": "colocated", "ray": {"colocated": True}}))
    assert calls == ["release", "resume"] * 3
    run(validate(base | {"name": "separate"}))
    digests = [[s.rollout_digest for s in RunDirectory(tmp_path / n).read_steps()] for n in ("colocated", "separate")]
    assert digests[0] == digests[1]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"ray": {"colocated": True}, "speculation": {"draft_during_training": True}},
         "draft_during_training needs ranks on hardware of their own; with ray.colocated"),
        ({"ray": {"colocated": True}, "speculation": {"draft_during_training": 1}},
         "draft_during_training needs ranks on hardware of their own; with ray.colocated"),
        ({"trainer": {"device": "cuda", "gpus_per_worker": 0}}, "trainer.device cuda needs a GPU per worker"),
        ({"rollout": {"gpus_per_rank": -1}}, "rollout.gpus_per_rank: Input should be greater than or equal to 0"),
    ],
)  # fmt: skip
def test_placement_settings_that_cannot_work_are_config_errors(changes, message):
    from bubblespec.core.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        validate(changes)


@pytest.mark.parametrize(
    ("changes", "drafts", "why"),
    [
        ({}, 0, "the ranks run on CPU cores the trainer may use"),  # the README's main job: wall clock, CPU
        ({"rollout": {"gpus_per_rank": 1}}, 2, "the ranks reserve GPUs of their own"),
        ({"rollout": {"gpus_per_rank": 1}, "ray": {"colocated": True}}, 0, "ray.colocated"),
        ({"ray": {"rollout_nodes": {"role": "rollout"}, "trainer_nodes": {"role": "train"}}}, 2, "nodes of their"),
        ({"ray": {"rollout_nodes": {"role": "any"}, "trainer_nodes": {"role": "any"}}}, 0, "CPU cores"),
        ({"clock": {"kind": "virtual", "profile": "h100-7b"}}, 0, "on the virtual clock set it true"),
        ({"rollout": {"gpus_per_rank": 1}, "speculation": {"enabled": False}}, 0, "nothing"),
        ({"speculation": {"draft_during_training": True}}, 2, "speculation.draft_during_training: true"),
        ({"clock": {"kind": "virtual", "profile": "h100-7b"}, "speculation": {"draft_during_training": False}},
         0, "speculation.draft_during_training: false"),
        # bench-wall's setting on 2 CPU cores: the one rank of two a core is left for beside the trainer
        ({"speculation": {"draft_during_training": 1}}, 1, "speculation.draft_during_training: 1 (the first ranks)"),
    ],
)  # fmt: skip
def test_drafting_while_training_is_decided_from_the_placement_unless_set(changes, drafts, why):
    """``auto`` (the default) drafts while the trainer trains with every rank where the ranks have hardware of their
    own, with none where they share the trainer's; an explicit setting wins (true: every rank, a number: that many);
    the reason is what the run prints."""
    decided, reason = validate(changes | {"rollout": {"num_ranks": 2} | changes.get("rollout", {})}).training_drafting()
    assert decided == drafts
    assert why in reason
    assert reason.startswith("auto: ") == ("draft_during_training" not in changes.get("speculation", {}))


def test_a_run_drafts_while_training_as_decided(tmp_path):
    """A run's service follows the decision (the step records carry the drafting's timelines): on the virtual
    clock only when told to."""
    from bubblespec.run.launch import run

    drafted = {}
    for setting in ("auto", True):
        config = validate({
            "name": str(setting), "output_dir": str(tmp_path), "num_steps": 3,
            "task": {"prompts_per_step": 4, "samples_per_prompt": 2}, "rollout": {"num_ranks": 2},
            "clock": {"kind": "virtual", "profile": "h100-7b"}, "metrics": {"enabled": False},
            "speculation": {"draft_during_training": setting, "lookahead_steps": 2},
        })  # fmt: skip
        steps = []
        run(config, on_step=steps.append)
        drafted[setting] = [s.training_timelines is not None for s in steps]
    # Step 0's bubble drafts step 1's keys, and step 2's are left for its training; the last step drafts nothing
    # while it trains: no step comes after it.
    assert drafted["auto"] == [False, False, False]
    assert drafted[True][0] and not drafted[True][-1]


def test_keys_a_late_bubble_chunk_held_are_drafted_while_training(tmp_path):
    """Two ranks on the virtual clock with collatz responses: the first rank to finish takes every key of the next
    step a moment before the barrier, and the barrier cuts that chunk off before its first pass (a late chunk with
    no draft). Its keys go back to the plan, and the ranks draft them while the trainer trains."""
    from bubblespec.run.launch import run

    config = validate({
        "name": "late", "output_dir": str(tmp_path), "num_steps": 2, "model": {"dtype": "float64"},
        "task": {"name": "collatz", "prompts_per_step": 4, "samples_per_prompt": 2,
                 "options": {"max_digits": 4, "max_response_tokens": 256}},
        "rollout": {"num_ranks": 2}, "clock": {"kind": "virtual", "profile": "h100-7b"},
        "metrics": {"enabled": False}, "speculation": {"draft_during_training": True},
    })  # fmt: skip
    steps = []
    run(config, on_step=steps.append)
    first = steps[0]
    assert not any(rank.draft_requests for rank in first.ranks)  # the bubble's chunk made no draft
    assert first.training_timelines and any(timeline for timeline in first.training_timelines)
    assert steps[1].draft_coverage > 0


def test_gpus_per_worker_defaults_to_one_on_cuda_and_bad_draft_store_options_are_named():
    from bubblespec.core.errors import ConfigError

    assert validate({"trainer": {"device": "cuda"}}).trainer.worker_gpus == 1
    assert validate({}).trainer.worker_gpus == 0
    assert validate({"trainer": {"gpus_per_worker": 0.5}}).trainer.worker_gpus == 0.5
    config = ServiceConfig(speculation={"draft_store_options": {"label_selector": {"role": "store"}}},
                           clock={"kind": "virtual"})  # fmt: skip
    from bubblespec.core.interfaces import SamplingParams

    path = str(ArithmeticTask.model_path())
    with pytest.raises(
        ConfigError, match=r"draft_store_options .* do not suit the 'memory' draft store: .*label_selector"
    ):
        with start_service(config, path, SamplingParams(max_new_tokens=8), 1):
            pass


def test_a_failed_trainers_error_is_not_replaced_by_the_ranks_errors_after_it(caplog):
    """The trainer failed (``training_ended(0.0)``, its error on its way to the caller): an error stopping the ranks'
    drafting or collecting the draft head's round is logged, not raised over it; after a trainer that did not fail,
    the same error is raised."""
    import logging

    from bubblespec.core.interfaces import SamplingParams

    task = ArithmeticTask(seed=0, prompts_per_step=4)
    config = _service_config(True, draft_head={"enabled": True})
    path = str(ArithmeticTask.model_path())

    def fails(*args, **kwargs):
        raise RuntimeError("rank 1 lost")

    with start_service(config, path, SamplingParams(max_new_tokens=24), SAMPLES, peek=task.peek) as service:
        for train_seconds in (0.0, 1.0):
            service.generate(0, task.batch(0), SAMPLES)
            service.training_starts()
            service._drafting = True  # as where the ranks draft while the trainer trains
            service.ranks.stop_drafting = service.ranks.learned_head = fails
            if train_seconds:
                with pytest.raises(RuntimeError, match="rank 1 lost"):
                    service.training_ended(train_seconds)
                continue
            with caplog.at_level(logging.WARNING, logger="bubblespec.rollout.service"):
                assert service.training_ended(train_seconds) is None
            assert "drafting while the trainer trained failed too: RuntimeError: rank 1 lost" in caplog.text
            assert "the draft head's learning failed too: RuntimeError: rank 1 lost" in caplog.text
