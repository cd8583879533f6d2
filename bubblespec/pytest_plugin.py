"""bubblespec's pytest plugin (entry point ``pytest11``): pytest rewrites the asserts of the conformance suite
(:mod:`bubblespec.testing`), so that a plugin author's failing check shows the values it compared, not a bare
``AssertionError``."""

import pytest

pytest.register_assert_rewrite("bubblespec.testing")
