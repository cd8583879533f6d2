"""Rollout ranks as Ray Serve deployments: one single-replica application per data-parallel rank, addressed by
rank, with the HTTP proxy off. The controller drives them through DeploymentHandles (wall clock).

A rank that finishes its shard is handed chunks of the next step's drafting plan; when the last rank finishes
(the barrier) every rank is told to stop, and each in-flight draft call returns after its current forward pass
with partial drafts. Stopping uses a step number rather than a flag to clear, so a stop can never be lost to a
draft call that starts late.

Faults: Serve replaces a replica that dies, and the replacement starts from the initial model. Every call
therefore names the policy version it expects; a replica holding another one refuses it (:class:`StalePolicy`),
and the pool gives the rank the current weights and calls again, as it does when a call fails with the replica.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence

from bubblespec.interfaces import GenerationRequest, GenerationResult
from bubblespec.rollout import DraftPlan, RankRecord, RolloutOutcome, drafted_tokens, drafts_from

logger = logging.getLogger(__name__)


class StalePolicy(RuntimeError):
    """A replica asked to generate with a policy version it does not hold (Serve replaced it meanwhile)."""


class RankReplica:
    """The body of one rank's deployment: an engine from the configured backend plugin."""

    def __init__(self, rank: int, backend: str, engine_settings: dict) -> None:
        import torch

        from bubblespec import plugins

        torch.set_num_threads(engine_settings.get("num_threads") or 1)
        self.rank, self.backend = rank, backend
        self.engine = plugins.load("backends", backend).from_pretrained(**(engine_settings | {"rank": rank}))
        self.stopped_step = -1
        self.version = 0

    def generate(self, requests: list[GenerationRequest], version: int) -> tuple[list[GenerationResult], int]:
        self._check_version(version)
        passes = getattr(self.engine, "num_forward_passes", 0)
        results = self._engine_call(self.engine.generate, requests)
        return results, getattr(self.engine, "num_forward_passes", 0) - passes

    def draft(self, requests: list[GenerationRequest], step: int, version: int) -> list[GenerationResult]:
        self._check_version(version)
        return self._engine_call(self.engine.generate, requests, stop=_StepStop(self, step))

    def _check_version(self, version: int) -> None:
        if version != self.version:
            raise StalePolicy(f"rank {self.rank} holds policy version {self.version}, the call expects {version}")

    def _engine_call(self, method, requests, **kwargs) -> list[GenerationResult]:
        """An engine failure names this rank and backend; a result list that does not match the requests is one."""
        from bubblespec.errors import BubblespecError, EngineError

        try:
            results = method(requests, **kwargs)
        except BubblespecError:
            raise
        except Exception as error:
            raise EngineError(
                f"rank {self.rank} (backend {self.backend!r}) failed on {len(requests)} requests: "
                f"{type(error).__name__}: {error}"
            ) from error
        if len(results) != len(requests) or [r.key for r in results] != [r.key for r in requests]:
            raise EngineError(
                f"rank {self.rank} (backend {self.backend!r}) returned {len(results)} results for {len(requests)} "
                "requests, or in another order: the GenerationEngine contract asks for one per request, in order"
            )
        return results

    def stop(self, step: int) -> None:
        self.stopped_step = max(self.stopped_step, step)

    def update_weights(self, state: dict, version: int) -> int:
        import torch

        self.engine.update_weights({name: torch.from_numpy(array.copy()) for name, array in state.items()}, version)
        self.version = version
        return version


class _StepStop:
    def __init__(self, replica: RankReplica, step: int) -> None:
        self.replica, self.step = replica, step

    def is_set(self) -> bool:
        return self.replica.stopped_step >= self.step


