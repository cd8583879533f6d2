"""TRL's GRPOTrainer on bubblespec's rollout (bubblespec.integrations.trl) and examples/trl_grpo.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bubblespec.core.errors import ConfigError
from bubblespec.integrations.trl import BubblespecRollout, check_trl_version
from bubblespec.tasks import ArithmeticTask

EXAMPLE = Path(__file__).parent.parent / "examples" / "trl_grpo.py"


def _example():
    spec = importlib.util.spec_from_file_location("trl_grpo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_trl_grpo_gives_identical_completions_and_fewer_decode_steps_with_speculation_on_one_and_two_processes(
    tmp_path,
):
    """The example on one process, then under ``accelerate launch`` on two (gloo, CPU) with the same generation
    batch split between them: each run is identical with speculation off and on, and the two runs' completions are
    identical (the main process generates the whole batch under the same keys)."""
    import torch

    reports, weights = [], []
    for processes in (1, 2):
        out, saved = tmp_path / f"out-{processes}.json", tmp_path / f"weights-{processes}.pt"
        example = ["--steps", "3", "--json", str(out), "--save-weights", str(saved)]
        if processes == 1:
            assert _example().main(example) == 0
        else:
            _launch(processes, example)
        reports.append(json.loads(out.read_text()))
        weights.append(torch.load(saved))
    for report, processes in zip(reports, (1, 2), strict=True):
        assert report["processes"] == processes
        assert report["identical_completions"] and report["identical_weights"]
        off, on = report["speculation_off"]["generations"], report["speculation_on"]["generations"]
        assert len(off) == len(on) == 3 and on[0]["decode_steps"] == off[0]["decode_steps"]  # nothing to draft yet
        assert all(d["decode_steps"] < p["decode_steps"] for d, p in zip(on[1:], off[1:], strict=True))
        assert all(g["draft_coverage"] > 0 for g in on[1:]) and report["decode_step_reduction_from_step_2"] > 0.2
        assert [g["global_step"] for g in on] == [0, 1, 2]
    one, two = reports
    for run in ("speculation_off", "speculation_on"):
        assert [g["completions_digest"] for g in one[run]["generations"]] == [
            g["completions_digest"] for g in two[run]["generations"]
        ]
        assert [g["decode_steps"] for g in one[run]["generations"]] == [
            g["decode_steps"] for g in two[run]["generations"]
        ]
    # The weights are TRL's: its two-process all-reduce sums the gradient in another order, and Adam magnifies those
    # last-bit differences where a gradient is near 0; one step's update is about 1e-4.
    for name, tensor in weights[0].items():
        assert torch.allclose(tensor, weights[1][name], rtol=0, atol=1e-5), name


def _launch(processes: int, example: list[str]) -> None:
    """examples/trl_grpo.py under ``accelerate launch`` on ``processes`` CPU processes (gloo)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes)]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += ["--main_process_port", str(port), str(EXAMPLE), *example]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


