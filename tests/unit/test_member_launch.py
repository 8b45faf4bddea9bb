"""laminar.members.launch: the member block checked in full, and the argv and env a member of a
multi-node job runs with (torchrun through c10d, or plain)."""

from __future__ import annotations

import copy
import sys
from typing import Any

import pytest

from laminar.members.launch import (
    LAST_CALL_S,
    MAX_RESTARTS,
    PORT_BASE,
    PORT_SPAN,
    LaunchError,
    MemberBlock,
    endpoint_port,
    interface_of,
    launch,
    launcher_for,
    split_endpoint,
)

BLOCK: dict[str, Any] = {"job": "job-7-n3", "origin": 3, "index": 1, "count": 3, "min": 2, "max": 4,
                         "nodes": [[5, "10.9.0.5"], [8, "10.9.0.8"], [2, "10.9.0.2"]],
                         "endpoint": "10.9.0.5:29517", "launcher": "torchrun", "generation": 0}


def _with(**kw: Any) -> dict[str, Any]:
    d = copy.deepcopy(BLOCK)
    d.update(kw)
    return d


def test_the_design_s_block_reads_and_round_trips() -> None:
    b = MemberBlock.from_dict(BLOCK)
    assert b.own_addr == "10.9.0.8" and b.addresses == ["10.9.0.5", "10.9.0.8", "10.9.0.2"]
    assert b.nodes == ((5, "10.9.0.5"), (8, "10.9.0.8"), (2, "10.9.0.2"))
    assert MemberBlock.from_dict(b.to_dict()) == b and b.to_dict() == BLOCK


@pytest.mark.parametrize("change, words", [
    ({"job": "job-7"}, "job 'job-7' is not a multi-node job id"),
    ({"job": "job-7-n3\n"}, "is not a multi-node job id"),
    ({"job": "job-7-n4"}, "was not made by origin 3"),
    ({"job": 7}, "job 7 is not"),
    ({"job": "job-" + "1" * 5000 + "-n3"}, "is not a multi-node job id"),
    ({"origin": -1}, "origin -1 out of range 0..4294967295"),
    ({"origin": True}, "origin True is not an integer"),
    ({"count": 0}, "count 0 out of range 1..64"),
    ({"count": 65}, "count 65 out of range 1..64"),
    ({"min": 4}, "min 4 out of range 1..3 (count 3)"),
    ({"min": 0}, "min 0 out of range 1..3"),
    ({"max": 2}, "max 2 out of range 3..64 (count 3)"),
    ({"max": 65}, "max 65 out of range 3..64"),
    ({"index": 3}, "index 3 out of range 0..2 (count 3)"),
    ({"index": -1}, "index -1 out of range"),
    ({"index": 1.0}, "index 1.0 is not an integer"),
    ({"nodes": [[5, "10.9.0.5"], [8, "10.9.0.8"]]}, "nodes holds 2 members, count says 3"),
    ({"nodes": "10.9.0.5"}, "nodes holds '10.9.0.5' members"),
    ({"nodes": [[5, "10.9.0.5"], [8, "10.9.0.8"], [2]]}, "nodes[2] [2] is not [node id, address]"),
    ({"nodes": [[5, "10.9.0.5"], ["8", "10.9.0.8"], [2, "10.9.0.2"]]}, "nodes[1]: node '8' is not a node id"),
    ({"nodes": [[5, "10.9.0.5"], [8, "10.9.0.8"], [2, "10.9.0.256"]]}, "nodes[2] address '10.9.0.256' is not an IP"),
    ({"nodes": [[5, "10.9.0.5"], [8, "host"], [2, "10.9.0.2"]]}, "nodes[1] address 'host' is not an IP"),
    ({"nodes": [[5, "10.9.0.5"], [5, "10.9.0.8"], [2, "10.9.0.2"]]}, "names a node twice"),
    ({"nodes": [[5, "10.9.0.5"], [8, "10.9.0.5"], [2, "10.9.0.2"]]}, "names an address twice"),
    ({"endpoint": "10.9.0.5"}, "endpoint '10.9.0.5' is not \"address:port\""),
    ({"endpoint": "10.9.0.5:0"}, "port '0' is not 1..65535"),
    ({"endpoint": "10.9.0.5:65536"}, "port '65536' is not 1..65535"),
    ({"endpoint": "10.9.0.5:２９５"}, "is not 1..65535"),
    ({"endpoint": "10.9.0.8:29517"}, "is not on member 0's address 10.9.0.5"),
    ({"endpoint": "fd00::5:29517"}, "an IPv6 address goes in brackets"),
    ({"launcher": "mpirun"}, "launcher 'mpirun'; allowed: ['torchrun', 'plain']"),
    ({"generation": -1}, "generation -1 out of range"),
    ({"extra": 1}, "unknown keys ['extra']"),
])
def test_a_wrong_value_is_refused_by_name_with_what_is_allowed(change: dict[str, Any], words: str) -> None:
    with pytest.raises(LaunchError) as e:
        MemberBlock.from_dict(_with(**change))
    assert words in str(e.value)
    assert isinstance(e.value, ValueError)


