"""The dataset task: the user's files, the model folder's tokenizer and chat template, stop tokens, epochs, held-out
splits and the errors bad input gets; and whole runs on it (speculation changes no rollout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bubblespec.core.config import load_config, validate
from bubblespec.core.errors import ConfigError
from bubblespec.observe.run_dir import RunDirectory
from bubblespec.run.assembly import make_task, make_tasks
from bubblespec.run.launch import run
from bubblespec.tasks.arithmetic import ArithmeticTask
from bubblespec.tasks.dataset import DatasetTask
from bubblespec.testing.random_checkpoints import write_chat_tokenizer, write_random_checkpoint

VOCAB = 32_000
PROBLEMS = [
    {"problem": f"What is {a} + {b}?", "solution": str(a + b), "level": a % 3} for a in range(12) for b in range(4)
]
"""48 rows; the prompts of a >= 10 (the last 8 rows) are one character longer."""


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A random Qwen2-shaped checkpoint with a 32,000-token vocabulary and a ChatML tokenizer."""
    folder = tmp_path_factory.mktemp("qwen2-chat")
    write_random_checkpoint(folder, "qwen2", vocab_size=VOCAB, hidden_size=64, num_heads=2, num_kv_heads=1,
                            head_dim=32, intermediate_size=128, max_position_embeddings=512, bos_token_id=None,
                            eos_token_id=0)  # fmt: skip
    write_chat_tokenizer(folder, VOCAB)
    return str(folder)


