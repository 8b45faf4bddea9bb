"""laminarctl without an agent: usage errors exit 2, a missing agent exits 3, both say why."""

from __future__ import annotations

from pathlib import Path

import pytest

from laminarctl.cmd_core import parse_duration
from laminarctl.main import main


def test_no_agent_is_exit_3_with_a_clear_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--socket", str(tmp_path / "none.sock"), "status"]) == 3
    assert "laminard is not running" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["killswitch", "on"], "--job ID, --all or --lent"),
    (["killswitch", "arm", "--job", "j"], "arm needs --at"),
    (["killswitch", "on", "--job", "j", "--at", "+5s"], "--at goes with arm only"),
    (["killswitch", "arm", "--all", "--at=-3s"], "'-3s' not understood"),
    (["killswitch", "explode"], "invalid choice"),
    (["nosuchcommand"], "invalid choice"),
])
def test_bad_input_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(["--socket", str(tmp_path / "none.sock"), *argv]))
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_durations() -> None:
    assert parse_duration("+30s") == 30
    assert parse_duration("2m") == 120
    assert parse_duration("500ms") == 0.5
    with pytest.raises(ValueError, match="'0s' must be greater than zero"):
        parse_duration("0s")


def test_unload_with_config_talks_to_that_agent_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bpf unload --force --config C` must reach the agent of C, never whichever agent owns the
    default socket (a test's cleanup once unloaded the node's real agent that way)."""
    import os
    import socket
    import threading

    if os.geteuid() != 0:
        pytest.skip("the offline unload needs root")
    other = tmp_path / "other.sock"
    seen: list[bytes] = []
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(other))
    srv.listen(1)
    srv.settimeout(5)

    def serve() -> None:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        seen.append(conn.recv(4096))
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    monkeypatch.setenv("LAMINAR_SOCKET", str(other))  # what a bare laminarctl would talk to
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[agent]\nstate_dir = "{tmp_path}/state"\nsocket = "{tmp_path}/mine.sock"\n'
                   f'[bpf]\npin_root = "{tmp_path}/pins"\n[net]\nuplink = "lo"\n')
    assert main(["bpf", "unload", "--force", "--config", str(cfg)]) == 0
    srv.close()
    t.join(5)
    assert seen == []


def test_an_error_reaches_a_pipe_whole_on_one_line() -> None:
    """A script or a log reading laminarctl's stderr gets each error whole: rich wrapped errors at
    80 columns, also in the middle of a long path, so "zone.keys:2: expected a role" under a long
    directory came out as ".../z" and "one.keys:2: ..." on two lines."""
    import subprocess
    import sys

    long_path = "/tmp/" + "/".join(["lm-t-a-rather-long-directory-name"] * 5) + "/zone.keys"
    msg = f"{long_path}:2: expected a role (current, next or previous), got 'previus'"
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from laminarctl.output import error; "
            "error(sys.argv[2])")
    ctl_dir = str(Path(__file__).resolve().parents[2] / "ctl")
    r = subprocess.run([sys.executable, "-c", code, ctl_dir, msg], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr == f"laminarctl: {msg}\n", r.stderr
