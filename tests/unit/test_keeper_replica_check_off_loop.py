"""A keeper's take-over of a dead source's job, and a reclaimed keeper's pass of what it holds,
check the replica they resume or pass (``latest_verified``) in a worker thread.

``latest_verified`` trusts a committed replica whose files kept their identity for
TRUST_UNCHANGED_S (600 s) after its commit; an older one is hashed whole. A keeper takes a job
over when its source dies, often long after the replica came: the hash of a checkpoint of many
GB then ran on the agent's event loop (probes, the API, kill-switch requests waiting for
seconds), exactly when a node had just died. Real replicas: committed by a real Receiver over
loopback; the trust window is set to 0 so that they are hashed, as an old one is.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from standin_agent import standin_agent
from xferrig import KEY, make_ckpt, with_receiver

from laminar import jobkit
from laminar.components import MigrateAgent
from laminar.migrate import transfer as T
from laminar.migrate.reclaim import ReclaimComponent
from laminar.migrate.transfer import committed as xfer_committed

REPLICA = "n2-job-1"


class Stop(Exception):
    """Raised by a stand-in right after the check: what comes next is not under test."""


@pytest.fixture
def hashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """A replica of ``REPLICA`` committed under ``tmp_path/xfer``, hashed whole when checked;
    the list fills with, for each file hashed, whether it was on the event loop's thread."""
    ck = make_ckpt(tmp_path, 300 << 10)

    async def body(rcv: T.Receiver, port: int) -> None:
        await T.send_checkpoint("127.0.0.1", port, ck, REPLICA, KEY, chunk_size=64 << 10, retries=0,
                                node="2")  # the key's node: a take-over reads only its keeper's copies

    asyncio.run(with_receiver(tmp_path / "xfer", body))
    monkeypatch.setattr(xfer_committed, "TRUST_UNCHANGED_S", 0.0)  # as a replica committed long ago
    calls: list[bool] = []
    real = jobkit.file_sha256

    def spy(p: Any) -> str:
        calls.append(threading.current_thread() is threading.main_thread())
        return real(p)

    monkeypatch.setattr(jobkit, "file_sha256", spy)
    return calls


def component(root: Path) -> ReclaimComponent:
    c = ReclaimComponent()
    c.agent = standin_agent(MigrateAgent)  # an agent with nothing: no store, no jobs, no zone
    c.root = root
    return c


def test_a_take_over_checks_its_replica_off_the_event_loop(tmp_path: Path, hashed: list[bool]) -> None:
    c = component(tmp_path / "xfer")
    c.takeover.placement_here = lambda request: ""  # type: ignore[method-assign]
    c.takeover.runs_here = lambda key: None  # type: ignore[method-assign]
    row = {"key": REPLICA, "src_node": 2, "request": json.dumps({"spec": {"argv": ["true"]}})}
    try:  # what comes after the check fails on this bare component (an agent with nothing): not under test
        asyncio.run(c.takeover.take_over_once(row, REPLICA, "lm-t: source dead"))
    except Exception:  # noqa: BLE001
        pass
    assert hashed and not any(hashed), f"the replica was hashed on the event loop: {hashed}"


def test_a_reclaimed_keepers_pass_checks_its_replica_off_the_event_loop(tmp_path: Path, hashed: list[bool]) -> None:
    c = component(tmp_path / "xfer")

    async def rank_keepers(*a: Any, **kw: Any) -> list[Any]:
        raise Stop

    c.keepers.rank = rank_keepers  # type: ignore[method-assign]
    with pytest.raises(Stop):
        asyncio.run(c.keepers._pass_one({"key": REPLICA, "src_node": 2}, {"owner_uid": 65534, "owner_gid": 65534},
                                time.monotonic() + 60))
    assert hashed and not any(hashed), f"the replica was hashed on the event loop: {hashed}"
