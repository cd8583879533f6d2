"""Token trees: several candidate continuations per sequence verified in one forward pass (bubblespec/verify/tree.py,
the torch engine's tree pass). Outputs must be plain keyed decoding's whatever the candidates; the right candidate,
wherever it stands in the tree, must be taken whole."""

from __future__ import annotations

import random

import pytest

from bubblespec.backends.torch_engine import TorchEngine
from bubblespec.core.interfaces import Draft, GenerationRequest, RolloutKey, SamplingParams
from bubblespec.verify.sequence import Sequence
from bubblespec.verify.tree import DraftTree


def test_candidates_share_their_prefixes_and_the_first_one_is_laid_out_in_order():
    tree = DraftTree.of([("request", [5, 6, 7]), ("group", [5, 6, 9, 9]), ("ngram", [8]), ("x", [5, 6])], budget=10)
    assert tree.tokens == [5, 6, 7, 9, 9, 8]
    assert tree.parents == [-1, 0, 1, 1, 3, -1]
    assert tree.depths == [1, 2, 3, 3, 4, 1]
    assert tree.owners == [0, 0, 0, 1, 1, 2]
    assert tree.path_tokens(4) == [5, 6, 9, 9]
    # [5, 6] is a prefix of the first candidate: it adds no node but is a candidate of its own
    assert [source for source, _ in tree.candidates] == ["request", "group", "ngram", "x"]


def test_the_budget_cuts_a_candidate_and_drops_those_after_it():
    tree = DraftTree.of([("a", [1, 2, 3]), ("b", [1, 4, 5, 6]), ("c", [7])], budget=4)
    assert tree.tokens == [1, 2, 3, 4]
    assert tree.candidates == [("a", [1, 2, 3]), ("b", [1, 4])]
    assert DraftTree.of([("a", [1, 2]), ("b", [1, 2])], budget=8).candidates == [("a", [1, 2])]


def test_the_accepted_path_follows_the_keyed_samples():
    tree = DraftTree.of([("a", [5, 6, 7]), ("b", [5, 6, 9, 9]), ("c", [8])], budget=10)
    # samples[0] after the last token, samples[1 + i] after node i
    assert tree.accept([5, 6, 9, 0, 3, 0, 0]) == [0, 1, 3]  # 5, 6 (shared), then 9: the second candidate
    assert tree.chosen([0, 1, 3]) == ("b", [5, 6, 9, 9])
    assert tree.accept([8, 0, 0, 0, 0, 0, 1]) == [5]
    assert tree.accept([4, 0, 0, 0, 0, 0, 0]) == [] and tree.chosen([]) == ("a", [5, 6, 7])


def _oracle(kind: str, plain: dict, rng: random.Random, vocab: int):
    """Sequence.propose_candidates replaced: candidates made from plain decoding's response (the truth)."""

    def wrong(token: int) -> int:
        return (token + 1 + rng.randrange(vocab - 1)) % vocab

    def propose_candidates(self: Sequence, settings) -> list[tuple[str, list[int]]]:
        limit = min(settings.max_draft_tokens_per_step, self.room - 1)
        truth = list(plain[self.request.key][len(self.tokens) : len(self.tokens) + limit])
        if limit <= 0 or not truth:
            return []
        cut = rng.randrange(len(truth))
        late = truth[:cut] + [wrong(truth[cut])] + truth[cut + 1 :]
        noise = [[rng.randrange(vocab) for _ in range(limit)] for _ in range(6)]
        candidates = {
            "agree": [late, truth],  # share a prefix, then branch where the first one is wrong
            "disagree": [late, [wrong(truth[0]), *truth[1:]], truth],
            "branch at the first token": [[wrong(truth[0]), *truth[1:]], truth],
            "exceed the budget": [*noise, truth],  # the truth is cut off or dropped
            "first is right": [truth, late],
        }[kind]
        return [(f"oracle-{i}", c) for i, c in enumerate(candidates)][: settings.draft_candidates]

    return propose_candidates


