"""systemd/laminard.service run by a real systemd: installed with `make install`, started,
killed, restarted and stopped with systemctl inside a container booted from this machine's root
(tests/nspawnrig.py says what the container is given and why).

One container and one agent serve the whole module; the tests run in file order and each
builds on the one before it (start, sandbox, socket, jobs, open files, SIGKILL and restart,
stop, a stop held past TimeoutStopSec= with gdb, reboot). Each prints the figures it saw
(time to ready, restart, stop) for `pytest -s`.

What cannot be checked here: `OOMScoreAdjust=-900`, `LimitMEMLOCK=infinity` and the full
`LimitNOFILE=` (this machine's root lacks CAP_SYS_RESOURCE, so systemd can neither lower an
oom_score_adj nor raise a hard rlimit: the agent gets the host's hard limits), and NVML devices
(no GPU).
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agentproc import wait_until
from nspawnrig import REPO, SystemdContainer, missing

from laminarctl.client import Client

# serial: boots this machine's root under systemd-nspawn (a whole systemd: CPU and memory)
pytestmark = [pytest.mark.kernel, pytest.mark.serial]

UNIT = "laminard"
UNIT_FILE = REPO / "systemd" / "laminard.service"
OPERATOR = "lm-sd-op"     # a member of the control group (created in the container only)
USER = "lm-sd-user"       # an ordinary local user
# Linux capability numbers (include/uapi/linux/capability.h), for reading CapBnd masks.
CAPS = ("CAP_CHOWN CAP_DAC_OVERRIDE CAP_DAC_READ_SEARCH CAP_FOWNER CAP_FSETID CAP_KILL CAP_SETGID CAP_SETUID "
        "CAP_SETPCAP CAP_LINUX_IMMUTABLE CAP_NET_BIND_SERVICE CAP_NET_BROADCAST CAP_NET_ADMIN CAP_NET_RAW "
        "CAP_IPC_LOCK CAP_IPC_OWNER CAP_SYS_MODULE CAP_SYS_RAWIO CAP_SYS_CHROOT CAP_SYS_PTRACE CAP_SYS_PACCT "
        "CAP_SYS_ADMIN CAP_SYS_BOOT CAP_SYS_NICE CAP_SYS_RESOURCE CAP_SYS_TIME CAP_SYS_TTY_CONFIG CAP_MKNOD "
        "CAP_LEASE CAP_AUDIT_WRITE CAP_AUDIT_CONTROL CAP_SETFCAP CAP_MAC_OVERRIDE CAP_MAC_ADMIN CAP_SYSLOG "
        "CAP_WAKE_ALARM CAP_BLOCK_SUSPEND CAP_AUDIT_READ CAP_PERFMON CAP_BPF CAP_CHECKPOINT_RESTORE").split()


def unit_directive(name: str) -> str:
    values = [x.split("=", 1)[1] for x in UNIT_FILE.read_text().splitlines() if x.startswith(f"{name}=")]
    assert values, f"{UNIT_FILE} sets no {name}="
    return values[-1]


def cap_names(mask_hex: str) -> set[str]:
    mask = int(mask_hex, 16)
    return {c for i, c in enumerate(CAPS) if mask >> i & 1}


def proc_status(box: SystemdContainer, pid: int) -> dict[str, str]:
    text = box.sh(f"cat /proc/{pid}/status").stdout
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def job_cgroups(box: SystemdContainer, pid: int) -> dict[str, str]:
    """{hierarchy: path} of a process, from /proc/PID/cgroup (cgroup2 as "unified")."""
    out = box.sh(f"cat /proc/{pid}/cgroup").stdout
    return {parts[1] or "unified": parts[2] for parts in (line.split(":", 2) for line in out.splitlines())}


def mono_us() -> int:
    """CLOCK_MONOTONIC in µs: the container shares it (no time namespace), so it compares with
    systemd's *TimestampMonotonic properties."""
    return time.monotonic_ns() // 1000


def status(box: SystemdContainer) -> dict[str, Any]:
    return json.loads(box.ctl("-o", "json", "status").stdout)


def wait_for(what: str, fn: Any, timeout: float = 30.0) -> Any:
    return wait_until(fn, timeout, what)


