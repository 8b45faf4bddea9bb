"""An agent restarted with another ``bpf.pin_root`` keeps every switch and leaves no pins behind.

The switches live in the pinned maps. When ``bpf.pin_root`` changed between two runs, the new run
found no pins at the new root, loaded empty maps and replaced the filters with programs that use
them: a job that was cut came back uncut, an armed deadline was gone, a cut flow flowed again.
The old pins stayed under /sys/fs/bpf for good, and the agent's record kept naming the old root
(it was only rewritten when the uplink changed), so ``bpf unload --force`` removed the old pins and
left the new ones. The agent now moves the pins from the recorded root to the new one (the same
maps, re-pinned) before it loads, and records the new root.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc

pytestmark = pytest.mark.kernel

FLOW = "udp:10.78.2.1:40600->10.78.2.2:9600"


def test_a_new_pin_root_keeps_the_cuts_and_the_old_root_goes(agent: AgentProc) -> None:
    a = agent
    job = a.json("submit", "--name", "lm-t-pinroot", "--", "sleep", "600")
    armed = a.json("submit", "--name", "lm-t-pinroot-armed", "--", "sleep", "600")
    a.json("killswitch", "on", "--job", job["id"])
    a.json("killswitch", "arm", "--job", armed["id"], "--at", "+600s")
    a.json("net", "kill-flow", FLOW, "on")
    a.stop()
    old_root = a.pin_root
    new_root = Path(f"/sys/fs/bpf/laminar-t-{secrets.token_hex(3)}")
    a.config_path.write_text(a.config_path.read_text().replace(f'pin_root = "{old_root}"', f'pin_root = "{new_root}"'))
    a.pin_root = new_root  # cleanup removes this one
    try:
        a.start()
        rows: dict[str, Any] = {r["job"]: r for r in a.json("killswitch", "status")["jobs"]}
        assert rows[job["id"]]["kill"], rows
        assert rows[armed["id"]]["armed_in_s"] and rows[armed["id"]]["armed_in_s"] > 500, rows
        flows = {f["flow"]: f for f in a.json("net", "flows")}
        assert flows.get(FLOW, {}).get("kill"), flows
        assert (new_root / "lm_jobs").exists()
        assert not old_root.exists() or not any(old_root.iterdir()), sorted(p.name for p in old_root.iterdir())
        a.stop()
        r = a.ctl("bpf", "unload", "--force", "--config", str(a.config_path), check=False)
        assert r.returncode == 0, r.stderr
        assert not new_root.exists() or not any(p.name.startswith("lm_") for p in new_root.iterdir())
    finally:
        if old_root.exists():
            for p in old_root.iterdir():
                p.unlink()
            old_root.rmdir()
