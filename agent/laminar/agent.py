"""laminard: the Laminar node agent.

One process, one asyncio loop, components with ``start()``/``stop()``. On start it reads the
TOML config (no file: a one-node zone), opens the SQLite store, loads and pins the BPF objects,
attaches netguard to the uplink, starts the pressure watch and the other components, serves the
control API on a Unix socket and Prometheus metrics on localhost, and tells systemd it is ready.

SIGTERM stops it cleanly and leaves the pinned maps and the attached programs in place: jobs
keep running in their cgroups and the kill-switches keep enforcing. The next start reattaches
them. ``laminarctl bpf unload`` removes the data plane.

Usage::

    laminard [--config /etc/laminar/laminard.toml]
    laminard --check-config FILE      # validate and print the effective config, change nothing
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import json
import logging
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from . import __version__, limits
from .api import ApiError, ApiServer, Authorizer, RawJson, Request, Route, Stream, to_json
from .config import Config, ConfigError, defaults_toml, load
from .events import EventBus
from .metrics import CoreMetrics, MetricsServer, make_registry
from .store import Store

if TYPE_CHECKING:
    from .airlock.manager import Airlock
    from .components import (
        AirlockAgent,
        JobsAgent,
        MembersAgent,
        MigrateAgent,
        NetGuardAgent,
        NetGuardSwitch,
        PressureAgent,
        SchedAgent,
        TransfersAgent,
        ZoneAgent,
    )
    from .members.component import MembersComponent
    from .migrate.reclaim import ReclaimComponent
    from .net.netguard import NetGuard
    from .net.transfers import TransferRegistry
    from .pressurewatch import PressureWatch
    from .runtime.jobs import JobManager
    from .sched.component import SchedulerComponent
    from .zone.component import ZoneComponent

log = logging.getLogger("laminar.agent")

# Components beyond the core, started in this order (stopped in reverse). Each entry is
# "module:Class"; the class takes no arguments and has async start(agent)/stop().
COMPONENTS = [
    "laminar.runtime.jobs:JobManager",
    "laminar.airlock.manager:Airlock",
    "laminar.net.transfers:TransferRegistry",
    "laminar.zone.component:ZoneComponent",
    "laminar.members.component:MembersComponent",
    "laminar.sched.component:SchedulerComponent",
    "laminar.migrate.reclaim:ReclaimComponent",
]


def import_components() -> list[tuple[str, type]]:
    """Imports every component module (each registers its config section) and returns the classes.

    Runs before the config is read, so a file may hold every component's section. A component
    that cannot be imported is an installation error: raised, never skipped."""
    out = []
    for spec in COMPONENTS:
        module, _, cls = spec.partition(":")
        mod = importlib.import_module(module)
        if not hasattr(mod, cls):
            raise ImportError(f"component {spec}: module {module} has no {cls} (a broken installation?)")
        out.append((spec, getattr(mod, cls)))
    return out


class LogfmtFormatter(logging.Formatter):
    """One structured line per record: ``ts=… level=… logger=… msg="…" key=value``."""

    def format(self, record: logging.LogRecord) -> str:
        parts = [f"ts={time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(record.created))}.{int(record.msecs):03d}Z",
                 f"level={record.levelname.lower()}", f"logger={record.name}", f"msg={json.dumps(record.getMessage())}"]
        for k, v in (getattr(record, "fields", None) or {}).items():
            parts.append(f"{k}={json.dumps(v, default=str)}")
        if record.exc_info:
            parts.append(f"exc={json.dumps(self.formatException(record.exc_info))}")
        return " ".join(parts)


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def sd_notify(message: str) -> bool:
    """Sends a state line to systemd when NOTIFY_SOCKET is set; returns whether it was sent."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(addr)
        s.sendall(message.encode())
    return True


