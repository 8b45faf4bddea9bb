"""Cuts of jobs being stopped cannot hold the ladder off for good: pure decisions.

A cut (a job in its stop's grace, killed under pressure) holds the ladder off for
``KILL_SETTLE_S`` so that the cut job's memory comes back before a running job is suspended.
Any local user can stop their own jobs, so a user stopping one job that ignores SIGTERM every
200 ms had every decision end at the cut, and each new cut restarted the wait: under CRITICAL
no running job was ever suspended or killed, nor a spent budget escalated, however fast the
memory went (the kernel's OOM killer was left to act). Now the hold comes at most once per
``CUT_HOLD_S``; a cut within it is taken beside what the ladder decides.
"""

from __future__ import annotations

from laminar.airlock.policy import validate
from laminar.policy import ladder


def view(jid: str, mem_mib: int = 100, stopping: bool = False, rung: str | None = None,
         since: float | None = None) -> ladder.JobView:
    return ladder.JobView(jid, "transient", 50, 10.0, mem_mib << 20, rung=rung, rung_since=since, stopping=stopping)


def test_a_stream_of_stopping_jobs_does_not_keep_the_ladder_from_suspending_and_reclaiming() -> None:
    policy = validate({})
    memo = ladder.Memo()
    seen: list[tuple[float, str, str]] = []
    t = 100.0
    # two running jobs at CRITICAL; a new job of the user's enters its stop every 0.2 s and ends
    # 0.2 s later (the ladder is asked every 50 ms, as Airlock's tick does); the rungs the
    # ladder gives are kept as the manager keeps them
    rungs: dict[str, tuple[str, float]] = {}
    gone: set[str] = set()
    for i in range(80):
        now = t + i * 0.05
        jobs = [view(j, mem_mib=m, rung=rungs.get(j, (None, None))[0], since=rungs.get(j, (None, None))[1])
                for j, m in (("hog", 2000), ("other", 500)) if j not in gone]
        jobs.append(view(f"stop{i // 4}", mem_mib=1, stopping=True))
        for a in ladder.decide(now, ladder.CRITICAL, jobs, policy, memo, 0.99):
            seen.append((now, a.kind, a.job_id))
            if a.kind in (ladder.SUSPEND, ladder.READDRESS):
                rungs[a.job_id] = (a.kind, now)
            elif a.kind == ladder.KILL:
                gone.add(a.job_id)
    kinds = {k for _, k, _ in seen}
    assert ladder.CUT in kinds, seen
    assert ladder.SUSPEND in kinds and ladder.KILL in kinds, seen
    # the hold still comes first: nothing but cuts in the first settle time
    assert all(k == ladder.CUT for n, k, _ in seen if n < t + ladder.KILL_SETTLE_S), seen


def test_a_single_cut_still_holds_the_ladder_off_while_its_memory_comes_back() -> None:
    policy = validate({})
    memo = ladder.Memo()
    jobs = [view("run"), view("big", mem_mib=300, stopping=True)]
    assert [a.kind for a in ladder.decide(100.0, ladder.CRITICAL, jobs, policy, memo, 0.99)] == [ladder.CUT]
    assert ladder.decide(100.1, ladder.CRITICAL, jobs, policy, memo, 0.99) == []
    acts = ladder.decide(100.0 + ladder.KILL_SETTLE_S, ladder.CRITICAL, jobs, policy, memo, 0.99)
    assert [(a.kind, a.job_id) for a in acts] == [(ladder.SUSPEND, "run")], acts