def test_missing_keys_and_non_objects_are_refused() -> None:
    d = _with()
    del d["generation"]
    with pytest.raises(LaunchError, match=r"missing \['generation'\]"):
        MemberBlock.from_dict(d)
    for bad in (None, [], "x", 3):
        with pytest.raises(LaunchError, match="is not an object"):
            MemberBlock.from_dict(bad)


def test_hostile_sizes_cost_little() -> None:
    """A peer's huge block is refused before anything is iterated over."""
    with pytest.raises(LaunchError, match="nodes holds 1000000 members"):
        MemberBlock.from_dict(_with(nodes=[[1, "10.0.0.1"]] * 1_000_000))
    with pytest.raises(LaunchError, match="unknown keys"):
        MemberBlock.from_dict({**BLOCK, **{f"k{i}": i for i in range(100_000)}})
    with pytest.raises(LaunchError, match="is not an IP address string"):
        MemberBlock.from_dict(_with(nodes=[[5, "10.9.0.5"], [8, "1" * 10_000_000], [2, "10.9.0.2"]]))
    with pytest.raises(LaunchError, match="is not \"address:port\""):
        MemberBlock.from_dict(_with(endpoint="1" * 10_000_000))


def test_ipv6_members_and_endpoint() -> None:
    b = MemberBlock.from_dict(_with(nodes=[[5, "fd00::5"], [8, "fd00::8"], [2, "fd00::2"]], endpoint="[fd00::5]:29517"))
    assert b.endpoint == "[fd00::5]:29517"
    ln = launch(b, ["python3", "train.py"], ifname="br0")
    assert ln.env["MASTER_ADDR"] == "fd00::5" and ln.env["MASTER_PORT"] == "29517"
    assert "--rdzv-endpoint=[fd00::5]:29517" in ln.argv and "--local-addr=fd00::8" in ln.argv
    assert split_endpoint("[::1]:80") == ("::1", 80)


def test_torchrun_argv_is_the_design_s() -> None:
    b = MemberBlock.from_dict(BLOCK)
    ln = launch(b, ["/opt/venv/bin/python3", "train.py", "--lr", "0.1"], ifname="eth1")
    assert ln.argv == ["/opt/venv/bin/python3", "-m", "torch.distributed.run", "--nnodes=2:4", "--nproc-per-node=1",
                       "--rdzv-backend=c10d", "--rdzv-endpoint=10.9.0.5:29517", "--rdzv-id=job-7-n3",
                       f"--max-restarts={MAX_RESTARTS}", "--local-addr=10.9.0.8",
                       f"--rdzv-conf=is_host=0,last_call_timeout={LAST_CALL_S}", "train.py", "--lr", "0.1"]
    host = launch(MemberBlock.from_dict(_with(index=0)), ["python", "-m", "pkg.train", "-x"], ifname=None)
    assert "--rdzv-conf=is_host=1,last_call_timeout=5" in host.argv and "--local-addr=10.9.0.5" in host.argv
    assert host.argv[-3:] == ["-m", "pkg.train", "-x"] and host.argv[0] == "python"
    more = launch(b, ["python", "t.py"], ifname=None, rdzv_conf={"join_timeout": 30, "last_call_timeout": 1})
    assert "--rdzv-conf=is_host=0,last_call_timeout=1,join_timeout=30" in more.argv
    with pytest.raises(LaunchError, match="rdzv-conf"):
        launch(b, ["python", "t.py"], ifname=None, rdzv_conf={"is_host": "1,evil=2"})


