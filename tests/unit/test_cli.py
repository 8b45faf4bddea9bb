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
