"""Components reach each other through the typed interfaces of ``laminar.components``, never
``getattr(agent, "...", None)`` (issue 32): anywhere in the package, the migration layer
(``migrate/``, through ``MigrateAgent``) included."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from standin_agent import interface_names, standin_agent

import laminar
from laminar.components import AirlockAgent, MigrateAgent, NetGuardAgent, ZoneAgent

PKG = Path(laminar.__file__).parent
# getattr(agent, "x", ...), getattr(self.agent, ...), getattr(self.host.agent, ...), ...
LOOKUP = re.compile(r'getattr\([a-z_.]*agent, "')


def test_no_component_looks_the_agent_up_by_name() -> None:
    files = sorted(PKG.rglob("*.py"))
    assert any(p.is_relative_to(PKG / "migrate") for p in files)  # the migration layer is looked at too
    found = [f"{p.relative_to(PKG)}:{n}: {line.strip()}"
             for p in files
             for n, line in enumerate(p.read_text().splitlines(), 1) if LOOKUP.search(line)]
    assert not found, "use the component's interface in laminar/components.py:\n" + "\n".join(found)


def test_a_stand_in_agent_gives_every_name_of_its_interface() -> None:
    agent = standin_agent(ZoneAgent, store="the store")
    assert interface_names(ZoneAgent) == ["api", "components_started", "config", "events", "jobs", "members", "migrate",
                                         "store"]
    assert agent.store == "the store" and agent.migrate is None and agent.jobs is None
    assert agent.components_started.is_set()  # nothing of the stand-in is still to start
    assert "request_stop" in interface_names(NetGuardAgent)  # a method is a name too
    assert interface_names(MigrateAgent) == ["api", "config", "events", "jobs", "metrics", "netguard", "schedulers", "store",
                                             "transfers", "zone"]


def test_a_stand_in_agent_refuses_a_name_its_interface_does_not_have() -> None:
    with pytest.raises(TypeError, match="AirlockAgent names no zone"):
        standin_agent(AirlockAgent, zone=object())
