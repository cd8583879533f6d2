"""Rollout ranks as Ray Serve deployments: one single-replica application per data-parallel rank, addressed by
rank, with the HTTP proxy off. The controller drives them through DeploymentHandles (wall clock).

A rank that finishes its shard is handed chunks of the next step's drafting plan; when the last rank finishes
(the barrier) every rank is told to stop and the step goes on at once: each draft call in flight returns after its
current forward pass with partial drafts, while the trainer trains, and :meth:`ServeRankPool.settle` collects
them. A replica runs one engine call at a time (a lock), so new weights wait for that pass on the rank, not for the
step. Stopping uses a step number rather than a flag to clear, so a stop can never be lost to a draft call that
starts late. The pool drives every phase from one event loop of its own (a thread), on which late calls finish.

Faults: Serve replaces a replica that dies, and the replacement starts from the initial model. Every call
therefore names the policy version it expects; a replica holding another one refuses it (:class:`StalePolicy`),
and the pool gives the rank the current weights and calls again, as it does when a call fails with the replica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence

from bubblespec.core import fault_gates
from bubblespec.core.interfaces import GenerationRequest, GenerationResult
from bubblespec.rollout.bubble_scheduler import (
    REPLACED,
    ActivityListener,
    DraftChunk,
    Generate,
    PhaseScheduler,
    RetryPolicy,
    StopDrafting,
    ignore_activity,
)
from bubblespec.rollout.speculation_effect import PassCostFit, TimedPasses, seconds_saved
from bubblespec.rollout.step import DraftPlan, HeadRound, RolloutOutcome
from bubblespec.rollout.weights import PackedWeights

logger = logging.getLogger(__name__)


class StalePolicy(RuntimeError):
    """A replica asked to generate with a policy version it does not hold (Serve replaced it meanwhile)."""


class RankReplica:
    """The body of one rank's deployment: an engine from the configured backend plugin."""

    def __init__(self, rank: int, backend: str, engine_settings: dict) -> None:
        import torch

        from bubblespec.core import plugins

        torch.set_num_threads(engine_settings.get("num_threads") or 1)
        self.rank, self.backend = rank, backend
        self.engine = plugins.load("backends", backend).from_pretrained(**(engine_settings | {"rank": rank}))
        self.dtype = engine_settings.get("dtype")
        self.max_batch_size = engine_settings.get("max_batch_size", 64)
        self.stopped_step = -1
        self.version = 0
        self.releases = 0
        self._pass_cost = PassCostFit()
        self._engine_lock = threading.Lock()
        """One engine call at a time: Serve runs this replica's methods in a thread pool, and a late drafting pass
        may still run when new weights or the next call arrive."""

    def __del__(self) -> None:
        """Serve calls this when it shuts the replica down gracefully (its application deleted, as on a shared
        cluster at the end of a run): the engine frees what it holds."""
        engine = getattr(self, "engine", None)  # None: the constructor failed before the engine existed
        if engine is not None:
            engine.close()

    def generate(
        self, requests: list[GenerationRequest], version: int
    ) -> tuple[list[GenerationResult], int, float, float]:
        """The shard's results, its forward passes, the seconds its drafts saved (negative: cost), estimated
        from the passes' measured times (:mod:`bubblespec.rollout.speculation_effect`) less its draft-head calls, and
        the seconds of those calls (0 without a head)."""
        head_clock = getattr(self.engine, "head_call_seconds", None)
        passes = TimedPasses(None if head_clock is None else lambda: self.engine.head_call_seconds)
        hold = fault_gates.armed(f"rank {self.rank} generate")  # a testing seam: None unless a fault test armed it
        results = self._engine_call(self.engine.generate, requests, version, on_forward=passes, stop=hold)
        cost = self._pass_cost(passes.passes)
        ran = sum(cost(forward) for forward, _ in passes.passes)
        padded = any(forward.padded_tokens for forward, _ in passes.passes)
        saved = seconds_saved(requests, results, ran, self.max_batch_size, self.engine.vocab_size, cost, padded)
        # its passes' times leave the head's calls out: the saving is net of them, as the virtual clock's
        return results, len(passes.passes), saved - passes.head_seconds, passes.head_seconds

    def draft(self, requests: list[GenerationRequest], step: int, version: int) -> list[GenerationResult]:
        return self._engine_call(self.engine.generate, requests, version, stop=_StepStop(self, step))

    def learn_head(self, samples: list, learning, budget: float | None, version: int) -> tuple:
        """One round of the draft head's online learning on this rank's engine (``learn_draft_head``) from the
        responses ``samples``, AdamW steps after the first only while the round is within ``budget`` seconds (None:
        all of them); its ``HeadLearningReport`` and wall seconds."""

        def learn():
            start = time.perf_counter()
            until = None if budget is None else start + budget
            report = self.engine.learn_draft_head(samples, learning, until)
            return report, time.perf_counter() - start

        return self._locked(version, "learning its draft head", learn)

    def keep_hidden(self, keep: bool) -> None:
        """Whether the engine keeps its responses' hidden states for the head's next round (``keep_hidden``)."""
        with self._engine_lock:
            self.engine.keep_hidden = keep

    def draft_head_state(self) -> dict | None:
        """The engine's learned head (``draft_head_state``), its tensors on the CPU: what another rank or a checkpoint
        loads, whatever device it has."""
        with self._engine_lock:
            return _on_cpu(self.engine.draft_head_state())

    def load_draft_head(self, state: dict | None, learning) -> None:
        """The learned head of another rank (or a checkpoint's; None: none), to draft with from the next call."""
        with self._engine_lock:
            self.engine.load_draft_head_state(state, learning)

    def pause_head(self) -> None:
        with self._engine_lock:
            self.engine.pause_draft_head()

    def head_step_cost(self, window: int) -> float:
        """A draft-head step's measured cost over a decode pass's on this rank (``measure_head_step_cost``)."""
        with self._engine_lock:
            return self.engine.measure_head_step_cost(window)

    def _engine_call(self, method, requests, version: int, **kwargs) -> list[GenerationResult]:
        """``method(requests, **kwargs)`` under the engine lock (:meth:`_locked`); a result list that does not match
        the requests is an engine failure too."""
        from bubblespec.core.errors import EngineError

        results = self._locked(version, f"on {len(requests)} requests", lambda: method(requests, **kwargs))
        if len(results) != len(requests) or [r.key for r in results] != [r.key for r in requests]:
            raise EngineError(
                f"rank {self.rank} (backend {self.backend!r}) returned {len(results)} results for {len(requests)} "
                "requests, or in another order: the GenerationEngine contract asks for one per request, in order"
            )
        return results

    def _locked(self, version: int, doing: str, call):
        """``call()`` under the engine lock, if the engine holds policy ``version`` then (read under the lock: new
        weights may be loading meanwhile). An engine failure names this rank, its backend and what it was
        ``doing``."""
        from bubblespec.core.errors import BubblespecError, EngineError

        with self._engine_lock:
            if version != self.version:
                raise StalePolicy(f"rank {self.rank} holds policy version {self.version}, the call expects {version}")
            try:
                return call()
            except BubblespecError:
                raise
            except Exception as error:
                raise EngineError(
                    f"rank {self.rank} (backend {self.backend!r}) failed {doing}: {type(error).__name__}: {error}"
                ) from error

    def stop(self, step: int) -> None:
        self.stopped_step = max(self.stopped_step, step)

    def update_weights(self, weights: PackedWeights, version: int) -> int:
        """``weights``: tensors by Hugging Face name, in any dtype (views of the node's object store); the engine
        gets them in its own."""
        from bubblespec.models.decoder import DTYPES

        dtype = DTYPES.get(self.dtype)  # an engine-specific dtype name ("auto") takes the tensors as they are
        state = weights.tensors()  # made ready while a late drafting pass may still run; swapped in after it
        state = {name: t if dtype is None else t.to(dtype) for name, t in state.items()}
        with self._engine_lock:
            self.engine.update_weights(state, version)
            self.version = version
        return version

    def release(self) -> None:
        """The trainer shares this rank's hardware: free the engine's generation memory until :meth:`resume`."""
        with self._engine_lock:
            self.engine.release()
        self.releases += 1

    def resume(self) -> None:
        with self._engine_lock:
            self.engine.resume()

    def placement(self) -> dict:
        """Where this replica runs: its Ray node, the GPUs Ray gave it, and how often it released its memory."""
        import ray

        context = ray.get_runtime_context()
        return {"node": context.get_node_id(), "gpus": [str(g) for g in context.get_accelerator_ids().get("GPU", [])],
                "releases": self.releases}  # fmt: skip


