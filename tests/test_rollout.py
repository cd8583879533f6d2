"""Bubble drafting pieces without Ray: the drafting plan and drafts that go on across bubbles."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from bubblespec.backends.torch_engine import TorchEngine
from bubblespec.core.interfaces import (
    Draft,
    GenerationRequest,
    GenerationResult,
    RequestStats,
    RolloutKey,
    SamplingParams,
)
from bubblespec.rollout.clocks import PROFILES
from bubblespec.rollout.step import DraftPlan, drafted_tokens, drafts_from, step_requests
from bubblespec.rollout.virtual_ranks import VirtualRankPool
from bubblespec.tasks import ArithmeticTask

from .conftest import write_checkpoint


def _request(uid: str) -> GenerationRequest:
    return GenerationRequest((1, 5, 6), RolloutKey(0, 1, uid, 0), SamplingParams(max_new_tokens=20))


def test_a_plan_hands_out_equal_shares_of_what_is_left():
    plan = DraftPlan([_request(str(i)) for i in range(10)], num_ranks=2, max_batch_size=4)
    sizes = []
    while plan:
        sizes.append(len(plan.take()))
    assert sizes == [4, 3, 2, 1]


def test_requeue_puts_unfinished_drafts_first_with_their_tokens():
    requests = [_request(uid) for uid in "abcd"]
    plan = DraftPlan(requests, num_ranks=1, max_batch_size=2)
    taken = plan.take()
    assert [r.key.prompt_uid for r in taken] == ["a", "b"]
    plan.requeue(
        [
            Draft(requests[0].key, (7, 8), policy_version=3, finished=False),
            Draft(requests[1].key, (7, 2), policy_version=3, finished=True),  # done: nothing to go on with
            Draft(requests[3].key, (9,), policy_version=3, finished=False),  # not handed out: stays as it was
        ]
    )
    again = plan.take()
    assert [r.key.prompt_uid for r in again] == ["a", "c"]
    assert again[0].draft.token_ids == (7, 8) and again[0].prompt_token_ids == requests[0].prompt_token_ids
    assert again[1].draft is None
    assert [r.key.prompt_uid for r in plan.take()] == ["d"] and not plan


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("model"), seed=3)
    return TorchEngine.from_pretrained(str(folder), dtype="float64")


def test_a_draft_cut_off_by_the_barrier_goes_on_where_it_stopped(engine):
    """Drafting the rest of a cut-off draft in a later phase gives exactly the draft one long bubble would have
    made (same policy, keyed sampling), and the later phase only pays for the new tokens."""
    requests = [
        GenerationRequest(
            (1, 3 + i, 7), RolloutKey(0, 1, f"p{i}", 0), SamplingParams(max_new_tokens=40, ignore_eos=True)
        )
        for i in range(6)
    ]
    whole = {r.key: r.token_ids for r in engine.generate(requests)}
    pool = VirtualRankPool(engine, num_ranks=2, profile=PROFILES["h100-7b"])
    shard_short = [GenerationRequest((1, 4), RolloutKey(0, 0, "now", 0), SamplingParams(max_new_tokens=3))]
    shard_long = [GenerationRequest((1, 4), RolloutKey(0, 0, "now", 1), SamplingParams(max_new_tokens=12))]
    plan = DraftPlan(requests, num_ranks=2)
    outcome = pool.rollout([shard_short, shard_long], plan)
    assert outcome.seconds == outcome.barrier_seconds  # the step went on at the barrier
    late, _ = pool.settle()  # the drafting pass the barrier cut ends late
    cut = {d.key: d for d in outcome.drafts}
    assert set(cut) == {d.key for d in late}
    assert cut and all(not d.finished for d in cut.values())  # a 9-pass bubble drafts no 40-token response
    assert all(whole[key][: len(d.token_ids)] == list(d.token_ids) for key, d in cut.items())

    pool.start_drafting(plan)  # the keys the late pass left unfinished went back to the plan when it was reported
    late = {d.key: d for d in pool.stop_drafting(train_seconds=10.0).drafts}
    assert set(cut) <= set(late)
    for key in cut:
        assert late[key].finished and list(late[key].token_ids) == whole[key]


def test_drafted_tokens_count_only_what_drafting_sampled(engine):
    request = step_requests(ArithmeticTask(prompts_per_step=1).batch(0), 0, 0, 1, SamplingParams(max_new_tokens=20))[0]
    first = engine.generate([request])
    draft = drafts_from(first, policy_version=0)[0]
    continued = engine.generate([GenerationRequest(request.prompt_token_ids, request.key, request.sampling, draft)])
    assert drafted_tokens(first) == len(first[0].token_ids)
    assert drafted_tokens(continued) == len(continued[0].token_ids) - continued[0].stats.draft_tokens_accepted
    # the whole draft was accepted: each verify pass sampled one token after the draft tokens it accepted
    assert continued[0].token_ids == first[0].token_ids
    assert drafted_tokens(continued) == continued[0].stats.decode_steps < len(first[0].token_ids)


def test_a_rank_record_names_its_slowest_response(engine):
    """The response with the most decode steps sets a rank's forward passes: the record keeps its decode steps,
    tokens and accepted draft tokens, and every token it did not take from a draft cost one decode step."""
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True)
    keys = [RolloutKey(0, 1, f"p{i}", 0) for i in range(3)]
    plain = engine.generate([GenerationRequest((1, 3 + i, 7), key, sampling) for i, key in enumerate(keys)])
    drafted = [  # p0 and p1 with their whole response as draft, p2 with its first 5 tokens only
        GenerationRequest((1, 3 + i, 7), key, sampling, Draft(key, tuple(r.token_ids[: 24 if i < 2 else 5]), 0))
        for i, (key, r) in enumerate(zip(keys, plain, strict=True))
    ]
    pool = VirtualRankPool(engine, num_ranks=1, profile=PROFILES["h100-7b"])
    rank = pool.rollout([drafted], DraftPlan([], num_ranks=1)).ranks[0]
    assert rank.slowest_response_tokens == 24
    assert rank.slowest_response_draft_tokens == 5
    assert rank.slowest_response_decode_steps == 24 - 5 == rank.forward_passes


class _WatchedLock:
    """A replica's engine lock that tells the test (sets ``waiting``) when a caller has to wait for it."""

    def __init__(self, waiting: threading.Event) -> None:
        self.lock, self.waiting = threading.Lock(), waiting

    def __enter__(self) -> None:
        if not self.lock.acquire(blocking=False):
            self.waiting.set()
            self.lock.acquire()

    def __exit__(self, *exc) -> None:
        self.lock.release()


