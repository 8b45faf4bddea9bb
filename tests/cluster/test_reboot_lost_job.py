"""A node that reboots faster than anyone takes it for gone: its job's keeper resumes the job.

Three real agents in one zone (tests/cluster/harness.py), each in its own network namespace,
``orphan_after_s`` off (the default: a silence alone declares nobody gone). A real job on A
writes a jobkit checkpoint (step 7) and runs on; A prestages it to a keeper. Then A "reboots":
its link goes down, its agent and the job are SIGKILLed and its cgroups removed (a power cut),
and 6 s later the link is back and its agent starts with its state directory kept (a disk).
A's agent finds the job gone (state ``lost``). The keeper, hearing A again after the silence,
asks it about the job (control op ``needs``), learns it was lost there, and resumes it from its
replica (event phase ``stopped-there``): exactly one copy runs, on a node other than A, from
the checkpoint A left. Before, the keeper went on keeping a job that ran nowhere, for as long
as A stayed up (bench/chaos.py --no-archive --reboots found the same with a reclaim window that
ended while the keeper's agent was down).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest
from agentproc import VENV_BIN, remove_cgroup_tree
from harness import Cluster, wait_until
from test_migration import find_migrated, job_state, migrate_config, submit
from test_replica_keeper_change import JOB, keeper_of

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster.create(tmp_path_factory.mktemp("reboot"), zones=1, per_zone=3, gpus=0,
                        zone_extra=migrate_config()) as c:
        yield c


def test_a_job_lost_in_a_quick_reboot_is_resumed_by_its_keeper(cluster: Cluster) -> None:
    c = cluster
    a = c.nodes[0]
    jid = submit(a, "--name", "one-ckpt", "--", str(VENV_BIN / "python"), "-c", JOB, gpus=0)
    key = f"n{a.node_id}-{jid}"
    x = wait_until(lambda: keeper_of(c.nodes[1:], key), 60, "the job's checkpoint to be prestaged to a keeper")

    subprocess.run(["ip", "link", "set", a.host_if, "down"], check=True)
    try:
        a.agent.kill9()
        remove_cgroup_tree(a.agent.cgroup_root)  # the job with it: a power cut
        time.sleep(6.0)
    finally:
        subprocess.run(["ip", "link", "set", a.host_if, "up"], check=True)
    a.agent.start(timeout=90)
    assert job_state(a, jid)["state"] == "lost"
    assert job_state(a, jid)["end_cause"] == "lost_with_cgroup"

    nd, resumed = wait_until(lambda: find_migrated(c, key), 60, "the keeper to resume the lost job", every=0.5)
    assert nd is x and nd is not a, (nd.node_id, x.node_id)
    assert resumed["state"] == "running", resumed
    assert resumed["spec"]["resume_from"].endswith("/ckpt-7"), resumed["spec"]
    events = x.json("events", "--kind", "migrate", "--limit", "500")
    said = [e for e in events if e.get("phase") == "stopped-there" and e.get("key") == key]
    assert len(said) == 1 and said[0]["src_state"] == "lost", said
    time.sleep(3.0)  # nothing else resumes it meanwhile: one copy
    copies = [(n.node_id, j["id"]) for n in c.nodes for j in n.json("jobs", "--active")
              if (j.get("origin") or {}).get("migrated_from") == key]
    assert copies == [(x.node_id, resumed["id"])], copies
    x.ctl("job", "stop", resumed["id"])
