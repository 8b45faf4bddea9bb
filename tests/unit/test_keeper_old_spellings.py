"""What an older agent, peer or user may still say with a keeper's old names (until 2026-12-06 a
keeper was a buddy, a guard or a holder: old spelling), read for one release: the control op
(answered as ``keeper``; this agent sends only ``keeper``), the migrate section's config keys
(read as the new ones, with a logged note; both names at once refused) and the status field
``migrate.buddies`` (the same as ``migrate.keepers``: old spelling). The store's tables:
tests/unit/test_keeper_tables_upgrade.py."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from test_migrate_evidence import make_agent

from laminar import config
from laminar.migrate import keepers, mover, takeover
from laminar.migrate.control import OLD_CONTROL_OPS, Control
from laminar.migrate.reclaim import ReclaimComponent
from laminar.migrate.transfer.channel import KEEPER_MAX, LARGE_HEADERS

OLD_OP = next(old for old, new in OLD_CONTROL_OPS.items() if new == "keeper")
OLD_KEYS = config.OLD_KEYS["migrate"]


def run(coro: Any) -> Any:
    return asyncio.new_event_loop().run_until_complete(coro)


def test_the_old_op_is_answered_as_keeper_and_only_keeper_is_sent(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, int, dict[str, Any]]] = []

    def op_keeper(self: Control, node: str, asker: int, body: dict[str, Any]) -> Any:
        seen.append((node, asker, body))
        return {"keeping": body["key"]}
    monkeypatch.setitem(Control.OPS, "keeper", op_keeper)

    async def main() -> None:
        agent = make_agent(tmp_path)
        comp = ReclaimComponent()
        await comp.start(agent)
        try:
            assert comp.control.answer("2", OLD_OP, {"key": "n2-job-1"}) == {"keeping": "n2-job-1"}
            assert comp.control.answer("2", "keeper", {"key": "n2-job-2"}) == {"keeping": "n2-job-2"}
            assert seen == [("2", 2, {"key": "n2-job-1"}), ("2", 2, {"key": "n2-job-2"})]
            assert OLD_OP not in Control.OPS  # not listed, not sent
            # the status field's old spelling, the same map
            comp.prestage.keeper["job-1"] = 3
            st = comp.status()
            assert st["keepers"] == {"job-1": 3} and st["buddies"] == st["keepers"]  # old spelling
        finally:
            await comp.stop()
    run(main())
    # the sender's code names the new op only
    src = "".join(Path(m.__file__).read_text() for m in (mover, keepers, takeover))
    assert f'_control(node, "{OLD_OP}"' not in src and src.count('_control(node, "keeper"') == 3


def test_the_old_op_may_carry_a_job_spec_as_keeper_does() -> None:
    old = b'{"t":"ctl","op":"' + OLD_OP.encode() + b'",'
    assert LARGE_HEADERS[old] == LARGE_HEADERS[b'{"t":"ctl","op":"keeper",'] == KEEPER_MAX


def test_the_old_config_keys_are_read_as_the_new_ones_with_a_note(caplog: pytest.LogCaptureFixture) -> None:
    assert set(OLD_KEYS.values()) == {"keeper", "keeper_reserve_mb", "replica_keeper_check_s"}
    old = {new: o for o, new in OLD_KEYS.items()}
    given = {old["keeper"]: False, old["keeper_reserve_mb"]: 512, old["replica_keeper_check_s"]: 60}
    with caplog.at_level(logging.WARNING, logger="laminar.config"):
        got = config.validate({"migrate": given}, source="test.toml")["migrate"]
    assert got["keeper"] is False and got["keeper_reserve_mb"] == 512 and got["replica_keeper_check_s"] == 60
    assert not set(OLD_KEYS) & set(got)
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 3 and all("read for one release" in n for n in notes), notes
    assert any(f"migrate.{old['keeper']} is now migrate.keeper" in n for n in notes), notes
    # the new names need no note
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="laminar.config"):
        assert config.validate({"migrate": {"keeper": False}})["migrate"]["keeper"] is False
    assert caplog.records == []


def test_a_key_under_both_names_is_refused() -> None:
    old = next(k for k, v in OLD_KEYS.items() if v == "keeper")
    with pytest.raises(config.ConfigError, match=f"migrate.{old} and migrate.keeper both given"):
        config.validate({"migrate": {old: False, "keeper": True}}, source="test.toml")
    # and a bad value under the old name is refused as under the new one
    with pytest.raises(config.ConfigError, match="migrate.keeper = 'yes': expected true/false"):
        config.validate({"migrate": {old: "yes"}}, source="test.toml")
