"""The synchronous RL loop on the virtual clock (no Ray): exactness, policies, resume and config errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bubblespec.core.config import apply_overrides, load_config, validate
from bubblespec.core.errors import BubblespecError, CheckpointError, ConfigError
from bubblespec.observe.records import StepRecord
from bubblespec.observe.run_dir import RunDirectory
from bubblespec.run.launch import run
from tests.step_records import step_record

SMALL = {
    "num_steps": 3,
    "checkpoint_every": 10,
    "model": {"dtype": "float64"},
    "task": {"prompts_per_step": 4, "samples_per_prompt": 2},
    "rollout": {"num_ranks": 2, "sampling": {"max_new_tokens": 48}},
    "clock": {"kind": "virtual", "profile": "h100-7b"},
    "trainer": {"optimizer": {"learning_rate": 1e-3}},
    "metrics": {"port": 0},
}


def _config(tmp_path, name: str, **changes) -> object:
    data = {key: dict(value) if isinstance(value, dict) else value for key, value in SMALL.items()}
    for section, value in changes.items():
        if isinstance(value, dict):
            data[section] = data.get(section, {}) | value
        else:
            data[section] = value
    return validate(data | {"name": name, "output_dir": str(tmp_path)})


def _run(tmp_path, name: str, **changes) -> tuple[list[dict], dict]:
    config = _config(tmp_path, name, **changes)
    run(config)
    run_dir = RunDirectory(config.run_dir)
    weights = load_file(str(run_dir.latest_checkpoint() / "weights.safetensors"))
    return run_dir.read_steps(), weights


def _crash_after(config, step: int) -> RunDirectory:
    """Runs ``config`` until its controller raises after step ``step`` was logged (not checkpointed); its run
    directory, to resume from."""

    class Crash(Exception):
        pass

    def crash(record):
        if record.step == step:
            raise Crash

    with pytest.raises(Crash):
        run(config, on_step=crash)
    return RunDirectory(config.run_dir)


def _rollouts(steps: list[dict]) -> list[tuple]:
    return [(s.step, s.rollout_digest, s.reward_mean) for s in steps]


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Speculation off: the plain synchronous run everything else must reproduce."""
    return _run(tmp_path_factory.mktemp("runs"), "plain", speculation={"enabled": False})


def test_speculation_changes_no_rollout_reward_or_weight(tmp_path, baseline):
    plain_steps, plain_weights = baseline
    steps, weights = _run(tmp_path, "spec", speculation={"enabled": True})
    assert _rollouts(steps) == _rollouts(plain_steps)
    assert _same_weights(weights, plain_weights)
    # and speculation really happened: drafts were verified from step 1 on
    assert all(s.draft_tokens_accepted > 0 for s in steps[1:])
    assert sum(s.decode_steps for s in steps) < sum(s.decode_steps for s in plain_steps)
    assert steps[0].draft_coverage == 0 and steps[1].draft_coverage > 0


def test_draft_tries_change_no_rollout_or_weight_and_their_branches_are_followed(tmp_path, baseline):
    """Idle ranks branch the next step's drafts at their near-ties (docs/design.md §13), with two candidates a pass
    (the branches ahead are verified beside the draft) and with one."""
    plain_steps, plain_weights = baseline
    tries = {"enabled": True, "tries_max_tokens_per_rank": 400, "draft_during_training": True}
    single_steps, _ = _run(tmp_path, "single", speculation=tries | {"tries_max_tokens_per_rank": 0})
    for candidates in (1, 2):
        steps, weights = _run(tmp_path, f"tries-{candidates}", speculation=tries | {"draft_candidates": candidates})
        assert _rollouts(steps) == _rollouts(plain_steps)
        assert _same_weights(weights, plain_weights)
        branch_tokens = [sum(rank.branch_tokens_produced for rank in s.ranks) for s in steps]
        followed = sum(rank.branches_followed for s in steps for rank in s.ranks)
        assert sum(branch_tokens) > 0 and branch_tokens[-1] == 0, branch_tokens  # the last step drafts nothing
        assert followed > 0, "no response took a branch"
        # where a response took one, it decoded fewer steps than along the single path (step 1 here; speed in
        # general is BENCHMARKS.md's: a faster rollout leaves less bubble to draft the next step's keys)
        took = [i for i, s in enumerate(steps) if any(rank.branches_followed for rank in s.ranks)]
        assert all(steps[i].decode_steps < single_steps[i].decode_steps for i in took), candidates


HEAD = {"enabled": True, "window": 16, "steps_per_rollout": 8, "responses_per_step": 4}


def test_a_draft_head_learned_online_changes_no_rollout_or_weight_and_drafts(tmp_path, baseline):
    """The last rank learns a draft head from each step's responses while the trainer trains (docs/design.md §14),
    its own with the hidden states it kept; from step 1 on it drafts beside the bubble drafts, and the run is the plain
    one."""
    plain_steps, plain_weights = baseline
    steps, weights = _run(
        tmp_path, "head", speculation={"enabled": True, "draft_during_training": True, "draft_head": HEAD}
    )
    assert _rollouts(steps) == _rollouts(plain_steps)
    assert _same_weights(weights, plain_weights)
    learned = [s.draft_head for s in steps]
    assert all(h is not None and h.rank == 1 and h.steps == 8 and h.responses == 8 for h in learned), learned
    assert all(h.seconds > 0 and h.wait_seconds <= h.seconds for h in learned)
    # the learning rank kept its own responses' hidden states as it generated them; the others' are computed again
    assert all(0 < h.kept_responses < h.responses for h in learned), learned
    proposed = [sum(rank.head_tokens_proposed for rank in s.ranks) for s in steps]
    assert proposed[0] == 0 and all(p > 0 for p in proposed[1:]), proposed
    accepted = sum(rank.head_tokens_accepted for s in steps for rank in s.ranks)
    assert 0 < accepted <= sum(proposed)


