"""Periodic checkpoints in the archive (``migrate.archive_dir``; a directory of the test that
every agent's namespace sees, as an NFS mount would be seen).

Three agents. The real PyTorch job (examples/train_mnistlike.py on CPU) trains on A; its
checkpoints are prestaged to a keeper B and, while departures without notice are plausible (the
prior: no departure seen yet), archived with a live record naming A and B. A and B then leave
without notice at once (agents SIGKILLed, their jobs' cgroups killed, namespaces deleted): the
keeper's replica goes with B. The third agent C sees both silent for ``orphan_after_s``, claims
the live record and resumes the job from the archived periodic checkpoint, whose weights equal
an uninterrupted run's at that step; the job trains every later step once and ends with the
weights of an uninterrupted run; exactly one copy ran; the job's own archived copies at C are
removed when it ends.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agentproc import REPO, VENV_BIN, remove_cgroup_tree
from archiverig import body_of
from conftest import delete_netns
from harness import wait_until
from test_migrate_archive import finish, submit
from test_migration import (  # noqa: F401  (fixtures: make_cluster, reference_sha)
    HIDDEN,
    STEPS,
    find_migrated,
    job_log,
    make_cluster,
    migrate_config,
    parse_events,
    reference_sha,
    train_cmd,
)

pytestmark = pytest.mark.cluster


def live(arch: Path, key: str) -> dict[str, Any] | None:
    """The body of the key's live record (as its node signed it), or None."""
    return body_of(arch / key / "live.json")


def started(argv: list[str], env: dict[str, str], timeout: float) -> Callable[[], str]:
    """Starts ``argv`` now (in the background: the test waits for the cluster meanwhile); the
    function returned waits for it and gives its stdout, failing the test if it failed."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result() -> str:
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert proc.returncode == 0, (argv, proc.returncode, err[-2000:])
        return out

    return result


def reference_at(step: int, tmp: Path) -> Callable[[], str]:
    """The weights of an uninterrupted run after ``step`` steps (same seed, outside any agent),
    started now and read when the function returned is called."""
    cmd = train_cmd(0.0)
    cmd[cmd.index("--steps") + 1] = str(step)
    run = started(cmd, {"PATH": "/usr/bin:/bin", "LAMINAR_CKPT_DIR": str(tmp / f"ref-{step}")}, 300)
    return lambda: str([e for e in parse_events(run()) if e["event"] == "done"][0]["weights_sha256"])


def archived_weights(ckpt: Path, tmp: Path) -> Callable[[], tuple[int, str]]:
    """(step, weights SHA-256) of an archived checkpoint, loaded the way the job loads it;
    started now and read when the function returned is called."""
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); import torch.nn as nn, train_mnistlike as t;"
        "from laminar import jobkit;"
        "s = jobkit.Checkpointer(ckpt_dir=sys.argv[2], install_signal=False).resume();"
        "m = nn.Sequential(nn.Flatten(), nn.Linear(784, int(sys.argv[3])), nn.ReLU(), nn.Linear(int(sys.argv[3]), 10));"
        "m.load_state_dict(s['model']); print(json.dumps([int(s['step']), t.weights_sha256(m)]))")
    run = started([str(VENV_BIN / "python"), "-c", code, str(REPO / "examples"), str(tmp / "load"), str(HIDDEN)],
                  {"PATH": "/usr/bin:/bin", "LAMINAR_RESUME_FROM": str(ckpt)}, 120)

    def result() -> tuple[int, str]:
        step, sha = json.loads(run().strip().splitlines()[-1])
        return int(step), str(sha)

    return result


def test_node_and_keeper_gone_without_notice_the_job_resumes_from_its_archived_periodic_checkpoint(
        make_cluster, reference_sha, tmp_path):  # noqa: F811
    arch = tmp_path / "archive"
    c = make_cluster(zones=1, per_zone=3, gpus=0, zone_extra=migrate_config(
        retry_base_s=0.5, retry_max_s=2.0, orphan_after_s=2.0, archive_dir=f'"{arch}"',
        archive_gc_s=1.0))  # the archive sweep every second (default 10 s): what the job's end frees goes soon
    a = c.nodes[0]
    go = tmp_path / "go"  # the job sleeps per step (to be watched) until the test creates it
    jid = submit(a, "--name", "train", "--", *train_cmd(0.15, sleep_until=go), gpus=0)
    key = f"n{a.node_id}-{jid}"

    def ready() -> bool:  # a periodic checkpoint past the first, archived, naming the keeper that keeps it
        r = live(arch, key)
        if r is None or r.get("buddy") is None or int(r["ckpt"].removeprefix("ckpt-")) < 30:
            return False
        b = c.nodes[int(r["buddy"]) - 1]
        return any(x["key"] == key and x["state"] == "keeping" for x in b.json("replicas"))

    wait_until(ready, 90, "a periodic checkpoint archived and prestaged to the keeper", every=0.2)
    b = c.nodes[int(live(arch, key)["buddy"]) - 1]  # type: ignore[index]
    x = next(nd for nd in c.nodes if nd is not a and nd is not b)
    a.agent.kill9()  # both leave without notice, at once: nothing more is archived or taken over
    b.agent.kill9()
    for nd in (a, b):
        remove_cgroup_tree(nd.agent.cgroup_root)
        delete_netns(nd.netns)
    on_a = job_log(a, jid)
    assert not any(e["event"] == "done" for e in on_a), "the job ended before its node left"
    rec = live(arch, key)
    assert rec is not None and rec["src_node"] == a.node_id and rec["kind"] == "live", rec
    held = int(rec["ckpt"].removeprefix("ckpt-"))
    assert sorted(p.name for p in (arch / key).glob("ckpt-*")) == [rec["ckpt"]]  # only the newest is kept
    assert max(e["step"] for e in on_a if e["event"] == "step") >= held
    # kept aside now: the claimed directory goes once the resumed job's own checkpoint is archived
    snap = tmp_path / "archived-ckpt"
    shutil.copytree(arch / key / rec["ckpt"], snap)
    # what the archived checkpoint holds and an uninterrupted run to that step, computed while C works
    snap_weights, reference_then = archived_weights(snap, tmp_path), reference_at(held, tmp_path)

    # the resumed job at C archives copies of its own (departures without notice were seen); then
    # it may train the rest at full speed
    nd, resumed = wait_until(lambda: find_migrated(c, key), 60, "the job to resume at C", every=0.3)
    own = f"n{nd.node_id}-{resumed['id']}"
    wait_until(lambda: live(arch, own) is not None, 60, "the resumed job's own archived copy", every=0.2)
    go.touch()
    finish(c, key, x, held, reference_sha)  # resumed at C from exactly the archived step, same final weights
    wait_until(lambda: not (arch / key).exists(), 60, "the claimed directory to go (Sweep.sweep)", every=0.3)
    step, sha = snap_weights()
    assert step == held and held < STEPS
    assert sha == reference_then()  # the archived weights are an uninterrupted run's at that step
    # the resumed job ended at C: its own archived periodic copies are removed
    wait_until(lambda: not (arch / own).exists(), 30, "the ended job's archived copies to go")
