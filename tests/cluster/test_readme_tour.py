"""The README's "A tour of laminarctl" is true: every command it names exists, and the
representative ones do what their comment says against real agents.

The tour block (the ```sh block after "## A tour of laminarctl" in README.md) is parsed, not
copied: each ``laminarctl ...`` line must parse with laminarctl's own argument parser (so a
renamed command or option fails here), its command path must answer ``--help`` with exit 0, and
``laminarctl --help`` must list every top-level command the tour names.

Then the tour is run, adapted only where it must be (job ids, the addresses of the test's
namespaces, a short notice, a tiny job instead of ``python train.py``):

- one real laminard (every component, Airlock included) on a test veth: status, submit, jobs,
  job show --follow, job stop, policy show/validate/set, events --follow (exits 3 with the
  --since id when the agent goes away), bpf maps/dump, killswitch on/arm/off, net transfers,
  kill-flow, flows, and bpf unload (the agent stops);
- two agents in one zone (tests/cluster/harness.py; node 2 advertises an H100 and serves the
  inference pool): zone peers/submit/stats/keys, pool load/show/reclaim, reclaim --notice,
  migrations, replicas.

The GPUs are declared ones (no GPU on this machine): a fake, named as one.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from agentproc import NOBODY, AgentProc
from harness import UDP_PORT, VENV_BIN, Cluster, cluster_ready, wait_until
from test_migration import train_cmd

pytestmark = pytest.mark.cluster

README = Path(__file__).resolve().parents[2] / "README.md"
CTL = str(VENV_BIN / "laminarctl")


def tour_lines() -> list[list[str]]:
    """The argv (after ``laminarctl``) of every command line of the README's tour block."""
    text = README.read_text()
    m = re.search(r"^## A tour of laminarctl\s*\n```sh\n(.*?)^```", text, re.S | re.M)
    assert m, "README.md has no ```sh block after '## A tour of laminarctl'"
    out = []
    for line in m.group(1).splitlines():
        line = line.strip()
        if not line.startswith("laminarctl "):
            continue
        out.append(shlex.split(line, comments=True)[1:])
    assert len(out) > 20, out
    return out


def command_path(argv: list[str]) -> list[str]:
    """The (sub)command words of one tour line, by walking laminarctl's parser."""
    import argparse

    from laminarctl.main import build_parser

    parser: argparse.ArgumentParser = build_parser()
    path: list[str] = []
    opts_with_value = {"-o", "--output", "--socket"}
    words: list[str] = []
    skip = False
    for w in argv:
        if skip:
            skip = False
        elif w in opts_with_value:
            skip = True
        elif not w.startswith("-"):
            words.append(w)
        else:
            break
    for w in words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or w not in subs[0].choices:
            break
        path.append(w)
        parser = subs[0].choices[w]
    return path