def _on_cpu(state):
    """``state`` (nested dicts and lists of tensors and numbers) with every tensor on the CPU."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {key: _on_cpu(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_on_cpu(value) for value in state)
    return state


class _StepStop:
    def __init__(self, replica: RankReplica, step: int) -> None:
        self.replica, self.step = replica, step

    def is_set(self) -> bool:
        return self.replica.stopped_step >= self.step


def deploy_ranks(num_ranks: int, backend: str, engine_settings: dict, resources: dict) -> list:
    """Deploys one application ``bubblespec-rank-<r>`` per rank, each replica with Ray ``resources``
    (``ray_actor_options``: num_cpus, num_gpus, label_selector); returns their handles in rank order. Serve
    spreads the replicas over the nodes that have room."""
    from ray import serve
    from ray.serve.api import RunTarget

    # stop() must run while draft() does: synchronous methods in Serve's thread pool, whatever the Ray version's
    # default (env_vars of an actor's runtime_env add to the job's own)
    options = resources | {"runtime_env": {"env_vars": {"RAY_SERVE_RUN_SYNC_IN_THREADPOOL": "1"}}}
    deployment = serve.deployment(name="rank", max_ongoing_requests=4, ray_actor_options=options)(RankReplica)
    targets = [
        RunTarget(deployment.bind(rank, backend, engine_settings), name=f"bubblespec-rank-{rank}", route_prefix=None)
        for rank in range(num_ranks)
    ]
    try:
        return list(serve.run_many(targets))
    except RuntimeError as error:  # Serve says only "failed to update the deployments"; the replica said why
        from bubblespec.core.errors import EngineError

        raise EngineError(_why_a_rank_failed_to_start(num_ranks, backend) or str(error)) from None


def _why_a_rank_failed_to_start(num_ranks: int, backend: str) -> str | None:
    """The first failed rank and the last line of its replica's error (the exception and its message)."""
    from ray import serve

    applications = serve.status().applications
    for rank in range(num_ranks):
        application = applications.get(f"bubblespec-rank-{rank}")
        for deployment in application.deployments.values() if application else ():
            lines = [line.strip() for line in (deployment.message or "").splitlines() if line.strip()]
            if str(deployment.status).endswith(("DEPLOY_FAILED", "UNHEALTHY")) and lines:
                return f"rank {rank} could not start its engine (backend {backend!r}): {lines[-1]}"
    return None


