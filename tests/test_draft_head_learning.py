"""A draft head learned online by the torch engine (``TorchEngine.learn_draft_head``, docs/design.md §14): from the
responses of the policy it holds, it learns and drafts from the next generate on, changing no output; its state
resumes learning exactly; with nothing to learn from it installs no head. A random Llama checkpoint at a 32,000-token
vocabulary in float64 (outputs bit-identical with and without drafts) and in bfloat16, prompts of 1-10 tokens,
responses of 4-24 tokens, temperature 1, top-k with top-p, and greedy."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from bubblespec.backends.torch_engine import TorchEngine
from bubblespec.core.interfaces import Draft, DraftBranch, GenerationRequest, RolloutKey, SamplingParams
from bubblespec.models.draft_head import PROBE_EVERY, HeadLearning, HeadSizing, drafting_call_counts
from bubblespec.testing.random_checkpoints import write_random_checkpoint

VOCAB = 32_000
LEARNING = HeadLearning(window=8, max_tokens=3, learning_rate=3e-3, steps=4, rows_per_step=3)
SETTINGS = [(1.0, 0, 1.0), (0.8, 50, 0.9), (0.0, 0, 1.0)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(write_random_checkpoint(tmp_path_factory.mktemp("head") / "llama", "llama", vocab_size=VOCAB))


def requests_of(seed: int, num: int = 6) -> list[GenerationRequest]:
    rng = random.Random(seed)
    requests = []
    for i in range(num):
        temperature, top_k, top_p = SETTINGS[i % len(SETTINGS)]
        sampling = SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=rng.randint(4, 24), ignore_eos=True
        )
        prompt = tuple(rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 10)))
        requests.append(GenerationRequest(prompt, RolloutKey(seed, 1, f"p{i}", 0), sampling))
    return requests


def samples_of(requests, results):
    return [(r.prompt_token_ids, x.token_ids, r.sampling.temperature) for r, x in zip(requests, results, strict=True)]


def assert_same_state(a: dict, b: dict) -> None:
    assert a["head"].keys() == b["head"].keys()
    assert all(torch.equal(a["head"][name], b["head"][name]) for name in a["head"])
    assert a["sizing"] == b["sizing"]
    moments_a, moments_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert moments_a.keys() == moments_b.keys()
    for index, moments in moments_a.items():
        assert all(torch.equal(value, moments_b[index][name]) for name, value in moments.items())


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_a_head_learned_online_drafts_without_changing_outputs(checkpoint, dtype):
    engine = TorchEngine.from_pretrained(checkpoint, dtype=dtype)
    requests = requests_of(1)
    plain = engine.generate(requests)
    report = engine.learn_draft_head(samples_of(requests, plain), LEARNING)
    assert report.responses == len(requests) and report.pairs == sum(len(x.token_ids) for x in plain)
    assert report.steps == LEARNING.steps and report.first_loss is not None and report.final_loss is not None
    # each step trains 3 responses in turn, cut to their own lengths
    lengths = [len(x.token_ids) for x in plain]
    assert report.trained_pairs == sum(lengths[(s * 3 + i) % 6] for s in range(4) for i in range(3))
    assert [p.num_sequences for p in report.hidden_passes] == [4, 2]  # 4 responses a pass
    fed = [len(r.prompt_token_ids) + len(x.token_ids) for r, x in zip(requests, plain, strict=True)]
    assert [p.num_tokens for p in report.hidden_passes] == [sum(fed[:4]), sum(fed[4:])]
    assert sum(p.attention_pairs for p in report.hidden_passes) == sum(n * (n + 1) // 2 for n in fed)
    assert engine.draft_head is not None
    later = requests_of(2)
    without = TorchEngine.from_pretrained(checkpoint, dtype=dtype).generate(later)
    with_head = engine.generate(later)
    if dtype == "float64":
        assert [x.token_ids for x in with_head] == [x.token_ids for x in without]
    else:  # bfloat16: a verify pass may round a near-tie otherwise (docs/design.md §3.2)
        assert sum(x.token_ids != y.token_ids for x, y in zip(with_head, without, strict=True)) <= 1
    proposed = sum(x.stats.head_tokens_proposed for x in with_head)
    assert proposed > 0 and proposed <= sum(x.stats.draft_tokens_proposed for x in with_head)
    for x in with_head:  # the head's accepted tokens are its source's
        assert x.stats.accepted_by_source.get("head", 0) == x.stats.head_tokens_accepted
        assert sum(x.stats.accepted_by_source.values()) == x.stats.draft_tokens_accepted
    assert all(x.stats.head_tokens_accepted <= x.stats.head_tokens_proposed for x in with_head)


def test_online_learning_resumes_exactly_from_its_state(checkpoint):
    """Two rounds in one engine equal one round, the state saved and loaded into a fresh engine, then the second
    round there: the same losses, parameters, optimizer moments, measured acceptance and drafts."""
    first, second = requests_of(3), requests_of(4)
    engine = TorchEngine.from_pretrained(checkpoint, dtype="float64")
    engine.learn_draft_head(samples_of(first, engine.generate(first)), LEARNING)
    saved = engine.draft_head_state()
    round_two = samples_of(second, engine.generate(second))
    whole = engine.learn_draft_head(round_two, LEARNING)

    resumed = TorchEngine.from_pretrained(checkpoint, dtype="float64")
    resumed.load_draft_head_state(saved, LEARNING)
    assert samples_of(second, resumed.generate(second)) == round_two  # its measured acceptance grows alike
    again = resumed.learn_draft_head(round_two, LEARNING)
    assert (again.first_loss, again.final_loss) == (whole.first_loss, whole.final_loss)
    assert_same_state(resumed.draft_head_state(), engine.draft_head_state())
    later = requests_of(5)
    assert [x.stats.head_tokens_proposed for x in resumed.generate(later)] == [
        x.stats.head_tokens_proposed for x in engine.generate(later)
    ]

    resumed.load_draft_head_state(None, LEARNING)  # a checkpoint without a head: learning starts from nothing
    assert resumed.draft_head is None and resumed.draft_head_state() is None


def test_a_paused_head_drafts_nothing_until_its_next_round_and_its_pause_resumes(checkpoint):
    """``pause_draft_head`` (``draft_head.enabled: auto``): no head token until the next round of learning, which
    goes on from the paused head's state; a checkpoint of a paused head loads paused."""
    first, later = requests_of(13), requests_of(14)
    engine = TorchEngine.from_pretrained(checkpoint, dtype="float64")
    samples = samples_of(first, engine.generate(first))
    engine.learn_draft_head(samples, LEARNING)
    engine.pause_draft_head()
    assert engine.draft_head is None and sum(x.stats.head_tokens_proposed for x in engine.generate(later)) == 0
    saved = engine.draft_head_state()
    assert saved["paused"] is True
    resumed = TorchEngine.from_pretrained(checkpoint, dtype="float64")
    resumed.load_draft_head_state(saved, LEARNING)
    assert resumed.draft_head is None
    for each in (engine, resumed):
        each.learn_draft_head(samples, LEARNING)  # the second round, from the paused head's state
        assert each.draft_head is not None and each.draft_head_state()["paused"] is False
    assert_same_state(resumed.draft_head_state(), engine.draft_head_state())
    assert sum(x.stats.head_tokens_proposed for x in engine.generate(later)) > 0