def test_a_rank_takes_new_weights_once_its_drafting_pass_in_flight_has_ended():
    """The step goes on at the barrier while a rank's drafting pass still runs (a late chunk); the new weights the
    rank gets meanwhile wait for that pass on the rank (the replica's engine lock), so no pass mixes two policies."""

    from bubblespec.rollout.serve_ranks import RankReplica
    from bubblespec.rollout.weights import PackedWeights

    events: list[str] = []
    in_pass, pass_may_end, weights_wait = threading.Event(), threading.Event(), threading.Event()

    class Drafting:
        def generate(self, requests, stop=None, on_forward=None):
            in_pass.set()
            pass_may_end.wait()
            events.append("pass ended")
            return [GenerationResult(r.key, [1], [0.0], "preempted", RequestStats()) for r in requests]

        def update_weights(self, state_dict, version):
            events.append(f"weights {version}")

    replica = RankReplica.__new__(RankReplica)  # the Serve deployment's body, without loading a model
    replica.rank, replica.backend, replica.stopped_step, replica.version, replica.dtype = 0, "drafting", -1, 0, None
    replica.engine, replica._engine_lock = Drafting(), _WatchedLock(weights_wait)
    drafting = threading.Thread(target=replica.draft, args=([_request("a")], 1, 0))
    drafting.start()
    assert in_pass.wait(timeout=60)
    replica.stop(1)  # the barrier: the pass in flight ends late
    weights = PackedWeights.pack({"w": torch.ones(2)})
    syncing = threading.Thread(target=replica.update_weights, args=(weights, 1))
    syncing.start()
    assert weights_wait.wait(timeout=60)  # the sync reached the engine while the pass ran: it waits
    pass_may_end.set()
    drafting.join(), syncing.join()
    assert events == ["pass ended", "weights 1"] and replica.version == 1


def test_a_failing_engine_names_its_rank_and_backend():
    from bubblespec.core.errors import EngineError
    from bubblespec.rollout.serve_ranks import RankReplica

    class Broken:
        def generate(self, requests, stop=None, on_forward=None):
            raise RuntimeError("device lost")

    class Silent:
        def generate(self, requests, stop=None, on_forward=None):
            return []

    replica = RankReplica.__new__(RankReplica)  # the Serve deployment's body, without loading a model
    replica.rank, replica.backend, replica.stopped_step, replica.version = 3, "broken", -1, 0
    replica._engine_lock = threading.Lock()
    replica.engine = Broken()
    with pytest.raises(EngineError, match=r"rank 3 \(backend 'broken'\) failed on 1 requests: RuntimeError: device"):
        replica.generate([_request("a")], version=0)
    replica.engine = Silent()
    with pytest.raises(EngineError, match=r"returned 0 results for 1 requests"):
        replica.draft([_request("a")], step=1, version=0)