@pytest.mark.slow
def test_a_resumed_trl_run_gives_the_uninterrupted_run_s_completions_and_weights(tmp_path):
    """The speculation-on run stops after 2 of 4 steps with a checkpoint and a new trainer resumes from it: its
    generations 2 and 3 have the keys, completions and final weights of the uninterrupted speculation-off run."""
    out = tmp_path / "out.json"
    assert _example().main(["--steps", "4", "--resume-at", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    resumed = report["speculation_on"]["generations"]
    assert [(g["generation"], g["global_step"]) for g in resumed] == [(2, 2), (3, 3)]
    assert report["identical_completions"] and report["identical_weights"]
    assert resumed[1]["draft_coverage"] > 0  # the resumed service drafts again from its first generation on


@pytest.mark.parametrize(
    ("global_step", "accumulation", "per_generation", "iterations", "before", "exact"),
    [
        (0, 1, 1, 1, 0, True),  # a run's start
        (2, 1, 1, 1, 2, True),  # one generation batch per optimizer step
        (4, 2, 2, 2, 2, True),  # a batch every 4 micro-steps, 2 per optimizer step: 8 micro-steps done
        (3, 2, 2, 2, 2, False),  # 6 micro-steps: inside the second batch, TRL generates afresh as the third
    ],
)
def test_a_resumed_run_s_generation_index_goes_on_from_the_checkpoint_s_steps(
    global_step, accumulation, per_generation, iterations, before, exact
):
    from types import SimpleNamespace

    from bubblespec.integrations.trl import _generations_before

    trainer = SimpleNamespace(
        args=SimpleNamespace(gradient_accumulation_steps=accumulation, steps_per_generation=per_generation),
        num_iterations=iterations,
        state=SimpleNamespace(global_step=global_step),
        _step=0,
    )
    if exact:
        assert _generations_before(trainer) == before
    else:
        with pytest.warns(UserWarning, match="inside a generation batch.*save_steps a multiple of 2 resumes exactly"):
            assert _generations_before(trainer) == before


def test_an_error_on_the_main_process_reaches_the_others_with_its_message():
    from bubblespec.integrations.trl import _portable

    refused = _portable(ConfigError("bubblespec's TRL rollout takes text or chat prompts; this one carries images"))
    assert isinstance(refused, ConfigError) and "carries images" in str(refused)

    class Unpicklable(Exception):
        def __init__(self, message, handle):
            super().__init__(message)
            self.handle = handle

    travelled = _portable(Unpicklable("the ranks are gone", handle=lambda: None))
    assert isinstance(travelled, RuntimeError) and str(travelled) == "Unpicklable: the ranks are gone"


def test_an_unsupported_trl_version_names_the_supported_range():
    check_trl_version("1.16.0")
    for version in ("1.15.2", "1.17.0", "2.0.0"):
        with pytest.raises(ConfigError, match=r"supports TRL >= 1\.16\.0, < 1\.17\.0 .* has TRL " + version):
            check_trl_version(version)


def test_settings_the_rollout_cannot_honour_fail_at_construction(tmp_path):
    from trl import GRPOConfig

    path = ArithmeticTask.model_path()
    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, bf16=False, report_to="none")
    with pytest.raises(ConfigError, match=r"use_vllm=True\).*set use_vllm=False"):
        BubblespecRollout({}, path, args=args)
    with pytest.raises(ConfigError, match="not a Hugging Face model folder"):
        BubblespecRollout({}, tmp_path)
    with pytest.raises(ValueError, match="rollout"):
        BubblespecRollout({"rollout": {"num_ranks": 0}}, path)


def test_sampling_is_trl_s_own_generation_s_and_what_it_cannot_apply_is_refused_by_name(tmp_path):
    """min_p, repetition_penalty and generation_kwargs reach the rollout's sampling as TRL's own generation takes them
    (they were dropped without a word); a generation_kwargs key or a model generation_config setting that would
    change the samples and that the rollout does not apply is refused, naming it, when the rollout is built."""
    from transformers import GenerationConfig
    from trl import GRPOConfig

    from bubblespec.integrations.trl import sampling_params

    def config(**settings):
        return GRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", **settings)

    params = sampling_params(config(min_p=0.1, repetition_penalty=1.2, temperature=0.8, top_k=20), None, (2,))
    assert (params.min_p, params.repetition_penalty, params.temperature, params.top_k) == (0.1, 1.2, 0.8, 20)
    assert params.stop_token_ids == (2,) and params.max_new_tokens == config().max_completion_length
    overridden = sampling_params(config(min_p=0.1, generation_kwargs={"min_p": 0.3, "repetition_penalty": 1.5,
                                                                      "use_cache": True}), None, ())  # fmt: skip
    assert (overridden.min_p, overridden.repetition_penalty) == (0.3, 1.5)
    assert sampling_params(config(generation_kwargs={"do_sample": False}), None, ()).temperature == 0.0
    assert sampling_params(config(), GenerationConfig(min_p=0.05), ()).min_p == 0.05  # generate fills it in
    assert sampling_params(config(min_p=0.2), GenerationConfig(min_p=0.05), ()).min_p == 0.2
    suppressing = GenerationConfig(suppress_tokens=[0, 3])  # generate's SuppressTokensLogitsProcessor
    assert sampling_params(config(), suppressing, ()).suppressed_token_ids == (0, 3)
    overriding = config(generation_kwargs={"suppress_tokens": [1]})
    assert sampling_params(overriding, suppressing, ()).suppressed_token_ids == (1,)
    with pytest.raises(ConfigError, match=r"generation_kwargs \['no_repeat_ngram_size', 'typical_p'\]: bubblespec"):
        sampling_params(config(generation_kwargs={"typical_p": 0.9, "no_repeat_ngram_size": 3}), None, ())
    with pytest.raises(ConfigError, match=r"generation_config sets typical_p=0\.9, which TRL's own generation"):
        sampling_params(config(), GenerationConfig(typical_p=0.9), ())
    assert sampling_params(config(), GenerationConfig(typical_p=1.0, num_beams=1), ()).min_p == 0.0  # neutral values
    with pytest.raises(ConfigError, match="typical_p"):
        BubblespecRollout({}, ArithmeticTask.model_path(), args=config(generation_kwargs={"typical_p": 0.9}))


def test_a_trainer_with_tools_is_refused_at_the_first_call_before_a_rank_starts(tmp_path):
    """With tools TRL generates every turn after a tool call itself (transformers' generate, outside the rollout):
    refused by name at the first call, before the service starts (it trained on silently)."""
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from bubblespec.testing.random_checkpoints import write_chat_model, write_chat_tokenizer

    def add(a: int, b: int) -> int:
        """Adds two numbers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b

    folder = write_chat_model(tmp_path / "chat")  # Qwen2.5's template: one TRL accepts tools with
    write_chat_tokenizer(folder, 512, (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text())
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_vllm=False, bf16=False, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=4, max_steps=1, report_to="none", save_strategy="no",
                      disable_tqdm=True)  # fmt: skip
    with BubblespecRollout({"clock": {"kind": "virtual"}, "metrics": {"enabled": False}}, folder, args) as rollout:
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(folder),
                              reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                              train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1?"}]}] * 4),
                              processing_class=AutoTokenizer.from_pretrained(folder), rollout_func=rollout,
                              tools=[add])  # fmt: skip
        with pytest.raises(ConfigError, match=r"tools \(add\) with bubblespec's rollout: not supported.*neither keyed"):
            trainer.train()
        assert rollout._service is None and trainer.state.global_step == 0


def _trainer_on(distributed_type, *, fsdp_version=None, zero_stage=None):
    """A stand-in for a GRPOTrainer whose ``accelerator.state`` reads as accelerate's does under ``accelerate launch``
    with FSDP (``fsdp_plugin``, the ``FSDP`` distributed type) or DeepSpeed (``deepspeed_plugin.zero_stage``): FSDP
    and ZeRO-3 cannot be launched on a CPU (accelerate runs ``--use_fsdp`` there as plain ``MULTI_CPU``)."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    state = SimpleNamespace(
        distributed_type=DistributedType[distributed_type],
        fsdp_plugin=None if fsdp_version is None else SimpleNamespace(fsdp_version=fsdp_version),
        deepspeed_plugin=None if zero_stage is None else SimpleNamespace(zero_stage=zero_stage),
    )
    accelerator = SimpleNamespace(state=state, num_processes=2, is_main_process=True, process_index=0)
    return SimpleNamespace(args=SimpleNamespace(use_vllm=False), tools=[], train_dataset=[], accelerator=accelerator)


