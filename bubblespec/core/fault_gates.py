"""A testing seam: named points where a fault test holds a rank or a trainer worker until it has injected its fault.

Fault tests must fire their fault at an event, never after a delay: a timer that lands mid-shard on one machine
lands after the shard on a faster one or beside a busy process. The code under test names a few points and asks
the gate, when it passes one, whether a test armed it:

- ``rank <r> generate``: a rank's shard call (:meth:`bubblespec.rollout.serve_ranks.RankReplica.generate`), held where
  the engine checks its stop signal before forward pass ``after_passes + 1``: the rank has started the shard and
  generated its first tokens;
- ``trainer worker <r> <command>``: a Ray Train worker that has received a command (``train``, ``load``, ...) and
  not yet run it (:func:`bubblespec.rl.ray_train.train_loop`).

A test arms a point (:meth:`FaultGate.arm`), waits until a call holds there (:meth:`FaultGate.wait_held`, which
also says on which node and in which process), injects the fault (kills that process, removes that node) and
releases the gate. A point holds once per arming: the call that a fault made the run retry passes through.

Off unless the environment variable ``BUBBLESPEC_FAULT_GATE`` names the gate (a Ray actor) in the processes of the
ranks and trainer workers: set it before Ray starts (its workers inherit the environment). Unset, each point costs
one environment lookup. Not a user setting: nothing in the run config reaches it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable

ENVIRONMENT_VARIABLE = "BUBBLESPEC_FAULT_GATE"
NAMESPACE = "bubblespec-fault-gates"


class Hold:
    """A :class:`~bubblespec.core.interfaces.StopSignal` that never stops: the ``after_passes + 1``-th time it is
    checked (before a forward pass) it holds the calling thread until the test releases the gate."""

    def __init__(self, gate, point: str, after_passes: int) -> None:
        self.gate, self.point, self.after_passes = gate, point, after_passes
        self.num_checks = 0

    def is_set(self) -> bool:
        self.num_checks += 1
        if self.num_checks == self.after_passes + 1:
            self.wait()
        return False

    def wait(self) -> None:
        """Tells the gate where this call holds and returns once the test released it."""
        import ray

        context = ray.get_runtime_context()
        where = {"node": context.get_node_id(), "pid": os.getpid()}
        ray.get(self.gate.hold.remote(self.point, where))


def armed(point: str) -> Hold | None:
    """The hold a fault test armed at ``point``, taken by this call (the next call passes), or None: always None
    while ``BUBBLESPEC_FAULT_GATE`` is unset or names no gate yet."""
    name = os.environ.get(ENVIRONMENT_VARIABLE)
    if not name:
        return None
    import ray

    try:
        gate = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:  # no test created the gate (yet): nothing is armed
        return None
    after_passes = ray.get(gate.enter.remote(point))
    return None if after_passes is None else Hold(gate, point, after_passes)


def reached(point: str) -> None:
    """Holds here if a fault test armed ``point`` (with no forward passes to wait for)."""
    hold = armed(point)
    if hold is not None:
        hold.wait()


class _Gate:
    """The Ray actor (async) behind a gate: armed points, where calls hold, and their releases."""

    def __init__(self) -> None:
        self.armed: dict[str, int] = {}
        self.held: dict[str, dict] = {}
        self.holding: dict[str, asyncio.Event] = {}
        self.released: dict[str, asyncio.Event] = {}

    async def arm(self, point: str, after_passes: int) -> None:
        self.armed[point] = after_passes
        self.holding[point], self.released[point] = asyncio.Event(), asyncio.Event()

    async def enter(self, point: str) -> int | None:
        return self.armed.pop(point, None)

    async def hold(self, point: str, where: dict) -> None:
        self.held[point] = where
        self.holding[point].set()
        await self.released[point].wait()

    async def held_at(self, point: str, timeout_s: float) -> dict | None:
        try:
            await asyncio.wait_for(self.holding[point].wait(), timeout_s)
        except TimeoutError:
            return None
        return self.held[point]

    async def release(self, point: str | None) -> None:
        """Lets the call held at ``point`` (or at every point: None) go on, and any later one pass at once."""
        for name, released in self.released.items():
            if point in (None, name):
                released.set()

    async def disarm(self) -> None:
        """Releases every point and forgets them: the next test's gate starts empty."""
        await self.release(None)
        self.armed.clear()


