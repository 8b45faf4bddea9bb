"""Contradicting [migrate] interval bounds stop the agent at start, naming both keys.

``min_interval_s`` above ``max_interval_s`` passed every key's own range check and the agent
planned every job at the minimum, silently. A real laminard is started with them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from agentproc import agent_factory

pytestmark = pytest.mark.kernel


def test_min_interval_above_max_interval_is_refused_at_start(veth_pair: Any, tmp_path: Path) -> None:
    bad = "[migrate]\nmin_interval_s = 600\nmax_interval_s = 60\n"
    with agent_factory(tmp_path, veth_pair, bad) as make, pytest.raises(RuntimeError) as e:
        make()
    assert "migrate.min_interval_s = 600 is above migrate.max_interval_s = 60" in str(e.value), str(e.value)[-2000:]
