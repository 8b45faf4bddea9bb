"""The archive's test rig: migrate components standing for the agents of one zone that share an
archive directory, each holding the zone's keys (and, where a test gives them, node keys) as a
real agent does, so the records they write are really signed and really verified. What a real
zone component would hold is given as a namespace (its node id, zone, keys, pair keys and
roster); nothing here is a stand-in for the archive's own code or files."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from standin_agent import standin_agent

from laminar.components import MigrateAgent
from laminar.migrate.reclaim import ReclaimComponent
from laminar.zone.authority import Policy
from laminar.zone.keys import PairKeys, ZoneKeys, parse_keys, public_key

ZONE = 1
ZONE_KEY = "11" * 32  # the test zone's key (hex)
OTHER_KEY = "22" * 32  # another zone's (or a forger's) key
MEMBERS = range(0, 16)  # the test roster's node ids


def zone_keys(current: str = ZONE_KEY, previous: str | None = None, zone: int = ZONE) -> ZoneKeys:
    """A key file's keys for ``zone``: ``current`` (hex), and ``previous`` when given."""
    text = f"{zone} {current}\n" + (f"{zone} {previous} previous\n" if previous else "")
    return parse_keys(text, "test keys")


def node_keys(nodes: list[int]) -> dict[int, bytes]:
    """A fresh X25519 private key for each node."""
    return {n: secrets.token_bytes(32) for n in nodes}


def pairs_of(node: int, privs: dict[int, bytes], mode: str = "require") -> PairKeys:
    """``node``'s pair keys with every node of ``privs`` (the roster lists their pubkeys)."""
    return PairKeys(node, privs[node], {n: public_key(p) for n, p in privs.items()}, f"node {node} key", mode=mode)


def zone_of(node: int, keys: ZoneKeys | None = None, pairs: PairKeys | None = None, zone: int = ZONE,
            networked: bool = False) -> Any:
    """What the migrate layer reads of a zone component: its node id, zone, keys, pair keys,
    roster (every node of MEMBERS in ``zone``), its policy for peers' jobs, whether it is networked (nothing here talks)."""
    # the rig's records are root's jobs (the test's own checkpoints): every member trusts every
    # other with root's jobs, as a zone whose [zone] root_from lists them all
    return SimpleNamespace(node_id=node, zone=zone, keys=keys if keys is not None else zone_keys(), pairs=pairs,
                           networked=networked, policy=Policy(node, root_from=frozenset(MEMBERS)),
                           membership=SimpleNamespace(by_node={n: SimpleNamespace(zone=zone) for n in MEMBERS}))


def agent_of(node: int, archive: Path, keys: ZoneKeys | None = None, pairs: PairKeys | None = None,
             **settings: Any) -> ReclaimComponent:
    """A component of node ``node`` whose ``archive_dir`` is ``archive``."""
    c = ReclaimComponent()
    c.agent = standin_agent(MigrateAgent, zone=zone_of(node, keys, pairs))
    c.s = {"archive_dir": str(archive), "prestage_unannounced": 0.02, **settings}
    return c


def request(uid: int | None = None, command: list[str] | None = None, **spec: Any) -> dict[str, Any]:
    """A job's request as its node signs it: a valid spec, its owner (this process's uid by
    default: the test's checkpoints are its files), GPUs."""
    return {"spec": {"command": command or ["true"], **spec}, "owner_uid": os.getuid() if uid is None else uid,
            "owner_gid": os.getgid(), "gpus": 0}


def record(key: str, keeper: int | None = 2, **extra: Any) -> dict[str, Any]:
    """What the migrate layer hands the archive for ``key`` (``n<node>-<job>``)."""
    node, job = key[1:].split("-", 1)
    return {"key": key, "src_node": int(node), "src_job": job, "buddy": keeper, "request": request(), **extra}


def snapshot(d: Path) -> dict[str, tuple[int, int, bytes | None]]:
    """Every entry under ``d`` (links not followed): (mode, uid, bytes of a regular file): a
    test compares two snapshots to show nothing changed, byte for byte and mode for mode."""
    out: dict[str, tuple[int, int, bytes | None]] = {}
    for top, dirs, files in os.walk(d, followlinks=False):
        for n in [".", *dirs, *files]:
            p = Path(top) / n
            st = os.lstat(p)
            data = p.read_bytes() if os.path.isfile(p) and not os.path.islink(p) else None
            out[str(p.relative_to(d))] = (st.st_mode, st.st_uid, data if n != "." else None)
        dirs[:] = [x for x in dirs if not os.path.islink(Path(top) / x)]
    return out


def reseal(agent: ReclaimComponent, path: Path, **changes: Any) -> dict[str, Any]:
    """The record at ``path`` written again with ``changes`` to its body, signed by ``agent``
    (as if its node had written it so: an earlier ``ts``, say). Its new body."""
    import json

    body = {**json.loads(path.read_bytes())["body"], **changes}
    with agent.archive.view() as v:
        path.write_bytes(v.auth.seal(body))
    return body


def mark_done(agent: ReclaimComponent, key: str, runner: int, why: str = "superseded", at: float | None = None) -> None:
    """``<archive>/.done/<key>``, signed by ``agent``, as its sweep writes it."""
    import time

    with agent.archive.view() as v:
        agent.archive.gc.mark_done_in(v, key, runner, why, time.time() if at is None else at)


def presigned(src: ReclaimComponent, key: str, ckpt: Path) -> dict[str, Any]:
    """``record(key)`` as a keeper of the job holds it: its request carries the keeper record the
    job's node ``src`` signed for ``ckpt`` when it handed the keeper over (what the keeper
    publishes when it finds no room)."""
    import json
    import time

    from laminar.migrate.archive_auth import PRESIGNED, owner_body
    from laminar.migrate.mover import _manifest_facts

    rec = record(key)
    with src.archive.view() as v:
        env = json.loads(v.auth.seal(owner_body("guard", rec, ckpt.name, *_manifest_facts(ckpt), time.time())))
    rec["request"][PRESIGNED] = env
    return rec


def claimed_by(arch: Path, tmp: Path, key: str, runner: int, resumed: tuple[int, str] | None,
               keys: ZoneKeys | None = None) -> Path:
    """``key``'s job archived by its own node (a real checkpoint) and claimed and started by node
    ``runner`` (its signed ``running-<runner>.json``, ``resumed`` naming where the job runs): the
    key's directory."""
    from laminar.jobkit import Checkpointer

    src = int(key[1:].split("-", 1)[0])
    ckpt = Checkpointer(job_id=key, ckpt_dir=tmp / f"ck-{key}", install_signal=False).save(b"w", step=7)
    agent_of(src, arch, keys).archive.stopped.publish(key, ckpt, record(key))
    r = agent_of(runner, arch, keys)
    assert r.archive.claims.claim(key)
    r.archive.claims.claim_done(key, f"node {runner}", resumed)
    return arch / key


def held_record(path: Path) -> dict[str, Any] | None:
    """The body of the job's own record (its keeper or live record, as its node signed it) that
    the archive file ``path`` holds: itself, what a claim took, what a run record claimed. Read
    as a test reads its own archive (not verified); None when there is none or it is no envelope."""
    import json

    try:
        body = json.loads(path.read_bytes())["body"]
        if body["kind"] == "claim":
            body = body["taken"]["body"]
        return dict(body["record"]["body"]) if body["kind"] == "run" else dict(body)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def body_of(path: Path) -> dict[str, Any] | None:
    """The body of the archive file ``path`` (an envelope), unverified; None when there is none."""
    import json

    try:
        return dict(json.loads(path.read_bytes())["body"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
