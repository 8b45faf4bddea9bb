"""A real agent whose ``migrate.archive_dir`` stops answering (a dead NFS or FUSE server: every
stat, readdir and open on it waits) stays a working agent: its control socket answers, the
kill switch flips, a job is submitted and starts; its status says the archive is stalled (and
an event says so, once). When the storage answers again, archive work goes on (its sweeps come
round again) and the status says so.

The hung storage is real: ``archive_dir`` is a FUSE mount (tests/fuserig.py, a read-only mirror
of an empty backing directory) whose server is stopped (:meth:`fuserig.EioMount.hang`), so every
call on the mount waits in the kernel, then let go (:meth:`fuserig.EioMount.heal`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, api_json, wait_until
from fuserig import eio_mount, fuse_waiters

pytestmark = pytest.mark.kernel

# poll_s 0.2 and archive_gc_s 0.5: a round every 0.2 s, stalled after 3 x 0.5 s without progress.
MIGRATE = "[migrate]\narchive_dir = \"{arch}\"\npoll_s = 0.2\narchive_gc_s = 0.5\n"
# Bounds for the suite only (how long a look may take before the test gives up): generous.
ANSWER_S = 20.0
WAIT_S = 60.0


def status_of(a: AgentProc) -> dict[str, Any]:
    """The agent's status through its control socket; fails the test when the socket does not
    answer within ANSWER_S (an agent whose loop waits on the archive)."""
    try:
        code, body = api_json(a.sock, "GET", "/v1/status", timeout=ANSWER_S)
    except TimeoutError:
        pytest.fail(f"the agent's control socket did not answer within {ANSWER_S} s (its loop waits on the "
                    f"hung archive)\n--- agent log ---\n{a.log()}")
    assert code == 200, body
    return dict(body)


def archive_of(a: AgentProc) -> dict[str, Any]:
    return dict(status_of(a)["migrate"]["archive"])


def events_of(a: AgentProc, phase: str) -> list[dict[str, Any]]:
    return [e for e in a.json("events", "--kind", "migrate", "--limit", "1000") if e.get("phase") == phase]


def test_a_hung_archive_leaves_the_agent_working_and_is_reported_then_work_goes_on(
        veth_pair: Any, tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    with eio_mount(backing) as fs:
        a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a, extra_toml=MIGRATE.format(arch=fs.path))
        try:
            a.start()
            assert a.proc is not None
            status_of(a)

            fs.hang()
            # the agent looks at its archive and waits: from here on, every look waits
            wait_until(lambda: fuse_waiters(a.proc.pid), WAIT_S, "an agent thread waiting on the hung archive", a.log)
            status_of(a)  # the control socket answers
            stalled = wait_until(lambda: archive_of(a)["stalled_s"], WAIT_S, "the archive reported stalled",
                                 a.log)
            assert stalled > 0
            human = a.ctl("status", timeout=ANSWER_S).stdout  # laminarctl shows it where status is shown
            assert "stalled_s" in human, human
            # the agent works: the kill switch flips both ways, a job is submitted and starts
            a.ctl("killswitch", "on", "--all", timeout=ANSWER_S)
            assert a.json("killswitch", "status")["global"]["flags"] != []
            a.ctl("killswitch", "off", "--all", timeout=ANSWER_S)
            assert a.json("killswitch", "status")["global"]["flags"] == []
            job = a.json("submit", "--name", "lm-t-archive-hung", "--", sys.executable, "-c",
                         "import time; time.sleep(60)")
            wait_until(lambda: a.json("job", "show", job["id"])["state"] == "running", WAIT_S, "the job running", a.log)
            # one blocked look at the archive, never a pile of them (many rounds came and went meanwhile)
            assert len(fuse_waiters(a.proc.pid)) == 1, fuse_waiters(a.proc.pid)
            assert len(events_of(a, "archive-stalled")) == 1, events_of(a, "archive-stalled")
            rounds = archive_of(a)["rounds"]

            fs.heal()
            wait_until(lambda: (s := archive_of(a))["stalled_s"] is None and s["rounds"] >= rounds + 2, WAIT_S,
                       "archive rounds again after the storage answered", a.log)
            ok = events_of(a, "archive-answers")
            assert len(ok) == 1 and "answers again" in ok[0]["message"], ok
            assert len(events_of(a, "archive-stalled")) == 1
        finally:
            fs.heal()  # the agent stops with its storage answering
            a.cleanup()
