"""What plugin authors test with: the engine conformance suites (:mod:`bubblespec.testing.conformance`), random
checkpoints with real model families' shapes (:mod:`bubblespec.testing.random_checkpoints`) and the fault-test
gates' client side (:mod:`bubblespec.core.fault_gates` is the seam the code under test calls).

``from bubblespec.testing import EngineConformance`` loads the suite on first use, not when this package is
imported: bubblespec's pytest plugin (:mod:`bubblespec.pytest_plugin`) registers the suite for assert rewriting
first, and :mod:`bubblespec.testing.random_checkpoints` stays importable without pytest.
"""

from __future__ import annotations

__all__ = [
    "LOGPROB_TOLERANCES",
    "EngineConformance",
    "RealVocabularyConformance",
    "compare",
    "run_settings",
    "write_policy_pair",
]


def __getattr__(name: str):
    if name in __all__:
        from bubblespec.testing import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module 'bubblespec.testing' has no attribute {name!r}")
