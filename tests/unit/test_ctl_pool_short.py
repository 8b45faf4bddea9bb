"""``laminarctl pool return`` when concurrent returns took servers: the servers that refused
are shown, and a plan that fell short of ``--count`` says why and exits 1 (an operator's script
must not read a partial return as done). The agent here is a stand-in: a real ApiServer on a
real socket answering with what the zone component answers in that case (its behaviour is
tested in test_zone_reclaim.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from laminar.api import ApiServer, Authorizer, Request, Route
from laminarctl.main import main

ANSWER = {"plan": 7, "pool": "inference", "count": 2, "servers": [3], "cost": 12.5, "actions": [],
          "candidates": {}, "unanswered": {}, "told": {}, "refused": {"4": "returned already by plan 6"},
          "short": "1 server(s) short: only 1 loaned server(s) of pool inference answered", "elapsed_ms": 3.1}


def run_ctl(tmp_path: Path, answer: dict[str, Any], argv: list[str]) -> int:
    async def give_back(req: Request) -> dict[str, Any]:
        return answer

    async def go() -> int:
        path = tmp_path / "api.sock"
        server = ApiServer(path, Authorizer("laminar-test-no-such-group"))
        server.add([Route("POST", "/v1/pool/return", give_back, privileged=True)])
        await server.start()
        try:
            return await asyncio.get_running_loop().run_in_executor(None, main, ["--socket", str(path), *argv])
        finally:
            await server.stop()

    return asyncio.run(go())


def test_a_short_return_exits_1_and_names_the_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["pool", "return", "--pool", "inference", "--count", "2"]
    assert run_ctl(tmp_path, ANSWER, argv) == 1
    out = capsys.readouterr()
    text = out.out + out.err
    assert "returned already by plan 6" in text and "1 server(s) short" in text
    assert run_ctl(tmp_path, ANSWER, ["-o", "json", *argv]) == 1
    assert json.loads(capsys.readouterr().out)["short"] == ANSWER["short"]
    assert run_ctl(tmp_path, {**ANSWER, "count": 1, "refused": {}, "short": None}, argv) == 0


@pytest.mark.parametrize("argv", [["pool", "reclaim"], ["reclaim"]])
def test_the_old_spellings_still_return_and_say_the_new_one(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            argv: list[str]) -> None:
    """``pool reclaim`` and ``reclaim --pool``, the names before 2026-12-06, do what ``pool
    return`` does (through its route) for one release, and say on stderr what to write now."""
    full = [*argv, "--pool", "inference", "--count", "2"]
    assert run_ctl(tmp_path, {**ANSWER, "count": 1, "refused": {}, "short": None}, full) == 0
    out = capsys.readouterr()
    assert "is now `pool return`" in out.err and "plan 7" in out.out + out.err
