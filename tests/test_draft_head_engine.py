"""The torch engine drafting with a draft head (backends/torch_engine.py, bubblespec/models/draft_head.py): each
sequence keeps the policy's hidden states of its latest valid (hidden state, token) pairs, the head fills the room a
sequence's own proposal leaves in a pass, and verification decides every token, so the outputs are plain decoding's
whatever the head: untrained, trained on the policy's own samples, or trained on another policy's. Random checkpoints
at a 32,000-token vocabulary (Llama in float32, batch-invariant; Qwen3 in bfloat16), batches with padding (prompts of
1-12 tokens, responses of 6-28), stop tokens, the length limit, continuous batching, and request drafts that are
stale, truncated or wrong, under temperature 1, top-k with top-p, top-p alone and greedy."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from bubblespec.backends.torch_engine import TorchEngine
from bubblespec.core.draft_sources import DynamicDraftSource
from bubblespec.core.interfaces import (
    Draft,
    DraftBranch,
    GenerationRequest,
    GenerationResult,
    RolloutKey,
    SamplingParams,
)
from bubblespec.models.decoder import DecoderModel
from bubblespec.models.draft_head import DraftHead, DraftHeadTrainer, HeadBatch
from bubblespec.testing.conformance import write_policy_pair
from bubblespec.verify.sampling import keyed_sample

VOCAB = 32_000
WINDOW = 16
HEAD_TOKENS = 4
HEAD_SCALE = 200.0
"""The output head's rows of a random set of "common" tokens are scaled by this, so the policy's mass sits on a few
likely tokens (as a trained model's does): a head must then learn where it sits to be accepted."""
INIT_RANGE = 0.005
"""The checkpoints' initialiser standard deviation: small enough that the policy's last hidden state is mostly the
fed token's embedding, a function a one-layer head can learn in a few steps of a test."""
SETTINGS = [(1.0, 0, 1.0), (0.7, 40, 0.9), (1.0, 0, 0.9), (0.0, 0, 1.0)]
"""(temperature, top-k, top-p) of the requests in turn: plain, top-k with top-p, top-p, greedy."""
CASES = [("llama", "float32"), ("qwen3", "bfloat16")]
TRAINING_STEPS = 16


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{d}" for f, d in CASES])
def engines(request, tmp_path_factory):
    """(policy, other policy) engines of one case; the policy's batch holds at most 6 sequences (continuous
    batching over 10 requests)."""
    family, dtype = request.param
    # The policy (a peaked output head) and another policy one small random step away.
    newer, older = write_policy_pair(
        tmp_path_factory.mktemp(family), family, VOCAB, HEAD_SCALE, 0.05, initializer_range=INIT_RANGE
    )
    invariant = dtype == "float32"  # float32 verify passes round like decode passes: bit-identical outputs
    made = [
        TorchEngine.from_pretrained(str(path), dtype=dtype, batch_invariant=invariant, max_batch_size=size)
        for path, size in ((newer, 6), (older, 64))
    ]
    yield made
    for engine in made:
        engine.close()


def requests_of(seed: int, num: int = 10, **sampling) -> list[GenerationRequest]:
    """Prompts of 1-12 tokens, responses of 6-28 tokens, the sampling settings of :data:`SETTINGS` in turn."""
    rng = random.Random(seed)
    requests = []
    for i in range(num):
        temperature, top_k, top_p = SETTINGS[i % len(SETTINGS)]
        options = {"max_new_tokens": rng.randint(6, 28), "ignore_eos": True} | sampling
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, **options)
        prompt = tuple(rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12)))
        requests.append(GenerationRequest(prompt, RolloutKey(seed, 1, f"p{i}", i % 2), params))
    return requests


