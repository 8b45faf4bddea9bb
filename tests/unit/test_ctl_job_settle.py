"""`laminarctl job settle ID --run-here|--gone` and `laminarctl migrations --pending`: what
they parse and what they ask the agent. The agent is a recording stand-in client here (the
route itself: tests/kernel/test_handover_settle.py; a real laminard refusing it to a second
user: tests/kernel/test_security_routes.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from laminarctl.main import build_parser


class Recorder:
    """Stand-in for laminarctl.client.Client: records requests, answers from ``answers``."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers, self.calls = answers, []  # type: ignore[var-annotated]

    def post(self, path: str, body: Any, timeout: float | None = None) -> Any:
        self.calls.append(("POST", path, body))
        return self.answers[path]

    def get(self, path: str) -> Any:
        self.calls.append(("GET", path, None))
        return self.answers[path]


def run(argv: list[str], answers: dict[str, Any]) -> Recorder:
    args = build_parser().parse_args(argv)
    args.output = getattr(args, "output", "table")
    args.client = Recorder(answers)
    assert args.func(args) == 0
    return args.client


@pytest.mark.parametrize("flag,decision", [("--run-here", "run-here"), ("--gone", "gone")])
def test_settle_posts_the_decision(flag: str, decision: str, capsys: pytest.CaptureFixture[str]) -> None:
    answer = {"job": "job-3", "kind": "move", "node": 2, "decision": decision, "state": "running"}
    c = run(["job", "settle", "3", flag], {"/v1/migrations/3/settle": answer})
    assert c.calls == [("POST", "/v1/migrations/3/settle", {"decision": decision})]
    out = capsys.readouterr().out
    assert "job-3" in out and "node 2" in out


@pytest.mark.parametrize("argv", [["job", "settle", "3"], ["job", "settle", "3", "--run-here", "--gone"],
                                  ["job", "settle", "--gone"]])
def test_settle_needs_one_decision_and_a_job(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2


def test_migrations_pending_lists_node_state_and_since(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"job": "job-4", "kind": "move", "node": 2, "state": "unconfirmed", "since": time.time(), "error": "x"}]
    c = run(["migrations", "--pending", "-o", "json"], {"/v1/migrate/handovers": rows})
    assert c.calls == [("GET", "/v1/migrate/handovers", None)]
    assert '"unconfirmed"' in capsys.readouterr().out
    run(["migrations", "--pending"], {"/v1/migrate/handovers": rows})
    out = capsys.readouterr().out
    assert "job-4" in out and "unconfirmed" in out
    run(["migrations", "--pending"], {"/v1/migrate/handovers": []})
    cap = capsys.readouterr()
    assert "no pending hand-over" in cap.out + cap.err