@pytest.fixture(scope="module")
def box() -> Iterator[SystemdContainer]:
    why = missing()
    if why:
        pytest.skip(why)
    t0 = time.monotonic()
    with SystemdContainer() as b:
        print(f"\ncontainer {b.name} booted in {time.monotonic() - t0:.2f} s")
        b.install()
        b.sh(f"groupadd laminar && useradd -M -s /usr/sbin/nologin -G laminar {OPERATOR} && "
             f"useradd -M -s /usr/sbin/nologin {USER}")
        try:
            yield b
        finally:
            print(f"{UNIT} journal:\n{b.journal(UNIT, 30)}")
            t1 = time.monotonic()
    print(f"container gone {time.monotonic() - t1:.2f} s after the last test; {time.monotonic() - t0:.1f} s in all")


# The jobs the tests below start, for the ones after them (the module's tests run in order),
# and the file descriptors the agent held before they started.
JOBS: list[dict[str, Any]] = []
FDS_BEFORE_JOBS: list[int] = []


def open_fds(box: SystemdContainer, pid: int) -> int:
    """The file descriptors `pid` holds: the least of a few looks, so that one a request holds
    for a moment (a connection, a pipe) does not count."""
    counts = []
    for _ in range(5):
        counts.append(len(box.sh(f"ls /proc/{pid}/fd").stdout.split()))
        time.sleep(0.05)
    return min(counts)


def test_start_returns_once_the_agent_is_ready_with_its_data_plane(box: SystemdContainer) -> None:
    """`systemctl enable --now` (docs/operations.md) with Type=notify returns when the agent
    sent READY=1, which it does only after its programs are attached, its maps pinned and its
    socket up. (Enabled, the unit keeps its exit status once stopped: systemd unloads an
    inactive unit nothing refers to, and its ExecMain* properties with it.)"""
    assert unit_directive("Type") == "notify"
    t = time.monotonic()
    r = box.sh(f"systemctl enable --now {UNIT}", check=False)
    wall = time.monotonic() - t
    assert r.returncode == 0, f"systemctl enable --now failed: {r.stderr}\n{box.journal(UNIT)}"
    p = box.show(UNIT, "ActiveState", "SubState", "StatusText", "ExecMainStartTimestampMonotonic",
                 "ActiveEnterTimestampMonotonic")
    assert (p["ActiveState"], p["SubState"]) == ("active", "running"), p
    assert p["StatusText"].startswith("ready"), p
    print(f"ready {(int(p['ActiveEnterTimestampMonotonic']) - int(p['ExecMainStartTimestampMonotonic'])) / 1000:.0f} ms "
          f"after exec (systemctl enable --now returned after {wall * 1000:.0f} ms)")
    s = status(box)
    ng = s["netguard"]
    assert ng["ifname"] == "lmsd0", ng["ifname"]
    assert {x["direction"] for x in ng["programs"]} == {"egress", "ingress"}, ng["programs"]
    pins = set(box.sh(f"ls {ng['pin_root']}").stdout.split())
    assert {m["name"] for m in ng["maps"]} <= pins, (ng["maps"], pins)
    assert s["pressurewatch"]["attached"], s["pressurewatch"]
    assert s["kernel"]["cgroup_mode"] == "hybrid" and s["kernel"]["cap_bpf"], s["kernel"]
    # StateDirectoryMode= and RuntimeDirectory=: a job's owner may pass the state dir.
    modes = box.sh("stat -c '%a %U' /var/lib/laminar /run/laminar").stdout.split("\n")
    assert modes[:2] == ["711 root", "755 root"], modes


