"""Zone hot path: what checking and decoding one datagram costs (``laminar.zone.wire.Decoder``),
with the zone key's MAC and with node keys (the pair MAC, docs/protocol.md, *Node keys*).

A member (node 2) signs probes for node 1 beforehand, each with its own sequence number; the
bench times node 1's decoder over them (MAC check, replay window, body), and node 2's encoder
signing them. Each figure is the best of ``--rounds`` runs over ``--n`` datagrams (the runs of
the two modes alternate; on a shared machine the best is the steadiest figure, the median moves
by a microsecond from one invocation to the next), in microseconds per datagram, on one core,
in-process (no socket): the cost node keys add is the pair key's lookup (derived once per peer
and zone key, then cached), the MAC being one HMAC-SHA256 either way.

    python bench/wire_decode.py [--n 50000] [--rounds 15] [--json PATH] [--agent DIR]

``--agent DIR`` imports ``laminar`` from DIR instead of this checkout's ``agent/`` (to measure
another version, e.g. ``git archive HEAD~1 agent | tar -x -C /tmp/x``, then ``--agent
/tmp/x/agent``); a version without node keys reports the zone-key figures only. No privileges.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run(n: int, rounds: int, node_keys: bool) -> dict[str, dict[str, float]]:
    """Best microseconds per datagram, decoding and encoding, by mode: ``zone_key`` and (with
    ``node_keys``) ``node_keys``."""
    from laminar.zone import wire
    from laminar.zone.keys import ZoneKeys

    keys = ZoneKeys({1: secrets.token_bytes(32)}, "bench")
    known = {i: 1 for i in range(1, 9)}
    modes: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {"zone_key": ({}, {})}
    if node_keys:
        from laminar.zone.keys import PairKeys, public_key

        priv = {i: secrets.token_bytes(32) for i in known}
        pubs = {i: public_key(k) for i, k in priv.items()}
        modes["node_keys"] = ({"pairs": PairKeys(2, priv[2], pubs)}, {"pairs": PairKeys(1, priv[1], pubs)})
    probe = wire.Probe(1, 100, 1000, 4096, 100, "H100", "", ())
    best = {m: {"decode_us": float("inf"), "encode_us": float("inf")} for m in modes}
    for _ in range(rounds):
        for mode, (enc_kw, dec_kw) in modes.items():
            enc = wire.Encoder(2, keys, seq0=1, **enc_kw)
            now = time.time()
            t = time.perf_counter()
            data = [enc.encode(probe, 1, now, to=1) for _ in range(n)]
            b = best[mode]
            b["encode_us"] = min(b["encode_us"], (time.perf_counter() - t) / n * 1e6)
            dec = wire.Decoder(keys, known, node=1, **dec_kw)
            decode = dec.decode
            t = time.perf_counter()
            for d in data:
                decode(d, now)
            b["decode_us"] = min(b["decode_us"], (time.perf_counter() - t) / n * 1e6)
            assert dec.accepted == n, dec.stats()
    return {m: {k: round(v, 3) for k, v in b.items()} for m, b in best.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50_000, help="datagrams per run (default 50000)")
    ap.add_argument("--rounds", type=int, default=15, help="runs of each mode; the best is reported (default 15)")
    ap.add_argument("--json", help="write the figures to this file too")
    ap.add_argument("--agent", default=str(REPO / "agent"), help="import laminar from this directory")
    a = ap.parse_args()
    if a.n < 1 or a.rounds < 1:
        ap.error(f"--n {a.n} and --rounds {a.rounds} must be at least 1")
    sys.path.insert(0, a.agent)
    import laminar.zone.keys as k

    where = str(Path(k.__file__).resolve().parents[2])
    if where != str(Path(a.agent).resolve()):
        ap.error(f"--agent {a.agent}: laminar was imported from {where} instead (an installed package shadows it)")
    out: dict[str, Any] = {"agent": where, "n": a.n, "rounds": a.rounds, "node_keys": None}
    out.update(run(a.n, a.rounds, hasattr(k, "PairKeys")))
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