def test_a_replica_refuses_a_call_for_a_policy_version_it_does_not_hold():
    """A replacement replica starts from the initial model: generating with it would silently change rollouts."""
    from bubblespec.rollout.serve_ranks import RankReplica, StalePolicy

    replica = RankReplica.__new__(RankReplica)
    replica.rank, replica.backend, replica.stopped_step, replica.version = 1, "torch", -1, 0
    replica._engine_lock = threading.Lock()

    class Never:
        def generate(self, requests, stop=None, on_forward=None):
            raise AssertionError("a call for another policy version reached the engine")

        def close(self):
            pass

    replica.engine = Never()
    with pytest.raises(StalePolicy, match="rank 1 holds policy version 0, the call expects 5"):
        replica.generate([_request("a")], version=5)
    with pytest.raises(StalePolicy):
        replica.draft([_request("a")], step=5, version=5)


def test_a_call_that_waited_for_new_weights_is_refused_for_the_policy_it_expected():
    """A drafting call for version 0 arrives while version 1's weights are loading (the engine lock held): it reads
    the version once it has the lock, so it is refused, never run with the new weights as the old policy's drafts."""

    from bubblespec.rollout.serve_ranks import RankReplica, StalePolicy
    from bubblespec.rollout.weights import PackedWeights

    loading, may_finish, draft_waits = threading.Event(), threading.Event(), threading.Event()
    generated: list[int] = []

    class Loading:
        version = 0

        def generate(self, requests, stop=None, on_forward=None):
            generated.append(self.version)
            return [GenerationResult(r.key, [1], [0.0], "stop", RequestStats()) for r in requests]

        def update_weights(self, state_dict, version):
            loading.set()
            may_finish.wait()
            self.version = version

        def close(self):
            pass

    replica = RankReplica.__new__(RankReplica)  # the Serve deployment's body, without loading a model
    replica.rank, replica.backend, replica.stopped_step, replica.version, replica.dtype = 0, "loading", -1, 0, None
    replica.engine, replica._engine_lock = Loading(), _WatchedLock(draft_waits)
    weights = PackedWeights.pack({"w": torch.ones(2)})
    syncing = threading.Thread(target=replica.update_weights, args=(weights, 1))
    syncing.start()
    assert loading.wait(timeout=60)
    refused: list[BaseException] = []

    def draft():
        try:
            replica.draft([_request("a")], 1, 0)
        except StalePolicy as error:
            refused.append(error)

    drafting = threading.Thread(target=draft)
    drafting.start()
    assert draft_waits.wait(timeout=60)  # the call expects version 0 and waits for the engine
    may_finish.set()
    syncing.join(), drafting.join()
    assert generated == [] and replica.version == 1
    assert [str(e) for e in refused] == ["rank 0 holds policy version 1, the call expects 0"]


class _FakeReplica:
    """A rank's replica running calls in threads of its own, as a Serve replica does: a call goes on when its
    caller stops waiting for it. Drafting runs 10 ms forward passes until stopped (at most ``max_passes``)."""

    def __init__(self, rank: int, fails_in: str = "", max_passes: int = 1000) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.rank, self.fails_in, self.max_passes = rank, fails_in, max_passes
        self.stopped_step, self.drafting, self.draft_calls = -1, 0, 0
        self.learning_may_end = threading.Event()
        self.threads = ThreadPoolExecutor(4)

    def generate(self, requests, version):
        if self.fails_in == "generate":
            return self._fail(requests)
        return [self._result(r, 3, "stop") for r in requests], 1, 0.0, 0.0

    def draft(self, requests, step, version):
        import time

        if self.fails_in == "draft":
            return self._fail(requests)
        self.draft_calls += 1
        self.drafting += 1
        try:
            passes = 0
            while self.stopped_step < step and passes < self.max_passes:
                time.sleep(0.01)
                passes += 1
            return [self._result(r, passes, "preempted") for r in requests]
        finally:
            self.drafting -= 1

    def stop(self, step):
        self.stopped_step = max(self.stopped_step, step)

    def learn_head(self, samples, learning, budget, version):
        """A round of the draft head's learning that ends once the test sets :attr:`learning_may_end`."""
        from bubblespec.models.draft_head import HeadLearningReport

        self.learning_may_end.wait(timeout=60)
        return HeadLearningReport.nothing(), 0.5

    def _fail(self, requests):
        import time

        from bubblespec.core.errors import EngineError

        time.sleep(0.2)
        raise EngineError(f"rank {self.rank} (backend 'fake') failed on {len(requests)} requests: RuntimeError: lost")

    @staticmethod
    def _result(request, length, reason):
        from bubblespec.core.interfaces import GenerationResult, RequestStats

        return GenerationResult(request.key, [5] * length, [0.0] * length, reason, RequestStats())


