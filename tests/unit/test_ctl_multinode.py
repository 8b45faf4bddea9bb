"""`laminarctl zone submit --workers N [--elastic A:B] [--launcher ...] [--spread-zones]`, and
`jobs` / `job show` / `job stop` of a multi-node job: what they send and what they print. The
agent is a recording stand-in client here (the routes: tests/unit/test_members_api.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from standin_members import view

import laminarctl.main as ctl_main
from laminarctl.client import CtlError
from laminarctl.main import build_parser


class Recorder:
    """Stand-in for laminarctl.client.Client: records requests, answers from ``answers`` (an
    exception there is raised)."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers, self.calls = answers, []  # type: ignore[var-annotated]

    def _answer(self, path: str) -> Any:
        a = self.answers[path.partition("?")[0]]
        if isinstance(a, Exception):
            raise a
        return a(path) if callable(a) else a

    def post(self, path: str, body: Any, timeout: float | None = None) -> Any:
        self.calls.append(("POST", path, body))
        return self._answer(path)

    def get(self, path: str) -> Any:
        self.calls.append(("GET", path, None))
        return self._answer(path)


def run(argv: list[str], answers: dict[str, Any], code: int = 0) -> Recorder:
    args = build_parser().parse_args(argv)
    args.output = getattr(args, "output", "table")
    args.client = Recorder(answers)
    assert args.func(args) == code
    return args.client


def test_zone_submit_workers_sends_the_gang(capsys: pytest.CaptureFixture[str]) -> None:
    v = view("job-7-n1", 1, [(2, "10.9.0.2"), (3, "10.9.0.3"), (4, "10.9.0.4")], state="starting")
    c = run(["zone", "submit", "--workers", "3", "--gpus", "1", "--elastic", "2:4", "--launcher", "torchrun",
             "--spread-zones", "--", "python", "train.py"], {"/v1/placements": v})
    (_, path, body), = c.calls
    assert path == "/v1/placements" and body["gpus"] == 1 and body["spread_zones"] is True
    spec = body["spec"]
    assert (spec["workers"], spec["workers_min"], spec["workers_max"], spec["launcher"]) == (3, 2, 4, "torchrun")
    assert "elastic_min" not in spec and spec["command"] == ["python", "train.py"]
    out = capsys.readouterr().out
    assert "job-7-n1 starting: 3 members on nodes 2, 3, 4" in out
    for word in ("MEMBER", "NODE", "ADDRESS", "10.9.0.3"):
        assert word in out
    # -o json: the view as the agent gave it
    run(["zone", "submit", "--workers", "3", "-o", "json", "--", "python", "train.py"], {"/v1/placements": v})
    assert json.loads(capsys.readouterr().out) == v


def test_zone_submit_elastic_without_workers_keeps_its_meaning() -> None:
    answer = {"outcome": "placed", "job_id": "job-3", "node": 2, "zone": 1, "elapsed_ms": 1.0, "placement_id": 9}
    c = run(["zone", "submit", "--elastic", "1:2", "--", "python", "t.py"], {"/v1/placements": answer})
    spec = c.calls[0][2]["spec"]
    assert (spec["elastic_min"], spec["elastic_max"]) == (1, 2) and "workers" not in spec


@pytest.mark.parametrize("argv, needle", [
    (["zone", "submit", "--workers", "0", "--", "x"], "--workers 0: expected a number of nodes"),
    (["zone", "submit", "--workers", "3", "--elastic", "4:2", "--", "x"], "--elastic 4:2: MIN 4 is more than MAX 2"),
    (["zone", "submit", "--workers", "3", "--elastic", "two", "--", "x"], "expected MIN:MAX"),
    (["zone", "submit", "--launcher", "plain", "--", "x"], "--launcher: only with --workers"),
    (["zone", "submit", "--spread-zones", "--", "x"], "--spread-zones: only with --workers"),
])
def test_bad_input_is_exit_2_with_the_value(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctl_main, "Client", lambda socket: Recorder({}))
    assert ctl_main.main(argv) == 2
    assert needle in capsys.readouterr().err


def test_a_refusal_exits_1_with_the_agents_message(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    msg = "placement: workers 5: the zone has 3 nodes, and a job has one member per node; ask for at most 3"
    monkeypatch.setattr(ctl_main, "Client", lambda socket: Recorder({"/v1/placements": CtlError(msg, 1)}))
    assert ctl_main.main(["zone", "submit", "--workers", "5", "--", "python", "t.py"]) == 1
    assert msg in capsys.readouterr().err
    # placed nowhere in the end (the view's state ended): exit 1 with its reason
    v = view("job-8-n1", 1, [], state="ended")
    v["end_reason"] = "queued out: no 3 nodes offered within 4 rounds"
    run(["zone", "submit", "--workers", "3", "--", "x"], {"/v1/placements": v}, code=1)
    assert "job-8-n1 not placed: queued out" in capsys.readouterr().out


def test_jobs_and_job_show_list_the_members(capsys: pytest.CaptureFixture[str]) -> None:
    mine = {**view("job-2-n1", 1, [(2, "10.9.0.2"), (3, "10.9.0.3")]), "num": 2, "kind": "multinode"}
    other = view("job-9-n4", 4, [(4, "10.9.0.4"), (1, "10.9.0.1")])
    local = {"id": "job-9-n4", "num": 3, "name": "", "state": "running", "spec": {"command": ["python"]},
             "member": {"job": "job-9-n4", "index": 1, "count": 2, "origin": 4}, "multinode": other}
    one = {"id": "job-1", "num": 1, "name": "a", "state": "running", "spec": {"command": ["sleep"]}}

    def pages(path: str) -> list[dict[str, Any]]:
        return [] if "before=" in path else [one, mine, local]

    run(["jobs"], {"/v1/jobs": pages})
    out = capsys.readouterr().out
    assert "job-2-n1" in out and "members of job-2-n1" in out and "members of job-9-n4" in out
    assert "10.9.0.3" in out and "10.9.0.4" in out and "member 1 of job-9-n4" in out
    run(["jobs", "-o", "json"], {"/v1/jobs": pages})
    listed = json.loads(capsys.readouterr().out)
    assert [j["id"] for j in listed] == ["job-1", "job-2-n1", "job-9-n4"] and listed[1]["members"][1]["node"] == 3
    c = run(["job", "show", "job-2-n1"], {"/v1/jobs/job-2-n1": mine, "/v1/migrations/job-2-n1": CtlError("no", 1)})
    assert c.calls[0] == ("GET", "/v1/jobs/job-2-n1", None)
    out = capsys.readouterr().out
    assert "job job-2-n1" in out and "members of job-2-n1" in out and "10.9.0.2" in out
    run(["job", "show", "job-2-n1", "-o", "json"], {"/v1/jobs/job-2-n1": mine,
                                                    "/v1/migrations/job-2-n1": CtlError("no", 1)})
    assert json.loads(capsys.readouterr().out) == mine


def test_job_stop_of_a_multinode_job(capsys: pytest.CaptureFixture[str]) -> None:
    v = view("job-2-n1", 1, [(2, "10.9.0.2")], state="ended")
    v["end_reason"] = "stopped by uid 0"
    c = run(["job", "stop", "job-2-n1"], {"/v1/jobs/job-2-n1/stop": v})
    assert c.calls[0][:2] == ("POST", "/v1/jobs/job-2-n1/stop")
    assert "job-2-n1 ended: stopped by uid 0" in capsys.readouterr().out