@pytest.mark.parametrize("drafting", [True, False], ids=["beside-the-trainer", "on-the-trainers-hardware"])
def test_the_step_waits_once_for_a_head_that_outlasts_the_trainer(tmp_path, drafting):
    """A head that learns longer than the trainer trains: beside the trainer (the ranks draft while it trains) the
    weight sync waits for what outlasted the trainer once, as for a late drafting pass (its rank's drafting starts
    after the head); where the ranks share the trainer's hardware the sync waits for the whole head after it. After
    the first training phase the head learns within the last one's seconds."""
    long_head = HEAD | {"steps_per_rollout": 400}
    speculation = {"enabled": True, "draft_during_training": drafting, "draft_head": long_head}
    first, second = _run(tmp_path, "long-head", num_steps=2, speculation=speculation)[0]
    head = first.draft_head  # step 0's is not budgeted: no training phase has run yet
    assert head.steps == 400 and head.seconds > first.phase_seconds.train, "the head must outlast the trainer"
    plain = _run(tmp_path, "no-head", num_steps=1, speculation=speculation | {"draft_head": {"enabled": False}})[0][0]

    def late_wait(record) -> float:  # the sync's wait for the drafts' late passes
        return record.barrier_wait_seconds - (record.phase_seconds.rollout - record.barrier_seconds)

    if drafting:
        # the sync waits for the head (the latest) once: what it added beyond the other ranks' late passes is the
        # head's, not the drafts' (their estimated saving does not pay for the head)
        assert 0 < head.wait_seconds <= head.seconds
        assert late_wait(first) < head.wait_seconds
    else:
        assert head.wait_seconds == head.seconds and late_wait(first) == 0
    sync = plain.phase_seconds.weight_sync - late_wait(plain)  # the sync itself, the head's parameters aside
    assert first.phase_seconds.weight_sync == pytest.approx(
        sync + late_wait(first) + head.wait_seconds + head.sync_seconds
    )
    # from step 1 on it learns within the last training phase's seconds: fewer steps
    assert 0 < second.draft_head.steps < 400 and second.draft_head.seconds <= first.phase_seconds.train


def test_a_head_that_does_not_pay_pauses_under_auto_and_a_resumed_run_pauses_alike(tmp_path, baseline):
    """``draft_head.enabled: auto`` (cpu-tiny: a head step costs half a pass, so the head proposes little and saves
    less than its learning and sync cost): judged over steps 1-3, it pauses at step 3's end, before the weight sync
    would send round 3's head, so it drafts in no later step and does not learn after steps 4-7; outputs are the plain
    run's; a run resumed from the checkpoint after step 5 (the engine's head paused) goes on alike (the head's gate,
    its budget and its pause are in the checkpoint)."""
    changes = {
        "num_steps": 8,
        "checkpoint_every": 2,
        "speculation": {"enabled": True, "draft_during_training": True, "draft_head": HEAD | {"enabled": "auto"}},
        "clock": {"kind": "virtual", "profile": "cpu-tiny"},
    }
    uninterrupted, final = _run(tmp_path, "whole", **changes)
    assert _rollouts(uninterrupted)[:3] == _rollouts(baseline[0])
    learned = [s.draft_head is not None for s in uninterrupted]
    assert learned == [True] * 4 + [False] * 4, learned
    assert [s.draft_head.sync_seconds > 0 for s in uninterrupted[:4]] == [True, True, True, False]
    proposed = [sum(rank.head_tokens_proposed for rank in s.ranks) for s in uninterrupted]
    assert proposed[0] == 0 and sum(proposed[1:4]) > 0 and proposed[4:] == [0] * 4, proposed

    config = _config(tmp_path, "broken", **changes)
    run_dir = _crash_after(config, step=6)
    assert torch.load(run_dir.latest_checkpoint() / "draft_head.pt")["paused"] is True
    run(run_dir.load_config(), resume_dir=config.run_dir)  # from the checkpoint after step 5: paused
    resumed = run_dir.read_steps()
    assert [_without_timelines(s) for s in resumed] == [_without_timelines(s) for s in uninterrupted]
    assert _same_weights(load_file(str(run_dir.latest_checkpoint() / "weights.safetensors")), final)


def test_a_draft_head_without_its_backend_or_schedule_is_refused_by_name(tmp_path):
    head = {"enabled": True, "draft_head": {"enabled": True}}
    with pytest.raises(ConfigError, match="does not draft with a draft head"):
        run(_config(tmp_path, "sglang", speculation=head, rollout={"backend": "sglang"}))
    with pytest.raises(ConfigError, match="the head learns while the trainer trains"):
        _config(tmp_path, "async", speculation=head, schedule={"kind": "async"})


