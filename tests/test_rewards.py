"""Rewards of the dataset task: built-ins, user functions by name, weighted sums, the worker pool's time limit."""

from __future__ import annotations

import pytest

from bubblespec.core.errors import ConfigError, RewardError
from bubblespec.tasks.rewards import (
    RewardItem,
    RewardScorer,
    RewardSpec,
    exact,
    extract,
    format_match,
    math_answer,
    parse_specs,
)


def _items(*responses, **columns):
    return [RewardItem(f"train-{i}", "the prompt", r, dict(columns)) for i, r in enumerate(responses)]


def test_exact_compares_normalised_text_or_the_last_match_of_a_pattern():
    assert exact("p", "  Paris. ", answer="paris") == 1.0
    assert exact("p", "Paris is big", answer="paris") == 0.0
    assert exact("p", "1+3=4,2+9=1c;14;4914", answer="4914", pattern=";([0-9]+)") == 1.0
    assert exact("p", "no answer here", answer="4914", pattern=";([0-9]+)") == 0.0
    assert extract("a1 b2", r"[a-z]\d") == "b2"  # no group: the whole last match


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("x = 3, hence \\boxed{3}", "\\boxed{3}", 1.0),
        ("after simplifying: 12", "12", 1.0),
        ("the answer is \\boxed{4}", "5", 0.0),
        ("I do not know", "5", 0.0),
    ],
)
def test_math_checks_equivalence_with_math_verify(response, answer, expected):
    assert math_answer("p", response, answer=answer) == expected


def test_format_matches_the_whole_response():
    pattern = r"<think>.*</think>\s*\\boxed\{.*\}"
    assert format_match("p", "<think>a\nb</think> \\boxed{3}", pattern=pattern) == 1.0
    assert format_match("p", "\\boxed{3}", pattern=pattern) == 0.0
    with pytest.raises(TypeError, match="needs a pattern"):
        format_match("p", "x")


def test_specs_parse_names_mappings_and_weighted_lists():
    assert parse_specs("exact") == (RewardSpec("exact"),)
    assert parse_specs({"name": "format", "pattern": "x", "weight": 0.5}) == (
        RewardSpec("format", 0.5, {"pattern": "x"}),
    )
    assert [s.name for s in parse_specs(["math", {"name": "format", "weight": 0.1, "pattern": "."}])] == [
        "math",
        "format",
    ]
    for bad, message in [
        ([], "empty list"),
        ({"weight": 1}, "'name'"),
        (3, "reward name"),
        ({"name": "x", "weight": "a"}, "weight"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_specs(bad)


def test_a_weighted_sum_of_built_in_and_user_rewards_in_this_process():
    specs = [RewardSpec("exact", 2.0), RewardSpec("tests.reward_functions:length_bonus", 0.5, {"scale": 0.1})]
    scorer = RewardScorer(specs, workers=0)
    assert scorer(_items("42", "7", answer="42")) == pytest.approx([2.0 + 0.5 * 0.2, 0.5 * 0.1])


def test_user_rewards_get_every_column_and_batched_ones_get_lists():
    scorer = RewardScorer([RewardSpec("tests.reward_functions:uses_columns")], workers=0)
    assert scorer(_items("5", "6", answer="5", level=3)) == [3.0, 0.0]
    batched = RewardScorer([RewardSpec("tests.reward_functions:batched_contains")], workers=0)
    assert batched(_items("it is 42", "it is 41", answer="42")) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no-such-reward", "reward 'no-such-reward' is not known.*exact, format, math"),
        ("no_such_module_anywhere:f", "module 'no_such_module_anywhere' does not import"),
        ("tests.reward_functions:missing", "has no attribute 'missing'"),
        ("tests.reward_functions:NOT_CALLABLE", "is not callable"),
        ("rewards/mine.py:score", "not a file path"),
    ],
)
def test_a_reward_that_cannot_be_loaded_is_a_clear_error(name, message):
    with pytest.raises(ConfigError, match=message):
        RewardScorer([RewardSpec(name)], workers=0)


def test_a_reward_returning_a_non_number_names_the_reward_and_the_row():
    scorer = RewardScorer([RewardSpec("tests.reward_functions:returns_text")], workers=0)
    with pytest.raises(RewardError, match=r"returns_text.*'high' for row 'train-0'"):
        scorer(_items("x"))