@pytest.fixture(scope="module")
def problems(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    path = folder / "problems.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROBLEMS))
    return path


def _task(model_path, data, prompts_per_step=8, split="train", seed=0, **options):
    options = {
        "path": data if isinstance(data, list) else str(data),
        "prompt_column": "problem",
        "answer_column": "solution",
        "reward_workers": 0,
    } | options
    return DatasetTask(seed=seed, prompts_per_step=prompts_per_step, model_path=model_path, split=split, **options)


def test_every_file_format_reads_the_same_rows(chat_model, problems, tmp_path):
    import datasets

    table = datasets.Dataset.from_list(PROBLEMS)
    table.to_parquet(str(tmp_path / "a.parquet"))
    table.to_csv(str(tmp_path / "a.csv"), index=False)
    table.save_to_disk(str(tmp_path / "saved"))
    first, second = tmp_path / "part-0.jsonl", tmp_path / "part-1.jsonl"
    lines = problems.read_text().splitlines(keepends=True)
    first.write_text("".join(lines[:15]))
    second.write_text("".join(lines[15:]))
    expected = _task(chat_model, problems).prompts
    for path in (tmp_path / "a.parquet", tmp_path / "saved", str(tmp_path / "part-*.jsonl"), [str(first), str(second)]):
        prompts = _task(chat_model, path).prompts
        assert [p.token_ids for p in prompts] == [p.token_ids for p in expected], path
        assert [p.answer for p in prompts] == [row["solution"] for row in PROBLEMS]
    csv = _task(chat_model, tmp_path / "a.csv").prompts  # CSV has no types: answers read back as numbers
    assert [p.token_ids for p in csv] == [p.token_ids for p in expected]


def test_the_chat_template_system_prompt_and_message_prompts(chat_model, problems, tmp_path):
    task = _task(chat_model, problems, system_prompt="Answer with a number.")
    assert task.prompts[0].text == (
        "<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nWhat is 0 + 0?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert task.prompts[0].token_ids[0] == task.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert task.tokenizer.decode(task.prompts[0].token_ids) == task.prompts[0].text
    messages = tmp_path / "messages.jsonl"
    messages.write_text(json.dumps({"chat": [{"role": "user", "content": "What is 0 + 0?"}], "solution": "0"}) + "\n")
    chat = _task(chat_model, messages, prompts_per_step=1, prompt_column="chat", system_prompt="Answer with a number.")
    assert chat.prompts[0].token_ids == task.prompts[0].token_ids
    plain = _task(chat_model, problems, chat_template=False)
    assert plain.prompts[0].text == "What is 0 + 0?"


def test_stop_tokens_are_the_tokenizer_s_the_generation_config_s_and_the_options(chat_model, problems):
    task = _task(chat_model, problems, stop_tokens=["?"])
    vocab = task.tokenizer.get_vocab()
    assert set(task.stop_token_ids) == {vocab["<|endoftext|>"], vocab["<|im_end|>"], vocab["?"]}
    with pytest.raises(ConfigError, match="'<|eot_id|>' is not a token"):
        _task(chat_model, problems, stop_tokens=["<|eot_id|>"])


def test_epochs_are_seeded_permutations_and_a_prompt_appears_once_per_step(chat_model, problems):
    task = _task(chat_model, problems, prompts_per_step=8)  # 48 rows: 6 steps an epoch
    epoch = [p.uid for step in range(6) for p in task.batch(step)]
    assert sorted(epoch) == sorted(f"train-{i}" for i in range(48))
    assert epoch != [f"train-{i}" for i in range(48)]  # shuffled
    again = _task(chat_model, problems, prompts_per_step=8)
    assert [p.uid for p in again.batch(7)] == [p.uid for p in task.peek(7)]  # deterministic and peekable
    assert [p.uid for p in task.batch(6)] != [p.uid for p in task.batch(0)]  # the next epoch is another order
    other_seed = _task(chat_model, problems, prompts_per_step=8, seed=1)
    assert [p.uid for p in other_seed.batch(0)] != [p.uid for p in task.batch(0)]
    uneven = _task(chat_model, problems, prompts_per_step=20)  # 2 steps an epoch, 8 rows wait for a later one
    for step in range(6):
        uids = [p.uid for p in uneven.batch(step)]
        assert len(set(uids)) == 20


def test_held_out_rows_come_from_eval_path_or_a_seeded_fraction(chat_model, problems, tmp_path):
    train = _task(chat_model, problems, eval_fraction=0.25)
    held_out = _task(chat_model, problems, split="eval", prompts_per_step=100, eval_fraction=0.25)
    assert len(train.prompts) == 36 and len(held_out.prompts) == 12 and held_out.prompts_per_step == 12
    train_texts = {p.text for p in train.prompts}
    assert not train_texts & {p.text for p in held_out.prompts}
    assert held_out.batch(0) == held_out.batch(0) and [p.uid for p in held_out.batch(0)] == [
        p.uid for p in held_out.prompts
    ]  # file order
    separate = tmp_path / "eval.jsonl"
    separate.write_text(json.dumps({"problem": "What is 9 + 9?", "solution": "18"}) + "\n")
    assert [p.answer for p in _task(chat_model, problems, split="eval", eval_path=str(separate)).batch(0)] == ["18"]


def test_long_prompts_are_dropped_and_counted_or_an_error(chat_model, problems, caplog):
    task = _task(chat_model, problems, chat_template=False, max_prompt_tokens=15)  # "What is 10 + 3?" is 15
    assert len(task.prompts) == 48 and task.num_dropped_prompts == 0
    shorter = _task(chat_model, problems, chat_template=False, max_prompt_tokens=14)
    assert len(shorter.prompts) == 40 and shorter.num_dropped_prompts == 8
    assert "dropped 8 of 48 train prompts longer than 14 tokens" in caplog.text
    with pytest.raises(ConfigError, match="row train-40 .* 15 tokens, longer than 14"):
        _task(chat_model, problems, chat_template=False, max_prompt_tokens=14, long_prompts="error")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"prompt_column": "question"},
            "'question' is not a column of .*problems.jsonl; its columns: problem, solution",
        ),
        ({"answer_column": "answer"}, "'answer' is not a column"),
        ({"path": "nowhere/*.jsonl"}, "no file matches 'nowhere/\\*.jsonl'"),
        ({"reward": "no-such-reward"}, "reward 'no-such-reward' is not known"),
        ({"reward": "not_a_module_at_all:f"}, "module 'not_a_module_at_all' does not import"),
        ({"eval_path": "x", "eval_fraction": 0.1}, "eval_path or eval_fraction, not both"),
        ({"prompt_column": "level"}, "row train-0's 'level' is neither text nor a list of"),
        ({"max_prompt_tokens": 1}, "has 0 usable rows"),
    ],
)
def test_bad_options_are_clear_errors(chat_model, problems, options, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        _task(chat_model, problems, **options)


def test_bad_inputs_of_the_files_and_the_model_folder(chat_model, problems, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="empty.jsonl"):
        _task(chat_model, empty)
    mixed = [str(problems), str(tmp_path / "x.csv")]
    (tmp_path / "x.csv").write_text("problem,solution\na,b\n")
    with pytest.raises(ConfigError, match="one format"):
        _task(chat_model, mixed)
    no_template = tmp_path / "no-template"
    write_random_checkpoint(no_template, "llama", vocab_size=512, hidden_size=64, num_heads=2, num_kv_heads=1,
                            head_dim=32, intermediate_size=128)  # fmt: skip
    write_chat_tokenizer(no_template, 512, chat_template=None)
    with pytest.raises(ConfigError, match="chat_template is true, but the model folder's tokenizer has no chat"):
        _task(str(no_template), problems, chat_template=True)
    messages = tmp_path / "messages.jsonl"
    messages.write_text(json.dumps({"chat": [{"role": "user", "content": "hi"}], "solution": "0"}) + "\n")
    with pytest.raises(ConfigError, match="list of chat messages, which needs a chat template"):
        _task(str(no_template), messages, prompts_per_step=1, prompt_column="chat")
    with pytest.raises(ConfigError, match="system_prompt needs a chat template"):
        _task(str(no_template), problems, system_prompt="Be brief.")
    bare = tmp_path / "bare"
    write_random_checkpoint(bare, "llama", vocab_size=512, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                            intermediate_size=128)  # fmt: skip
    with pytest.raises(ConfigError, match="needs the model folder's tokenizer"):
        _task(str(bare), problems)


def test_rewards_see_the_prompt_the_decoded_response_and_every_column(chat_model, problems):
    task = _task(chat_model, problems, reward=[{"name": "exact"}, {"name": "tests.reward_functions:uses_columns"}])
    prompt = next(p for p in task.prompts if p.answer == "7" and p.columns["level"] == 2)
    right = task.tokenizer("7")["input_ids"] + [task.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert task.score([prompt, prompt], [right, task.tokenizer("8")["input_ids"]]) == [1.0 + 2.0, 0.0]
    assert task(prompt, right) == 3.0


def test_the_answer_column_is_the_answer_even_beside_a_column_named_answer(chat_model, tmp_path):
    """GSM8K rows keep their worked solution in ``answer``; with ``answer_column: final`` rewards must get the final
    answer as ``answer`` (before, the row's own ``answer`` column won and "42" scored 0 with ``exact``)."""
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"question": "6 * 7?", "answer": "6 * 7 = 42\n#### 42", "final": "42"}) + "\n")
    task = _task(chat_model, data, prompts_per_step=1, prompt_column="question", answer_column="final", reward="exact")
    (prompt,) = task.prompts
    assert task.score([prompt], [task.tokenizer("42")["input_ids"]]) == [1.0]