@pytest.mark.parametrize(
    "advantage", ["dr_grpo", "rloo", "reinforce_pp", {"advantage": "grpo", "scale_rewards": "batch"}]
)
def test_speculation_changes_no_rollout_or_weight_for_every_advantage_estimator(tmp_path, advantage):
    trainer = {"loss": advantage if isinstance(advantage, dict) else {"advantage": advantage}}
    plain_steps, plain_weights = _run(tmp_path, "plain", speculation={"enabled": False}, trainer=trainer)
    steps, weights = _run(tmp_path, "spec", speculation={"enabled": True}, trainer=trainer)
    assert _rollouts(steps) == _rollouts(plain_steps) and _same_weights(weights, plain_weights)
    assert sum(s.draft_tokens_accepted for s in steps) > 0


RECIPE_CHECKS = {
    # recipe: a check on its step records that its algorithm really acted
    "grpo": lambda steps: all(s.train["kl"] > 0 for s in steps[1:]),
    "dr-grpo": lambda steps: all("kl" not in s.train and s.train["optimizer_steps"] == 1 for s in steps),
    "dapo": lambda steps: (
        all(s.train["groups_dropped"] > 0 for s in steps)
        and max(s.train["optimizer_steps"] for s in steps) > 1
        and max(s.train["ratio_max"] for s in steps) > 1.0
    ),
    "rloo": lambda steps: all(s.train["ratio_max"] == 1.0 for s in steps) and steps[-1].train["kl"] != 0,
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPE_CHECKS))
def test_each_recipe_trains_identically_with_speculation_on_and_off(tmp_path, recipe):
    """examples/recipe-*.yaml, shortened to 3 steps of 8 prompts (DAPO: 16 trained of 20): the side-by-side bench
    finds identical rollouts and final weights, and fewer decode steps with speculation."""
    from pathlib import Path

    from bubblespec.cli.bench_run import run_side_by_side

    overrides = ["num_steps=3", "checkpoint_every=3", "metrics.enabled=false", "task.prompts_per_step=8"]
    if recipe == "dapo":  # 20 prompts generated for 16 trained
        overrides += ["task.prompts_per_step=20", "trainer.dapo.train_prompts=16"]
    config = load_config(Path(__file__).parent.parent / "examples" / f"recipe-{recipe}.yaml", overrides)
    report = run_side_by_side(config, tmp_path)
    assert report["identical_rollouts"] and report["identical_weights"]
    assert report["from_step_2"]["decode_step_reduction"] > 0.3
    for step in report["per_step"]:  # a rank's batch waits for its slowest response
        assert 0 < step["slowest_response_decode_steps"] <= step["slowest_rank_forward_passes"]
        assert step["step_seconds_on"] == pytest.approx(
            step["rollout_seconds_on"] + step["train_seconds_on"] + step["weight_sync_seconds_on"]
        )
    steps = RunDirectory(tmp_path / f"{config.name}-speculation-on").read_steps()
    assert RECIPE_CHECKS[recipe](steps), [s.train for s in steps]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"trainer": {"device": "cuda"}}, "trainer.device 'cuda': this machine has no CUDA device"),
        ({"rollout": {"engine_options": {"device": "cuda:0"}}}, "device 'cuda:0' was asked for but torch sees no CUDA"),
        ({"rollout": {"engine_options": {"device": "tpu7"}}}, "device: .*'tpu7' is not a torch device"),
    ],
)
def test_a_device_this_machine_lacks_is_a_clear_error(tmp_path, changes, message):
    config = _config(tmp_path, "device", **changes)
    with pytest.raises(BubblespecError, match=message):
        run(config)
    assert not config.run_dir.exists()


@pytest.mark.parametrize("clock", ["virtual", "wall"])
def test_a_bad_engine_option_is_a_config_error_before_anything_starts(tmp_path, clock):
    config = _config(tmp_path, clock, clock={"kind": clock}, rollout={"engine_options": {"bogus": 1}})
    with pytest.raises(ConfigError, match=r"torch backend settings .*bogus: Extra inputs .*valid settings: .*dtype"):
        run(config)  # on the wall clock: before Ray starts, not as a failed Serve deployment
    assert not config.run_dir.exists()


@pytest.mark.parametrize(
    "changes",
    [
        {"rollout": {"num_ranks": 3}},
        {"speculation": {"sharding_policy": "length-balanced"}},
        {"speculation": {"bubble_policy": "longest-first", "draft_during_training": True}},
        {"speculation": {"lookahead_steps": 2}},
        {"rollout": {"num_ranks": 1, "max_batch_size": 3, "max_draft_tokens_per_step": 5}},
    ],
)
def test_ranks_sharding_and_bubble_policy_change_no_rollout(tmp_path, baseline, changes):
    plain_steps, plain_weights = baseline
    changes = changes | {"speculation": {"enabled": True} | changes.get("speculation", {})}
    steps, weights = _run(tmp_path, "variant", **changes)
    assert _rollouts(steps) == _rollouts(plain_steps)
    assert _same_weights(weights, plain_weights)


