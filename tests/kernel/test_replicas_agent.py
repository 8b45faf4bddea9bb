"""A real laminard shows and drops the checkpoint replicas it holds (``laminarctl replicas``,
``laminarctl replicas drop KEY [--force]``), for root and for a user who may not see whose
they are.

The agent (``agentproc.AgentProc``, in its own network namespace) is given two replicas before
it starts: real jobkit checkpoints sent with the real ``send_checkpoint`` into a real Receiver
on the agent's own receive root (``<state_dir>/xfer``, the directory its migrate component
serves). One of them gets a ``keeping`` row written into the agent's store with the
component's own schema: a stand-in, named as such, for the authenticated ``keeper`` message a
source sends (which needs a zone and its key; tests/unit/test_replicas_api.py sends the real
one). The other has no row: its keeper never came (``unclaimed``).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from agentproc import NOBODY, AgentProc
from xferrig import KEY, with_receiver

from laminar.jobkit import Checkpointer
from laminar.migrate.reclaim import REPLICAS_SCHEMA
from laminar.migrate.transfer import Receiver, send_checkpoint
from laminar.store import Store

pytestmark = pytest.mark.kernel


def disk_bytes(d: Path) -> int:
    return sum(os.lstat(os.path.join(t, n)).st_size for t, _, fs in os.walk(d) for n in fs)


def test_a_real_agent_lists_its_replicas_refuses_a_keeper_without_force_and_drops(veth_pair: Any, tmp_path: Path) -> None:
    a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a)
    try:
        root = a.state_dir / "xfer"

        async def fill(rcv: Receiver, port: int) -> None:
            for key, step in (("n2-job-1", 4), ("n3-job-2", 1)):
                ck = Checkpointer(job_id=key, ckpt_dir=tmp_path / f"src-{key}", install_signal=False)
                c = ck.save(os.urandom(1 << 20), step=step)
                await send_checkpoint("127.0.0.1", port, c, key, KEY, zone=1, node=key[1], retries=1)

        asyncio.run(with_receiver(root, fill))
        store = Store(a.state_dir / "laminar.db")
        store.ensure_schema("migrate", REPLICAS_SCHEMA)
        with store.tx() as db:  # the stand-in for node 2's keeper message (see the module docs)
            db.execute("INSERT INTO migrate_replicas VALUES ('n2-job-1', 2, 'job-1', ?, 'ckpt-4', 'keeping', NULL, ?)",
                       (json.dumps({"spec": {"command": ["train"]}, "owner_uid": 1000}), time.time()))
        store.db.close()
        base = root / "checkpoints"
        sizes = {k: disk_bytes(base / k) for k in ("n2-job-1", "n3-job-2")}
        a.start()

        rows = {r["key"]: r for r in a.json("replicas")}
        assert {k: (r["state"], [c["name"] for c in r["checkpoints"]], r["bytes"]) for k, r in rows.items()} == {
            "n2-job-1": ("keeping", ["ckpt-4"], sizes["n2-job-1"]),
            "n3-job-2": ("unclaimed", ["ckpt-1"], sizes["n3-job-2"])}
        assert rows["n2-job-1"]["owner_uid"] == 1000 and rows["n3-job-2"]["gc"] == "removes"
        totals = a.json("replicas", "--totals")["totals"]
        assert totals["bytes_held"] == sum(sizes.values()) and totals["free_bytes"] > 0
        table = a.ctl("replicas").stdout
        assert "n2-job-1" in table and "keeping" in table and "2 keys" in table

        # a user who is not the owner: sizes and states, not whose; and no drop
        r = a.ctl("-o", "json", "replicas", user=NOBODY)
        seen = json.loads(r.stdout)
        assert sorted(x["bytes"] for x in seen) == sorted(sizes.values())
        assert all(x["redacted"] and x["key"] is None for x in seen) and "n2-job-1" not in r.stdout
        r = a.ctl("replicas", "drop", "n3-job-2", user=NOBODY, check=False)
        assert r.returncode == 4 and (base / "n3-job-2" / "ckpt-1").is_dir()

        # the keeper: refused without --force, naming the source; an unknown key: refused
        r = a.ctl("replicas", "drop", "n2-job-1", check=False)
        err = " ".join(r.stderr.split())
        assert r.returncode == 1 and "node 2" in err and "--force" in err and "only way back" in err
        r = a.ctl("replicas", "drop", "n7-job-9", check=False)
        assert r.returncode == 1 and "no replicas of 'n7-job-9'" in " ".join(r.stderr.split())
        assert (base / "n2-job-1" / "ckpt-4").is_dir()

        a.ctl("replicas", "drop", "n3-job-2")
        assert not (base / "n3-job-2").exists()
        r = a.ctl("replicas", "drop", "n2-job-1", "--force")
        assert "was not told" in " ".join(r.stderr.split())
        assert not (base / "n2-job-1").exists()
        assert a.json("replicas") == [] and a.json("replicas", "--totals")["totals"]["keys"] == 0
        events = a.json("events")
        dropped = [e for e in (events if isinstance(events, list) else events.get("events", []))
                   if e.get("phase") == "replica-dropped"]
        assert [(e["key"], e["forced"]) for e in dropped] == [("n3-job-2", False), ("n2-job-1", True)]
        assert a.proc is not None and a.proc.poll() is None and "Traceback" not in a.log()
    finally:
        a.cleanup()
