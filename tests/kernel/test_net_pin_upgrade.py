"""An agent finds pinned maps of another build (a resized map): it starts, and cuts stay cut.

The maps are pinned so a restarted agent reattaches them. libbpf reuses a pin only when its type,
key and value sizes and max_entries are the object's; an upgrade that resized a map (say
LM_MAX_FLOWS or LM_MAX_JOBS) met the old build's pins and every start failed at load
("couldn't reuse pinned map ... parameter mismatch"), over and over under systemd, until someone
ran ``bpf unload --force``, which also removes every cut, the shaping tree and the stored transfers.
netguard now replaces such a pin with the new map and carries its entries over (same key and value
layout, same ABI version), so a job or flow that was cut before the upgrade is still cut after.

The old build's maps are made for real: ``bpftool map create`` with the old sizes, the entries the
first agent wrote copied in, pinned in place of the first agent's pins while no agent runs.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc

from laminar.bpf import abi
from laminar.bpf.libbpf import BpfMap

pytestmark = pytest.mark.kernel

FLOW = "udp:10.78.1.1:40500->10.78.1.2:9500"
OLD_SIZES = {"lm_jobs": ("8", "16", "2048"), "lm_flows": ("40", "40", "512")}  # key, value, max_entries


def make_old_build_map(pin_root: Path, name: str) -> None:
    """Replaces the pin ``name`` with a map of the old build's size holding the same entries."""
    key, value, entries = OLD_SIZES[name]
    tmp = pin_root / f"{name}-oldbuild"
    subprocess.run(["bpftool", "map", "create", str(tmp), "type", "hash", "key", key, "value", value,
                    "entries", entries, "name", name], check=True)
    cur, old = BpfMap.from_pin(pin_root / name), BpfMap.from_pin(tmp)
    try:
        for k, v in cur.items():
            old.update(k, v)
        BpfMap.unpin(pin_root / name)
        old.pin(pin_root / name)
        BpfMap.unpin(tmp)
    finally:
        cur.close()
        old.close()


def max_entries(pin: Path) -> int:
    return int(json.loads(subprocess.run(["bpftool", "-j", "map", "show", "pinned", str(pin)], check=True,
                                         capture_output=True, text=True).stdout)["max_entries"])


def test_pins_of_another_build_are_replaced_and_cuts_carried_over(agent: AgentProc) -> None:
    a = agent
    job = a.json("submit", "--name", "lm-t-pinup", "--", "sleep", "600")
    a.json("killswitch", "on", "--job", job["id"])
    a.json("net", "kill-flow", FLOW, "on")
    a.stop()
    for name in OLD_SIZES:
        make_old_build_map(a.pin_root, name)
    assert max_entries(a.pin_root / "lm_flows") == 512
    a.start()
    assert max_entries(a.pin_root / "lm_flows") == 1024 and max_entries(a.pin_root / "lm_jobs") == 4096
    rows: list[dict[str, Any]] = a.json("killswitch", "status")["jobs"]
    mine = [r for r in rows if r["job"] == job["id"]]
    assert mine and mine[0]["kill"], rows
    flows = {f["flow"]: f for f in a.json("net", "flows")}
    assert flows.get(FLOW, {}).get("kill"), flows
    events = a.ctl("events").stdout
    assert "pinned maps of another build replaced" in events, events