def hard_batch(policy: TorchEngine, other: TorchEngine, seed: int) -> list[GenerationRequest]:
    """:func:`requests_of` with two requests stopped by a token of their own response, and request drafts: the other
    policy's response (stale), half of the policy's own (truncated), random tokens (wrong)."""
    requests = requests_of(seed)
    first = policy.generate(requests)
    for i in (1, 2):
        stopped = dataclasses.replace(requests[i].sampling, stop_token_ids=(first[i].token_ids[3],))
        requests[i] = dataclasses.replace(requests[i], sampling=stopped)
    stale = other.generate(requests[3:4])[0].token_ids
    truncated = first[4].token_ids[: len(first[4].token_ids) // 2]
    wrong = [random.Random(seed).randrange(3, VOCAB) for _ in range(20)]
    for i, tokens in ((3, stale), (4, truncated), (5, wrong)):
        requests[i] = dataclasses.replace(requests[i], draft=Draft(requests[i].key, tuple(tokens), 0))
    return requests


def assert_same(plain: list[GenerationResult], other: list[GenerationResult], dtype: str) -> None:
    for expected, got in zip(plain, other, strict=True):
        assert got.token_ids == expected.token_ids, expected.key
        assert got.finish_reason == expected.finish_reason, expected.key
        # float32 batch-invariant passes give bit-identical logits; float64 tree passes round attention otherwise
        atol = {"float32": 0.0, "float64": 1e-12, "bfloat16": 1e-6}[dtype]
        torch.testing.assert_close(
            torch.tensor(got.logprobs, dtype=torch.float64), torch.tensor(expected.logprobs, dtype=torch.float64),
            rtol=0.0, atol=atol,
        )  # fmt: skip


def head_batch(model: DecoderModel, requests: list[GenerationRequest], results: list[GenerationResult]) -> HeadBatch:
    """The responses' (hidden state, token) pairs: the policy's last hidden states over prompt + response (one
    training forward pass), from the prompt's last position on."""
    rows = [[*r.prompt_token_ids, *x.token_ids] for r, x in zip(requests, results, strict=True)]
    tokens_BT = torch.nn.utils.rnn.pad_sequence([torch.tensor(row) for row in rows], batch_first=True)
    positions_BT = torch.arange(tokens_BT.shape[1])[None].expand(len(rows), -1)
    with torch.no_grad():
        _, hidden_BTH = model.forward(tokens_BT, positions_BT, return_hidden=True)
    starts = [len(r.prompt_token_ids) - 1 for r in requests]
    return HeadBatch.pad(
        [hidden_BTH[row, start : start + len(x.token_ids)] for row, (start, x) in enumerate(zip(starts, results,
                                                                                                 strict=True))],
        [torch.tensor(x.token_ids) for x in results],
        [r.sampling.temperature for r in requests],
    )  # fmt: skip


TRAINED: dict[str, dict[str, torch.Tensor]] = {}


def trained_head(engine: TorchEngine) -> dict[str, torch.Tensor]:
    """A head trained on ``engine``'s own samples (32 responses), from a warm start: ``fc`` passing the next token's
    embedding through and the layer's output projections zero, so that it starts as the policy's "bigram" (learning
    from nothing is tests/test_draft_head.py's); then :data:`TRAINING_STEPS` AdamW steps of 8 responses. One per
    checkpoint for the module."""
    if engine.config.model_path not in TRAINED:
        TRAINED[engine.config.model_path] = _train_head(engine)
    return TRAINED[engine.config.model_path]


def _train_head(engine: TorchEngine) -> dict[str, torch.Tensor]:
    requests = requests_of(1000, 32, max_new_tokens=24)
    batch = head_batch(engine.model, requests, engine.generate(requests))
    head = DraftHead(engine.model, seed=0, window=WINDOW)
    state, hidden = head.state_dict(), engine.model_config.hidden_size
    state["fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
    state["layer.self_attn.o_proj.weight"].zero_()
    state["layer.mlp.down_proj.weight"].zero_()
    head.load_state_dict(state)
    trainer = DraftHeadTrainer(head, learning_rate=1e-3)
    for step in range(TRAINING_STEPS):
        rows = slice(8 * step % 32, 8 * step % 32 + 8)
        trainer.step(HeadBatch(batch.hidden_BTH[rows], batch.tokens_BT[rows], batch.lengths_B[rows],
                               batch.temperature_B[rows]))  # fmt: skip
    return head.state_dict()


def totals(results: list[GenerationResult]) -> tuple[int, int, int]:
    """Decode steps, head tokens proposed, head tokens accepted, summed over the responses."""
    return (
        sum(r.stats.decode_steps for r in results),
        sum(r.stats.head_tokens_proposed for r in results),
        sum(r.stats.head_tokens_accepted for r in results),
    )


def test_any_head_leaves_the_outputs_of_plain_decoding_and_a_trained_one_saves_steps(engines):
    """The same outputs as plain decoding without a head (tokens, logprobs, finish reasons), with request drafts or
    without, for an untrained head, one trained on the policy's samples and one trained on the other policy's; the
    trained heads' tokens are accepted and save decode steps; removing the head gives plain decoding again."""
    policy, other = engines
    dtype = str(policy.model.dtype)[6:]
    requests = hard_batch(policy, other, seed=7)
    undrafted = [dataclasses.replace(r, draft=None) for r in requests]
    policy.set_draft_head(None)
    plain, plain_undrafted = policy.generate(requests), policy.generate(undrafted)
    assert {r.finish_reason for r in plain} == {"stop", "length"}
    assert totals(plain)[1:] == (0, 0)
    heads = {
        "untrained": DraftHead(policy.model, seed=5).state_dict(),
        "trained": trained_head(policy),
        "foreign": trained_head(other),
    }
    figures = {}
    for name, state in heads.items():
        policy.set_draft_head(state, window=WINDOW, max_tokens=HEAD_TOKENS)
        drafted, alone = policy.generate(requests), policy.generate(undrafted)
        assert_same(plain, drafted, dtype)
        assert_same(plain_undrafted, alone, dtype)
        figures[name] = totals(drafted), totals(alone)
        print(f"{name} head: (decode steps, head tokens proposed, accepted) with request drafts {totals(drafted)} "
              f"(plain {totals(plain)[0]}), without {totals(alone)} (plain {totals(plain_undrafted)[0]})")  # fmt: skip
    policy.set_draft_head(None)
    assert_same(plain, policy.generate(requests), dtype)

    for name in heads:
        assert all(proposed > 0 for (_, proposed, _) in figures[name]), name  # the head drafted in every run
    for name in ("trained", "foreign"):
        with_drafts, alone = figures[name]
        assert with_drafts[2] > 0 and alone[2] > 0, name
        assert with_drafts[0] < totals(plain)[0] and alone[0] < totals(plain_undrafted)[0], name
    # A random head's keyed samples agree with the policy's only by chance: a few tokens in hundreds.
    assert figures["untrained"][1][2] <= figures["untrained"][1][1] // 10


def tree_engine(policy: TorchEngine, chain: tuple[str, ...] = ("request", "ngram")) -> TorchEngine:
    """The policy in an engine that verifies token trees of up to 3 candidates (request draft and n-gram matches, in
    the order of ``chain``), in float64."""
    return TorchEngine.from_pretrained(
        policy.config.model_path, dtype="float64", draft_candidates=3, draft_chain=chain, max_batch_size=6
    )


def test_tree_passes_take_the_heads_proposal_and_change_no_output(engines):
    """Token-tree passes (float64, 3 candidates): an untrained and a trained head leave plain tree decoding's outputs
    (without a head), and the trained head's tokens, the tree's first candidate where a sequence has no other, are
    accepted and save steps."""
    policy, other = engines
    tree = tree_engine(policy)
    requests = hard_batch(tree, other, seed=9)
    plain = tree.generate(requests)
    figures = {}
    for name, state in (("untrained", DraftHead(tree.model, seed=5).state_dict()), ("trained", trained_head(policy))):
        tree.set_draft_head(state, window=WINDOW, max_tokens=HEAD_TOKENS)
        drafted = tree.generate(requests)
        assert_same(plain, drafted, "float64")
        figures[name] = totals(drafted)
        print(f"tree passes, {name} head: (decode steps, head tokens proposed, accepted) {figures[name]} "
              f"(plain {totals(plain)[0]})")  # fmt: skip
    assert figures["untrained"][1] > 0 and figures["untrained"][2] <= figures["untrained"][1] // 10
    assert figures["trained"][2] > 0 and figures["trained"][0] < totals(plain)[0]
    tree.close()


class Junk(DynamicDraftSource):
    """A dynamic source that always proposes two tokens, nearly always wrong."""

    def propose(self, context, limit: int) -> list[int]:
        return [3, 4][:limit]


@pytest.mark.parametrize("candidates", [1, 3], ids=["linear", "tree"])
def test_after_the_request_draft_the_head_proposes_before_the_dynamic_sources(engines, candidates):
    """``position="after-request"`` (float64, a chain of the request's draft and a dynamic source that always
    proposes): where the request's draft has nothing the trained head proposes first (in a tree, the first candidate,
    the source's after it); with ``last`` it never proposes, the source having proposed. Both leave plain decoding's
    outputs, and the head's accepted tokens are its source's."""
    policy, other = engines
    options = {"draft_candidates": candidates} if candidates > 1 else {}
    engine = TorchEngine.from_pretrained(
        policy.config.model_path, dtype="float64", draft_chain=("request", "ngram"), max_batch_size=6, **options
    )
    engine._proposal.proposers["ngram"] = Junk()  # in the chain's place of the n-gram matches
    requests = hard_batch(engine, other, seed=11)
    wrong = tuple(random.Random(11).randrange(3, VOCAB) for _ in range(64))  # longer than any response
    requests[5] = dataclasses.replace(requests[5], draft=Draft(requests[5].key, wrong, 0))
    plain = engine.generate(requests)
    figures = {}
    for position in ("last", "after-request"):
        engine.set_draft_head(trained_head(policy), window=WINDOW, max_tokens=HEAD_TOKENS, position=position)
        drafted = engine.generate(requests)
        assert_same(plain, drafted, "float64")
        figures[position] = totals(drafted)
        for x in drafted:
            assert x.stats.accepted_by_source.get("head", 0) == x.stats.head_tokens_accepted
    (_, last, _), (_, early, accepted) = figures["last"], figures["after-request"]
    assert last == 0 and early > 0 and accepted > 0, figures
    # request 5's draft is random tokens past its response's end: once it diverged, the head goes before its
    # proposals by position, in every pass after the first (which has no pairs yet)
    assert drafted[5].stats.head_tokens_proposed >= drafted[5].stats.decode_steps - 1 > 0
    with pytest.raises(ValueError, match="position must be 'last' or 'after-request'"):
        engine.set_draft_head(trained_head(policy), position="first")
    engine.close()


@pytest.mark.parametrize("passes", ["linear", "tree"])
def test_a_sequences_pairs_are_the_policys_hidden_states_of_its_response(engines, passes):
    """What the head reads at each drafting call is the policy's own last hidden state at every response position
    so far (the prompt's last position first) paired with the token sampled there: the latest ``window`` of them,
    the rejected draft tokens' dropped (in a tree pass: all but the accepted path's), as a training pass over prompt
    + response computes them (to rounding). Two requests carry a wrong draft of 7 tokens: the head proposes for them
    only once the draft has nothing left to propose (the draft chain's first source that proposes wins). In tree
    passes the others' drafts are tries whose path is wrong at response position 2
    and whose branch there holds the response's next 4 tokens: the accepted path runs through the second candidate's
    nodes."""
    policy = engines[0] if passes == "linear" else tree_engine(engines[0])
    requests = requests_of(11, 6)
    own = policy.generate(requests) if passes == "tree" else []
    for i, response in enumerate(own):
        tokens = response.token_ids
        wrong = next(t for t in range(100, 110) if t != tokens[2])
        trie = Draft(requests[i].key, (*tokens[:2], wrong), 0, branches=(DraftBranch(2, tuple(tokens[2:6])),))
        requests[i] = dataclasses.replace(requests[i], draft=trie)
    for i in (0, 3):
        requests[i] = dataclasses.replace(requests[i], draft=Draft(requests[i].key, tuple(range(100, 107)), 0))
    policy.set_draft_head(DraftHead(policy.model, seed=5).state_dict(), window=WINDOW, max_tokens=HEAD_TOKENS)
    calls, continued = [], []
    drafting = policy.draft_head.draft

    def recording(hidden_BTH, tokens_BT, lengths_B, first_positions_B, num_tokens, sample, **options):
        calls.append((hidden_BTH.clone(), tokens_BT.clone(), lengths_B.clone(), first_positions_B.clone()))
        continued.extend(len(tokens) for tokens in options.get("given") or [])
        return drafting(hidden_BTH, tokens_BT, lengths_B, first_positions_B, num_tokens, sample, **options)

    policy.draft_head.draft = recording
    results = policy.generate(requests)
    policy.set_draft_head(None)
    reference = head_batch(policy.model, requests, results)
    checked = 0
    scale = float(reference.hidden_BTH.float().abs().max())
    tolerance = 2.0**-6 if policy.model.dtype == torch.bfloat16 else 1e-5
    for hidden_BTH, tokens_BT, lengths_B, first_positions_B in calls:
        for row in range(len(lengths_B)):
            length, first = int(lengths_B[row]), int(first_positions_B[row])
            # The row's response: the one whose tokens before position `first` end with the row's tokens.
            row_tokens = tokens_BT[row, :length].tolist()
            matches = [b for b, r in enumerate(results) if r.token_ids[max(0, first - WINDOW) : first] == row_tokens]
            assert matches, (row, first)
            b = matches[0]
            assert length == min(first, WINDOW)
            expected_TH = reference.hidden_BTH[b, first - length : first]
            torch.testing.assert_close(
                hidden_BTH[row, :length].float(), expected_TH.float(), rtol=0.0, atol=tolerance * scale
            )
            checked += 1
    assert checked > 20
    assert calls and not any(continued), "the head proposes only where a sequence's own proposal is empty"
    if passes == "tree":
        assert sum(r.stats.branches_followed for r in results) >= 3
        policy.close()


def test_the_head_continues_a_given_proposal():
    """``DraftHead.draft(given=...)``: a row's given tokens are its first draft tokens and the head reads them as
    its own (giving it its own draft changes no bit); after them it drafts keyed samples of its logits, as a loop
    over the head's whole-row forward pass fed the context, its outputs and the given tokens computes them."""
    generator = torch.Generator().manual_seed(0)
    hidden_BTH = 0.3 * torch.randn(3, 10, 128, generator=generator)
    tokens_BT = torch.randint(3, VOCAB, (3, 10), generator=generator)
    lengths_B = torch.tensor([10, 4, 7])
    seeds_B2 = torch.tensor([[1, 2], [3, 4], [5, 6]])
    temperature_B, top_k_B, top_p_B = (torch.tensor([1.0, 0.7, 1.0], dtype=torch.float64), torch.tensor([0, 40, 0]),
                                       torch.tensor([1.0, 0.9, 0.9], dtype=torch.float64))  # fmt: skip

    def sample(logits_B1V, positions_B1, rows=slice(None)):
        return keyed_sample(logits_B1V, seeds_B2[rows], positions_B1, temperature_B[rows], top_k_B[rows],
                            top_p_B[rows])[0]  # fmt: skip

    policy = policy_model()
    head = DraftHead(policy, seed=2, window=8)
    own_BN = head.draft(hidden_BTH, tokens_BT, lengths_B, lengths_B, 5, sample)
    given = [own_BN[0, :3].tolist(), [], own_BN[2, :5].tolist()]
    assert torch.equal(head.draft(hidden_BTH, tokens_BT, lengths_B, lengths_B, 5, sample, given=given), own_BN)

    given = [[11, 12], [13, 14, 15], []]
    drafted_BN = head.draft(hidden_BTH, tokens_BT, lengths_B, lengths_B, 5, sample, given=given)
    for row, tokens in enumerate(given):
        assert drafted_BN[row, : len(tokens)].tolist() == tokens
        length = int(lengths_B[row])
        context_TH, context_T = hidden_BTH[row, :length], tokens_BT[row, :length]
        with torch.no_grad():
            for step in range(5):
                output_H = head.forward(context_TH[None], context_T[None])[0, -1]
                logits_11V = head.logits(output_H)[None, None]
                sampled = int(sample(logits_11V, torch.tensor([[length + step]]), slice(row, row + 1)))
                token = tokens[step] if step < len(tokens) else sampled
                assert int(drafted_BN[row, step]) == token, (row, step)
                context_TH = torch.cat([context_TH, output_H[None]])
                context_T = torch.cat([context_T, torch.tensor([token])])
    with pytest.raises(ValueError, match="given needs one row of at most 5 tokens"):
        head.draft(hidden_BTH, tokens_BT, lengths_B, lengths_B, 5, sample, given=[[1] * 6, [], []])


def policy_model() -> DecoderModel:
    """A small random Llama policy in float32 (no checkpoint on disk)."""
    from bubblespec.models.decoder import DecoderConfig

    config = DecoderConfig.from_hf(
        {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 128, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
         "tie_word_embeddings": False, "rope_theta": 1e4, "max_position_embeddings": 256},
        "llama",
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    weights = {
        name: torch.ones(shape) if len(shape) == 1 else 0.05 * torch.randn(shape, generator=generator)
        for name, shape in config.parameter_shapes().items()
    }
    return DecoderModel(config, weights, torch.float32, "cpu")


def test_setting_a_head_is_checked_and_none_removes_it(engines):
    """A head's state must fit the engine's model; ``max_tokens`` is a positive count; None removes the head (no
    head tokens afterwards)."""
    policy, _ = engines
    state = DraftHead(policy.model, seed=1).state_dict()
    with pytest.raises(ValueError, match="draft head state does not fit"):
        policy.set_draft_head({**state, "fc.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="max_tokens must be a positive number"):
        policy.set_draft_head(state, max_tokens=0)
    policy.set_draft_head(state, window=WINDOW)
    assert policy.draft_head is not None and policy.draft_head.window == WINDOW
    requests = requests_of(3, 4)
    assert totals(policy.generate(requests))[1] > 0
    policy.set_draft_head(None)
    assert policy.draft_head is None and totals(policy.generate(requests))[1:] == (0, 0)
