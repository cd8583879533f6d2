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
