"""A compromised zone member, for tests: node N's real identity (its zone key, its node key, its
roster address and ports), run from node N's own network namespace while node N's agent is
stopped, with the agent's real wire, transport and transfer code. What it sends is what a member
with root on node N can send; what the receiving agents do with it is under test
(tests/cluster/test_member_authority.py).

    nsenter --net=... python rogue_member.py NODE_CONFIG.toml '[{"do": "handover", ...}, ...]'

It runs a real :class:`laminar.zone.component.ZoneComponent` for node N (so the zone hears node
N alive: summaries, heartbeats), except that it answers no probe: each probe it receives is
noted (a victim placement's id, for ``hijack``). It prints one JSON line when it is ready, then
one per action, in order:

- ``{"do": "handover", "to": 1, "req": {...}, "gpus": 0}``: probe ``to`` for a reservation of
  its own, then hand over ``req`` (the hand-over request: spec, owner_uid, ...) under it. Out:
  ``{"status", "text"}`` (the HandoverAck), or ``{"error"}`` when there was no offer.
- ``{"do": "hijack", "victim": 2, "to": 1, "req": {...}, "wait_s": 30}``: wait for a probe from
  ``victim``, then hand ``req`` over to ``to`` under that placement id (another submitter's).
- ``{"do": "ckpt", "to": 2, "key": "n1-job-1", "step": 999999}``: write a jobkit checkpoint of
  its own (step ``step``) and send it under ``key``. Out: ``{"ok": remote path}`` or ``{"error"}``.
- ``{"do": "ctl", "to": 2, "op": "keeper", "body": {...}}``: one control message. Out:
  ``{"ok": result}`` or ``{"error"}``.
- ``{"do": "loan", "to": 1, "op": 2}``: a loan request (op 2: return). Out: ``{"ok"}`` / ``{"error"}``.
- ``{"do": "sleep", "s": 1.0}``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

from laminar.jobkit import Checkpointer
from laminar.migrate.transfer import send_checkpoint, send_control
from laminar.policy import placement as pl
from laminar.zone import wire
from laminar.zone.component import ZoneComponent, demand_to_probe
from laminar.zone.loan import LoanError
from laminar.zone.membership import WILDCARDS
from laminar.zone.transport import HandoverError


class Rogue:
    def __init__(self, config: Path) -> None:
        cfg = tomllib.loads(config.read_text())
        self.zone_settings = dict(cfg["zone"])
        self.migrate_port = int(cfg.get("migrate", {}).get("port", 7442))
        self.comp = ZoneComponent(settings=self.zone_settings, gpus=0)
        self.probes: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        self.tmp = Path(tempfile.mkdtemp(prefix="lmt-rogue-"))
        real = self.comp.handle_request

        def handle(sender: int, body: wire.Body) -> wire.Body | None:
            if isinstance(body, wire.Probe) and sender != self.comp.node_id:
                self.probes.put_nowait((sender, body.placement_id))
                return None  # silent: the submitter's probe times out here
            return real(sender, body)

        self.comp.handle_request = handle  # type: ignore[method-assign]

    @property
    def local(self) -> str | None:
        return None if self.comp.listen_host in WILDCARDS else self.comp.listen_host

    def peer(self, to: int) -> tuple[str, bytes, int]:
        """(address, key, zone) of ``to``'s transfer endpoint, signed as this node signs (pair key)."""
        m = self.comp.membership.by_node[to]
        key = self.comp.keys.get(m.zone)
        assert key is not None
        if self.comp.pairs is not None:
            key = self.comp.pairs.signing_key(key, to)
        return m.addr, key, m.zone

    async def handover(self, to: int, pid: int, req: dict[str, Any]) -> dict[str, Any]:
        try:
            ack = await self.comp.submitter.t.handover(to, 0, wire.Handover(pid, json.dumps(req).encode()), 15.0)
        except HandoverError as e:
            return {"error": f"hand-over failed: {e}"}
        return {"status": ack.status, "text": ack.text, "placement": f"{pid:016x}"}

    async def act(self, a: dict[str, Any]) -> dict[str, Any]:
        do = a["do"]
        if do == "sleep":
            await asyncio.sleep(float(a["s"]))
            return {}
        if do == "handover":
            pid = self.comp.submitter.new_placement_id()
            q = self.comp.router.expect(pid)
            try:
                demand = pl.Demand(gpus=float(a.get("gpus", 0)), cpus=float(a.get("cpus", 0.5)),
                                   memory_mb=int(a.get("memory_mb", 256)))
                self.comp.endpoint.send(a["to"], demand_to_probe(demand, pid, 10.0))
                try:
                    node, body = await asyncio.wait_for(q.get(), 5.0)
                except TimeoutError:
                    return {"error": "no answer to the probe"}
            finally:
                self.comp.router.forget(pid)
            if not isinstance(body, wire.Offer):
                return {"error": f"no offer: {body}"}
            return await self.handover(a["to"], pid, a["req"])
        if do == "hijack":
            deadline = time.monotonic() + float(a.get("wait_s", 30))
            while True:
                sender, pid = await asyncio.wait_for(self.probes.get(), max(0.1, deadline - time.monotonic()))
                if sender == a["victim"]:
                    break
            return await self.handover(a["to"], pid, a["req"])
        if do == "ckpt":
            ck = Checkpointer(job_id=a["key"], ckpt_dir=self.tmp / a["key"], install_signal=False, keep=10)
            path = ck.save(f"rogue-{a['step']}".encode(), step=int(a["step"]))
            addr, key, zone = self.peer(a["to"])
            try:
                res = await send_checkpoint(addr, self.migrate_port, path, a["key"], key, zone=zone,
                                            node=str(self.comp.node_id), local_host=self.local, retries=0)
            except Exception as e:  # noqa: BLE001 - the refusal is what is reported
                return {"error": str(e)}
            return {"ok": res.remote_path}
        if do == "ctl":
            addr, key, zone = self.peer(a["to"])
            try:
                out = await send_control(addr, self.migrate_port, key, a["op"], a["body"], zone=zone,
                                         node=str(self.comp.node_id), local_host=self.local, timeout=15.0)
            except Exception as e:  # noqa: BLE001
                return {"error": str(e)}
            return {"ok": out}
        if do == "loan":
            try:
                return {"ok": await self.comp.loan.request(a["to"], int(a["op"]), {"plan": "rogue", "actions": {}})}
            except LoanError as e:
                return {"error": str(e)}
        raise ValueError(f"unknown action {do!r}")


async def main(config: str, plan: list[dict[str, Any]]) -> None:
    r = Rogue(Path(config))
    await r.comp.start(None)
    try:
        print(json.dumps({"ready": r.comp.node_id}), flush=True)
        for a in plan:
            try:
                out = await r.act(a)
            except Exception as e:  # noqa: BLE001 - reported, the next action still runs
                out = {"error": f"{type(e).__name__}: {e}"}
            print(json.dumps({"do": a["do"], **out}), flush=True)
    finally:
        await r.comp.stop()
        shutil.rmtree(r.tmp, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