def test_every_command_of_the_tour_exists_and_parses() -> None:
    from laminarctl.main import build_parser

    top = subprocess.run([CTL, "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0, top.stderr
    for argv in tour_lines():
        path = command_path(argv)
        assert path, f"laminarctl {' '.join(argv)}: names no laminarctl command"
        assert re.search(rf"^\s+{re.escape(path[0])}\s", top.stdout, re.M) or f"{{{path[0]}," in top.stdout \
            or f",{path[0]}," in top.stdout or f",{path[0]}}}" in top.stdout, \
            f"laminarctl --help does not list {path[0]!r}:\n{top.stdout}"
        r = subprocess.run([CTL, *path, "--help"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"laminarctl {' '.join(path)} --help exited {r.returncode}: {r.stderr}"
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"laminarctl {' '.join(argv)}: laminarctl's parser refuses it (exit {e.code})")
    # the simulator's line runs as written from the checkout (no agent needed), where its data is
    sim = [argv for argv in tour_lines() if argv[0] == "sim"]
    assert len(sim) == 1, sim
    trace = README.parent / sim[0][sim[0].index("--trace") + 1]
    if trace.is_dir():
        r = subprocess.run([CTL, *sim[0]], capture_output=True, text=True, timeout=120, cwd=README.parent)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["policy"] == "laminar", r.stdout[:2000]


def ok(a: AgentProc, *args: str) -> subprocess.CompletedProcess[str]:
    r = a.ctl(*args)
    print(f"$ laminarctl {' '.join(args)}\n{r.stdout}{r.stderr}")  # shown when the test fails
    return r


def js(a: AgentProc, *args: str) -> Any:
    return a.json(*args)


def bg(a: AgentProc, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(a.argv(CTL, "--socket", str(a.sock), *args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


POLICY_OK = '[thresholds]\n"memory.some" = 0.2\n'
POLICY_BAD = '[thresholds]\n"memory.some" = 1.7\n'


def test_the_tour_on_one_agent(agent: AgentProc, tmp_path: Path) -> None:
    a = agent
    st = js(a, "status")
    assert ok(a, "status").stdout.strip()
    assert isinstance(st, dict) and st, st

    # jobs
    sub = js(a, "submit", "--env", "LMT_TOKEN=lm-t-secret", "--memory", "64M", "--class", "long-resident", "--priority", "80", "--name", "lm-t-tour",
             "--", "sleep", "3600")
    jid = sub["id"]
    wait_until(lambda: js(a, "job", "show", jid)["state"] == "running", 30, "the job to run")
    shown = js(a, "job", "show", jid)
    assert shown["spec"]["class"] == "long-resident" and shown["spec"]["priority"] == 80, shown
    # no GPUs: the job sees CUDA_VISIBLE_DEVICES="" (not unset: no GPU visible at all)
    seen = tmp_path / "cvd"
    gj = js(a, "submit", "--", "sh", "-c", f'printf "[%s]" "${{CUDA_VISIBLE_DEVICES-unset}}" > {seen}')["id"]
    wait_until(lambda: seen.exists() and seen.read_text(), 30, "the job to write its CUDA_VISIBLE_DEVICES")
    assert seen.read_text() == "[]", seen.read_text()
    # a class beyond standard/transient at 50 needs a [grants] entry: an ordinary user is refused (exit 4)
    r = a.ctl("submit", "--class", "long-resident", "--priority", "80", "--", "true", check=False, user=NOBODY)
    assert r.returncode == 4, (r.returncode, r.stdout, r.stderr)
    wait_until(lambda: js(a, "job", "show", gj)["state"] not in ("running", "queued"), 30, "the GPU-less job to end")
    # env values are shown to the job's owner and root only
    assert js(a, "job", "show", jid)["spec"]["env"]["LMT_TOKEN"] == "lm-t-secret"
    other = a.ctl("-o", "json", "jobs", user=NOBODY)
    assert other.returncode == 0 and "lm-t-secret" not in other.stdout, other
    seen_by_other = [j for j in json.loads(other.stdout) if j["id"] == jid]
    assert seen_by_other[0]["env_redacted"] is True and list(seen_by_other[0]["spec"]["env"]) == ["LMT_TOKEN"]
    assert "lm-t-secret" not in a.ctl("jobs", user=NOBODY).stdout
    table = ok(a, "jobs").stdout
    assert jid in table and "running" in table, table
    assert any(j["id"] == jid for j in js(a, "jobs", "--last", "1000"))
    follow = bg(a, "job", "show", jid, "--follow")

    # Airlock's policy
    pol = js(a, "policy", "show")
    good, bad = tmp_path / "my.toml", tmp_path / "bad.toml"
    good.write_text(POLICY_OK)
    bad.write_text(POLICY_BAD)
    assert js(a, "policy", "validate", str(good))
    r = a.ctl("policy", "validate", str(bad), check=False)
    assert r.returncode == 1 and "1.7" in r.stderr and "memory.some" in r.stderr, (r.returncode, r.stderr)
    put = js(a, "policy", "set", str(good))
    assert put["version"] >= 1 and put["policy"]["thresholds"]["memory.some"] == 0.2, put
    pol2 = js(a, "policy", "show")
    assert pol2 != pol and json.dumps(pol2).count("0.2"), pol2

    # the data plane
    maps = ok(a, "bpf", "maps").stdout
    assert "lm_jobs" in maps, maps
    dump = js(a, "bpf", "dump", "lm_jobs")
    assert dump, dump
    ok(a, "bpf", "dump", "lm_jobs")
    def job_flags() -> list[str]:
        return [e["value"]["flags"] for e in js(a, "bpf", "dump", "lm_jobs")["entries"]
                if e["value"]["job_id"] == shown["num"]][0]

    def global_flags() -> list[str]:
        return list(js(a, "killswitch", "status")["global"]["flags"])

    # killswitch on --job: the job's lm_jobs entry carries the kill bit (the data plane drops its packets)
    ok(a, "killswitch", "on", "--job", jid)
    assert "kill" in job_flags()
    assert [j["kill"] for j in js(a, "killswitch", "status")["jobs"] if j["job"] == jid] == [True]
    # arm --lent --at +30s: the deadline is in lm_global, where the data plane enforces it alone
    armed = js(a, "killswitch", "arm", "--lent", "--at", "+30s")
    assert (armed["action"], armed["scope"]) == ("arm", "lent"), armed
    assert "armed" in global_flags()
    assert 0 < js(a, "killswitch", "status")["global"]["armed_in_s"] <= 30
    ok(a, "killswitch", "off", "--all")
    assert "kill" not in job_flags()
    # NB: `off --all` clears every job's cut and deadline but not the lent deadline (reported to
    # the lead); `off --lent` clears that one.
    ok(a, "killswitch", "off", "--lent")
    assert global_flags() == [], global_flags()
    assert js(a, "net", "transfers") is not None
    ok(a, "net", "transfers")
    flow = "tcp:10.0.0.1:40000->10.0.0.2:7000"
    ok(a, "net", "kill-flow", flow, "on")
    flows = js(a, "net", "flows")
    mine = [f for f in flows if "40000" in json.dumps(f) and "7000" in json.dumps(f)]
    assert mine and mine[0]["origin"] == "operator" and mine[0]["cut"], flows
    assert "operator" in ok(a, "net", "flows").stdout
    restored = js(a, "net", "kill-flow", flow, "off")
    assert restored["kill"] is False and restored["cut"] is False, restored

    assert js(a, "job", "stop", jid)["state"] == "stopped"
    assert follow.wait(60) == 0, follow.communicate()
    assert js(a, "job", "show", jid)["state"] not in ("running", "queued", "suspended")

    # events --follow exits 3 with the id to resume from when the agent goes away
    ev = bg(a, "events", "--follow", "--kind", "airlock")
    time.sleep(1.0)
    unloaded = js(a, "bpf", "unload")
    assert "lm_jobs" in unloaded["pins_removed"] and unloaded["filters_removed"] == 2, unloaded
    wait_until(lambda: a.proc is not None and a.proc.poll() is not None, 60, "the agent to stop after bpf unload")
    try:
        code = ev.wait(60)
    finally:
        if ev.poll() is None:
            ev.kill()
    err = ev.communicate()[1]
    assert code == 3 and "--since" in err, (code, err)
    assert not a.pin_root.exists() or not any(a.pin_root.iterdir())


H100 = 'gpu_model = "NVIDIA H100 80GB HBM3"\n'
LOAN = "\n[loan]\nelastic_interval_s = 0\nckpt_wait_s = 5\nstop_grace_s = 1\n"


def test_the_tour_in_a_zone_of_two(tmp_path: Path) -> None:
    why = cluster_ready()
    if why:
        pytest.skip(why)
    migrate = '\n[migrate]\nprestage = "always"\npoll_s = 0.2\n'
    with Cluster.create(tmp_path, zones=1, per_zone=2, gpus=1, pools={0: "training", 1: "inference"},
                        node_extra={0: migrate + LOAN, 1: H100 + migrate + LOAN}, probe_timeout_s=1.0) as c:
        a, b = c.nodes
        peers = a.json("zone", "peers")
        assert {p["node"] for p in peers} == {a.node_id, b.node_id}, peers
        assert str(b.node_id) in ok(a.agent, "zone", "peers").stdout

        # zone submit: probe d nodes, bind the first good offer
        r = a.json("zone", "submit", "--gpus", "0.5", "--name", "lm-t-serve", "--", "sleep", "3600")
        assert r["outcome"] == "placed", r
        # --gpu-model H100 matches node 2's "NVIDIA H100 80GB HBM3" and only it
        r = a.json("zone", "submit", "--gpus", "1", "--gpu-model", "H100", "--name", "lm-t-h100", "--", "sleep", "3600")
        assert r["outcome"] == "placed" and r["node"] == b.node_id, r
        r = a.json("zone", "submit", "--packing", "--gpus", "0.25", "--name", "lm-t-pack", "--", "sleep", "3600")
        assert r["outcome"] == "placed", r
        # not in the tour (reported): the placements this node submitted
        assert len(a.json("zone", "placements")) >= 3
        ok(a.agent, "zone", "placements")
        # a datagram that is not the zone's is dropped, by reason
        before = sum(a.json("zone", "stats")["drops"].values())
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"lm-t not a zone datagram" * 4, (a.addr, UDP_PORT))
        wait_until(lambda: sum(a.json("zone", "stats")["drops"].values()) > before, 10, "the drop to be counted")
        assert "bad_magic" in ok(a.agent, "zone", "stats").stdout
        keys = a.json("zone", "keys")
        assert "current" in json.dumps(keys), keys
        ok(a.agent, "zone", "keys")
        reloaded = a.json("zone", "keys", "reload")
        assert [k["role"] for k in reloaded["keys"]] == ["current"], reloaded

        # pool
        loaded = b.json("pool", "load", "0.2")
        assert loaded["load"] == 0.2 and loaded["loanable"] is True, loaded
        pool = b.json("pool")
        assert pool["loanable"] is True, pool
        assert "inference" in ok(b.agent, "pool").stdout
        r = a.agent.ctl("-o", "json", "pool", "return", "--pool", "inference", "--count", "2", check=False)
        assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)

        # reclaim: the zone's sleepers go, a checkpointing job on A is prestaged to B, then moved
        for nd in c.nodes:
            for j in nd.json("jobs", "--active"):
                ok(nd.agent, "job", "stop", j["id"], "--grace", "0")
        job = a.json("submit", "--name", "lm-t-train", "--", *train_cmd(0.1))
        jid, key = job["id"], f"n{a.node_id}-{job['id']}"
        wait_until(lambda: any(r["key"] == key and r["state"] == "keeping" for r in b.json("replicas")), 60,
                   "B to hold A's job's checkpoint")
        assert key in ok(b.agent, "replicas").stdout
        # not in the tour (reported): each job's periodic checkpoint plan
        assert jid in json.dumps(a.json("checkpoints"))
        ok(a.agent, "checkpoints")
        r = b.agent.ctl("replicas", "drop", key, check=False)  # a keeper needs --force
        assert r.returncode == 1 and "--force" in r.stderr, (r.returncode, r.stderr)
        res = a.json("reclaim", "--notice", "8s", "--reason", "lm-t tour")
        assert res["reclaim"]["armed"] == [jid], res  # the kill-switch is armed for the window's end
        wait_until(lambda: a.json("job", "show", jid)["state"] == "migrated", 60, "the job to leave node A")
        move = a.json("migrations")[0]  # done before the job was stopped here (migrated)
        assert move["phase"] == "done", move
        assert move["job"] == jid and move["dest"] == b.node_id, move
        assert "done" in ok(a.agent, "migrations").stdout
        assert b.json("job", "show", move["dest_job"])["state"] in ("running", "exited"), move
        # and nothing starts on A any more
        r = a.ctl("-o", "json", "submit", "--", "sleep", "60", check=False)
        assert r.returncode == 0, (r.returncode, r.stderr)
        late = json.loads(r.stdout)
        assert late["state"] != "running" and "reclaimed" in (late.get("reason") or ""), late


def test_killswitch_off_all_restores_lent_jobs_too(agent: AgentProc) -> None:
    """The tour's ``killswitch off --all`` after ``arm --lent`` (or ``on --lent``): every job's
    traffic flows again, as the answer says, lent jobs' included, and no lent deadline is left."""
    a = agent
    lent = js(a, "submit", "--lent", "--name", "lm-t-lent", "--", "sleep", "600")["id"]
    ok(a, "killswitch", "on", "--lent")
    ok(a, "killswitch", "arm", "--lent", "--at", "+30s")
    assert js(a, "killswitch", "status")["global"]["flags"]
    res = js(a, "killswitch", "off", "--all")
    assert "all jobs restored" in res["message"], res
    st = js(a, "killswitch", "status")
    assert [j["kill"] for j in st["jobs"] if j["job"] == lent] == [False], st
    assert st["global"]["flags"] == [] and st["global"]["armed_in_s"] is None, st