def test_the_agent_runs_inside_the_units_sandbox(box: SystemdContainer) -> None:
    """What systemd applied to the running agent, read from /proc: the bounding set is the
    unit's (less what this container lacks), no_new_privs, Nice=-10, /usr and /etc read-only
    (ProtectSystem=full), and a seccomp filter of the unit's own (RestrictAddressFamilies=)."""
    pid = int(box.show(UNIT, "MainPID")["MainPID"])
    st, init = proc_status(box, pid), proc_status(box, 1)
    want = set(unit_directive("CapabilityBoundingSet").split()) & cap_names(init["CapBnd"])
    assert cap_names(st["CapBnd"]) == want, (sorted(cap_names(st["CapBnd"]) ^ want), "differ")
    assert cap_names(st["CapEff"]) == want
    assert st["NoNewPrivs"] == "1"
    assert int(st["Seccomp_filters"]) > int(init["Seccomp_filters"]), (st["Seccomp_filters"], init["Seccomp_filters"])
    assert box.sh(f"ps -o ni= -p {pid}").stdout.strip() == "-10"
    # systemd put the agent in the unit's cgroups, the v1 memory and pids ones too (hybrid host),
    # and TasksMax=infinity lifted the unit's pids limit that its jobs will count against
    cg = job_cgroups(box, pid)
    assert cg["unified"] == cg["memory"] == cg["pids"] == "/system.slice/laminard.service", cg
    assert unit_directive("TasksMax") == "infinity"
    assert box.sh("cat /sys/fs/cgroup/pids/system.slice/laminard.service/pids.max").stdout.strip() == "max"
    ro = {}
    for line in box.sh(f"cat /proc/{pid}/mountinfo").stdout.splitlines():
        f = line.split()
        ro[f[4]] = "ro" in f[5].split(",")
    assert ro.get("/usr") and ro.get("/etc"), {k: v for k, v in ro.items() if k in ("/usr", "/etc", "/")}


def test_control_socket_permissions_under_systemd(box: SystemdContainer) -> None:
    """The public socket is 0666 (any user reads), the admin socket 0660 with the control group;
    a privileged call is refused to an ordinary user (exit 4) and allowed to the control group
    and root."""
    ls = box.sh("stat -c '%n %a %U %G' /run/laminar/laminard.sock /run/laminar/laminard.admin.sock").stdout.split("\n")
    assert ls[0] == "/run/laminar/laminard.sock 666 root root", ls
    assert ls[1] == "/run/laminar/laminard.admin.sock 660 root laminar", ls
    assert box.ctl("status", user=USER, check=False).returncode == 0
    r = box.ctl("pool", "load", "0.1", user=USER, check=False)
    assert r.returncode == 4, (r.returncode, r.stdout, r.stderr)
    assert "permission denied" in r.stderr, r.stderr
    r = box.ctl("pool", "load", "0.1", user=OPERATOR, check=False)
    assert r.returncode == 0, (r.stdout, r.stderr)
    box.ctl("pool", "load", "0.0")
    assert status(box)["agent"]["api_refused"] >= 1


def test_jobs_run_as_their_submitter_in_the_agents_cgroups(box: SystemdContainer) -> None:
    """A job submitted through the socket runs as its submitter in the cgroups the agent made
    (cgroup2, v1 memory and v1 pids under /laminar, with a pids.max), outside the unit's own
    cgroup, and with its owner's limits, not the unit's LimitNOFILE= (docs/operations.md, "What a
    job gets: the site's limits")."""
    agent = int(box.show(UNIT, "MainPID")["MainPID"])
    fds_before = open_fds(box, agent)
    mine = json.loads(box.ctl("-o", "json", "submit", "--name", "lm-sd-root", "--", "sleep", "600").stdout)
    theirs = json.loads(box.ctl("-o", "json", "submit", "--name", "lm-sd-user", "--", "sleep", "600",
                                user=USER, cwd="/tmp").stdout)
    FDS_BEFORE_JOBS.append(fds_before)
    uid = int(box.sh(f"id -u {USER}").stdout)
    for job, owner in ((mine, 0), (theirs, uid)):
        assert job["state"] == "running", job
        st = proc_status(box, job["pid"])
        assert st["Uid"].split()[0] == str(owner), (job["id"], st["Uid"])
        cg = job_cgroups(box, job["pid"])
        assert cg["unified"] == f"/laminar/{job['class']}/{job['id']}", cg
        assert cg["memory"] == f"/laminar/{job['class']}/{job['id']}", cg
        assert job["cgroup"] == f"/sys/fs/cgroup/unified{cg['unified']}"
        assert cg["pids"] == f"/laminar/{job['class']}/{job['id']}", cg  # its own, not the unit's (TasksMax)
        assert box.sh(f"cat /sys/fs/cgroup/pids{cg['pids']}/pids.max").stdout.strip().isdigit()
        # set in the root steps before the drop: look once the command runs
        wait_until(lambda j=job: box.sh(f"cat /proc/{j['pid']}/cmdline").stdout.split("\0")[0] == "sleep", 30,
                   "the job's command to run")
        nofile = next(line.split()[3:5] for line in box.sh(f"cat /proc/{job['pid']}/limits").stdout.splitlines()
                      if line.startswith("Max open files"))
        assert nofile[0] == "1024", (job["id"], nofile)  # [job_limits] nofile, not the unit's 65536
        # a job may not gain privileges the agent lacks (NoNewPrivileges= is inherited)
        assert st["NoNewPrivs"] == "1"
    JOBS[:] = [mine, theirs]


