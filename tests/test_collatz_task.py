"""Tests of the built-in long-response task (Collatz trajectories, digits reversed): its prompts, reference
responses and their long-tailed lengths, its reward, its options' errors."""

from __future__ import annotations

import random

import pytest

from bubblespec.core.config import validate
from bubblespec.core.errors import ConfigError
from bubblespec.core.interfaces import PromptSource, RewardFn
from bubblespec.tasks.collatz import (
    MAX_RESPONSE_TOKENS,
    CollatzTask,
    length_quantiles,
    parse_prompt,
    prefix_credit,
    prompt_text,
    sample_number,
    trajectory,
    worked_solution,
)


@pytest.fixture(scope="module")
def task() -> CollatzTask:
    return CollatzTask(seed=7, prompts_per_step=16)


def test_implements_the_protocols(task):
    assert isinstance(task, PromptSource) and isinstance(task, RewardFn)


def test_a_trajectory_is_the_collatz_map_down_to_one_written_digits_reversed():
    assert trajectory(27)[:3] == [82, 41, 124] and len(trajectory(27)) == 111 and trajectory(27)[-1] == 1
    assert worked_solution(6) == "3,01,5,61,8,4,2,1"  # 6 -> 3 -> 10 -> 5 -> 16 -> 8 -> 4 -> 2 -> 1
    assert prompt_text(27) == "72=" and parse_prompt("72=") == 27
    for text in ("27", "1=", "a="):
        with pytest.raises(ValueError, match="not a Collatz prompt"):
            parse_prompt(text)


def test_batch_is_a_pure_function_of_seed_and_step(task):
    again = CollatzTask(seed=7, prompts_per_step=16)
    assert [p.text for p in task.batch(3)] == [p.text for p in again.batch(3)]
    assert [p.text for p in task.batch(3)] != [p.text for p in task.batch(4)]
    assert [p.text for p in task.batch(3)] != [p.text for p in CollatzTask(seed=8, prompts_per_step=16).batch(3)]
    prompts = task.batch(0)
    assert len({p.uid for p in prompts + task.batch(1)}) == 32
    for prompt in prompts:
        n = parse_prompt(prompt.text)
        assert prompt.token_ids == (task.bos_token_id, *task.encode(prompt.text))
        assert prompt.answer == str(len(trajectory(n)))
        assert len(task.reference_response_ids(prompt)) <= task.max_new_tokens == MAX_RESPONSE_TOKENS


def test_response_lengths_are_long_tailed():
    """Several hundred tokens at the median, a tail of thousands (the shape of RL response lengths)."""
    lengths = length_quantiles(CollatzTask(), num_prompts=2000)
    assert 300 <= lengths["median"] <= 600, lengths
    assert lengths["p90"] >= 2.5 * lengths["median"] and lengths["max"] >= 2500, lengths
    assert lengths["max"] <= MAX_RESPONSE_TOKENS


def test_max_response_tokens_and_max_digits_bound_the_prompts():
    short = CollatzTask(max_digits=3, max_response_tokens=64, prompts_per_step=64)
    for prompt in short.batch(0):
        assert parse_prompt(prompt.text) < 1000 and len(short.reference_response_ids(prompt)) <= 64
    assert short.max_new_tokens == 64
    rng = random.Random(0)
    assert all(3 <= sample_number(rng, 1, 100) < 10 for _ in range(50))


def test_the_reward_is_the_share_of_the_trajectory_right_from_the_start(task):
    prompt = task.make_prompt(6, uid="six")  # 3,01,5,61,8,4,2,1: eight values
    eos = task.eos_token_id

    def score(text: str, **options) -> float:
        scorer = CollatzTask(**options) if options else task
        return scorer(prompt, [*task.encode(text), eos])

    assert score("3,01,5,61,8,4,2,1") == 1.0
    assert task(prompt, task.encode("3,01,5,61,8,4,2,1")) == 1.0  # no <eos>: scored as it stands
    assert score("3,01,5,61") == 0.5
    assert score("3,01,5,60,8,4,2,1") == 3 / 8  # right values after a wrong one do not count
    assert score("3,01,5,61,8,4,2,1,4,2,1") == 8 / 11  # going on past 1 costs
    assert score("") == 0.0 and score("4") == 0.0 and score(",,,") == 0.0
    assert task(prompt, [*task.encode("3,01,5"), eos, *task.encode("61")]) == 3 / 8  # nothing after <eos> counts
    assert score("3,01,5,61,8,4,2,1", reward="exact") == 1.0 and score("3,01,5,61", reward="exact") == 0.0
    assert prefix_credit([], ["1"]) == 0.0


