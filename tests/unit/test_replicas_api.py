"""Operators see and drop the checkpoint replicas a node holds: ``GET /v1/migrate/replicas``,
``POST /v1/migrate/replicas/{key}/drop`` and ``laminarctl replicas [drop KEY [--force]]``.

Real pieces: the migrate component on a real SQLite store, its real Receiver on loopback, real
jobkit checkpoints sent with the real ``send_checkpoint``, real authenticated ``keeper``/``release``
control messages (``Source`` from test_replica_gc); the component's routes served by a real
ApiServer on a Unix socket; the real ``laminarctl`` run as a process (as root) and in a child
that dropped to uid 65534 (``agentproc.ctl_as``). Stand-ins, named as such: the zone
(``FakeZone``: membership and keys only) and the job manager (``Jobs``: the local jobs the view
and the drop ask about). One state no real path can reach here without a dead zone peer, a
take-over that found no verified checkpoint (``failed``), is set with the keeper part's
``Takeover.set_replica``.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from agentproc import NOBODY, VENV_BIN, ctl_as
from jobrig import until
from test_api import _req
from test_replica_gc import KEY, Source, names, started

from laminar.api import ApiServer, Authorizer
from laminar.jobkit import Checkpointer
from laminar.migrate.reclaim import REPLICA_LATE_S, ReclaimComponent
from laminar.migrate.transfer import send_checkpoint, send_control
from laminar.policy import custody
from laminar.runtime.provenance import JobOrigin
from laminar.runtime.spec import JobSpec


def disk_bytes(d: Path) -> int:
    """The bytes of the regular files under ``d``, counted here independently of the agent."""
    return sum(os.lstat(os.path.join(t, n)).st_size for t, _, fs in os.walk(d) for n in fs)


def row(agent: SimpleNamespace, key: str) -> Any:
    return agent.store.db.execute("SELECT state FROM migrate_replicas WHERE key=?", (key,)).fetchone()


async def ctl(sock: Path, *args: str) -> tuple[int, str, str]:
    """The real laminarctl, as root, against ``sock``: exit code, stdout, stderr (its lines joined)."""
    p = await asyncio.create_subprocess_exec(str(VENV_BIN / "laminarctl"), "--socket", str(sock), *args,
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await p.communicate()
    assert p.returncode is not None
    return p.returncode, out.decode(), " ".join(err.decode().split())  # stderr is wrapped at 80 columns


async def serve(agent: SimpleNamespace, comp: ReclaimComponent) -> tuple[ApiServer, Path]:
    """The component's routes on a real ApiServer, on a socket uid 65534 can reach."""
    sock = Path(f"/run/laminar-t-{secrets.token_hex(3)}/api.sock")
    server = ApiServer(sock, Authorizer("laminar-test-no-such-group"))
    server.add(comp.routes())
    await server.start()
    agent.api = server
    return server, sock