class ServeRankPool:
    """All ranks for real, in wall-clock time: a driver of :class:`~bubblespec.rollout.bubble_scheduler.PhaseScheduler`
    whose calls are DeploymentHandle calls, reported as they return.

    A draft head (``speculation.draft_head``) learns on the last rank while the trainer trains (that rank does not
    draft then, :meth:`start_drafting`); :meth:`learned_head` waits for it once the trainer is done, and the weight
    sync after it sends its state from that rank to the others, as a replaced replica gets it again."""

    head_wait_seconds = 0.0
    """:meth:`settle` never waits for the draft head's learning here: :meth:`learned_head` does, and says how long."""
    head_synced_seconds: float | None = 0.0
    """What the last :meth:`update_weights` spent sending a learned head to the other ranks (measured; 0: none)."""

    def __init__(self, handles: Sequence, retry: RetryPolicy | None = None) -> None:
        self.handles = list(handles)
        self.num_ranks = len(self.handles)
        self.context_length = None
        """Not asked of the replicas: only the synchronous schedule, which needs none, runs on the wall clock."""
        self.retry = retry or RetryPolicy()
        self.version = 0
        self._step = 0
        self._weights = None
        self.clock: Callable[[], float] = time.perf_counter
        """Seconds on the wall clock; the scheduler's times are differences of two readings."""
        self.on_activity: ActivityListener = ignore_activity
        """Told (rank, activity, detail) as ranks start generating, fall idle, draft and stop: the live display."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._late: list[asyncio.Future] = []
        """Calls of ended phases still running on the pool's loop: late drafting chunks, stop calls."""
        self._drafting = None
        self._learning: concurrent.futures.Future | HeadRound | None = None
        """The draft head's round of learning that :meth:`learn_head` started, until :meth:`learned_head`."""
        self._head_learning = None
        """How the head learns (``models.draft_head.HeadLearning``), for the ranks that load it."""
        self._head_state: dict | None = None
        """The head the ranks hold since the last sync or restore: what a replaced replica gets."""
        self._head_unsynced = False
        self._last_head_sync = 0.0
        """What the last sync that sent a learned head took (:meth:`head_sync_seconds`)."""
        self._keeps_hidden = False
        """Whether the last rank keeps its responses' hidden states (a replaced replica is told again)."""

    restore_timeout_s = 120.0

    def _submit(self, coroutine) -> concurrent.futures.Future:
        """Runs ``coroutine`` on the pool's event loop (started on first use, in a thread of its own, so that calls
        still running when a phase ends go on running)."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="bubblespec-ranks", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _call(self, coroutine):
        return self._submit(coroutine).result()

    def update_weights(self, state_dict, version: int) -> float:
        import ray

        start = time.perf_counter()
        # One object for every rank: each node's ranks map the same bytes of its object store.
        reference = ray.put(PackedWeights.pack(state_dict))
        self.version, self._weights = version, reference  # a replica restored meanwhile gets these
        self._on_every_rank(lambda handle: handle.update_weights.remote(reference, version))
        self.head_synced_seconds = self._sync_head() if self._head_unsynced else 0.0
        return time.perf_counter() - start

    def _sync_head(self) -> float:
        """The head the last rank learned since the last sync, to the other ranks (its parameters, optimizer state
        and sizing: each rank then holds the same head, and goes on measuring its own acceptance); its seconds."""
        import ray

        start, last = time.perf_counter(), self.num_ranks - 1
        self._head_state = state = self.draft_head_state()
        reference, learning = ray.put(state), self._head_learning  # one copy for every rank
        self._on_ranks(range(last), lambda handle: handle.load_draft_head.remote(reference, learning))
        self._head_unsynced = False
        self._last_head_sync = time.perf_counter() - start
        return self._last_head_sync

    def release(self) -> None:
        """Every rank frees its generation memory for the trainer (colocated hardware)."""
        self._on_every_rank(lambda handle: handle.release.remote())

    def resume(self) -> None:
        self._on_every_rank(lambda handle: handle.resume.remote())

    def learn_head(self, samples, learning, beside: bool = True, budget: float | None = None) -> None:
        """Starts the draft head's round of learning on the last rank (:meth:`RankReplica.learn_head`); ``beside``
        the trainer it runs meanwhile, otherwise this waits for it (before the trainer, on the step)."""
        self._head_learning, self._head_unsynced = learning, True
        rank, samples = self.num_ranks - 1, list(samples)
        self._learning = self._submit(
            self._resilient(rank, lambda handle: handle.learn_head.remote(samples, learning, budget, self.version))
        )
        if not beside:
            self._learning = self._head_round(self._learning)

    def learned_head(self) -> HeadRound:
        """The round :meth:`learn_head` started, waited for: its ``waited`` is what waiting for it took here (from
        the trainer's end; not beside the trainer, all of it, before the trainer)."""
        learning, self._learning = self._learning, None
        return learning if isinstance(learning, HeadRound) else self._head_round(learning)

    @staticmethod
    def _head_round(future: concurrent.futures.Future) -> HeadRound:
        pending, start = not future.done(), time.perf_counter()
        try:
            report, seconds = future.result()
        except Exception as error:
            raise _engine_error(error) from None
        return HeadRound(seconds, 0.0, report, time.perf_counter() - start if pending else 0.0)

    def head_step_cost(self, window: int) -> float:
        """A draft-head step's cost over a decode pass's, measured on the last rank."""
        return self._on_last_rank(lambda handle: handle.head_step_cost.remote(window))

    def keep_hidden_states(self, keep: bool) -> None:
        self._keeps_hidden = keep
        self._on_last_rank(lambda handle: handle.keep_hidden.remote(keep))

    def head_sync_seconds(self) -> float:
        """What the last sync that sent a learned head took: the next one's estimate until that sync measures its
        own (:attr:`head_synced_seconds`)."""
        return self._last_head_sync

    def pause_head(self) -> None:
        self._on_every_rank(lambda handle: handle.pause_head.remote())
        self._head_unsynced = False
        if self._head_state is not None:  # a replaced replica gets it paused too
            self._head_state = self._head_state | {"paused": True}

    def draft_head_state(self) -> dict | None:
        return self._on_last_rank(lambda handle: handle.draft_head_state.remote())

    def load_draft_head_state(self, state, learning) -> None:
        """Every rank back to ``state`` (a checkpoint's; None: no head), once a round still running has ended."""
        if isinstance(self._learning, concurrent.futures.Future):
            concurrent.futures.wait([self._learning])
        self._learning, self._head_state, self._head_learning, self._head_unsynced = None, state, learning, False
        self._on_every_rank(lambda handle: handle.load_draft_head.remote(state, learning))

    def placement(self) -> list[dict]:
        """Each rank's node, GPUs and releases (:meth:`RankReplica.placement`)."""
        return self._on_every_rank(lambda handle: handle.placement.remote())

    def _on_last_rank(self, call):
        """``call(handle)`` on the last rank (the one that learns the draft head), resilient as every call is."""
        return self._call(self._resilient(self.num_ranks - 1, call))

    def _on_every_rank(self, call) -> list:
        return self._on_ranks(range(self.num_ranks), call)

    def _on_ranks(self, ranks: Sequence[int], call) -> list:
        async def on_all():
            return await asyncio.gather(*[self._resilient(rank, call) for rank in ranks])

        return self._call(on_all())

    async def _resilient(self, rank: int, call):
        """``call(handle)`` on a rank; if the rank's replica died, wait for Serve's replacement, give it the current
        policy and call again, as :attr:`retry` says."""
        attempt = 0
        while True:
            try:
                return await call(self.handles[rank])
            except _replica_lost_errors() as error:
                if not self.retry.retry(attempt):
                    from bubblespec.core.errors import EngineError

                    raise EngineError(f"rank {rank}: its replica died {attempt + 1} times ({error})") from error
                logger.warning(
                    "rank %d lost its replica (%s); restoring policy version %d and retrying", rank, error, self.version
                )
                await self._restore(rank)
                self.on_activity(rank, REPLACED, f"replica replaced, policy version {self.version}")
                attempt += 1

    async def _restore(self, rank: int) -> None:
        deadline = time.perf_counter() + self.restore_timeout_s
        while True:
            try:
                if self._weights is not None:
                    await self.handles[rank].update_weights.remote(self._weights, self.version)
                else:  # version 0: a new replica loads the initial weights itself
                    await self.handles[rank].stop.remote(-1)  # waits until the rank has a replica again
                if self._head_state is not None:  # the head the ranks hold (the last rank's latest round is lost)
                    await self.handles[rank].load_draft_head.remote(self._head_state, self._head_learning)
                if self._keeps_hidden and rank == self.num_ranks - 1:
                    await self.handles[rank].keep_hidden.remote(True)
                return
            except _replica_lost_errors():
                if time.perf_counter() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def _stop_all(self, step: int) -> None:
        """Tells every rank to stop drafting for ``step``. A replica that died has nothing left to stop: the
        rank's next call restores it."""

        async def stop(rank: int) -> None:
            try:
                await self.handles[rank].stop.remote(step)
            except _replica_lost_errors() as error:
                logger.warning("rank %d lost its replica (%s); nothing to stop there", rank, error)

        await asyncio.gather(*[stop(rank) for rank in range(self.num_ranks)])

    def evaluate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Every rank generates a share of the held-out requests (every ``num_ranks``-th), at once; the results in
        request order. (Rank 0 alone took ``num_ranks`` times as long.)"""
        shares = {rank: list(requests[rank :: self.num_ranks]) for rank in range(self.num_ranks)}

        async def on_all():
            calls = [self._resilient(rank, lambda handle, share=share: handle.generate.remote(share, self.version))
                     for rank, share in shares.items() if share]  # fmt: skip
            return await asyncio.gather(*calls)

        by_key = {result.key: result for results, *_ in self._call(on_all()) for result in results}
        return [by_key[request.key] for request in requests]

    def rollout(self, shards, plan: DraftPlan) -> RolloutOutcome:
        self._step += 1
        scheduler = PhaseScheduler(self.num_ranks, plan, self.version, shards, self.on_activity)
        return self._call(self._run(scheduler, self._step, self.clock()))

    def start_drafting(self, plan: DraftPlan, ranks: int | None = None) -> None:
        """Ranks (the first ``ranks``; None: all) draft the rest of ``plan`` in the background (on the pool's loop)
        until :meth:`stop_drafting`; not the last while it learns the draft head (its drafting would wait for that
        behind its engine lock, counted as drafting)."""
        if isinstance(self._learning, concurrent.futures.Future) and not self._learning.done():
            ranks = min(ranks or self.num_ranks, self.num_ranks - 1)
        self._step += 1
        scheduler = PhaseScheduler(self.num_ranks, plan, self.version, on_activity=self.on_activity,
                                   drafting_ranks=ranks)  # fmt: skip
        trainer_done = asyncio.Event()
        future = self._submit(self._run(scheduler, self._step, self.clock(), until=trainer_done))
        self._drafting = (future, trainer_done)

    def stop_drafting(self, train_seconds: float) -> RolloutOutcome:
        """Stops the drafting at once (passes in flight end late, :meth:`settle`); raises the error of a rank whose
        engine failed meanwhile (every rank was stopped then already)."""
        future, trainer_done = self._drafting
        self._drafting = None
        self._loop.call_soon_threadsafe(trainer_done.set)
        return future.result()

    def settle(self, elapsed: float = 0.0) -> tuple[list, float]:
        """Waits for the late calls of ended phases (their drafts join those phases' outcomes); returns their drafts
        and the wall seconds this waited (``elapsed`` is for the virtual clock: here the wait is measured)."""
        if not self._late:
            return [], 0.0
        late, self._late = self._late, []
        outcomes, waited = self._call(_gather(late))
        errors = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if errors:
            raise errors[0]
        return [draft for outcome in outcomes if outcome for draft in outcome], waited

    async def _run(
        self, scheduler: PhaseScheduler, step: int, started: float, until: asyncio.Event | None = None
    ) -> RolloutOutcome:
        """Runs a phase until it ends (:attr:`PhaseScheduler.ended`): starts the calls ``scheduler`` asks for and
        reports each as it returns; ``until``: the trainer's end (drafting while training), reported to the
        scheduler as its stop. Drafting calls still running then are late: reported as they return, after."""
        running: dict[asyncio.Future, Generate | DraftChunk] = {}
        trainer_done = None if until is None else asyncio.ensure_future(until.wait())

        async def run(commands) -> None:
            for command in commands:
                if isinstance(command, StopDrafting):
                    self._late.append(asyncio.ensure_future(self._stop_all(step)))  # the step does not wait for it
                elif isinstance(command, Generate):
                    shard = list(command.requests)
                    call = self._resilient(command.rank, lambda h, shard=shard: h.generate.remote(shard, self.version))
                    running[asyncio.ensure_future(call)] = command
                else:
                    call = self.handles[command.rank].draft.remote(list(command.requests), step, self.version)
                    running[asyncio.ensure_future(_awaited(call))] = command

        async def report(future: asyncio.Future, now: float) -> None:
            command = running.pop(future)
            if isinstance(command, Generate):
                results, passes, saved, head = future.result()
                await run(scheduler.shard_done(command.rank, now, results, passes, saved, head or None))
                return
            try:
                results = future.result()
            except _replica_lost_errors() as error:
                logger.warning(
                    "rank %d lost its replica while drafting (%s); its chunk's drafts are dropped", command.rank, error
                )
                await run(scheduler.chunk_lost(command.rank, now, error))
            else:
                await run(scheduler.chunk_done(command.rank, now, results))

        async def late() -> list:
            """The late chunks, reported as they return; their drafts."""
            try:
                while running:
                    done, _ = await asyncio.wait(set(running), return_when=asyncio.FIRST_COMPLETED)
                    for future in done:
                        await report(future, self.clock() - started)
            except Exception as error:
                await self._abandon(step, set(running), set())
                raise _engine_error(error) from None
            return scheduler.late_drafts

        now = 0.0
        try:
            if until is not None and self._late:
                # The rollout's drafting passes that ran past its barrier end within a forward pass; the keys they
                # left unfinished go back to the plan first, so that this phase goes on with them (as on the
                # virtual clock) rather than with a later step's. The trainer does not wait for this.
                await asyncio.gather(*self._late, return_exceptions=True)
            await run(scheduler.start())
            while not scheduler.ended:
                # the trainer's end is waited for until the phase has stopped for it, also when it came before this
                # phase first waited (the phase waited for late passes first)
                stopped = trainer_done is None or scheduler.stopped_at is not None
                waiting = set(running) if stopped else {*running, trainer_done}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                now = self.clock() - started
                if trainer_done in done:
                    await run(scheduler.stop(now))
                # calls that came back together: shards first, so that the barrier comes before a chunk's end
                for future in sorted(done - {trainer_done}, key=lambda f: isinstance(running[f], DraftChunk)):
                    await report(future, now)
        except Exception as error:
            shard_calls = {future for future, command in running.items() if isinstance(command, Generate)}
            await self._abandon(step, set(running), shard_calls)
            raise _engine_error(error) from None
        finally:
            if trainer_done is not None:
                trainer_done.cancel()
        outcome = scheduler.outcome(now)  # the barrier (the stop): what follows it is bookkeeping, not waiting
        if running:
            self._late.append(asyncio.ensure_future(late()))
        return outcome

    async def _abandon(self, step: int, in_flight: set, shard_calls: set) -> None:
        """After a rank's engine failed: every rank stops drafting for ``step`` (its drafting call returns after the
        current forward pass), shard calls still running are cancelled, and every call in flight is waited for,
        so that no rank works on when the error reaches the caller. Errors met meanwhile are logged; the first
        one is the error to raise."""
        for future in in_flight & shard_calls:
            future.cancel()
        outcomes = await asyncio.gather(self._stop_all(step), *in_flight, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                logger.warning(
                    "while stopping the ranks after an engine error: %s: %s", type(outcome).__name__, outcome
                )


def _engine_error(error: Exception) -> Exception:
    """The replica's own exception, where Ray wrapped it in a RayTaskError (whose message is a whole traceback)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, Exception) else error


async def _awaited(response):
    return await response


async def _gather(futures: list) -> tuple[list, float]:
    """The futures' outcomes (exceptions included), and the seconds spent waiting for those not done yet."""
    pending, start = any(not future.done() for future in futures), time.perf_counter()
    outcomes = await asyncio.gather(*futures, return_exceptions=True)
    return outcomes, time.perf_counter() - start if pending else 0.0


def _replica_lost_errors() -> tuple[type[BaseException], ...]:
    """What a call to a rank raises when its replica died, is being replaced, or is a replacement that does not
    hold the current policy yet."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    return (
        RayActorError,
        ActorDiedError,
        ActorUnavailableError,
        ReplicaUnavailableError,
        DeploymentUnavailableError,
        StalePolicy,
    )
