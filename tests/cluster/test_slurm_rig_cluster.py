"""The Slurm test rig itself (``tests/slurmrig.py``) and what the SPANK plugin does without the
agent's word: real slurmctld, slurmd and munge beside two real laminard agents.

- each slurmd runs in its agent's namespaces with its NodeName as hostname, and a step runs there;
- a job that gives no ``--laminar-*`` option is left alone (no Laminar job on its node);
- an option whose syntax is wrong is refused by the plugin at ``srun`` and ``sbatch``, before
  anything is queued, with the value and what is right;
- the rig leaves nothing behind: no Slurm or munge process, no directory it made.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from harness import Cluster
from slurmrig import SlurmRig, _pids_in_uts, slurm_ready

pytestmark = pytest.mark.cluster

_reason = slurm_ready()
if _reason:  # in CI (CI=true) a cluster test that skips counts as failed (tests/conftest.py)
    pytestmark = [pytest.mark.cluster, pytest.mark.skip(reason=f"slurm rig: {_reason}")]


def test_the_rig_runs_steps_in_each_agents_namespaces_leaves_plain_jobs_alone_and_cleans_up(tmp_path: Path):
    with Cluster.create(tmp_path, zones=1, per_zone=2, gpus=0) as c:
        with SlurmRig.create(tmp_path, c) as s:
            public, state = s.public, s.state
            uts = [n.uts for n in s.nodes] + [s.ctld_uts]
            munged = s.munged
            assert munged is not None
            # a step on node 1, launched from node 0: its hostname is node 1's NodeName, its
            # network node 1's namespace (the agent's address)
            r = s.run("srun", "-w", s.nodes[1].name, "sh", "-c", "hostname; ip -4 -o addr show", node=0)
            lines = r.stdout.splitlines()
            assert lines[0] == s.nodes[1].name, r.stdout
            assert f" {c.nodes[1].addr}/" in r.stdout, r.stdout
            # the plugin's socket path, in node 0's mount namespace, is node 0's agent
            r = s.run("sh", "-c", f"test -S {s.plugin_socket} && echo yes", node=0)
            assert r.stdout.strip() == "yes"
            assert not s.plugin_socket.exists()  # on the host: nothing there (no agent to ask)
            # no --laminar-* option: left alone
            r = s.run("srun", "-w", s.nodes[0].name, "sh", "-c", 'echo "id=${LAMINAR_JOB_ID:-none}"', node=0)
            assert r.stdout.strip() == "id=none", r.stdout
            assert not [j for j in c.nodes[0].json("jobs") if j.get("scheduler")], c.nodes[0].json("jobs")
            # syntax refused by the plugin itself, at srun and at sbatch, nothing queued
            for argv in (["srun", "--laminar-priority", "1000", "true"],
                         ["sbatch", "--laminar-priority", "1000", "--wrap", "true"]):
                r = s.run(*argv, node=0, check=False)
                assert r.returncode != 0, r
                assert "laminar: --laminar-priority 1000: expected an integer 0..100" in r.stderr, r.stderr
            for argv in (["srun", "--laminar-class", "bad/name", "true"],
                         ["srun", "--laminar-checkpoint", "USR1;x", "true"]):
                r = s.run(*argv, node=0, check=False)
                assert r.returncode != 0 and "laminar: --laminar-" in r.stderr, r.stderr
            assert s.run("squeue", "-h", "-o", "%i").stdout.split() == []
            # a batch job that outlives the rig's exit: scancel and the teardown take it
            out = tmp_path / "long.out"
            job = s.sbatch("-o", str(out), "--wrap", "exec sleep 600")
            s.wait_state(job, "RUNNING")
        # nothing left: no process in the rig's UTS namespaces (slurmd, slurmctld, slurmstepd, the
        # job), munged gone, no directory the rig made
        assert all(ns is not None and not _pids_in_uts(ns) for ns in uts), uts
        assert munged.poll() is not None
        assert not public.exists() and not state.exists()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            assert str(public).encode() not in cmd and str(state).encode() not in cmd, cmd


def test_the_rig_leaves_nothing_when_the_test_fails_inside_it(tmp_path: Path):
    seen: dict[str, object] = {}
    with Cluster.create(tmp_path, zones=1, per_zone=1, gpus=0) as c:
        with pytest.raises(RuntimeError, match="the test failed"):
            with SlurmRig.create(tmp_path, c, gpus=2) as s:  # gres on fake GPU device files
                s.wait_state(s.sbatch("--gres=gpu:2", "--wrap", "exec sleep 600"), "RUNNING")
                assert s.fake_gpu(1).is_char_device()
                seen.update(public=s.public, state=s.state, uts=[n.uts for n in s.nodes] + [s.ctld_uts],
                            munged=s.munged)
                raise RuntimeError("the test failed")
    uts = seen["uts"]
    assert isinstance(uts, list) and all(ns is not None and not _pids_in_uts(ns) for ns in uts), uts
    assert seen["munged"].poll() is not None  # type: ignore[attr-defined]
    assert not Path(str(seen["public"])).exists() and not Path(str(seen["state"])).exists()