def test_the_agent_may_open_the_files_two_users_at_their_job_cap_need(box: SystemdContainer) -> None:
    """The agent holds file descriptors for each running job (its pidfd, its memory.pressure
    trigger). Under the unit its soft RLIMIT_NOFILE must leave room for two local users at
    `[jobs] max_per_user` each: with systemd's default soft limit (1024) the agent ran out near
    480 jobs, and then failed `laminarctl status` ("internal error: Too many open files"),
    refused every submission with a misleading message and accepted no connection."""
    assert FDS_BEFORE_JOBS and JOBS, "needs test_jobs_run_as_their_submitter_in_the_agents_cgroups"
    agent = int(box.show(UNIT, "MainPID")["MainPID"])
    # Airlock opens a job's PSI trigger within a second of its start: count once nothing changes.
    last, now = -1, open_fds(box, agent)
    while now != last:
        time.sleep(1.1)
        last, now = now, open_fds(box, agent)
    per_job = (now - FDS_BEFORE_JOBS[0]) / len(JOBS)
    soft = next(int(line.split()[3]) for line in box.sh(f"cat /proc/{agent}/limits").stdout.splitlines()
                if line.startswith("Max open files"))
    cap = int(Client(f"/proc/{box.leader}/root/run/laminar/laminard.sock").get("/v1/config")["config"]["jobs"]["max_per_user"])
    need = now + per_job * 2 * cap
    print(f"open files: soft limit {soft}; {per_job:g} per job; two users at {cap} jobs need {need:.0f}")
    assert per_job >= 1, per_job  # at least its pidfd: else the count above missed the jobs
    assert soft >= need, (f"laminard's soft RLIMIT_NOFILE is {soft}: two users at max_per_user = {cap} need "
                          f"{need:.0f} ({per_job:g} per job); the unit's LimitNOFILE= is too low")


def test_sigkill_restarts_the_agent_and_it_reattaches_its_jobs(box: SystemdContainer) -> None:
    """`systemctl kill -s SIGKILL` (every process in the unit's cgroup): Restart=on-failure brings
    the agent back; the jobs, in the agent's cgroups, were not hit and are reattached with the
    pinned maps."""
    jobs = JOBS
    assert jobs, "needs the jobs of test_jobs_run_as_their_submitter_in_the_agents_cgroups"
    old = int(box.show(UNIT, "MainPID")["MainPID"])
    t = mono_us()
    box.sh(f"systemctl kill -s SIGKILL {UNIT}")

    def back() -> dict[str, str] | None:
        p = box.show(UNIT, "ActiveState", "SubState", "MainPID", "NRestarts", "ActiveEnterTimestampMonotonic")
        ok = p["ActiveState"] == "active" and p["SubState"] == "running" and int(p["MainPID"]) not in (0, old)
        return p if ok else None

    p = wait_for("the agent restarted", back)
    assert p["NRestarts"] == "1", p
    print(f"restart: active again {(int(p['ActiveEnterTimestampMonotonic']) - t) / 1e6:.2f} s after SIGKILL "
          f"(RestartSec={unit_directive('RestartSec')})")
    s = status(box)
    assert s["netguard"]["reattached_pins"] is True
    for job in jobs:
        now = json.loads(box.ctl("-o", "json", "job", "show", job["id"]).stdout)
        assert (now["state"], now["pid"], now["reattached"]) == ("running", job["pid"], True), now
        assert job_cgroups(box, job["pid"])["unified"] == f"/laminar/{job['class']}/{job['id']}"


