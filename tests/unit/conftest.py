"""Unit tests run the custody ledger strict: a move its table does not allow raises
(laminar.migrate.ledger) instead of being logged and counted."""

from __future__ import annotations

import os

os.environ["LAMINAR_STRICT_CUSTODY"] = "1"
