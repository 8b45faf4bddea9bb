"""Fixtures of the kernel tests (the shared ones are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc


@pytest.fixture
def agent(veth_pair: Any, tmp_path: Path) -> Iterator[AgentProc]:
    """A real laminard with the default configuration on one end of a test veth pair; stopped
    and cleaned up (jobs, cgroups, pins) after the test. A module may define its own."""
    a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a)
    try:
        a.start()
        yield a
    finally:
        a.cleanup()
