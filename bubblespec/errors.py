"""``bubblespec.errors``, the name users and plugins import, is
:mod:`bubblespec.core.errors`."""

import sys

from bubblespec.core import errors

sys.modules[__name__] = errors