FAMILIES = {
    "llama": {"family": "llama"},
    "qwen2-window": {"family": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    "qwen3": {"family": "qwen3"},
    "mistral": {"family": "mistral", "sliding_window": 8},
}
KINDS = ["agree", "disagree", "branch at the first token", "exceed the budget", "first is right"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    from bubblespec.testing.random_checkpoints import write_random_checkpoint

    folder = tmp_path_factory.mktemp("trees")
    small = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    return {
        name: write_random_checkpoint(
            folder / name, vocab_size=32_000, intermediate_size=128, initializer_range=0.1, **small, **case, seed=i
        )
        for i, (name, case) in enumerate(FAMILIES.items())
    }


@pytest.mark.parametrize(
    ("family", "dtype", "sampling"),
    [
        ("llama", "float32", {"temperature": 1.0}),
        ("qwen2-window", "float32", {"temperature": 0.7, "top_k": 40, "top_p": 0.9}),
        ("qwen3", "bfloat16", {"temperature": 1.0}),
        ("mistral", "float64", {"temperature": 0.9, "repetition_penalty": 1.3, "min_p": 0.01}),
    ],
)
def test_any_candidates_give_plain_decodings_tokens_and_the_right_one_is_taken_whole(
    checkpoints, monkeypatch, family, dtype, sampling
):
    """32,000-token vocabulary, responses long enough to pass the windows of 8 (the tree's positions decide what a
    window sees); the repetition penalty depends on each node's own path. Whichever place the right candidate
    has in the tree, every pass takes it whole, so a response of L tokens takes about L / 8 passes (9 per pass
    at most); where the budget drops it, plain decoding's count. Each request runs alone (batch 1: the tail of a
    step, where a sequence gets the whole tree budget)."""
    path = str(checkpoints[family])
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, **sampling)
    rng = random.Random(0)
    requests = [
        GenerationRequest(
            tuple(rng.randrange(3, 32_000) for _ in range(5 + 3 * i)), RolloutKey(7, 1, f"p{i}", 0), params
        )
        for i in range(4)
    ]
    plain_engine = TorchEngine.from_pretrained(path, dtype=dtype, draft_chain=())
    plain = {r.key: r.token_ids for r in plain_engine.generate(requests)}
    logprobs = {r.key: r.logprobs for r in plain_engine.generate(requests)}
    engine = TorchEngine.from_pretrained(path, dtype=dtype, draft_candidates=3, max_draft_tokens_per_step=8)
    tolerance = 1e-9 if dtype == "float64" else 1e-4
    passes = []
    for kind in KINDS:
        monkeypatch.setattr(Sequence, "propose_candidates", _oracle(kind, plain, random.Random(1), 32_000))
        # together: one row has the whole tree, the others 8 tokens, which cut the candidates after the first
        together = engine.generate(requests)
        assert {r.key: r.token_ids for r in together} == plain, f"{kind}, batched"
        out = [result for request in requests for result in engine.generate([request])]  # each alone: a whole tree
        assert {r.key: r.token_ids for r in out} == plain, kind
        for result in [*out, *together]:
            assert result.logprobs == pytest.approx(logprobs[result.key], abs=tolerance), kind
        steps = sum(r.stats.decode_steps for r in out)
        passes.append(steps)
        if kind != "exceed the budget":
            assert steps <= sum(-(-40 // 9) + 1 for _ in requests), f"{kind}: {steps} decode steps"
            assert all(r.stats.draft_tokens_accepted > 30 for r in out), kind
    assert passes[KINDS.index("exceed the budget")] > 3 * passes[KINDS.index("first is right")]


def test_candidates_come_in_chain_order_distinct_the_diverged_draft_by_position_last():
    from bubblespec.core.draft_sources import ProposalContext
    from bubblespec.verify.sequence import ProposalSettings

    class Fixed:
        def __init__(self, *proposals):
            self.proposals = [list(p) for p in proposals]

        def propose_all(self, context: ProposalContext, limit: int) -> list[list[int]]:
            return self.proposals

    key = RolloutKey(0, 1, "p", 0)
    draft = Draft(key, (7, 8, 9, 10, 11, 12), 0)
    sequence = Sequence.admit(0, GenerationRequest((1, 2), key, SamplingParams(max_new_tokens=50), draft), 64, 256, [2])
    sequence.tokens = [7]
    proposers = {"a": Fixed([8, 9, 10, 11], [5]), "b": Fixed([5], [], [6, 6])}
    settings = ProposalSettings(3, draft_chain=("request", "a", "b"), proposers=proposers, draft_candidates=4)
    # the request's draft at its position; a's first, cut to 3, is the same; [5] only once; b's [6, 6]
    assert sequence.propose_candidates(settings) == [("request", [8, 9, 10]), ("a", [5]), ("b", [6, 6])]
    proposers["a"] = Fixed([9, 9], [5])
    sequence.diverged = True  # and the last tokens re-align nowhere: the draft by position comes last
    expected = [("a", [9, 9]), ("a", [5]), ("b", [6, 6]), ("request", [8, 9, 10])]
    assert sequence.propose_candidates(settings) == expected
    two = ProposalSettings(3, draft_chain=("request", "a", "b"), proposers=proposers, draft_candidates=2)
    assert sequence.propose_candidates(two) == expected[:2]


def test_the_tree_budget_goes_to_the_sequence_predicted_longest():
    from bubblespec.verify.sequence import ProposalSettings, tree_budgets

    params = SamplingParams(max_new_tokens=100)

    def sequence(draft_length: int, tokens: int) -> Sequence:
        key = RolloutKey(0, 1, f"p{draft_length}-{tokens}", 0)
        draft = Draft(key, tuple(range(3, 3 + draft_length)), 0) if draft_length else None
        made = Sequence.admit(0, GenerationRequest((1, 2), key, params, draft), 64, 256, [2])
        made.tokens = [5] * tokens
        return made

    batch = [sequence(10, 3), sequence(0, 40), sequence(30, 5)]
    settings = ProposalSettings(max_draft_tokens_per_step=8, draft_candidates=4)
    assert tree_budgets(batch, settings) == [8, 32, 8]  # 40 tokens so far beats a 30-token draft
    assert tree_budgets(batch[::2], settings) == [8, 32]
    assert tree_budgets(batch, ProposalSettings(max_draft_tokens_per_step=8)) == [8, 8, 8]


def test_a_tree_pass_is_charged_for_its_tokens_and_their_attention(checkpoints, monkeypatch):
    """What the virtual clock charges (ForwardPass): every tree token fed, each attending the context and its
    own ancestors only."""
    path = str(checkpoints["llama"])
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    request = GenerationRequest((5, 6, 7), RolloutKey(7, 1, "p", 0), params)

    def candidates(self: Sequence, settings):
        return [("a", [9, 9, 9]), ("b", [9, 8]), ("c", [4])] if len(self.tokens) == 1 else []

    monkeypatch.setattr(Sequence, "propose_candidates", candidates)
    seen = []
    TorchEngine.from_pretrained(path, draft_candidates=3).generate([request], on_forward=seen.append)
    second = seen[1]  # the prefill, then the pass that verified the tree after the first token
    assert second.num_tokens == 1 + 5  # the last token, then 9 9 9, 8 and 4
    last_token = 3 + 1  # the prompt's 3 cached positions and itself
    tree = sum(3 + 1 + depth for depth in (1, 2, 3, 2, 1))  # the context, the last token, its path in the tree
    assert second.attention_pairs == last_token + tree


def test_sources_verified_together_change_no_output_and_pass_fewer_times_than_a_chain(tmp_path):
    """The request's draft (wrong a third of the way in), sibling responses and prompt lookup: a tree of three
    candidates gives the chain's tokens in fewer passes. (A 40-token vocabulary, where a random model's responses
    repeat themselves and each other so that lookup and siblings have something to propose; the 32,000-token case
    is the test above.)"""
    from tests.conftest import write_checkpoint

    path = str(write_checkpoint(tmp_path / "model", seed=3))
    params = SamplingParams(temperature=1.0, max_new_tokens=40)
    prompts = [(1, 5, 6, 5, 6, 5), (1, 7, 8, 9)] * 2
    requests = [GenerationRequest(p, RolloutKey(0, 1, f"p{i % 2}", i), params) for i, p in enumerate(prompts)]
    plain = TorchEngine.from_pretrained(path, draft_chain=()).generate(requests)

    def changed(tokens):
        tokens = list(tokens)
        if tokens:
            tokens[len(tokens) // 3] = (tokens[len(tokens) // 3] + 1) % 40
        return tuple(tokens)

    drafted = [
        GenerationRequest(r.prompt_token_ids, r.key, r.sampling, Draft(r.key, changed(p.token_ids), 0))
        for r, p in zip(requests, plain, strict=True)
    ]
    settings = {"draft_chain": ("request", "group", "ngram"), "draft_source_options": {"ngram": {"min_n": 1}}}
    chain = TorchEngine.from_pretrained(path, **settings).generate(drafted)
    tree = TorchEngine.from_pretrained(path, draft_candidates=3, **settings).generate(drafted)
    assert [r.token_ids for r in tree] == [r.token_ids for r in chain] == [r.token_ids for r in plain]
    assert sum(r.stats.decode_steps for r in tree) < sum(r.stats.decode_steps for r in chain)
    assert sum(r.stats.draft_tokens_proposed for r in tree) > sum(r.stats.draft_tokens_proposed for r in chain)


def test_draft_candidates_reach_the_engine_only_where_set():
    from bubblespec.core.config import RunConfig
    from bubblespec.run.assembly import engine_settings

    config = RunConfig.model_validate({"speculation": {"draft_candidates": 4}})
    assert engine_settings(config, "m")["draft_candidates"] == 4
    assert "draft_candidates" not in engine_settings(RunConfig(), "m")
    with pytest.raises(ValueError, match="draft_candidates"):
        RunConfig.model_validate({"speculation": {"draft_candidates": 0}})


@pytest.mark.parametrize(
    ("speculation", "why"),
    [({"enabled": False}, "enabled is false"), ({"draft_sources": ["none"]}, r"draft_sources is \['none'\]")],
)
def test_draft_candidates_where_nothing_drafts_are_refused(speculation, why):
    from bubblespec.core.config import RunConfig

    with pytest.raises(ValueError, match=f"draft_candidates 3 verifies several drafts per pass, but nothing drafts "
                                         f"\\({why}\\); use 1"):  # fmt: skip
        RunConfig.model_validate({"speculation": speculation | {"draft_candidates": 3}})
    RunConfig.model_validate({"speculation": speculation | {"draft_candidates": 1}})


def test_batch_invariant_refuses_token_trees_before_anything_runs(tmp_path):
    """A tree stores a later candidate's keys after the earlier candidates' keys, so a token accepted from it is
    scored with keys summed in another order than a decode pass sums them: float32 logits 1e-8 off plain
    decoding's. ``batch_invariant`` promises bit-identity, so it refuses trees, from the run's config too."""
    from bubblespec.core.config import RunConfig
    from bubblespec.core.errors import ConfigError
    from bubblespec.run.assembly import checked_engine_settings

    with pytest.raises(ConfigError, match="batch_invariant verifies one candidate per pass, got draft_candidates 3"):
        TorchEngine.from_pretrained(str(tmp_path), batch_invariant=True, draft_candidates=3)
    config = RunConfig.model_validate({
        "speculation": {"draft_sources": ["bubble", "ngram"], "draft_candidates": 3},
        "rollout": {"engine_options": {"batch_invariant": True}},
    })  # fmt: skip
    with pytest.raises(ConfigError, match=r"draft_candidates 3 \(speculation.draft_candidates\)"):
        checked_engine_settings(config, str(tmp_path), TorchEngine)