def test_stop_exits_cleanly_and_leaves_jobs_and_data_plane(box: SystemdContainer) -> None:
    """`systemctl stop`: SIGTERM, the agent exits 0 well within TimeoutStopSec (Result=success,
    not timeout); KillMode=process leaves the jobs running and the pins in place."""
    jobs = JOBS
    assert jobs, "needs the jobs of test_jobs_run_as_their_submitter_in_the_agents_cgroups"
    r = box.sh(f"systemctl stop {UNIT}", check=False)
    assert r.returncode == 0, r.stderr
    p = box.show(UNIT, "ActiveState", "Result", "ExecMainCode", "ExecMainStatus", "ActiveExitTimestampMonotonic",
                 "InactiveEnterTimestampMonotonic")
    assert (p["ActiveState"], p["Result"], p["ExecMainCode"], p["ExecMainStatus"]) == ("inactive", "success", "1", "0"), p
    print(f"stop: {(int(p['InactiveEnterTimestampMonotonic']) - int(p['ActiveExitTimestampMonotonic'])) / 1000:.0f} ms "
          f"(TimeoutStopSec={unit_directive('TimeoutStopSec')})")
    for job in jobs:
        assert proc_status(box, job["pid"])["State"].startswith(("S", "R")), job["id"]
    assert "lm_jobs" in box.sh("ls /sys/fs/bpf/laminar").stdout
    assert re.search(r"lm_egress", box.sh("tc filter show dev lmsd0 egress").stdout)
    # and the next start reattaches them
    box.sh(f"systemctl start {UNIT}")
    for job in jobs:
        assert json.loads(box.ctl("-o", "json", "job", "show", job["id"]).stdout)["state"] == "running"


SHORT_STOP_S = 2  # the drop-in's TimeoutStopSec= below: the agent's stop is held past it
HOLD_S = 3.0
EXTEND = b"EXTEND_TIMEOUT_USEC="


