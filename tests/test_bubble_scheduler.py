"""The bubble scheduler: its rules, and both clocks' drivers making the same decisions from the same durations.

No Ray here: the Ray Serve driver runs against stand-ins for its DeploymentHandles whose calls take scripted
simulated time, resolved one at a time in the order the virtual clock would report them.
"""

from __future__ import annotations

import asyncio
import copy
import math
import threading
from dataclasses import replace

import pytest

from bubblespec.core.interfaces import (
    Engine,
    ForwardPass,
    GenerationRequest,
    GenerationResult,
    RequestStats,
    RolloutKey,
    SamplingParams,
)
from bubblespec.rollout.bubble_scheduler import DraftChunk, Generate, PhaseScheduler, RetryPolicy, StopDrafting
from bubblespec.rollout.clocks import CostProfile
from bubblespec.rollout.serve_ranks import ServeRankPool
from bubblespec.rollout.step import DraftPlan
from bubblespec.rollout.virtual_ranks import VirtualRankPool

ONE_SECOND_A_PASS = CostProfile(
    name="one-second", description="every forward pass takes one second", fixed_s=1.0, weight_bytes=0.0,
    kv_bytes_per_context_token=0.0, flops_per_token=0.0, attention_flops_per_pair=0.0, bandwidth_bytes_per_s=1.0,
    flops_per_s=1.0, train_flops_per_token=0.0, train_fixed_s=0.0, weight_sync_fixed_s=0.0,
    weight_sync_put_bytes_per_s=1.0, weight_sync_load_bytes_per_s=1.0,
)  # fmt: skip


class ScriptedEngine(Engine):
    """One token per request per forward pass until the request's scripted length; tokens follow from the key."""

    def __init__(self, lengths: dict[str, int]) -> None:
        self.lengths = lengths
        self.policy_version = 0
        self.vocab_size = 64

    def length(self, key: RolloutKey) -> int:
        return self.lengths[f"{key.step}/{key.prompt_uid}"]

    def generate(self, requests, stop=None, on_forward=None) -> list[GenerationResult]:
        tokens: list[list[int]] = [[] for _ in requests]
        while True:
            active = [i for i, r in enumerate(requests) if len(tokens[i]) < self.length(r.key)]
            if not active or (stop is not None and stop.is_set()):
                break
            for i in active:
                tokens[i].append(1 + (len(tokens[i]) + sum(map(ord, requests[i].key.prompt_uid))) % 50)
            if on_forward is not None:
                on_forward(ForwardPass(len(active), len(active), 0, 0))
        return [
            GenerationResult(
                r.key,
                t,
                [0.0] * len(t),
                "length" if len(t) == self.length(r.key) else "preempted",
                RequestStats(decode_steps=len(t)),
            )  # fmt: skip
            for r, t in zip(requests, tokens, strict=True)
        ]

    def passes(self, requests) -> int:
        return max((self.length(r.key) for r in requests), default=0)


class _PassesThenStop:
    def __init__(self, passes: int) -> None:
        self.left = passes

    def is_set(self) -> bool:
        self.left -= 1
        return self.left < 0


class _Call:
    def __init__(self, rank: int, start: float, requests, step: int | None, engine: ScriptedEngine) -> None:
        self.rank, self.start, self.requests, self.step, self.engine = rank, start, list(requests), step, engine
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.passes = engine.passes(self.requests)

    @property
    def end(self) -> float:
        return self.start + self.passes

    def stop_at(self, t: float) -> None:
        """Stopped at ``t``: runs the passes that began before ``t``, as a rank checks its stop before each pass."""
        self.passes = min(self.passes, max(0, math.ceil(t - self.start)))

    def resolve(self) -> None:
        results = self.engine.generate(self.requests, stop=_PassesThenStop(self.passes))
        self.future.set_result(results if self.step is not None else (results, self.passes, 0.0, 0.0))