def test_the_listing_shows_each_key_its_bytes_its_user_and_the_gc_plan(tmp_path: Path) -> None:
    async def main() -> None:
        agent, comp = await started(tmp_path)
        server, sock = await serve(agent, comp)
        try:
            base = comp.root / "checkpoints"  # type: ignore[operator]
            kept = Source(tmp_path, comp, 2, "n2-job-1")
            await kept.send(4)
            await kept.ctl("keeper", "ckpt-4")
            released = Source(tmp_path, comp, 3, "n3-job-2")
            await released.send(1)
            await released.ctl("keeper", "ckpt-1")
            await released.ctl("release")
            assert await until(lambda: not (base / "n3-job-2").exists())
            await released.send(2)  # came after the release: kept for REPLICA_LATE_S
            lost = Source(tmp_path, comp, 3, "n3-job-3")  # its keeper never came
            await lost.send(7)
            used = Source(tmp_path, comp, 2, "n2-job-5")
            p = await used.send(9)
            await used.ctl("keeper", "ckpt-9")
            agent.jobs.jobs.append(SimpleNamespace(id="job-8", state="running", ended=None,
                                                   spec=JobSpec(["train"], resume_from=str(p)), origin=JobOrigin(resume_given=str(p))))
            comp.takeover.set_replica("n2-job-5", custody.Event.HAND_OVER, "job-8")
            mine = Source(tmp_path, comp, 2, "n2-job-6")  # a job of uid 65534's
            await mine.send(3)
            await send_control("127.0.0.1", comp.port, KEY, "keeper",
                               {"key": "n2-job-6", "src_node": 2, "src_job": "job-6", "ckpt": "ckpt-3",
                                "request": {"spec": {"command": ["train"]}, "owner_uid": NOBODY}},
                               zone=1, node="2")

            waiting = Source(tmp_path, comp, 3, "n3-job-7")  # its source died; no room to resume it yet
            await waiting.send(2)
            await waiting.ctl("keeper", "ckpt-2")
            comp.takeover.wait_for_room("n3-job-7", "node 3 is dead", "here: no free GPU", None)

            rc, out, err = await ctl(sock, "-o", "json", "replicas")
            assert rc == 0, err
            rows = {r["key"]: r for r in json.loads(out)}
            assert set(rows) == {"n2-job-1", "n3-job-2", "n3-job-3", "n2-job-5", "n2-job-6", "n3-job-7"}
            for k, r in rows.items():
                assert r["bytes"] == disk_bytes(base / k) > 0
                assert sum(c["bytes"] for c in r["checkpoints"]) == r["bytes"]
                assert r["age_s"] is not None and r["age_s"] >= 0
            g = rows["n2-job-1"]
            assert (g["state"], g["src_node"], g["src_job"], g["ckpt"]) == ("keeping", 2, "job-1", "ckpt-4")
            assert [c["name"] for c in g["checkpoints"]] == ["ckpt-4"]
            assert g["gc"] == "keeps" and "node 2" in g["gc_why"] and g["used_by"] == []
            assert "--force" in g["droppable"] and "only way back" in g["droppable"]
            r2 = rows["n3-job-2"]
            assert r2["state"] == "released" and r2["gc"] == "removes" and "came after" in r2["gc_why"]
            late = os.lstat(base / "n3-job-2" / "ckpt-2").st_mtime  # kept for a keeper that may follow, then goes
            assert r2["gc_removes"] == ["ckpt-2"] and abs(r2["gc_at"] - (late + REPLICA_LATE_S)) < 1
            o = rows["n3-job-3"]
            assert o["state"] == "unclaimed" and o["src_node"] == 3 and o["gc"] == "removes"
            assert o["gc_removes"] == ["ckpt-7"]
            newest = max(os.lstat(os.path.join(t, n)).st_mtime for t, ds, fs in os.walk(base / "n3-job-3")
                         for n in ds + fs)
            assert abs(o["gc_at"] - (max(newest, os.lstat(base / "n3-job-3").st_mtime)
                                     + comp.s["replica_orphan_s"])) < 1
            u = rows["n2-job-5"]
            assert u["used_by"] == ["job-8"] and u["gc"] == "keeps" and u["job_id"] == "job-8"
            assert "job-8" in u["droppable"]
            w = rows["n3-job-7"]
            assert (w["state"], w["attempts"], w["last_error"], w["gc"]) == ("waiting", 1, "here: no free GPU", "keeps")
            assert "waiting for room" in w["gc_why"] and "--force" in w["droppable"]

            rc, out, err = await ctl(sock, "-o", "json", "replicas", "--totals")
            assert rc == 0, err
            v = json.loads(out)
            t = v["totals"]
            assert t["keys"] == 6 and t["bytes_held"] == sum(disk_bytes(base / k) for k in rows)
            st = os.statvfs(base)
            assert 0 < t["free_bytes"] <= st.f_blocks * st.f_frsize and t["root"] == str(base)
            assert t["by_state"] == {"keeping": 2, "handed-over": 1, "released": 1, "unclaimed": 1, "waiting": 1}

            rc, out, err = await ctl(sock, "replicas")  # the table
            assert rc == 0, err
            for k in rows:
                assert k in out
            assert "removes ckpt-7" in out and "6 keys" in out and "free" in out
            assert "looked 1 time, last: here: no free GPU" in out

            # a caller that is neither root, the control group nor the job's owner: no job identities
            loop = asyncio.get_running_loop()
            r = await loop.run_in_executor(None, ctl_as, NOBODY, ["--socket", str(sock), "-o", "json", "replicas"])
            assert r.returncode == 0, r.stderr
            seen = json.loads(r.stdout)
            assert len(seen) == 6
            theirs = [x for x in seen if x.get("redacted")]
            assert len(theirs) == 5 and all(x["key"] is None and x["src_job"] is None and x["used_by"] is None
                                            for x in theirs)
            assert sorted(x["bytes"] for x in seen) == sorted(x["bytes"] for x in rows.values())
            own = [x for x in seen if not x.get("redacted")]
            assert [x["key"] for x in own] == ["n2-job-6"] and own[0]["owner_uid"] == NOBODY
            assert "n2-job-1" not in r.stdout and "job-8" not in r.stdout
            # ... and may not drop anything (exit 4), its own job's replica included
            r = await loop.run_in_executor(None, ctl_as, NOBODY, ["--socket", str(sock), "replicas", "drop", "n2-job-6",
                                                                  "--force"])
            assert r.returncode == 4 and "permission denied" in r.stderr
            assert names(base / "n2-job-6") == ["ckpt-3"]
        finally:
            await server.stop()
            shutil.rmtree(sock.parent, ignore_errors=True)
            await comp.stop()
            agent.store.db.close()

    asyncio.new_event_loop().run_until_complete(main())


