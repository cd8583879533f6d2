"""``bubblespec.random_checkpoints``, the name users and plugins import, is
:mod:`bubblespec.testing.random_checkpoints`."""

import sys

from bubblespec.testing import random_checkpoints

sys.modules[__name__] = random_checkpoints