@pytest.mark.parametrize(
    "sources", [["none"], ["ngram"], ["group"], ["history"], ["bubble", "group", "ngram"], ["history", "ngram"]]
)
def test_draft_sources_change_no_rollout(tmp_path, sources):
    """Every draft source and combination reproduces plain decoding (prompts repeat every 2 steps, so that
    history has responses to propose; siblings share a rank, so that group drafting has siblings)."""
    task = {"options": {"dataset_size": 8}}
    plain_steps, plain_weights = _run(tmp_path, "plain", task=task, speculation={"enabled": False})
    speculation = {"draft_sources": sources, "sharding_policy": "prompt-grouped"}
    steps, weights = _run(tmp_path, "sources", task=task, speculation=speculation)
    assert _rollouts(steps) == _rollouts(plain_steps)
    assert _same_weights(weights, plain_weights)
    if sources == ["group"]:  # siblings decode in lockstep: one is rarely ahead of another to propose
        pass
    elif sources != ["none"]:
        assert sum(s.draft_tokens_accepted for s in steps) > 0
    else:
        assert all(s.verify_steps == 0 and s.drafts_made == 0 for s in steps)
    if sources == ["history"]:  # step 2 repeats step 0's prompts: history drafts from then on only
        assert [s.draft_coverage for s in steps] == [0.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        (
            ["bubble", "telepathy"],
            "unknown draft source 'telepathy'; available: bubble, group, history, ngram, none, suffix",
        ),
        (["ngram", "bubble", "ngram"], "'ngram' named more than once"),
        (["none", "ngram"], "'none' cannot be combined"),
        ([], "at least one draft source"),
    ],
)
def test_draft_source_config_errors(sources, message):
    with pytest.raises(ConfigError, match=message):
        validate({"speculation": {"draft_sources": sources}})


THIRD_PARTY_SOURCES = """
from bubblespec.core.draft_sources import StaticDraftSource
from bubblespec.core.interfaces import Draft


class LastResponse(StaticDraftSource):
    \"\"\"The last response to the same prompt, whatever its sample index, cut to max_tokens.\"\"\"

    def __init__(self, max_tokens):
        self.max_tokens, self.seen = max_tokens, {}

    def observe(self, results):
        for result in results:
            self.seen[result.key.prompt_uid] = (result.key.step, tuple(result.token_ids[: self.max_tokens]))

    def drafts(self, keys):
        found = {k: self.seen.get(k.prompt_uid) for k in keys}
        return {k: Draft(k, seen[1], seen[0]) for k, seen in found.items() if seen and seen[1] and seen[0] < k.step}


def not_a_source():
    return None
"""


@pytest.fixture
def third_party_sources(tmp_path, monkeypatch):
    """A package installed beside bubblespec (its module and dist-info on sys.path) that registers a static draft
    source and a function under the draft source entry point group."""
    package = tmp_path / "third_party"
    package.mkdir()
    (package / "thirdparty_sources.py").write_text(THIRD_PARTY_SOURCES)
    info = package / "thirdparty_sources-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-sources\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[bubblespec.draft_sources]\n"
        "last-response = thirdparty_sources:LastResponse\n"
        "not-a-source = thirdparty_sources:not_a_source\n"
        "[bubblespec.tasks]\n"
        "not-a-task = thirdparty_sources:not_a_source\n"
        "[bubblespec.backends]\n"
        "not-an-engine = thirdparty_sources:LastResponse\n"
    )
    monkeypatch.syspath_prepend(str(package))


def test_a_third_party_static_draft_source_is_used_with_its_options(tmp_path, third_party_sources):
    task = {"options": {"dataset_size": 8}}  # step 2 repeats step 0's prompts
    plain_steps, plain_weights = _run(tmp_path, "plain", task=task, speculation={"enabled": False})
    speculation = {"draft_sources": ["last-response"], "draft_source_options": {"last-response": {"max_tokens": 5}}}
    steps, weights = _run(tmp_path, "third-party", task=task, speculation=speculation)
    assert _rollouts(steps) == _rollouts(plain_steps) and _same_weights(weights, plain_weights)
    assert [s.draft_coverage for s in steps] == [0.0, 0.0, 1.0]
    assert steps[2].draft_tokens_accepted > 0


def test_a_draft_source_that_is_no_draft_source_class_is_refused_by_name(third_party_sources):
    with pytest.raises(ConfigError, match="draft source 'not-a-source' .* is not a draft source class"):
        validate({"speculation": {"draft_sources": ["not-a-source"]}})
    with pytest.raises(ConfigError, match="draft_source_options.last-response {}: .*max_tokens"):
        validate({"speculation": {"draft_sources": ["last-response"]}})


def test_plugins_that_do_not_subclass_their_kinds_base_are_refused_by_name(tmp_path, third_party_sources):
    from bubblespec.run.assembly import load_backend, make_task

    with pytest.raises(BubblespecError, match=r"tasks plugin 'not-a-task' \(thirdparty_sources:not_a_source\) is not a "
                       r"subclass of bubblespec.core.interfaces.Task"):  # fmt: skip
        make_task(_config(tmp_path, "task", task={"name": "not-a-task"}))
    with pytest.raises(BubblespecError, match="backends plugin 'not-an-engine' .* bubblespec.core.interfaces.Engine"):
        load_backend(_config(tmp_path, "engine", rollout={"backend": "not-an-engine"}))


