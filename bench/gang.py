"""Gang benchmark: messages and CPU per placed multi-node job (a gang of k workers) from 100 to
100,000 nodes, beside a central gang scheduler that scans every node (issue 33).

Scale part (simulated transport, real code): the cluster is a FAKE (``laminar.zone.simnet``:
100,000 nodes cannot exist on this machine), but every gang placement runs the agent's own
``GangPlacer`` (``laminar.zone.gangplace``), ``Arbiter`` and the ``laminar.policy.gang`` /
``laminar.policy.placement`` policy, and every message is encoded, HMAC-signed, checked and
decoded by ``laminar.zone.wire``. Both schedulers see the same initial cluster (each GPU idle,
half or fully used at random; 8 GPUs, 64 CPUs, 512 GB per node; zones of 1,000 nodes) and the
same stream of gangs (per worker 1, 2 or 4 whole GPUs, 8 CPUs, 32 GB; ``k`` workers each, for
k = 2, 3, 4, 8). Gangs finish first-in first-out once a quarter of the node count runs workers
(a steady state), at the same load per node at every size (``LOAD`` workers placed per node per
second of fake time). The central baseline keeps every node's residual capacity and, per
gang, scans all of them for the ``k`` best fits (least GPU left over, one worker a node), with
the same ``fits`` and ``allocate_gpus`` functions. CPU is the process time of one gang's
placement, for the submitter and every probed node together, the median over the placed gangs
(``cpu_mean_us``: the mean, all placements' time over the placed gangs); zone summary refreshes,
which the agents spread in the background at a bounded rate, are excluded. The fake cluster's
own objects are frozen out of the garbage collector's reach (``gc.freeze``) while it places: no
agent holds an Arbiter per node, and a full collection through millions of them would be
charged to whichever placement triggered it.

What a gang's messages count: every datagram and TCP message the placement of a gang causes,
both directions, failed steps and retries included: the probes (``d * k`` a step), their
answers (offers and refusals, also those that come after the first ``k`` offers), the ``k``
commits and their acknowledgements, the releases of the unused offers (sent at once, one
datagram each, as are the releases after a failed commit), and the ``k`` TCP hand-overs and
their acknowledgements. TCP's own segments (handshake, acknowledgements) are not counted; zone
summaries are background traffic at a bounded rate per node; the members' own traffic after
they start (REPORT, ORDER) is not placement. "Per worker" divides a run's messages by the
workers of the gangs it placed (so a gang that queued out costs its placed peers). The
``sent`` figures count the submitter's messages alone (probes, commits, releases, hand-overs).

The bound ``msgs_bound_per_worker`` is ``laminar.policy.gang.messages_bound_per_worker(d)``:
one successful step costs each worker ``d`` probes, ``d`` answers, a commit and its ack, a
hand-over and its ack, and a release for each of its ``d - 1`` unused offers: ``3d + 3`` (9 for
the default ``d = 2``). The issue's goal of ``d + 2`` counts less than this benchmark does
(about the probes, the commit and the hand-over a worker's submitter sends, without answers,
acknowledgements or releases); ``sent_bound_per_worker`` (``2d + 1``) is the submitter's share.

Not built here yet (hooks for the lead): the netns part (``gang_netns_p99_ms``: 3-worker
placements on real agents in network namespaces, :func:`run_netns`) and the DDP part
(``ddp_overhead_pct``: a real 3-worker DDP job's step time under Laminar against ``torchrun``
by hand, :func:`run_ddp`).

    python bench/gang.py [--quick] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "agent"))

from laminar.policy import gang  # noqa: E402
from laminar.policy import placement as pl  # noqa: E402
from laminar.zone.gangplace import GangResult  # noqa: E402
from laminar.zone.simnet import SimNet  # noqa: E402

SIZES = (100, 1_000, 10_000, 100_000)
KS = (2, 3, 4, 8)
HEADLINE_K = 3  # the unsuffixed keys: a 3-worker gang, the netns and DDP case
ZONE_SIZE = 1_000
# Workers placed per node per second of fake time, the same at every size. Offers are released
# at once, so what lapses is only what a silent node held: the load matters less than in
# bench/placement.py, but it is kept the same for the comparison.
LOAD = 1.0
# Gangs finish first-in first-out once their workers hold one node in KEEP_DIV: the running
# gangs add the same small share of load at every size (a fixed number of gangs per size could
# not fill a 100,000-node cluster to a quarter, as bench/placement.py's n / 4 would ask, while
# it fills a 100-node one many times over: the small clusters would be measured busier). How
# busy the nodes are comes from the initial fill, the same draw at every size.
KEEP_DIV = 100
REFRESH_EVERY = 50  # zone summaries recomputed every this many gangs, at every size
GPU_CHOICES = (1.0, 2.0, 4.0)  # per worker: whole GPUs, as distributed training asks


def gang_demands(n: int, seed: int) -> list[pl.Demand]:
    rng = random.Random(seed)
    return [pl.Demand(gpus=rng.choice(GPU_CHOICES), cpus=8, memory_mb=32_000) for _ in range(n)]


def central_gang(nodes: list[pl.NodeCapacity], jobs: list[pl.Demand], k: int,
                 keep_running: int) -> tuple[list[float], int]:
    """The baseline: one scheduler that knows every node and scans all of them per gang for the
    ``k`` best fits (least GPU left over), one worker a node. Returns (CPU seconds of each gang
    placed, gangs placed)."""
    running: list[list[tuple[int, pl.Reservation]]] = []
    workers = 0
    cpu: list[float] = []
    placed = 0
    for d in jobs:
        c0 = time.process_time()
        cands = []
        for i, n in enumerate(nodes):
            if pl.fits(n, d) is None:
                cands.append((sum(n.gpu_free) - d.gpus, i))
        if len(cands) >= k:
            chosen = []
            for _, i in heapq.nsmallest(k, cands):
                n = nodes[i]
                res = pl.Reservation(0, d, pl.allocate_gpus(n.gpu_free, d.gpus) or (), float("inf"))
                nodes[i] = pl.residual(n, [res], 0.0)
                chosen.append((i, res))
            running.append(chosen)
            workers += k
            placed += 1
            cpu.append(time.process_time() - c0)
        while workers > keep_running:  # FIFO finish: give the capacity back
            for i, r in running.pop(0):
                cur = nodes[i]
                gpu = list(cur.gpu_free)
                for g, f in r.gpu_alloc:
                    gpu[g] = min(1.0, gpu[g] + f)
                nodes[i] = pl.NodeCapacity(cur.node, cur.zone, tuple(gpu), cur.cpus + r.demand.cpus,
                                           cur.memory_mb + r.demand.memory_mb, cur.gpu_model)
            workers -= k
    return cpu, placed


def run_gangs(net: SimNet, jobs: list[pl.Demand], k: int, keep_running: int,
              interval_s: float) -> tuple[list[GangResult], list[float], int, Counter[str]]:
    """Place ``jobs`` as gangs of ``k`` from node 1, one after another, ``interval_s`` of fake
    time apart; gangs finish FIFO once more than ``keep_running`` workers run, and every gang
    still running finishes at the end (the cluster is left as it was found). Returns the
    results, the CPU seconds each placement took (summary refreshes excluded), the messages
    sent while placing and their count by type."""
    placer = net.gang_placer()
    running: list[GangResult] = []
    results: list[GangResult] = []
    cpu: list[float] = []
    msgs = 0
    by_type: Counter[str] = Counter()

    async def go() -> None:
        nonlocal msgs
        workers = 0
        for i, d in enumerate(jobs):
            if i and i % REFRESH_EVERY == 0:
                net.refresh_summaries(only_changed=True)
            m0 = net.messages
            t0 = dict(net.by_type)
            c0 = time.process_time()
            r = await net.place_gang(d, k, placer=placer)
            cpu.append(time.process_time() - c0)
            msgs += net.messages - m0
            by_type.update({t: c - t0.get(t, 0) for t, c in net.by_type.items() if c != t0.get(t, 0)})
            results.append(r)
            net.clock_s += interval_s
            if r.outcome == "placed":
                running.append(r)
                workers += k
            while workers > keep_running or (i == len(jobs) - 1 and running):
                done = running.pop(0)
                for n in done.nodes:
                    net.finish(n, done.placement_id)
                workers -= k
        net.refresh_summaries(only_changed=True)

    asyncio.run(go())
    return results, cpu, msgs, by_type


def _laminar(n: int, gangs: int, repeats: int, seed: int) -> tuple[dict[int, dict[str, Any]], list[pl.NodeCapacity]]:
    """Per k: place ``gangs`` gangs ``repeats`` times on fresh ``n``-node clusters (one cluster
    a repeat, every k in turn on it: each run leaves it as it found it). Returns the figures
    per k and the first cluster's nodes (for the central baseline: the same cluster)."""
    acc: dict[int, dict[str, list[float]]] = {k: {"cpu": [], "cpu_mean": [], "msgs": [], "sent": [], "placed": [],
                                                  "refused": []} for k in KS}
    by_type: dict[int, Counter[str]] = {k: Counter() for k in KS}
    workers_placed = dict.fromkeys(KS, 0)
    refresh = []
    inventory: list[pl.NodeCapacity] = []
    for r in range(repeats):
        net = SimNet.build(n, min(n, ZONE_SIZE), gpus_per_node=8, rng=random.Random(seed + r), summaries=False)
        if not inventory:
            inventory = [a.inventory for a in net.arbiters.values()]  # capacity with nothing placed
        t0 = time.process_time()
        net.refresh_summaries()
        refresh.append(time.process_time() - t0)
        # The fake cluster's own objects (an Arbiter and its capacity per node: millions of
        # objects at 100,000 nodes, which no agent holds) are moved out of the collector's
        # reach, so that a full collection they would make slow is not charged to the
        # placements; what the placements allocate is collected as usual.
        gc.collect()
        gc.freeze()
        for k in KS:
            jobs = gang_demands(gangs, seed + 100 + r)
            gc.collect()  # each run starts from the same collector state, not the last one's garbage
            results, cpu, msgs, bt = run_gangs(net, jobs, k, keep_running=max(k, n // KEEP_DIV),
                                               interval_s=k / (LOAD * n))
            assert all(x.outcome in ("placed", "queued-out") for x in results), [x.as_dict() for x in results]
            assert not any(a.held or a.placed for a in net.arbiters.values())  # nothing left behind
            placed = sum(1 for x in results if x.outcome == "placed")
            a = acc[k]
            a["cpu"] += [c for c, x in zip(cpu, results, strict=True) if x.outcome == "placed"]
            a["cpu_mean"].append(sum(cpu) / max(1, placed))
            a["msgs"].append(msgs / max(1, placed * k))
            a["sent"].append(sum(x.sent for x in results) / max(1, placed * k))
            a["placed"].append(placed / len(results))
            a["refused"].append(sum(sum(x.refusals.values()) for x in results) / len(results))
            by_type[k].update(bt)
            workers_placed[k] += placed * k
        gc.unfreeze()
        del net
    return {k: {
        "msgs_per_worker": statistics.median(a["msgs"]), "sent_per_worker": statistics.median(a["sent"]),
        "cpu_us": statistics.median(a["cpu"] or [0.0]) * 1e6, "cpu_mean_us": statistics.median(a["cpu_mean"]) * 1e6,
        "placed_ratio": statistics.median(a["placed"]),
        "refusals_per_gang": statistics.median(a["refused"]), "summary_refresh_ms": statistics.median(refresh) * 1e3,
        "msgs_by_type": {t: v / max(1, workers_placed[k]) for t, v in sorted(by_type[k].items())},
    } for k, a in acc.items()}, inventory


def run_scale(quick: bool, seed: int = 11) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    gangs = 120 if quick else 1_000
    repeats = 1 if quick else 3
    warm = SimNet.build(100, 100, rng=random.Random(seed))  # warm the interpreter's caches
    for k in KS:
        run_gangs(warm, gang_demands(60, seed), k, keep_running=k, interval_s=0.03)
    for n in SIZES:
        lams, inventory = _laminar(n, gangs, repeats, seed)  # the baseline's cluster: the first repeat's
        for k in KS:
            lam = lams[k]
            cgangs = max(5, min(gangs, (20 if quick else 100) * 100_000 // (n * 10) + 5))
            ccpu, cplaced = central_gang(list(inventory), gang_demands(cgangs, seed + 100), k,
                                         keep_running=max(k, n // KEEP_DIV))
            row = {"nodes": n, "k": k, **lam, "central_cpu_us": statistics.median(ccpu or [0.0]) * 1e6,
                   "central_placed_ratio": cplaced / cgangs, "central_gangs": cgangs}
            rows.append(row)
            by = ", ".join(f"{t} {v:.2f}" for t, v in row["msgs_by_type"].items())
            print(f"  {n:>7} nodes k={k}: {row['msgs_per_worker']:.3f} msgs/worker ({by}), "
                  f"{row['sent_per_worker']:.3f} sent/worker, {row['cpu_us']:.0f} us CPU/gang, placed "
                  f"{row['placed_ratio']:.1%}, {row['refusals_per_gang']:.2f} refusals/gang | central "
                  f"{row['central_cpu_us']:.0f} us CPU/gang, placed {row['central_placed_ratio']:.1%} "
                  f"({cgangs} gangs)", flush=True)
            for key in ("msgs_per_worker", "sent_per_worker", "cpu_us", "cpu_mean_us", "placed_ratio", "refusals_per_gang",
                        "central_cpu_us", "central_placed_ratio"):
                out[f"gang_{key}_k{k}_{n}"] = round(row[key], 4)
        out[f"summary_refresh_ms_{n}"] = round(rows[-1]["summary_refresh_ms"], 1)
    by_k = {k: [r for r in rows if r["k"] == k] for k in KS}
    for k, rs in by_k.items():
        first, last = rs[0], rs[-1]
        out[f"gang_msgs_per_worker_k{k}_spread_pct"] = round(
            100 * (max(r["msgs_per_worker"] for r in rs) / min(r["msgs_per_worker"] for r in rs) - 1), 2)
        out[f"gang_cpu_ratio_k{k}_100000_vs_100"] = round(last["cpu_us"] / first["cpu_us"], 3)
        out[f"central_gang_cpu_ratio_k{k}_100000_vs_100"] = round(last["central_cpu_us"] / first["central_cpu_us"], 1)
    head = by_k[HEADLINE_K]
    out["gang_k"] = HEADLINE_K
    out["gang_msgs_per_worker_100"] = round(head[0]["msgs_per_worker"], 3)
    out["gang_msgs_per_worker_100000"] = round(head[-1]["msgs_per_worker"], 3)
    out["gang_msgs_per_worker_change_pct"] = round(
        100 * (head[-1]["msgs_per_worker"] / head[0]["msgs_per_worker"] - 1), 2)
    out["gang_sent_per_worker_100"] = round(head[0]["sent_per_worker"], 3)
    out["gang_sent_per_worker_100000"] = round(head[-1]["sent_per_worker"], 3)
    out["gang_cpu_ratio_100000_vs_100"] = out[f"gang_cpu_ratio_k{HEADLINE_K}_100000_vs_100"]
    out["central_gang_cpu_ratio_100000_vs_100"] = out[f"central_gang_cpu_ratio_k{HEADLINE_K}_100000_vs_100"]
    out["central_vs_laminar_cpu_100000"] = round(head[-1]["central_cpu_us"] / head[-1]["cpu_us"], 1)
    d = pl.RetryPolicy().d
    out["probe_d"] = d
    out["msgs_bound_per_worker"] = gang.messages_bound_per_worker(d)
    out["sent_bound_per_worker"] = gang.sent_bound_per_worker(d)
    out["issue_goal_d_plus_2"] = d + 2
    out["load_workers_per_node_per_s"] = LOAD
    out["_rows"] = rows
    return out


def run_contention(quick: bool, seed: int = 5) -> dict[str, Any]:
    """Gangs racing for one zone: 20 gangs of 4 whole-node workers at once on 40 idle nodes
    (room for 10), every message delivered on a later turn of the event loop so that the
    placements interleave message by message. Counts what must stay zero (nodes given to two
    gangs, members of gangs that did not place, reservations left after every placement ended)
    and how many gangs placed."""
    runs = 5 if quick else 30
    placed, overcommit, partial, left = [], 0, 0, 0
    for r in range(runs):
        net = SimNet.build(40, 40, rng=random.Random(seed + r), fill=0.0)
        net.async_delivery = True
        placer = net.gang_placer(max_rounds=2)
        whole = pl.Demand(gpus=8, cpus=4, memory_mb=8_000)

        async def go(net: SimNet = net, placer: Any = placer, whole: pl.Demand = whole) -> list[GangResult]:
            return await asyncio.wait_for(asyncio.gather(*(net.place_gang(whole, 4, placer=placer)
                                                           for _ in range(20))), 60)

        results = asyncio.run(go())
        ok = [x for x in results if x.outcome == "placed"]
        placed.append(len(ok))
        used = [n for x in ok for n in x.nodes]
        overcommit += len(used) - len(set(used)) + sum(1 for a in net.arbiters.values() if len(a.placed) > 1)
        partial += sum(len(a.placed) for a in net.arbiters.values()) - len(used)
        left += sum(len(a.held) for a in net.arbiters.values())
    return {"contention_runs": runs, "contention_gangs_placed_median": statistics.median(placed),
            "contention_gangs_room": 10, "contention_overcommitted_nodes": overcommit,
            "contention_partial_members": partial, "contention_reservations_left": left}


def run_netns(quick: bool) -> dict[str, Any]:
    """Hook, not built yet: 3-worker gang placements on real agents in network namespaces
    (``gang_netns_p99_ms``, the time to every member's hand-over acknowledged), to be filled
    in once the agent places gangs (the lead's part of issue 33)."""
    return {"gang_netns_status": "not built yet (hook: bench/gang.py run_netns)"}


def run_ddp(quick: bool) -> dict[str, Any]:
    """Hook, not built yet: a real 3-worker DDP job's step time under Laminar against the same
    ``torchrun`` by hand (``ddp_overhead_pct``)."""
    return {"ddp_status": "not built yet (hook: bench/gang.py run_ddp)"}


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["_rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k in KS:
        rs = [r for r in rows if r["k"] == k]
        xs = [r["nodes"] for r in rs]
        a.plot(xs, [r["msgs_per_worker"] for r in rs], "o-", label=f"Laminar k={k}")
        line = b.plot(xs, [r["cpu_us"] for r in rs], "o-", label=f"Laminar k={k}")
        b.plot(xs, [r["central_cpu_us"] for r in rs], "s--", c=line[0].get_color(), label=f"central k={k}")
    a.axhline(res["msgs_bound_per_worker"], ls=":", c="gray",
              label=f"3d+3 = {res['msgs_bound_per_worker']}: one step, all messages")
    a.axhline(res["issue_goal_d_plus_2"], ls="-.", c="tab:red", label="issue's goal d+2 (counts less)")
    a.set_xscale("log")
    a.set_ylim(0, res["msgs_bound_per_worker"] + 4)
    a.set_xlabel("nodes")
    a.set_ylabel("messages per placed worker")
    a.set_title("Messages per worker (both directions)")
    a.legend(fontsize=7)
    b.set_xscale("log")
    b.set_yscale("log")
    b.set_xlabel("nodes")
    b.set_ylabel("CPU µs per placed gang")
    b.set_title("CPU per gang: probes vs a central scan")
    b.legend(fontsize=6, ncol=2)
    fig.suptitle("Gang placement (simulated transport for scale, real policy and wire code)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer gangs per size (under 60 s)")
    ap.add_argument("--json", help="write the flat result object here")
    ap.add_argument("--plot", help="write a PNG here")
    args = ap.parse_args()
    t0 = time.time()
    print("scale (simulated transport, real policy and wire code):", flush=True)
    res = run_scale(args.quick)
    print("contention (20 gangs of 4 racing for 40 nodes):", flush=True)
    res.update(run_contention(args.quick))
    print(f"  placed {res['contention_gangs_placed_median']} of 20 (room for 10), over-committed nodes "
          f"{res['contention_overcommitted_nodes']}, partial members {res['contention_partial_members']}, "
          f"reservations left {res['contention_reservations_left']}", flush=True)
    res.update(run_netns(args.quick))
    res.update(run_ddp(args.quick))
    res["wall_s"] = round(time.time() - t0, 1)
    res["loadavg_1m_after"] = round(__import__("os").getloadavg()[0], 2)  # a shared machine: how busy it was
    if args.plot:
        plot(res, args.plot)
    flat = {k: v for k, v in res.items() if not k.startswith("_")}
    print(json.dumps(flat, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(flat, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
