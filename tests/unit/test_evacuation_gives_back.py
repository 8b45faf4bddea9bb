"""An owner's reclaim of a job adopted from a scheduler (:class:`laminar.migrate.evacuation.
Evacuation`, its ``_execute``) with a stand-in host and a stand-in scheduler component (the
test's; nothing runs): the job is in the reclaim's ``evacuating`` set while its scheduler
component checkpoints it and gives it back, as a moved job is (Airlock neither freezes it in its
checkpoint nor kills it, no archive or prestage of it begins: AirlockManager.moving), and out of
it once that is done; the reclaim's withdrawal reaches the give-back."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from laminar.migrate.evacuation import Evacuation


class StandInSchedulers:
    """Records, at each give-back, whether the job was being evacuated, then withdraws the
    reclaim (the test's window ends at once)."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.seen: list[tuple[str, bool, bool]] = []

    def handles(self, job: Any) -> bool:
        return True

    async def evacuate(self, job: Any, deadline_mono: float, cancel: asyncio.Event | None = None) -> dict[str, Any]:
        assert cancel is not None
        self.seen.append((job.id, job.id in self.host.evacuating, cancel.is_set()))
        cancel.set()
        return {"job": job.id, "outcome": "given-back"}


def test_a_job_given_back_to_its_scheduler_is_evacuating_meanwhile() -> None:
    async def go() -> tuple[StandInSchedulers, Any]:
        async def pass_keepers(deadline: float, cancel: asyncio.Event) -> None:
            return None

        host = SimpleNamespace(evacuating=set(), fence=SimpleNamespace(fenced_jobs=set()),
                               keepers=SimpleNamespace(pass_keepers=pass_keepers),
                               reclaim={"planned_mono": time.monotonic(), "deadline_mono": time.monotonic() + 30,
                                        "cancel": asyncio.Event()})
        sch = StandInSchedulers(host)
        host.agent = SimpleNamespace(schedulers=sch)
        job = SimpleNamespace(id="job-1", active=True)
        await asyncio.wait_for(Evacuation(host)._execute([job], {}), 10)  # type: ignore[arg-type]
        return sch, host

    sch, host = asyncio.run(go())
    assert sch.seen == [("job-1", True, False)]
    assert host.evacuating == set()