def test_engine_side_draft_sources_need_a_backend_that_runs_them(tmp_path):
    from bubblespec.run.assembly import load_backend

    speculation = {"enabled": True, "draft_sources": ["bubble", "ngram"]}
    config = _config(tmp_path, "sglang", speculation=speculation, rollout={"backend": "sglang"})
    with pytest.raises(
        ConfigError,
        match=r"\['ngram'\] run inside the engine, and rollout.backend 'sglang' "
        r"cannot run them; use a backend that can \(torch, vllm\)",
    ):
        run(config)
    assert not config.run_dir.exists()
    vllm = _config(tmp_path, "vllm", speculation=speculation, rollout={"backend": "vllm"})
    assert load_backend(vllm).supports_draft_chain  # vLLM runs them in its proposer


def test_draft_trees_need_a_backend_that_runs_draft_chains(tmp_path):
    from bubblespec.run.assembly import load_backend

    speculation = {"enabled": True, "draft_candidates": 3}
    sglang = _config(tmp_path, "sglang", speculation=speculation, rollout={"backend": "sglang"})
    with pytest.raises(ConfigError, match="draft_candidates 3: rollout.backend 'sglang' verifies only the request"):
        load_backend(sglang)
    vllm = _config(tmp_path, "vllm", speculation=speculation, rollout={"backend": "vllm"})
    assert not load_backend(vllm).supports_draft_trees  # it verifies the first candidate (a warning says so)
    torch_config = _config(tmp_path, "torch", speculation=speculation)
    assert load_backend(torch_config).supports_draft_trees


@pytest.mark.parametrize(
    "changes",
    [
        {},
        # history drafts come back with the checkpoint: the resumed run is as fast, step by step, as the other
        {"speculation": {"draft_sources": ["history", "bubble"]}, "task": {"options": {"dataset_size": 8}}},
        # the checkpoint keeps the float32 master weights of a bfloat16 run (and its float32 Adam state)
        {"model": {"dtype": "bfloat16"}, "trainer": {"optimizer": {"learning_rate": 1e-5}}},
        # draft tries come back with the checkpoint: branches and near-ties of the pending drafts
        {"speculation": {"tries_max_tokens_per_rank": 400, "draft_during_training": True}},
        # the draft head comes back with the checkpoint: its parameters, optimizer state, sizing and budget (the last
        # training phase's seconds: 400 steps do not fit it)
        {"speculation": {"draft_head": HEAD | {"steps_per_rollout": 400}}},
        # on cpu-tiny a head step costs half a pass, so the head proposes only its probes: their pass count too
        {"speculation": {"draft_head": HEAD}, "clock": {"kind": "virtual", "profile": "cpu-tiny"}},
    ],
    ids=["bubble", "history", "bfloat16", "tries", "draft-head", "draft-head-probes"],
)
def test_resume_equals_an_uninterrupted_run(tmp_path, changes):
    uninterrupted, final = _run(tmp_path, "whole", num_steps=4, checkpoint_every=2, **changes)
    master_dtype = "float32" if changes.get("model", {}).get("dtype") == "bfloat16" else "float64"
    assert all(str(weight.dtype) == f"torch.{master_dtype}" for weight in final.values())
    config = _config(tmp_path, "broken", num_steps=4, checkpoint_every=2, **changes)
    run_dir = _crash_after(config, step=2)
    assert [s.step for s in run_dir.read_steps()] == [0, 1, 2]  # step 2 was logged, not checkpointed
    run(run_dir.load_config(), resume_dir=config.run_dir)
    resumed = run_dir.read_steps()
    assert [s.step for s in resumed] == [0, 1, 2, 3]
    assert [_without_timelines(s) for s in resumed] == [_without_timelines(s) for s in uninterrupted]
    assert _same_weights(load_file(str(run_dir.latest_checkpoint() / "weights.safetensors")), final)


@pytest.mark.slow
def test_a_killed_controller_resumes_to_an_identical_run(tmp_path):
    """SIGKILL the whole `bubblespec run` process at an arbitrary moment (mid-step, mid-checkpoint or mid-line of
    the step log), then `bubblespec run --resume`: the run ends exactly as an uninterrupted one."""
    from tests.crash import kill_after_steps, resume

    uninterrupted, final = _run(tmp_path, "whole", num_steps=6, checkpoint_every=2)
    config = _config(tmp_path, "killed", num_steps=6, checkpoint_every=2)
    kill_after_steps(config, 3)
    run_dir = RunDirectory(config.run_dir)
    assert len(run_dir.read_steps()) < 6
    resume(config)
    assert [_without_timelines(s) for s in run_dir.read_steps()] == [_without_timelines(s) for s in uninterrupted]
    assert _same_weights(load_file(str(run_dir.latest_checkpoint() / "weights.safetensors")), final)


def test_a_torn_last_step_line_is_dropped_and_other_bad_lines_are_named(tmp_path):
    run_dir = RunDirectory(tmp_path)
    first, second = step_record(0, reward_mean=0.5), step_record(1)
    run_dir.append_step(first)
    with run_dir.steps_file.open("a") as out:
        out.write('{"step": 1, "rew')  # the process died while writing this line
    assert run_dir.read_steps() == [first]
    run_dir.truncate_steps(0)
    run_dir.append_step(second)
    assert run_dir.read_steps() == [first, second]
    run_dir.steps_file.write_text(f"{first.to_json()}\nnot json\n{second.to_json()}\n")
    with pytest.raises(CheckpointError, match="steps.jsonl line 2 is not JSON"):
        run_dir.read_steps()
    # JSON that is not a step record (a field missing, a field of the wrong type) is named with its fields
    run_dir.steps_file.write_text(f'{first.to_json()}\n{{"step": 1}}\n')
    with pytest.raises(CheckpointError, match=r"steps.jsonl line 2 is not a step record: reward_mean: Field required"):
        run_dir.read_steps()
    run_dir.steps_file.write_text(first.to_json().replace('"reward_mean": 0.5', '"reward_mean": "high"') + "\n")
    with pytest.raises(CheckpointError, match=r"line 1 is not a step record: reward_mean: Input should be a valid"):
        run_dir.read_steps()