def test_the_configs_position_reaches_the_learned_head(checkpoint):
    """``speculation.draft_head.position`` through the run's ``HeadLearning`` to the engine: with ``after-request``
    the learned head proposes where the request has no draft though a dynamic source always proposes (one that
    proposes two tokens, nearly always wrong, in n-gram's place); with ``last`` it never does."""
    from bubblespec.core.config import validate
    from bubblespec.core.draft_sources import DynamicDraftSource
    from bubblespec.rollout.service import head_learning

    class Junk(DynamicDraftSource):
        def propose(self, context, limit: int) -> list[int]:
            return [3, 4][:limit]

    requests = requests_of(15)
    proposed = {}
    for position in ("last", "after-request"):
        head = {"enabled": True, "sizing": "fixed", "max_tokens": 3, "position": position}
        learning = head_learning(validate({"speculation": {"draft_head": head}}).speculation, ranks=None)
        assert learning.position == position
        engine = TorchEngine.from_pretrained(checkpoint, dtype="float64", draft_chain=("request", "ngram"))
        engine._proposal.proposers["ngram"] = Junk()
        engine.learn_draft_head(samples_of(requests, engine.generate(requests)), learning)
        proposed[position] = sum(x.stats.head_tokens_proposed for x in engine.generate(requests))
    assert proposed["last"] == 0 and proposed["after-request"] > 0, proposed


