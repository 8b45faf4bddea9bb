"""One agent per node: a second laminard started against a running one's socket exits 1 before
it starts any component (it would re-attach the first one's filters, reattach its jobs and sweep
its files), and the first keeps serving. ``GET /v1/events`` answers at most 1,000 events: a
``limit`` of -1 (SQLite: no limit) or above that is refused, naming the value; laminarctl reads
more in pages. Once ready, the
agent gives the memory its start-up freed back to the OS (and logs how much)."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import time

import pytest
from agentproc import VENV_BIN, AgentProc, api_json, wait_until

pytestmark = pytest.mark.kernel


def test_a_second_agent_on_a_live_socket_does_not_start(agent: AgentProc) -> None:
    job = agent.json("submit", "--", "sleep", "600")

    def maps() -> list[dict[str, object]]:  # each map and its pin (entry counts are up to 1 s old: netguard.MAP_COUNTS_S)
        return [{k: v for k, v in m.items() if k != "entries"} for m in agent.json("bpf", "maps")]

    before = maps()
    r = subprocess.run(agent.argv(str(VENV_BIN / "laminard"), "--config", str(agent.config_path)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "another laminard answers on" in r.stderr
    assert "netguard" not in r.stderr.split("another laminard")[0].lower()  # refused before any component
    # the first agent is untouched: it answers, its job runs, its maps are the same pins
    assert agent.json("job", "show", job["id"])["state"] == "running"
    assert maps() == before
    agent.ctl("job", "stop", job["id"], "--grace", "0")


def test_events_limit_is_bounded(agent: AgentProc) -> None:
    """The agent answers at most 1000 events a request (10,000 decoded on the loop per request,
    32 at once per user, stalled it 3.8 s); laminarctl reads more in pages (?before=)."""
    for bad in ("-1", "0", "100001"):
        r = agent.ctl("events", "--limit", bad, check=False)
        assert r.returncode == 2 and f"--limit {bad}: expected 1 to 100000 events" in r.stderr, (bad, r.stderr)
    for bad in ("0", "1001"):
        code, out = api_json(agent.sock, "GET", f"/v1/events?limit={bad}")
        assert code == 400 and "expected 1..1000" in out["error"], out
    db = sqlite3.connect(str(agent.state_dir / "laminar.db"), timeout=30)
    with db:
        db.executemany("INSERT INTO events(ts, kind, message, fields) VALUES(?, 'lm-t', ?, '{}')",
                       [(time.time(), f"e{i}") for i in range(2500)])
    db.close()
    got = agent.json("events", "--kind", "lm-t", "--limit", "2400")
    assert [e["message"] for e in got] == [f"e{i}" for i in range(100, 2500)]  # three pages, oldest first
    assert len(agent.json("events", "--kind", "lm-t", "--limit", "5000")) == 2500


def test_sighup_does_not_kill_a_one_node_agent(agent: AgentProc) -> None:
    """``systemctl reload`` sends SIGHUP; an agent whose zone is not networked has nothing to
    re-read, and SIGHUP's default action would have ended it."""
    import os
    import signal
    import time

    assert agent.proc is not None
    os.kill(agent.proc.pid, signal.SIGHUP)
    time.sleep(0.5)
    assert agent.proc.poll() is None, "laminard died of SIGHUP"
    assert agent.json("status")["agent"]


def test_start_up_returns_freed_memory_to_the_os(agent: AgentProc) -> None:
    """What start-up freed (compiling modules without cached bytecode) is given back once the
    agent is ready (laminar.agent.release_freed_memory): glibc kept it behind the objects
    start-up keeps, and an idle agent stayed several MB larger for its whole life."""
    wait_until(lambda: re.search(r"start-up: \d+ KiB of freed memory returned to the OS", agent.log_path.read_text()),
               30, "the start-up's malloc_trim line", agent.log)
