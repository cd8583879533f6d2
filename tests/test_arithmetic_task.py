"""Tests of the built-in arithmetic task, its tokenizer and the shipped tiny model (no training here)."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys

import pytest

from bubblespec.core.interfaces import Prompt, PromptSource, RewardFn, SamplingParams
from bubblespec.tasks import ArithmeticTask
from bubblespec.tasks.arithmetic import (
    ALPHABET,
    CONTEXT_LENGTH,
    MAX_DIGITS,
    answer_digits_credit,
    build_tokenizer,
    max_response_tokens,
    parse_prompt,
    sample_operands,
    worked_solution,
)


@pytest.fixture(scope="module")
def task() -> ArithmeticTask:
    return ArithmeticTask(seed=7, prompts_per_step=16)


def test_implements_the_protocols(task):
    assert isinstance(task, PromptSource)
    assert isinstance(task, RewardFn)


def test_batch_is_a_pure_function_of_seed_and_step():
    first, second = ArithmeticTask(seed=3), ArithmeticTask(seed=3)
    assert first.batch(5) == second.batch(5)
    assert first.peek(5) == first.batch(5)
    assert first.batch(5) != first.batch(6)
    assert first.batch(5) != ArithmeticTask(seed=4).batch(5)
    assert len(first.batch(0)) == 16


def test_uids_are_unique_within_and_across_steps(task):
    uids = [p.uid for step in range(4) for p in task.batch(step)]
    assert len(uids) == len(set(uids)) == 64


def test_prompt_fields_agree(task):
    for prompt in task.batch(0):
        a, b = parse_prompt(prompt.text)
        assert prompt.answer == str(a + b)
        assert prompt.token_ids == (task.bos_token_id, *task.encode(prompt.text))
        assert task.decode(prompt.token_ids[1:]) == prompt.text


def test_worked_solution_columns():
    assert worked_solution(4821, 93) == "1+3=4,2+9=1c,8+0+1=9,4+0=4;4914"
    assert worked_solution(0, 0) == "0+0=0;0"
    assert worked_solution(95, 7) == "5+7=2c,9+0+1=0c;102"


def test_worked_solution_digits_reproduce_the_sum():
    rng = random.Random(0)
    for _ in range(500):
        a, b = sample_operands(rng)
        columns, answer = worked_solution(a, b).split(";")
        digits = "".join(column.split("=")[1][0] for column in columns.split(","))[::-1]
        carry = "1" if columns.endswith("c") else ""
        assert answer == str(a + b) == (carry + digits).lstrip("0").rjust(1, "0")


def test_reward_is_one_for_the_reference_response(task):
    for prompt in task.batch(0):
        response = task.reference_response_ids(prompt)
        assert response[-1] == task.eos_token_id
        assert task(prompt, response) == 1.0
        assert task(prompt, response[:-1]) == 1.0  # an engine may strip the stop token
        assert task(prompt, [*response, *task.encode("9;1"), task.eos_token_id]) == 1.0  # after <eos>: ignored


def test_reward_is_zero_for_wrong_or_malformed_responses(task):
    prompt = task.make_prompt(4821, 93, uid="x")
    eos = task.eos_token_id
    reference = task.reference_response_ids(prompt)
    wrong = [*task.encode("1+3=4,2+9=1c,8+0+1=9,4+0=4;4915"), eos]
    assert task(prompt, wrong) == 0.0
    assert task(prompt, reference[: len(reference) // 2]) == 0.0  # truncated in the scratchpad
    assert task(prompt, reference[:-2]) == 0.0  # truncated inside the answer
    assert task(prompt, []) == 0.0
    assert task(prompt, [eos]) == 0.0
    assert task(prompt, [task.pad_token_id] * 5) == 0.0
    assert task(prompt, [*reference[:-1], *task.encode(";4914"), eos]) == 0.0  # two answers
    assert task(prompt, [10_000, -1, 3]) == 0.0  # ids outside the vocabulary
    assert task(prompt, ["a", None]) == 0.0  # not ids at all
    assert task(prompt, [task.bos_token_id, *reference]) == 0.0  # a special token inside the response


def test_reward_never_raises_on_random_ids(task):
    rng = random.Random(1)
    prompt = task.batch(0)[0]
    for _ in range(300):
        response = [rng.randrange(-3, task.vocab_size + 3) for _ in range(rng.randrange(0, 40))]
        assert task(prompt, response) in (0.0, 1.0)


def test_response_lengths_are_long_tailed_and_fit_the_context():
    task = ArithmeticTask(seed=0, prompts_per_step=2000)
    prompts = task.batch(0)
    lengths = sorted(len(task.reference_response_ids(p)) for p in prompts)
    median, p95 = statistics.median(lengths), lengths[int(0.95 * len(lengths)) - 1]
    assert 20 <= median <= 40
    assert p95 / median >= 2.5
    assert lengths[-1] <= task.max_new_tokens <= 250
    longest_prompt = len(task.make_prompt(10**MAX_DIGITS - 1, 10**MAX_DIGITS - 1, uid="x").token_ids)
    assert longest_prompt + task.max_new_tokens <= CONTEXT_LENGTH
    worst = task.make_prompt(10**MAX_DIGITS - 1, 10**MAX_DIGITS - 1, uid="x")
    assert len(task.reference_response_ids(worst)) == task.max_new_tokens  # the bound is tight


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seed": "0"}, "seed must be an integer"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"prompts_per_step": 0}, "prompts_per_step must be an integer >= 1, got 0"),
        ({"prompts_per_step": 2.0}, "prompts_per_step must be an integer >= 1"),
        ({"prompts_per_step": True}, "prompts_per_step must be an integer >= 1"),
    ],
)
def test_bad_constructor_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reward": "partial"}, "reward must be one of 'answer', 'digits', got 'partial'"),
        ({"max_digits": 0}, r"max_digits must be an integer in \[1, 20\], got 0"),
        ({"max_digits": 21}, "max_digits must be an integer in"),
        ({"digits_continue_probability": 1.0}, r"digits_continue_probability must be in \[0, 1\)"),
        ({"digits_continue_probability": "0.5"}, "digits_continue_probability must be a number"),
    ],
)
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(**kwargs)


def test_default_options_keep_the_original_prompt_stream():
    default = ArithmeticTask(seed=3, prompts_per_step=64)
    explicit = ArithmeticTask(seed=3, prompts_per_step=64, reward="answer", max_digits=MAX_DIGITS)
    assert default.batch(4) == explicit.batch(4)
    assert default.max_new_tokens == max_response_tokens()


def test_max_digits_caps_problem_sizes_and_the_response_bound():
    task = ArithmeticTask(seed=0, prompts_per_step=500, max_digits=5)
    prompts = task.batch(0)
    assert max(max(map(len, p.text.rstrip("=").split("+"))) for p in prompts) == 5
    assert task.max_new_tokens == max_response_tokens(5)
    assert all(len(task.reference_response_ids(p)) <= task.max_new_tokens for p in prompts)


def test_digit_credit_is_partial_and_full_only_for_the_right_answer():
    assert answer_digits_credit("4914", "4914") == 1.0
    assert answer_digits_credit("4924", "4914") == 0.75
    assert answer_digits_credit("14914", "4914") == 0.8  # an extra digit costs one position
    assert answer_digits_credit("914", "4914") == 0.75  # so does a missing one
    task = ArithmeticTask(seed=0, reward="digits")
    prompt = task.make_prompt(4821, 93, uid="x")
    assert task(prompt, task.reference_response_ids(prompt)) == 1.0
    assert task(prompt, task.encode("1+3=4;4924") + [task.eos_token_id]) == 0.75
    assert task(prompt, task.encode(";;12") + [task.eos_token_id]) == 0.0
    rng = random.Random(2)
    for _ in range(300):
        response = [rng.randrange(-3, task.vocab_size + 3) for _ in range(rng.randrange(0, 40))]
        assert 0.0 <= task(prompt, response) <= 1.0


def test_bad_steps_and_text_are_refused(task):
    with pytest.raises(ValueError, match="step must be an integer >= 0, got -1"):
        task.batch(-1)
    with pytest.raises(ValueError, match="not in the task's alphabet"):
        task.encode("12 + 3")
    with pytest.raises(ValueError, match="not an arithmetic prompt"):
        task.reference_response("12-3=")


def test_tokenizer_special_ids_and_size(task):
    assert (task.pad_token_id, task.bos_token_id, task.eos_token_id) == (0, 1, 2)
    assert task.vocab_size <= 64
    assert task.decode(task.encode(ALPHABET)) == ALPHABET


def test_shipped_tokenizer_matches_the_task(task):
    from tokenizers import Tokenizer

    shipped = Tokenizer.from_file(str(ArithmeticTask.model_path() / "tokenizer.json"))
    assert shipped.get_vocab() == build_tokenizer().get_vocab()
    text = "4821+93=1+3=4,2+9=1c;4914"
    assert shipped.encode(text).ids == [task.bos_token_id, *task.encode(text)]
    assert shipped.decode(task.encode(text)) == text


_LOAD_OFFLINE = """
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, prompt_text = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(folder)
tokenizer = AutoTokenizer.from_pretrained(folder)
config = model.config
print(json.dumps({
    "class": type(model).__name__,
    "vocab_size": config.vocab_size,
    "heads": [config.num_attention_heads, config.num_key_value_heads],
    "special_ids": [config.pad_token_id, config.bos_token_id, config.eos_token_id],
    "max_position_embeddings": config.max_position_embeddings,
    "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    "tokenizer_special_ids": [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id],
    "prompt_ids": tokenizer(prompt_text).input_ids,
    "decoded": tokenizer.decode(tokenizer(prompt_text).input_ids, skip_special_tokens=True),
}))
"""


def test_shipped_model_loads_offline_with_transformers(task):
    pytest.importorskip("transformers")
    folder = ArithmeticTask.model_path()
    assert sum(f.stat().st_size for f in folder.iterdir()) < 8 * 2**20
    prompt = task.batch(0)[0]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    completed = subprocess.run(
        [sys.executable, "-c", _LOAD_OFFLINE, str(folder), prompt.text],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    loaded = json.loads(completed.stdout.strip().splitlines()[-1])
    assert loaded["class"] == "LlamaForCausalLM"
    assert loaded["vocab_size"] == task.vocab_size
    assert loaded["heads"] == [4, 2]  # grouped-query attention
    assert loaded["special_ids"] == loaded["tokenizer_special_ids"] == [0, 1, 2]
    assert loaded["max_position_embeddings"] == CONTEXT_LENGTH
    assert loaded["dtypes"] == ["torch.float32"]
    assert loaded["prompt_ids"] == list(prompt.token_ids)
    assert loaded["decoded"] == prompt.text


def test_model_path_is_inside_the_package():
    import bubblespec.tasks

    path = ArithmeticTask.model_path()
    assert path.is_dir()
    assert path.resolve().is_relative_to(next(iter(bubblespec.tasks.__path__)))


def test_prompt_dataclass_is_the_interface_one(task):
    assert all(type(p) is Prompt for p in task.batch(0))


def test_dataset_size_repeats_the_prompts_every_epoch():
    task = ArithmeticTask(seed=2, prompts_per_step=4, dataset_size=12)  # an epoch of 3 steps
    assert task.batch(4) == task.batch(1) and task.batch(6) == task.batch(0)
    assert task.batch(1) != task.batch(2)
    assert ArithmeticTask(seed=2, prompts_per_step=4).batch(1) == task.batch(1)  # the same first epoch
    with pytest.raises(ValueError, match="multiple of prompts_per_step"):
        ArithmeticTask(prompts_per_step=4, dataset_size=10)


@pytest.mark.parametrize("task_name", ["arithmetic", "collatz"])
def test_the_shipped_models_never_sample_their_special_tokens_with_the_default_config(task_name):
    """Without the task's suppressed tokens the shipped models sample <pad>, <bos> or <unk> in some responses at
    step 0 (about one in five); a run's default sampling never does."""
    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.core.config import validate
    from bubblespec.rollout.step import step_requests
    from bubblespec.run.assembly import make_task, model_path, sampling_params

    config = validate(
        {"task": {"name": task_name, "prompts_per_step": 32}, "rollout": {"sampling": {"max_new_tokens": 40}}}
    )
    task = make_task(config)
    path = model_path(config, task)
    special = set(task.suppressed_token_ids)
    assert special == {task._tokenizer.token_to_id(t) for t in ("<pad>", "<bos>", "<unk>")}
    engine = TorchEngine.from_pretrained(path, dtype="float32", max_batch_size=64)
    sampled = {}
    unsuppressed = SamplingParams(max_new_tokens=40)
    for what, sampling in {"default": sampling_params(config, task, path), "none": unsuppressed}.items():
        results = engine.generate(step_requests(task.batch(0), 0, 0, 2, sampling))
        sampled[what] = sum(bool(set(r.token_ids) & special) for r in results)
    assert sampled["default"] == 0 and sampled["none"] > 0, sampled