def test_the_arithmetic_dataset_prompts_equal_the_shipped_task_s(tmp_path):
    rows = [{"prompt": p.text, "answer": p.answer} for p in ArithmeticTask(seed=3, prompts_per_step=32).batch(0)]
    path = tmp_path / "arithmetic.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    model = str(ArithmeticTask.model_path())
    task = DatasetTask(prompts_per_step=32, model_path=model, path=str(path), reward_workers=0)
    assert [p.token_ids for p in task.prompts] == [
        p.token_ids for p in ArithmeticTask(seed=3, prompts_per_step=32).batch(0)
    ]
    assert task.stop_token_ids == (2,)  # <eos>


SMALL = {
    "num_steps": 3,
    "checkpoint_every": 10,
    "eval_every": 2,
    "eval_prompts": 8,
    "model": {"dtype": "float64"},
    "task": {"name": "dataset", "prompts_per_step": 4, "samples_per_prompt": 2},
    "rollout": {"num_ranks": 2, "sampling": {"max_new_tokens": 24}},
    "clock": {"kind": "virtual", "profile": "h100-7b"},
    "trainer": {"optimizer": {"learning_rate": 1e-3}},
    "metrics": {"port": 0},
}


EXAMPLES = Path(__file__).parent.parent / "examples"


def _math_example(tmp_path, name: str, model_path: str, speculation: bool, extra=()) -> list[dict]:
    """examples/math.yaml, small, on the virtual clock, with the random chat model."""
    overrides = [
        f"name={name}", f"output_dir={tmp_path}", f"model.path={model_path}", "model.dtype=float64",
        f"task.options.path={EXAMPLES / 'data' / 'math-sample.jsonl'}", "task.options.max_new_tokens=24",
        "task.options.reward_workers=1", "task.prompts_per_step=4", "task.samples_per_prompt=2", "num_steps=3",
        "eval_every=2", "eval_prompts=4", "checkpoint_every=10", "clock.kind=virtual", "clock.profile=h100-7b",
        "trainer.optimizer.learning_rate=1e-5", "metrics.port=0", f"speculation.enabled={str(speculation).lower()}",
        "speculation.draft_during_training=true",  # equal-length responses leave no bubble to draft in
        # a random model never earns the math reward: digit_share gives the trainer a signal to train on
        'task.options.reward=[math, {name: format, weight: 0.1, pattern: ".*boxed.*"}, '
        '"tests.reward_functions:digit_share"]',
        *extra,
    ]  # fmt: skip
    config = load_config(EXAMPLES / "math.yaml", overrides)
    run(config)
    return RunDirectory(config.run_dir).read_steps()


