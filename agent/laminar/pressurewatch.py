"""The pressure watch: kernel memory-pressure events from BPF tracepoints, as agent events.

``pressure.bpf.o`` hooks direct reclaim (begin/end), memcg reclaim (begin/end) and OOM victim
selection and writes ``struct lm_pressure_event`` records to the ``lm_events`` ring buffer.
This component polls the ring buffer from the event loop (its epoll fd is a loop reader, so
no thread and no polling interval) and emits each record as a ``pressure`` event, with the job
it belongs to when the cgroup is a job's.

Reclaim events come in bursts of thousands per second under a storm. Every one reaches the
subscribers (Airlock reacts to the first), but only OOM victims and the first reclaim event per
cgroup per second are written to the store, so a storm cannot turn into an fsync storm.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .bpf import abi
from .bpf.libbpf import BpfObject, RingBuffer, object_path

if TYPE_CHECKING:
    from .components import PressureAgent

log = logging.getLogger("laminar.pressure")

PERSIST_EVERY_S = 1.0


class PressureWatch:
    status_key = "pressurewatch"

    def __init__(self) -> None:
        self.obj: BpfObject | None = None
        self.links: list[Any] = []
        self.ring: RingBuffer | None = None
        self.agent: PressureAgent | None = None  # what the watch reads of it: laminar.components
        self.counts: dict[str, int] = {}
        self._last_persist: dict[tuple[str, int], float] = {}
        self.last_event_ts: float | None = None
        self.attached: list[str] = []

    async def start(self, agent: PressureAgent) -> None:
        self.agent = agent
        cfg = agent.config
        path = Path(cfg.bpf.object_dir, "pressure.bpf.o") if cfg.bpf.object_dir else object_path("pressure")
        self.obj = BpfObject.open(path, pin_root=cfg.bpf.pin_root)
        self.obj.load()
        for prog in self.obj.programs().values():
            self.links.append(prog.attach())
        self.attached = sorted(self.obj.programs())
        self.ring = RingBuffer(self.obj.map("lm_events"), self._on_record)
        assert agent.loop is not None  # the agent's loop runs before any component starts
        agent.loop.add_reader(self.ring.epoll_fd(), self._drain)

    def _drain(self) -> None:
        if self.ring is not None:
            self.ring.consume()

    def _on_record(self, data: bytes) -> None:
        fields = abi.decode_event(data)
        kind = str(fields["type"])
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.last_event_ts = time.time()
        cgroup_id = int(fields["cgroup_id"])
        agent = self.agent
        assert agent is not None  # records come from the ring start opened
        jobs = agent.jobs
        job = next((j for j in jobs.jobs.values() if j.cgroup_id == cgroup_id), None) if jobs is not None else None
        if job is not None:
            fields["job"] = job.id
        key = (kind, cgroup_id)
        now = time.monotonic()
        persist = kind == "oom_victim" or now - self._last_persist.get(key, -1e9) >= PERSIST_EVERY_S
        if persist:
            self._last_persist[key] = now
            if len(self._last_persist) > 4096:
                self._last_persist.clear()
        who = f"job {job.id}" if job is not None else f"cgroup {cgroup_id}"
        agent.events.emit("pressure", f"{kind} in {who} (pid {fields['pid']} {fields['comm']})", persist=persist, **fields)

    async def stop(self) -> None:
        if self.ring is not None:
            if self.agent and self.agent.loop:
                self.agent.loop.remove_reader(self.ring.epoll_fd())
            self.ring.close()
            self.ring = None
        for link in self.links:
            link.destroy()
        self.links.clear()
        if self.obj is not None:
            self.obj.close()
            self.obj = None

    def status(self) -> dict[str, Any]:
        return {"attached": self.attached, "events": dict(self.counts),
                "last_event_age_s": round(time.time() - self.last_event_ts, 1) if self.last_event_ts else None}
