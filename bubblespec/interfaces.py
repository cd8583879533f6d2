"""``bubblespec.interfaces``, the name users and plugins import, is
:mod:`bubblespec.core.interfaces`."""

import sys

from bubblespec.core import interfaces

sys.modules[__name__] = interfaces
