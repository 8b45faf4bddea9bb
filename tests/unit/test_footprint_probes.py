"""bench/footprint.py signs its probes ahead of the load with the agent's wire codec; a wire
change the bench does not follow makes the agent drop every probe (as `bad_mac` when the MAC
came to cover the receiver's node id), and the benchmark then measures nothing. The probes it
writes must decode at the agent (node 1) as probes, each releasing the one before."""

from __future__ import annotations

import os
import secrets
import struct
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import footprint  # noqa: E402

from laminar.zone import wire  # noqa: E402
from laminar.zone.keys import load_keys  # noqa: E402


def test_the_benchs_probes_verify_at_the_agent(tmp_path: Path) -> None:
    keys = tmp_path / "zone.keys"
    keys.write_text(f"1 {secrets.token_hex(32)}\n")
    os.chmod(keys, 0o600)
    out = tmp_path / "probes.bin"
    footprint.sign_probes(keys, 5, 10_000, 100, 1000, out)
    raw = out.read_bytes()
    dgrams = []
    i = 0
    while i < len(raw):
        (n,) = struct.unpack_from("<H", raw, i)
        dgrams.append(raw[i + 2:i + 2 + n])
        i += 2 + n
    agent = wire.Decoder(load_keys(str(keys)), {1: 1, 2: 1}, node=1, window_s=3600)
    bodies = [agent.decode(d, time.time()).body for d in dgrams]
    assert [type(b) for b in bodies] == [wire.Probe] * 5, agent.drops
    assert [b.placement_id for b in bodies] == [1000, 1001, 1002, 1003, 1004]
    assert [b.releases for b in bodies] == [(), (1000,), (1001,), (1002,), (1003,)]
    other = wire.Decoder(load_keys(str(keys)), {1: 1, 2: 1}, node=3, window_s=3600)
    for d in dgrams:  # signed for node 1: another node refuses them
        with pytest.raises(wire.Dropped) as e:
            other.decode(d, time.time())
        assert e.value.reason is wire.DropReason.BAD_MAC