@pytest.mark.parametrize(
    ("distributed_type", "fsdp_version", "zero_stage", "named"),
    [
        ("FSDP", 1, None, "FSDP1"),
        ("FSDP", 2, None, "FSDP2"),
        ("FSDP", None, None, "FSDP"),  # ACCELERATE_USE_FSDP=true without a plugin: accelerate's FSDP type alone
        ("DEEPSPEED", None, 3, "DeepSpeed ZeRO-3"),
    ],
)
def test_a_sharded_trainer_is_refused_by_name_at_the_first_call_before_a_rank_starts(
    distributed_type, fsdp_version, zero_stage, named
):
    """Under FSDP or DeepSpeed ZeRO-3 each process holds a shard of every parameter, so the weights the main process
    would sync are shards or empty placeholders: refused at the first call, naming the setting and what works."""
    trainer = _trainer_on(distributed_type, fsdp_version=fsdp_version, zero_stage=zero_stage)
    rollout = BubblespecRollout({"clock": {"kind": "virtual"}, "metrics": {"enabled": False}},
                                ArithmeticTask.model_path())  # fmt: skip
    message = (f"{named} with bubblespec's TRL rollout: not supported, because each process holds only a shard of the "
               "weights .*shards or empty placeholders.*DDP, DeepSpeed ZeRO-1/2 or one process")  # fmt: skip
    with pytest.raises(ConfigError, match=message) as refused:
        rollout(["1+1=", "1+1="], trainer)
    assert "\n" not in str(refused.value) and rollout._service is None and not rollout._started


