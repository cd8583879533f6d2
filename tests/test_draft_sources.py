"""Draft sources: what ngram, group, suffix and history propose, and that no source changes an engine's output."""

from __future__ import annotations

import pytest

from bubblespec.core.draft_sources import (
    REQUEST_DRAFT,
    DynamicDraftSource,
    GroupProposer,
    HistoryDrafts,
    NGramProposer,
    ProposalContext,
    SuffixProposer,
    draft_chain,
    lookup_continuation,
)
from bubblespec.core.interfaces import GenerationRequest, GenerationResult, RequestStats, RolloutKey, SamplingParams

KEY = RolloutKey(0, 3, "p", 1)


def _context(tokens, prompt=(), siblings=()) -> ProposalContext:
    return ProposalContext(KEY, tuple(prompt), list(tokens), [list(s) for s in siblings])


def test_lookup_takes_the_longest_ngram_then_the_latest_occurrence():
    history = [5, 6, 7, 1, 5, 6, 8, 2, 6, 9, 5, 6]
    # the 2-gram (5, 6) occurs at 0 and 4 (the suffix itself at 10 is excluded by `before`): latest is 4
    assert lookup_continuation([5, 6], history, max_n=3, min_n=2, num_tokens=3, before=11) == [8, 2, 6]
    # a 3-gram match beats a later 2-gram match
    history = [1, 5, 6, 7, 7, 0, 5, 6, 4, 1, 5, 6]
    assert lookup_continuation([1, 5, 6], history, max_n=3, min_n=2, num_tokens=2, before=11) == [7, 7]
    assert lookup_continuation([3, 3], history, max_n=3, min_n=2, num_tokens=2) == []


def test_ngram_proposes_what_followed_the_last_tokens_in_prompt_and_response():
    ngram = NGramProposer(max_n=3, min_n=2, num_tokens=4)
    # prompt "1 2 3 4 5", response "9 2 3": the 2-gram (2, 3) was followed by 4 5 in the prompt, then 9 2 3
    assert ngram.propose(_context([9, 2, 3], prompt=[1, 2, 3, 4, 5]), limit=16) == [4, 5, 9, 2]
    assert ngram.propose(_context([9, 2, 3], prompt=[1, 2, 3, 4, 5]), limit=1) == [4]
    assert ngram.propose(_context([7, 8], prompt=[1, 2, 3]), limit=16) == []
    assert ngram.propose(_context([], prompt=[1, 2, 1, 2]), limit=16) == []
    with pytest.raises(ValueError, match="min_n"):
        NGramProposer(max_n=1, min_n=2)


def test_group_proposes_a_siblings_tokens_at_the_same_positions_or_realigned():
    group = GroupProposer(max_n=4, min_n=2, match_tokens=2)
    ahead = [1, 2, 3, 4, 5, 6, 2]
    assert group.propose(_context([1, 2, 3], siblings=[ahead]), limit=3) == [4, 5, 6]
    # not aligned (we inserted a token), but our last tokens (3, 4) occur in the sibling: continue after them
    assert group.propose(_context([1, 2, 9, 3, 4], siblings=[ahead]), limit=8) == [5, 6, 2]
    # the sibling with the longest proposal wins; one that is behind offers nothing at the aligned position
    assert group.propose(_context([1, 2, 3], siblings=[[1, 2], [1, 2, 3, 4], ahead]), limit=8) == [4, 5, 6, 2]
    assert group.propose(_context([1, 2, 3], siblings=[]), limit=8) == []
    assert group.propose(_context([7, 7, 7], siblings=[ahead]), limit=8) == []


def test_group_proposes_every_siblings_continuation_longest_first():
    group = GroupProposer(max_n=4, min_n=2, match_tokens=2)
    siblings = [[1, 2, 3, 4], [1, 2, 3, 7, 8], [5, 5], [1, 2, 3, 4]]
    assert group.propose_all(_context([1, 2, 3], siblings=siblings), limit=8) == [[7, 8], [4], [4]]