def test_drop_refuses_a_keeper_without_force_a_used_key_and_bad_keys_then_removes_safely(tmp_path: Path) -> None:
    async def main() -> None:
        agent, comp = await started(tmp_path)
        server, sock = await serve(agent, comp)
        try:
            base = comp.root / "checkpoints"  # type: ignore[operator]
            trash = comp.root / "replica-gc"  # type: ignore[operator]
            kept = Source(tmp_path, comp, 2, "n2-job-1")
            await kept.send(4)
            await kept.ctl("keeper", "ckpt-4")
            failed = Source(tmp_path, comp, 3, "n3-job-2")
            await failed.send(1)
            await failed.ctl("keeper", "ckpt-1")
            comp.takeover.set_replica("n3-job-2", custody.Event.FAIL)  # a take-over that found nothing to resume from (see above)
            used = Source(tmp_path, comp, 2, "n2-job-5")
            p = await used.send(9)
            await used.ctl("keeper", "ckpt-9")
            agent.jobs.jobs.append(SimpleNamespace(id="job-8", state="failed", ended=time.time(),
                                                   spec=JobSpec(["train"], resume_from=str(p)), origin=JobOrigin(resume_given=str(p))))
            comp.takeover.set_replica("n2-job-5", custody.Event.HAND_OVER, "job-8")
            before = {k: names(base / k) for k in ("n2-job-1", "n3-job-2", "n2-job-5")}

            # a keeper: refused without --force, saying the job may have no other copy and its source
            rc, out, err = await ctl(sock, "replicas", "drop", "n2-job-1")
            assert rc == 1 and "keeping" in err and "node 2" in err and "--force" in err and "only way back" in err
            # a key a local job resumed from: refused, --force or not
            rc, out, err = await ctl(sock, "replicas", "drop", "n2-job-5", "--force")
            assert rc == 1 and "job-8" in err
            # an unknown key, a key with path characters (the CLI's check, then the agent's own)
            rc, out, err = await ctl(sock, "replicas", "drop", "n9-job-404")
            assert rc == 1 and "no replicas of 'n9-job-404'" in err
            rc, out, err = await ctl(sock, "replicas", "drop", "../../etc")
            assert rc == 2 and "not a replica key" in err
            loop = asyncio.get_running_loop()
            for target, status in (("/v1/migrate/replicas/..%2F..%2Fetc/drop", 400),
                                   ("/v1/migrate/replicas/.hidden/drop", 400),
                                   ("/v1/migrate/replicas/n2-job-1/drop", 400)):
                body = {"force": "yes"} if target.endswith("n2-job-1/drop") else {}
                st, res = await loop.run_in_executor(None, _req, sock, "POST", target, body)
                assert st == status and "replicas drop" in res["error"], res
            assert {k: names(base / k) for k in before} == before
            assert {r["key"] for r in agent.store.db.execute("SELECT key FROM migrate_replicas")} == set(before)

            got: list[dict[str, Any]] = []
            agent.events.subscribe(got.append)
            # a failed key: an operator's to drop; gone from disk, from the table, the trash emptied
            rc, out, err = await ctl(sock, "-o", "json", "replicas", "drop", "n3-job-2")
            assert rc == 0, err
            res = json.loads(out)
            assert res["dropped"] == ["ckpt-1"] and res["state"] == "failed" and not res["forced"] and res["bytes"] > 0
            assert not (base / "n3-job-2").exists() and row(agent, "n3-job-2") is None
            assert await until(lambda: names(trash) == [])
            # the keeper, forced: dropped, with a warning that the source was not told
            rc, out, err = await ctl(sock, "replicas", "drop", "n2-job-1", "--force")
            assert rc == 0 and "dropped n2-job-1 (keeping): ckpt-4" in out and "was not told" in err
            assert not (base / "n2-job-1").exists() and row(agent, "n2-job-1") is None
            assert await until(lambda: names(trash) == [])
            ev = [(e["key"], e["forced"], e["by"]) for e in got if e.get("phase") == "replica-dropped"]
            assert ev == [("n3-job-2", False, "uid 0"), ("n2-job-1", True, "uid 0")]
            assert comp.counts["replica_dropped"] == 2
            rc, out, err = await ctl(sock, "-o", "json", "replicas")
            assert [r["key"] for r in json.loads(out)] == ["n2-job-5"]

            # the GC does not trip over what was dropped, now or a day later
            comp.replicas.tick(time.time(), force=True)
            comp.replicas.tick(time.time() + comp.s["replica_row_keep_s"] + 60, force=True)
            assert sorted(os.listdir(base)) == ["n2-job-5"] and names(base / "n2-job-5") == ["ckpt-9"]
            # a source that prestages again: a new keeper of a new checkpoint, as for any new key
            await kept.send(5)
            await kept.ctl("keeper", "ckpt-5")
            assert names(base / "n2-job-1") == ["ckpt-5"] and row(agent, "n2-job-1")["state"] == "keeping"
            # the failed local job was removed by its operator: its replica may go now
            agent.jobs.jobs.clear()
            rc, out, err = await ctl(sock, "replicas", "drop", "n2-job-5")
            assert rc == 0, err
            assert not (base / "n2-job-5").exists() and row(agent, "n2-job-5") is None
        finally:
            await server.stop()
            shutil.rmtree(sock.parent, ignore_errors=True)
            await comp.stop()
            agent.store.db.close()

    asyncio.new_event_loop().run_until_complete(main())


