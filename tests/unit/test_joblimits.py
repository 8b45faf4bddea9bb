"""What a job starts with (laminar.runtime.joblimits), without privileges: the defaults are a
Debian login's, limits.conf is read as Debian's pam_limits reads it (precedence, domains, units,
unlimited, ``-``, root), every rlimit is set (none left to the agent's), the agent's own
limits and capabilities bound what it can give, and the task limits land in the right cgroup
file on v1 (hybrid) and v2 hosts.

The same rules checked against the real pam_limits (``runuser``) and a real job:
tests/kernel/test_job_limits.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from laminar import config
from laminar.airlock.cgroups import CgroupTree, Hierarchy, detect
from laminar.runtime import joblimits as jl
from laminar.runtime.joblimits import INF, Owner, overlay, parse_conf

BASE = jl.Settings.from_config(None).base
ALICE = Owner(uid=1500, name="alice", gid=1500, groups=frozenset({1500, 2000}))
ROOT = Owner(uid=0, name="root", gid=0, groups=frozenset({0}))
GROUPS = {"alice": 1500, "gpu": 2000, "other": 3000, "root": 0}
NR_OPEN = 1048576


def over(owner: Owner, *files: str, base: dict[str, tuple[int, int]] | None = None) -> jl.Overlay:
    parsed = [parse_conf(text, f"f{i}")[0] for i, text in enumerate(files)]
    return overlay(base or BASE, parsed, owner, GROUPS.get, NR_OPEN)


# -- the defaults ----------------------------------------------------------------------------------------
def test_the_defaults_are_a_debian_login_and_name_every_rlimit() -> None:
    b = BASE
    assert set(b) == set(jl.RLIMITS) and len(b) == 16
    half = jl.threads_half()
    assert b["memlock"] == (8 << 20, 8 << 20)
    assert b["nofile"] == (1024, 524288)
    assert b["core"] == (0, INF) and b["stack"] == (8 << 20, INF)
    assert b["nproc"] == (half, half) and b["sigpending"] == (half, half)
    assert b["msgqueue"] == (819200, 819200) and b["nice"] == (0, 0) and b["rtprio"] == (0, 0)
    for k in ("as", "cpu", "data", "fsize", "locks", "rss", "rttime"):
        assert b[k] == (INF, INF), k
    s = jl.Settings.from_config(None)
    assert s.umask == 0o022 and not s.no_new_privs and s.pam_limits
    assert s.limits_conf == Path("/etc/security/limits.conf") and s.limits_dir == Path("/etc/security/limits.d")


def test_every_rlimit_goes_to_prlimit_so_none_is_the_agents() -> None:
    p = jl.Profile(1500, dict(BASE), 100, 0o022, 0, False)
    args = p.prlimit_args()
    assert sorted(a.split("=")[0][2:] for a in args) == sorted(jl.RLIMITS)
    assert "--memlock=8388608:8388608" in args and "--core=0:unlimited" in args and "--nofile=1024:524288" in args
    argv = jl.launch_argv(p)
    assert argv[argv.index(jl.PRLIMIT):][-1] == "--" and jl.SETPRIV not in argv
    nnp = jl.launch_argv(jl.Profile(1500, dict(BASE), 100, 0o022, 0, True))
    assert nnp[-3:] == [jl.SETPRIV, "--no-new-privs", "--"]  # after the limits, before the drop


@pytest.mark.parametrize("text, want", [
    ("8M", (8 << 20, 8 << 20)), ("1024:524288", (1024, 524288)), ("0:unlimited", (0, INF)),
    ("64K:4MiB", (64 << 10, 4 << 20)), ("unlimited", (INF, INF)), ("infinity:infinity", (INF, INF)),
])
def test_config_values(text: str, want: tuple[int, int]) -> None:
    assert jl.parse_pair("memlock", text) == want


@pytest.mark.parametrize("toml, needles", [
    ('memlock = "8X"', ["job_limits.memlock = '8X'", "not a number"]),
    ('nofile = "2048:1024"', ["job_limits.nofile", "soft limit 2048 above the hard limit 1024"]),
    ('nofile = "1K"', ["job_limits.nofile = '1K'", "count"]),
    ('memlock = "auto"', ["'auto' is only for nproc and sigpending"]),
    ('pids_max = "120%"', ["job_limits.pids_max = '120%'", "'33%'"]),
    ('pids_max = 0', ["at least 1"]),
    ('umask = "999"', ["job_limits.umask = '999'", "octal umask"]),
    ('limits_conf = "etc/limits.conf"', ["absolute path"]),
])
def test_a_bad_value_is_refused_naming_it(tmp_path: Path, toml: str, needles: list[str]) -> None:
    p = tmp_path / "c.toml"
    p.write_text(f"[job_limits]\n{toml}\n")
    with pytest.raises(config.ConfigError) as e:
        config.load(p)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_pids_max_as_a_share_of_the_kernels_task_limit() -> None:
    assert jl.parse_pids("max") is None and jl.parse_pids(4096) == 4096
    assert jl.parse_pids("33%") == max(1, int(jl.kernel_tasks() * 0.33))
    assert jl.parse_pids("100%") == jl.kernel_tasks()


# -- limits.conf, as pam_limits reads it -------------------------------------------------------------
def test_user_beats_group_beats_star_whatever_the_order() -> None:
    o = over(ALICE, "alice hard nproc 300\n* hard nproc 200\n@gpu hard nproc 250\n")
    assert o.limits["nproc"][1] == 300
    o = over(ALICE, "* hard nproc 200\n@gpu hard nproc 250\n")
    assert o.limits["nproc"][1] == 250
    # among equals the later line wins, also across files (limits.conf, then limits.d by name)
    o = over(ALICE, "@gpu soft nofile 512\n", "@alice soft nofile 256\n")
    assert o.limits["nofile"][0] == 256
    o = over(ALICE, "* - core 1\n* - core 2\n")
    assert o.limits["core"] == (2048, 2048)


def test_soft_hard_and_dash_and_the_soft_clamp() -> None:
    o = over(ALICE, "alice soft stack 4096\n")
    assert o.limits["stack"] == (4 << 20, INF)  # the hard limit stays the base's
    o = over(ALICE, "alice hard nproc 100\n")
    assert o.limits["nproc"] == (100, 100)  # the soft above the new hard is lowered to it
    o = over(ALICE, "alice - memlock 1024\n")
    assert o.limits["memlock"] == (1 << 20, 1 << 20)


def test_units_kib_minutes_bytes_nice_and_unlimited() -> None:
    o = over(ALICE, "alice - fsize 10\nalice - cpu 2\nalice - msgqueue 4096\nalice - nice -5\n"
                    "alice - nofile unlimited\nalice - as -1\nalice - data -\nalice - locks infinity\n"
                    "alice - rtprio 3\nalice - sigpending 77\nalice - rss 1\nalice - core 0\n")
    lim = o.limits
    assert lim["fsize"] == (10 << 10, 10 << 10) and lim["cpu"] == (120, 120) and lim["msgqueue"] == (4096, 4096)
    assert lim["nice"] == (25, 25)  # RLIMIT_NICE = 20 - nice
    assert lim["nofile"] == (NR_OPEN, NR_OPEN)  # unlimited nofile: fs.nr_open
    assert lim["as"] == (INF, INF) and lim["data"] == (INF, INF) and lim["locks"] == (INF, INF)
    assert lim["rtprio"] == (3, 3) and lim["sigpending"] == (77, 77) and lim["rss"] == (1024, 1024)
    assert over(ALICE, "alice - nice 40\n").limits["nice"] == (1, 1)  # nice clamped to 19
    assert over(ALICE, "alice - nice -99\n").limits["nice"] == (40, 40)  # ... and to -20


def test_values_as_c_reads_them_and_bad_lines_skipped() -> None:
    # strtoull: trailing text ignored; case of type, item and value ignored; comments; a bad value,
    # an unknown item or type, three fields: skipped as pam_limits skips them
    o = over(ALICE, "alice SOFT NOFILE 100abc   # comment\n  # only a comment\n\nalice hard nofile x\n"
                    "alice hard frobs 1\nalice medium nofile 5\nalice hard\n")
    assert o.limits["nofile"] == (100, 524288)
    assert [x.split(":")[1] for x in o.applied] == ["1"]
    _lines, bad = parse_conf("alice hard\nx y z\n", "f")
    assert bad == ["f:1: alice hard", "f:2: x y z"]


def test_groups_by_name_by_gid_and_gid_ranges_of_the_primary_group() -> None:
    assert over(ALICE, "@gpu - core 1\n").limits["core"] == (1024, 1024)      # a supplementary group by name
    assert over(ALICE, "@other - core 1\n").limits["core"] == BASE["core"]   # not a member
    assert over(ALICE, "@nosuch - core 1\n").limits["core"] == BASE["core"]  # no such group
    assert over(ALICE, "@:2000 - core 1\n").limits["core"] == (1024, 1024)   # any of its groups, by gid
    assert over(ALICE, "@1900:2100 - core 1\n").limits["core"] == BASE["core"]  # ranges: the primary only
    assert over(ALICE, "@1400:1600 - core 1\n").limits["core"] == (1024, 1024)
    assert over(ALICE, "@1500: - core 1\n").limits["core"] == (1024, 1024)


def test_uid_ranges_count_as_user_lines() -> None:
    assert over(ALICE, "1000:2000 - core 1\n* - core 2\n").limits["core"] == (1024, 1024)
    assert over(ALICE, ":1500 - core 1\n").limits["core"] == (1024, 1024)
    assert over(ALICE, "1501: - core 1\n").limits["core"] == BASE["core"]
    assert over(ALICE, "x:1 - core 1\n").limits["core"] == BASE["core"]  # a bad range: skipped


def test_star_and_groups_do_not_apply_to_root_its_name_and_uid_ranges_do() -> None:
    o = over(ROOT, "* - core 1\n@root - nproc 10\nroot hard nofile 4000\n0:0 soft stack 100\n")
    assert o.limits["core"] == BASE["core"] and o.limits["nproc"] == BASE["nproc"]
    assert o.limits["nofile"] == (1024, 4000) and o.limits["stack"] == (100 << 10, INF)


def test_percent_domains_and_login_items_are_not_process_limits() -> None:
    o = over(ALICE, "%gpu - nproc 10\n% - nofile 10\nalice - maxlogins 1\nalice - maxsyslogins 1\n"
                    "alice - chroot /jail\n")
    assert o.limits == {k: (min(s, h), h) for k, (s, h) in BASE.items()} and o.applied == []


def test_a_matching_no_limits_line_leaves_the_defaults() -> None:
    o = over(ALICE, "* - core 1\nalice -\n* - nofile 10\n")
    assert o.ignored_by == "f0:2: alice -" and o.limits["core"] == BASE["core"]
    o = over(ALICE, "* - core 1\n", "@gpu -\n")  # in a later file: nothing of the earlier one either
    assert o.ignored_by == "f1:1: @gpu -" and o.limits["core"] == BASE["core"]
    assert over(ALICE, "bob -\n* - core 1\n").limits["core"] == (1024, 1024)  # someone else's


def test_a_dash_line_whose_soft_half_is_beaten_sets_no_hard_limit() -> None:
    # pam's process_limit returns at the soft half: the hard half of the same line is dropped
    o = over(ALICE, "alice soft nofile 100\n* - nofile 200\n")
    assert o.limits["nofile"] == (100, 524288)


def test_priority_and_nonewprivs_the_last_matching_line() -> None:
    o = over(ALICE, "* - priority 5\n@gpu - priority 7\nalice - nonewprivs 1\n")
    assert o.nice == 7 and o.no_new_privs
    assert not over(ALICE, "alice - nonewprivs 1\nalice - nonewprivs 0\n").no_new_privs


def test_an_owner_without_a_passwd_entry_gets_star_ranges_and_its_gid() -> None:
    anon = Owner(uid=777777, name=None, gid=3000, groups=frozenset({3000}))
    o = over(anon, "* - core 1\n@other - nproc 9\n777777: - locks 3\n")
    assert o.limits["core"] == (1024, 1024) and o.limits["nproc"] == (9, 9) and o.limits["locks"] == (3, 3)


# -- files ----------------------------------------------------------------------------------------------
def test_limits_conf_then_limits_d_by_name_hidden_and_other_names_not_read(tmp_path: Path) -> None:
    d = tmp_path / "limits.d"
    d.mkdir()
    conf = tmp_path / "limits.conf"
    conf.write_text("* - core 1\n")
    (d / "20-b.conf").write_text("* - core 3\n")
    (d / "10-a.conf").write_text("* - core 2\n")
    (d / ".hidden.conf").write_text("* - core 9\n")
    (d / "30-c.conf.dpkg-old").write_text("* - core 9\n")
    lim = jl.Limiter(jl.Settings.from_config({"limits_conf": str(conf), "limits_dir": str(d)}))
    p = lim.profile(65534, 65534)
    assert p.limits["core"] == (3072, 3072)
    assert p.sources == ("[job_limits]", f"{conf}:1: * - core 1", f"{d}/10-a.conf:1: * - core 2",
                         f"{d}/20-b.conf:1: * - core 3")
    (d / "20-b.conf").write_text("* - core 4\n")  # a changed file is read again
    assert lim.profile(65534, 65534).limits["core"] == (4096, 4096)
    conf.unlink()  # a missing limits.conf is an empty one
    assert lim.profile(65534, 65534).limits["core"] == (4096, 4096)


def test_a_file_that_cannot_be_read_refuses_the_start_naming_it(tmp_path: Path) -> None:
    (tmp_path / "limits.conf").mkdir()  # exists, cannot be read as a file
    lim = jl.Limiter(jl.Settings.from_config({"limits_conf": str(tmp_path / "limits.conf"),
                                              "limits_dir": str(tmp_path / "none")}))
    with pytest.raises(jl.LimitsError, match="limits.conf"):
        lim.profile(65534, 65534)
    off = jl.Limiter(jl.Settings.from_config({"pam_limits": False, "limits_conf": str(tmp_path / "limits.conf")}))
    assert off.profile(65534, 65534).sources == ("[job_limits]",)


# -- what the agent can give -----------------------------------------------------------------------
def test_without_cap_sys_resource_a_hard_limit_above_the_agents_is_lowered_and_said() -> None:
    p = jl.Profile(1500, dict(BASE), None, 0o022, 0, False)
    agent = {k: h for k, (_s, h) in BASE.items()} | {"nofile": 20000, "memlock": 4 << 20}
    c = jl.clamp(p, agent, may_raise=False, nofile_max=NR_OPEN, agent_nice=0, may_renice=True)
    assert c.limits["nofile"] == (1024, 20000) and c.limits["memlock"] == (4 << 20, 4 << 20)
    assert "CAP_SYS_RESOURCE" in c.clamped["nofile"] and "8M lowered to 4M" in c.clamped["memlock"]
    full = jl.clamp(p, agent, may_raise=True, nofile_max=NR_OPEN, agent_nice=0, may_renice=True)
    assert full.limits == p.limits and full.clamped == {}
    big = jl.clamp(jl.Profile(1500, BASE | {"nofile": (INF, INF)}, None, 0o022, 0, False), agent, True, NR_OPEN, 0, True)
    assert big.limits["nofile"] == (NR_OPEN, NR_OPEN) and "fs.nr_open" in big.clamped["nofile"]
    nice = jl.clamp(jl.Profile(1500, dict(BASE), None, 0o022, -15, False), agent, True, NR_OPEN, -10, False)
    assert nice.nice == -10 and "CAP_SYS_NICE" in nice.clamped["priority"]


def test_the_record_names_every_rlimit_with_unlimited_spelled_out() -> None:
    rec = jl.Profile(1500, dict(BASE), 4096, 0o027, 3, True, ("[job_limits]",)).record()
    assert set(rec["rlimits"]) == set(jl.RLIMITS)
    assert rec["rlimits"]["core"] == [0, "unlimited"] and rec["rlimits"]["memlock"] == [8 << 20, 8 << 20]
    assert rec["pids_max"] == 4096 and rec["umask"] == "0027" and rec["nice"] == 3 and rec["no_new_privs"]


# -- where pids.max goes: v1 (hybrid) and v2 (fake cgroupfs: plain directories) ---------------------------
HYBRID_PIDS = """cgroup2 {u} cgroup2 rw,nosuid 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,memory 0 0
cgroup {p} cgroup rw,nosuid,pids 0 0
"""


def test_hybrid_detects_the_v1_pids_hierarchy(tmp_path: Path) -> None:
    u = tmp_path / "unified"
    u.mkdir()
    (u / "cgroup.controllers").write_text("hugetlb\n")
    h = detect(HYBRID_PIDS.format(u=u, p=tmp_path / "pids"))
    assert h.mode == "hybrid" and h.v1["pids"] == tmp_path / "pids" and h.pids_mount == tmp_path / "pids"
    assert not h.pids_in_v2


@pytest.mark.parametrize("mode", ["v2", "hybrid"])
def test_pids_max_lands_in_the_job_dir_and_the_root_dir_fake_cgroupfs(tmp_path: Path, mode: str) -> None:
    """A fake cgroupfs (plain directories; this host's pids controller is v1-bound, so a real v2
    one cannot be made): the files the writes land in, per layout."""
    u = tmp_path / "unified"
    pids_v1 = tmp_path / "pids"
    h = (Hierarchy("v2", u, {}, frozenset({"memory", "cpu", "pids"})) if mode == "v2"
         else Hierarchy("hybrid", u, {"memory": tmp_path / "memory", "pids": pids_v1}, frozenset()))
    tree = CgroupTree(h, "laminar-t-fake")
    for m in tree.mounts():
        for c in ("", *tree.classes):
            (m / "laminar-t-fake" / c).mkdir(parents=True, exist_ok=True)
    (u / "cgroup.subtree_control").touch()
    for c in ("", *tree.classes):
        (u / "laminar-t-fake" / c / "cgroup.subtree_control").touch()
    tree.ensure()
    cg = tree.job("transient", "job-1")
    cg.create()
    assert cg.set_pids_max(64) and tree.set_root_pids_max(1000)
    base = u if mode == "v2" else pids_v1
    assert (base / "laminar-t-fake/transient/job-1/pids.max").read_text() == "64"
    assert (base / "laminar-t-fake/pids.max").read_text() == "1000"
    assert cg.set_pids_max(None) and (base / "laminar-t-fake/transient/job-1/pids.max").read_text() == "max"
    if mode == "v2":
        assert "+pids" in (u / "laminar-t-fake" / "cgroup.subtree_control").read_text()
    else:  # the job joins the v1 pids directory too (ENTER_SH writes every cgroup.procs)
        assert pids_v1 / "laminar-t-fake/transient/job-1/cgroup.procs" in cg.procs_files()
    none = Hierarchy("hybrid", u, {"memory": tmp_path / "memory"}, frozenset())
    assert not CgroupTree(none, "laminar-t-fake").job("transient", "job-1").set_pids_max(64)