class _FakeHandle:
    """``handle.method.remote(...)`` runs the replica's method in its threads; the response is awaitable."""

    def __init__(self, replica: _FakeReplica) -> None:
        self.replica = replica

    def __getattr__(self, name):
        import asyncio
        from types import SimpleNamespace

        class Response:
            def __init__(self, future):
                self.future = future

            def __await__(self):
                return asyncio.wrap_future(self.future).__await__()

        method = getattr(self.replica, name)
        return SimpleNamespace(remote=lambda *args: Response(self.replica.threads.submit(method, *args)))


@pytest.mark.parametrize("phase", ["rollout", "training"])
def test_an_engine_error_stops_every_rank_and_is_raised_with_its_message(phase):
    """Rank 0's engine fails while rank 1 drafts (in its bubble, or while the trainer runs): rank 1 is told to
    stop, its drafting call has returned when the error reaches the caller, and the error is the engine's."""
    import time

    from bubblespec.core.errors import EngineError
    from bubblespec.rollout.serve_ranks import ServeRankPool

    replicas = [_FakeReplica(0, fails_in="generate" if phase == "rollout" else "draft"), _FakeReplica(1)]
    pool = ServeRankPool([_FakeHandle(r) for r in replicas])
    plan = DraftPlan([_request(str(i)) for i in range(8)], num_ranks=2)
    message = r"^rank 0 \(backend 'fake'\) failed on \d+ requests: RuntimeError: lost$"
    try:
        if phase == "rollout":
            with pytest.raises(EngineError, match=message):
                pool.rollout([[_request("a")], [_request("b")]], plan)
        else:
            pool.start_drafting(plan)
            deadline = time.monotonic() + 3.0  # the trainer is still training: rank 1 stops without being told
            while (replicas[1].stopped_step < 1 or replicas[1].drafting) and time.monotonic() < deadline:
                time.sleep(0.01)
            with pytest.raises(EngineError, match=message):
                pool.stop_drafting(train_seconds=3.0)
        assert replicas[1].stopped_step == 1 and replicas[1].drafting == 0
    finally:
        for replica in replicas:
            replica.max_passes = 0
            replica.threads.shutdown(wait=True)


