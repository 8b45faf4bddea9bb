"""Policy text a caller sends is parsed with bounds (laminar.airlock.policy.parse_bounded): at most
POLICY_TEXT_MAX characters; JSON read at once; TOML in a child process killed after
POLICY_PARSE_S (CPython's TOML parser is quadratic in dotted keys and recursive in arrays);
every problem list capped; never a RecursionError."""

from __future__ import annotations

import asyncio
import time

import pytest

from laminar.airlock import policy as P
from laminar.airlock.policy import PolicyError, parse_bounded, validate


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_json_and_toml_are_read() -> None:
    assert run(parse_bounded('{"thresholds": {"memory.some": 0.2}}')) == {"thresholds": {"memory.some": 0.2}}
    assert run(parse_bounded('[thresholds]\n"memory.some" = 0.2\n')) == {"thresholds": {"memory.some": 0.2}}


def test_text_past_the_cap_is_refused_before_it_is_parsed() -> None:
    with pytest.raises(PolicyError) as e:
        run(parse_bounded("a = 1\n" * 20_000))
    assert e.value.reason == "policy_too_large" and "at most 65536" in str(e.value)


def test_dotted_keys_that_take_long_are_cut_at_the_time_bound() -> None:
    text = "a" + ".a" * 30_000 + " = 1"  # about 13 s for the parser
    assert len(text) <= P.POLICY_TEXT_MAX
    t0 = time.monotonic()
    with pytest.raises(PolicyError) as e:
        run(parse_bounded(text))
    assert e.value.reason == "policy_parse_timeout" and "longer than 2 s" in str(e.value)
    assert time.monotonic() - t0 < P.POLICY_PARSE_S + 5  # a liveness bound: the child was killed


def test_nesting_is_a_policy_error_not_a_recursion_error() -> None:
    with pytest.raises(PolicyError, match="nested too deeply"):
        run(parse_bounded("a = " + "[" * 20_000 + "]" * 20_000))
    with pytest.raises(PolicyError, match="neither valid JSON nor valid TOML"):
        run(parse_bounded("a = = 1"))
    deep: object = 1
    for _ in range(900):
        deep = {"x": deep}
    with pytest.raises(PolicyError):
        validate({"rungs": deep})


def test_problems_are_capped() -> None:
    with pytest.raises(PolicyError) as e:
        validate({f"k{i}": 1 for i in range(100_000)})
    assert len(e.value.problems) == P.PROBLEMS_SHOWN + 1
    assert e.value.problems[-1] == f"policy: ... and {100_000 - P.PROBLEMS_SHOWN} more problems"
    assert len(str(e.value)) < 20_000


def test_the_parse_child_runs_at_the_lowest_cpu_priority() -> None:
    """The agent runs at Nice=-10 (its unit); a user's TOML parse is not the agent's work, so its
    child drops to nice 19: a user who keeps one parsing for its 2 s competes with the users'
    processes, not with the event loop."""
    import os
    from pathlib import Path

    seen: list[int] = []

    async def main() -> None:
        task = asyncio.ensure_future(parse_bounded("a" + ".a" * 30_000 + " = 1"))
        deadline = time.monotonic() + 5
        while not task.done() and time.monotonic() < deadline and len(seen) < 5:
            for d in Path("/proc").iterdir():
                if not d.name.isdigit():
                    continue
                try:
                    stat = (d / "stat").read_text().rpartition(")")[2].split()
                    cmd = (d / "cmdline").read_bytes()
                except OSError:
                    continue
                if int(stat[1]) == os.getpid() and b"tomllib" in cmd:
                    seen.append(int(stat[16]))  # field 19 of stat: the nice value
            await asyncio.sleep(0.05)
        with pytest.raises(PolicyError):
            await task

    run(main())
    assert seen and seen[-1] == 19, seen  # (the first look may come before the child's first line)