def test_the_head_drafts_only_in_passes_of_at_most_its_live_sequences(checkpoint):
    """``speculation.draft_head.max_live_sequences`` through the run's ``HeadLearning`` to the engine: the head
    proposes (and its call is reported) only in passes of at most that many sequences, the tail of a batch of
    responses of 4-24 tokens; without it, in fuller passes too; the outputs are those without a head either way."""
    from bubblespec.core.config import validate
    from bubblespec.rollout.service import head_learning

    requests, later = requests_of(16), requests_of(17)
    plain = [x.token_ids for x in TorchEngine.from_pretrained(checkpoint, dtype="float64").generate(later)]
    batches = {}
    for live in (None, 3):
        head = {"enabled": True, "sizing": "fixed", "max_tokens": 3, "max_live_sequences": live}
        learning = head_learning(validate({"speculation": {"draft_head": head}}).speculation, ranks=None)
        assert learning.max_live_sequences == live
        engine = TorchEngine.from_pretrained(checkpoint, dtype="float64")
        engine.learn_draft_head(samples_of(requests, engine.generate(requests)), learning)
        passes = []
        results = engine.generate(later, on_forward=passes.append)
        assert [x.token_ids for x in results] == plain
        assert 0 < sum(x.stats.head_tokens_proposed for x in results) <= sum(p.head_tokens for p in passes)
        batches[live] = {p.num_sequences for p in passes if p.head_steps}
    assert max(batches[None]) > 3 and max(batches[3]) <= 3, batches


def test_nothing_to_learn_from_installs_no_head(checkpoint):
    engine = TorchEngine.from_pretrained(checkpoint, dtype="float64")
    requests = requests_of(6, num=2)
    report = engine.learn_draft_head([(r.prompt_token_ids, (), 1.0) for r in requests], LEARNING)
    assert (report.responses, report.pairs, report.steps) == (0, 0, 0)
    assert engine.draft_head is None and engine.draft_head_state() is None


