"""NetGuard: the agent's side of the ``netguard`` tc program on the uplink.

It loads ``netguard.bpf.o`` with its maps pinned by name under ``bpf.pin_root``
(default ``/sys/fs/bpf/laminar``), attaches ``lm_egress``/``lm_ingress`` to the uplink's
clsact hook and owns every write to the kill-switch maps. Because the maps are pinned and the
tc filters hold the programs, the data plane keeps enforcing while the agent is stopped,
restarted or dead: a restart re-opens the same pins (libbpf reuses a pin whose definition
matches) and atomically replaces the filters with the new programs, so nothing is duplicated
and no switch is ever open in between.

Kill-switch semantics (see docs/bpf-maps.md for the bits):

- ``job`` on/off: the job's ``LM_JOB_KILL`` flag; ``arm``: ``LM_JOB_ARMED`` with a
  CLOCK_MONOTONIC deadline the program compares with ``bpf_ktime_get_ns()``;
- ``all`` on/off: ``LM_GLOBAL_KILL_JOBS``; ``arm --all`` arms every current job;
- ``lent`` on/off: ``LM_GLOBAL_KILL_LENT``; ``arm --lent`` sets ``LM_GLOBAL_ARMED``.

``unload()`` (``laminarctl bpf unload``) detaches the programs, deletes the clsact qdisc if
the agent created it, deletes the shaping tree (the HTB root ``4c4d:`` of ``laminar.net.htb``)
with the stored transfers, and removes the pins: the interface is as it was before.

Tunnels (``net.tunnels``, on by default with ``net.ingress``): traffic a job receives over a tunnel
whose underlay is the uplink (VXLAN, GENEVE, GRE, IPIP, ...) reaches the uplink encapsulated, for
the tunnel's kernel socket or no socket at all, so ``lm_ingress`` there cannot name the job; the
inner packet surfaces on the tunnel device after decapsulation. ``lm_ingress`` is therefore also
attached to every tunnel device of the uplink's namespace bound to the uplink or to no interface
(``tunnels_over``), at the start, on every interface change (a netlink link event) and every
``net.tunnel_scan_s`` in any case, and taken off again by
``bpf unload`` (the record's ``tunnels``). Egress needs nothing more: an encapsulated packet keeps
the job's socket (``skb->sk``), so ``lm_egress`` on the uplink still names the job.

An agent started on another uplink than its last run (``net.uplink`` changed) attaches to the new
one, then restores the old one the same way (filters, the clsact it made, the shaping tree); an
old uplink it could not restore stays in its record (``previous``) for the next start and for
``bpf unload``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..api import ApiError, Request, Route, require
from ..bpf import abi
from ..bpf.libbpf import BpfMap, BpfObject, object_path
from ..features import ensure_bpffs
from . import htb, rtnl, tc
from .killswitch import cut_by_deadline

if TYPE_CHECKING:
    from ..components import NetGuardAgent

log = logging.getLogger("laminar.netguard")

PROGRAMS = {"egress": "lm_egress", "ingress": "lm_ingress"}
# Link kinds whose decapsulated traffic arrives on the device itself (rtnl.link_kind).
TUNNEL_KINDS = frozenset({"vxlan", "geneve", "gre", "gretap", "erspan", "ip6gre", "ip6gretap", "ip6erspan",
                          "ipip", "sit", "ip6tnl"})
META_KEY = "netguard.attachment"
# Link events coalesce: after a look for tunnels, the next waits at least this long (a host
# making hundreds of container veths raises as many events; one look covers them all).
TUNNEL_EVENT_GAP_S = 0.2
MAP_COUNTS_S = 1.0  # map_rows counts the hash maps' entries at most this often


def _u64(v: int) -> bytes:
    return int(v).to_bytes(8, "little")


def resolve_uplink(configured: str) -> tuple[str, int]:
    """The uplink's name and index; raises RuntimeError saying what to set when there is none."""
    try:
        ifname = configured or tc.default_route_ifname()
    except tc.AmbiguousUplink as e:
        raise RuntimeError(f"netguard: {e}; netguard's programs sit on one interface and would see only the "
                           "flows the kernel hashes to it, so a cut or shaped job's traffic would leave by the "
                           f"other{'s' if len(e.ifnames) > 2 else ''} unchecked. Set net.uplink in the config to "
                           "the interface jobs' traffic leaves by (route it by that one), or bond the interfaces "
                           "and set net.uplink to the bond (docs/operations.md, 'ECMP uplinks')") from None
    if not ifname:
        raise RuntimeError("netguard: this node has no default route, so there is no uplink to attach to; "
                           "set net.uplink in the config to the interface jobs' traffic leaves by")
    try:
        return ifname, tc.ifindex_of(ifname)
    except (LookupError, OSError) as e:
        raise RuntimeError(f"netguard: uplink {ifname!r} not found ({e}); set net.uplink to an existing "
                           "interface (see `ip link`)") from None


def tunnels_over(uplink_ifindex: int) -> dict[int, str]:
    """The tunnel devices (TUNNEL_KINDS) of the current network namespace whose underlay may be
    the uplink: bound to it (``dev``), or to no interface (routed by the table, so by the uplink
    for anything the default route carries), by ifindex. A tunnel bound to another interface, or
    to one in another namespace, is left alone."""
    with rtnl.Rtnl() as nl:
        links = nl.links()
    out: dict[int, str] = {}
    for m in links:
        if rtnl.link_kind(m) in TUNNEL_KINDS and rtnl.link_underlay(m) in (0, uplink_ifindex):
            out[m.ifindex] = rtnl.string(m.attrs.get(rtnl.IFLA_IFNAME)) or f"ifindex {m.ifindex}"
    return out


def attach_tunnel(ifindex: int, prog_fd: int) -> bool:
    """Attaches ``lm_ingress`` on a tunnel device's ingress; returns whether its clsact was made here."""
    created = tc.ensure_clsact(ifindex)
    tc.attach_bpf(ifindex, "ingress", prog_fd, PROGRAMS["ingress"])
    return created


