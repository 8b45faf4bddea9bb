"""``laminarctl job show ID --follow`` ends once the job has ended and its move is over, whatever
phase the move ended in: ``done`` (the job runs elsewhere), ``failed``, but also ``held`` (a
keeper keeps its checkpoint until room frees), ``archived`` and ``archiving`` (its copy goes on
past the window). A move is over when the agent says it ended (``ended``, wall clock); before
that the follow goes on, also while the job already reads ``migrated`` and its move is still at
``handover`` (the agent stops the job a moment before the move's record ends).

The agent is a stand-in here (a client that replays the snapshots the agent's API returned);
the real agent's follow is in tests/cluster/test_migration.py."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from laminarctl import cmd_jobs

TERMINAL = ("done", "failed", "held", "archived", "archiving")


class Replay:
    """Answers GET /v1/jobs/ID and GET /v1/migrations/ID from a list of (job, move) snapshots,
    one per poll; the last one repeats."""

    def __init__(self, snaps: list[tuple[dict[str, Any], dict[str, Any] | None]]) -> None:
        self.snaps = snaps
        self.polls = 0

    def get(self, path: str) -> Any:
        snap = self.snaps[min(self.polls, len(self.snaps) - 1)]
        if path.startswith("/v1/jobs/"):
            return snap[0]
        self.polls += 1
        if self.polls > 50:
            raise AssertionError("the follow did not end after 50 polls")
        return snap[1]


def follow(snaps: list[tuple[dict[str, Any], dict[str, Any] | None]], capsys: pytest.CaptureFixture[str],
           monkeypatch: pytest.MonkeyPatch) -> tuple[Replay, list[dict[str, Any]]]:
    monkeypatch.setattr(cmd_jobs, "FOLLOW_EVERY_S", 0.0)
    client = Replay(snaps)
    args = argparse.Namespace(client=client, id="job-1", output="json", follow=True)
    assert cmd_jobs.cmd_job_show(args) == 0
    return client, [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def job(state: str) -> dict[str, Any]:
    return {"id": "job-1", "state": state, "reason": ""}


def move(phase: str, ended: float | None) -> dict[str, Any]:
    return {"job": "job-1", "phase": phase, "dest": None, "ended": ended, "error": ""}


@pytest.mark.parametrize("phase", TERMINAL)
def test_the_follow_ends_when_the_job_ended_and_its_move_ended_in_any_phase(
        phase: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    client, out = follow([(job("running"), move("checkpoint", None)),
                          (job("reclaimed" if phase != "done" else "migrated"), move(phase, 1.0))], capsys, monkeypatch)
    assert client.polls == 2
    assert out[-1]["migration"]["phase"] == phase


def test_the_follow_goes_on_while_the_job_is_stopped_and_its_move_not_yet_ended(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    client, out = follow([(job("running"), move("transfer", None)), (job("migrated"), move("handover", None)),
                          (job("migrated"), move("done", 2.0))], capsys, monkeypatch)
    assert client.polls == 3
    assert [s["migration"]["phase"] for s in out] == ["transfer", "handover", "done"]


def test_a_job_with_no_move_is_followed_until_it_ends(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    client, out = follow([(job("running"), None), (job("running"), None), (job("exited"), None)], capsys, monkeypatch)
    assert client.polls == 3
    assert [s["state"] for s in out] == ["running", "exited"]