class SimulatedRanks:
    """Stand-ins for the ranks' DeploymentHandles: a call takes one simulated second per forward pass, and the
    calls in flight return one at a time, earliest first (shards before chunks, then by rank), each once the
    driver has settled. ``trainer_ends``: the simulated time at which the test's thread calls ``stop_drafting``."""

    def __init__(self, engine: ScriptedEngine, num_ranks: int, trainer_ends: float | None = None) -> None:
        self.engine, self.now, self.trainer_ends = engine, 0.0, trainer_ends
        self.calls: list[_Call] = []
        self.trainer_end_reached = threading.Event()
        self.stopped = False
        self.handles = [_Handle(self, rank) for rank in range(num_ranks)]
        self._coordinator: asyncio.Task | None = None

    def clock(self) -> float:
        return self.now

    def call(self, rank: int, requests, step: int | None) -> asyncio.Future:
        call = _Call(rank, self.now, requests, step, self.engine)
        self.calls.append(call)
        if self._coordinator is None or self._coordinator.done():
            self._coordinator = asyncio.ensure_future(self._resolve_in_order())
        return call.future

    def stop(self, rank: int, step: int) -> None:
        self.stopped = True
        for call in self.calls:
            if call.rank == rank and call.step == step:
                call.stop_at(self.now)

    async def _settle(self) -> None:
        for _ in range(50):
            await asyncio.sleep(0)

    async def _resolve_in_order(self) -> None:
        while True:
            await self._settle()
            if not self.calls:
                return
            call = min(self.calls, key=lambda c: (c.end, c.step is not None, c.rank))
            if self.trainer_ends is not None and not self.stopped and call.end >= self.trainer_ends:
                self.now = self.trainer_ends
                self.trainer_end_reached.set()
                while not self.stopped:  # until the test's thread has called stop_drafting
                    await asyncio.sleep(0.001)
                continue
            self.calls.remove(call)
            self.now = call.end
            call.resolve()


class _Method:
    def __init__(self, function) -> None:
        self.remote = function


class _Handle:
    def __init__(self, ranks: SimulatedRanks, rank: int) -> None:
        self.generate = _Method(lambda shard, version: ranks.call(rank, shard, None))
        self.draft = _Method(lambda chunk, step, version: ranks.call(rank, chunk, step))
        self.stop = _Method(lambda step: _done(ranks.stop(rank, step)))


def _done(value) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


NUM_RANKS = 3
SHARD_LENGTHS = {"0/a": 4, "0/b": 9, "0/c": 2, "0/d": 13, "0/e": 3, "0/f": 6}
PLAN_LENGTHS = {f"1/p{i}": n for i, n in enumerate([5, 1, 8, 3, 12, 2, 7, 4, 9, 6, 3, 11])}


def _requests(lengths: dict[str, int]) -> list[GenerationRequest]:
    return [
        GenerationRequest((1, 2), RolloutKey(0, int(name.split("/")[0]), name.split("/")[1], 0), SamplingParams())
        for name in lengths
    ]


def _shards() -> list[list[GenerationRequest]]:
    requests = _requests(SHARD_LENGTHS)
    return [requests[rank::NUM_RANKS] for rank in range(NUM_RANKS)]


def _plan() -> DraftPlan:
    return DraftPlan(_requests(PLAN_LENGTHS), num_ranks=NUM_RANKS, max_batch_size=2)


def _decisions(outcome, activity) -> dict:
    """A copy of what the phase decided so far (late chunks add to the outcome in place)."""
    return copy.deepcopy(
        {
            "activity": activity,
            "records": list(outcome.ranks),
            "timelines": outcome.timelines,
            "drafts": outcome.drafts,
            "results": sorted((r.key, tuple(r.token_ids)) for r in outcome.results),
            "seconds": (outcome.seconds, outcome.barrier_seconds),
        }
    )


def _virtual(phase: str):
    pool = VirtualRankPool(ScriptedEngine(SHARD_LENGTHS | PLAN_LENGTHS), NUM_RANKS, ONE_SECOND_A_PASS)
    activity: list = []
    pool.on_activity = lambda *event: activity.append(event)
    if phase == "rollout":
        return _settled(pool, pool.rollout(_shards(), _plan()), activity)
    pool.start_drafting(_plan())
    return _settled(pool, pool.stop_drafting(train_seconds=7.0), activity)


def _settled(pool, outcome, activity) -> dict:
    """The phase's decisions once its late chunks are reported (the outcome gains their drafts and records)."""
    ended = _decisions(outcome, activity)
    late, _ = pool.settle()
    return _decisions(outcome, activity) | {"late": late, "ended": ended}


def _serve(phase: str):
    ranks = SimulatedRanks(ScriptedEngine(SHARD_LENGTHS | PLAN_LENGTHS), NUM_RANKS,
                           trainer_ends=None if phase == "rollout" else 7.0)  # fmt: skip
    pool = ServeRankPool(ranks.handles)
    pool.clock = ranks.clock
    activity: list = []
    pool.on_activity = lambda *event: activity.append(event)
    if phase == "rollout":
        return _settled(pool, pool.rollout(_shards(), _plan()), activity)
    pool.start_drafting(_plan())
    assert ranks.trainer_end_reached.wait(timeout=60), "the simulated ranks never reached the trainer's end"
    return _settled(pool, pool.stop_drafting(train_seconds=7.0), activity)