class NetGuard:
    status_key = "netguard"

    def __init__(self) -> None:
        self.obj: BpfObject | None = None
        self.maps: dict[str, BpfMap] = {}
        self._map_counts: tuple[float, dict[str, int]] | None = None  # (monotonic, entries by map name)
        self.ifname = ""
        self.ifindex = 0
        self.pin_root = Path("/sys/fs/bpf/laminar")
        self.reattached = False
        self.agent: NetGuardAgent | None = None  # what netguard reads of it: laminar.components
        self.tunnels: dict[int, str] = {}  # tunnel devices lm_ingress is attached to, by ifindex
        self._tunnel_task: asyncio.Task[None] | None = None
        # Every read-modify-write of an lm_jobs or lm_global entry (and every delete of one) holds
        # this lock from the lookup to the update, whatever thread it runs on: two writers each
        # putting back the value they read would clear a kill bit the other set in between.
        # Reentrant: the API's 'all' actions call the per-job writers in a loop.
        self.lock = threading.RLock()
        # job number -> every cgroup id registered for it: an adopted pod's cgroup and its
        # containers' (laminar.runtime.adopt); a job's switch and deadline are set on all of them
        self._cgroups_of: dict[int, set[int]] = {}

    @property
    def _agent(self) -> NetGuardAgent:
        """The agent netguard was started with (every caller runs after ``start``)."""
        if self.agent is None:
            raise RuntimeError("netguard: not started")
        return self.agent

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self, agent: NetGuardAgent) -> None:
        self.agent = agent
        cfg = agent.config
        self.pin_root = Path(cfg.bpf.pin_root)
        ensure_bpffs(str(self.pin_root.parent) if self.pin_root.parent != Path("/") else "/sys/fs/bpf")
        self.ifname, self.ifindex = resolve_uplink(cfg.net.uplink)
        self.pin_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        recorded_root = (agent.store.get_meta(META_KEY) or {}).get("pin_root")
        if recorded_root and Path(recorded_root) != self.pin_root:
            self._move_pins(Path(recorded_root))
        self.reattached = (self.pin_root / "lm_jobs").exists()
        path = Path(cfg.bpf.object_dir, "netguard.bpf.o") if cfg.bpf.object_dir else object_path("netguard")
        self.obj = BpfObject.open(path, pin_root=str(self.pin_root))
        aside = self._set_aside_mismatched_pins(self.obj)
        try:
            self.obj.load()
        except BaseException:
            self._put_back(aside)
            raise
        self.maps = {name: self.obj.map(name) for name in abi.NETGUARD_MAPS}
        if aside:
            self._carry_over(aside)
        self._init_global()
        if self.reattached:
            stale = self.prune_jobs(cfg.cgroups.root)
            if stale:
                agent.events.emit("agent", f"netguard: dropped {len(stale)} lm_jobs entries of jobs that ended while "
                                           "no agent ran", cgroup_ids=stale)
        created = tc.ensure_clsact(self.ifindex)
        record = agent.store.get_meta(META_KEY) or {}
        # Uplinks of earlier runs not restored yet (net.uplink changed): kept in the record until
        # they are, so neither a failure here nor a crash before the end forgets them.
        previous = [p for p in record.get("previous") or [] if p.get("ifname") != self.ifname]
        made_here = created or any(p.get("clsact_created") for p in record.get("previous") or []
                                   if p.get("ifname") == self.ifname)
        if record.get("ifname") and record["ifname"] != self.ifname:
            previous.append({"ifname": record["ifname"], "clsact_created": bool(record.get("clsact_created"))})
        if record.get("ifname") != self.ifname:
            record = {"ifname": self.ifname, "clsact_created": made_here, "pin_root": str(self.pin_root),
                      "tunnels": record.get("tunnels") or []}  # restored below unless over the new uplink
        elif made_here:
            record["clsact_created"] = True
        record["pin_root"] = str(self.pin_root)  # bpf unload --force removes the pins here
        record["ingress"] = bool(cfg.net.ingress)
        record["previous"] = previous
        agent.store.set_meta(META_KEY, record)
        directions = ["egress", "ingress"] if cfg.net.ingress else ["egress"]
        for direction in directions:
            prog = self.obj.program(PROGRAMS[direction])
            tc.attach_bpf(self.ifindex, direction, prog.fd, PROGRAMS[direction])
        if not cfg.net.ingress:
            tc.detach_bpf(self.ifindex, "ingress")
        if previous:  # after the new uplink enforces
            record["previous"] = [p for p in previous if not self._leave_old_uplink(p)]
            agent.store.set_meta(META_KEY, record)
        if cfg.net.ingress and cfg.net.tunnels:
            self.sync_tunnels()
            self._tunnel_task = asyncio.get_running_loop().create_task(self._scan_tunnels(cfg.net.tunnel_scan_s))
        else:
            self.sync_tunnels(wanted={})  # switched off since the last run: take them off
        agent.events.emit("agent", f"netguard {'reattached pins and ' if self.reattached else ''}attached to "
                                   f"{self.ifname} ({'/'.join(directions)})",
                          ifname=self.ifname, pin_root=str(self.pin_root), reattached=self.reattached)

    def _move_pins(self, old_root: Path) -> None:
        """``bpf.pin_root`` changed since the last run: the maps pinned under the old root (every
        switch, deadline and counter) are pinned under the new one, where the load reattaches them,
        and the old pins and directory go. A name already pinned under the new root stays (the
        old pin is removed all the same: nothing else would ever remove it)."""
        if not old_root.is_dir():
            return
        moved: list[str] = []
        for pin in sorted(old_root.iterdir()):
            if not pin.name.startswith("lm_"):
                continue
            target = self.pin_root / pin.name
            if not target.exists():
                try:
                    m = BpfMap.from_pin(pin)
                except OSError as e:
                    log.warning("netguard: cannot open %s to move it to %s: %s", pin, target, e)
                    continue
                try:
                    m.pin(target)
                    moved.append(pin.name)
                finally:
                    m.close()
            BpfMap.unpin(pin)
        try:
            old_root.rmdir()
        except OSError:
            pass  # not empty: something not ours is pinned there
        self._agent.events.emit("agent", f"netguard: bpf.pin_root changed from {old_root} to {self.pin_root}: "
                                        f"{len(moved)} pinned maps moved ({', '.join(moved) or 'none'})",
                               old_pin_root=str(old_root), pin_root=str(self.pin_root), moved=moved)

    def _set_aside_mismatched_pins(self, obj: BpfObject) -> dict[str, BpfMap]:
        """Pins under pin_root whose definition (type, key and value size, max_entries) is not the
        one this agent's object declares, left by an agent of another build (an upgrade that resized
        a map): libbpf refuses to reuse them and the load, so every start failed. Each is unpinned
        and returned open, to be carried over into the new map after the load (``_carry_over``) or
        pinned back if the load fails (``_put_back``). Pins left by an agent of another map ABI
        (the pinned ``lm_global.abi_version`` is neither 0 nor this agent's ``LM_ABI_VERSION``) are
        all set aside, whatever their sizes: libbpf would reattach a map of the same size and this
        agent would read its entries under another layout; ``_carry_over`` copies none of them. Pins of
        an older ABI this agent knows how to convert (``abi.UPGRADES``: 1, whose lm_flows keys were
        IPv4 only) are treated as another build's: the maps whose size changed are set aside and
        their entries converted, so a flow or job cut before the upgrade stays cut."""
        aside: dict[str, BpfMap] = {}
        other_abi = self._pinned_abi_version()
        if other_abi in abi.UPGRADES:
            # An older ABI this agent converts: the maps whose layout changed have another size and
            # are set aside below like a resized map; _carry_over converts their entries. The
            # maps of the same size kept their layout and are reattached as they are.
            log.warning("netguard: the maps pinned under %s are of map ABI version %d, this agent's is %d: "
                        "their entries are converted", self.pin_root, other_abi, abi.LM_ABI_VERSION)
            other_abi = None
        elif other_abi in (None, 0, abi.LM_ABI_VERSION):
            other_abi = None
        else:
            log.warning("netguard: the maps pinned under %s are of map ABI version %d, this agent's is %d: "
                        "all replaced, none of their entries carried over", self.pin_root, other_abi,
                        abi.LM_ABI_VERSION)
        for name, want in obj.maps().items():
            pin = self.pin_root / name
            if not pin.exists():
                continue
            try:
                old = BpfMap.from_pin(pin)
            except OSError:
                continue  # not a map: libbpf says so at load
            if other_abi is not None:
                BpfMap.unpin(pin)
                aside[name] = old
                continue
            if (old.map_type, old.key_size, old.value_size, old.max_entries) == \
                    (want.map_type, want.key_size, want.value_size, want.max_entries):
                old.close()
                continue
            log.warning("netguard: pinned %s is %s key %d value %d max_entries %d; this agent's is %s key %d value %d "
                        "max_entries %d: replaced, its entries carried over", pin, old.type_name, old.key_size,
                        old.value_size, old.max_entries, want.type_name, want.key_size, want.value_size,
                        want.max_entries)
            BpfMap.unpin(pin)
            aside[name] = old
        return aside

    def _pinned_abi_version(self) -> int | None:
        """``lm_global.abi_version`` of the map pinned under pin_root, or None (none pinned, unreadable)."""
        pin = self.pin_root / "lm_global"
        if not pin.exists():
            return None
        try:
            g = BpfMap.from_pin(pin)
        except OSError:
            return None
        try:
            raw = g.lookup(abi.u32(0))
        except OSError:
            return None
        finally:
            g.close()
        return int.from_bytes(raw[4:8], "little") if raw and len(raw) >= 8 else None

    def _put_back(self, aside: dict[str, BpfMap]) -> None:
        for name, old in aside.items():
            try:
                old.pin(self.pin_root / name)
            except OSError as e:
                log.error("netguard: cannot pin %s back at %s: %s", name, self.pin_root / name, e)
            old.close()

    def _carry_over(self, aside: dict[str, BpfMap]) -> None:
        """Copies the entries of the replaced maps into the new ones, where the entries mean the
        same (same key and value size, and the old maps' lm_global.abi_version is this agent's):
        a job or flow that was cut stays cut. Counters (per-CPU) start again. Emits one event."""
        abi_ok = True
        upgrade = None
        g_old = aside.get("lm_global")
        raw = (g_old.lookup(abi.u32(0)) if g_old is not None else self.maps["lm_global"].lookup(abi.u32(0)))
        version = abi.LM_ABI_VERSION
        if raw and len(raw) >= 8:
            version = int.from_bytes(raw[4:8], "little")
            upgrade = abi.UPGRADES.get(version)
            abi_ok = version in (0, abi.LM_ABI_VERSION) or upgrade is not None
        report: list[str] = []
        for name, old in aside.items():
            new = self.maps.get(name)
            copied = dropped = 0
            if new is not None and abi_ok and not old.percpu and not new.percpu:
                with self.lock:
                    for k, v in old.items():
                        if upgrade is not None:
                            k, v = upgrade(name, k, v)
                        if (len(k), len(v)) != (new.key_size, new.value_size):
                            dropped += 1  # a layout this agent cannot read
                            continue
                        try:
                            new.update(k, v)
                            copied += 1
                        except OSError:  # a smaller map, or an array index beyond it
                            dropped += 1
            else:
                dropped = sum(1 for _ in old.keys()) if not old.percpu else 0
            old.close()
            report.append(f"{name} ({copied} entries carried over{f', {dropped} dropped' if dropped else ''})")
        self._agent.events.emit("agent", "netguard: pinned maps of another build replaced: " + ", ".join(report)
                               + ("" if abi_ok else f"; not carried over: the old maps' ABI version is not "
                                                    f"{abi.LM_ABI_VERSION}")
                               + (f"; converted from map ABI version {version} to {abi.LM_ABI_VERSION}"
                                  if upgrade is not None else ""), pin_root=str(self.pin_root),
                               replaced=sorted(aside))

    def _leave_old_uplink(self, prev: dict[str, Any]) -> bool:
        """An earlier run was attached to another uplink (``net.uplink`` changed): put that interface
        back as it was (our filters, the clsact we made, the shaping tree), as ``bpf unload`` would.
        Returns whether it is done (the interface may be gone: nothing left to do)."""
        old = str(prev["ifname"])
        try:
            idx = tc.ifindex_of(old)
        except (LookupError, OSError):
            return True  # gone with its interface
        try:
            done = restore_interface(idx, bool(prev.get("clsact_created")))
        except OSError as e:
            log.warning("netguard: cannot restore the old uplink %s (kept for bpf unload and the next start): %s",
                        old, e)
            return False
        log.info("netguard: left the old uplink %s: %s", old, done)
        self._agent.events.emit("agent", f"netguard: net.uplink changed from {old} to {self.ifname}: {old} restored "
                                        f"({done['filters_removed']} filters, clsact "
                                        f"{'removed' if done['clsact_removed'] else 'kept'}, shaping tree "
                                        f"{'removed' if done['htb_removed'] else 'none'})", ifname=old, **done)
        return True

    def sync_tunnels(self, wanted: dict[int, str] | None = None) -> None:
        """Attaches ``lm_ingress`` to the tunnel devices over the uplink (``tunnels_over``; `wanted`
        instead when given) that do not have it yet, and restores those of the record that are no
        longer wanted (their clsact too when it was made here). The record's ``tunnels`` says what
        ``bpf unload`` has to restore."""
        if self.obj is None:
            return
        if wanted is None:
            wanted = tunnels_over(self.ifindex)
        record = self._agent.store.get_meta(META_KEY) or {}
        recorded = {int(t["ifindex"]): t for t in record.get("tunnels") or []}
        changed = False
        for idx, name in wanted.items():
            if idx in self.tunnels:
                continue
            try:
                created = attach_tunnel(idx, self.obj.program(PROGRAMS["ingress"]).fd)
            except OSError as e:  # gone meanwhile, or refused: tried again at the next scan
                log.warning("netguard: cannot attach to tunnel %s: %s", name, e)
                continue
            prev = recorded.get(idx)
            recorded[idx] = {"ifindex": idx, "ifname": name,
                             "clsact_created": created or bool(prev and prev.get("clsact_created"))}
            self.tunnels[idx] = name
            changed = True
            self._agent.events.emit("agent", f"netguard: attached to tunnel {name} (ingress): what the uplink "
                                            "receives for a job through it is cut with the job", ifname=name)
        for idx in [i for i in recorded if i not in wanted]:
            t = recorded.pop(idx)
            self.tunnels.pop(idx, None)
            changed = True
            if tc.ifindex_of_or_none(str(t.get("ifname", ""))) == idx:
                try:
                    restore_interface(idx, bool(t.get("clsact_created")))
                except OSError as e:
                    log.warning("netguard: cannot restore tunnel %s: %s", t.get("ifname"), e)
        for idx in [i for i in self.tunnels if i not in wanted]:
            self.tunnels.pop(idx)
        if changed:
            record["tunnels"] = list(recorded.values())
            self._agent.store.set_meta(META_KEY, record)

    async def _scan_tunnels(self, every_s: float) -> None:
        """Looks for tunnels again whenever an interface is added or changes (a netlink link
        event: a tunnel made after the start is kept at once, not up to ``every_s`` later),
        and every ``every_s`` in any case (a missed or overflowed event). Events coalesce: at
        most one look per TUNNEL_EVENT_GAP_S. ``every_s`` 0: on link events only."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        try:
            sock: socket.socket | None = rtnl.link_events()
        except OSError as e:
            log.warning("netguard: no link events (%s): tunnels are looked for every %g s only", e, every_s)
            sock = None

        def drain() -> None:
            assert sock is not None
            while True:
                try:
                    if not sock.recv(65536):
                        break
                except BlockingIOError:
                    break
                except OSError:  # ENOBUFS: events were lost; a look covers them
                    break
            wake.set()

        if sock is not None:
            loop.add_reader(sock.fileno(), drain)
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), every_s if every_s > 0 else None)
                wake.clear()
                try:
                    self.sync_tunnels()
                except OSError as e:
                    log.warning("netguard: tunnel scan failed: %s", e)
                await asyncio.sleep(TUNNEL_EVENT_GAP_S)
        finally:
            if sock is not None:
                loop.remove_reader(sock.fileno())
                sock.close()

    async def stop(self) -> None:
        # Pins and filters stay: they keep enforcing while no agent runs.
        if self._tunnel_task is not None:
            self._tunnel_task.cancel()
            self._tunnel_task = None
        if self.obj is not None:
            self.obj.close()
            self.obj = None

    def _init_global(self) -> None:
        with self.lock:
            g = self._global()
            if g.abi_version != abi.LM_ABI_VERSION:
                g.abi_version = abi.LM_ABI_VERSION
                self.maps["lm_global"].update(abi.u32(0), bytes(g))

    # --- jobs -------------------------------------------------------------------------------

    def register_job(self, cgroup_id: int, job_num: int, lent: bool = False) -> None:
        """Makes netguard see a job's cgroup; keeps any switch already set for it (reattachment)."""
        m = self.maps["lm_jobs"]
        with self.lock:
            raw = m.lookup(_u64(cgroup_id))
            job = abi.LmJob.from_buffer_copy(raw) if raw else abi.LmJob()
            job.job_id = job_num
            job.flags = (job.flags | abi.LM_JOB_LENT) if lent else (job.flags & ~abi.LM_JOB_LENT)
            # a cgroup of a job already registered (a pod's container) starts with the job's switch
            for other in self._cgroups_of.get(job_num, set()) - {cgroup_id}:
                first = self.job_entry(other)
                if first is not None:
                    keep = abi.LM_JOB_KILL | abi.LM_JOB_ARMED
                    job.flags = (job.flags & ~keep) | (first.flags & keep)
                    job.kill_at_ns = first.kill_at_ns
                    break
            m.update(_u64(cgroup_id), bytes(job))
            self._cgroups_of.setdefault(job_num, set()).add(cgroup_id)

    def unregister_job(self, cgroup_id: int) -> None:
        with self.lock:
            for num, ids in list(self._cgroups_of.items()):
                ids.discard(cgroup_id)
                if not ids:
                    del self._cgroups_of[num]
            self.maps["lm_jobs"].delete(_u64(cgroup_id))
            self.maps["lm_job_stats"].delete(_u64(cgroup_id))

    def prune_jobs(self, cgroup_root: str) -> list[int]:
        """Deletes the lm_jobs/lm_job_stats entries whose cgroup under the agent's cgroup root
        (cgroup2) no longer exists or holds no process: jobs that ended while no agent ran, which
        nobody unregistered. Called at start, before the job manager reattaches the live jobs.
        Returns the cgroup ids dropped; none when the cgroup2 mount cannot be found."""
        from ..airlock.cgroups import CgroupError, detect

        try:
            base = detect().unified / cgroup_root
        except (CgroupError, OSError) as e:
            log.warning("netguard: cannot look for stale lm_jobs entries: %s", e)
            return []
        live: set[int] = set()
        for dirpath, _dirs, _files in os.walk(base):
            try:
                if "populated 1" in Path(dirpath, "cgroup.events").read_text():
                    live.add(os.stat(dirpath).st_ino)
            except OSError:  # removed meanwhile
                continue
        stale = [cg for cg in (int.from_bytes(k, "little") for k in list(self.maps["lm_jobs"].keys()))
                 if cg not in live]
        for cg in stale:
            self.unregister_job(cg)
        return stale

    def job_entry(self, cgroup_id: int) -> abi.LmJob | None:
        raw = self.maps["lm_jobs"].lookup(_u64(cgroup_id))
        return abi.LmJob.from_buffer_copy(raw) if raw else None

    def job_counters(self, cgroup_id: int) -> dict[str, int]:
        raw = self.maps["lm_job_stats"].lookup(_u64(cgroup_id))
        if not raw:
            return {f[0]: 0 for f in abi.LmCounters._fields_}
        c = abi.LmCounters.from_buffer_copy(raw)
        return {f[0]: int(getattr(c, f[0])) for f in abi.LmCounters._fields_}

    def _update_job(self, cgroup_id: int, set_flags: int = 0, clear_flags: int = 0, kill_at_ns: int | None = None) -> None:
        """Sets the flags and deadline of the job registered as ``cgroup_id``, and of every other
        cgroup registered for the same job (an adopted pod's containers). KeyError: not registered."""
        with self.lock:  # an unregister in between cannot be undone by this update either
            job = self.job_entry(cgroup_id)
            if job is None:
                raise KeyError(cgroup_id)
            for cg in sorted({cgroup_id} | self._cgroups_of.get(int(job.job_id), set())):
                entry = job if cg == cgroup_id else self.job_entry(cg)
                if entry is None or int(entry.job_id) != int(job.job_id):
                    continue
                entry.flags = (entry.flags | set_flags) & ~clear_flags
                if kill_at_ns is not None:
                    entry.kill_at_ns = kill_at_ns
                self.maps["lm_jobs"].update(_u64(cg), bytes(entry))

    def set_job_kill(self, cgroup_id: int, on: bool) -> None:
        """on: drop the job's traffic from the next packet; off: restore it (clears an armed deadline too)."""
        if on:
            self._update_job(cgroup_id, set_flags=abi.LM_JOB_KILL)
        else:
            self._update_job(cgroup_id, clear_flags=abi.LM_JOB_KILL | abi.LM_JOB_ARMED, kill_at_ns=0)

    def set_job_switch(self, job_id: str, on: bool) -> bool:
        """The kill-switch of the local job ``job_id``: on cuts its traffic from the next packet,
        off restores it (and clears an armed deadline), as ``killswitch on|off --job`` here. What
        the members component calls when a multi-node job's origin orders every member's traffic
        cut or restored (ORDER killswitch_on/off); it reaches no other node. False when no job of
        that id runs here or it is not registered with netguard."""
        jobs = self.agent.jobs if self.agent is not None else None
        job = jobs.get(job_id) if jobs is not None else None
        if job is None or "lm_jobs" not in self.maps:
            return False
        try:
            self.set_job_kill(int(job.cgroup_id), on)
        except KeyError:
            return False
        if self.agent is not None:
            self.agent.events.emit("killswitch", f"kill-switch: traffic of job {job_id} "
                                   f"{'cut' if on else 'restored'} with its multi-node job",
                                   action="on" if on else "off", scope="job", job=job_id, members=True)
        return True

    def disarm_job(self, cgroup_id: int) -> None:
        """Clears the job's armed deadline only (``LM_JOB_ARMED``, ``kill_at_ns``): a cut the job
        has (``LM_JOB_KILL``: an operator's ``killswitch job on``) stays; a deadline that had
        passed stops cutting. KeyError: not registered."""
        self._update_job(cgroup_id, clear_flags=abi.LM_JOB_ARMED, kill_at_ns=0)

    def arm_job(self, cgroup_id: int, deadline_monotonic_ns: int) -> bool:
        """The data plane cuts the job's traffic once CLOCK_MONOTONIC passes the deadline. A job its
        passed armed deadline has cut already stays cut (its kill flag is set with the new
        deadline: only ``off`` restores). Returns whether that was so. KeyError: not registered."""
        with self.lock:
            job = self.job_entry(cgroup_id)
            if job is None:
                raise KeyError(cgroup_id)
            stays_cut = cut_by_deadline(job.flags, job.kill_at_ns, abi.LM_JOB_ARMED)
            self._update_job(cgroup_id, set_flags=abi.LM_JOB_ARMED | (abi.LM_JOB_KILL if stays_cut else 0),
                             kill_at_ns=deadline_monotonic_ns)
        return stays_cut

    def _global(self) -> abi.LmGlobal:
        raw = self.maps["lm_global"].lookup(abi.u32(0))
        return abi.LmGlobal.from_buffer_copy(raw) if raw else abi.LmGlobal()

    def set_global(self, set_flags: int = 0, clear_flags: int = 0, kill_at_ns: int | None = None) -> abi.LmGlobal:
        with self.lock:
            g = self._global()
            g.flags = (g.flags | set_flags) & ~clear_flags
            g.abi_version = abi.LM_ABI_VERSION
            if kill_at_ns is not None:
                g.kill_at_ns = kill_at_ns
            self.maps["lm_global"].update(abi.u32(0), bytes(g))
            return g

    # --- status and API ---------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        m = self.maps["lm_stats"]
        names = {v: k for k, v in abi.STAT_SLOTS.items()}
        return {names[i]: m.lookup_percpu_sum(abi.u32(i)) for i in sorted(names)}

    def map_rows(self) -> list[dict[str, Any]]:
        """Each map with its entry count. A hash map is counted key by key (a syscall each: about
        10,000 for lm_jobs, lm_job_stats, lm_flows and lm_frags), so the counts are taken at most
        every MAP_COUNTS_S: any local user may ask GET /v1/status or /v1/bpf/maps in a loop."""
        now = time.monotonic()
        if self._map_counts is None or now - self._map_counts[0] >= MAP_COUNTS_S:
            self._map_counts = (now, {name: sum(1 for _ in m.keys()) for name, m in self.maps.items()
                                      if m.type_name not in ("array", "percpu_array")})
        counts = self._map_counts[1]
        rows = []
        for name, m in self.maps.items():
            entries = counts.get(name, 0) if m.type_name not in ("array", "percpu_array") else m.max_entries
            rows.append({"name": name, "type": m.type_name, "key_size": m.key_size, "value_size": m.value_size,
                         "entries": entries, "max_entries": m.max_entries, "pin": str(self.pin_root / name)})
        return rows

    def status(self) -> dict[str, Any]:
        progs = []
        for direction in ("egress", "ingress"):
            for f in tc.list_bpf_filters(self.ifindex, direction):
                progs.append({"ifname": self.ifname, "direction": direction, **f})
        for idx, name in sorted(self.tunnels.items()):
            try:
                filters = tc.list_bpf_filters(idx, "ingress")
            except OSError:  # the tunnel went since the last scan
                continue
            for f in filters:
                progs.append({"ifname": name, "direction": "ingress", **f})
        g = self._global()
        return {"ifname": self.ifname, "ifindex": self.ifindex, "pin_root": str(self.pin_root),
                "reattached_pins": self.reattached, "global_flags": abi.global_flag_names(g.flags),
                "stats": self.stats(), "programs": progs, "maps": self.map_rows()}

    def routes(self) -> list[Route]:
        return [
            Route("GET", "/v1/bpf/maps", self._api_maps),
            Route("GET", "/v1/bpf/maps/{name}", self._api_dump),
            Route("POST", "/v1/bpf/unload", self._api_unload, privileged=True),
            Route("GET", "/v1/killswitch", self._api_ks_status),
            Route("POST", "/v1/killswitch", self._api_killswitch, privileged=True),
        ]

    async def _api_maps(self, req: Request) -> list[dict[str, Any]]:
        return self.map_rows()

    async def _api_dump(self, req: Request) -> dict[str, Any]:
        name = req.params["name"]
        m = self.maps.get(name)
        if m is None:
            raise ApiError(404, f"no map {name!r}; maps: {', '.join(sorted(self.maps))}")
        entries: list[dict[str, Any]] = []
        if name == "lm_stats":
            for slot, i in sorted(abi.STAT_SLOTS.items(), key=lambda kv: kv[1]):
                entries.append({"key": {"slot": slot}, "value": {"value": m.lookup_percpu_sum(abi.u32(i))}})
        else:
            for k, v in m.items():
                key, value = abi.decode(name, k, v)
                entries.append({"key": key, "value": value})
        return {"name": name, "pin": str(self.pin_root / name), "entries": entries}

    async def _api_unload(self, req: Request) -> dict[str, Any]:
        airlock = self.agent.airlock if self.agent is not None else None
        # Before the cgroups go: on v1 their removal signals Airlock's eventfds, and a job it
        # holds suspended would stay frozen with no agent left to recover it.
        thawed = airlock.release_for_unload() if airlock is not None else []
        try:
            res = unload(self._agent.store, self.ifindex, self.pin_root, self._agent.config.cgroups.root)
        except Exception:
            if airlock is not None:  # the agent goes on running: not without Airlock
                airlock.resume_after_failed_unload()
            raise
        self.maps = {}
        if self._tunnel_task is not None:
            self._tunnel_task.cancel()
            self._tunnel_task = None
        self.tunnels = {}
        if self.obj is not None:
            self.obj.close()
            self.obj = None
        res["jobs_thawed"] = thawed
        self._agent.events.emit("agent", f"data plane unloaded from {self.ifname} by uid {req.peer.uid}; agent stops",
                               **res)
        # Without its data plane the agent has nothing to enforce: stop after answering.
        agent = self._agent
        assert agent.loop is not None  # the agent's loop runs before any component starts
        agent.loop.call_later(0.05, agent.request_stop)
        return res

    def _job_cgroup(self, job_id: str) -> tuple[Any, int]:
        jobs = self.agent.jobs if self.agent is not None else None
        job = jobs.get(job_id) if jobs is not None else None
        if job is None:
            raise ApiError(404, f"unknown job {job_id!r}; `laminarctl jobs` lists the jobs on this node")
        if self.job_entry(job.cgroup_id) is None:
            raise ApiError(409, f"job {job_id!r} is not registered with netguard (state {getattr(job, 'state', '?')})")
        return job, int(job.cgroup_id)

    async def _api_ks_status(self, req: Request) -> dict[str, Any]:
        now = time.monotonic_ns()
        g = self._global()
        by_cgroup = {}
        jobs = self.agent.jobs if self.agent is not None else None
        if jobs is not None:
            by_cgroup = {int(j.cgroup_id): j.id for j in jobs.list(all_jobs=False)}  # the live ones: not the history
        rows = []
        for k, v in self.maps["lm_jobs"].items():
            cg = int.from_bytes(k, "little")
            j = abi.LmJob.from_buffer_copy(v)
            rows.append({"job": by_cgroup.get(cg, f"#{j.job_id}"), "cgroup_id": cg,
                         "kill": bool(j.flags & abi.LM_JOB_KILL), "lent": bool(j.flags & abi.LM_JOB_LENT),
                         "armed_in_s": round((j.kill_at_ns - now) / 1e9, 3) if j.flags & abi.LM_JOB_ARMED else None})
        return {"global": {"flags": abi.global_flag_names(g.flags),
                           "armed_in_s": round((g.kill_at_ns - now) / 1e9, 3) if g.flags & abi.LM_GLOBAL_ARMED else None},
                "jobs": rows}

    def _job_names(self, cgroup_ids: list[int]) -> list[str]:
        """Job ids of these cgroups (``cgroup N`` for one the job manager does not know)."""
        if not cgroup_ids:
            return []
        jobs = self.agent.jobs if self.agent is not None else None
        by_cgroup = {int(j.cgroup_id): j.id for j in jobs.list(all_jobs=False)} if jobs is not None else {}
        return [by_cgroup.get(cg, f"cgroup {cg}") for cg in cgroup_ids]

    async def _api_killswitch(self, req: Request) -> dict[str, Any]:
        body = req.body or {}
        action = require(body, "action", str, "one of on, off, arm")
        scope = require(body, "scope", str, "one of job, all, lent")
        if action not in ("on", "off", "arm"):
            raise ApiError(400, f"action {action!r}: expected one of on, off, arm")
        if scope not in ("job", "all", "lent"):
            raise ApiError(400, f"scope {scope!r}: expected one of job, all, lent")
        deadline = None
        if action == "arm":
            at_s = require(body, "at_s", (int, float), "seconds from now (> 0) when the cut happens")
            if not 0 < at_s <= 7 * 86400:
                raise ApiError(400, f"at_s = {at_s!r}: the deadline must be in the future and within 7 days "
                                    "(a deadline in the past would cut at once: use `on` for that)")
            deadline = time.monotonic_ns() + int(at_s * 1e9)
        who = ""
        disarmed: list[int] = []  # cgroup ids whose armed deadline an 'off' cleared (a reclaim's, maybe)
        stayed_cut: list[int] = []  # cgroup ids an 'arm' found cut by their passed deadline (kept cut)
        lent_stays_cut = False
        lent_off = False  # an 'off --all' that also cleared the lent cut or the lent deadline
        members = self.agent.members if self.agent is not None else None
        multi: str | None = None  # a multi-node job's id: its other members are reached too
        if scope == "job":
            job_id = require(body, "job", str, "a job id")
            jobs = self.agent.jobs if self.agent is not None else None
            here = jobs is not None and jobs.get(job_id) is not None
            if members is not None and (members.member_of(job_id) is not None
                                        or (not here and members.view(job_id) is not None)):
                multi = job_id
        if scope == "job" and multi is not None and not here:
            # the origin of a multi-node job with no member here: the members are reached below
            if action == "arm":
                raise ApiError(409, f"job {job_id!r} has no member on this node, and arm reaches a member on its "
                                    "own node only: arm it on a member's node, or use on/off for every member")
            who = f"multi-node job {job_id}"
        elif scope == "job":
            job, cg = self._job_cgroup(job_id)
            if action == "arm":
                assert deadline is not None
                if self.arm_job(cg, deadline):
                    stayed_cut.append(cg)
            else:
                with self.lock:
                    before = self.job_entry(cg)
                    self.set_job_kill(cg, action == "on")
                if action == "off" and before is not None and before.flags & abi.LM_JOB_ARMED:
                    disarmed.append(cg)
            who = f"job {job_id}"
        elif scope == "all":
            if action == "arm":
                assert deadline is not None
                for k, _ in list(self.maps["lm_jobs"].items()):
                    try:
                        if self.arm_job(int.from_bytes(k, "little"), deadline):
                            stayed_cut.append(int.from_bytes(k, "little"))
                    except KeyError:  # unregistered meanwhile
                        pass
            elif action == "on":
                self.set_global(set_flags=abi.LM_GLOBAL_KILL_JOBS)
            else:
                # The operator's "all off" is all off: per-job cuts and every armed deadline, those
                # a reclaim armed included (docs/operations.md); the answer and event name them.
                with self.lock:
                    g = self._global()
                    lent_off = bool(g.flags & (abi.LM_GLOBAL_KILL_LENT | abi.LM_GLOBAL_ARMED))
                    self.set_global(clear_flags=abi.LM_GLOBAL_KILL_JOBS | abi.LM_GLOBAL_KILL_LENT | abi.LM_GLOBAL_ARMED,
                                    kill_at_ns=0)
                    for k, v in list(self.maps["lm_jobs"].items()):
                        cg_k = int.from_bytes(k, "little")
                        if abi.LmJob.from_buffer_copy(v).flags & abi.LM_JOB_ARMED:
                            disarmed.append(cg_k)
                        try:
                            self.set_job_kill(cg_k, False)
                        except KeyError:  # unregistered meanwhile
                            pass
            who = "all jobs"
        else:
            if action == "arm":
                with self.lock:
                    g = self._global()
                    lent_stays_cut = cut_by_deadline(g.flags, g.kill_at_ns, abi.LM_GLOBAL_ARMED)
                    self.set_global(set_flags=abi.LM_GLOBAL_ARMED
                                    | (abi.LM_GLOBAL_KILL_LENT if lent_stays_cut else 0), kill_at_ns=deadline)
            elif action == "on":
                self.set_global(set_flags=abi.LM_GLOBAL_KILL_LENT)
            else:
                self.set_global(clear_flags=abi.LM_GLOBAL_KILL_LENT | abi.LM_GLOBAL_ARMED, kill_at_ns=0)
            who = "lent jobs"
        fanned: dict[str, Any] | None = None
        fan_error: str | None = None
        if multi is not None and members is not None and action in ("on", "off"):
            try:
                fanned = await members.killswitch(multi, action == "on", req.peer.uid)
            except Exception as e:  # what is cut here stays cut; the answer says who was not reached
                fan_error = str(e) or type(e).__name__
        verb = {"on": "cut", "off": "restored", "arm": f"armed to cut in {body.get('at_s')} s"}[action]
        msg = f"kill-switch: traffic of {who} {verb}"
        if multi is not None:
            msg += ("; its other members: " + (f"not reached: {fan_error}" if fan_error is not None else
                                               "asked through its origin" if action != "arm" else
                                               "not armed (arm reaches this member only)"))
        disarmed_jobs = self._job_names(disarmed)
        if disarmed_jobs:
            msg += f"; armed deadline cleared for {', '.join(disarmed_jobs)}"
        if lent_off:
            msg += "; the lent jobs' cut and deadline cleared"
        kept = self._job_names(stayed_cut) + (["lent jobs"] if lent_stays_cut else [])
        if kept:
            msg += (f"; {', '.join(kept)} cut by the armed deadline already: stays cut (off restores)")
        # Recorded in the next loop round, after the answer: the switch is already enforcing.
        agent = self._agent
        assert agent.loop is not None  # the agent's loop runs before any component starts
        agent.loop.call_soon(lambda: agent.events.emit(
            "killswitch", msg, action=action, scope=scope, job=body.get("job"), uid=req.peer.uid, deadline_ns=deadline,
            disarmed=disarmed_jobs, stays_cut=kept))
        out: dict[str, Any] = {"message": msg, "action": action, "scope": scope, "job": body.get("job"),
                               "deadline_ns": deadline, "disarmed": disarmed_jobs, "stays_cut": kept}
        if multi is not None:
            out["members"] = fanned
            if fan_error is not None:
                out["members_error"] = fan_error
        return out