def test_serve_ranks_learn_a_draft_head_on_the_last_rank_and_every_rank_drafts_with_it(tmp_path, monkeypatch):
    """On Ray Serve ranks (wall clock; here the replicas' own code behind in-process handles) the last rank learns the
    head from the rollout's responses, its own kept hidden states included, while the caller goes on; the weight sync
    after it gives every rank that head, which then drafts without changing an output; a pause reaches every rank, a
    checkpoint's head comes back on every rank, and a replaced replica gets the head the ranks hold."""
    import concurrent.futures

    import ray

    from bubblespec.models.draft_head import HeadLearning
    from bubblespec.rollout.serve_ranks import RankReplica, ServeRankPool
    from bubblespec.testing.random_checkpoints import write_random_checkpoint

    monkeypatch.setattr(ray, "put", lambda value: value)  # the weights go to the in-process replicas as they are
    path = str(write_random_checkpoint(tmp_path / "llama", "llama", vocab_size=32_000))
    settings = {"model_path": path, "dtype": "float64", "max_batch_size": 8, "num_threads": 1}
    threads = torch.get_num_threads()
    replicas = [RankReplica(rank, "torch", settings) for rank in range(2)]
    torch.set_num_threads(threads)  # a replica sets its process's threads: this one is the test's
    for replica in replicas:
        replica.threads = concurrent.futures.ThreadPoolExecutor(4)
    pool = ServeRankPool([_FakeHandle(replica) for replica in replicas])

    def requests(step: int) -> list[GenerationRequest]:
        sampling = [SamplingParams(max_new_tokens=16 + 2 * i, ignore_eos=True, top_k=40 * (i % 2)) for i in range(4)]
        return [GenerationRequest((1, 5 + i, 9), RolloutKey(0, step, f"p{i}", 0), s) for i, s in enumerate(sampling)]

    learning = HeadLearning(window=8, max_tokens=3, steps=4, rows_per_step=2)
    try:
        assert pool.head_step_cost(learning.window) > 0  # measured on the last rank
        pool.keep_hidden_states(True)
        assert [replica.engine.keep_hidden for replica in replicas] == [False, True]
        first = requests(1)
        outcome = pool.rollout([first[:2], first[2:]], DraftPlan([]))
        samples = [(r.prompt_token_ids, x.token_ids, 1.0) for r, x in zip(first, outcome.results, strict=True)]
        pool.learn_head(samples, learning, beside=True)
        learned = pool.learned_head()
        assert (learned.report.steps, learned.report.responses, learned.report.kept_responses) == (4, 4, 2)
        assert learned.waited > 0 and learned.seconds > 0  # collected at once: the pool waited for it, measured
        assert replicas[1].engine.draft_head is not None and replicas[0].engine.draft_head is None
        weights = {name: tensor.clone() for name, tensor in replicas[0].engine.model.weights.items()}
        pool.update_weights(weights, version=1)  # the same policy: the same outputs for the same keys
        synced = pool.head_synced_seconds
        assert synced > 0 and pool.head_sync_seconds() == synced
        state = pool.draft_head_state()

        def holds(replica) -> bool:
            head = replica.engine.draft_head
            return head is not None and all(torch.equal(t, state["head"][n]) for n, t in head.state_dict().items())

        assert all(holds(replica) for replica in replicas)
        later = requests(2)
        plain = {x.key: x.token_ids for x in replicas[0].engine.generate(later)}  # drafts change no output
        outcome = pool.rollout([later[:2], later[2:]], DraftPlan([]))
        assert {x.key: x.token_ids for x in outcome.results} == plain  # in the order the ranks finished
        assert all(x.stats.head_tokens_proposed > 0 for x in outcome.results)
        assert all(rank.head_call_seconds > 0 for rank in outcome.ranks)
        pool.pause_head()
        assert all(replica.engine.draft_head is None for replica in replicas)
        pool.update_weights(weights, version=1)  # a paused head is not sent; the next sync's estimate stays
        assert pool.head_synced_seconds == 0.0 and pool.head_sync_seconds() == synced
        pool.load_draft_head_state(state, learning)  # a checkpoint's head, not paused
        assert all(holds(replica) for replica in replicas)
        replicas[1] = RankReplica(1, "torch", settings)  # Serve replaced the last rank's replica: the initial model
        torch.set_num_threads(threads)
        replicas[1].threads = concurrent.futures.ThreadPoolExecutor(4)
        pool.handles[1] = _FakeHandle(replicas[1])
        outcome = pool.rollout([later[:2], later[2:]], DraftPlan([]))  # refused for its policy version: restored
        assert replicas[1].version == 1 and holds(replicas[1]) and replicas[1].engine.keep_hidden
        assert {x.key: x.token_ids for x in outcome.results} == plain
    finally:
        for replica in replicas:
            replica.threads.shutdown(wait=True)


def test_the_last_rank_does_not_draft_while_training_while_it_learns_the_draft_head():
    """On Serve ranks a round of the head's learning holds the last rank's engine: a training phase that starts while
    it runs has only the other ranks draft (the last one's drafting would wait for the round, counted as drafting);
    the round is collected once the trainer is done, with the wait measured."""
    from bubblespec.models.draft_head import HeadLearning
    from bubblespec.rollout.serve_ranks import ServeRankPool

    replicas = [_FakeReplica(0), _FakeReplica(1)]
    pool = ServeRankPool([_FakeHandle(r) for r in replicas])
    try:
        pool.learn_head([((1,), (2, 3), 1.0)], HeadLearning(), beside=True)
        pool.start_drafting(DraftPlan([_request(str(i)) for i in range(8)], num_ranks=2))  # every rank, but the last
        deadline = time.monotonic() + 30
        while replicas[0].draft_calls == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        pool.stop_drafting(train_seconds=1.0)
        replicas[1].learning_may_end.set()
        learned = pool.learned_head()
        assert replicas[0].draft_calls > 0 and replicas[1].draft_calls == 0
        assert learned.seconds == 0.5 and learned.waited >= 0
    finally:
        for replica in replicas:
            replica.learning_may_end.set()
            replica.max_passes = 0
            replica.threads.shutdown(wait=True)
