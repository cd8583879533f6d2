"""TRL's GRPOTrainer on bubblespec's rollout (bubblespec.integrations.trl) and examples/trl_grpo.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bubblespec.errors import ConfigError
from bubblespec.integrations.trl import BubblespecRollout, check_trl_version
from bubblespec.tasks import ArithmeticTask

EXAMPLE = Path(__file__).parent.parent / "examples" / "trl_grpo.py"


def _example():
    spec = importlib.util.spec_from_file_location("trl_grpo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_trl_grpo_gives_identical_completions_and_fewer_decode_steps_with_speculation(tmp_path):
    out = tmp_path / "out.json"
    assert _example().main(["--steps", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["identical_completions"] and report["identical_weights"]
    off, on = report["speculation_off"]["generations"], report["speculation_on"]["generations"]
    assert len(off) == len(on) == 3 and on[0]["decode_steps"] == off[0]["decode_steps"]  # nothing to draft yet
    assert all(d["decode_steps"] < p["decode_steps"] for d, p in zip(on[1:], off[1:], strict=True))
    assert all(g["draft_coverage"] > 0 for g in on[1:]) and report["decode_step_reduction_from_step_2"] > 0.2
    assert [g["global_step"] for g in on] == [0, 1, 2]


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


def test_prompts_must_come_as_trl_repeats_them_and_carry_no_images():
    distinct = BubblespecRollout._distinct(["a", "a", "b", "b"], 2)
    assert distinct == ["a", "b"]
    with pytest.raises(ValueError, match="repeated num_generations times in a row"):
        BubblespecRollout._distinct(["a", "b", "a", "b"], 2)
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

    from bubblespec.random_checkpoints import write_chat_tokenizer, write_random_checkpoint

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
        assert counted == sum(s["decode_steps"] for s in steps) > 0
    assert calls == ["release", "resume", "release", "resume"]  # the last resume: when the rollout closes
    # (every response runs to max_completion_length here, so the ranks finish together: no bubble to draft in)
    assert len(steps) == 2 and steps[1]["peek_matched"] is True and steps[1]["generated_tokens"] == 4 * 6