def restore_interface(ifindex: int, clsact_created: bool) -> dict[str, Any]:
    """Removes from one interface what the agent put there: its ``lm_`` filters on both hooks, the
    clsact qdisc when the agent created it, and its shaping tree (``htb.remove_tree``: only an HTB
    root with the agent's handle). Returns what was removed."""
    done: dict[str, Any] = {"filters_removed": 0, "clsact_removed": False, "htb_removed": False}
    for direction in ("egress", "ingress"):
        done["filters_removed"] += tc.detach_bpf(ifindex, direction)
    if clsact_created:
        tc.delete_clsact(ifindex)
        done["clsact_removed"] = True
    done["htb_removed"] = htb.remove_tree(ifindex)
    return done


def unload(store: Any, ifindex: int | None, pin_root: Path, cgroup_root: str | None = None) -> dict[str, Any]:
    """Detaches netguard, deletes clsact if the agent created it, deletes the shaping tree
    (`htb.remove_tree`: only an HTB root with the agent's handle) and forgets the stored
    transfers, removes the pins and, when `cgroup_root` is given, the agent's cgroup subtree
    where no job runs any more.

    Returns what was done. Safe to run twice (the second run finds nothing to remove)."""
    record = store.get_meta(META_KEY) or {}
    done: dict[str, Any] = {"filters_removed": 0, "clsact_removed": False, "htb_removed": False,
                            "pins_removed": []}
    if ifindex is None and record.get("ifname"):
        try:
            ifindex = tc.ifindex_of(record["ifname"])
        except (LookupError, OSError):
            ifindex = None
    if ifindex is not None:
        done.update(restore_interface(ifindex, bool(record.get("clsact_created"))))
    for t in record.get("tunnels") or []:  # tunnel devices lm_ingress was attached to
        idx = tc.ifindex_of_or_none(str(t.get("ifname", "")))
        if idx is not None and idx == t.get("ifindex"):  # not another device that took the name
            more = restore_interface(idx, bool(t.get("clsact_created")))
            done["filters_removed"] += more["filters_removed"]
    for prev in record.get("previous") or []:  # uplinks of earlier runs, not restored yet
        try:
            idx = tc.ifindex_of(prev["ifname"])
        except (LookupError, OSError):
            continue
        more = restore_interface(idx, bool(prev.get("clsact_created")))
        done["filters_removed"] += more["filters_removed"]
    # Without their tree the stored transfers would come back at the next start, leaves and all.
    # Nor would the records of flow cuts whose lm_flows entries go with the pins.
    for table in ("net_transfers", "net_flow_cuts"):
        try:
            with store.tx() as db:
                db.execute(f"DELETE FROM {table}")
        except sqlite3.OperationalError:  # no such table: shaping never ran here
            pass
    if pin_root.is_dir():
        for p in sorted(pin_root.iterdir()):
            if p.name.startswith("lm_"):
                p.unlink()
                done["pins_removed"].append(p.name)
        try:
            pin_root.rmdir()
        except OSError:
            pass
    if cgroup_root:
        from ..airlock.cgroups import remove_empty_tree

        tree = remove_empty_tree(cgroup_root)
        done["cgroups_removed"] = len(tree["removed"])
        done["cgroups_kept_busy"] = tree["kept"]
    store.del_meta(META_KEY)
    return done