@pytest.mark.slow
def test_the_pool_scores_a_timed_out_or_raising_call_0_and_counts_it():
    specs = [RewardSpec("tests.reward_functions:sleeps_on_slow"), RewardSpec("tests.reward_functions:raises_on_bad")]
    scorer = RewardScorer(specs, workers=2, timeout_s=1.0)
    try:
        assert scorer(_items("fine", "slow", "bad")) == [2.0, 1.0, 1.0]
        failures = scorer.take_failures()
        assert (failures.timeouts, failures.errors) == (1, 1)
        assert "sleeps_on_slow" in failures.first_error and "train-1" in failures.first_error
        assert scorer(_items("fine")) == [2.0]  # the pool goes on
        assert scorer.take_failures().timeouts == 0
    finally:
        scorer.close()
    text = RewardScorer([RewardSpec("tests.reward_functions:returns_text")], workers=1)
    try:
        with pytest.raises(RewardError, match="returns_text"):  # from a worker too: an error, not a 0
            text(_items("x"))
    finally:
        text.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["swallows_exceptions", "swallows_everything"])
def test_the_time_limit_holds_against_rewards_that_catch_it_and_is_always_counted(name):
    """Rewards (math-verify among them) catch ``Exception`` around their work; before, the limit was an
    Exception: it was swallowed, not counted, and the call ran on without a limit."""
    import time

    scorer = RewardScorer([RewardSpec(f"tests.reward_functions:{name}")], workers=1, timeout_s=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(RewardError, match="failed .* on 1 of its 1 calls.*did not return within 0.5 s"):
            scorer(_items("x"))  # every call of the step failed: the run stops
        assert time.monotonic() - start < 20  # the call sleeps 60 s (twice) unless the limit ends it
        failures = scorer.take_failures()
        assert (failures.timeouts, failures.errors) == (1, 0)
        assert "did not return within 0.5 s" in failures.first_error
    finally:
        scorer.close()


def test_a_reward_failing_on_a_share_of_its_calls_stops_the_run_at_the_limit_it_is_given():
    """raises_on_bad raises for the response "bad": 1 of 3 calls fails. The default stops only when every call of a
    step fails; a limit of a third stops at one in three."""
    items = _items("fine", "bad", "fine")
    lenient = RewardScorer([RewardSpec("tests.reward_functions:raises_on_bad")], workers=1)
    strict = RewardScorer([RewardSpec("tests.reward_functions:raises_on_bad")], workers=1, failure_limit=0.3)
    try:
        assert lenient(items) == [1.0, 0.0, 1.0]
        failures = lenient.take_failures()
        assert (failures.errors, failures.calls) == (1, 3)
        with pytest.raises(RewardError, match=r"raises_on_bad' failed .* on 1 of its 3 calls.*reward_failure_limit"):
            strict(items)
    finally:
        lenient.close()
        strict.close()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"name": "format", "patern": "x"}, "reward 'format' has no option 'patern' (did you mean 'pattern'?)"),
        ({"name": "format"}, "reward 'format' needs option 'pattern'"),
        ({"name": "exact", "pattern": "(unclosed"}, "pattern: '(unclosed' is not a regular expression"),
        ({"name": "math", "pattern": "x"}, "reward 'math' has no option 'pattern'; its options: none"),
    ],
)
def test_built_in_reward_options_are_checked_when_the_scorer_is_built(spec, message):
    with pytest.raises(ConfigError) as raised:
        RewardScorer(parse_specs(spec), workers=0)
    assert message in str(raised.value)


def test_each_reward_scores_on_its_own_beside_the_weighted_sum():
    specs = parse_specs(
        [{"name": "exact"}, {"name": "format", "weight": 0.5, "pattern": "4.*"}, {"name": "format", "pattern": "x"}]
    )
    scorer = RewardScorer(specs, workers=0)
    totals, parts = scorer.score([RewardItem("train-0", "2+2", "4", {"answer": "4"})])
    assert totals == [1.5] and parts == {"exact": [1.0], "format": [1.0], "format#2": [0.0]}