@pytest.mark.parametrize(
    ("distributed_type", "zero_stage"),
    [("NO", None), ("MULTI_CPU", None), ("MULTI_GPU", None), ("DEEPSPEED", 0), ("DEEPSPEED", 1), ("DEEPSPEED", 2)],
    ids=["one-process", "ddp-cpu", "ddp-gpu", "zero-0", "zero-1", "zero-2"],
)
def test_trainers_that_keep_the_full_weights_on_every_process_pass_the_sharding_check(distributed_type, zero_stage):
    from bubblespec.integrations.trl import check_unsharded

    check_unsharded(_trainer_on(distributed_type, zero_stage=zero_stage).accelerator)


def test_prompts_must_come_as_trl_repeats_them_and_carry_no_images():
    distinct = BubblespecRollout._distinct(["a", "a", "b", "b"], 2)
    assert distinct == ["a", "b"]
    with pytest.raises(ValueError, match=r"repeated 2 times in a row \(TRL's num_generations, or num_generations_eval"):
        BubblespecRollout._distinct(["a", "b", "a", "b"], 2)
    with pytest.raises(ValueError, match="3 prompts for 2 samples per prompt"):
        BubblespecRollout._distinct(["a", "a", "b"], 2)
    image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    with pytest.raises(ConfigError, match="carries images"):
        BubblespecRollout._distinct([image, image], 2)
    text = [{"role": "user", "content": [{"type": "text", "text": "1+1?"}]}]
    assert BubblespecRollout._distinct([text, text], 2) == [text]


@pytest.mark.slow
def test_chat_prompts_are_tokenized_as_trl_does_and_train(tmp_path):
    """A random Qwen2-shaped chat model with a 32,000-token ChatML tokenizer: our tokenization of text and of
    message prompts equals TRL's own ``_tokenize_prompts``; two GRPO steps on message prompts run on the service,
    the second's prompts were peeked right, and the ranks' Prometheus counters add up to the records."""
    from unittest import mock

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from bubblespec.testing.random_checkpoints import write_chat_tokenizer, write_random_checkpoint

    folder = tmp_path / "qwen2-chat"
    write_random_checkpoint(folder, "qwen2", vocab_size=32_000, hidden_size=64, num_heads=2, num_kv_heads=1,
                            head_dim=32, intermediate_size=128, max_position_embeddings=512, bos_token_id=None,
                            eos_token_id=0)  # fmt: skip
    write_chat_tokenizer(folder, 32_000)
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {a}?"}]} for a in range(8)]
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_vllm=False, bf16=False, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=6, max_steps=2, report_to="none", save_strategy="no",
                      disable_tqdm=True)  # fmt: skip
    service = {"model": {"dtype": "float32"}, "rollout": {"num_ranks": 2}, "speculation": {"enabled": True},
               "clock": {"kind": "virtual", "profile": "h100-7b"}, "metrics": {"port": 0},
               "ray": {"colocated": True}}  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    calls: list[str] = []
    engine = "bubblespec.backends.torch_engine.TorchEngine"
    with mock.patch(f"{engine}.release", lambda _: calls.append("release")), \
         mock.patch(f"{engine}.resume", lambda _: calls.append("resume")), \
         BubblespecRollout(service, folder, args) as rollout:  # fmt: skip
        trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0, 1.0] * (len(completions) // 2),
                              args=args, train_dataset=Dataset.from_list(rows),
                              processing_class=AutoTokenizer.from_pretrained(folder), rollout_func=rollout)  # fmt: skip
        rollout._trainer = trainer  # the tokenizer and settings the first call would take
        messages = [row["prompt"] for row in rows[:3]]
        assert [rollout._tokenize(m) for m in messages] == [list(ids) for ids in trainer._tokenize_prompts(messages)[0]]
        texts = ["What is 2 + 2?", "hello"]
        assert [rollout._tokenize(t) for t in texts] == [list(ids) for ids in trainer._tokenize_prompts(texts)[0]]
        trainer.train()
        steps = rollout.steps
        registry = rollout.metrics.registry  # the per-rank counters of a bubblespec run, served on metrics.port
        counted = sum(registry.get_sample_value("bubblespec_decode_steps_total", {"rank": str(r)}) for r in (0, 1))
        assert counted == sum(s.decode_steps for s in steps) > 0
        for rank in ("0", "1"):  # the ranks' liveness comes from the pool's activity events, as in a bubblespec run
            assert registry.get_sample_value("bubblespec_rank_state", {"rank": rank, "state": "idle"}) == 1
            assert registry.get_sample_value("bubblespec_rank_last_progress_timestamp_seconds", {"rank": rank}) > 0
    assert calls == ["release", "resume", "release", "resume"]  # the last resume: when the rollout closes
    # (every response runs to max_completion_length here, so the ranks finish together: no bubble to draft in)
    assert len(steps) == 2 and steps[1].peek_matched is True and steps[1].generated_tokens == 4 * 6