def _without_timelines(record: StepRecord) -> dict:
    return record.model_dump(exclude={"timelines"})


def test_a_corrupt_checkpoint_is_a_clear_error_not_a_restart(tmp_path):
    config = _config(tmp_path, "corrupt", num_steps=2, checkpoint_every=1)
    run(config)
    checkpoint = RunDirectory(config.run_dir).latest_checkpoint()
    (checkpoint / "weights.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="weights.safetensors"):
        run(config, resume_dir=config.run_dir)
    (checkpoint / "trainer.pt").unlink()
    with pytest.raises(CheckpointError, match="missing trainer.pt"):
        run(config, resume_dir=config.run_dir)


def test_an_existing_run_directory_is_not_overwritten(tmp_path):
    config = _config(tmp_path, "twice", num_steps=1)
    run(config)
    with pytest.raises(ConfigError, match="already exists; resume it"):
        run(config)


def test_flat_trainer_keys_of_earlier_versions_name_their_new_place():
    """Every key the trainer section had before it was grouped fails with the key it is now, all at once."""
    from bubblespec.core.config import MOVED_TRAINER_KEYS

    with pytest.raises(ConfigError) as raised:
        validate({"trainer": {key: None for key in MOVED_TRAINER_KEYS}})
    for key, place in MOVED_TRAINER_KEYS.items():
        assert f"trainer.{key} is now trainer.{place}" in str(raised.value)
    with pytest.raises(ConfigError, match="trainer.learning_rate is now trainer.optimizer.learning_rate"):
        validate(apply_overrides({}, ["trainer.learning_rate=0.1"]))
    with pytest.raises(ConfigError, match="trainer.model is a section now: trainer.model.kind: transformers"):
        validate({"trainer": {"model": "transformers"}})
    for example in sorted(Path(__file__).parent.parent.glob("examples/*.yaml")):
        load_config(example)  # the shipped examples have the new shape


def test_config_errors_name_the_field_and_the_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.backend: .*unknown backend 'nope'; available: .*torch"):
        validate({"rollout": {"backend": "nope"}})
    with pytest.raises(ConfigError, match=r"speculation.bubble_policy: .*available: coverage-first, longest-first"):
        validate({"speculation": {"bubble_policy": "round-robin"}})
    with pytest.raises(ConfigError, match=r"rollout.num_ranks: Input should be a valid integer.*'two'"):
        validate({"rollout": {"num_ranks": "two"}})
    with pytest.raises(ConfigError, match=r"trainer.optimizer.learning_rte: Extra inputs are not permitted"):
        validate({"trainer": {"optimizer": {"learning_rte": 0.1}}})
    with pytest.raises(ConfigError, match=r"trainer.optimizer.schedule: kind must be one of constant, cosine"):
        validate({"trainer": {"optimizer": {"schedule": {"kind": "linear"}}}})
    with pytest.raises(ConfigError, match=r"rollout.sampling.top_p: Input should be less than or equal to 1"):
        validate({"rollout": {"sampling": {"top_p": 2}}})
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("rollout: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad_yaml)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    good_yaml = tmp_path / "good.yaml"
    good_yaml.write_text("num_steps: 2\n")
    with pytest.raises(ConfigError, match="must look like section.field=value"):
        load_config(good_yaml, ["no-equals-sign"])
    assert load_config(good_yaml, ["rollout.num_ranks=3"]).rollout.num_ranks == 3


def test_task_options_reach_the_task_and_bad_ones_are_config_errors():
    from bubblespec.run.assembly import make_task

    config = validate({"task": {"options": {"reward": "digits", "max_digits": 5}}, "eval_prompts": 7})
    task, held_out = make_task(config), make_task(config, held_out=True)
    assert (task.reward, task.max_digits, held_out.reward, held_out.max_digits) == ("digits", 5, "digits", 5)
    assert len(held_out.batch(0)) == 7
    with pytest.raises(ConfigError, match=r"task.options \['colour'\] do not fit task 'arithmetic'"):
        make_task(validate({"task": {"options": {"colour": "red"}}}))
    with pytest.raises(ConfigError, match="reward must be one of"):
        make_task(validate({"task": {"options": {"reward": "partial"}}}))


def test_every_shipped_example_parses():
    from pathlib import Path

    examples = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))
    assert examples
    for example in examples:
        load_config(example)


def test_a_task_that_cannot_peek_runs_without_drafts_and_says_so(tmp_path, baseline, monkeypatch, caplog):
    from bubblespec.tasks.arithmetic import ArithmeticTask

    monkeypatch.setattr(ArithmeticTask, "peek", lambda self, step: None)
    steps, weights = _run(tmp_path, "no-peek", speculation={"enabled": True})
    assert "cannot say the prompts of step 1 in advance" in caplog.text
    assert all(s.draft_coverage == 0 for s in steps)
    assert _rollouts(steps) == _rollouts(baseline[0])