def deploy_ranks(num_ranks: int, backend: str, engine_settings: dict, cpus_per_rank: float) -> list:
    """Deploys one application ``bubblespec-rank-<r>`` per rank; returns their handles in rank order."""
    from ray import serve
    from ray.serve.api import RunTarget

    deployment = serve.deployment(name="rank", max_ongoing_requests=4, ray_actor_options={"num_cpus": cpus_per_rank})(
        RankReplica
    )
    targets = [
        RunTarget(deployment.bind(rank, backend, engine_settings), name=f"bubblespec-rank-{rank}", route_prefix=None)
        for rank in range(num_ranks)
    ]
    try:
        return list(serve.run_many(targets))
    except RuntimeError as error:  # Serve says only "failed to update the deployments"; the replica said why
        from bubblespec.errors import EngineError

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
    """All ranks for real, in wall-clock time."""

    def __init__(self, handles: Sequence) -> None:
        self.handles = list(handles)
        self.num_ranks = len(self.handles)
        self.version = 0
        self._step = 0
        self.on_activity: ActivityListener = _ignore
        """Told (rank, activity, detail) as ranks start generating, fall idle, draft and stop: the live display."""

    max_retries = 3
    """Times a rank's shard is retried after its replica died (Serve starts a new one)."""
    restore_timeout_s = 120.0

    def update_weights(self, state_dict, version: int) -> float:
        import ray

        start = time.perf_counter()
        reference = ray.put({name: tensor.detach().cpu().numpy() for name, tensor in state_dict.items()})
        self.version, self._weights = version, reference  # a replica restored meanwhile gets these

        async def send_all():
            await asyncio.gather(
                *[
                    self._resilient(rank, lambda handle: handle.update_weights.remote(reference, version))
                    for rank in range(self.num_ranks)
                ]
            )

        asyncio.run(send_all())
        return time.perf_counter() - start

    async def _resilient(self, rank: int, call):
        """``call(handle)`` on a rank; if the rank's replica died, wait for Serve's replacement, give it the current
        policy and call again. Keyed sampling makes the retried shard's tokens those of the lost one."""
        for attempt in range(self.max_retries + 1):
            try:
                return await call(self.handles[rank])
            except _replica_lost_errors() as error:
                if attempt == self.max_retries:
                    from bubblespec.errors import EngineError

                    raise EngineError(f"rank {rank}: its replica died {attempt + 1} times ({error})") from error
                logger.warning(
                    "rank %d lost its replica (%s); restoring policy version %d and retrying", rank, error, self.version
                )
                await self._restore(rank)

    async def _restore(self, rank: int) -> None:
        deadline = time.perf_counter() + self.restore_timeout_s
        while True:
            try:
                if getattr(self, "_weights", None) is not None:
                    await self.handles[rank].update_weights.remote(self._weights, self.version)
                else:  # version 0: a new replica loads the initial weights itself
                    await self.handles[rank].stop.remote(-1)  # waits until the rank has a replica again
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
        results, _ = asyncio.run(
            self._resilient(0, lambda handle: handle.generate.remote(list(requests), self.version))
        )
        return results

    def rollout(self, shards, plan: DraftPlan) -> RolloutOutcome:
        self._step += 1
        return asyncio.run(self._rollout(shards, plan, self._step))

    def start_drafting(self, plan: DraftPlan) -> None:
        """Ranks draft the rest of ``plan`` in the background (a thread with its own event loop) until
        :meth:`stop_drafting`."""
        self._step += 1
        self._training = RolloutOutcome([], [], [RankRecord(rank) for rank in range(self.num_ranks)], 0.0)
        self._training.timelines = [[] for _ in range(self.num_ranks)]
        self._training_started = time.perf_counter()
        self._stop_requested = threading.Event()
        self._drafter = threading.Thread(target=lambda: asyncio.run(self._draft_until_stopped(plan, self._step)))
        self._drafter.start()

    def stop_drafting(self, train_seconds: float) -> RolloutOutcome:
        self._stop_requested.set()
        asyncio.run(self._stop_all(self._step))
        self._drafter.join()
        self._training.seconds = self._training.barrier_seconds = time.perf_counter() - self._training_started
        return self._training

    async def _draft_until_stopped(self, plan: DraftPlan, step: int) -> None:
        running: dict[asyncio.Future, tuple[int, float]] = {}

        def hand_out(rank: int) -> None:
            chunk = plan.take()
            self.on_activity(rank, "draft", _chunk_detail(chunk, "while training"))
            future = asyncio.ensure_future(_awaited(self.handles[rank].draft.remote(chunk, step, self.version)))
            running[future] = (rank, time.perf_counter() - self._training_started)

        for rank in range(self.num_ranks):
            if plan:
                hand_out(rank)
        while running:
            done, _ = await asyncio.wait(set(running), return_when=asyncio.FIRST_COMPLETED)
            now = time.perf_counter() - self._training_started
            for future in done:
                rank, began = running.pop(future)
                chunk_results = _drafts_or_nothing(future, rank)
                made = drafts_from(chunk_results, policy_version=self.version)
                self._training.drafts += made
                record = self._training.ranks[rank]
                record.drafting_seconds += now - began
                record.draft_requests += len(made)
                record.draft_tokens_produced += drafted_tokens(chunk_results)
                self._training.timelines[rank].append(("draft", began, now))
                if plan and not self._stop_requested.is_set():
                    hand_out(rank)
                else:
                    self.on_activity(rank, "idle", "")

    async def _rollout(self, shards, plan: DraftPlan, step: int) -> RolloutOutcome:
        start = time.perf_counter()
        records = [RankRecord(rank) for rank in range(self.num_ranks)]
        activity: list[list[tuple[str, float, float]]] = [[] for _ in range(self.num_ranks)]
        generating = {
            asyncio.ensure_future(
                self._resilient(rank, lambda handle, shard=shard: handle.generate.remote(list(shard), self.version))
            ): rank
            for rank, shard in enumerate(shards)
        }
        for rank, shard in enumerate(shards):
            with_draft = sum(r.draft is not None for r in shard)
            self.on_activity(rank, "generate", f"{len(shard)} requests, {with_draft} with a draft")
        drafting: dict[asyncio.Future, tuple[int, float]] = {}
        results: list[GenerationResult] = []
        drafts = []
        barrier = None
        pending = set(generating)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            now = time.perf_counter() - start
            for future in done:
                if future in generating:
                    rank = generating[future]
                    shard_results, passes = future.result()
                    results += shard_results
                    shard = shards[rank]
                    records[rank].add_results(shard_results, [r.draft is not None for r in shard])
                    records[rank].generation_seconds = now
                    records[rank].forward_passes = passes
                    activity[rank].append(("generate", 0.0, now))
                    tokens = sum(len(r.token_ids) for r in shard_results)
                    self.on_activity(rank, "idle", f"shard done at {now:.1f}s: {tokens} tokens, {passes} passes")
                else:
                    rank, began = drafting.pop(future)
                    chunk_results = _drafts_or_nothing(future, rank)
                    made = drafts_from(chunk_results, policy_version=self.version)
                    drafts += made
                    records[rank].draft_requests += len(made)
                    records[rank].draft_tokens_produced += drafted_tokens(chunk_results)
                    records[rank].drafting_seconds += (now if barrier is None else min(now, barrier)) - began
                    activity[rank].append(("draft", began, now))
                    if barrier is not None:
                        records[rank].preemption_latency_seconds = now - barrier
                    self.on_activity(rank, "idle", f"{len(made)} drafts, {drafted_tokens(chunk_results)} tokens")
                still_generating = any(f in generating for f in pending)
                if barrier is None and still_generating and plan:  # a rank that fell idle before the barrier
                    chunk = plan.take()
                    if chunk:
                        self.on_activity(rank, "draft", _chunk_detail(chunk, "in the bubble"))
                        future_draft = asyncio.ensure_future(
                            _awaited(self.handles[rank].draft.remote(chunk, step, self.version))
                        )
                        drafting[future_draft] = (rank, now)
                        pending.add(future_draft)
            if barrier is None and not any(f in generating for f in pending):
                barrier = now  # when the last shard came back
                await self._stop_all(step)
        end = time.perf_counter() - start
        for record in records:
            record.bubble_seconds = barrier - record.generation_seconds
        return RolloutOutcome(results, drafts, records, end, barrier, activity)


async def _awaited(response):
    return await response


ActivityListener = Callable[[int, str, str], None]


def _drafts_or_nothing(future: asyncio.Future, rank: int) -> list[GenerationResult]:
    """A draft chunk's results; a replica that died while drafting costs its drafts only (the rank's next shard
    call restores it)."""
    try:
        return future.result()
    except _replica_lost_errors() as error:
        logger.warning("rank %d lost its replica while drafting (%s); its chunk's drafts are dropped", rank, error)
        return []


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


def _ignore(rank: int, activity: str, detail: str) -> None:
    pass


def _chunk_detail(chunk: Sequence[GenerationRequest], when: str) -> str:
    steps = sorted({r.key.step for r in chunk})
    going_on = sum(r.draft is not None for r in chunk)
    return f"{len(chunk)} keys of step {', '.join(map(str, steps))} {when}" + (
        f" ({going_on} going on from a draft)" if going_on else ""
    )