# -- evaluation and LoRA ---------------------------------------------------------------------------------------------


def _arithmetic_grpo(output_dir, *, speculation, evaluation=None, peft_config=None, colocated=False, on_reward=None,
                     score=None):  # fmt: skip
    """Two TRL GRPO steps on the shipped arithmetic task and model (float64, 4 ranks, virtual clock); with
    ``evaluation`` (num_generations_eval), an evaluation of 4 held-out prompts in 2 batches after every step.
    ``on_reward(rollout, trainer)`` runs in the reward function: after a generation batch, before TRL trains on it;
    ``score(completion_ids, answer)``: the reward (the task's by default). Returns the (closed) rollout and the
    trainer."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from bubblespec.core.interfaces import Prompt

    torch.manual_seed(0)
    task = ArithmeticTask(seed=0, prompts_per_step=64)
    path = str(ArithmeticTask.model_path())
    rows = [{"prompt": p.text, "answer": p.answer} for p in task.batch(0)]
    held_out = [{"prompt": p.text, "answer": p.answer} for p in ArithmeticTask(seed=1, prompts_per_step=4).batch(0)]
    live: dict = {}
    score = score or (lambda ids, answer: task(Prompt("", (), "", answer), ids))

    def reward(completion_ids, answer, **_):
        if on_reward is not None and live["trainer"].model.training:
            on_reward(live["rollout"], live["trainer"])
        return [score(ids, a) for ids, a in zip(completion_ids, answer, strict=True)]

    evaluating = {} if evaluation is None else {"eval_strategy": "steps", "eval_steps": 1,
                  "num_generations_eval": evaluation, "per_device_eval_batch_size": 2 * evaluation}  # fmt: skip
    args = GRPOConfig(output_dir=str(output_dir), use_vllm=False, bf16=False, per_device_train_batch_size=16,
                      num_generations=4, max_completion_length=task.max_new_tokens, learning_rate=1e-2, max_steps=2,
                      logging_steps=1, save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
                      **evaluating)  # fmt: skip
    service = {"model": {"dtype": "float64"}, "rollout": {"num_ranks": 4}, "speculation": {"enabled": speculation},
               "clock": {"kind": "virtual", "profile": "h100-7b"}, "metrics": {"enabled": False},
               "ray": {"colocated": colocated}}  # fmt: skip
    with BubblespecRollout(service, path, args) as rollout:
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64),
                              reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                              eval_dataset=None if evaluation is None else Dataset.from_list(held_out),
                              processing_class=AutoTokenizer.from_pretrained(path), rollout_func=rollout,
                              peft_config=peft_config)  # fmt: skip
        live.update(rollout=rollout, trainer=trainer)
        trainer.train()
    return rollout, trainer


def _training_records(rollout) -> list[tuple]:
    keys = ("generation", "global_step", "completions_digest", "decode_steps", "draft_coverage", "peek_matched")
    return [tuple(getattr(step, k) for k in keys) for step in rollout.steps]


@pytest.fixture(scope="module")
def grpo_without_evaluation(tmp_path_factory):
    return _arithmetic_grpo(tmp_path_factory.mktemp("no-eval"), speculation=True)[0]


@pytest.mark.slow
@pytest.mark.parametrize("num_generations_eval", [2, 4], ids=["fewer-eval-generations", "as-many"])
def test_evaluation_has_keys_of_its_own_and_leaves_the_training_generations_and_drafts_alone(
    tmp_path, grpo_without_evaluation, num_generations_eval
):
    """TRL evaluates after each of two steps (num_generations_eval samples per prompt; training: 4). Evaluation
    batches are told apart by TRL's own eval mode: they neither take the next generation's index nor use its drafts,
    so the training generations (digests, decode steps, draft coverage) are exactly those of a run without
    evaluation; they are not training records, in ``steps`` or TRL's ``bubblespec/`` log; their completions are
    the same with speculation off; colocated ranks generate from the first evaluation batch to TRL's on_evaluate."""
    from unittest import mock

    calls: list[str] = []
    engine = "bubblespec.backends.torch_engine.TorchEngine"
    with mock.patch(f"{engine}.release", lambda _: calls.append("release")), \
         mock.patch(f"{engine}.resume", lambda _: calls.append("resume")):  # fmt: skip
        on, trainer = _arithmetic_grpo(tmp_path / "on", speculation=True, evaluation=num_generations_eval,
                                       colocated=True)  # fmt: skip
    off, _ = _arithmetic_grpo(tmp_path / "off", speculation=False, evaluation=num_generations_eval)
    assert _training_records(on) == _training_records(grpo_without_evaluation)
    assert [s.generation for s in on.steps] == [0, 1] and on.steps[1].peek_matched is True
    assert on.steps[1].draft_coverage > 0 and on.steps[1].decode_steps < off.steps[1].decode_steps
    # two batches per evaluation, after steps 1 and 2: 2 prompts x num_generations_eval each
    evaluations = [(e["evaluation"], e["global_step"], e["num_completions"]) for e in on.evaluations]
    assert evaluations == [(0, 1, 2 * num_generations_eval), (1, 1, 2 * num_generations_eval),
                           (2, 2, 2 * num_generations_eval), (3, 2, 2 * num_generations_eval)]  # fmt: skip
    assert [e["completions_digest"] for e in on.evaluations] == [e["completions_digest"] for e in off.evaluations]
    history = trainer.state.log_history
    logged = [h["bubblespec/draft_coverage"] for h in history if "bubblespec/draft_coverage" in h]
    assert logged == [s.draft_coverage for s in on.steps]
    assert not [k for h in history for k in h if k.startswith("eval_") and "bubblespec" in k]
    # generation 0 | TRL trains | evaluation (2 batches) | on_evaluate | generation 1 | ... | close
    assert calls == ["release", "resume"] * 4


