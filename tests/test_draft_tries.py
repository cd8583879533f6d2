"""Draft tries (docs/design.md §13): a drafting pass reports each sample's runner-up and margin; a branch drafted
from a near-tie is the older policy's keyed continuation after its runner-up; a verifier that emits the runner-up
follows the branch; and none of it changes an output. A policy pair at a 32,000-token vocabulary, one small random
step apart, in float64 (so a continued draft is bit-identical to an uncut one)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from bubblespec.core.errors import DraftError, RequestError
from bubblespec.core.interfaces import (
    Draft,
    DraftBranch,
    GenerationRequest,
    NearTie,
    RolloutKey,
    SamplingParams,
)
from bubblespec.observe.run_dir import _draft_from_json, _draft_to_json
from bubblespec.rollout.draft_store import InMemoryDraftStore
from bubblespec.testing.conformance import write_policy_pair
from bubblespec.verify.drafts import validate_draft
from bubblespec.verify.margins import REPORTED_MARGIN_LIMIT
from bubblespec.verify.sequence import Sequence
from bubblespec.verify.tries import (
    branch_from,
    branch_request,
    continue_request,
    node_at,
    open_ties,
    path_at,
    unfinished_branches,
    with_branch,
)

VOCAB = 32_000
TOKENS = 40


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from bubblespec.backends.torch_engine import TorchEngine

    newer, older = write_policy_pair(tmp_path_factory.mktemp("tries"), "llama", VOCAB, 40.0, 0.05)
    made = [TorchEngine.from_pretrained(str(path), dtype="float64") for path in (newer, older)]
    yield made
    for engine in made:
        engine.close()


def _requests(num: int = 8, margins: bool = False, **sampling) -> list[GenerationRequest]:
    params = SamplingParams(max_new_tokens=TOKENS, ignore_eos=True, **sampling)
    return [
        GenerationRequest((5 + p, 17, 300 + p, 9), RolloutKey(3, 2, f"p{p}", s), params, margins=margins)
        for p in range(num // 2)
        for s in range(2)
    ]


def _tries(older, requests, rounds: int, per_round: int = 3) -> dict[RolloutKey, Draft]:
    """The older policy's drafts of ``requests`` with margins, then ``rounds`` rounds of branches: each round drafts
    the ``per_round`` open near-ties of every trie with the smallest margins (a later round branches the branches)."""
    tries = {r.key: d for r, d in zip(requests, _drafts(older.generate(requests)), strict=True)}
    by_key = {r.key: r for r in requests}
    for _ in range(rounds):
        opened = [
            (key, tie)
            for key, draft in tries.items()
            for tie in sorted(open_ties(draft), key=lambda t: t.tie.margin)[:per_round]
        ]
        results = older.generate([branch_request(by_key[key], tie) for key, tie in opened])
        for (key, tie), result in zip(opened, results, strict=True):
            tries[key] = with_branch(tries[key], tie.route, branch_from(result, tie.tie.index))
    return tries


def _drafts(results) -> list[Draft]:
    return [Draft(r.key, tuple(r.token_ids), 0, r.finish_reason != "preempted", r.near_ties()) for r in results]


def _with(requests, drafts) -> list[GenerationRequest]:
    return [dataclasses.replace(r, draft=drafts[r.key], margins=False) for r in requests]


def test_a_drafting_pass_reports_the_runner_up_the_policy_samples_without_the_winner(engines):
    newer, _ = engines
    requests = _requests(margins=True)
    plain = newer.generate(_requests())
    reported = newer.generate(requests)
    checked = 0
    for request, result, without in zip(requests, reported, plain, strict=True):
        assert result.token_ids == without.token_ids and result.logprobs == without.logprobs  # margins change nothing
        assert len(result.runner_up_ids) == len(result.margins) == len(result.token_ids)
        for index, (winner, runner_up, margin) in enumerate(
            zip(result.token_ids, result.runner_up_ids, result.margins, strict=True)
        ):
            if runner_up < 0:
                assert margin == float("inf")
                continue
            assert runner_up != winner and 0 <= margin <= REPORTED_MARGIN_LIMIT
            if checked < 12:  # the sample at that position with the winner suppressed is the runner-up
                params = dataclasses.replace(request.sampling, suppressed_token_ids=(winner,), max_new_tokens=index + 1)
                again = dataclasses.replace(
                    request, sampling=params, response_prefix=tuple(result.token_ids[:index]), margins=False
                )
                assert newer.generate([again])[0].token_ids[index] == runner_up
                checked += 1
    assert checked >= 4, "too few near-ties to check"


def test_a_response_prefix_of_its_own_tokens_gives_the_same_response(engines):
    newer, _ = engines
    requests = _requests(4)
    plain = newer.generate(requests)
    prefixed = newer.generate(
        [dataclasses.replace(r, response_prefix=tuple(p.token_ids[: 3 + i])) for i, (r, p) in
         enumerate(zip(requests, plain, strict=True))]
    )  # fmt: skip
    for i, (without, given) in enumerate(zip(plain, prefixed, strict=True)):
        assert given.token_ids == without.token_ids
        assert given.logprobs[3 + i :] == pytest.approx(without.logprobs[3 + i :], abs=1e-9)  # float64, another pass
        assert given.logprobs[: 3 + i] == [0.0] * (3 + i)  # given, not sampled
        assert given.stats.decode_steps == TOKENS - (3 + i)


def test_bad_response_prefixes_and_malformed_tries_are_refused(engines):
    newer, _ = engines
    key, params = RolloutKey(0, 0, "p", 0), SamplingParams(max_new_tokens=4, stop_token_ids=(7,))
    with pytest.raises(RequestError, match=r"a response prefix of 5 tokens is longer than the response may be \(4"):
        newer.generate([GenerationRequest((1, 2), key, params, response_prefix=(3, 4, 5, 6, 8))])
    with pytest.raises(RequestError, match=r"holds stop tokens \[7\] before its last"):
        newer.generate([GenerationRequest((1, 2), key, params, response_prefix=(3, 7, 8))])
    ended = newer.generate(  # a prefix that fills the room or ends with a stop token ends the response at once
        [GenerationRequest((1, 2), key, params, response_prefix=p, margins=True) for p in ((3, 4, 5, 6), (3, 7))]
    )
    assert [(r.token_ids, r.finish_reason, r.stats.decode_steps) for r in ended] == [
        ([3, 4, 5, 6], "length", 0),
        ([3, 7], "stop", 0),
    ]
    assert ended[1].runner_up_ids == [-1, -1] and ended[1].margins == [float("inf")] * 2
    with pytest.raises(RequestError, match=r"response prefix token ids \[32000\] outside"):
        newer.generate([GenerationRequest((1, 2), key, params, response_prefix=(VOCAB,))])
    with pytest.raises(RequestError, match="has a response prefix, which this engine does not take"):
        Sequence.admit(0, GenerationRequest((1, 2), key, params, response_prefix=(3,)), VOCAB, 100, ())
    path = (1, 2, 3, 4)
    bad = {
        "a branch starting with the path's own token": (DraftBranch(1, (2, 9)),),
        "a branch past the path": (DraftBranch(4, (9,)),),
        "an empty branch": (DraftBranch(2, ()),),
        "a nested branch before its parent": (DraftBranch(1, (8, 9), branches=(DraftBranch(0, (5,)),)),),
    }
    for name, branches in bad.items():
        with pytest.raises(DraftError, match="a branch starts within the path's positions"):
            validate_draft(Draft(key, path, 0, branches=branches), VOCAB)
            pytest.fail(f"{name} was accepted")
    with pytest.raises(DraftError, match=r"has token 32000 at position 2"):
        validate_draft(Draft(key, path, 0, branches=(DraftBranch(1, (8, VOCAB)),)), VOCAB)
    with pytest.raises(DraftError, match="near-tie"):
        validate_draft(Draft(key, path, 0, near_ties=(NearTie(4, 9, 0.1),)), VOCAB)


@pytest.mark.parametrize("candidates", [1, 3])
def test_tries_change_no_output_and_the_response_follows_the_branch_it_takes(engines, tmp_path, candidates):
    from bubblespec.backends.torch_engine import TorchEngine

    newer, older = engines
    if candidates > 1:
        newer = TorchEngine.from_pretrained(newer.config.model_path, dtype="float64", draft_candidates=candidates)
    requests = _requests(16)
    plain = {r.key: r for r in newer.generate(requests)}
    single = _tries(older, _requests(16, margins=True), rounds=0)
    tries = _tries(older, _requests(16, margins=True), rounds=2)
    assert any(len(key) > 1 for draft in tries.values() for key in _routes(draft)), "no nested branch was drafted"
    along_single = {r.key: r for r in newer.generate(_with(requests, single))}
    along_tries = {r.key: r for r in newer.generate(_with(requests, tries))}
    for key, result in plain.items():
        assert along_single[key].token_ids == result.token_ids and along_tries[key].token_ids == result.token_ids
        assert along_tries[key].logprobs == pytest.approx(result.logprobs, abs=1e-9)
    followed = sum(r.stats.branches_followed for r in along_tries.values())
    steps = [sum(r.stats.decode_steps for r in run.values()) for run in (plain, along_single, along_tries)]
    diverged = sum(single[k].token_ids != plain[k].token_ids[: len(single[k].token_ids)] for k in plain)
    assert diverged >= 4, "the older policy is not far enough from the newer one to leave its drafts"
    assert followed >= 2, f"{followed} branches followed in {diverged} responses that left their drafts"
    assert steps[2] < steps[1] < steps[0], f"decode steps plain, single drafts, tries: {steps}"


def test_wrong_branches_and_branches_past_the_end_change_no_output(engines):
    newer, older = engines
    requests = _requests(8)
    plain = {r.key: r for r in newer.generate(requests)}
    tries = _tries(older, _requests(8, margins=True), rounds=1)
    generator = torch.Generator().manual_seed(4)

    def wrong(branch: DraftBranch) -> DraftBranch:  # the runner-up, then random tokens
        noise = torch.randint(VOCAB, (len(branch.token_ids) - 1,), generator=generator).tolist()
        return dataclasses.replace(branch, token_ids=(branch.token_ids[0], *noise))

    variants = {
        "every branch wrong": {k: dataclasses.replace(d, branches=tuple(map(wrong, d.branches))) for k, d in
                               tries.items()},
        "branches past the response's end": {
            k: Draft(k, (*plain[k].token_ids, 11, 12, 13, 14), 0, branches=(DraftBranch(TOKENS + 1, (99, 98, 97)),))
            for k in plain
        },
        "a branch taken at once, then nothing": {
            k: Draft(k, (VOCAB - 1,), 0, branches=(DraftBranch(0, plain[k].token_ids[:1]),)) for k in plain
        },
    }  # fmt: skip
    for name, drafts in variants.items():
        result = {r.key: r for r in newer.generate(_with(requests, drafts))}
        assert all(result[k].token_ids == plain[k].token_ids for k in plain), name
    taken = newer.generate(_with(requests, variants["a branch taken at once, then nothing"]))
    assert all(r.stats.branches_followed == 1 for r in taken)


def test_a_branch_cut_by_a_barrier_and_continued_is_the_uncut_branch(engines):
    _, older = engines
    requests = _requests(4, margins=True)
    tries = _tries(older, requests, rounds=0)
    by_key = {r.key: r for r in requests}
    opened = [(k, min(open_ties(d), key=lambda t: t.tie.margin)) for k, d in tries.items() if d.near_ties]
    branch_requests = [branch_request(by_key[k], tie) for k, tie in opened]
    whole = older.generate(branch_requests)

    class AfterPasses:  # the barrier: set once the engine has run three forward passes
        passes = 0

        def is_set(self) -> bool:
            return self.passes >= 3

        def __call__(self, forward_pass) -> None:
            self.passes += 1

    barrier = AfterPasses()
    cut = older.generate(branch_requests, stop=barrier, on_forward=barrier)
    cut_tries = {
        k: with_branch(tries[k], tie.route, branch_from(r, tie.tie.index)) for (k, tie), r in zip(opened, cut,
                                                                                                    strict=True)
    }  # fmt: skip
    assert all(route for d in cut_tries.values() for route in unfinished_branches(d))
    for (key, tie), uncut in zip(opened, whole, strict=True):
        route = next(unfinished_branches(cut_tries[key]))
        continued = older.generate([continue_request(by_key[key], cut_tries[key], route)])[0]
        branch = node_at(cut_tries[key], route)
        grown = dataclasses.replace(branch_from(continued, branch.index), branches=branch.branches)
        expected = branch_from(uncut, tie.tie.index)
        assert (grown.index, grown.token_ids, grown.finished) == (expected.index, expected.token_ids, True)
        # the same near-ties; their margins from a verify pass rather than decode passes: float64 rounding apart
        assert [t[:2] for t in grown.near_ties] == [t[:2] for t in expected.near_ties]
        assert [t.margin for t in grown.near_ties] == pytest.approx([t.margin for t in expected.near_ties], abs=1e-9)
        assert path_at(with_branch(cut_tries[key], (), grown), route) == tuple(uncut.token_ids)


def test_tries_round_trip_through_checkpoints_and_count_against_the_store_cap():
    key = RolloutKey(1, 2, "p", 0)
    nested = DraftBranch(3, (7, 8), near_ties=(NearTie(4, 5, 0.25),))
    draft = Draft(
        key, (1, 2, 3, 4, 5), 0, True, near_ties=(NearTie(1, 9, 0.1 + 0.2),),
        branches=(DraftBranch(1, (9, 6, 5, 4), False, (NearTie(3, 7, 1 / 3),), (nested,)),),
    )  # fmt: skip
    assert _draft_from_json(json.loads(json.dumps(_draft_to_json(draft)))) == validate_draft(draft, VOCAB)
    assert draft.num_tokens == 5 + 4 + 2
    store = InMemoryDraftStore(VOCAB, max_tokens=20)
    store.put([draft])
    assert store.num_tokens == 11
    store.put([dataclasses.replace(draft, key=RolloutKey(1, 3, "p", 0))])
    assert store.stats()["evicted"] == 1 and store.num_tokens == 11


def _routes(draft: Draft):
    stack = [((), draft)]
    while stack:
        route, node = stack.pop()
        yield route
        stack += [((*route, b.index), b) for b in node.branches]


def test_tries_are_refused_where_the_bubble_drafts_nothing_or_the_backend_cannot_draft_them():
    from bubblespec.core.config import validate
    from bubblespec.core.errors import ConfigError
    from bubblespec.run.assembly import load_backend

    with pytest.raises(ConfigError, match=r"tries_max_tokens_per_rank 100 branches the bubble's drafts, but the bubble "
                       r"drafts nothing \(enabled is false\)"):  # fmt: skip
        validate({"speculation": {"enabled": False, "tries_max_tokens_per_rank": 100}})
    with pytest.raises(ConfigError, match=r"draft_sources \['ngram'\] has no bubble"):
        validate({"speculation": {"draft_sources": ["ngram"], "tries_max_tokens_per_rank": 100}})
    with pytest.raises(ConfigError, match="unknown tries policy 'longest-first'; available: tail-margin"):
        validate({"speculation": {"tries_policy": "longest-first"}})
    sglang = validate({"rollout": {"backend": "sglang"}, "speculation": {"tries_max_tokens_per_rank": 100}})
    with pytest.raises(
        ConfigError, match=r"backend 'sglang' does not draft tries .*use 0 with it, or the torch or vllm"
    ):
        load_backend(sglang)
    assert load_backend(validate({"speculation": {"tries_max_tokens_per_rank": 100}})).supports_draft_tries
    vllm = {"rollout": {"backend": "vllm"}, "speculation": {"tries_max_tokens_per_rank": 100}}
    assert load_backend(validate(vllm)).supports_draft_tries


def test_bench_engine_finds_every_divergence_of_the_older_policy_along_the_newer_responses(engines):
    from bubblespec.cli.bench_engine_tries import decode_steps_with_branches, divergence_summary, divergences

    newer, older = engines
    requests = _requests(6)
    responses = newer.generate(requests)
    found = divergences(older, requests, responses)
    checked = 0
    for request, response, walk in zip(requests, responses, found, strict=True):
        marked = {d["position"]: d for d in walk["divergences"]}
        positions = sorted({*marked, *range(0, len(response.token_ids), 7)})
        for position in positions:  # the older policy given the response's own prefix, one position at a time
            params = dataclasses.replace(request.sampling, max_new_tokens=position + 1)
            forced = dataclasses.replace(request, sampling=params, response_prefix=tuple(response.token_ids[:position]))
            sample = older.generate([forced])[0].token_ids[position]
            if position in marked:
                assert sample == marked[position]["older_sample"] != response.token_ids[position]
                checked += 1
            else:
                assert sample == response.token_ids[position], f"{request.key} position {position} missed"
    summary = divergence_summary(found)
    assert summary["divergences"] >= 4 and checked == summary["divergences"], summary
    assert 0 <= summary["took_the_runner_up"] <= 1 and summary["responses_that_left_their_draft"] >= 2
    branched = decode_steps_with_branches(older, newer, requests, branches_per_draft=3)
    assert branched["identical"] and branched["branches_drafted"] > 0
    assert branched["decode_steps_with_branches"] <= branched["decode_steps_single"]


def test_the_tries_plan_hands_out_several_near_ties_of_a_key_at_once_and_merges_each_where_it_belongs(engines):
    """One round of branch requests drafts the best near-ties of every key, several per key (a result is told
    apart by its response prefix); each result grows its own node; a result for a draft that was replaced meanwhile
    is dropped; the budget stops the hand-out; a branch the barrier cut is continued before new near-ties."""
    from bubblespec.policies.tries import TailMargin
    from bubblespec.rollout.step import drafts_from
    from bubblespec.rollout.tries_plan import TriesPlan

    _, older = engines
    requests = _requests(3, margins=True)
    drafts = drafts_from(older.generate(requests), 0)
    plan = TriesPlan(TailMargin(), requests, max_tokens=10_000, drafts=drafts)
    assert not plan.available(policy_version=1), "another policy's drafts branched"
    chunk = plan.take(12, policy_version=0)
    per_key = {r.key: sum(c.key == r.key for c in chunk) for r in requests}
    assert len(chunk) == 12 and max(per_key.values()) > 1, per_key
    assert len({(c.key, c.response_prefix) for c in chunk}) == 12, "two requests for one near-tie"
    results = older.generate(chunk)
    assert all(plan.is_branch(r) for r in results)
    assert not any(plan.is_branch(r) for r in older.generate(requests[:1])), "a key's own draft taken for a branch"
    grown = plan.merge(results[::-1])  # in any order
    assert sorted(t.key for t in grown) == sorted({c.key for c in chunk})  # one trie per key
    for request, result in zip(chunk, results, strict=True):
        trie = plan.tries[request.key]
        index = len(request.response_prefix) - 1
        branch = node_at(trie, (index,))  # the draft's own near-ties: route ()
        assert branch.token_ids == tuple(result.token_ids[index:])
        assert path_at(trie, (index,))[: index + 1] == request.response_prefix
    assert plan.tokens == sum(
        len(r.token_ids) - len(c.response_prefix) + 1 for c, r in zip(chunk, results, strict=True)
    )
    again = plan.take(12, policy_version=0)
    assert not {(c.key, c.response_prefix) for c in again} & {(c.key, c.response_prefix) for c in chunk}

    # the key's draft replaced while a branch of the old one was out: the branch is dropped
    key = again[0].key
    replaced = dataclasses.replace(plan.tries[key], token_ids=(7, *plan.tries[key].token_ids[1:]), branches=())
    plan.observe([replaced])
    assert plan.merge(older.generate(again[:1])) == [] and plan.tries[key] == replaced

    # the budget: nothing more is handed out once it is spent
    plan.tokens = plan.max_tokens
    assert not plan.available(0) and plan.take(4, 0) == []

    # a cut branch: continued before any new near-tie
    fresh = TriesPlan(TailMargin(), requests, max_tokens=10_000, drafts=drafts)
    first = fresh.take(1, 0)[0]
    cut = older.generate([dataclasses.replace(first, sampling=dataclasses.replace(
        first.sampling, max_new_tokens=len(first.response_prefix) + 2))])[0]  # fmt: skip
    fresh.merge([dataclasses.replace(cut, finish_reason="preempted")])
    following = fresh.take(3, 0)
    assert following[0].draft is not None and following[0].response_prefix == first.response_prefix
    continued = fresh.merge(older.generate(following[:1]))[0]
    index = len(first.response_prefix) - 1
    whole = older.generate([first])[0]
    assert node_at(continued, (index,)).token_ids == tuple(whole.token_ids[index:])
    assert node_at(continued, (index,)).finished