def test_suffix_proposes_the_continuations_of_the_longest_matches_in_earlier_responses():
    suffix = SuffixProposer(min_n=2, max_n=4, num_tokens=3, max_candidates=2)
    assert suffix.propose(_context([1, 2, 3]), limit=8) == []  # nothing seen yet
    suffix.observe(_context([9, 2, 3, 5, 5, 5]))  # (2, 3) then 5 5 5; matches our last 2 tokens
    suffix.observe(_context([7, 1, 2, 3, 6, 6, 6]))  # (1, 2, 3) then 6 6 6: matches 3 tokens, ranked first
    suffix.observe(_context([8, 8, 2, 3, 4]))  # the latest, but a 2-token match
    assert suffix.propose_all(_context([0, 1, 2, 3]), limit=8) == [[6, 6, 6], [4]]
    assert suffix.propose(_context([0, 1, 2, 3]), limit=2) == [6, 6]
    assert suffix.propose(_context([4, 4]), limit=8) == []
    with pytest.raises(ValueError, match="min_n"):
        SuffixProposer(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="max_candidates"):
        SuffixProposer(max_candidates=0)


def test_suffix_forgets_its_oldest_responses_past_its_token_cap():
    suffix = SuffixProposer(min_n=2, max_n=4, num_tokens=4, max_tokens=10)
    suffix.observe(_context([1, 2, 3, 4, 5, 6]))
    assert suffix.propose(_context([1, 2]), limit=8) == [3, 4, 5, 6]
    suffix.observe(_context([7, 8, 9, 7, 8, 1]))  # 12 tokens held: the first response goes
    assert suffix.propose(_context([1, 2]), limit=8) == []
    assert suffix.propose(_context([7, 8]), limit=8) == [1]  # the latest of two places, both of one length
    assert (1, 2) not in suffix._places


def _result(key, tokens) -> GenerationResult:
    return GenerationResult(key, list(tokens), [0.0] * len(tokens), "stop", RequestStats())


def test_history_drafts_are_earlier_responses_to_the_same_prompt_and_sample():
    history = HistoryDrafts()
    history.observe([_result(RolloutKey(0, 1, "p", 0), [4, 5]), _result(RolloutKey(0, 1, "p", 1), [6])])
    history.observe([_result(RolloutKey(0, 2, "q", 0), [7])])
    later = [RolloutKey(0, 5, "p", 0), RolloutKey(0, 5, "p", 1), RolloutKey(0, 5, "p", 2), RolloutKey(0, 5, "r", 0)]
    drafts = history.drafts(later)
    assert {k: d.token_ids for k, d in drafts.items()} == {later[0]: (4, 5), later[1]: (6,)}
    assert all(d.key == k and d.policy_version == 1 for k, d in drafts.items())
    assert history.drafts([RolloutKey(0, 1, "p", 0)]) == {}  # never its own step's response
    history.observe([_result(RolloutKey(0, 3, "p", 0), [9, 9, 9])])  # the latest epoch wins
    assert history.drafts([later[0]])[later[0]].token_ids == (9, 9, 9)


def test_a_dynamic_source_defines_propose_or_propose_all_and_gets_the_other():
    class Several(DynamicDraftSource):
        def propose_all(self, context, limit):
            return [[5, 6][:limit], [7]]

    class One(DynamicDraftSource):
        def propose(self, context, limit):
            return [9] * limit

    assert Several().propose(_context([1]), 1) == [5] and One().propose_all(_context([1]), 2) == [[9, 9]]
    with pytest.raises(TypeError, match="draft source Neither must define propose or propose_all"):

        class Neither(DynamicDraftSource):
            pass