@pytest.mark.parametrize("response", [[99], [-1], ["3"], [1.5], [None]])
def test_a_malformed_response_scores_zero_without_raising(task, response):
    assert task(task.make_prompt(6, uid="six"), response) == 0.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"reward": "digits"}, "reward must be one of 'prefix', 'exact'"),
        ({"max_digits": 0}, r"max_digits must be an integer in \[1, 12\]"),
        ({"max_digits": 13}, r"max_digits must be an integer in \[1, 12\]"),
        ({"max_response_tokens": 5000}, r"max_response_tokens must be an integer in \[8, 4000\]"),
        ({"max_response_tokens": "long"}, "max_response_tokens must be an integer"),
        ({"size": 3}, "do not fit task 'collatz'"),
    ],
)
def test_bad_options_are_config_errors_that_say_what_is_allowed(tmp_path, options, message):
    from bubblespec.run.assembly import make_task

    config = validate({"name": "c", "output_dir": str(tmp_path), "task": {"name": "collatz", "options": options}})
    with pytest.raises(ConfigError, match=message):
        make_task(config)


def _training_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "scripts" / "train_tiny_model.py"
    spec = importlib.util.spec_from_file_location("train_tiny_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pre_training_windows_label_only_values_whose_predecessor_they_hold(task):
    """scripts/train_tiny_model.py --task collatz trains on windows of the response with their true position ids;
    a window's first value has no predecessor in it (unless the window starts the response) and must carry no
    loss, the last value ``1`` included (else the model learns that ``=`` is followed by ``1``)."""
    pytest.importorskip("transformers")
    script = _training_script()
    rng = random.Random(0)
    comma = task.encode(",")[0]
    for n in (27, 633, 6, 97):
        response = task.reference_response_ids(task.make_prompt(n, uid="n"))
        for _ in range(40):
            prompt_ids, window, start, unlabelled = script.collatz_window(task, n, rng, window=12)
            assert window == response[start : start + 12]
            assert start == 0 or response[start - 1] == comma  # a window starts at a value
            rest = response[start:]
            # its first value and that value's "," carry no loss (the last value, 1, all but the <eos> after it)
            first_value = rest.index(comma) + 1 if comma in rest else len(rest) - 1
            assert unlabelled == (first_value if start else 0)
            input_ids, _, labels, positions = script.collate([(prompt_ids, window, start, unlabelled)], 0)
            assert positions[0, len(prompt_ids)].item() == len(prompt_ids) + start  # where the window really is
            assert (labels[0, : len(prompt_ids) + unlabelled] == -100).all()
            assert labels[0, len(prompt_ids) + unlabelled :].tolist() == window[unlabelled:]


def test_the_shipped_model_writes_trajectories_greedily_and_worse_at_temperature_one():
    """The pre-trained model in assets/tiny-collatz (scripts/train_tiny_model.py --task collatz): small, a 4,096-token
    context, the task's tokenizer; greedy it writes nearly every trajectory right, its temperature-1 samples
    (what GRPO trains on) much less often: the gap reinforcement learning closes."""
    import statistics

    from tokenizers import Tokenizer

    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.core.interfaces import GenerationRequest, RolloutKey, SamplingParams
    from bubblespec.tasks.arithmetic import build_tokenizer

    folder = CollatzTask.model_path()
    assert sum(f.stat().st_size for f in folder.iterdir()) < 8 * 2**20
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab() == build_tokenizer().get_vocab()
    task = CollatzTask(seed=12345, prompts_per_step=24, max_digits=5, max_response_tokens=800)
    engine = TorchEngine.from_pretrained(str(folder), dtype="float32")
    assert engine.vocab_size == task.vocab_size
    prompts = task.batch(0)
    rewards = {}
    for temperature in (0.0, 1.0):
        sampling = SamplingParams(temperature, max_new_tokens=task.max_new_tokens, stop_token_ids=(task.eos_token_id,))
        results = engine.generate(
            [GenerationRequest(p.token_ids, RolloutKey(0, 0, p.uid, 0), sampling) for p in prompts]
        )
        rewards[temperature] = statistics.fmean(task(p, r.token_ids) for p, r in zip(prompts, results, strict=True))
    assert rewards[0.0] >= 0.95, rewards
    assert rewards[1.0] <= rewards[0.0] - 0.1, rewards
