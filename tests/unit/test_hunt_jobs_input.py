"""Bad job input is refused by validation, naming the value, before anything is stored or made.

A NUL byte in the command, the environment or a path, and a CPU limit under the kernel's
minimum quota (1 ms per 100 ms period: 0.01 CPUs), used to pass `JobSpec.validate` and fail
only when the job started: a failed job record left behind, an internal error (HTTP 500) or a
cgroup error (503) instead of a 400, and for a queued job a failure at its turn. A stop grace
that is not a finite number of seconds (``--grace inf``, JSON ``Infinity``/``NaN``) waited
forever, and a second stop is refused while one is under way, so the job could not be stopped.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from laminar.runtime.spec import STOP_GRACE_MAX_S, JobError, JobSpec, parse_grace_s
from laminarctl.main import main


@pytest.mark.parametrize("spec, needle", [
    ({"command": ["echo", "a\x00b"]}, "NUL"),
    ({"command": ["true"], "env": {"X": "a\x00b"}}, "NUL"),
    ({"command": ["true"], "env": {"X\x00Y": "v"}}, "NUL"),
    ({"command": ["true"], "cwd": "/tmp\x00/x"}, "NUL"),
    ({"command": ["true"], "resume_from": "/ckpt\x00"}, "NUL"),
    ({"command": ["true"], "cpus": 0.001}, "cpus 0.001"),
    ({"command": ["true"], "cpus": 0.009}, "at least 0.01"),
])
def test_spec_refuses_what_the_start_would_fail_on(spec: dict[str, object], needle: str) -> None:
    with pytest.raises(JobError, match=needle):
        JobSpec.from_dict(spec)


def test_spec_keeps_accepting_what_is_valid() -> None:
    s = JobSpec.from_dict({"command": ["echo", "a b"], "env": {"X": "1"}, "cpus": 0.01, "cwd": "/tmp"})
    assert s.cpus == 0.01


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, -1, STOP_GRACE_MAX_S + 1, True, "5"])
def test_grace_must_be_finite_seconds(bad: object) -> None:
    with pytest.raises(JobError, match="grace_s"):
        parse_grace_s(bad)


def test_grace_accepts_none_and_seconds() -> None:
    assert parse_grace_s(None) is None
    assert parse_grace_s(0) == 0
    assert parse_grace_s(2.5) == 2.5


@pytest.mark.parametrize("grace", ["inf", "nan", "1e9"])
def test_cli_refuses_a_grace_that_is_not_finite_seconds(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       grace: str) -> None:
    code = main(["--socket", str(tmp_path / "none.sock"), "job", "stop", "job-1", "--grace", grace])
    assert code == 2, capsys.readouterr()
    assert "--grace" in (err := capsys.readouterr().err) and "expected seconds from 0 to 3600" in err


def test_cli_waits_for_a_long_grace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The request waits out the grace and the kill after it: no 'did not answer' after 120 s."""
    from laminarctl import client

    seen: dict[str, float | None] = {}

    def post(self: client.Client, path: str, body: object = None, timeout: float | None = None) -> object:
        seen["timeout"] = timeout
        return {"id": "job-1", "state": "stopped", "reason": "r"}

    monkeypatch.setattr(client.Client, "post", post)
    assert main(["--socket", str(tmp_path / "none.sock"), "job", "stop", "job-1", "--grace", "600"]) == 0
    assert seen["timeout"] is not None and seen["timeout"] > 600


@pytest.mark.parametrize("sig", ["SIGKILL", "KILL", 9, "SIGSTOP", 19])
def test_checkpoint_signal_must_be_one_a_job_can_catch(sig: object) -> None:
    """No process can handle SIGKILL or SIGSTOP: a job on laminar.jobkit died at its start
    (signal.signal raised OSError), and the agent could never ask for a checkpoint."""
    with pytest.raises(JobError, match="cannot be caught"):
        JobSpec.from_dict({"command": ["true"], "checkpoint_signal": sig})
    assert JobSpec.from_dict({"command": ["true"], "checkpoint_signal": "SIGUSR2"}).checkpoint_signal == "SIGUSR2"
