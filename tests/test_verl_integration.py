"""verl's trainer on bubblespec's rollout (bubblespec.integrations.verl): the plugin found through verl's registries,
the rollout driven through verl's own pieces (its config composed from ppo_trainer.yaml, its dataset, sampler and
StatefulDataLoader, its DataProto, the trainer's batch handling: ``_get_gen_batch``, ``repeat(interleave=True)``,
``union``), and verl's own trainer on a CPU (examples/verl_trainer_cpu.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from verl import DataProto

from bubblespec.core.errors import ConfigError
from bubblespec.integrations.verl import (
    MANAGER,
    BubblespecAgentLoopManager,
    BubblespecReplica,
    BubblespecServerAdapter,
    check_verl_version,
    inbox,
)

EXAMPLES = Path(__file__).parent.parent / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example, trainer_example = _example("verl_rollout"), _example("verl_trainer_cpu")
N, BATCH = example.N, example.BATCH
verl_config, train_loader, gen_batch, policy, run = (
    example.verl_config, example.train_loader, example.gen_batch, example.policy, example.run
)  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The shipped arithmetic model with a chat template, and a parquet training set of its prompts in verl's
    format: its responses are worked solutions of many lengths."""
    return example.write_inputs(tmp_path_factory.mktemp("verl"))


