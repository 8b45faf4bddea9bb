"""Config validation: unknown keys and bad values are refused with the key, the value and the fix."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from laminar import config

REPO = Path(__file__).resolve().parents[2]


def test_defaults_make_a_one_node_agent() -> None:
    c = config.load(None)
    assert c.agent.state_dir == "/var/lib/laminar"
    assert c.agent.socket == "/run/laminar/laminard.sock"
    assert c.bpf.pin_root == "/sys/fs/bpf/laminar"
    assert c.net.uplink == ""  # the default route's interface
    assert c.agent.node  # the host name


def test_shipped_toml_documents_every_default() -> None:
    from laminar.agent import import_components

    import_components()  # components register their sections on import
    shipped = tomllib.loads((REPO / "systemd/laminard.toml").read_text())
    assert set(shipped) == set(config.SCHEMA)
    for section, fields in config.SCHEMA.items():
        assert set(shipped[section]) == set(fields), section
        for key, f in fields.items():
            assert shipped[section][key] == f.default, f"{section}.{key}"


@pytest.mark.parametrize("text, needles", [
    ("[net]\nuplnk = 'eth0'\n", ["unknown key net.uplnk", "allowed in [net]", "uplink"]),
    ("[nett]\nuplink = 'eth0'\n", ["unknown section [nett]"]),
    ("[metrics]\nlisten = 'nope'\n", ["metrics.listen = 'nope'", "HOST:PORT"]),
    ("[agent]\nstate_dir = 'relative'\n", ["agent.state_dir = 'relative'", "absolute path"]),
    ("[agent]\nlog_level = 'loud'\n", ["agent.log_level = 'loud'", "debug, info, warning, error"]),
    ("[gpus]\ndeclared = -1\n", ["gpus.declared = -1", ">= 0"]),
    ("[net]\ningress = 'yes'\n", ["net.ingress = 'yes'", "expected true/false"]),
    ("[agent\n", ["not valid TOML"]),
])
def test_bad_config_is_refused_with_key_value_and_fix(tmp_path: Path, text: str, needles: list[str]) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(config.ConfigError) as e:
        config.load(p)
    for n in needles:
        assert n in str(e.value)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[net]\nuplnk = 'x'\n[metrics]\nlisten = 'nope'\n")
    with pytest.raises(config.ConfigError) as e:
        config.load(p)
    assert "net.uplnk" in str(e.value) and "metrics.listen" in str(e.value)


def test_check_config_exits_nonzero_and_names_the_key(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[bpf]\npin_root = 5\n")
    r = subprocess.run([sys.executable, "-m", "laminar.agent", "--check-config", str(p)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "bpf.pin_root = 5: expected a string" in r.stderr
    ok = tmp_path / "ok.toml"
    ok.write_text("[agent]\nnode = 'gpu-1'\n")
    r = subprocess.run([sys.executable, "-m", "laminar.agent", "--check-config", str(ok)], capture_output=True, text=True)
    assert r.returncode == 0 and '"node": "gpu-1"' in r.stdout


@pytest.mark.parametrize("text, needles", [
    # '.' and '..' as the cgroup root: the agent's class parents in the cgroup root itself, or
    # above it; both passed --check-config and the agent failed at start.
    ("[cgroups]\nroot = '..'\n", ["cgroups.root = '..'", "not starting with '.'"]),
    ("[cgroups]\nroot = '.'\n", ["cgroups.root = '.'", "not starting with '.'"]),
    ("[cgroups]\nroot = '.hidden'\n", ["cgroups.root = '.hidden'"]),
    # a declared count the agent would expand to a list of that many GPUs at start
    ("[gpus]\ndeclared = 1000000000000\n", ["gpus.declared = 1000000000000", "0..1024"]),
    ("[gpus]\ndeclared = [0, 5000]\n", ["gpus.declared = [0, 5000]", "0..1023"]),
    # a socket path bind() cannot take (sun_path: 107 bytes), counting the admin socket beside it
    ("[agent]\nsocket = '/run/laminar-" + "x" * 90 + ".sock'\n", ["agent.socket", "too long for a Unix socket",
                                                                  "at most 107"]),
])
def test_values_the_agent_could_not_use_are_refused_by_check_config(tmp_path: Path, text: str,
                                                                    needles: list[str]) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(config.ConfigError) as e:
        config.load(f)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_the_longest_usable_socket_path_is_accepted() -> None:
    path = "/run/" + "x" * (config.SUN_PATH_MAX - len("/run/") - len(".admin.sock")) + ".sock"
    assert len(config.admin_socket_path(path)) == config.SUN_PATH_MAX
    assert config.validate({"agent": {"socket": path}})["agent"]["socket"] == path
    assert config.validate({"gpus": {"declared": 1024}})["gpus"]["declared"] == 1024
