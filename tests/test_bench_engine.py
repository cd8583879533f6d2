"""``bubblespec bench engine``: settings, requests, the policy step of a model folder, and quick runs of the
torch and vLLM backends that must report the same fields."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from typer.testing import CliRunner

from bubblespec.cli.bench_engine import ROW_FIELDS, EngineBenchSettings, parse_backends, parse_batch_sizes
from bubblespec.cli.bench_engine_requests import perturbation, random_workload
from bubblespec.cli.main import app
from bubblespec.core.errors import ConfigError
from bubblespec.testing.random_checkpoints import perturbed_weights, write_perturbed_copy

runner = CliRunner()

SUMMARY_FIELDS = {
    "decode_steps_no_draft",
    "decode_steps_with_draft",
    "decode_step_reduction",
    "acceptance_length_mean",
    "draft_acceptance_rate",
    "undecided_steps",
    "identical_with_and_without_draft",
    "fully_accepted_responses",
    "steps_over_ceil_l_over_k",
}
REPORT_FIELDS = {
    "settings",
    "draft_tries",
    "draft_head",
    "workload",
    "policy_update",
    "keyed_sampling",
    "hf_generate_tokens_per_s",
    "backends",
    "exactness",
    "benchmark_seconds",
    "float64_identical",
    "float32_mismatch_rate",
    "vllm_ngram",
}
EXACTNESS_FIELDS = {
    "responses",
    "differing",
    "mismatch_rate",
    "differing_between_plain_batches",
    "plain_batch_mismatch_rate",
}


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory):
    """A Qwen2-family checkpoint with a real-sized vocabulary and a tiny body."""
    from bubblespec.testing.random_checkpoints import write_random_checkpoint

    folder = tmp_path_factory.mktemp("qwen2-small")
    return write_random_checkpoint(folder, "qwen2", vocab_size=32_000, hidden_size=64, num_heads=1, head_dim=64)


def test_settings_refuse_what_no_engine_offers(tmp_path):
    with pytest.raises(ConfigError, match=r"backend 'sglang' is not benchmarked; choose one of torch, vllm"):
        EngineBenchSettings(backends=("torch", "sglang"))
    with pytest.raises(ConfigError, match=r"dtype 'float64' is not offered by the vllm engine; .* float32, bfloat16"):
        EngineBenchSettings(backends=("torch", "vllm"), dtype="float64")
    with pytest.raises(ConfigError, match=r"name one twice"):
        EngineBenchSettings(backends=("vllm", "vllm"))
    with pytest.raises(ConfigError, match="name at least one backend"):
        EngineBenchSettings(backends=())
    with pytest.raises(ConfigError, match="is not a Hugging Face model folder"):
        EngineBenchSettings(model_path=str(tmp_path))
    with pytest.raises(ConfigError, match="prompt lengths"):
        EngineBenchSettings(prompt_lengths=(64, 32))
    with pytest.raises(ConfigError, match=r"--vllm-ngram .* --backend torch has no vllm: add it"):
        EngineBenchSettings(backends=("torch",), vllm_ngram=True)
    assert parse_batch_sizes("1,16,32") == (1, 16, 32)
    assert parse_backends("torch, vllm") == ("torch", "vllm")
    with pytest.raises(ConfigError, match=r"--batch-sizes '1,x' is not a comma-separated list"):
        parse_batch_sizes("1,x")
    with pytest.raises(ConfigError, match=r"--batch-sizes '0,4': every batch size must be >= 1"):
        parse_batch_sizes("0,4")


def test_a_bad_backend_on_the_command_line_is_a_clear_error():
    result = runner.invoke(app, ["bench", "engine", "--backend", "torch,tensorrt"])
    assert result.exit_code == 2
    assert "backend 'tensorrt' is not benchmarked; choose one of torch, vllm" in result.output


def test_vllm_ngram_without_the_vllm_backend_is_one_error_line():
    result = runner.invoke(app, ["bench", "engine", "--vllm-ngram", "--quick"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --vllm-ngram times vLLM's own n-gram drafts"), lines


def test_head_steps_without_a_run_config_is_one_error_line():
    result = runner.invoke(app, ["bench", "engine", "--head-steps", "4", "--quick"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --head-steps trains the draft head"), lines


def test_random_prompts_have_the_asked_lengths_no_eos_and_depend_on_the_seed_only(small_folder):
    workload = random_workload(str(small_folder), 40, (3, 9), 12, seed=5)
    again = random_workload(str(small_folder), 40, (3, 9), 12, seed=5)
    other = random_workload(str(small_folder), 40, (3, 9), 12, seed=6)
    lengths = [len(r.prompt_token_ids) for r in workload.requests]
    assert min(lengths) >= 3 and max(lengths) <= 9 and len(set(lengths)) > 3
    assert all(workload.eos_token_id not in r.prompt_token_ids for r in workload.requests)
    assert max(t for r in workload.requests for t in r.prompt_token_ids) < 32_000
    assert len({r.key for r in workload.requests}) == 40
    assert {r.sampling.max_new_tokens for r in workload.requests} == {12}
    assert [r.prompt_token_ids for r in workload.requests] == [r.prompt_token_ids for r in again.requests]
    assert [r.prompt_token_ids for r in workload.requests] != [r.prompt_token_ids for r in other.requests]


def test_the_perturbation_moves_every_tensor_by_the_asked_relative_rms():
    generator = torch.Generator().manual_seed(0)
    weights = {
        "a": 3.0 * torch.randn(256, 128, generator=generator),
        "b": 0.02 * torch.randn(4096, generator=generator),
    }
    state, summary = perturbation(weights, 0.01, seed=1)
    for name, weight in weights.items():
        relative = (state[name] - weight).square().mean().sqrt() / weight.square().mean().sqrt()
        assert relative == pytest.approx(0.01, rel=0.05), name
    assert summary["relative_rms_change"] == 0.01 and "random perturbation" in summary["method"]
    assert all(torch.equal(state[n], perturbed_weights(weights, 0.01, seed=1)[n]) for n in weights)
    unchanged = perturbed_weights(weights, 0.0, seed=1)
    assert all(torch.equal(unchanged[n], weights[n]) for n in weights)


def test_a_perturbed_copy_of_a_folder_holds_the_perturbed_weights_in_their_own_dtypes(tmp_path):
    from safetensors.torch import save_file

    from bubblespec.core import model_folder

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"vocab_size": 64}')
    weights = {"a": torch.randn(64, 8), "b": torch.ones(8, dtype=torch.bfloat16)}
    save_file({"a": weights["a"]}, str(folder / "model-1.safetensors"))
    save_file({"b": weights["b"]}, str(folder / "model-2.safetensors"))
    copy = model_folder.weights(write_perturbed_copy(folder, tmp_path / "copy", 0.01, seed=3))
    expected = perturbed_weights(weights, 0.01, seed=3)
    assert torch.equal(copy["a"], expected["a"]) and copy["b"].dtype == torch.bfloat16
    assert torch.equal(copy["b"], expected["b"].to(torch.bfloat16)) and not torch.equal(copy["a"], weights["a"])
    assert (tmp_path / "copy" / "config.json").is_file()


def _run_quick(tmp_path, *arguments: str, printed: list | None = None) -> dict:
    out = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", "engine", "--quick", "--json", str(out), *arguments])
    assert result.exit_code == 0, result.output
    if printed is not None:
        printed.append(result.output)
    return json.loads(out.read_text())


def _check_rows(report: dict, backends: set[str], hf_batch_sizes: set[str]) -> None:
    assert set(report) == REPORT_FIELDS
    assert set(report["backends"]) == backends
    assert set(report["hf_generate_tokens_per_s"]) == hf_batch_sizes
    for rows in report["backends"].values():
        assert set(rows) == set(ROW_FIELDS) | SUMMARY_FIELDS
        for name in ROW_FIELDS:
            assert set(rows[name]) == (hf_batch_sizes if name == "engine_vs_hf_generate" else {"1", "16"}), name
        for name in ("engine_tokens_per_s", "engine_tokens_per_s_with_draft", "speedup_with_draft"):
            assert all(value > 0 for value in rows[name].values()), name
        assert all(rows["identical_outputs"].values()) and rows["identical_with_and_without_draft"]
        for key in ("1", "16"):
            assert rows["forward_passes_with_draft"][key] < rows["forward_passes_no_draft"][key]
        assert rows["decode_steps_with_draft"] < rows["decode_steps_no_draft"]
        assert 0 < rows["decode_step_reduction"] < 1
        assert rows["acceptance_length_mean"] > 1
        # responses whose drafts were all accepted took at most one decode step more than ceil(L / K)
        assert rows["fully_accepted_responses"] > 0 and rows["steps_over_ceil_l_over_k"] <= 1
    for table in report["exactness"].values():
        assert all(set(row) == EXACTNESS_FIELDS for row in table.values())
    share = report["keyed_sampling"]
    assert share["share_of_forward_pass"] == pytest.approx(share["keyed_sample_s"] / share["forward_pass_s"])


@pytest.mark.slow
def test_quick_torch_run_on_the_shipped_model_reports_every_field(tmp_path):
    report = _run_quick(tmp_path)
    _check_rows(report, {"torch"}, {"1", "16"})
    update = report["policy_update"]  # one step of the run's own learner on 16 prompts x 4 samples of the task
    assert update["method"].startswith("one GRPO step of the config's trainer") and update["samples"] == 64
    assert update["learning_rate"] == 1e-4 and update["max_relative_weight_change"] > 0
    assert set(report["exactness"]["torch"]) == {"float64", "float32", "bfloat16"}
    assert report["exactness"]["torch"]["float64"]["differing"] == 0 and report["float64_identical"]
    assert report["exactness"]["torch"]["float64"]["differing_between_plain_batches"] == 0
    assert report["exactness"]["torch"]["float64"]["responses"] == 64
    assert 0 <= report["float32_mismatch_rate"] <= 1
    assert report["keyed_sampling"]["vocab_size"] == 19


@pytest.mark.slow
def test_quick_torch_run_on_a_model_folder_uses_random_prompts_and_a_perturbed_policy(tmp_path, small_folder):
    report = _run_quick(tmp_path, "--model", str(small_folder), "--weight-noise", "0.01")
    _check_rows(report, {"torch"}, {"16"})
    assert report["workload"]["max_new_tokens"] == 16 and report["workload"]["vocab_size"] == 32_000
    assert report["policy_update"]["relative_rms_change"] == 0.01
    assert report["exactness"]["torch"]["float64"]["responses"] == 8
    assert report["exactness"]["torch"]["float64"]["differing"] == 0
    assert report["keyed_sampling"]["vocab_size"] == 32_000


@pytest.mark.slow
def test_quick_torch_run_on_a_run_config_verifies_drafts_made_before_a_real_grpo_step(tmp_path, monkeypatch):
    """--config: the config's task and sampling (its suppressed tokens too), pi_t+1 from one step of bubblespec's own
    learner at the config's learning rate on pi_t's samples and rewards; --set reaches the config. The task is built
    once and closed at the end."""
    from bubblespec.run import assembly

    built, make_task = [], assembly.make_task

    def counted(*args, **kwargs):
        task = make_task(*args, **kwargs)
        built.append(task)
        return task

    monkeypatch.setattr(assembly, "make_task", counted)
    config = ["--config", "examples/arithmetic.yaml", "--set", "task.prompts_per_step=8", "--set", "eval_every=0"]
    report = _run_quick(tmp_path, *config, "--exactness-requests", "8")
    assert len(built) == 1
    _check_rows(report, {"torch"}, {"16"})
    update = report["policy_update"]
    assert update["method"].startswith("one GRPO step of the config's trainer")
    assert update["samples"] == 64 and update["learning_rate"] == 1e-4 and update["max_relative_weight_change"] > 0
    assert report["workload"]["suppressed_token_ids"] == [0, 1, 3]
    assert report["workload"]["prompts"].startswith("task 'arithmetic', steps 1-")
    assert report["exactness"]["torch"]["float64"]["differing"] == 0
    tries = report["draft_tries"]  # where the responses left their drafts, and decode steps with branches
    assert tries["requests"] == 16 and tries["divergences"]["responses"] == 16
    left = tries["divergences"]["responses_that_left_their_draft"]  # a response left it iff it was not all accepted
    assert left == 16 - report["backends"]["torch"]["fully_accepted_responses"]
    assert tries["divergences"]["divergences"] >= left and tries["divergences"]["median_reported_margin_per_response"]
    assert tries["branches"]["identical"] and tries["branches"]["branches_drafted"] > 0
    head = report["draft_head"]  # a head learned from pi_t's 64 samples of the GRPO step, drafting for pi_t+1
    assert head["requests"] == 16 and head["identical"]
    assert head["training"]["steps"] == 32 and head["training"]["responses"] == 64
    assert head["training"]["final_loss"] < head["training"]["first_loss"]
    arms = head["arms"]
    assert arms["plain"]["decode_steps"] == arms["plain"]["tokens"]
    assert arms["drafts"]["decode_steps"] == report["backends"]["torch"]["decode_steps_with_draft"]
    assert arms["head"]["head_tokens_proposed"] == arms["head"]["draft_tokens_proposed"] > 0
    assert arms["head"]["head_tokens_accepted"] <= arms["head"]["head_tokens_proposed"]
    assert "draft head" in report["benchmark_seconds"]
    result = runner.invoke(app, ["bench", "engine", *config, "--weight-noise", "0.01"])
    assert result.exit_code != 0 and "leave out --weight-noise" in result.output


def test_a_grpo_step_without_reward_signal_is_a_clear_error_not_drafts_of_the_same_policy():
    from bubblespec.cli.bench_engine_requests import ConfigRun, grpo_step
    from bubblespec.core.config import validate
    from bubblespec.core.interfaces import GenerationResult, RequestStats

    class SameAnswer:  # every sample the same response: every group's rewards are equal
        def generate(self, requests):
            return [GenerationResult(r.key, [5, 2], [-1.0, -1.0], "stop", RequestStats()) for r in requests]

    config = validate({"task": {"prompts_per_step": 2, "samples_per_prompt": 2}})
    run = ConfigRun.of(config)
    with pytest.raises(ConfigError, match=r"no reward signal: in each of step 0's 2 groups every sample scored"):
        grpo_step(run, SameAnswer())
    run.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_quick_run_of_torch_and_vllm_side_by_side_reports_the_same_fields(tmp_path):
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("BUBBLESPEC_SKIP_VLLM") == "1":
            pytest.skip("vLLM is not installed and BUBBLESPEC_SKIP_VLLM=1")
        raise RuntimeError("this test needs vLLM (pip install -e '.[vllm]'), or BUBBLESPEC_SKIP_VLLM=1 to skip it")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    printed: list[str] = []
    report = _run_quick(
        tmp_path, "--backend", "torch,vllm", "--exactness-requests", "8", "--vllm-ngram", printed=printed
    )
    _check_rows(report, {"torch", "vllm"}, {"1", "16"})
    assert set(report["exactness"]) == {"torch", "vllm"}
    assert set(report["exactness"]["vllm"]) == {"float32", "bfloat16"}
    assert report["exactness"]["torch"]["float64"]["differing"] == 0
    torch_rows, vllm_rows = report["backends"]["torch"], report["backends"]["vllm"]
    assert torch_rows["decode_steps_no_draft"] == vllm_rows["decode_steps_no_draft"]  # the same requests and tokens
    _check_ngram_rows(report, printed[0])


def _check_ngram_rows(report: dict, printed: str) -> None:
    """vLLM's own n-gram drafts and its own sampler, timed beside the vllm backend: every row, speedups against the
    backend's plain run, and drafts that vLLM proposed and partly accepted (the arithmetic task's scratchpad repeats
    its digits), so that its responses took fewer decode steps than tokens."""
    from bubblespec.cli.bench_engine_ngram import NGRAM_SPECULATIVE_CONFIG
    from bubblespec.cli.bench_engine_ngram import ROW_FIELDS as NGRAM_ROW_FIELDS

    rows, vllm_rows = report["vllm_ngram"], report["backends"]["vllm"]
    assert set(rows) == {"speculative_config", "summary", *NGRAM_ROW_FIELDS}
    assert rows["speculative_config"] == NGRAM_SPECULATIVE_CONFIG
    for name in NGRAM_ROW_FIELDS:
        assert set(rows[name]) == {"1", "16"}, name
    for key in ("1", "16"):
        assert rows["num_requests"][key] == vllm_rows["num_requests"][key]
        assert rows["ngram_tokens_per_s"][key] > 0 and rows["vllm_sampler_tokens_per_s"][key] > 0
        plain = vllm_rows["engine_tokens_per_s"][key]
        assert rows["ngram_speedup"][key] == pytest.approx(rows["ngram_tokens_per_s"][key] / plain)
        assert rows["vllm_sampler_speedup"][key] == pytest.approx(rows["vllm_sampler_tokens_per_s"][key] / plain)
        assert rows["bubble_speedup"][key] == vllm_rows["speedup_with_draft"][key]
        assert 0 < rows["forward_passes_ngram"][key] <= rows["tokens_ngram"][key]
        assert 0 < rows["forward_passes_vllm_sampler"][key] <= rows["tokens_vllm_sampler"][key]
    summary = rows["summary"]
    assert summary["tokens"] == rows["tokens_ngram"]["16"]
    assert 0 < summary["verify_steps"] <= summary["decode_steps"] < summary["tokens"]
    assert 0 < summary["draft_tokens_accepted"] < summary["draft_tokens_proposed"]
    # a verify step emits its accepted tokens and one more, unless a stop or the length limit cuts them
    assert summary["decode_steps"] >= summary["tokens"] - summary["draft_tokens_accepted"]
    assert summary["acceptance_length_mean"] > 1
    assert "vLLM's own n-gram drafts beside bubble drafts" in printed and "n-gram drafts (up to 4 tokens" in printed
