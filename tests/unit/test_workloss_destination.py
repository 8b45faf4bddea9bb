"""bench/workloss.py's Laminar model chooses a move's destination as the agent does
(Mover.candidates): a node already under a reclaim notice is never a destination.

Hand-made node timelines (workloss.Node, seconds), run through the bench's own simulate with
no departures without notice (``abrupt_frac`` 0), so every departure below is announced."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

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


def _abrupt(seed: int, zone: str, at: float, frac: float) -> bool:
    """The bench's draw of whether the departure of a node of ``zone`` at ``at`` comes without
    notice (simulate's ``abrupt``: a draw per (scenario, zone, time))."""
    return workloss.random.Random(f"{seed}:{zone}:{round(at)}").random() < frac


def _moving(leave_after_plan: float, archive: bool) -> tuple[workloss.Result, workloss.Params]:
    """The job's node a-src leaves with notice at D; a-x, the destination the agent ranks first
    (not under notice when the move is planned), leaves *without* notice ``leave_after_plan``
    seconds after the move was planned; b-y stays up. A seed is picked so that exactly a-x's
    departure is abrupt."""
    p = workloss.Params(nodes_per_job=1, rotations=1, abrupt_frac=0.5, archive=archive)
    step = workloss.notice_schedule([workloss.CkptJob("j", p.ckpt_gb_per_node * 1e9, p.write_gbps * 1e9)],
                                    p.link_gbps * 1e9, p.notice_s)[0]
    assert step.final
    x_end = D - p.notice_s + step.signal_at_s + leave_after_plan
    seed = next(s for s in range(200) if not _abrupt(s, "z", D, 0.5) and _abrupt(s, "z", x_end, 0.5))
    src = workloss.Node("a-src", "z", [(0.0, D), (D + 5000.0, FAR)])
    x = workloss.Node("a-x", "z", [(1.0, x_end)])
    y = workloss.Node("b-y", "z", [(1.0, FAR)])
    return workloss.simulate("laminar", [src, x, y], 0.0, END, p, seed=seed), p


def test_a_destination_that_leaves_before_the_checkpoint_arrives_fails_the_move() -> None:
    """Was: the model looked ahead and skipped a-x because it would be gone when the job
    restarted, which the agent cannot know (a-x left without notice). The agent sends to a-x,
    the send fails at the plan's transfer deadline, and every other try gets that passed
    deadline: the move fails, the job trains on to the window's end and its keeper (b-y)
    resumes it from its replica."""
    write_s = 8.0 / 2.0
    r, p = _moving(write_s + 3.0, archive=False)  # mid-transfer (the send takes 6.4 s)
    assert r.moves_failed == 1 and r.moves_lost == 0
    assert r.migrations == 0 and r.held == 0 and r.fallbacks == 1
    xfer = p.ckpt_gb_per_node / p.link_gbps
    assert abs(r.down["final_transfer"] - xfer) < 1e-6  # frozen while the send stalled
    assert r.down["resume_transfer"] > 0  # from the keeper's replica


def test_a_destination_that_leaves_while_restarting_the_job_loses_it() -> None:
    """Was: skipped by look-ahead as above. After the hand-over the destination is the job's
    only keeper (the source stopped it, the old keeper was released): when it leaves without
    notice mid-restart the final checkpoint is gone; without the archive the job starts over,
    with it an agent with room claims it from its newest archived periodic checkpoint."""
    xfer_done = 8.0 / 2.0 + 8.0 / 1.25
    r, p = _moving(xfer_done + 20.0, archive=False)
    assert r.moves_lost == 1 and r.moves_failed == 0 and r.migrations == 1
    assert r.dest_lost == 1 and r.archive_claims == 0
    assert r.reclaims == 2  # a-src, then a-x under the restarting job
    assert r.rollback_node_s > D / 2  # the job's progress (about D s on one node) is rolled back
    ra, _ = _moving(xfer_done + 20.0, archive=True)
    assert ra.moves_lost == 1 and ra.dest_lost == 0 and ra.archive_claims == 1
    assert ra.rollback_node_s < r.rollback_node_s  # back to the archived copy, not to the start


def test_the_old_flag_for_no_keeper_still_works_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``--no-keeper`` was ``--no-holder`` until 2026-12-06 (old spelling): read for one release."""
    seen: list[workloss.Params] = []
    monkeypatch.setattr(workloss, "run", lambda trace, sets, scen, p: seen.append(p) or {})
    monkeypatch.setattr(workloss, "both_configs", lambda *a: {})
    assert workloss.main(["--quick", "--trace", str(tmp_path), "--no-holder"]) in (0, None)  # old spelling
    assert [p.keeper for p in seen] == [False, False]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is now `--no-keeper`" in err, err
    seen.clear()
    assert workloss.main(["--quick", "--trace", str(tmp_path), "--no-keeper"]) in (0, None)
    assert [p.keeper for p in seen] == [False, False] and capsys.readouterr().err == ""
