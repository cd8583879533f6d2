"""Tests that start Ray take turns across pytest-xdist workers: two local Rays (or a Ray cluster of several nodes
beside a local Ray) on one machine's two cores slow each other past their timeouts, and a local ``ray.init`` finds
the other worker's cluster and refuses to start. One lock file that every worker of the session shares.
(pytest-xdist's ``xdist_group`` cannot do it: its loadgroup scheduling does not group under pytest 9.)"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

_held = False
"""Whether this worker holds the lock (a module's Ray cluster holds it for all of its tests)."""


@contextlib.contextmanager
def ray_turn(tmp_path_factory) -> Iterator[None]:
    """Holds the session's Ray lock (nothing to hold outside xdist, or when this worker holds it already)."""
    global _held
    if _held or not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    with open(tmp_path_factory.getbasetemp().parent / "ray-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _held = True
        try:
            yield
        finally:
            _held = False
            fcntl.flock(lock, fcntl.LOCK_UN)
