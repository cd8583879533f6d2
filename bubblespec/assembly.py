"""``bubblespec.assembly``, the name users and plugins import, is
:mod:`bubblespec.run.assembly`."""

import sys

from bubblespec.run import assembly

sys.modules[__name__] = assembly