def test_the_chain_proposes_what_its_candidates_begin_with():
    """``Sequence.propose`` (one proposal a pass) takes the first non-empty of what ``propose_candidates`` (a tree's
    candidates) lists: one walk of the chain serves both."""
    from bubblespec.core.interfaces import Draft
    from bubblespec.verify.sequence import ProposalSettings, Sequence

    settings = ProposalSettings(
        max_draft_tokens_per_step=4, draft_chain=(REQUEST_DRAFT, "group", "ngram"),
        proposers={"group": GroupProposer(min_n=1), "ngram": NGramProposer(max_n=2, min_n=1)}, draft_candidates=4,
    )  # fmt: skip
    params, firsts = SamplingParams(max_new_tokens=20), []
    for draft in ([1, 2, 3, 4, 5, 6], [1, 9, 9, 9], []):
        request = GenerationRequest((1, 2, 1), KEY, params, Draft(KEY, tuple(draft), 0) if draft else None)
        sequence = Sequence.admit(0, request, 32, 64, [0])
        sibling = Sequence.admit(1, GenerationRequest((1, 2, 1), KEY, params), 32, 64, [0])
        sequence.tokens, sibling.tokens = [1, 2, 3], [1, 2, 3, 8, 8]
        sequence.siblings, sequence.diverged = [sibling], draft == [1, 9, 9, 9]  # it left that draft at 9
        candidates = sequence.propose_candidates(settings)
        assert sequence.propose(settings) == candidates[0][1] and sequence.proposed_by == candidates[0][0]
        firsts.append(candidates[0][0])
    assert firsts == [REQUEST_DRAFT, "group", "group"]


def test_draft_chain_puts_the_request_draft_where_the_first_static_source_is():
    assert draft_chain(["bubble", "group", "ngram"]) == (REQUEST_DRAFT, "group", "ngram")
    assert draft_chain(["ngram", "history", "bubble"]) == ("ngram", REQUEST_DRAFT)
    assert draft_chain(["none"]) == ()


@pytest.mark.parametrize(
    "chain", [("ngram",), ("group",), ("suffix",), ("request", "group", "ngram"), ("ngram", "request", "suffix")]
)
def test_dynamic_sources_change_no_engine_output(tmp_path, chain):
    """float64, random weights: every chain gives plain decoding's tokens and logprobs, with and without a
    foreign request draft."""
    from bubblespec.backends.torch_engine import TorchEngine
    from tests.conftest import write_checkpoint

    path = write_checkpoint(tmp_path / "model", seed=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=40)
    prompts = [(1, 5, 6, 5, 6, 5), (1, 7, 8, 9), (1, 5, 6, 5, 6, 5)]
    requests = [GenerationRequest(prompt, RolloutKey(0, 1, f"p{i % 2}", i), params) for i, prompt in enumerate(prompts)]
    plain = TorchEngine.from_pretrained(str(path), dtype="float64", draft_chain=()).generate(requests)
    engine = TorchEngine.from_pretrained(
        str(path), dtype="float64", draft_chain=chain, draft_source_options={"ngram": {"min_n": 1}}
    )
    from bubblespec.core.interfaces import Draft

    foreign = [r.token_ids[::-1] for r in plain]  # a wrong draft, so that the chain falls back
    drafted = [
        GenerationRequest(r.prompt_token_ids, r.key, r.sampling, Draft(r.key, tuple(f), 0))
        for r, f in zip(requests, foreign, strict=True)
    ]
    for batch in (requests, drafted):
        out = engine.generate(batch)
        assert [o.token_ids for o in out] == [p.token_ids for p in plain]
        for o, p in zip(out, plain, strict=True):
            assert o.logprobs == pytest.approx(p.logprobs, abs=1e-9)
    if "ngram" in chain:  # prompt lookup with 1-grams always finds something to propose here
        assert sum(o.stats.verify_steps for o in engine.generate(requests)) > 0


def test_a_static_source_in_an_engine_chain_is_refused(tmp_path):
    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.core.errors import RequestError
    from tests.conftest import write_checkpoint

    path = write_checkpoint(tmp_path / "model")
    with pytest.raises(RequestError, match="not a dynamic source"):
        TorchEngine.from_pretrained(str(path), draft_chain=("history",))
    with pytest.raises(RequestError, match="draft source 'ngram' with options {'n': 3}"):
        TorchEngine.from_pretrained(str(path), draft_chain=("ngram",), draft_source_options={"ngram": {"n": 3}})


