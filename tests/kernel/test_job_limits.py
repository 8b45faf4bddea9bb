"""Jobs get the site's limits, not the agent's (laminar.runtime.joblimits; issue 31 item 7).

A job is a child of the agent, and the unit starts the agent with ``LimitMEMLOCK=infinity``,
``LimitNOFILE=65536`` and ``Nice=-10``. A job used to inherit every rlimit of the agent's
verbatim, and its cgroup had no ``pids.max`` (on a hybrid host it stayed in the unit's v1 pids
cgroup, ``TasksMax=infinity``): unevictable memory without limit, and a fork bomb bounded by
nothing but the pid space. Now every job starts with its owner's profile (``[job_limits]``
defaults overlaid with limits.conf, read as Debian's pam_limits reads it) and a ``pids.max``.

Real: a real laminard started under ``prlimit`` with limits unlike the profile's (standing in for
the unit's: this VM has no CAP_SYS_RESOURCE, so nothing can hold a hard limit above the test
shell's own, 8 MiB of memlock and 20,000 files here; where a CI runner has it, the agent gets
the unit's ``memlock=unlimited``), a real unprivileged user (tests/userrig.py) whose job reads
its own ``/proc/self/limits``, umask, nice value and cgroup's ``pids.max``. The oracle for the
limits is the real pam_limits: ``runuser -u USER -- cat /proc/self/limits`` in a private mount
namespace where the fixture files stand at /etc/security/limits.conf and limits.d, and where
``/proc/1/limits`` shows the profile's defaults (Debian's pam_limits starts a login from PID 1's
limits), run under those same defaults. Fixture values stay below the defaults' hard limits,
which pam could not raise here either.

Task limits: this host is hybrid, so the job's ``pids.max`` is in the v1 pids hierarchy
(``/sys/fs/cgroup/pids/<root>/<class>/<job>``); the v2 layout (``pids.max`` in the job's
cgroup2 directory) cannot be made here (the pids controller is bound to v1) and is checked on a
fake cgroupfs in tests/unit/test_joblimits.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agentproc import AgentProc, wait_until
from fuserig import eio_mount
from liveness import RootLiveness
from userrig import User, call_as, local_user

from laminar.migrate import owner_check
from laminar.runtime import joblimits as jl
from laminar.runtime import launch

pytestmark = pytest.mark.kernel

INF = jl.INF
NAMES = {"Max cpu time": "cpu", "Max file size": "fsize", "Max data size": "data", "Max stack size": "stack",
         "Max core file size": "core", "Max resident set": "rss", "Max processes": "nproc",
         "Max open files": "nofile", "Max locked memory": "memlock", "Max address space": "as",
         "Max file locks": "locks", "Max pending signals": "sigpending", "Max msgqueue size": "msgqueue",
         "Max nice priority": "nice", "Max realtime priority": "rtprio", "Max realtime timeout": "rttime"}
PIDS_MAX = 40
# What the job reads of itself: its limits, its v1 pids cgroup's pids.max, its umask and nice value.
SELF = ("cat /proc/self/limits; p=$(grep ':pids:' /proc/self/cgroup | cut -d: -f3); "
        "echo pids.max $(cat /sys/fs/cgroup/pids$p/pids.max 2>&1); echo umask $(umask); echo nice $(nice)")


def parse_limits(text: str) -> dict[str, tuple[int, int]]:
    """{item: (soft, hard)} from /proc/PID/limits text (unlimited: INF)."""
    out = {}
    for line in text.splitlines():
        for label, item in NAMES.items():
            if line.startswith(label + " "):
                soft, hard = line[len(label):].split()[:2]
                out[item] = (INF if soft == "unlimited" else int(soft), INF if hard == "unlimited" else int(hard))
    return out


def agent_prefix() -> tuple[str, ...]:
    """prlimit limits unlike the profile's for the agent, and the unit's Nice=-10. Memlock and
    nofile at the most this process may hold (the unit's unlimited and 65536 where it may)."""
    def hard(r: int) -> str:
        h = resource.getrlimit(r)[1]
        return "unlimited" if h == resource.RLIM_INFINITY else str(h)
    mem, nof = hard(resource.RLIMIT_MEMLOCK), hard(resource.RLIMIT_NOFILE)
    return ("nice", "-n", "-10", jl.PRLIMIT, f"--memlock={mem}:{mem}", f"--nofile={nof}:{nof}",
            "--core=1234567:unlimited", "--stack=16777216:unlimited", "--nproc=4242:", "--sigpending=4321:",
            "--msgqueue=409600:", "--locks=55:unlimited", "--")


def profile_toml(conf: Path, confd: Path) -> str:
    # memlock below what the agent holds (this VM: 8 MiB at most; the unit: unlimited), so a job
    # holding the agent's would show; umask unlike the test shell's
    return (f'[job_limits]\nmemlock = "2M:4M"\numask = "027"\npids_max = {PIDS_MAX}\n'
            f'limits_conf = "{conf}"\nlimits_dir = "{confd}"\n')


def write_fixture(conf: Path, confd: Path, user: User, group: str) -> None:
    """limits.conf and two limits.d files with user, @group, uid-range and * lines: precedence,
    units, a later file winning, C's number parsing, lines not for root and one for root."""
    confd.mkdir(exist_ok=True)
    conf.write_text(f"""# a fixture of tests/kernel/test_job_limits.py
{user.name}   hard  nproc    300
*             hard  nproc    200
*             -     core     0
*             soft  stack    4096
@{group}      -     memlock  1024
{user.name}   soft  nofile   100abc
root          hard  nofile   4000
@root         -     nproc    10
""")
    (confd / "10-a.conf").write_text(f"@{group} soft msgqueue 4096\n{user.uid}:{user.uid} hard locks 77\n")
    (confd / "20-b.conf").write_text(f"@{group} soft msgqueue 2048\n")


def pam_oracle(tmp: Path, who: str, base: dict[str, tuple[int, int]], conf: Path, confd: Path) -> dict[str, tuple[int, int]]:
    """What the real pam_limits gives a login of `who` from `base` with the fixture files."""
    p = jl.Profile(0, base, None, 0o022, 0, False)
    fake_pid1 = tmp / "pid1-limits"
    fake_pid1.write_text(subprocess.run([jl.PRLIMIT, *p.prlimit_args(), "--", "cat", "/proc/self/limits"],
                                        check=True, capture_output=True, text=True).stdout)
    script = (f"mount --bind {conf} /etc/security/limits.conf && mount --bind {confd} /etc/security/limits.d && "
              f"mount --bind {fake_pid1} /proc/1/limits && "
              f"exec {jl.PRLIMIT} {' '.join(p.prlimit_args())} -- runuser -u {who} -- cat /proc/self/limits")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return parse_limits(r.stdout)


def base_of(agent: AgentProc) -> dict[str, tuple[int, int]]:
    """The defaults as this agent gives them (status: clamped to its own hard limits here)."""
    d = agent.json("status")["jobs"]["job_limits"]["defaults"]
    return {k: (INF if s == "unlimited" else s, INF if h == "unlimited" else h) for k, (s, h) in d.items()}


def ended(agent: AgentProc, job_id: str) -> dict[str, Any]:
    return wait_until(lambda: (j := agent.json("job", "show", job_id))["state"] in ("exited", "failed") and j, 60,
                      f"job {job_id} to end", agent.log)


@pytest.fixture
def limits_agent(veth_pair: Any, tmp_path: Path) -> Iterator[AgentProc]:
    conf, confd = tmp_path / "limits.conf", tmp_path / "limits.d"
    conf.write_text("")
    confd.mkdir()
    a = AgentProc(tmp_path, veth_pair.ifname_a, veth_pair.a, extra_toml=profile_toml(conf, confd))
    try:
        a.start(prefix=agent_prefix())
        yield a
    finally:
        a.cleanup()


def test_a_users_job_gets_its_login_limits_not_the_agents(limits_agent: AgentProc, tmp_path: Path) -> None:
    agent = limits_agent
    conf, confd = tmp_path / "limits.conf", tmp_path / "limits.d"
    agent_pid = int(agent.json("status")["agent"]["pid"])
    theirs = parse_limits(Path(f"/proc/{agent_pid}/limits").read_text())
    assert theirs["core"] == (1234567, INF) and os.getpriority(os.PRIO_PROCESS, agent_pid) == -10
    with local_user("lim", extra_group=True) as user:
        group = next(g.gr_name for g in __import__("grp").getgrall() if g.gr_gid == user.groups[1])
        write_fixture(conf, confd, user, group)
        code, job, raw = call_as(user, agent.sock, "POST", "/v1/jobs", {"command": ["sh", "-c", SELF]})
        assert code == 201, raw
        final = ended(agent, job["id"])
        out = Path(job["log"]).read_text()
        got = parse_limits(out)
        assert final["exit_code"] == 0, out
        # the real pam_limits, from the same defaults, with the same files
        want = pam_oracle(tmp_path, user.name, base_of(agent), conf, confd)
        assert got == want, {k: (got.get(k), want.get(k)) for k in NAMES.values() if got.get(k) != want.get(k)}
        # ... which are the fixture's and the profile's, not the agent's
        assert got["memlock"] == (1 << 20, 1 << 20) != theirs["memlock"]   # @group - memlock 1024 (KiB)
        assert got["nofile"][0] == 100 != theirs["nofile"][0]                # user soft nofile 100abc
        assert got["core"] == (0, 0) != theirs["core"]                        # * - core 0
        assert got["nproc"] == (300, 300)                                     # the user's line beats '*'
        assert got["locks"] == (77, 77) and got["msgqueue"] == (2048, 819200)  # a uid range; the later file
        assert got["stack"] == (4 << 20, INF) and got["sigpending"] == base_of(agent)["sigpending"]
        assert f"pids.max {PIDS_MAX}\n" in out and "umask 0027\n" in out and "nice 0\n" in out
        # the record says what it got, and where from
        rec = agent.json("job", "show", job["id"])["limits"]
        assert {k: (INF if s == "unlimited" else s, INF if h == "unlimited" else h)
                for k, (s, h) in rec["rlimits"].items()} == got
        assert rec["pids_max"] == PIDS_MAX and rec["umask"] == "0027" and rec["nice"] == 0
        assert any(f"@{group} - memlock 1024" in s for s in rec["from"]), rec["from"]
        human = agent.ctl("job", "show", job["id"]).stdout
        assert "memlock 1M:1M" in human and f"pids.max {PIDS_MAX}" in human and "limits from" in human


def test_roots_job_gets_roots_profile_star_and_groups_not_applied(limits_agent: AgentProc, tmp_path: Path) -> None:
    agent = limits_agent
    conf, confd = tmp_path / "limits.conf", tmp_path / "limits.d"
    with local_user("limr", extra_group=True) as user:
        write_fixture(conf, confd, user, "root")
        job = agent.json("submit", "--", "sh", "-c", SELF)
        ended(agent, job["id"])
        out = Path(job["log"]).read_text()
        got = parse_limits(out)
        want = pam_oracle(tmp_path, "root", base_of(agent), conf, confd)
        assert got == want, {k: (got.get(k), want.get(k)) for k in NAMES.values() if got.get(k) != want.get(k)}
        base = base_of(agent)
        assert got["nofile"] == (1024, 4000)                            # root hard nofile 4000
        assert got["core"] == base["core"] and got["nproc"] == base["nproc"]  # '*' and '@root': not root's
        assert got["memlock"] == (2 << 20, 4 << 20)                     # the profile's, not the agent's
        assert f"pids.max {PIDS_MAX}\n" in out and "umask 0027\n" in out


def test_a_fork_bomb_stops_at_pids_max_while_root_stays_live(limits_agent: AgentProc) -> None:
    agent = limits_agent
    bomb = ("import errno, os, sys, time\n"
            "kids = []\n"
            "for i in range(400):\n"
            "    try:\n"
            "        pid = os.fork()\n"
            "    except OSError as e:\n"
            "        print('refused', errno.errorcode[e.errno], 'after', len(kids), flush=True); break\n"
            "    if pid == 0:\n"
            "        time.sleep(120); os._exit(0)\n"
            "    kids.append(pid)\n"
            "else:\n"
            "    print('never refused after', len(kids), flush=True)\n"
            "time.sleep(120)\n")
    root_job = agent.json("submit", "--name", "liveness", "--", "sleep", "600")
    with local_user("bomb") as user, RootLiveness(agent.sock, root_job["id"]) as live:
        code, job, raw = call_as(user, agent.sock, "POST", "/v1/jobs", {"command": ["python3", "-c", bomb]})
        assert code == 201, raw
        log = Path(job["log"])
        line = wait_until(lambda: log.exists() and log.read_text(), 60, "the forker to report", agent.log)
        assert line.startswith("refused EAGAIN after "), line
        assert int(line.split()[-1]) < PIDS_MAX
        shown = agent.json("job", "show", job["id"])
        assert shown["pids_limit"]["max"] == PIDS_MAX and shown["pids_limit"]["refused"] >= 1, shown.get("pids_limit")
        assert shown["pids_limit"]["current"] <= PIDS_MAX
        all_jobs = agent.json("status")["jobs"]["job_limits"]["all_jobs_pids"]
        assert all_jobs["current"] >= shown["pids_limit"]["current"]
        # root's status and kill-switch keep answering while the job holds its tasks at pids.max
        wait_until(lambda: len(live.status_s) >= 10 or live.failures, 60, "root's status calls beside the bomb")
        agent.ctl("job", "stop", job["id"], "--grace", "0")
    live.check(bound_s=2.0)


# -- the helpers that run as a job's owner ---------------------------------------------------------------
def helper_of(marker: str, program: str, uid: int) -> int | None:
    """A process whose argv holds `marker`, that runs `program` (the launch steps before it are
    done: its limits are final) and has become `uid`."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if marker.encode() in b"\0".join(argv) and argv[0] == program.encode() and d.stat().st_uid == uid:
                return int(d.name)
    return None


def test_the_path_probe_and_the_checkpoint_check_hold_the_owners_limits(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """check_paths' probe (at submit) and verify_as_owner (a checkpoint from a peer) run as the
    job's owner: caught while they wait on hung storage, they hold the owner's profile and an
    oom_score_adj of their own, not this (agent) process's limits and -900-style score."""
    backing = tmp_path / "backing"
    (backing / "home").mkdir(parents=True)
    (backing / "home" / "ckpt-1").mkdir()
    conf = tmp_path / "limits.conf"
    jl.configure({"memlock": "2M:4M", "limits_conf": str(conf), "limits_dir": str(tmp_path / "none")})
    monkeypatch.setattr(launch, "PROBE_S", 20.0)
    monkeypatch.setattr(owner_check, "VERIFY_STALL_S", 20.0)
    try:
        with local_user("helper") as user, eio_mount(backing) as fs:
            conf.write_text(f"{user.name} hard nproc 321\n")
            fs.hang()
            errors: list[BaseException] = []

            def probe() -> None:
                try:
                    asyncio.run(launch.check_paths(str(fs.path / "home"), None, "/usr/bin", user.uid, user.gid))
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            def verify() -> None:
                try:
                    owner_check.verify_as_owner(str(fs.path / "home" / "ckpt-1"), user.uid, user.gid)
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            threads = [threading.Thread(target=f, daemon=True) for f in (probe, verify)]
            for t in threads:
                t.start()
            for marker, program in (("laminar-probe", "/bin/sh"), ("ckpt-1", sys.executable)):
                pid = wait_until(lambda m=marker, p=program: helper_of(m, p, user.uid), 15,
                                 f"the helper ({marker}) to run as the owner", lambda: repr(errors))
                lim = parse_limits(Path(f"/proc/{pid}/limits").read_text())
                assert lim["memlock"] == (2 << 20, 4 << 20), (marker, lim["memlock"])
                assert lim["nproc"] == (321, 321) and lim["nofile"][0] == 1024 and lim["core"] == (0, INF), lim
                assert int(Path(f"/proc/{pid}/oom_score_adj").read_text()) == jl.HELPER_OOM_SCORE_ADJ
            fs.heal()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads), errors
    finally:
        jl.configure(None)