@pytest.mark.parametrize("phase", ["rollout", "training"])
def test_both_clocks_make_the_same_decisions_from_the_same_durations(phase):
    virtual, serve = _virtual(phase), _serve(phase)
    assert [event[:2] for event in virtual["activity"]] == [event[:2] for event in serve["activity"]]
    for part in virtual.keys() - {"ended", "late"}:
        assert virtual[part] == serve[part], part
    # on Serve, late chunks may return while the outcome is read: what the step saw is compared by its length
    assert virtual["ended"]["seconds"] == serve["ended"]["seconds"]
    assert sorted(virtual["late"], key=repr) == sorted(serve["late"], key=repr)
    drafted = {d.key.prompt_uid for d in virtual["drafts"]}
    assert drafted and len(drafted) < len(PLAN_LENGTHS)  # the stop cut the plan off: the decisions mattered
    # the phase ended at the stop with chunks still in flight; reported late, they added their drafts
    assert virtual["late"] and virtual["ended"]["seconds"] == virtual["seconds"]
    assert sorted(virtual["drafts"], key=repr) == sorted(virtual["ended"]["drafts"] + virtual["late"], key=repr)


def test_the_rollout_decisions_follow_the_rules():
    """Shards end at 13, 9 and 6 s (ranks 0, 1, 2). Rank 2 idles first and takes the first chunk, rank 1 the next;
    the barrier at 13 s stops the chunks in flight."""
    outcome = _virtual("rollout")
    generation = [r.generation_seconds for r in outcome["records"]]
    assert generation == [13.0, 9.0, 6.0] and outcome["seconds"] == (13.0, 13.0)
    hand_outs = [(rank, detail) for rank, activity, detail in outcome["activity"] if activity == "draft"]
    assert [rank for rank, _ in hand_outs][:2] == [2, 1]
    assert all(rank != 0 for rank, _ in hand_outs)  # the last rank to finish drafts nothing: it is the barrier
    records = outcome["records"]
    assert records[0].bubble_seconds == 0 and records[2].bubble_seconds == 7.0
    # drafting time counts up to the barrier; what runs past it is preemption latency
    assert all(r.drafting_seconds <= r.bubble_seconds for r in records)
    assert all(end <= 13.0 + 1.0 for timeline in outcome["timelines"] for _, _, end in timeline)


def test_no_chunk_is_handed_out_at_the_barrier_and_a_lost_chunk_costs_its_drafts_only():
    shards = [_requests({"0/x": 1}), _requests({"0/y": 1})]
    scheduler = PhaseScheduler(2, _plan(), policy_version=4, shards=shards)
    assert scheduler.start() == [Generate(0, tuple(shards[0])), Generate(1, tuple(shards[1]))]
    engine = ScriptedEngine({"0/x": 1, "0/y": 1} | PLAN_LENGTHS)
    first = scheduler.shard_done(0, 1.0, engine.generate(shards[0]), 1)
    assert [type(c) for c in first] == [DraftChunk]
    assert scheduler.shard_done(1, 1.0, engine.generate(shards[1]), 1) == [StopDrafting(1.0)]  # the barrier
    assert scheduler.chunk_lost(0, 2.0, RuntimeError("replica died")) == []
    outcome = scheduler.outcome(2.0)
    assert outcome.drafts == [] and outcome.ranks[0].draft_requests == 0
    assert outcome.timelines[0] == [("generate", 0.0, 1.0), ("draft", 1.0, 2.0)]


def test_drafts_come_back_in_the_order_their_chunks_were_handed_out():
    scheduler = PhaseScheduler(2, _plan(), policy_version=2)
    first, second = scheduler.start()
    engine = ScriptedEngine(PLAN_LENGTHS)
    (third,) = scheduler.chunk_done(1, 3.0, engine.generate(second.requests))  # the later chunk returns first
    assert scheduler.stop(3.5) == [StopDrafting(3.5)] and scheduler.stop(3.6) == []
    assert scheduler.chunk_done(0, 4.0, engine.generate(first.requests)) == []  # nothing after the stop
    assert scheduler.chunk_done(1, 4.0, engine.generate(third.requests, stop=_PassesThenStop(1))) == []
    outcome = scheduler.outcome(4.0)
    keys = [r.key for r in first.requests + second.requests + third.requests]
    assert [d.key for d in outcome.drafts] == keys and {d.policy_version for d in outcome.drafts} == {2}
    assert [d.finished for d in outcome.drafts[-len(third.requests) :]] == [False] * len(third.requests)
    assert outcome.seconds == 3.5 and outcome.ranks[0].preemption_latency_seconds == 0.5
    assert outcome.ranks[0].drafting_seconds == 3.5  # counted up to the stop
    assert outcome.ranks[1].drafting_seconds == 3.5 and outcome.timelines[1][-1] == ("draft", 3.0, 4.0)