def test_verl_finds_the_bubblespec_rollout_by_name_through_its_plugin_entry_point():
    """A fresh interpreter that imports only verl: its entry-point discovery registers bubblespec in both of verl's
    rollout registries."""
    code = (
        "import verl\n"
        "from verl.workers.rollout.base import get_rollout_class\n"
        "from verl.workers.rollout.replica import get_rollout_replica_class\n"
        "print(get_rollout_replica_class('bubblespec').__name__, get_rollout_class('bubblespec', 'async').__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.split() == ["BubblespecReplica", "BubblespecServerAdapter"]


def test_the_rollout_returns_the_keys_and_shapes_of_verl_s_agent_loop(folder):
    from verl.trainer.ppo.ray_trainer import compute_response_mask
    from verl.utils import hf_tokenizer

    config = verl_config(folder)
    manager = BubblespecAgentLoopManager.create(config=config, llm_client=None)
    try:
        batch = DataProto.from_single_dict(next(iter(train_loader(config))))
        raw = [list(p) for p in batch.non_tensor_batch["raw_prompt"]]
        output = manager.generate_sequences(gen_batch(batch, 1))
    finally:
        manager.close()
    size, prompt_length, response_length = BATCH * N, example.PROMPT_LENGTH, example.RESPONSE_LENGTH
    shapes = {name: tuple(tensor.shape) for name, tensor in output.batch.items()}
    assert shapes == {
        "prompts": (size, prompt_length),
        "responses": (size, response_length),
        "response_mask": (size, response_length),
        "input_ids": (size, prompt_length + response_length),
        "attention_mask": (size, prompt_length + response_length),
        "position_ids": (size, prompt_length + response_length),
        "rollout_log_probs": (size, response_length),
    }
    assert output.batch["rollout_log_probs"].dtype == torch.float32
    tokenizer = hf_tokenizer(config.actor_rollout_ref.model.path)
    attention = output.batch["attention_mask"]
    for row in range(size):
        # Prompts left-padded, as verl's agent loop tokenizes raw_prompt with the chat template.
        expected = list(tokenizer.apply_chat_template(raw[row // N], add_generation_prompt=True)["input_ids"])
        mask = attention[row, :prompt_length].bool()
        assert output.batch["prompts"][row][mask].tolist() == expected
        assert not mask[: prompt_length - len(expected)].any()
        # Responses right-padded; the response mask is the response's attention mask, as verl computes it.
        length = int(output.batch["response_mask"][row].sum())
        assert 0 < length <= response_length and output.batch["response_mask"][row, :length].all()
        assert torch.equal(attention[row, prompt_length:], output.batch["response_mask"][row])
        assert (output.batch["rollout_log_probs"][row, :length] < 0).all()
        assert (output.batch["rollout_log_probs"][row, length:] == 0).all()
    assert torch.equal(output.batch["input_ids"], torch.cat([output.batch["prompts"], output.batch["responses"]], 1))
    assert torch.equal(output.batch["position_ids"], torch.clip(attention.cumsum(-1) - 1, min=0))
    assert torch.equal(compute_response_mask(output), output.batch["response_mask"])
    assert (output.non_tensor_batch["__num_turns__"] == 2).all()
    uids = output.non_tensor_batch["uid"]
    assert uids[0] == uids[N - 1] != uids[N]  # the batch's own fields, in its order
    assert "bubblespec/decode_steps_saved" in output.meta_info["timing"]


def test_speculation_on_and_off_give_identical_responses_and_fewer_decode_steps_over_verl_s_steps(tmp_path):
    """examples/verl_rollout.py: four steps over two epochs of verl's dataloader, new weights every step through the
    workers' weight sync: identical responses with speculation on and off; from the second step the drafts made in
    the bubbles of the step before cover the step's prompts (the peek read verl's sampler order, across the epoch
    boundary too)."""
    out = tmp_path / "out.json"
    assert example.main(["--steps", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["identical_responses"]
    off, on = report["speculation_off"], report["speculation_on"]
    assert [r["global_step"] for r in on] == [1, 2, 3, 4]
    assert [r["completions_digest"] for r in off] == [r["completions_digest"] for r in on]
    assert len({r["completions_digest"] for r in on}) == 4
    assert on[0]["decode_steps"] == off[0]["decode_steps"]  # nothing drafted before the first step
    assert all(r["peek_matched"] for r in on[1:])
    for drafted, plain in zip(on[1:], off[1:], strict=True):
        assert drafted["draft_coverage"] > 0 and drafted["decode_steps"] < plain["decode_steps"]
    assert report["decode_step_reduction_from_step_2"] > 0.1


def test_weights_handed_to_the_workers_rollout_reach_the_ranks(folder, tmp_path):
    """The responses after a weight sync are those of a model folder holding those weights."""
    from transformers import AutoModelForCausalLM

    config = verl_config(folder)
    batch_dict = next(iter(train_loader(config)))
    weights = policy(folder, 30)
    adapter = BubblespecServerAdapter(
        config=config.actor_rollout_ref.rollout, model_config=config.actor_rollout_ref.model
    )

    def responses(config, sync: bool) -> torch.Tensor:
        manager = BubblespecAgentLoopManager.create(config=config, llm_client=None)
        try:
            if sync:
                asyncio.run(adapter.update_weights(iter(weights.items()), global_steps=1))
            return manager.generate_sequences(gen_batch(DataProto.from_single_dict(batch_dict), 1)).batch["responses"]
        finally:
            manager.close()

    model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float64)
    model.load_state_dict(weights)
    model.save_pretrained(tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        (tmp_path / "model" / name).write_bytes((folder / "model" / name).read_bytes())
    synced = responses(config, sync=True)
    saved = responses(verl_config(folder, f"actor_rollout_ref.model.path={tmp_path / 'model'}"), sync=False)
    unsynced = responses(config, sync=False)  # a new manager forgets what an earlier run handed over
    assert torch.equal(synced, saved)
    assert not torch.equal(synced, unsynced)


def test_validation_batches_are_generated_under_their_own_keys_without_drafts(folder):
    """Validation samples with val_kwargs (here T = 1, two samples per prompt; verl's default is greedy) under keys
    of its own: identical with speculation on and off, and each validation batch has new keys."""
    sampled = ("actor_rollout_ref.rollout.val_kwargs.n=2", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
               "actor_rollout_ref.rollout.val_kwargs.temperature=1.0")  # fmt: skip
    outputs = []
    for speculation in ("true", "false"):
        config = verl_config(
            folder, *sampled, f"+actor_rollout_ref.rollout.custom.bubblespec.speculation.enabled={speculation}"
        )
        manager = BubblespecAgentLoopManager.create(config=config, llm_client=None)
        try:
            batch = DataProto.from_single_dict(next(iter(train_loader(config))))
            validation = batch.repeat(repeat_times=2, interleave=True)
            validation.meta_info["validate"] = True
            first = manager.generate_sequences(validation).batch["responses"]
            second = manager.generate_sequences(validation).batch["responses"]
            assert len(manager.evaluations) == 2 and not manager.steps
        finally:
            manager.close()
        assert not torch.equal(first, second)  # the second validation batch has keys of its own
        outputs.append(first)
    assert torch.equal(*outputs)
    # verl's default val_kwargs (do_sample false, temperature 0) are greedy: every validation batch is the same
    config = verl_config(folder)
    manager = BubblespecAgentLoopManager.create(config=config, llm_client=None)
    try:
        validation = DataProto.from_single_dict(next(iter(train_loader(config))))
        validation.meta_info["validate"] = True
        first, second = (manager.generate_sequences(validation).batch["responses"] for _ in range(2))
    finally:
        manager.close()
    assert torch.equal(first, second)


def test_settings_the_rollout_cannot_honour_are_refused_with_what_to_set(folder):
    config = verl_config(folder)
    with pytest.raises(ConfigError, match="verl >= 0.9.1, < 0.10.0"):
        check_verl_version("0.8.0")
    with pytest.raises(ConfigError, match="rollout.name=bubblespec, not 'vllm'"):
        BubblespecAgentLoopManager(verl_config(folder, "actor_rollout_ref.rollout.name=vllm"))
    with pytest.raises(ConfigError, match="set trainer.use_v1=False"):
        BubblespecAgentLoopManager(verl_config(folder, "trainer.use_v1=True"))
    with pytest.raises(ConfigError, match="not a local Hugging Face model folder"):
        BubblespecAgentLoopManager(verl_config(folder, "actor_rollout_ref.model.path=/nonexistent/model"))
    with pytest.raises(
        ConfigError, match=r"custom.bubblespec: 1 error\(s\)\n  rollout.num_rank: .*did you mean 'num_ranks'"
    ):
        BubblespecAgentLoopManager(
            verl_config(folder, "+actor_rollout_ref.rollout.custom.bubblespec.rollout.num_rank=2")
        )
    with pytest.raises(ConfigError, match="rollout.num_ranks"):
        BubblespecAgentLoopManager(
            verl_config(folder, "++actor_rollout_ref.rollout.custom.bubblespec.rollout.num_ranks=0")
        )
    adapter = BubblespecServerAdapter(
        config=config.actor_rollout_ref.rollout, model_config=config.actor_rollout_ref.model
    )
    with pytest.raises(ConfigError, match="checkpoint_engine.backend=naive"):
        asyncio.run(adapter.update_weights(iter([]), wire_format="delta_flush"))
    with pytest.raises(ConfigError, match="lora.merge=True"):
        asyncio.run(adapter.update_weights(iter([]), peft_config={"r": 8}))
    # The replica refuses to start without bubblespec's agent loop manager, naming the setting.
    plain = verl_config(folder, "~actor_rollout_ref.rollout.agent.agent_loop_manager_class")
    replica = BubblespecReplica(
        replica_rank=0, config=plain.actor_rollout_ref.rollout, model_config=plain.actor_rollout_ref.model
    )
    with pytest.raises(ConfigError, match=f"agent_loop_manager_class={MANAGER}"):
        asyncio.run(replica.launch_servers())
    replica = BubblespecReplica(
        replica_rank=0, config=config.actor_rollout_ref.rollout, model_config=config.actor_rollout_ref.model
    )
    asyncio.run(replica.launch_servers())
    assert replica.server_address == "bubblespec-0"
    # Multi-turn agent loops and prompts with content parts are refused.
    manager = BubblespecAgentLoopManager.create(config=config, llm_client=None)
    try:
        batch = gen_batch(DataProto.from_single_dict(next(iter(train_loader(config)))), 1)
        batch.non_tensor_batch["agent_name"] = np.array(["tool_agent"] * len(batch), dtype=object)
        with pytest.raises(ConfigError, match="single-turn prompts; this batch asks for 'tool_agent'"):
            manager.generate_sequences(batch)
    finally:
        manager.close()
    assert inbox().newer_than(None) is None  # nothing was handed over


def test_verl_s_sampling_settings_reach_the_rollout(folder):
    """ignore_eos (verl's vLLM server honours it) and repetition_penalty were dropped without a word; they apply to
    training and validation batches alike, and do_sample=False is greedy."""
    from bubblespec.integrations.verl import _sampling

    config = verl_config(folder, "actor_rollout_ref.rollout.ignore_eos=true", "actor_rollout_ref.rollout.top_k=7",
                         "+actor_rollout_ref.rollout.repetition_penalty=1.2")  # fmt: skip
    rollout = config.actor_rollout_ref.rollout
    for kwargs in (rollout, rollout.val_kwargs):
        params = _sampling(kwargs, rollout, (2,))
        assert (params.ignore_eos, params.repetition_penalty, params.stop_token_ids) == (True, 1.2, (2,))
    assert _sampling(rollout, rollout, ()).top_k == 7 and _sampling(rollout.val_kwargs, rollout, ()).temperature == 0.0
    default = verl_config(folder).actor_rollout_ref.rollout
    assert (_sampling(default, default, ()).ignore_eos, _sampling(default, default, ()).repetition_penalty) == (
        False,
        1,
    )


@pytest.mark.slow
@pytest.mark.ray  # verl's trainer starts a local Ray of its own: it takes its turn with the other tests that do
def test_verl_s_own_trainer_runs_with_the_bubblespec_rollout_and_drafts_from_the_second_step(tmp_path):
    """examples/verl_trainer_cpu.py: ``python -m verl.trainer.main_ppo`` (verl's legacy trainer, FSDP2 on gloo, its
    reward workers with the task's reward) with rollout.name=bubblespec for three steps. Every step generates with
    the weights of the update before it (verl's naive sync from the trainer worker, a Ray actor, through the
    inbox), the peek matches verl's dataloader, and from the second step drafts cover the prompts and save decode
    steps. (The same command with ``--speculation off`` gives the same responses, rewards and losses: measured,
    see docs/integrations.md; one trainer run is what CI affords.)"""
    out, log = tmp_path / "out.json", tmp_path / "verl.log"
    code = trainer_example.main(["--steps", "3", "--json", str(out), "--log", str(log)])
    assert code == 0, log.read_text()[-3000:]
    steps = json.loads(out.read_text())["steps"]
    assert [s["global_step"] for s in steps] == [1, 2, 3]
    assert [s["weights_version"] for s in steps] == [0, 1, 2]
    assert steps[0]["decode_steps"] == steps[0]["generated_tokens"]  # nothing drafted before the first step
    for step in steps[1:]:
        assert step["peek_matched"] and step["draft_coverage"] > 0
        assert step["decode_steps"] < step["generated_tokens"]
    assert len({s["completions_digest"] for s in steps}) == 3
    scores = [float(m) for m in re.findall(r"critic/score/mean:([0-9.]+)", log.read_text())]
    assert len(scores) == 3 and max(scores) > 0  # verl's reward workers scored the rollout's responses


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3", "mistral"])
def test_each_model_family_at_a_32k_vocabulary_in_bfloat16_with_top_k_and_top_p(family, tmp_path):
    """A random chat model of each family with a 32,000-token ChatML tokenizer, ranks in bfloat16, verl's sampling
    with temperature, top-k and top-p: verl's own tokenizer path for the family (its Continuous Token builder by
    model_type) gives the chat template's prompt, the sampling settings are verl's, and a weight sync through the
    adapter (float64 tensors from the trainer, bfloat16 on the ranks) changes the next step's responses."""
    import pandas as pd
    from verl.utils import hf_tokenizer

    from bubblespec.core.interfaces import SamplingParams
    from bubblespec.testing.random_checkpoints import write_chat_model

    write_chat_model(tmp_path / "model", vocab_size=32_000, family=family)
    rows = [
        {"data_source": "chat", "prompt": [{"role": "user", "content": f"Say {i} in words."}],
         "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}}
        for i in range(8)
    ]  # fmt: skip
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    config = verl_config(
        tmp_path,
        "++actor_rollout_ref.rollout.custom.bubblespec.model.dtype=bfloat16",
        "actor_rollout_ref.rollout.temperature=0.8",
        "actor_rollout_ref.rollout.top_k=50",
        "actor_rollout_ref.rollout.top_p=0.9",
        "data.max_response_length=16",
    )
    manager = BubblespecAgentLoopManager.create(config=config, llm_client=None)
    adapter = BubblespecServerAdapter(
        config=config.actor_rollout_ref.rollout, model_config=config.actor_rollout_ref.model
    )
    try:
        assert manager.sampling == SamplingParams(0.8, 50, 0.9, 16, (0, 2))  # <|endoftext|>, <|im_end|>
        batch = DataProto.from_single_dict(next(iter(train_loader(config))))
        raw = [list(p) for p in batch.non_tensor_batch["raw_prompt"]]
        first = manager.generate_sequences(gen_batch(batch, 1))
        asyncio.run(adapter.update_weights(iter(policy(tmp_path, 30).items()), global_steps=1))
        again = manager.generate_sequences(gen_batch(DataProto.from_single_dict(next(iter(train_loader(config)))), 1))
    finally:
        manager.close()
    tokenizer = hf_tokenizer(config.actor_rollout_ref.model.path)
    prompts, attention = first.batch["prompts"], first.batch["attention_mask"]
    for row in range(len(first)):
        expected = list(tokenizer.apply_chat_template(raw[row // N], add_generation_prompt=True)["input_ids"])
        assert prompts[row][attention[row, : prompts.shape[1]].bool()].tolist() == expected
    assert first.batch["responses"].shape == (BATCH * N, 16)
    assert int(first.batch["responses"].max()) >= 512  # ids from the whole 32k vocabulary
    logprobs = first.batch["rollout_log_probs"][first.batch["response_mask"].bool()]
    assert torch.isfinite(logprobs).all() and (logprobs <= 0).all()
    assert not torch.equal(first.batch["responses"], again.batch["responses"])  # the same keys, new weights