def test_a_head_call_is_reported_with_the_pass_after_it(checkpoint):
    """Each pass whose proposals the head extended reports the head call's steps, tokens, context and sampled
    logits (what the virtual clock charges, :meth:`CostProfile.head_seconds`); a pass without one reports none."""
    from bubblespec.rollout.clocks import PROFILES

    engine = TorchEngine.from_pretrained(checkpoint, dtype="float64")
    requests = requests_of(7)
    engine.learn_draft_head(samples_of(requests, engine.generate(requests)), LEARNING)
    passes = []
    results = engine.generate(requests_of(8), on_forward=passes.append)
    with_head = [p for p in passes if p.head_steps]
    assert with_head and passes[0].head_steps == 0  # the first pass (prompts) has no pairs yet
    assert all(1 <= p.head_steps <= LEARNING.max_tokens for p in with_head)
    assert all(p.head_tokens >= p.head_steps and p.head_tokens % p.head_steps == 0 for p in with_head)
    assert all(p.head_sampled_logits % VOCAB == 0 and p.head_sampled_logits > 0 for p in with_head)
    assert sum(p.head_tokens for p in passes) >= sum(x.stats.head_tokens_proposed for x in results)
    assert all(p.head_context_pairs <= (LEARNING.window - 1) * p.head_tokens // p.head_steps for p in with_head)
    profile = PROFILES["h100-7b"]
    assert all(profile.head_seconds(p) > 0 for p in with_head)
    assert all(profile.head_seconds(p) == 0 for p in passes if not p.head_steps)


def test_the_head_proposes_what_its_measured_acceptance_pays_for():
    """k tokens where a^k >= the step's cost in passes: 3 at a = 0.5 and cost 0.123; none where a <= cost, but one
    every PROBE_EVERY passes; max_tokens where the cost is not known."""
    assert [HeadSizing(6, None).tokens() for _ in range(3)] == [6, 6, 6]
    sizing = HeadSizing(6, 0.123)
    assert sizing.acceptance == 0.5 and sizing.tokens() == 3
    sizing.observe(accepted=0, rejected=True)
    sizing.observe(accepted=0, rejected=True)  # a = 1/4: one token (0.25 >= 0.123 > 0.0625)
    assert sizing.tokens() == 1
    for _ in range(10):
        sizing.observe(accepted=0, rejected=True)  # a = 1/14 < 0.123: none, but a probe every 16 passes
    proposals = [sizing.tokens() for _ in range(3 * PROBE_EVERY)]
    assert sum(proposals) == 3 and set(proposals) == {0, 1}
    sizing.new_round()  # a new round of learning halves the evidence
    assert (sizing.accepted, sizing.rejected) == (0.0, 6.0)
    sizing.observe(accepted=60, rejected=False)  # a = 61/68: log(0.123) / log(0.897) = 19.2, capped at 6
    assert sizing.tokens() == 6


def test_a_head_that_is_not_accepted_stops_proposing(checkpoint):
    """An untrained head over a random policy is almost never accepted: at a step cost of 0.45 passes it soon
    proposes only its probes, and the outputs stay plain decoding's."""
    engine = TorchEngine.from_pretrained(checkpoint, dtype="float64")
    requests = requests_of(9)
    plain = engine.generate(requests)
    engine.learn_draft_head(samples_of(requests, plain), HeadLearning(window=8, max_tokens=3, steps=1, step_cost=0.45))
    passes = []
    results = engine.generate(requests, on_forward=passes.append)
    assert [x.token_ids for x in results] == [x.token_ids for x in plain]
    calls = [p.head_steps for p in passes]
    assert calls[:2] == [0, 1]  # the prompts' pass has no pairs; then a = 0.5 pays one token (0.5 >= 0.45 > 0.25)
    assert engine._head_sizing.rejected > 0 and calls.count(0) > len(calls) // 2, calls


def test_a_drafting_calls_counts_by_hand():
    """Two rows: 3 pairs with one token given, 70 pairs (64 read) with none; two steps at window 64, vocabulary 10."""
    counts = drafting_call_counts([3, 70], [1, 0], num_tokens=2, window=64, vocab_size=10)
    assert counts == {
        "head_steps": 2,
        "head_tokens": 4,
        "head_context_pairs": 2 + 63,
        "head_attention_pairs": (3 + 4) + (64 + 64),
        "head_sampled_logits": 2 * 2 * 10,  # some row samples at both steps
    }
    assert drafting_call_counts([5], [2], 2, 64, 10)["head_sampled_logits"] == 0  # every token given


def _learned(pool, *args, **kwargs) -> tuple:
    """A round of ``pool``'s head learning (``learn_head``, then ``learned_head``): its seconds, start and report."""
    pool.learn_head(*args, **kwargs)
    learned = pool.learned_head()
    return learned.seconds, learned.started, learned.report


def test_a_round_learns_from_fewer_responses_where_all_of_them_do_not_fit_its_budget(checkpoint):
    """The virtual pool fits a round in its budget (the last training phase's seconds): of all the responses, the
    first half, and so on down to one step's, the set with the most AdamW steps that fit after its hidden-state
    passes, the most responses among those (h100-7b: a pass reads the 7B weights, a head step costs about a
    millisecond)."""
    from bubblespec.models.draft_head import hidden_passes, trained_pairs_by_step
    from bubblespec.rollout.clocks import PROFILES
    from bubblespec.rollout.virtual_ranks import VirtualRankPool

    engine = TorchEngine.from_pretrained(checkpoint, dtype="float64")
    pool = VirtualRankPool(engine, 2, PROFILES["h100-7b"])
    requests = requests_of(10, num=12)
    samples = samples_of(requests, engine.generate(requests))
    learning = HeadLearning(window=8, steps=4, rows_per_step=3)

    def cost(kept, steps: int) -> float:
        passes = sum(pool.profile.forward_seconds(p) for p in hidden_passes(kept))
        pairs = sum(trained_pairs_by_step([len(r) for _, r, _ in kept], steps, 3))
        return passes + pool.profile.head_learning_seconds(pairs, steps, 8)

    budget = cost(samples[:6], 2)
    # all 12: not one step; the first 6: 2 steps; the first 3: all 4 steps
    assert cost(samples, 1) > budget and cost(samples[:6], 3) > budget and cost(samples[:3], 4) <= budget
    seconds, started, report = _learned(pool, samples, learning, budget=budget)
    assert (report.responses, report.steps) == (3, 4) and started == 0.0
    assert seconds == pytest.approx(cost(samples[:3], 4))
    budget = cost(samples[:6], 4)  # 6 and 3 responses both take every step: the 6
    assert cost(samples, 1) > budget
    seconds, _, report = _learned(pool, samples, learning, budget=budget)
    assert (report.responses, report.steps) == (6, 4) and seconds == pytest.approx(budget)
    seconds, _, report = _learned(pool, samples, learning, budget=None)  # no budget: every response, every step
    assert (report.responses, report.steps) == (12, 4) and seconds == pytest.approx(cost(samples, 4))
    seconds, _, report = _learned(pool, samples, learning, budget=budget / 100)  # not even one step of 3
    assert (seconds, report.steps) == (0.0, 0)


@pytest.mark.parametrize("candidates", [1, 3])
def test_the_hidden_states_a_rollout_keeps_are_the_ones_a_pass_computes_again(checkpoint, candidates):
    """With ``keep_hidden`` the engine keeps every finished response's hidden states as it generates, over linear
    and token-tree passes with drafts (some accepted, some not; a branch taken, in a tree off its first candidate),
    responses begun with a prefix and padded batches:
    one row per token, those a pass over prompt + response computes (float64), so learning from them runs no pass;
    a weight update drops them, a round uses them up."""
    from bubblespec.models.draft_head import hidden_pairs, sample_key

    options = {"max_draft_tokens_per_step": 4} | ({"draft_candidates": candidates} if candidates > 1 else {})
    engine = TorchEngine.from_pretrained(checkpoint, dtype="float64", **options)
    requests = requests_of(11, num=6)
    plain = TorchEngine.from_pretrained(checkpoint, dtype="float64").generate(requests)
    drafted = []
    for i, (request, result) in enumerate(zip(requests, plain, strict=True)):
        tokens = list(result.token_ids)
        if i % 3 == 0:  # right for a while, then wrong
            draft = tokens[: len(tokens) // 2] + [(t + 1) % VOCAB for t in tokens[len(tokens) // 2 :]]
            request = dataclasses.replace(request, draft=Draft(request.key, tuple(draft), 0))
        elif i % 3 == 1:  # begun with a prefix of the response
            request = dataclasses.replace(request, response_prefix=tuple(tokens[:3]))
        else:  # wrong from its middle on, with a branch there that is right: a tree accepts the branch's nodes
            k = len(tokens) // 2
            path = (*tokens[:k], (tokens[k] + 1) % VOCAB, *tokens[k + 1 :])
            branch = DraftBranch(k, tuple(tokens[k:]))
            request = dataclasses.replace(request, draft=Draft(request.key, path, 0, branches=(branch,)))
        drafted.append(request)
    engine.keep_hidden = True
    results = engine.generate(drafted)
    assert [x.token_ids for x in results] == [x.token_ids for x in plain]
    accepted = sum(x.stats.draft_tokens_accepted for x in results)
    assert 0 < accepted < sum(x.stats.draft_tokens_proposed for x in results)
    assert all(x.stats.branches_followed == 1 for x in results[2::3])
    samples = samples_of(requests, results)
    assert engine.hidden_kept(samples) == [True] * len(samples)
    expected = hidden_pairs(engine.model, samples)
    for row, sample in enumerate(samples):
        kept = engine._kept[sample_key(sample)]
        length = len(sample[1])
        assert kept.shape == (length, expected.hidden_BTH.shape[-1])
        torch.testing.assert_close(kept, expected.hidden_BTH[row, :length], rtol=1e-9, atol=1e-9)
    report = engine.learn_draft_head(samples, LEARNING)
    assert report.kept_responses == len(samples) and report.hidden_passes == ()
    assert engine.hidden_kept(samples) == [False] * len(samples)  # used up
    engine.generate(drafted)
    engine.update_weights({}, version=1)  # another policy: its hidden states are not these
    assert engine.hidden_kept(samples) == [False] * len(samples)
    engine.keep_hidden = False
    engine.generate(drafted)
    assert engine.hidden_kept(samples) == [False] * len(samples)


def test_a_head_learned_from_kept_hidden_states_is_the_one_learned_from_passes(checkpoint):
    """Learning from the hidden states the rollout kept gives the head that learning from the policy's passes over
    the same responses gives (float64, to rounding), and the virtual pool charges no pass for them: the learning
    rank's responses come first, then the others'."""
    from bubblespec.rollout.clocks import PROFILES
    from bubblespec.rollout.virtual_ranks import VirtualRankPool

    requests = requests_of(12)
    recomputing = TorchEngine.from_pretrained(checkpoint, dtype="float64")
    samples = samples_of(requests, recomputing.generate(requests))
    recomputing.learn_draft_head(samples, LEARNING)
    keeping = TorchEngine.from_pretrained(checkpoint, dtype="float64")
    keeping.keep_hidden = True
    keeping.generate(requests)
    report = keeping.learn_draft_head(samples, LEARNING)
    assert report.kept_responses == len(samples)
    a, b = recomputing.draft_head_state()["head"], keeping.draft_head_state()["head"]
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-7, atol=1e-9)

    engine = TorchEngine.from_pretrained(checkpoint, dtype="float64")
    pool = VirtualRankPool(engine, 2, PROFILES["h100-7b"])
    pool.keep_hidden_states(True)
    engine.keep_hidden = True
    engine.generate(requests[:2])  # as the learning rank: its own two responses
    engine.keep_hidden = False
    seconds, _, report = _learned(pool, samples, LEARNING)
    assert report.kept_responses == 2 and report.responses == len(samples)
    assert [p.num_sequences for p in report.hidden_passes] == [4]  # the other four
    passes = sum(pool.profile.forward_seconds(p) for p in report.hidden_passes)
    charged = pool.profile.head_learning_seconds(report.trained_pairs, report.steps, LEARNING.window)
    assert seconds == pytest.approx(passes + charged)


def test_a_step_record_of_a_round_that_took_no_step_reads_back():
    """A round that did not fit its budget has no losses: the step record leaves them out and still reads back."""
    from bubblespec.observe.records import StepRecord
    from bubblespec.rollout.step import HeadLearningRecord
    from tests.step_records import step_record

    record = step_record(0, draft_head=HeadLearningRecord(7, 0, 0, 0, None, None, 0.0, 0.0))
    line = record.to_json()
    assert "first_loss" not in line
    assert StepRecord.from_json(line).draft_head == record.draft_head