def test_a_run_that_pauses_drafting_gives_the_rollouts_and_weights_of_plain_decoding(tmp_path, monkeypatch, baseline):
    """speculation.enabled: auto with a gate that no saving satisfies: the run pauses drafting after its first judged
    step and probes every other step; its step records say so, and nothing it trains on changes."""
    import functools

    from bubblespec.rollout import service
    from bubblespec.rollout.speculation_gate import SpeculationGate

    never_pays = functools.partial(SpeculationGate, window=1, min_saving=10.0, probe_every=2)
    monkeypatch.setattr(service, "SpeculationGate", never_pays)
    plain_steps, plain_weights = _run(tmp_path, "plain", num_steps=6, speculation={"enabled": False})
    steps, weights = _run(tmp_path, "auto", num_steps=6, speculation={"enabled": "auto"})
    assert _rollouts(steps) == _rollouts(plain_steps) and _same_weights(weights, plain_weights)
    # step 1 verifies step 0's drafts and is judged as step 2 starts: paused from step 2, every other bubble a probe
    paused = [s.drafting_paused for s in steps]
    assert paused[:2] == [False, False] and paused[2:] == [i % 2 == 1 for i in range(1, len(paused) - 1)]
    assert steps[2].drafts_made == 0 and steps[3].drafts_made > 0
    assert all(s.draft_coverage == 0 for s in steps[3::2])  # after a paused bubble, nothing to verify


def test_virtual_ranks_stop_drafting_within_one_forward_pass(tmp_path):
    """Invariant 5 on the virtual clock: a rank's drafting ends at most one forward pass after the barrier."""
    from bubblespec.rollout.clocks import PROFILES

    steps, _ = _run(tmp_path, "preempt", speculation={"enabled": True}, rollout={"num_ranks": 4})
    profile = PROFILES["h100-7b"]
    # the most a single forward pass of these sizes can cost: 16 sequences x 17 tokens at 256 positions, each
    # position sampled over the shipped model's vocabulary
    from bubblespec.core.interfaces import ForwardPass
    from bubblespec.tasks import ArithmeticTask

    vocab = ArithmeticTask(seed=0).vocab_size
    longest_pass = profile.forward_seconds(ForwardPass(16, 16 * 17, 16 * 256, 16 * 17 * 256, 16 * 17 * vocab))
    latencies = [r.preemption_latency_seconds for s in steps for r in s.ranks]
    assert any(latency > 0 for latency in latencies)  # drafting really was cut off at the barrier
    assert max(latencies) <= longest_pass


def test_held_out_eval_is_recorded_and_repeatable(tmp_path):
    steps, _ = _run(tmp_path, "eval", num_steps=2, eval_every=1, eval_prompts=6)
    assert all(0 <= s.eval_reward <= 1 for s in steps)
    assert 0 <= steps[0].eval_reward_before_training <= 1
    again, _ = _run(tmp_path, "eval-again", num_steps=2, eval_every=1, eval_prompts=6)
    assert [s.eval_reward for s in again] == [s.eval_reward for s in steps]


def test_a_step_without_reward_signal_does_not_move_the_weights(tmp_path):
    from bubblespec.core.config import TrainerConfig
    from bubblespec.rl.learner import GRPOLearner, TrainSample
    from bubblespec.tasks import ArithmeticTask

    learner = GRPOLearner(
        str(ArithmeticTask.model_path()), "float64", TrainerConfig(optimizer={"learning_rate": 1e-2}), 1.0
    )
    before = learner.state_dict()
    same_rewards = [TrainSample((1, 5), (6, 2), group=0, reward=1.0), TrainSample((1, 5), (7, 2), group=0, reward=1.0)]
    assert learner.step(same_rewards)["skipped"] == 1
    assert _same_weights(learner.state_dict(), before)
    mixed = [TrainSample((1, 5), (6, 2), group=0, reward=1.0), TrainSample((1, 5), (7, 2), group=0, reward=0.0)]
    assert learner.step(mixed)["skipped"] == 0
    assert not _same_weights(learner.state_dict(), before)


def test_a_full_draft_store_evicts_reports_it_and_changes_no_rollout(tmp_path, baseline):
    speculation = {"enabled": True, "draft_store_max_tokens": 100, "draft_during_training": True, "lookahead_steps": 2}
    steps, weights = _run(tmp_path, "capped", speculation=speculation)
    assert _rollouts(steps) == _rollouts(baseline[0]) and _same_weights(weights, baseline[1])
    assert all(s.draft_store["tokens"] <= 100 for s in steps)
    evicted = [s.drafts_evicted for s in steps]
    assert sum(evicted) > 0, "the cap never bit: lower it"
    assert steps[-1].draft_store["evicted"] == sum(evicted)  # per step: the store's count since the last step