LORA = ("trainer.model.kind=transformers", "trainer.model.lora.rank=4", "trainer.optimizer.learning_rate=1e-3")


@pytest.mark.slow
@pytest.mark.parametrize("trainer", [(), LORA], ids=["built-in", "transformers-lora"])
def test_the_math_example_runs_a_chat_model_and_speculation_changes_no_rollout(chat_model, tmp_path, trainer):
    plain = _math_example(tmp_path, "plain", chat_model, speculation=False, extra=trainer)
    drafted = _math_example(tmp_path, "drafted", chat_model, speculation=True, extra=trainer)
    assert [(s.rollout_digest, s.reward_mean) for s in drafted] == [(s.rollout_digest, s.reward_mean) for s in plain]
    assert sum(s.draft_tokens_accepted for s in drafted) > 0
    assert all(s.reward_timeouts == 0 and s.reward_errors == 0 for s in drafted)
    # the held-out eval keeps each reward's own mean (the answer accuracy apart from the format), before and after
    for evaluated, means in [(plain[0].eval_reward_before_training, plain[0].eval_reward_means_before_training),
                             (plain[0].eval_reward, plain[0].eval_reward_means)]:  # fmt: skip
        assert list(means)[:2] == ["math", "format"] and len(means) == 3
        assert evaluated == pytest.approx(sum(w * m for w, m in zip((1.0, 0.1, 1.0), means.values(), strict=True)))
    assert drafted[-1].eval_reward is not None
    assert all(s.train["skipped"] == 0 for s in drafted)  # every step trained