def _rss_kib() -> int:
    """This process's resident memory in KiB (/proc/self/statm), 0 where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except (OSError, ValueError, IndexError):
        return 0


def release_freed_memory() -> int | None:
    """Returns the memory the C allocator holds freed to the OS (glibc's ``malloc_trim(0)``) and
    answers how many KiB of resident memory that gave back (0 or more), or None where the C
    library has no ``malloc_trim`` (musl) and nothing was done.

    Why: glibc keeps freed memory of its main heap (and its thread arenas) for reuse and gives
    back only what lies above the highest allocation still in use. Where the agent's modules
    have no cached bytecode (PYTHONDONTWRITEBYTECODE, a checkout the unit cannot write, e.g.
    under /usr with ProtectSystem=full) every start compiles them, and the compiler's freed
    memory stayed behind the objects start-up keeps: an idle agent was several MB larger for its
    whole life, by an amount that depended on allocation order (57.6 MB where 52.1 MB had been
    measured at a commit whose live data was 0.9 MB smaller; 50.6 MB with this call)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    before = _rss_kib()
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return max(0, before - _rss_kib())


# Events one GET /v1/events answers (more: page with ?before=). Decoded and encoded in chunks of
# EVENTS_CHUNK with a loop round between them: 10,000 took the loop 0.16 s per request (and a
# user may have 32 requests in flight).
MAX_EVENTS = 1000
EVENTS_CHUNK = 50
# Events an ``events --follow`` stream holds for a client that reads slower than they come: past
# it the stream ends with a ``lagged`` line (the client resumes with --since), so a reader that
# stopped holds at most this much (the API drops one that takes no line within request_timeout_s).
FOLLOW_QUEUE = 256
# An unprivileged caller's GET /v1/status is answered from a copy at most this old: it reads the
# kernel (BPF maps, tc filters, PSI) and every component's state, and root's status must stay
# cheap while users ask in a loop.
STATUS_CACHE_S = 1.0
# The stop: a component whose turn comes after the shared deadline still gets this long (its
# state is saved in its stop); systemd is told the bound plus STOP_MARGIN_S (store, metrics).
STOP_GRACE_S = 0.5
STOP_MARGIN_S = 5.0


def use_pidfd_child_watcher(loop: asyncio.AbstractEventLoop) -> bool:
    """On Python 3.11, children of ``asyncio.create_subprocess_exec`` (a submission's path probe,
    a policy parse, a checkpoint check as its owner) are watched by a pidfd on the loop instead
    of the default ThreadedChildWatcher's thread per child: a probe stuck on its owner's hung
    mount held a thread for as long, one more per submission. 3.12 and later do this
    themselves. True when installed here."""
    if sys.version_info >= (3, 12) or not hasattr(asyncio, "PidfdChildWatcher"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (OSError, AttributeError):  # a kernel before 5.3: the threaded watcher stays
        return False
    watcher = asyncio.PidfdChildWatcher()
    watcher.attach_loop(loop)
    asyncio.set_child_watcher(watcher)
    return True


def stop_bound_s(shutdown_timeout_s: float, components: int) -> float:
    """The longest the agent's stop may take (`Agent.shutdown`): the shared deadline, plus the
    grace each component (and the API server) gets when its turn comes after it."""
    return shutdown_timeout_s + STOP_GRACE_S * (components + 1)


class Agent:
    """The node agent: owns the loop, the store, the event bus and the components.

    Each component sees it through the interface ``laminar.components`` declares for it (what
    that component may reach of the agent and of the others); the attributes below carry their
    concrete types, and mypy checks them against every interface (:func:`_agent_conforms`)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.node = config.agent.node
        self.started = time.time()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.store = Store(config.state_dir / "laminar.db")
        self.metrics = make_registry()
        self.core_metrics = CoreMetrics(self.metrics)
        self.events = EventBus(self.store, int(config.agent.user_events_burst), float(config.agent.user_events_per_s))
        self.events.subscribe(lambda e: self.core_metrics.events.labels(e["kind"]).inc())
        self.api = ApiServer(config.agent.socket, Authorizer(config.agent.control_group),
                             float(config.agent.request_timeout_s))
        self.components: list[Any] = []
        # the components, each set once its start returned (None before, or where not started)
        self.netguard: NetGuard | None = None
        self.pressure: PressureWatch | None = None
        self.jobs: JobManager | None = None
        self.airlock: Airlock | None = None
        self.transfers: TransferRegistry | None = None
        self.zone: ZoneComponent | None = None
        # the members of multi-node jobs hosted or originated here (issue 33; None: none)
        self.members: MembersComponent | None = None
        # the schedulers this node works beside (issue 34: Slurm, Kubernetes; None: not started)
        self.schedulers: SchedulerComponent | None = None
        self.migrate: ReclaimComponent | None = None
        # set once every component has started: one started early may wait for a later one
        self.components_started = asyncio.Event()
        self._stopping = asyncio.Event()
        self._metrics_server: Any = None
        self._status_cache: tuple[float, RawJson] | None = None  # (monotonic, encoded answer) for users

    def _on_hup(self) -> None:
        if self.zone is None or not self.zone.networked:
            log.info("SIGHUP: nothing to reload here (zone keys are re-read by a networked zone)")
            return
        self.zone.keyring.on_reload_signal()

    def component_names(self) -> list[str]:
        return [type(c).__name__ for c in self.components]

    async def _start_component(self, comp: Any, attr: str | None = None) -> None:
        await comp.start(self)
        self.components.append(comp)
        if attr:
            setattr(self, attr, comp)
        routes = getattr(comp, "routes", None)
        if routes:
            self.api.add(routes())

    async def run(self) -> int:
        from .api import socket_in_use

        if socket_in_use(self.config.agent.socket):
            # another agent serves this node: starting the components would re-attach its
            # filters, reattach its jobs and sweep its files under it
            log.error("another laminard answers on %s: not starting (stop it first, or give this one "
                      "another agent.socket and state_dir)", self.config.agent.socket)
            return 1
        self.loop = asyncio.get_running_loop()
        use_pidfd_child_watcher(self.loop)
        nofile = self._raise_nofile()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self._stopping.set)
        # `systemctl reload` (SIGHUP): a networked zone re-reads its keys; anywhere else it must
        # not kill the agent (SIGHUP's default action)
        self.loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        self.core_metrics.up.set(self.started)
        self.api.add(self.core_routes())
        try:
            from .net.netguard import NetGuard
            from .pressurewatch import PressureWatch

            await self._start_component(NetGuard(), "netguard")
            if self.config.bpf.pressure:
                await self._start_component(PressureWatch(), "pressure")
            for _spec, cls in import_components():
                comp = cls()
                await self._start_component(comp, getattr(comp, "agent_attr", None))
            self.components_started.set()
            if self.jobs is not None and self.airlock is None:
                # an agent built without Airlock has no class caps: the queue held for Airlock's
                # word (runtime.jobs.limits) would otherwise never start a job
                from .policy.admission import NO_LIMITS

                self.jobs.set_admission(lambda: NO_LIMITS)
            note = limits.nofile_note(nofile, int(getattr(self.jobs, "max_per_user", 0) or 0)) if nofile else None
            if note:
                log.warning("%s", note)
                self.events.emit("agent", note, nofile_soft=nofile.soft if nofile else None)
            await self.api.start()
            if self.config.metrics.listen:
                self._metrics_server = MetricsServer(self.config.metrics.listen, self.metrics, self.api.refusals,
                                                     float(self.config.agent.request_timeout_s))
                await self._metrics_server.start()
        except Exception as e:
            log.error("start-up failed: %s", e, exc_info=log.isEnabledFor(logging.DEBUG))
            self.events.emit("agent", f"start-up failed: {e}")
            await self.shutdown()
            return 1
        self.events.emit("agent", f"laminard {__version__} ready on node {self.node}", pid=os.getpid(),
                         components=self.component_names())
        sd_notify(f"READY=1\nSTATUS=ready; components: {', '.join(self.component_names())}\nMAINPID={os.getpid()}")
        # start-up objects (modules, config, components) live as long as the agent: freezing them
        # keeps every later full collection from scanning them (one took about 12 ms on a 2-core
        # VM, a stall of the loop and of the zone's probe answers)
        gc.freeze()
        # what start-up freed (compiling modules without cached bytecode) goes back to the OS
        released = release_freed_memory()
        if released is None:
            log.info("start-up: the C library has no malloc_trim; freed memory stays with the allocator")
        else:
            log.info("start-up: %d KiB of freed memory returned to the OS", released)
        await self._stopping.wait()
        # the stop's bound goes with STOPPING=1: the event written next could wait on a busy store
        sd_notify(f"STOPPING=1\n{self._stop_extension()}")
        self.events.emit("agent", "stopping; jobs stay in their cgroups"
                         + ("; pins and programs stay in place" if self.netguard and self.netguard.maps else ""))
        await self.shutdown()
        return 0

    def _raise_nofile(self) -> limits.NofileLimits | None:
        """The agent's soft open-files limit raised to its hard limit (`laminar.limits`); jobs
        get their owner's (`laminar.runtime.joblimits`). None (and a warning) if the kernel refused."""
        try:
            lim = limits.raise_nofile()
        except OSError as e:
            log.warning("open-files limit: cannot raise the soft limit to the hard one: %s", e)
            return None
        if lim.soft != lim.inherited_soft:
            log.info("open-files limit: soft %d raised to %d (the hard limit); jobs get their owner's limits "
                     "([job_limits])", lim.inherited_soft, lim.soft)
        return lim

    def _stop_extension(self) -> str:
        """The sd_notify line that gives the stop its bound (shutdown's docstring)."""
        bound = stop_bound_s(float(self.config.agent.shutdown_timeout_s), len(self.components))
        return f"EXTEND_TIMEOUT_USEC={int((bound + STOP_MARGIN_S) * 1e6)}"

    async def shutdown(self) -> None:
        """Stops the components, last started first, within one deadline: ``shutdown_timeout_s``
        for all of them together. A component still stopping at the deadline is cancelled; one
        whose turn comes after it still gets `STOP_GRACE_S` (its state is saved in its stop).
        So the whole stop takes at most shutdown_timeout_s + STOP_GRACE_S per component, and
        systemd is told so (EXTEND_TIMEOUT_USEC): a longer shutdown_timeout_s than the unit's
        TimeoutStopSec no longer gets the agent SIGKILLed mid-stop. (Each component had its own
        shutdown_timeout_s before: a hung one or two took the agent past TimeoutStopSec=20s.)"""
        budget = float(self.config.agent.shutdown_timeout_s)
        sd_notify(self._stop_extension())
        deadline = time.monotonic() + budget
        try:
            await asyncio.wait_for(self.api.stop(), max(deadline - time.monotonic(), STOP_GRACE_S))
        except Exception:
            log.exception("stopping the API server failed")
        for comp in reversed(self.components):
            left = deadline - time.monotonic()
            try:
                await asyncio.wait_for(comp.stop(), max(left, STOP_GRACE_S))
            except TimeoutError:
                log.error("stopping %s: still not stopped after %.1f s (agent.shutdown_timeout_s %.1f s for the "
                          "whole stop); cancelled", type(comp).__name__, max(left, STOP_GRACE_S), budget)
            except Exception:
                log.exception("stopping %s failed", type(comp).__name__)
        self.components.clear()
        if self._metrics_server is not None:
            try:
                await asyncio.wait_for(self._metrics_server.stop(), STOP_GRACE_S * 4)
            except Exception:
                log.exception("stopping the metrics endpoint failed")
        self.store.close()

    def request_stop(self) -> None:
        self._stopping.set()

    # --- core API -------------------------------------------------------------------------

    def core_routes(self) -> list[Route]:
        return [
            Route("GET", "/v1/status", self._status),
            Route("GET", "/v1/config", self._config),
            Route("GET", "/v1/events", self._events),
        ]

    async def _status(self, req: Request) -> dict[str, Any] | RawJson:
        """The agent's state. Root and the control group get it fresh; others a copy at most
        STATUS_CACHE_S old, encoded once (see there)."""
        if not self.api.exempt(req.peer):
            now = time.monotonic()
            if self._status_cache is None or now - self._status_cache[0] >= STATUS_CACHE_S:
                self._status_cache = (now, RawJson(to_json(self._status_now()).encode()))
            return self._status_cache[1]
        return self._status_now()

    def _status_now(self) -> dict[str, Any]:
        from . import features

        out: dict[str, Any] = {
            "agent": {"node": self.node, "version": __version__, "pid": os.getpid(),
                      "uptime_s": round(time.time() - self.started, 1), "config": self.config.source,
                      "state_dir": str(self.config.state_dir), "socket": str(self.api.path),
                      "admin_socket": str(self.api.admin_path),
                      "components": self.component_names(),
                      "api_requests": self.api.requests, "api_refused": self.api.refused},
            "api": {**self.api.stats(), "events_not_stored": self.events.budget.suppressed_total
                    if self.events.budget is not None else 0},
            "kernel": features.detect().as_dict(),
            "pressure": features.pressure_now(),
        }
        for comp in self.components:
            status = getattr(comp, "status", None)
            if status:
                out[getattr(comp, "status_key", type(comp).__name__.lower())] = status()
        self.core_metrics.api_requests.set(self.api.requests)
        self.core_metrics.api_refused.set(self.api.refused)
        return out

    async def _config(self, req: Request) -> dict[str, Any]:
        return {"source": self.config.source, "config": self.config.as_dict()}

    async def _events(self, req: Request) -> Any:
        since_text, limit_text = req.query.get("since", "0"), req.query.get("limit", "100")
        if not (since_text.isascii() and since_text.isdigit() and len(since_text) <= 19):
            raise ApiError(400, f"since {since_text[:40]!r}: expected an event id, 0 to {(1 << 63) - 1}")
        if not (limit_text.isascii() and limit_text.isdigit() and len(limit_text) <= 7):
            raise ApiError(400, f"limit {limit_text[:40]!r}: expected 1..{MAX_EVENTS} events (page with since)")
        since, limit = int(since_text), int(limit_text)
        if not 0 <= since < 1 << 63:
            raise ApiError(400, f"since {since}: expected an event id, 0 to {(1 << 63) - 1}")
        if not 1 <= limit <= MAX_EVENTS:
            raise ApiError(400, f"limit {limit}: expected 1..{MAX_EVENTS} events (page with since: the next "
                                "page starts after the last id of this one)", "page_too_large")
        kind = req.query.get("kind") or None
        if kind is not None and len(kind) > 64:
            raise ApiError(400, f"kind {kind[:40]!r}...: an event kind is a short word (agent, job, airlock, ...)")
        before_text = req.query.get("before")
        if before_text is not None and not (before_text.isascii() and before_text.isdigit() and len(before_text) <= 18):
            raise ApiError(400, f"before {before_text[:40]!r}: expected an event id (the oldest of the last page)")
        before = None if before_text is None else int(before_text)
        if req.query.get("follow") not in ("1", "true", "yes"):
            return await self._past_events_json(since, kind, limit, before)
        return Stream(self._follow(kind, since, limit))

    async def _past_events_json(self, since: int, kind: str | None, limit: int, before: int | None) -> RawJson:
        """`_past_events` as the answer's JSON, each chunk read, decoded and encoded in its own
        loop round (newest first, each before the last): 32 pages of 1000 read and encoded in
        one round held root's status 0.19 s."""
        from .store import decode_event

        chunks: list[str] = []  # newest chunk first
        left, cursor = limit, before
        while left > 0:
            if chunks:
                await asyncio.sleep(0)
            rows = self.store.event_rows(since, kind, min(EVENTS_CHUNK, left), cursor)
            if not rows:
                break
            chunks.append(",".join(to_json(decode_event(r)) for r in rows))
            left -= len(rows)
            cursor = rows[0]["id"]
            if len(rows) < EVENTS_CHUNK:
                break
        return RawJson(("[" + ",".join(reversed(chunks)) + "]").encode())

    async def _past_events(self, since: int, kind: str | None, limit: int,
                           before: int | None = None) -> list[dict[str, Any]]:
        """The newest `limit` events after `since` (and before `before`: the page before one),
        oldest first: read in one query, decoded in chunks of EVENTS_CHUNK with a loop round
        between them."""
        from .store import decode_event

        rows = self.store.event_rows(since, kind, limit, before)
        out: list[dict[str, Any]] = []
        for i in range(0, len(rows), EVENTS_CHUNK):
            if i:
                await asyncio.sleep(0)
            out.extend(decode_event(r) for r in rows[i:i + EVENTS_CHUNK])
        return out

    async def _follow(self, kind: str | None, since: int, limit: int) -> Any:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=FOLLOW_QUEUE)
        lagged: list[int] = []  # the id of the first event that did not fit the queue

        def push(event: dict[str, Any]) -> None:
            if lagged or not (kind is None or event["kind"] == kind):
                return
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:  # a reader slower than the events: its stream ends (below)
                lagged.append(int(event.get("id") or 0))

        unsubscribe = self.events.subscribe(push)
        try:
            if since:
                for past in await self._past_events(since, kind, limit):
                    yield past
            while True:
                if lagged and queue.empty():
                    yield {"kind": "lagged", "ts": time.time(),
                           "message": f"stream closed: the client read slower than the agent's events came "
                                      f"({FOLLOW_QUEUE} waiting); go on with --since {max(lagged[0] - 1, 0)}"}
                    return
                # Not wait_for: on 3.11 it returns an item that arrives in the loop step its
                # caller is cancelled in and swallows the cancellation (CPython gh-86296); the
                # agent's stop cancels this stream as the "stopping" event comes in, so the
                # stream ran on and the agent never exited on SIGTERM. asyncio.wait lets a cancel
                # through.
                getter = asyncio.ensure_future(queue.get())
                try:
                    await asyncio.wait({getter}, timeout=15.0)
                except BaseException:
                    getter.cancel()
                    raise
                if getter.done():
                    yield getter.result()
                else:  # a pending get leaves the queue as it was when cancelled
                    getter.cancel()
                    yield {"kind": "keepalive", "ts": time.time()}
        finally:
            unsubscribe()


def _agent_conforms(agent: Agent) -> tuple[JobsAgent, AirlockAgent, NetGuardAgent, TransfersAgent, PressureAgent,
                                             ZoneAgent, MigrateAgent, MembersAgent, SchedAgent]:
    """Never called: mypy checks here that the agent offers every component what its interface
    in ``laminar.components`` names (and so that each component offers the others what theirs
    name: the migration layer what the zone calls on it, Airlock what netguard does, ...)."""
    return agent, agent, agent, agent, agent, agent, agent, agent, agent


def _netguard_switches(netguard: NetGuard) -> NetGuardSwitch:
    """Never called: mypy checks here that netguard offers the members component its per-job
    switch (an origin's ORDER killswitch_on/off)."""
    return netguard


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="laminard", description="Laminar node agent")
    parser.add_argument("--config", help="TOML config file (default: embedded defaults, a one-node zone)")
    parser.add_argument("--check-config", metavar="FILE", help="validate FILE, print the effective config, exit")
    parser.add_argument("--version", action="version", version=f"laminard {__version__}")
    parser.add_argument("--print-defaults", action="store_true", help="print every key with its default as TOML, exit")
    args = parser.parse_args(argv)
    import_components()
    if args.print_defaults:
        sys.stdout.write(defaults_toml())
        return 0
    try:
        config = load(args.check_config or args.config)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    if args.check_config:
        print(json.dumps(config.as_dict(), indent=2))
        return 0
    setup_logging(config.agent.log_level)
    if os.geteuid() != 0:
        print("laminard: must run as root (it loads BPF programs, attaches tc filters and creates cgroups)",
              file=sys.stderr)
        return 1
    agent = Agent(config)
    return asyncio.run(agent.run())


if __name__ == "__main__":
    sys.exit(main())