def unload_offline(config: Any) -> dict[str, Any]:
    """`laminarctl bpf unload --force` with no agent running: the same cleanup, done directly."""
    from ..store import Store

    if os.geteuid() != 0:
        raise PermissionError("bpf unload --force must run as root")
    store = Store(config.state_dir / "laminar.db")
    try:
        record = store.get_meta(META_KEY) or {}
        pin_root = Path(record.get("pin_root") or config.bpf.pin_root)
        ifindex = None
        ifname = record.get("ifname") or config.net.uplink
        if ifname:
            try:
                ifindex = tc.ifindex_of(ifname)
            except (LookupError, OSError):
                pass
        res = unload(store, ifindex, pin_root, config.cgroups.root)
    finally:
        store.close()
    # The cgroups jobs still run in are kept, with the holds Airlock wrote on them: no agent will
    # decide for a task waiting at one (the agent's own unload lifts them in release_for_unload).
    from ..airlock.cgroups import CgroupTree, detect
    from ..airlock.manager import release_holds

    try:
        airlock = config.section("airlock")
    except KeyError:  # the config was loaded before the airlock section was registered: defaults
        airlock = {}
    problems = release_holds(CgroupTree(detect(), config.cgroups.root), airlock.get("budget_mb") or None,
                             dict(airlock.get("class_budget_mb") or {}))
    if problems:
        res["memory_holds_kept"] = problems
    return res