def test_prompt_grouped_sharding_keeps_every_sample_of_a_prompt_on_one_rank():
    from bubblespec.policies.sharding import PromptGrouped

    requests = [
        GenerationRequest((1,), RolloutKey(0, 1, f"p{p}", s), SamplingParams()) for p in range(5) for s in range(3)
    ]
    predicted = {r.key: 10 * (int(r.key.prompt_uid[1:]) + 1) for r in requests}
    shards = PromptGrouped().shard(requests, 2, predicted)
    assert sorted(r.key for shard in shards for r in shard) == sorted(r.key for r in requests)
    for shard in shards:
        uids = {r.key.prompt_uid for r in shard}
        assert sum(r.key.prompt_uid in uids for r in requests) == len(shard)
    # longest group first on the least loaded rank: p4 (150) | p3 (120), p2 (90) -> 210 | p1 (60) -> 210 | p0
    assert [sorted({r.key.prompt_uid for r in shard}) for shard in shards] == [["p0", "p1", "p4"], ["p2", "p3"]]


def test_a_dynamic_source_takes_over_when_the_request_draft_runs_out(tmp_path):
    from bubblespec.backends.torch_engine import TorchEngine
    from bubblespec.core.interfaces import Draft
    from tests.conftest import write_checkpoint

    path = write_checkpoint(tmp_path / "model", seed=5)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True)
    request = GenerationRequest((1, 5, 6, 7), RolloutKey(0, 1, "p", 0), params)
    (plain,) = TorchEngine.from_pretrained(str(path), dtype="float64").generate([request])
    half = Draft(request.key, tuple(plain.token_ids[:10]), 0)
    with_half = GenerationRequest(request.prompt_token_ids, request.key, params, half)
    settings = {"dtype": "float64", "draft_source_options": {"ngram": {"min_n": 1}}}
    (alone,) = TorchEngine.from_pretrained(str(path), **settings).generate([with_half])
    (chained,) = TorchEngine.from_pretrained(str(path), draft_chain=("request", "ngram"), **settings).generate(
        [with_half]
    )
    assert alone.token_ids == chained.token_ids == plain.token_ids
    assert alone.stats.draft_tokens_proposed == 10  # the draft alone: its 10 tokens, then plain decoding
    assert chained.stats.draft_tokens_proposed > 10 and chained.stats.verify_steps > alone.stats.verify_steps
    # accepted tokens by the source that proposed them: the request's 10, then what ngram got right
    assert alone.stats.accepted_by_source == {"request": 10}
    by_source = chained.stats.accepted_by_source
    assert by_source["request"] == 10 and sum(by_source.values()) == chained.stats.draft_tokens_accepted


def test_suffix_learns_from_the_responses_an_engine_made_before(tmp_path):
    """The torch engine shows every response that ends to the sources: a second call of the same keys finds them
    (a later step's responses that merge into earlier ones are the case that pays in a run) and passes far fewer
    times, with the same tokens; on the same rank only."""
    from bubblespec.backends.torch_engine import TorchEngine
    from tests.conftest import write_checkpoint

    path = write_checkpoint(tmp_path / "model", seed=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True)
    requests = [GenerationRequest((1, 5 + i, 6), RolloutKey(0, 1, f"p{i}", 0), params) for i in range(3)]
    engine = TorchEngine.from_pretrained(str(path), dtype="float64", draft_chain=("suffix",))
    first = engine.generate(requests)
    engine.select_rank(1)  # the virtual clock's one engine serving another rank: that rank has seen nothing
    other_rank = engine.generate(requests)
    engine.select_rank(0)
    again = engine.generate(requests)
    assert [r.token_ids for r in again] == [r.token_ids for r in other_rank] == [r.token_ids for r in first]
    assert sum(r.stats.decode_steps for r in again) < 0.5 * sum(r.stats.decode_steps for r in first)
    assert sum(r.stats.decode_steps for r in other_rank) == sum(r.stats.decode_steps for r in first)
