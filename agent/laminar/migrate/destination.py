"""Moved to :mod:`laminar.policy.destination` (issue 32, stage 1): this old path is an alias of that
module (the same module object, so its private names and monkeypatching still work) until a
later stage removes it."""

import sys

from laminar.policy import destination as _moved
from laminar.policy.destination import *  # noqa: F403  (the public names, for type checkers)

sys.modules[__name__] = _moved