def test_pins_of_another_map_abi_are_replaced_and_none_of_their_entries_read(agent: AgentProc) -> None:
    """Pins whose lm_global says another map ABI version (a layout change that kept the sizes) are
    not reattached: libbpf would have reused them, and this agent read their entries under its own
    layout. They are all replaced and nothing is carried over."""
    a = agent
    job = a.json("submit", "--name", "lm-t-pinabi", "--", "sleep", "600")
    a.json("killswitch", "on", "--job", job["id"])
    a.stop()
    g = BpfMap.from_pin(a.pin_root / "lm_global")
    try:
        raw = bytearray(g.lookup((0).to_bytes(4, "little")) or b"")
        raw[4:8] = (999).to_bytes(4, "little")
        g.update((0).to_bytes(4, "little"), bytes(raw))
    finally:
        g.close()
    before = {n: json.loads(subprocess.run(["bpftool", "-j", "map", "show", "pinned", str(a.pin_root / n)],
                                           check=True, capture_output=True, text=True).stdout)["id"]
              for n in ("lm_jobs", "lm_global")}
    a.start()
    after = {n: json.loads(subprocess.run(["bpftool", "-j", "map", "show", "pinned", str(a.pin_root / n)],
                                          check=True, capture_output=True, text=True).stdout)["id"]
             for n in ("lm_jobs", "lm_global")}
    assert all(after[n] != before[n] for n in before), (before, after)
    g = BpfMap.from_pin(a.pin_root / "lm_global")
    try:
        raw = g.lookup((0).to_bytes(4, "little")) or b""
    finally:
        g.close()
    assert int.from_bytes(raw[4:8], "little") == abi.LM_ABI_VERSION
    events = a.ctl("events").stdout
    assert "not carried over: the old maps' ABI version" in events, events


def set_pinned_abi_version(pin_root: Path, version: int) -> None:
    g = BpfMap.from_pin(pin_root / "lm_global")
    try:
        raw = bytearray(g.lookup((0).to_bytes(4, "little")) or b"")
        raw[4:8] = version.to_bytes(4, "little")
        g.update((0).to_bytes(4, "little"), bytes(raw))
    finally:
        g.close()


def test_pins_of_map_abi_1_are_converted_and_cuts_stay(agent: AgentProc) -> None:
    """Map ABI 1 keyed lm_flows by IPv4 addresses (16-byte keys); ABI 2 by 16-byte addresses with
    IPv4 v4-mapped. An agent upgraded over ABI 1 pins converts their flow keys: a flow cut before
    the upgrade is still cut (and listed as the same flow), a job's cut stays too."""
    a = agent
    job = a.json("submit", "--name", "lm-t-pinv1", "--", "sleep", "600")
    a.json("killswitch", "on", "--job", job["id"])
    a.json("net", "kill-flow", FLOW, "on")
    a.stop()
    # The ABI 1 build's lm_flows: the same entry under its 16-byte IPv4 key.
    tmp = a.pin_root / "lm_flows-abi1"
    subprocess.run(["bpftool", "map", "create", str(tmp), "type", "hash", "key", "16", "value", "40",
                    "entries", str(abi.LM_MAX_FLOWS), "name", "lm_flows"], check=True)
    cur, old = BpfMap.from_pin(a.pin_root / "lm_flows"), BpfMap.from_pin(tmp)
    try:
        entries = list(cur.items())
        assert len(entries) == 1
        k, v = entries[0]
        assert k[:12] == bytes(10) + b"\xff\xff" and k[16:28] == bytes(10) + b"\xff\xff"
        old.update(k[12:16] + k[28:32] + k[32:37] + bytes(3), v)
        BpfMap.unpin(a.pin_root / "lm_flows")
        old.pin(a.pin_root / "lm_flows")
        BpfMap.unpin(tmp)
    finally:
        cur.close()
        old.close()
    set_pinned_abi_version(a.pin_root, 1)
    a.start()
    flows = {f["flow"]: f for f in a.json("net", "flows")}
    assert flows.get(FLOW, {}).get("kill"), flows
    rows: list[dict[str, Any]] = a.json("killswitch", "status")["jobs"]
    assert [r for r in rows if r["job"] == job["id"] and r["kill"]], rows
    assert json.loads(subprocess.run(["bpftool", "-j", "map", "show", "pinned", str(a.pin_root / "lm_flows")],
                                     check=True, capture_output=True, text=True).stdout)["bytes_key"] == 40
    g = BpfMap.from_pin(a.pin_root / "lm_global")
    try:
        assert int.from_bytes((g.lookup((0).to_bytes(4, "little")) or b"")[4:8], "little") == abi.LM_ABI_VERSION
    finally:
        g.close()
    events = a.ctl("events").stdout
    assert f"converted from map ABI version 1 to {abi.LM_ABI_VERSION}" in events, events