def _lora(**options):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], **options)


@pytest.mark.slow
def test_lora_ranks_get_the_merged_weights_and_speculation_changes_neither_completions_nor_weights(tmp_path):
    """GRPOTrainer(peft_config=LoraConfig(...)): after every sync the ranks hold exactly what peft's own
    ``merge_and_unload`` makes of the trainer's model (base names, adapter merged); with speculation on and off
    the completions and the trained adapters are identical, and drafts still save decode steps."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    def ranks_and_merged(rollout, trainer, into):
        ranks = rollout._service.ranks.engine.model.state_dict()  # the virtual ranks share one engine
        peft_model = trainer.accelerator.unwrap_model(trainer.model)
        into.append((ranks, copy.deepcopy(peft_model).merge_and_unload().state_dict()))

    def shorter(ids, answer):  # differs within every group from the first step on: the adapter trains at once
        return -len(ids) / 100

    seen: list = []
    on, trainer_on = _arithmetic_grpo(tmp_path / "on", speculation=True, peft_config=_lora(), score=shorter,
                                      on_reward=lambda r, t: ranks_and_merged(r, t, seen))  # fmt: skip
    off, trainer_off = _arithmetic_grpo(tmp_path / "off", speculation=False, peft_config=_lora(), score=shorter)
    assert len(seen) == 2
    for ranks, merged in seen:
        assert ranks.keys() == merged.keys() and all(torch.equal(ranks[n], merged[n]) for n in merged)
    base = AutoModelForCausalLM.from_pretrained(ArithmeticTask.model_path(), dtype=torch.float64).state_dict()
    trained = {n for n, t in seen[1][0].items() if not torch.equal(t, base[n])}
    assert trained and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in trained)  # the adapter merged
    assert [s.completions_digest for s in on.steps] == [s.completions_digest for s in off.steps]
    assert on.steps[1].draft_coverage > 0 and on.steps[1].decode_steps < off.steps[1].decode_steps
    adapters_on, adapters_off = (dict(t.model.named_parameters()) for t in (trainer_on, trainer_off))
    assert all(torch.equal(p, adapters_off[n]) for n, p in adapters_on.items())


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_the_merged_weights_are_peft_merge_and_unload_and_leave_the_model_alone(dtype):
    """The weights the ranks get from a peft model: those of peft's own merge (LoRA on linear layers and, but for
    bfloat16, where peft rounds an embedding's delta to bfloat16 before adding it, on the embedding)."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from bubblespec.rl.trainer_models import merged_weights

    targets = ["q_proj", "down_proj"] + ([] if dtype == "bfloat16" else ["embed_tokens"])
    model = AutoModelForCausalLM.from_pretrained(ArithmeticTask.model_path(), dtype=getattr(torch, dtype))
    original = {n: t.clone() for n, t in model.state_dict().items()}
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():  # B (embedding: A) starts at zero; a trained adapter does not
        for name, parameter in model.named_parameters():
            if "lora_B" in name or "lora_embedding_A" in name:
                parameter.normal_()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    merged = merged_weights(model)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys() and all(torch.equal(merged[n], reference[n]) for n in reference)
    changed = {n.removeprefix("model.") for n in merged if not torch.equal(merged[n], original[n])}
    layers = {f"layers.{i}.{layer}.weight" for i in range(4) for layer in ("self_attn.q_proj", "mlp.down_proj")}
    assert changed == layers | ({"embed_tokens.weight"} if "embed_tokens" in targets else set())
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())  # the trained model is untouched


