"""Shared test fixtures and the CI rule: in CI (CI=true) a skipped kernel or cluster test fails.

Kernel tests build their own network namespaces, veth pairs and cgroups, named with the
project's prefix (`lm-t-…`, `lmt…`), and remove them afterwards even when the test fails.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
REPO = Path(__file__).resolve().parents[1]


def kernel_ready() -> str | None:
    """Why kernel tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root"
    if not Path("/sys/kernel/btf/vmlinux").exists():
        return "no kernel BTF at /sys/kernel/btf/vmlinux"
    objs = REPO / "agent/laminar/bpf/objects"
    if not (objs / "netguard.bpf.o").exists():
        return f"BPF objects not built in {objs} (run `make bpf`)"
    for tool in ("ip", "tc", "bpftool", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (run `make setup`)"
    return None


def pytest_configure(config: pytest.Config) -> None:
    # A run started in the background by a non-interactive shell (`pytest ... &` in a script or a
    # CI step) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt: SIGINT
    # (Ctrl-C, `kill -INT`) did not stop the run. It does now; fixtures still clean up.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # SIGTERM (`timeout`, a CI runner giving up, `kill`) ends the run the same way, cleaning up: by
    # default it killed pytest on the spot and left every live fixture's namespaces, agents,
    # pins and cgroups behind.
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, signal.default_int_handler)


@contextlib.contextmanager
def _sigint_held(got: list[int]) -> Iterator[None]:
    """While fixtures clean up, Ctrl-C (SIGINT) or SIGTERM is noted in `got` instead of raised: a
    KeyboardInterrupt inside one fixture's teardown made pytest skip every teardown after it on
    that test (another fixture's namespaces, agents, cgroups were left behind)."""
    held = [s for s in (signal.SIGINT, signal.SIGTERM)  # not pdb's, or someone else's
            if signal.getsignal(s) is signal.default_int_handler]
    for s in held:
        signal.signal(s, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for s in held:
            signal.signal(s, signal.default_int_handler)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Ctrl-C during a test's teardown stops the run once every fixture of it cleaned up."""
    got: list[int] = []
    try:
        with _sigint_held(got):
            return (yield)
    finally:
        if got:
            raise KeyboardInterrupt  # over a teardown error too: the run stops


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Iterator[None]:
    """The last teardowns (also those of a run stopped by Ctrl-C) finish despite another Ctrl-C;
    the run then ends as interrupted."""
    got: list[int] = []
    with _sigint_held(got):
        result = yield
    if got:
        session.exitstatus = pytest.ExitCode.INTERRUPTED
    return result


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = kernel_ready()
    if why is None:
        return
    for item in items:
        if item.get_closest_marker("kernel") or item.get_closest_marker("cluster"):
            item.add_marker(pytest.mark.skip(reason=f"kernel test: {why}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and (item.get_closest_marker("kernel") or item.get_closest_marker("cluster")):
        # A kernel test that does not run in CI hides a broken data plane: count it as failed.
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.longrepr = f"kernel/cluster test skipped in CI (CI=true), which counts as a failure: {reason}"


def run(*argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    return subprocess.run(list(argv), check=check, text=True, capture_output=True, **kw)


@dataclass
class Netns:
    """A network namespace of the test's own, entered with `nsenter --net` only.

    `ip netns exec` would also remount /sys, hiding /sys/fs/bpf pins and kernel BTF, so
    commands go through nsenter, which enters just the network namespace.
    """

    name: str

    @property
    def path(self) -> str:
        return f"/run/netns/{self.name}"

    def argv(self, *argv: str) -> list[str]:
        return ["nsenter", f"--net={self.path}", "--", *argv]

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run(*self.argv(*argv), check=check)

    def popen(self, *argv: str, **kw) -> subprocess.Popen[str]:  # type: ignore[no-untyped-def]
        return subprocess.Popen(self.argv(*argv), text=True, **kw)


@dataclass
class VethPair:
    """Two namespaces joined by a veth: `a` (the node, address 10.77.x.1) and `b` (its peer, .2)."""

    a: Netns
    b: Netns
    ifname_a: str
    ifname_b: str
    addr_a: str
    addr_b: str


def make_netns(tag: str) -> Netns:
    name = f"lm-t-{tag}-{secrets.token_hex(3)}"
    run("ip", "netns", "add", name)
    ns = Netns(name)
    ns.run("ip", "link", "set", "lo", "up")
    return ns


def delete_netns(ns: Netns) -> None:
    run("ip", "netns", "delete", ns.name, check=False)


def make_veth_pair(created: list[Netns], subnet: str = "10.77", tag: str = "") -> VethPair:
    """Two fresh namespaces joined by a veth, addresses SUBNET.x.1 and .2, a default route from
    `a` through `b`. Each namespace is appended to `created` as soon as it exists, so the caller
    deletes them (delete_netns) even when a later step fails."""
    a = make_netns(f"{tag}a")
    created.append(a)
    b = make_netns(f"{tag}b")
    created.append(b)
    rnd = secrets.token_hex(3)
    ia, ib = f"lmt{rnd}a", f"lmt{rnd}b"
    run("ip", "link", "add", ia, "netns", a.name, "type", "veth", "peer", "name", ib, "netns", b.name)
    octet = secrets.randbelow(200) + 20
    addr_a, addr_b = f"{subnet}.{octet}.1", f"{subnet}.{octet}.2"
    a.run("ip", "addr", "add", f"{addr_a}/24", "dev", ia)
    b.run("ip", "addr", "add", f"{addr_b}/24", "dev", ib)
    a.run("ip", "link", "set", ia, "up")
    b.run("ip", "link", "set", ib, "up")
    a.run("ip", "route", "add", "default", "via", addr_b)
    return VethPair(a, b, ia, ib, addr_a, addr_b)


@pytest.fixture
def veth_pair() -> Iterator[VethPair]:
    """A veth pair across two fresh namespaces; both namespaces are deleted afterwards."""
    created: list[Netns] = []
    try:
        yield make_veth_pair(created)
    finally:
        for ns in created:
            delete_netns(ns)


@pytest.fixture
def agent(veth_pair: VethPair, tmp_path: Path) -> Iterator[object]:
    """A real laminard (tests/agentproc.AgentProc) with the default configuration on one end of
    a test veth pair; stopped and cleaned up (jobs, cgroups, pins) after the test. A module may
    define its own ``agent`` fixture with another configuration."""
    from agentproc import AgentProc

    a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a)
    try:
        a.start()
        yield a
    finally:
        a.cleanup()


@pytest.fixture
def shaping_agent(veth_pair: VethPair, tmp_path: Path) -> Iterator[object]:
    """Like ``agent``, with deadline shaping on (``[shaping] link_mbit = 1000``)."""
    from agentproc import AgentProc

    a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a, extra_toml="[shaping]\nlink_mbit = 1000\n")
    try:
        a.start()
        yield a
    finally:
        a.cleanup()


@pytest.fixture(autouse=True)
def _strict_custody_in_unit_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tests run the custody ledger strict: a move its table does not allow raises
    (laminar.migrate.ledger) instead of being logged and counted. Only they: the real agents of
    the kernel and cluster tests run as in production (a conftest.py of tests/unit's own would
    shadow this one's helpers where one session collects both, and its environment would reach
    the agents those tests start)."""
    if Path(str(request.node.path)).parent.name == "unit":
        monkeypatch.setenv("LAMINAR_STRICT_CUSTODY", "1")