def test_losing_the_draft_store_only_costs_speed(tmp_path, baseline, monkeypatch, caplog):
    """The store dies after step 0 (a lost actor or node): the run goes on without drafts, results unchanged."""
    from bubblespec.rollout.draft_store import InMemoryDraftStore

    calls = {"get": 0}
    real_get = InMemoryDraftStore.get

    def dying_get(self, keys):
        calls["get"] += 1
        if calls["get"] > 2:
            raise ConnectionError("the actor died")
        return real_get(self, keys)

    monkeypatch.setattr(InMemoryDraftStore, "get", dying_get)
    steps, weights = _run(tmp_path, "store-lost", speculation={"enabled": True})
    assert "the draft store (InMemoryDraftStore) failed and is given up" in caplog.text
    assert _rollouts(steps) == _rollouts(baseline[0])
    assert _same_weights(weights, baseline[1])
    assert steps[-1].draft_coverage == 0


def test_longest_first_drafts_the_longest_predicted_responses_first(tmp_path):
    """Predictions come from drafts (an unfinished one is a lower bound) and from the responses to the same
    prompt the last time it was sampled, never from prompt lengths; keys with neither come last."""
    from bubblespec.core.interfaces import Draft, GenerationResult, Prompt, RequestStats, RolloutKey, SamplingParams
    from bubblespec.policies.bubble import LongestFirst
    from bubblespec.rollout.draft_store import InMemoryDraftStore
    from bubblespec.rollout.service import RolloutService

    prompt_lengths = {"long-answer": 2, "long-prompt": 30, "unknown": 20, "cut": 3, "short": 4}

    class FixedPrompts:
        def peek(self, step):
            return [Prompt(uid, (1,) * length, "", "") for uid, length in prompt_lengths.items()]

    class TwoRanks:
        num_ranks = 2

    config = _config(tmp_path, "plan", num_steps=4, task={"samples_per_prompt": 1}, speculation={"enabled": True})
    store = InMemoryDraftStore(vocab_size=40)
    sampling = SamplingParams(max_new_tokens=48)
    service = RolloutService(
        TwoRanks(), store, LongestFirst(), None, sampling, config.speculation, config.seed, 64, FixedPrompts().peek
    )

    def key(uid):
        return RolloutKey(config.seed, 1, uid, 0)

    def plan_order():
        plan = service._next_plan(0)
        order = []
        while plan:
            order += [r.key.prompt_uid for r in plan.take()]
        return order

    store.put([Draft(key("long-answer"), (5,) * 30, 0, finished=True), Draft(key("cut"), (5,) * 10, 0)])
    store.put([Draft(key("short"), (5,) * 4, 0, finished=True)])
    # keys without a finished draft first (the unfinished one, then those without a prediction, coverage order),
    # then finished drafts, the longest first
    assert plan_order() == ["cut", "long-prompt", "unknown", "long-answer", "short"]

    def result(uid, length):
        return GenerationResult(
            RolloutKey(config.seed, 0, uid, 0), [5] * length, [0.0] * length, "stop", RequestStats()
        )

    service.response_lengths.observe([result("unknown", 25), result("long-prompt", 6), result("cut", 40)])
    # the cut draft (10 tokens) is a lower bound: its prompt's last responses (40) predict longer
    assert plan_order() == ["cut", "unknown", "long-prompt", "long-answer", "short"]


def test_response_lengths_are_bounded_and_restore_in_the_order_they_forget():
    """The least recently sampled prompts are forgotten first, and a restored snapshot forgets in the same
    order as the original (resumed runs must draft the same keys)."""
    from bubblespec.core.interfaces import GenerationResult, RequestStats, RolloutKey
    from bubblespec.rollout.predictions import ResponseLengths

    def results(step, lengths_by_uid):
        return [
            GenerationResult(RolloutKey(0, step, uid, i), [5] * length, [0.0] * length, "stop", RequestStats())
            for uid, lengths in lengths_by_uid.items()
            for i, length in enumerate(lengths)
        ]

    lengths = ResponseLengths(max_prompts=2)
    lengths.observe(results(0, {"a": [3, 4], "b": [10, 11]}))
    assert (lengths.get("a"), lengths.get("b")) == (4, 10)  # rounded means (half to even)
    lengths.observe(results(1, {"a": [7]}))  # a is now the most recent
    restored = ResponseLengths(max_prompts=2)
    restored.restore(lengths.snapshot())
    for table in (lengths, restored):
        table.observe(results(2, {"c": [1]}))
        assert (table.get("a"), table.get("b"), table.get("c")) == (7, None, 1)
    with pytest.raises(ValueError, match="max_prompts must be at least 1, got 0"):
        ResponseLengths(max_prompts=0)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rollout": {"sampling": {"suppressed_token_ids": [1, 2]}}},
         r"rollout.sampling.suppressed_token_ids \[2\] are the model's end-of-sequence tokens: a response could never"),
        ({"rollout": {"sampling": {"suppressed_token_ids": [40000]}}},
         r"rollout.sampling.suppressed_token_ids \[40000\] are outside the model's vocabulary of \d+ tokens"),
        ({"rollout": {"backend": "sglang"}},  # the shipped task suppresses <pad>, <bos> and <unk>
         r"rollout.backend 'sglang' cannot sample with suppressed_token_ids=\(0, 1, 3\); use a backend that can .*"
         r"suppressed_token_ids: \[\] suppresses none"),
    ],
    ids=["eos", "outside", "sglang"],
)  # fmt: skip
def test_suppressed_tokens_a_run_cannot_use_are_refused_before_anything_starts(tmp_path, changes, message):
    config = _config(tmp_path, "suppressed", **changes)
    with pytest.raises(ConfigError, match=message):
        run(config)
    assert not config.run_dir.exists()