def test_a_retry_policy_allows_its_number_of_retries():
    policy = RetryPolicy(max_retries=2)
    assert [policy.retry(attempt) for attempt in range(4)] == [True, True, False, False]
    assert replace(policy, max_retries=0).retry(0) is False


def test_the_step_goes_on_at_the_barrier_and_a_late_pass_delays_only_what_waits_for_it():
    """A pass costs one second per sequence. Rank 1's shard ends at 1 s; it drafts three keys (3 s a pass) from
    1 s; rank 0's shard ends at 5 s (the barrier), during rank 1's second pass, which ends at 7 s. The rollout ends at
    5 s; the late pass's drafts come with ``settle``, which waits 2 s right after the barrier and nothing once the
    trainer has trained for longer; drafting while training starts on rank 1 when its late pass is over."""
    per_sequence = replace(ONE_SECOND_A_PASS, fixed_s=0.0, flops_per_token=1.0)
    engine = ScriptedEngine({"0/long": 5, "0/short": 1, "2/a": 4, "2/b": 4} | {f"1/k{i}": 10 for i in range(6)})
    pool = VirtualRankPool(engine, 2, per_sequence, max_batch_size=3)
    shards = [_requests({"0/long": 5}), _requests({"0/short": 1})]
    plan = DraftPlan(_requests({f"1/k{i}": 10 for i in range(6)}), num_ranks=2, max_batch_size=3)
    outcome = pool.rollout(shards, plan)
    assert (outcome.seconds, outcome.barrier_seconds) == (5.0, 5.0) and outcome.drafts == []
    assert outcome.drafting_wait_seconds == 0.0  # the step did not wait
    late, waited = pool.settle(elapsed=0.0)
    assert waited == 2.0 and len(late) == 3 and outcome.drafts == late
    assert [len(d.token_ids) for d in late] == [2, 2, 2] and not any(d.finished for d in late)
    assert outcome.ranks[1].preemption_latency_seconds == 2.0 and outcome.ranks[1].drafting_seconds == 4.0
    assert outcome.timelines[1][-1] == ("draft", 1.0, 7.0)

    def bubble_plan():
        return DraftPlan(_requests({f"1/k{i}": 10 for i in range(6)}), num_ranks=2, max_batch_size=3)

    pool.rollout(shards, bubble_plan())
    late, waited = pool.settle(elapsed=2.5)  # the trainer trained for 2.5 s meanwhile
    assert len(late) == 3 and waited == 0.0
    assert pool.settle() == ([], 0.0)  # each late chunk is reported once
    pool.rollout(shards, bubble_plan())
    pool.start_drafting(DraftPlan(_requests({"2/a": 4, "2/b": 4}), num_ranks=2, max_batch_size=3))
    training = pool.stop_drafting(train_seconds=20.0)
    # four one-sequence passes each; rank 1 begins them once its late pass is over, 2 s into training
    assert [timeline[0][2] for timeline in training.timelines] == [4.0, 6.0]


def test_drafting_while_training_hands_chunks_only_to_the_ranks_it_may_use():
    """Ranks on CPU cores the trainer shares: only the first ``drafting_ranks`` draft; the others stay idle."""
    pool = VirtualRankPool(ScriptedEngine(SHARD_LENGTHS | PLAN_LENGTHS), NUM_RANKS, ONE_SECOND_A_PASS)
    pool.start_drafting(_plan(), ranks=1)
    outcome = pool.stop_drafting(train_seconds=7.0)
    assert outcome.ranks[0].draft_requests > 0 and outcome.timelines[0]
    assert all(r.draft_requests == 0 and not t for r, t in zip(outcome.ranks[1:], outcome.timelines[1:], strict=True))


def test_a_chunk_is_a_share_of_the_keys_left_per_rank_that_may_take_one():
    plan = DraftPlan(_requests({f"1/k{i}": 1 for i in range(5)} | {"2/a": 1, "2/b": 1}), num_ranks=2, max_batch_size=8)
    assert [r.key.prompt_uid for r in plan.take()] == ["k0", "k1", "k2", "k3"]  # half of seven, rounded up
    assert [r.key.prompt_uid for r in plan.take(takers=1)] == ["k4", "a", "b"] and not plan
    capped = DraftPlan(_requests({f"1/k{i}": 1 for i in range(5)}), num_ranks=1, max_batch_size=2)
    assert [len(capped.take()) for _ in range(3)] == [2, 2, 1]