def test_peft_models_that_do_not_merge_as_w_plus_ba_are_refused(tmp_path):
    import torch
    from datasets import Dataset
    from peft import IA3Config, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from bubblespec.integrations.trl import check_mergeable

    path = ArithmeticTask.model_path()

    def model():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    check_mergeable(model())
    check_mergeable(get_peft_model(model(), _lora()))
    for config, problem in [
        (_lora(lora_bias=True), "lora_bias=True, first on 'model.layers.0.self_attn.q_proj'"),
        (_lora(modules_to_save=["lm_head"]), r"ModulesToSaveWrapper \(modules_to_save"),
        (IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]), "is IA3, not LORA"),
    ]:
        with pytest.raises(ConfigError, match=f"{problem}.*Supported: one plain LoraConfig"):
            check_mergeable(get_peft_model(model(), config))
    # through TRL: refused at the first call, before a rank starts
    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=False, bf16=False, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=4, max_steps=1, report_to="none", save_strategy="no",
                      disable_tqdm=True)  # fmt: skip
    with BubblespecRollout({"clock": {"kind": "virtual"}, "metrics": {"enabled": False}}, path, args) as rollout:
        trainer = GRPOTrainer(model=model(), reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                              train_dataset=Dataset.from_list([{"prompt": "1+1="}] * 4),
                              processing_class=AutoTokenizer.from_pretrained(path), rollout_func=rollout,
                              peft_config=_lora(use_dora=True))  # fmt: skip
        with pytest.raises(ConfigError, match="the LoRA variant DoraLinearVariant"):
            trainer.train()
        assert rollout._service is None
