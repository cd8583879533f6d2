"""``bubblespec.config``, the name users and plugins import, is
:mod:`bubblespec.core.config`."""

import sys

from bubblespec.core import config

sys.modules[__name__] = config