@pytest.mark.parametrize(("num_ranks", "drafting_ranks", "chunk"), [(2, None, 12), (3, None, 6), (3, 1, 12)])
def test_in_a_rollout_the_rank_that_finishes_last_is_not_counted_among_those_that_take_chunks(
    num_ranks, drafting_ranks, chunk
):
    """Two ranks: the first to finish takes every key (the other is the barrier); three: half each, for the two
    that may finish first; one rank that drafts: every key."""
    shards = [_requests({f"0/r{rank}": 1}) for rank in range(num_ranks)]
    plan = DraftPlan(_requests(PLAN_LENGTHS), num_ranks=num_ranks, max_batch_size=64)
    scheduler = PhaseScheduler(num_ranks, plan, policy_version=1, shards=shards, drafting_ranks=drafting_ranks)
    scheduler.start()
    engine = ScriptedEngine({f"0/r{rank}": 1 for rank in range(num_ranks)})
    (command,) = scheduler.shard_done(0, 1.0, engine.generate(shards[0]), 1)
    assert isinstance(command, DraftChunk) and len(command.requests) == chunk


def test_drafting_while_training_goes_on_first_with_the_keys_a_late_rollout_pass_left_unfinished():
    """Ray Serve's driver: rank 1 finishes its shard first and drafts a batch of keys, step 1's, in the bubble; the
    barrier cuts it off (a late pass). Rank 0, the one rank drafting while the trainer trains, starts once that pass
    has returned, with step 1's unfinished keys, not step 2's, as the virtual clock does."""
    lengths = {f"1/k{i}": 10 for i in range(3)} | {"2/a": 4}
    ranks = SimulatedRanks(ScriptedEngine({"0/long": 5, "0/short": 1} | lengths), 2)
    pool = ServeRankPool(ranks.handles)
    pool.clock = ranks.clock
    activity: list = []
    pool.on_activity = lambda *event: activity.append(event)
    plan = DraftPlan(_requests(lengths), num_ranks=2, max_batch_size=3)
    pool.rollout([_requests({"0/long": 5}), _requests({"0/short": 1})], plan)
    pool.start_drafting(plan, ranks=1)
    pool.stop_drafting(train_seconds=1.0)
    pool.settle()
    drafting = [(rank, detail) for rank, what, detail in activity if what == "draft"]
    assert drafting[0] == (1, "3 keys of step 1 in the bubble")  # as many keys as a batch holds: two ranks
    assert drafting[1] == (0, "3 keys of step 1 while training (3 going on from a draft)")


def test_the_virtual_clocks_one_engine_is_told_which_rank_each_call_is_for():
    """A draft source's memory must be its own rank's (Engine.select_rank): every shard, drafting chunk and
    held-out share is preceded by its rank."""

    class RankAware(ScriptedEngine):
        def __init__(self, lengths) -> None:
            super().__init__(lengths)
            self.rank, self.calls = 0, []

        def select_rank(self, rank: int) -> None:
            self.rank = rank

        def generate(self, requests, stop=None, on_forward=None):
            self.calls.append((self.rank, sorted(r.key.prompt_uid for r in requests)))
            return super().generate(requests, stop, on_forward)

    engine = RankAware(SHARD_LENGTHS | PLAN_LENGTHS)
    pool = VirtualRankPool(engine, NUM_RANKS, ONE_SECOND_A_PASS)
    shards = _shards()
    pool.rollout(shards, _plan())
    pool.settle()
    for rank, shard in enumerate(shards):
        assert (rank, sorted(r.key.prompt_uid for r in shard)) in engine.calls
    drafted = [
        call
        for call in engine.calls
        if call not in [(i, sorted(r.key.prompt_uid for r in s)) for i, s in enumerate(shards)]
    ]
    assert drafted and {rank for rank, _ in drafted} <= set(range(NUM_RANKS))
    engine.calls.clear()
    held_out = [r for shard in shards for r in shard]
    assert [r.key for r in pool.evaluate(held_out)] == [r.key for r in held_out]
    assert [rank for rank, _ in engine.calls] == list(range(NUM_RANKS))
    assert sorted(uid for _, uids in engine.calls for uid in uids) == sorted(r.key.prompt_uid for r in held_out)