def test_the_env_every_member_gets() -> None:
    b = MemberBlock.from_dict(BLOCK)
    env = launch(b, ["python", "train.py"], ifname="eth1").env
    assert env == {"MASTER_ADDR": "10.9.0.5", "MASTER_PORT": "29517", "WORLD_SIZE": "3", "RANK": "1", "LOCAL_RANK": "0",
                   "LAMINAR_MEMBERS": "10.9.0.5,10.9.0.8,10.9.0.2", "LAMINAR_MEMBER": "1", "LAMINAR_JOB_ID": "job-7-n3",
                   "GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1",
                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    plain = launch(MemberBlock.from_dict(_with(launcher="plain")), ["./a.out", "--x"], ifname=None)
    assert plain.argv == ["./a.out", "--x"]
    assert "GLOO_SOCKET_IFNAME" not in plain.env and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in plain.env
    assert plain.env["RANK"] == "1" and plain.env["WORLD_SIZE"] == "3"


@pytest.mark.parametrize("command, launcher", [
    (["python", "train.py"], "torchrun"),
    (["/usr/bin/python3.11", "train.py", "--a"], "torchrun"),
    (["python3", "-m", "pkg.mod"], "torchrun"),
    (["python3", "-m"], "plain"),
    (["python3", "-m", "not a module"], "plain"),
    (["python3", "-u", "train.py"], "plain"),
    (["python3", "-c", "print(1)"], "plain"),
    (["python3"], "plain"),
    (["python3", "-x.py"], "plain"),
    (["./train.py"], "plain"),
    (["bash", "run.sh"], "plain"),
    (["mypython-wrapper", "t.py"], "plain"),
])
def test_the_default_launcher(command: list[str], launcher: str) -> None:
    assert launcher_for(command) == launcher


def test_a_torchrun_launch_of_what_torchrun_cannot_start_is_refused() -> None:
    b = MemberBlock.from_dict(BLOCK)
    for cmd in (["bash", "run.sh"], ["python3", "-u", "train.py"], ["python3", "-c", "x"]):
        with pytest.raises(LaunchError, match="is not `python X.py args` or `python -m module args`"):
            launch(b, cmd, ifname=None)


def test_endpoint_ports_are_stable_in_range_and_move_on() -> None:
    p = endpoint_port("job-7-n3", 0)
    assert PORT_BASE <= p < PORT_BASE + PORT_SPAN
    assert p == endpoint_port("job-7-n3", 0)  # no salted hash(): the same in every process
    assert endpoint_port("job-7-n3", 0, attempt=1) == PORT_BASE + (p - PORT_BASE + 1) % PORT_SPAN
    ports = {endpoint_port(f"job-{i}-n3", g) for i in range(200) for g in range(3)}
    assert len(ports) > 300 and all(PORT_BASE <= q < PORT_BASE + PORT_SPAN for q in ports)


def test_interface_of_finds_loopback() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.123") is None  # TEST-NET: on no interface
    assert interface_of("not an address") is None


def test_the_launch_runs_under_this_python() -> None:
    """What launch builds is a command torchrun accepts (its parser, not a pretend one)."""
    b = MemberBlock.from_dict(_with(nodes=[[5, "127.0.0.1"], [8, "127.0.0.2"], [2, "127.0.0.3"]],
                                    endpoint="127.0.0.1:29517"))
    argv = launch(b, [sys.executable, "train.py", "--lr", "0.1"], ifname="lo").argv
    torch_run = pytest.importorskip("torch.distributed.run")
    args = torch_run.parse_args(argv[3:])
    assert (args.nnodes, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id, args.max_restarts) == \
        ("2:4", "c10d", "127.0.0.1:29517", "job-7-n3", MAX_RESTARTS)
    assert args.local_addr == "127.0.0.2" and args.training_script == "train.py"
    assert args.training_script_args == ["--lr", "0.1"] and args.rdzv_conf == "is_host=0,last_call_timeout=5"