class FaultGate:
    """A fault test's side of the gate. The actor is created (or found, if an earlier test of the same Ray made it)
    on the driver's node, which must outlive any other node, by the first :meth:`arm`; a test calls it from an
    ``on_phase`` callback, when Ray is up. It stays up until Ray stops: a rank or trainer worker may ask it about a
    point at any time. Closing releases and forgets every point, so that no call stays held after the test."""

    def __init__(self, timeout_s: float = 180.0) -> None:
        self.name = os.environ.get(ENVIRONMENT_VARIABLE)
        if not self.name:
            raise ValueError(
                f"set {ENVIRONMENT_VARIABLE} to a gate name before Ray starts: the ranks and trainer workers read "
                "it from their environment"
            )
        self.timeout_s = timeout_s
        self._actor = None
        self._points: list[str] = []
        self._armed = threading.Event()
        self._closed = threading.Event()
        self._injectors: list[threading.Thread] = []
        self._errors: list[BaseException] = []

    def arm(self, point: str, after_passes: int = 0) -> None:
        """The next call that passes ``point`` holds there (after ``after_passes`` forward passes, for a rank)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self._actor is None:
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            options = {"name": self.name, "namespace": NAMESPACE, "get_if_exists": True, "scheduling_strategy": here}
            self._actor = ray.remote(num_cpus=0)(_Gate).options(**options).remote()
        ray.get(self._actor.arm.remote(point, after_passes))
        self._points.append(point)
        self._armed.set()

    def wait_held(self, point: str, running: Callable[[], bool] = lambda: True) -> dict:
        """Waits until a call holds at ``point`` and returns where (``node``: its Ray node id, ``pid``: its
        process). Fails after ``timeout_s``, or as soon as ``running()`` turns false (the run ended) or Ray stops."""
        import ray

        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline and running() and not self._closed.is_set():
            if not self._armed.wait(0.1) or point not in self._points:
                continue
            if not ray.is_initialized():
                break
            where = ray.get(self._actor.held_at.remote(point, 0.5))
            if where is not None:
                return where
        raise TimeoutError(f"no call held at {point!r} (armed: {self._points}): the fault was not injected")

    def release(self, point: str | None = None) -> None:
        """Lets the call held at ``point`` go on (None: at every point armed)."""
        import ray

        if self._actor is not None and ray.is_initialized():
            ray.get(self._actor.release.remote(point))

    def inject_when_held(self, point: str, fault: Callable[[dict], None]) -> None:
        """In a thread: waits until a call holds at ``point``, runs ``fault(where)``, releases the point. For faults
        that need not come from the main thread (killing a process); :meth:`close` raises their errors."""

        def inject() -> None:
            try:
                where = self.wait_held(point)
                try:
                    fault(where)
                finally:
                    self.release(point)
            except BaseException as error:
                self._errors.append(error)

        thread = threading.Thread(target=inject, name=f"fault at {point}", daemon=True)
        self._injectors.append(thread)
        thread.start()

    def close(self, raise_errors: bool = True) -> None:
        """Releases and forgets every point (while Ray is up), stops the injectors and raises the first error of
        one."""
        import ray

        self._closed.set()
        if self._actor is not None and ray.is_initialized():
            ray.get(self._actor.disarm.remote())
        self._actor = None
        for thread in self._injectors:
            thread.join(timeout=10)
        if self._errors and raise_errors:
            raise self._errors[0]

    def __enter__(self) -> FaultGate:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close(raise_errors=exc_type is None)  # the run's own error comes first