@pytest.mark.slow
def test_exact_partial_rollouts_at_a_32k_vocabulary_in_bfloat16_with_top_k_and_top_p(chat_model, tmp_path):
    """The exact partial schedule (docs/design.md §12) where users run it: a 32,000-token vocabulary, bfloat16
    ranks, top-k and top-p. A group with a response over 16 tokens is cut and generated again next step with its
    cut responses as drafts. No trained token comes from an older policy, and drafts change no response: the torch
    engine's bfloat16 verify and decode passes give bit-identical logits (§3.2; before they did not, and one response
    of 24 differed here, in the last step)."""
    extra = ("model.dtype=bfloat16", "trainer.optimizer.learning_rate=1e-3", "rollout.sampling.temperature=0.8",
             "rollout.sampling.top_k=50", "rollout.sampling.top_p=0.9", "schedule.kind=exact-partial",
             "schedule.cut_tokens=16", "logged_prompts=8")  # fmt: skip
    plain = _math_example(tmp_path, "exact-plain", chat_model, speculation=False, extra=extra)
    drafted = _math_example(tmp_path, "exact-drafted", chat_model, speculation=True, extra=extra)
    assert plain[0].carried_groups > 0  # the budget cut a group, and it came back a step later
    assert all(s.stale_tokens == 0 and s.policy_lag == 0 for s in plain + drafted)
    assert drafted[1].draft_tokens_accepted > 0 and drafted[1].decode_steps < plain[1].decode_steps
    assert [s.num_samples for s in drafted] == [s.num_samples for s in plain]
    responses = [
        [(group.step, group.prompt_uid, r.text) for group in RunDirectory(tmp_path / name).read_samples()
         for r in group.responses]
        for name in ("exact-plain", "exact-drafted")
    ]  # fmt: skip
    assert len(responses[0]) == len(responses[1]) == sum(s.num_samples for s in plain)  # every group logged
    differing = sum(a != b for a, b in zip(*responses, strict=True))
    assert differing == 0, f"{differing} of {len(responses[0])} responses differ"


def test_make_tasks_gives_the_held_out_split_the_same_seed_and_the_model_folder(chat_model, problems):
    config = validate(
        SMALL
        | {"model": {"path": chat_model}}
        | {"task": SMALL["task"] | {"seed": 5, "options": {"path": str(problems), "prompt_column": "problem",
                                                           "answer_column": "solution", "eval_fraction": 0.25}}}
    )  # fmt: skip
    task, held_out = make_tasks(config)
    assert (task.split, held_out.split, task.seed, held_out.seed) == ("train", "eval", 5, 5)
    assert held_out.prompts_per_step == 8 and len(held_out.prompts) == 12
    without_eval = validate(config.model_dump() | {"eval_every": 0})
    assert make_tasks(without_eval)[1] is None
    no_source = validate(config.model_dump() | {"task": config.task.model_dump() | {"options": {"path": str(problems),
                         "prompt_column": "problem", "answer_column": "solution"}}})  # fmt: skip
    with pytest.raises(ConfigError, match="eval_every needs held-out prompts"):
        make_task(no_source, held_out=True)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"prompt_column": "question"}, "'question' is not a column"),
        ({"path": "{empty}"}, "has no rows"),
        ({"max_prompt_tokens": 3, "long_prompts": "error"}, "longer than 3"),
        ({"reward": "nope"}, "reward 'nope' is not known"),
        ({"reward": "no_such_module_anywhere:score"}, "does not import"),
        ({"prompt_column": "chat", "path": "{messages}", "chat_template": False}, "needs a chat template"),
        ({"stop_tokens": ["<|eot_id|>"]}, "is not a token"),
        ({"eval_fraction": 2}, "eval_fraction"),
        ({"reward_workers": -1}, "reward_workers"),
    ],
)
def test_validate_reports_bad_task_input_without_a_traceback(chat_model, problems, tmp_path, options, message):
    from typer.testing import CliRunner

    from bubblespec.cli.main import app

    empty, messages = tmp_path / "empty.jsonl", tmp_path / "messages.jsonl"
    empty.write_text("")
    messages.write_text(json.dumps({"chat": [{"role": "user", "content": "hi"}], "solution": "0"}) + "\n")
    options = {k: v.format(empty=empty, messages=messages) if isinstance(v, str) else v for k, v in options.items()}
    task = {"path": str(problems), "prompt_column": "problem", "answer_column": "solution"} | options
    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps(
            {"model": {"path": chat_model}, "eval_every": 0, "clock": {"kind": "virtual"},
             "task": {"name": "dataset", "prompts_per_step": 1, "options": task}}
        )
    )  # fmt: skip
    result = CliRunner().invoke(app, ["validate", str(config)])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_validate_reports_a_model_folder_without_a_tokenizer(problems, tmp_path):
    from typer.testing import CliRunner

    from bubblespec.cli.main import app

    bare = write_random_checkpoint(tmp_path / "bare", "llama", vocab_size=512, hidden_size=64, num_heads=2,
                                   num_kv_heads=1, head_dim=32, intermediate_size=128)  # fmt: skip
    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "model": {"path": str(bare)},
                "eval_every": 0,
                "task": {"name": "dataset", "options": {"path": str(problems)}},
            }
        )
    )
    result = CliRunner().invoke(app, ["validate", str(config)])
    assert result.exit_code == 2 and "needs the model folder's tokenizer" in result.output, result.output


