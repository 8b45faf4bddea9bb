"""``laminarctl sim``: the trace-driven simulator, run locally (it does not need the agent).

    laminarctl sim --trace ../shared/data/openb_pod_list_default.csv --policy laminar -o json

See :mod:`laminar.sim.cli` for the options and docs/simulator.md for the model.
"""

from __future__ import annotations

import argparse
from typing import Any

from laminar.sim.cli import add_parser


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    add_parser(sub, parents=[common])