def test_drop_is_refused_while_a_checkpoint_of_the_key_is_being_received(tmp_path: Path) -> None:
    async def main() -> None:
        agent, comp = await started(tmp_path)
        server, sock = await serve(agent, comp)
        try:
            base = comp.root / "checkpoints"  # type: ignore[operator]
            src = Source(tmp_path, comp, 3, "n3-job-4")
            await src.send(1)  # held, no keeper: droppable but for the transfer below
            ck = Checkpointer(job_id="n3-job-4", ckpt_dir=tmp_path / "big", install_signal=False)
            c = ck.save(os.urandom(6 << 20), step=2)
            send = asyncio.get_running_loop().create_task(
                send_checkpoint("127.0.0.1", comp.port, c, "n3-job-4", KEY, zone=1, node="3", retries=1,
                                chunk_size=256 << 10, rate_bps=16e6))  # about 3 s: paced in user space
            assert await until(lambda: comp.replicas.operator.receiving("n3-job-4"))
            rc, out, err = await ctl(sock, "replicas", "drop", "n3-job-4", "--force")
            receiving = comp.replicas.operator.receiving("n3-job-4")
            assert rc == 1 and "transfer into it is in progress" in err, (rc, err, receiving)
            assert names(base / "n3-job-4")[:1] == ["ckpt-1"]
            await send
            assert names(base / "n3-job-4") == ["ckpt-2"]  # committed: the older one went (the GC's rule)
            rc, out, err = await ctl(sock, "replicas", "drop", "n3-job-4")
            assert rc == 0 and "dropped n3-job-4 (unclaimed): ckpt-2" in out, err
            assert not (base / "n3-job-4").exists()
        finally:
            await server.stop()
            shutil.rmtree(sock.parent, ignore_errors=True)
            await comp.stop()
            agent.store.db.close()

    asyncio.new_event_loop().run_until_complete(main())
