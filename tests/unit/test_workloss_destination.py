"""bench/workloss.py's Laminar model chooses a move's destination as the agent does
(ReclaimComponent.candidates): a node already under a reclaim notice is never a destination.

Hand-made node timelines (workloss.Node, seconds), run through the bench's own simulate with
no departures without notice (``abrupt_frac`` 0), so every departure below is announced."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import workloss  # noqa: E402

D = 10_000.0  # the job's node leaves here, with notice
END = 20_000.0
FAR = END + 10 * 86400.0  # up past the end of the run


def test_a_node_under_notice_is_not_a_move_destination() -> None:
    """Was: the model ranked every free node that was up, so it sent the job to "a-x", which
    had announced its own reclaim (it leaves 60 s after the job's node, inside its notice
    window) and ranks first by name at equal survival; the job then had to move a second time
    when a-x left. The agent never offers a draining node: the move goes to "b-y"."""
    p = workloss.Params(nodes_per_job=1, rotations=1, abrupt_frac=0.0)
    src = workloss.Node("a-src", "z", [(0.0, D), (D + 5000.0, FAR)])
    x = workloss.Node("a-x", "z", [(1.0, D + 60.0)])  # up after the job started on a-src
    y = workloss.Node("b-y", "z", [(1.0, FAR)])
    pool = [src, x, y]
    # the move is planned within 120 s of a-x's departure: a-x is under notice then
    step = workloss.notice_schedule([workloss.CkptJob("j", p.ckpt_gb_per_node * 1e9, p.write_gbps * 1e9)],
                                    p.link_gbps * 1e9, p.notice_s)[0]
    assert D + 60.0 <= D - p.notice_s + step.signal_at_s + p.notice_s
    # ... and still up when the job would run there: only the notice rules it out
    assert D + 60.0 > D - p.notice_s + step.signal_at_s + (p.ckpt_gb_per_node / p.write_gbps) \
        + p.ckpt_gb_per_node / p.link_gbps + p.restart_s
    r = workloss.simulate("laminar", pool, 0.0, END, p, seed=0)
    assert r.reclaims == 1  # a-src only: the job never ran on a-x
    assert r.migrations == 1 and r.fallbacks == 0 and r.held == 0
    assert r.rollback_node_s == 0.0


def test_live_nodes_not_under_notice_are_still_chosen() -> None:
    """The same scenario with a-x leaving well after its notice could have come (an hour
    later): a-x is not under notice when the move is planned, and is chosen as before."""
    p = workloss.Params(nodes_per_job=1, rotations=1, abrupt_frac=0.0)
    src = workloss.Node("a-src", "z", [(0.0, D), (D + 5000.0, FAR)])
    x = workloss.Node("a-x", "z", [(1.0, D + 3600.0)])
    y = workloss.Node("b-y", "z", [(1.0, FAR)])
    pool = [src, x, y]
    r = workloss.simulate("laminar", pool, 0.0, END, p, seed=0)
    assert r.reclaims == 2  # a-src, then a-x (the job went there)
    assert r.migrations == 2