def _gym(model_path, split="train", seed=0, prompts_per_step=4, **options):
    from bubblespec.tasks.reasoning_gym_task import ReasoningGymTask

    options = {"datasets": "basic_arithmetic", "size": 12, "eval_size": 6, "reward_workers": 0} | options
    return ReasoningGymTask(seed=seed, prompts_per_step=prompts_per_step, model_path=model_path, split=split, **options)


def test_reasoning_gym_problems_are_seeded_and_scored_by_their_own_dataset(chat_model):
    task = _gym(chat_model)
    assert [p.text for p in _gym(chat_model).prompts] == [p.text for p in task.prompts]  # deterministic per seed
    assert [p.answer for p in _gym(chat_model, seed=1).prompts] != [p.answer for p in task.prompts]
    held_out = _gym(chat_model, split="eval", prompts_per_step=100)
    assert len(held_out.prompts) == 6 and not {p.text for p in held_out.prompts} & {p.text for p in task.prompts}
    prompt = task.prompts[0]
    assert "<|im_start|>system\nThink about the problem" in prompt.text and prompt.columns["question"] in prompt.text
    encode = task.tokenizer.encode
    right, wrong = f"Adding up: <answer>{prompt.answer}</answer>", "<answer>no idea</answer>"
    assert task.score([prompt, prompt, prompt], [encode(right), encode(wrong), encode(prompt.answer)]) == [
        1.0,
        0.0,
        1.0,
    ]


def test_reasoning_gym_shares_problems_among_datasets_and_names_bad_ones(chat_model):
    mixed = _gym(chat_model, datasets={"basic_arithmetic": {}, "chain_sum": {"min_terms": 2, "max_terms": 3}}, size=7)
    sources = [p.columns["metadata"]["source_dataset"] for p in mixed.prompts]
    assert sources == ["basic_arithmetic"] * 4 + ["chain_sum"] * 3
    with pytest.raises(ConfigError, match="'no_such_puzzle'.*not registered.*basic_arithmetic"):
        _gym(chat_model, datasets="no_such_puzzle")
    with pytest.raises(ConfigError, match="'basic_arithmetic'.*bogus"):
        _gym(chat_model, datasets={"basic_arithmetic": {"bogus": 1}})


@pytest.mark.slow
def test_the_reasoning_gym_example_runs_on_the_virtual_clock(chat_model, tmp_path):
    overrides = [
        f"output_dir={tmp_path}", f"model.path={chat_model}", "model.dtype=float32", "task.options.size=16",
        "task.options.eval_size=4", "task.options.max_new_tokens=16", "task.options.reward_workers=1",
        "task.prompts_per_step=4", "task.samples_per_prompt=2", "num_steps=2", "eval_every=2", "eval_prompts=4",
        "clock.kind=virtual", "clock.profile=h100-7b", "metrics.port=0",
    ]  # fmt: skip
    config = load_config(EXAMPLES / "reasoning-gym.yaml", overrides)
    run(config)
    steps = RunDirectory(config.run_dir).read_steps()
    assert [s.step for s in steps] == [0, 1] and steps[-1].eval_reward is not None
    assert all(s.reward_errors == 0 and s.reward_timeouts == 0 for s in steps)
