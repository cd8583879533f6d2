"""speculation.enabled: auto: drafting pauses where the run's own estimate says it does not pay, one bubble in
``probe_every`` measures again, and drafting resumes where that pays; outputs never change. The draft head's gate
(``speculation.draft_head.enabled: auto``) does the same with the head's share of the saving net of its learning."""

from __future__ import annotations

import pytest

from bubblespec.rollout.speculation_gate import HeadGate, SpeculationGate, head_saving
from bubblespec.rollout.step import RankRecord, RolloutOutcome


def _outcome(saved: float, seconds: float = 1.0, drafts: int = 4) -> RolloutOutcome:
    """A one-rank rollout of ``seconds`` whose ``drafts`` verified drafts saved ``saved`` seconds (estimated)."""
    rank = RankRecord(0, requests_with_draft=drafts, generation_seconds=seconds, seconds_saved_by_drafts=saved)
    return RolloutOutcome([], [], [rank], seconds, seconds)


def test_drafting_pauses_after_a_window_that_did_not_pay_and_a_probe_that_pays_resumes_it():
    gate = SpeculationGate(window=3, min_saving=0.02, probe_every=4)
    assert gate.drafting(0)
    assert gate.observe(0, _outcome(0.0, drafts=0)) is None  # step 0 verified no drafts: not judged
    for step in (1, 2):
        assert gate.drafting(step) and gate.observe(step, _outcome(0.005)) is None
    assert gate.drafting(3)
    line = gate.observe(3, _outcome(0.005))  # 0.5% over three steps: under 2%
    assert gate.paused and "drafting pauses" in line and "0.5%" in line
    assert [gate.drafting(step) for step in range(4, 8)] == [False, False, False, True]  # step 7's bubble probes
    # step 4 verified drafts made before the pause: it does not decide, however much they saved
    assert gate.observe(4, _outcome(0.5)) is None and gate.paused
    assert gate.observe(8, _outcome(0.01)) is None and gate.paused  # the probe did not pay
    assert [gate.drafting(step) for step in range(9, 13)] == [False, False, False, True]
    assert "drafting resumes" in gate.observe(13, _outcome(0.1)) and not gate.paused
    assert gate.drafting(14)


def test_drafts_that_pay_keep_drafting_on_and_enabled_true_never_pauses():
    paying, forced = SpeculationGate(), SpeculationGate(auto=False)
    for step in range(1, 10):
        assert paying.drafting(step) and forced.drafting(step)
        assert paying.observe(step, _outcome(0.05)) is None
        assert forced.observe(step, _outcome(-0.5)) is None
    assert not paying.paused and not forced.paused


def test_a_restored_gate_decides_as_the_one_it_was_saved_from():
    """A checkpoint keeps the gate's state: a resumed run pauses, probes and resumes at the steps an uninterrupted
    one does."""
    import json

    gate = SpeculationGate(window=2, probe_every=3)
    for step in (1, 2):
        gate.drafting(step), gate.observe(step, _outcome(0.0))
    gate.drafting(3), gate.drafting(4)  # paused: step 5's bubble is the probe
    restored = SpeculationGate(window=2, probe_every=3)
    restored.restore(json.loads(json.dumps(gate.snapshot())))  # as state.json keeps it
    assert restored.paused and restored.snapshot() == gate.snapshot()
    assert [g.drafting(5) for g in (gate, restored)] == [True, True]
    lines = [g.observe(6, _outcome(0.1)) for g in (gate, restored)]
    assert "drafting resumes" in lines[0] and lines[0] == lines[1] and not restored.paused
    gate.restore({})  # a checkpoint of a run before gates were kept
    assert gate.snapshot() == SpeculationGate().snapshot()


def test_the_heads_saving_is_its_share_of_the_accepted_draft_tokens_less_its_calls_and_its_round():
    ranks = [
        RankRecord(0, requests_with_draft=2, draft_tokens_accepted=30, head_tokens_accepted=10,
                   generation_seconds=1.0, seconds_saved_by_drafts=0.4, head_call_seconds=0.02),
        RankRecord(1, requests_with_draft=2, draft_tokens_accepted=10, head_tokens_accepted=0,
                   generation_seconds=0.8, seconds_saved_by_drafts=0.1),
    ]  # fmt: skip
    outcome = RolloutOutcome([], [], ranks, 1.0, 1.0)
    assert outcome.seconds_saved == pytest.approx(0.4)  # the barrier without drafts: rank 0's 1.4 s
    # before its calls on the barrier's rank (rank 0) the drafts saved 0.42 s: a quarter of it, less those calls
    assert head_saving(outcome, round_cost=0.05) == pytest.approx(0.42 * 10 / 40 - 0.02 - 0.05)
    assert head_saving(_outcome(0.2), round_cost=0.01) == pytest.approx(-0.01)  # no head token: its cost only
    unestimated = RolloutOutcome([], [], [RankRecord(0, generation_seconds=1.0)], 1.0, 1.0)
    assert head_saving(unestimated, round_cost=0.0) is None


def test_a_head_that_does_not_pay_for_its_learning_pauses_and_a_probe_that_pays_resumes_it():
    gate, forced = HeadGate(window=3, probe_every=4), HeadGate(auto=False)
    for step in (1, 2):
        assert gate.drafting(step) and gate.judge(step, 0.01, 1.0) is None
    assert gate.drafting(3)
    line = gate.judge(3, -0.05, 1.0)  # net of its cost, -1% over three steps
    assert gate.paused and "draft head" in line and "-1.0%" in line
    assert [gate.drafting(step) for step in range(4, 8)] == [False, False, False, True]  # learns after step 7
    assert gate.judge(8, 0.0, 1.0) is None and gate.paused  # saved nothing: not paid
    assert [gate.drafting(step) for step in range(9, 13)] == [False, False, False, True]
    assert "resumes" in gate.judge(13, 0.02, 1.0) and not gate.paused
    for step in range(1, 10):
        assert forced.drafting(step) and forced.judge(step, -0.5, 1.0) is None
