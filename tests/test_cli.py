"""The command line and plugin discovery."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from bubblespec.cli.main import app
from bubblespec.core import plugins
from bubblespec.core.errors import PluginNotFoundError
from tests.step_records import step_record

runner = CliRunner()


def test_help_imports_no_heavy_modules():
    code = (
        "import sys; from bubblespec.cli.main import app; from typer.testing import CliRunner; "
        "result = CliRunner().invoke(app, ['--help']); assert result.exit_code == 0, result.output; "
        "heavy = [m for m in ('torch', 'transformers', 'ray', 'vllm') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plugins_lists_the_builtins_by_kind():
    result = runner.invoke(app, ["plugins"])
    assert result.exit_code == 0, result.output
    assert "torch" in result.output and "TorchEngine" in result.output
    assert "arithmetic" in result.output


def test_loading_plugins():
    from bubblespec.backends.torch_engine import TorchEngine

    assert plugins.load("backends", "torch") is TorchEngine
    with pytest.raises(PluginNotFoundError, match=r"unknown backends plugin 'nope'; available: .*torch"):
        plugins.load("backends", "nope")
    with pytest.raises(PluginNotFoundError, match="kinds: backends, draft_stores, draft_sources, policies, tasks"):
        plugins.available("engines")


def test_unknown_bench_target_is_a_clear_error():
    result = runner.invoke(app, ["bench", "nonsense"])
    assert result.exit_code == 2
    assert (
        "benchmark target 'nonsense' is neither a bench sub-command (engine, peers, peers-async) nor an existing "
        "config file" in result.output
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["examples/quickstart.yaml", "--backend", "vllm", "--device", "cuda", "--methods", "sync", "--sources",
          "ngram", "--batch-sizes", "999"], "--backend is an option of `bench engine`, not of `bench CONFIG`"),
        (["engine", "--methods", "sync"], "--methods is an option of `bench peers-async`, not of `bench engine`"),
        (["engine", "--output-dir", "x"], "--output-dir is an option of `bench peers` and `bench peers-async` and "
                                          "`bench CONFIG`, not of `bench engine`"),
        (["peers", "examples/quickstart.yaml", "--cut-tokens", "8"], "--cut-tokens is an option of `bench peers-as"),
        (["peers-async", "examples/quickstart.yaml", "--sources", "ngram"], "--sources is an option of `bench peers`,"),
        (["examples/quickstart.yaml", "--plot-dir", "x"], "--plot-dir is an option of `bench peers` and"),
    ],
)  # fmt: skip
def test_a_bench_option_of_another_mode_is_an_error_naming_its_mode(args, message):
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output
    assert "which takes --json" in result.output or "which takes" in result.output


def test_bench_engine_takes_set_only_with_a_run_config():
    result = runner.invoke(app, ["bench", "engine", "--set", "num_steps=2"])
    assert result.exit_code != 0 and "--set overrides a run config: give one with --config" in result.output


def test_each_bench_sub_command_lists_only_its_own_options():
    import re

    shown = {}
    for name in ("run", "engine", "peers", "peers-async"):
        result = runner.invoke(app, ["bench", name, "--help"], env={"COLUMNS": "300"})
        assert result.exit_code == 0, result.output
        shown[name] = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", result.output)) - {"--help"}
    assert shown["engine"] == {
        "--json", "--threads", "--repeats", "--quick", "--no-quick", "--backend", "--model", "--dtype", "--device",
        "--batch-sizes", "--max-new-tokens", "--weight-noise", "--adaptive-draft-length", "--fixed-draft-length",
        "--exactness-requests", "--config", "--set", "--vllm-ngram", "--head-steps",
    }  # fmt: skip
    assert shown["run"] == {"--json", "--set", "--output-dir"}
    assert shown["peers"] == {"--json", "--set", "--output-dir", "--sources", "--plot-dir", "--plot-prefix"}
    assert shown["peers-async"] == {
        "--json", "--set", "--output-dir", "--methods", "--seeds", "--jobs", "--cut-quantile", "--cut-tokens",
        "--plot-dir",
    }  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [
        ["examples/quickstart.yaml", "--set", "num_steps=2", "--json", "OUT"],
        ["run", "examples/quickstart.yaml", "--set", "num_steps=2", "--json", "OUT"],
        ["--json", "OUT", "--set", "num_steps=2", "examples/quickstart.yaml"],  # options before the mode, as before
        ["--set=num_steps=2", "examples/quickstart.yaml", "--json=OUT"],
    ],
)
def test_every_spelling_of_bench_config_runs_the_same_benchmark(tmp_path, monkeypatch, args):
    """`bench CONFIG` (the one bench command's spelling, which scripts use) is `bench run CONFIG`, with the options
    anywhere; the report reaches --json as it is."""
    import bubblespec.cli.bench_run

    seen = {}

    def side_by_side(config, output_dir):
        seen["num_steps"], seen["output_dir"] = config.num_steps, output_dir
        return {"per_step": [], "overall": {}, "from_step_2": {}, "identical_rollouts": True}

    monkeypatch.setattr(bubblespec.cli.bench_run, "run_side_by_side", side_by_side)
    monkeypatch.setattr(bubblespec.cli.bench_run, "print_report", lambda report: None)
    out = tmp_path / "out.json"
    result = runner.invoke(app, ["bench", *[a.replace("OUT", str(out)) for a in args]])
    assert result.exit_code == 0, result.output
    assert seen == {"num_steps": 2, "output_dir": None}
    assert json.loads(out.read_text())["identical_rollouts"] is True


def test_validate_prints_the_resolved_config_or_every_error(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("num_steps: 3\nrollout:\n  num_ranks: 4\n")
    result = runner.invoke(app, ["validate", str(good), "--set", "trainer.optimizer.learning_rate=0.001"])
    assert result.exit_code == 0, result.output
    assert "num_ranks: 4" in result.output and "learning_rate: 0.001" in result.output
    assert "bubble_policy: coverage-first" in result.output  # defaults are filled in
    # the sampling as the run resolves it: the config's null is the task's suppressed tokens, which it names
    assert "suppressed_token_ids: null" in result.output
    assert "responses end on token ids [2]; never sampled: [0, 1, 3] (the task's)" in result.output
    result = runner.invoke(app, ["validate", str(good), "--set", "rollout.sampling.suppressed_token_ids=[2]"])
    assert result.exit_code == 2 and "suppressed_token_ids [2] are the model's end-of-sequence tokens" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  num_ranks: zero\n  backend: nope\nunknown_section: 1\n")
    result = runner.invoke(app, ["validate", str(bad)])
    assert result.exit_code == 2
    for expected in ("3 error(s)", "rollout.num_ranks", "rollout.backend", "unknown_section"):
        assert expected in result.output
    # the backend's settings, checked as both clocks check them before a run starts
    result = runner.invoke(app, ["validate", str(good), "--set", "rollout.engine_options.bogus=1"])
    assert result.exit_code != 0
    assert "torch backend settings" in result.output and "bogus: Extra inputs are not permitted" in result.output


def test_run_with_a_missing_model_fails_cleanly_and_writes_nothing(tmp_path):
    config = tmp_path / "config.yaml"
    missing = tmp_path / "no-such-model"
    config.write_text(
        f"output_dir: {tmp_path / 'runs'}\nmodel:\n  path: {missing}\nclock:\n  kind: virtual\nmetrics:\n  port: 0\n"
    )
    result = runner.invoke(app, ["run", str(config)])
    assert result.exit_code == 2
    assert "no-such-model" in result.output and "no config.json" in result.output
    assert not (tmp_path / "runs").exists()
    result = runner.invoke(app, ["run", "--resume", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "not a run directory" in result.output


def test_the_live_display_shows_what_each_rank_is_doing_now():
    from rich.console import Console

    from bubblespec.core.config import validate
    from bubblespec.observe.progress import StepPrinter

    console = Console(record=True, width=120)
    printer = StepPrinter(validate({}), console)
    printer.phase(3, "rollout")
    printer.activity(0, "generate", "64 requests, 60 with a draft")
    printer.activity(1, "draft", "12 keys of step 4 in the bubble")
    console.print(printer._render())
    text = console.export_text()
    assert "step 3 (4/10): rollout" in text
    assert "generate" in text and "64 requests, 60 with a draft" in text
    assert "draft" in text and "12 keys of step 4 in the bubble" in text


def test_report_command_writes_the_report_and_explains_a_bad_folder(tmp_path):
    from bubblespec.core.config import validate
    from bubblespec.run.launch import run

    config = validate(
        {
            "name": "r",
            "output_dir": str(tmp_path),
            "num_steps": 2,
            "task": {"prompts_per_step": 2, "samples_per_prompt": 2},
            "rollout": {"num_ranks": 2, "sampling": {"max_new_tokens": 32}},
            "clock": {"kind": "virtual"},
            "metrics": {"enabled": False},
        }
    )
    run(config)
    result = runner.invoke(app, ["report", str(config.run_dir)])
    assert result.exit_code == 0, result.output
    folder = config.run_dir / "report"
    listed = [line for line in result.output.splitlines() if line.startswith(str(folder))]
    assert listed == sorted(str(path) for path in folder.iterdir())  # every file it wrote
    assert {"summary.md", "timeline.png", "steps.png", "training.png"} <= {path.rsplit("/", 1)[1] for path in listed}
    assert (config.run_dir / "report" / "summary.md").read_text().count("|") > 10
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "not a run directory" in result.output and "steps.jsonl" in result.output


def test_an_unreachable_ray_address_fails_fast_and_writes_nothing(tmp_path):
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "config.yaml"
    config.write_text(f"output_dir: {tmp_path / 'runs'}\nray:\n  address: 127.0.0.1:{port}\nmetrics:\n  port: 0\n")
    result = runner.invoke(app, ["run", str(config)])
    assert result.exit_code == 2
    assert f"ray.address '127.0.0.1:{port}' cannot be reached" in result.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("flag", ["--quiet", None, "--verbose"])
def test_run_logs_one_structured_line_per_step_unless_quiet(tmp_path, flag):
    config = tmp_path / "config.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'runs'}\nnum_steps: 2\nclock:\n  kind: virtual\nmetrics:\n  enabled: false\n"
        "task:\n  prompts_per_step: 2\n  samples_per_prompt: 2\nrollout:\n  sampling:\n    max_new_tokens: 24\n"
    )
    result = runner.invoke(app, ["run", str(config)] + ([flag] if flag else []))
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "decode_steps=" in line]
    if flag == "--quiet":
        assert not lines and "run directory:" in result.output
        assert "sample of step" not in result.output
    else:
        # what the model wrote, at the first step (show_sample_every: 10)
        assert "sample of step 0: 2 responses, reward min " in result.output and "sample of step 1" not in result.output
        assert "  prompt   '" in result.output and "  best     '" in result.output
        assert any("step=0 done=1/2 reward=" in line for line in lines)  # no pace yet: the first step warms up
        assert any("step=1 done=2/2 left=0m00s reward=" in line for line in lines)
        assert "report:" in result.output and "speculation " in result.output  # what it saved or cost
    assert (tmp_path / "runs" / "run" / "report" / "summary.md").is_file()


def test_bench_peers_runs_every_source_on_the_same_keys(tmp_path):
    out = tmp_path / "peers.json"
    args = ["bench", "peers", "examples/bench-peers.yaml", "--json", str(out), "--plot-dir", str(tmp_path)]
    small = ["num_steps=3", "task.prompts_per_step=4", "task.samples_per_prompt=2", "task.options.dataset_size=4"]
    small += ["rollout.num_ranks=2", "rollout.sampling.max_new_tokens=40"]
    sources = ["--sources", "ngram", "--sources", "history+group", "--sources", "bubble+suffix+ngram * 3"]
    sources += ["--sources", "head"]  # the draft head learned online, without bubble drafts (TLT's, FastGRPO's)
    result = runner.invoke(app, args + sources + [arg for s in small for arg in ("--set", s)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["variants"] == ["none", "ngram", "history+group", "bubble+suffix+ngram*3", "head"]
    assert report["identical_rollouts"] is True  # token trees of three candidates too
    assert [len(report["per_step"][v]) for v in report["variants"]] == [3, 3, 3, 3, 3]
    head = report["per_step"]["head"]
    assert head[0]["head_tokens_proposed"] == 0 and all(s["head_tokens_proposed"] > 0 for s in head[1:])
    assert all(s["draft_coverage"] == 0 for s in head)  # no bubble drafts: what it drafts is the head's
    assert all(s["head_tokens_proposed"] == 0 for v in report["variants"][:-1] for s in report["per_step"][v])
    assert report["steady_state"]["history+group"]["draft_coverage"] == 1.0  # prompts repeat every step
    assert report["steady_state"]["ngram"]["decode_step_reduction"] > 0
    assert (tmp_path / "peers-decode-steps.png").is_file() and (tmp_path / "peers-throughput.png").is_file()


def test_bench_peers_compares_one_hot_bubble_with_one_hot_plain_decoding(tmp_path):
    out = tmp_path / "peers.json"
    args = ["bench", "peers", "examples/bench-peers.yaml", "--json", str(out), "--sources", "bubble:one-hot"]
    small = ["num_steps=3", "task.prompts_per_step=4", "task.samples_per_prompt=2", "task.options.dataset_size=4"]
    small += ["rollout.num_ranks=2", "rollout.sampling.max_new_tokens=40", "rollout.verification=one_hot"]
    result = runner.invoke(app, args + [arg for s in small for arg in ("--set", s)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["variants"] == ["none", "none:one-hot", "bubble:one-hot"]
    # The config's one_hot is overridden: a variant without suffix runs coupled.
    assert report["verification"] == {"none": "coupled", "none:one-hot": "one_hot", "bubble:one-hot": "one_hot"}
    assert report["baselines"] == {"none": "none", "none:one-hot": "none:one-hot", "bubble:one-hot": "none:one-hot"}
    plain, one_hot = report["per_step"]["none:one-hot"], report["per_step"]["bubble:one-hot"]
    # One-hot rollouts are a function of (weights, key, version) too: bubble:one-hot equals none:one-hot.
    assert [s["identical_rollouts"] for s in one_hot] == [True, True, True] and report["identical_rollouts"] is True
    assert [s["generated_tokens"] for s in one_hot] == [s["generated_tokens"] for s in plain]
    assert one_hot[0]["generated_tokens"] == one_hot[0]["decode_steps"]  # step 1 has no drafts
    for step, baseline in zip(one_hot[1:], plain[1:], strict=True):
        assert step["draft_coverage"] == 1.0 and step["acceptance_length_mean"] > 1
        assert step["decode_step_reduction"] == pytest.approx(1 - step["decode_steps"] / baseline["decode_steps"])
        tokens_per_second = [s["generated_tokens"] / s["rollout_seconds"] for s in (step, baseline)]
        assert step["throughput_ratio"] == pytest.approx(tokens_per_second[0] / tokens_per_second[1])
    assert "own noise stream" in result.output


def test_bench_peers_refuses_unknown_sources_before_running():
    result = runner.invoke(app, ["bench", "peers", "examples/bench-peers.yaml", "--sources", "bubble+oracle"])
    assert result.exit_code == 2
    assert "unknown draft source 'oracle'; available: bubble, group, history, ngram, none, suffix" in result.output
    result = runner.invoke(app, ["bench", "peers", "examples/bench-peers.yaml", "--sources", "bubble*many"])
    assert result.exit_code == 2 and "after '*' comes the number of candidates" in result.output
    result = runner.invoke(app, ["bench", "peers", "examples/bench-peers.yaml", "--sources", "bubble:onehot"])
    assert result.exit_code == 2
    assert "unknown verification suffix 'onehot' in variant 'bubble:onehot'; allowed: 'one-hot'" in result.output
    result = runner.invoke(
        app, ["bench", "peers", "examples/bench-peers.yaml", "--sources", "bubble", "--sources", "bubble "]
    )
    assert result.exit_code == 2 and "variant(s) 'bubble' named more than once" in result.output


def test_ctrl_c_says_where_the_run_stopped_and_how_to_resume(tmp_path, monkeypatch):
    import bubblespec.run.launch
    from bubblespec.observe.run_dir import RunDirectory

    def interrupted_after_two_steps(config, **kwargs):
        folder = RunDirectory(config.run_dir)
        folder.create(config)
        for step in range(2):
            folder.append_step(step_record(step))
        raise KeyboardInterrupt

    monkeypatch.setattr(bubblespec.run.launch, "run", interrupted_after_two_steps)
    config = tmp_path / "run.yaml"
    config.write_text(f"name: stopped\noutput_dir: {tmp_path}\nclock: {{kind: virtual}}\n")
    result = runner.invoke(app, ["run", "--quiet", str(config)])
    assert result.exit_code == 130 and "Traceback" not in result.output
    assert "interrupted: 2 steps done, none checkpointed yet" in result.output
    assert f"bubblespec run --resume {tmp_path / 'stopped'}" in result.output


def test_sigterm_stops_a_bench_as_it_stops_a_run_and_leaves_no_file_behind(tmp_path):
    """`bench CONFIG` in its own process, SIGTERM once the speculation-off run has written its first step: one line,
    exit 143 as `bubblespec run`, no --json (it was to be written at the end), and its scratch runs removed."""
    import os
    import signal
    import time

    import yaml

    config = {"name": "stopped", "num_steps": 200, "model": {"dtype": "float64"}, "metrics": {"enabled": False},
              "task": {"prompts_per_step": 2, "samples_per_prompt": 2}, "clock": {"kind": "virtual"},
              "rollout": {"num_ranks": 2, "sampling": {"max_new_tokens": 8}}}  # fmt: skip
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump(config))
    scratch, out = tmp_path / "scratch", tmp_path / "out" / "bench.json"
    scratch.mkdir()
    out.parent.mkdir()
    command = [sys.executable, "-m", "bubblespec.cli.main", "bench", str(tmp_path / "bench.yaml"), "--json", str(out)]
    process = subprocess.Popen(command, env={**os.environ, "TMPDIR": str(scratch)}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        first_run = "bubblespec-bench-*/stopped-speculation-off/steps.jsonl"  # in the bench's scratch folder
        while not any(steps.read_text() for steps in scratch.glob(first_run)):
            assert process.poll() is None and time.monotonic() < deadline, "the bench never wrote its first step"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 143 and "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("terminated (SIGTERM): ")]
    assert line.endswith("`bench CONFIG` stopped before it finished; no output file was left half-written")
    assert not list(out.parent.iterdir()) and not list(scratch.glob("bubblespec-bench-*"))


def test_ctrl_c_while_a_bench_writes_its_json_leaves_the_file_before_it_whole(tmp_path, monkeypatch):
    """The report is written beside --json and moved onto it: Ctrl-C before the move leaves the old file as it was,
    and nothing else; the bench says so in one line and exits 130, as `bubblespec run`."""
    import os

    import bubblespec.cli.bench_run

    def interrupted(source, destination):
        raise KeyboardInterrupt

    monkeypatch.setattr(bubblespec.cli.bench_run, "run_side_by_side", lambda config, output_dir: {"per_step": []})
    monkeypatch.setattr(bubblespec.cli.bench_run, "print_report", lambda report: None)
    monkeypatch.setattr(os, "replace", interrupted)
    out = tmp_path / "out.json"
    out.write_text('{"from": "the last bench"}\n')
    result = runner.invoke(app, ["bench", "examples/quickstart.yaml", "--json", str(out)])
    assert result.exit_code == 130 and "Traceback" not in result.output, result.output
    assert "interrupted: `bench CONFIG` stopped before it finished; no output file" in result.output
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]
    assert json.loads(out.read_text()) == {"from": "the last bench"}


def test_plugins_help_names_every_kind():
    result = runner.invoke(app, ["plugins", "--help"])
    assert result.exit_code == 0, result.output
    for kind in plugins.KINDS:
        assert kind in result.output


def _bench_reports() -> dict[str, dict]:
    """A report of each bench printer with the keys it reads, numbers as wide as real runs have."""
    run_step = {
        "decode_steps_off": 148713,
        "decode_steps_on": 13391,
        "decode_step_reduction": 0.91,
        "acceptance_length_mean": 14.1,
        "draft_coverage": 1.0,
        "bubble_utilization": 1.0,
        "rollout_seconds_off": 123.456,
        "rollout_seconds_on": 45.678,
        "rollout_seconds_off_estimated_by_on": 123.123,
        "throughput_ratio": 12.41,
        "train_seconds_on": 6.123,
        "weight_sync_seconds_on": 1.266,
        "step_seconds_off": 131.846,
        "step_seconds_on": 54.067,
        "step_seconds_ratio": 2.44,
        "slowest_rank": 63,
        "slowest_rank_forward_passes": 11112,
        "slowest_response_tokens": 13579,
        "slowest_response_draft_tokens": 2468,
        "slowest_response_decode_steps": 11111,
        "branches_followed": 1234,
        "branch_tokens_drafted": 123456,
        "identical_rollouts": True,
    }
    aggregate = {"decode_step_reduction": 0.92, "acceptance_length_mean": 14.2, "step_seconds_ratio": 1.5}
    run = {
        "config": "arithmetic-example",
        "clock": "virtual",
        "per_step": [run_step | {"step": step} for step in range(12)],
        "overall": aggregate,
        "from_step_2": aggregate,
        "identical_rollouts": True,
        "identical_weights": True,
    }
    variants = ["none", "ngram", "history+group+ngram", "bubble+group+ngram", "none:one-hot", "bubble:one-hot"]
    peer_step = {
        "decode_steps": 123456,
        "generated_tokens": 1234567,
        "decode_step_reduction": -0.917,
        "acceptance_length_mean": 14.1,
        "draft_coverage": 1.0,
        "proposal_coverage": 0.95,
        "throughput_ratio": 12.41,
        "identical_rollouts": True,
    }
    peer_aggregate = {
        "decode_step_reduction": -0.917,
        "acceptance_length_mean": 14.1,
        "draft_coverage": 1.0,
        "proposal_coverage": 0.95,
        "generated_tokens": 12345678,
        "throughput_ratio": 12.41,
    }
    peers = {
        "config": "bench-peers",
        "clock": "virtual",
        "num_steps": 12,
        "epoch_steps": 4,
        "variants": variants,
        "baselines": {v: "none:one-hot" if v.endswith(":one-hot") else "none" for v in variants},
        "verification": {v: "one_hot" if v.endswith(":one-hot") else "coupled" for v in variants},
        "per_step": {v: [peer_step | {"step": step} for step in range(12)] for v in variants},
        "from_step_2": dict.fromkeys(variants, peer_aggregate),
        "steady_state": dict.fromkeys(variants, peer_aggregate),
        "identical_rollouts": True,
    }
    per_batch = {
        "engine_tokens_per_s": 12345.0,
        "engine_tokens_per_s_with_draft": 23456.0,
        "speedup_with_draft": 13.4,
        "forward_passes_no_draft": 1287,
        "forward_passes_with_draft": 122,
        "identical_outputs": True,
    }
    rows = {name: dict.fromkeys(("1", "16", "32"), value) for name, value in per_batch.items()}
    rows |= {"engine_vs_hf_generate": {"1": 1.24, "16": 11.36}, "decode_steps_no_draft": 4000, "undecided_steps": 0}
    exact = {"responses": 64, "differing": 0, "mismatch_rate": 0.0}
    exact |= {"differing_between_plain_batches": 12, "plain_batch_mismatch_rate": 12 / 64}
    keyed = {"keyed_sample_s": 1e-3, "forward_pass_s": 1e-2, "share_of_forward_pass": 0.1}
    engine = {
        "settings": {"dtype": "bfloat16", "model_path": "/models/Qwen2.5-0.5B-Instruct"},
        "backends": {"torch": rows, "vllm": rows},
        "hf_generate_tokens_per_s": {"1": 9876.0, "16": 10850.0},
        "exactness": {"torch": {"float64": exact, "bfloat16": exact}, "vllm": {"float32": exact}},
        "keyed_sampling": keyed | {"batch_size": 16, "vocab_size": 151936, "context_tokens": 100},
        "policy_update": {"weight_noise": 1e-4},
        "benchmark_seconds": {"batch 1": 10.0},
    }
    return {"run": run, "peers": peers, "engine": engine}


@pytest.mark.parametrize(
    ("bench", "shown"),
    [
        (
            "run",
            ["148713", "13391", "91.0%", "14.10", "123.456", "45.678", "12.41x", "yes", "1234"]
            + ["131.85", "54.07", "2.44x", "7.39", "63", "11112", "13579", "2468"],
        ),
        ("peers", ["history+group+ngram", "123456", "1234567", "-91.7%", "12.41x", "12345678", "0.95", "identical"]),
        ("engine", ["9876", "12345", "11.36x", "23456", "13.40x", "1287 -> 122", "0 (0.0%)", "12 (18.8%)"]),
    ],
)
def test_bench_tables_fit_80_columns(bench, shown):
    import importlib
    import io

    from rich.console import Console

    console = Console(width=80, record=True, file=io.StringIO())
    importlib.import_module(f"bubblespec.cli.bench_{bench}").print_report(_bench_reports()[bench], console)
    text = console.export_text()
    assert "…" not in text  # rich cuts a header or cell that does not fit with an ellipsis
    assert max(len(line) for line in text.splitlines()) <= 80
    for number in shown:
        assert number in text


def test_bench_names_no_slowest_response_for_a_step_recorded_before_it_was_kept():
    """Step records written before ``RankRecord.slowest_response_*`` existed read back with None there: the bench
    table shows a dash for the response, not a response of 0 tokens."""
    from types import SimpleNamespace

    from pydantic import TypeAdapter

    from bubblespec.cli.bench_run import _slowest_response
    from bubblespec.rollout.step import RankRecord

    old = TypeAdapter(RankRecord).validate_python({"rank": 1, "forward_passes": 7, "generation_seconds": 2.0})
    assert old.slowest_response_tokens is None
    found = _slowest_response(SimpleNamespace(ranks=[RankRecord(0, generation_seconds=1.0), old]))
    assert found == {"slowest_rank": 1, "slowest_rank_forward_passes": 7}


GPU_EXAMPLES = [
    # (file, rollout ranks, trainer workers): one GPU each, on one machine
    ("gpu-qwen25-05b.yaml", 3, 1),
    ("gpu-7b.yaml", 6, 2),
]


@pytest.fixture(scope="module")
def qwen2_chat_model(tmp_path_factory) -> str:
    """A small random Qwen2-family chat model (ChatML template, byte-level tokenizer, 512 tokens): what the GPU
    examples' Qwen2.5-Instruct folders are, at a size this machine loads in a second."""
    from bubblespec.testing.random_checkpoints import write_chat_model

    return str(write_chat_model(tmp_path_factory.mktemp("models") / "qwen2-chat"))


def _leaves(tree: dict, prefix: str = "") -> dict:
    """A nested mapping's values by dotted path (lists are values)."""
    found = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            found |= _leaves(value, f"{prefix}{key}.")
        else:
            found[f"{prefix}{key}"] = value
    return found


@pytest.mark.parametrize(("example", "ranks", "workers"), GPU_EXAMPLES)
def test_each_gpu_example_validates_as_shipped_with_only_its_model_folder_replaced(
    example, ranks, workers, qwen2_chat_model
):
    """`bubblespec validate` on this CPU-only machine: it builds the task (the model's chat template, the GSM8K-format
    rows, the rewards) and checks the engine settings and the sampling, and neither looks for CUDA nor counts GPUs
    (the run does at its start: the next test). Every setting the file makes but model.path reaches the resolved
    config as shipped: the GPUs per rank and per trainer worker, the trainer on CUDA, bfloat16, the speculation."""
    from pathlib import Path

    import yaml

    path = Path(__file__).parent.parent / "examples" / example
    result = runner.invoke(app, ["validate", str(path), "--set", f"model.path={qwen2_chat_model}"])
    assert result.exit_code == 0, result.output
    resolved = _leaves(yaml.safe_load(result.stdout[: result.stdout.index("\ndrafting while the trainer trains")]))
    shipped = _leaves(yaml.safe_load(path.read_text()))
    assert shipped.pop("model.path").startswith("../checkpoints/Qwen2.5-")
    assert resolved["model.path"] == qwen2_chat_model
    for option in ("task.options.path", "task.options.eval_path"):  # relative to the file, resolved
        assert resolved[option] == str((path.parent / shipped.pop(option)).resolve())
    assert {key: resolved[key] for key in shipped} == shipped
    assert (resolved["rollout.num_ranks"], resolved["trainer.num_workers"]) == (ranks, workers)
    assert resolved["rollout.gpus_per_rank"] == resolved["trainer.gpus_per_worker"] == 1
    assert resolved["rollout.engine_options.device"] == resolved["trainer.device"] == "cuda"
    assert [resolved[key] for key in ("model.dtype", "clock.kind", "rollout.backend")] == ["bfloat16", "wall", "torch"]
    assert "drafting while the trainer trains: on (auto: the ranks reserve GPUs of their own" in result.stdout
    assert "train rows: 4000" in result.stdout and "held-out rows: 200" in result.stdout
    assert "<|im_start|>system\n    Solve the problem step by step." in result.stdout
    assert "rewards: math (weight 1), format (weight 0.1)" in result.stdout and "warning" not in result.output


@pytest.mark.parametrize(("example", "ranks", "workers"), GPU_EXAMPLES)
def test_a_gpu_example_is_refused_at_start_where_ray_has_not_its_gpus(
    example, ranks, workers, qwen2_chat_model, monkeypatch
):
    """What validate leaves to the run: on the local Ray it starts, a run checks the GPUs its ranks and trainer
    workers reserve before deploying anything (tests/test_ray.py runs that through `run`), as one error with the
    count. Here that check on each shipped example, with this machine's Ray resources (no GPU) stood in for."""
    import re
    from pathlib import Path

    import ray

    from bubblespec.core.config import load_config
    from bubblespec.core.errors import ConfigError
    from bubblespec.run.ray_cluster import check_local_gpus

    config = load_config(Path(__file__).parent.parent / "examples" / example, [f"model.path={qwen2_chat_model}"])
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    message = (
        f"rollout.num_ranks {ranks} x rollout.gpus_per_rank 1 plus trainer.num_workers {workers} x 1 GPUs per worker "
        f"(trainer.device 'cuda') need {ranks + workers} GPUs; this machine's Ray has 0"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_local_gpus(config)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": float(ranks + workers)})
    check_local_gpus(config)  # a machine with that many GPUs passes


def test_a_speculation_preset_sets_the_measured_settings_validate_shows_them_and_a_setting_beside_it_wins(tmp_path):
    """``speculation.preset`` in one line: the settings the benchmarks measured best (``gpu``: bench-long's on the
    virtual h100-7b profile; ``cpu``: the main job's on this machine's wall clock), resolved where validate shows them;
    a setting given beside it wins, and a preset on a run that drafts nothing sets no candidates."""
    from bubblespec.core.config import SPECULATION_PRESETS, load_config, validate

    for name, preset in {"bench-long": "gpu", "quickstart": "cpu", "bench-wall": "cpu"}.items():
        speculation = load_config(f"examples/{name}.yaml").speculation  # what the benchmarks ran
        assert speculation.preset == preset
        assert {key: getattr(speculation, key) for key in SPECULATION_PRESETS[preset]} == SPECULATION_PRESETS[preset]
    gpu = validate({"speculation": {"preset": "gpu", "lookahead_steps": 1}}).speculation
    assert (gpu.draft_sources, gpu.draft_candidates, gpu.lookahead_steps) == (["bubble", "suffix", "ngram"], 4, 1)
    assert validate({"speculation": {"preset": "gpu", "enabled": False}}).speculation.draft_candidates == 1
    config = tmp_path / "preset.yaml"
    config.write_text("speculation:\n  preset: cpu\n")
    result = runner.invoke(app, ["validate", str(config)])
    assert result.exit_code == 0, result.output
    assert "preset: cpu" in result.output and "- suffix" in result.output and "longest-first" in result.output
    config.write_text("speculation:\n  preset: tpu\n")
    result = runner.invoke(app, ["validate", str(config)])
    assert result.exit_code == 2 and "speculation.preset: Input should be 'cpu' or 'gpu'" in result.output