def test_a_stop_longer_than_timeoutstopsec_is_extended_by_the_agent(box: SystemdContainer) -> None:
    """The agent announces its stop's bound to systemd (EXTEND_TIMEOUT_USEC, laminar.agent.
    stop_bound_s + STOP_MARGIN_S) as it starts to stop, so a stop longer than the unit's
    TimeoutStopSec= (allowed by a larger `agent.shutdown_timeout_s`) ends in Result=success,
    not in SIGKILL mid-stop (Result=timeout).

    Made cheap: a runtime drop-in lowers TimeoutStopSec= to SHORT_STOP_S (below the default
    config's bound, as a shutdown_timeout_s above 20 s is above the shipped 20 s), and gdb
    (in the container) holds the agent HOLD_S right after its EXTEND_TIMEOUT_USEC datagram
    went out (the return of that sendto): the stop lasts longer than TimeoutStopSec= and
    systemd waits for it only because it took the extension."""
    if shutil.which("gdb") is None:
        pytest.skip("gdb not installed (apt-get install gdb): it holds the agent mid-stop")
    if platform.machine() != "x86_64":
        pytest.skip("the gdb condition reads x86-64 registers")
    jobs = JOBS
    assert jobs, "needs the jobs of test_jobs_run_as_their_submitter_in_the_agents_cgroups"
    dropin = f"/run/systemd/system/{UNIT}.service.d/lm-test-short-stop.conf"
    box.sh(f"mkdir -p $(dirname {dropin}) && printf '[Service]\\nTimeoutStopSec={SHORT_STOP_S}s\\n' > {dropin} "
           "&& systemctl daemon-reload")
    gdb: subprocess.Popen[str] | None = None
    pid = int(box.show(UNIT, "MainPID")["MainPID"])
    try:
        assert box.show(UNIT, "TimeoutStopUSec")["TimeoutStopUSec"] == f"{SHORT_STOP_S}s"
        # sendto (44) whose buffer starts with EXTEND (first 8 bytes as a little-endian word): the
        # first hit is its entry, the second its return; then hold, print what was sent, let go
        word = int.from_bytes(EXTEND[:8], "little")
        gdb = subprocess.Popen(
            ["nsenter", "-t", str(box.leader), "-a", "--", "gdb", "-nx", "-q", "-batch", "-p", str(pid),
             "-ex", "handle all nostop noprint pass", "-ex", "catch syscall 44",
             "-ex", f"condition 1 *(unsigned long *)$rsi == {word:#x}",
             "-ex", "continue", "-ex", "continue", "-ex", f"shell sleep {HOLD_S}",
             "-ex", 'printf "lm-held %s\\n", (char *)$rsi', "-ex", "detach"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def traced_and_running() -> bool:  # gdb attached and let the agent run on (its catchpoint set)
            st = proc_status(box, pid)
            return st.get("TracerPid", "0") != "0" and not st.get("State", "").startswith("t")

        wait_for("gdb attached to the agent", traced_and_running)
        box.sh(f"systemctl stop --no-block {UNIT}")
        out, _ = gdb.communicate(timeout=60)
        p = wait_for("the agent stopped", lambda: (q := box.show(
            UNIT, "ActiveState", "Result", "ExecMainCode", "ExecMainStatus", "ActiveExitTimestampMonotonic",
            "InactiveEnterTimestampMonotonic"))["ActiveState"] in ("inactive", "failed") and q)
        held = re.search(r"lm-held EXTEND_TIMEOUT_USEC=(\d+)", out)
        assert held, f"gdb never held the agent after it sent EXTEND_TIMEOUT_USEC ({p}):\n{out[-3000:]}"
        extend_s = int(held.group(1)) / 1e6
        assert extend_s > HOLD_S + 1, extend_s
        took = (int(p["InactiveEnterTimestampMonotonic"]) - int(p["ActiveExitTimestampMonotonic"])) / 1e6
        print(f"stop held {HOLD_S} s past the agent's EXTEND_TIMEOUT_USEC ({extend_s:.1f} s): took {took:.2f} s "
              f"with TimeoutStopSec={SHORT_STOP_S}s")
        assert took > SHORT_STOP_S, f"the agent's stop was not held past TimeoutStopSec ({took:.2f} s)"
        assert (p["Result"], p["ExecMainCode"], p["ExecMainStatus"]) == ("success", "1", "0"), (p, box.journal(UNIT))
    finally:
        if gdb is not None and gdb.poll() is None:
            gdb.kill()
            gdb.wait(10)
        box.sh(f"rm -f {dropin} && systemctl daemon-reload", check=False)
        box.sh(f"systemctl start {UNIT}", check=False)
    for job in jobs:  # KillMode=process: the jobs outlived the stop; the next agent reattaches them
        assert json.loads(box.ctl("-o", "json", "job", "show", job["id"]).stdout)["state"] == "running"


def test_the_enabled_unit_starts_at_boot_and_reports_the_jobs_a_reboot_ended(box: SystemdContainer) -> None:
    """After a reboot (the same installed root; new processes, cgroups, /run and bpffs) the
    enabled unit starts by itself, loads its data plane again and reports the jobs that ran
    before as lost, not running."""
    jobs = JOBS
    assert jobs, "needs the jobs of test_jobs_run_as_their_submitter_in_the_agents_cgroups"
    box.reboot()

    def active() -> dict[str, str] | None:
        p = box.show(UNIT, "ActiveState", "NRestarts")
        return p if p["ActiveState"] == "active" else None

    p = wait_for("laminard active after the reboot", active)
    assert p["NRestarts"] == "0", p  # it started once, at boot, not after failures
    s = status(box)
    assert s["netguard"]["reattached_pins"] is False and len(s["netguard"]["programs"]) == 2, s["netguard"]
    for job in jobs:
        now = json.loads(box.ctl("-o", "json", "job", "show", job["id"]).stdout)
        assert now["state"] == "lost", now


def test_nothing_of_the_container_is_left_on_the_host() -> None:
    """A second container, booted and closed here: its cleanup leaves no mount, no cgroup (so
    no process: a cgroup that holds one cannot be removed), no nspawn and no directory of its own."""
    why = missing()
    if why:
        pytest.skip(why)
    b = SystemdContainer()
    try:
        b.boot()
        name, cg, base = b.name, b.cgroup, b.base
    finally:
        b.close()
    assert b.proc is not None and b.proc.poll() is not None
    assert name not in Path("/proc/self/mounts").read_text()
    assert not any(Path("/sys/fs/cgroup", h, cg).exists() for h in ("memory", "unified", "systemd", "pids"))
    assert not base.exists()
    assert not Path("/run/systemd/nspawn/propagate", name).exists()
