"""The ``[zone]`` section of the agent's configuration (registered with :mod:`laminar.config` on
import; :mod:`laminar.zone.component` imports it, so importing the component registers it too).

Each field says what it is for; ``docs/protocol.md`` and ``docs/operations.md`` say more about
the keys, the roster (``[[zone.nodes]]``) and the authority settings.
"""

from __future__ import annotations

from typing import Any

from laminar.zone import authority
from laminar.zone.arbiter import LEASE_S, PACKING_MODES, PACKING_SPREAD
from laminar.zone.keys import DEFAULT_NODE_KEY_FILE, NODE_KEY_MODES
from laminar.zone.membership import listen_check

DEFAULT_PORT = 7440
DEFAULT_HANDOVER_PORT = 7441


def _nodes_check(v: Any) -> str | None:
    from laminar.zone.membership import MembershipError, members_from_config

    try:
        members_from_config(v, DEFAULT_PORT, DEFAULT_HANDOVER_PORT)
    except MembershipError as e:
        return str(e)
    return None


def zone_config_fields() -> dict[str, Any]:
    """The ``[zone]`` config section (registered with laminar.config on import)."""
    from laminar.config import Field, _one_of, _range

    def rng(lo: float, hi: float) -> Any:
        return _range(lo, hi)

    return {
        "node_id": Field(int, 0, "this node's id in zone.nodes (0: the one-node zone, no network)", rng(0, 2**32 - 1)),
        "listen": Field(str, "0.0.0.0", "address the UDP probe endpoint and the TCP hand-over server bind "
                        "(0.0.0.0: this node's zone.nodes address when this host holds it, else 0.0.0.0, :: for "
                        "an IPv6 one)", listen_check),
        "port": Field(int, DEFAULT_PORT, "UDP port of the probe endpoint", rng(1, 65535)),
        "handover_port": Field(int, DEFAULT_HANDOVER_PORT, "TCP port for job hand-overs", rng(1, 65535)),
        "keys_file": Field(str, "/etc/laminar/zone.keys", "per-zone keys (root-only file; see docs/protocol.md)"),
        "node_key_file": Field(str, DEFAULT_NODE_KEY_FILE, "this node's private X25519 key (root-only file, "
                               "laminarctl zone keys node-gen); read only when this node's zone.nodes entry lists a "
                               "pubkey (docs/protocol.md, Node keys)"),
        "node_keys": Field(str, "require", "with a node key, what goes to and is taken from peers the roster gives "
                           "a pubkey: accept (sign with the zone key, take pair or zone MACs), send (sign with the "
                           "pair key, take either), require (pair MACs only); a zone rolls node keys out through "
                           "the three in turn (docs/operations.md, Node keys)", _one_of(*NODE_KEY_MODES)),
        "gpu_model": Field(str, "", "GPU model this node advertises (e.g. H100; empty: from NVML or none)"),
        "cpus": Field((int, float), 0.0, "CPUs this node offers to placed jobs (0: all online CPUs)", rng(0, 65535)),
        "memory_mb": Field(int, 0, "memory (MiB) this node offers to placed jobs (0: physical memory)", rng(0, 2**32 - 1)),
        "probe_d": Field(int, 2, "nodes probed per placement attempt", rng(1, 64)),
        "probe_d_max": Field(int, 8, "most nodes probed in one attempt after widening", rng(1, 255)),
        "zones_max": Field(int, 3, "zones tried before a placement is queued", rng(1, 1000)),
        "queue_rounds": Field(int, 3, "queue cycles (with back-off) before a placement gives up", rng(1, 100)),
        "lease_s": Field((int, float), LEASE_S, "lease of a tentative reservation (an offer); unused offers lapse "
                         "after it (they are not released)", rng(0.05, 60)),
        "hold_s": Field((int, float), 30.0, "hold of a committed reservation awaiting its hand-over", rng(1, 600)),
        "probe_timeout_s": Field((int, float), 0.2, "how long a submitter waits for answers to one probe round", rng(0.005, 10)),
        "handover_timeout_s": Field((int, float), 10.0, "how long a hand-over may take (job start included)", rng(0.1, 120)),
        "unconfirmed_wait_s": Field((int, float), 60.0, "how long a submitter keeps asking a node that received a "
                                    "hand-over and went silent, before reporting the placement unconfirmed", rng(0, 3600)),
        "summary_interval_s": Field((int, float), 1.0, "period of this node's capacity summaries", rng(0.05, 600)),
        "summary_fanout": Field(int, 8, "peers each summary goes to (bounds the rate in any zone size)", rng(1, 1000)),
        "peer_timeout_s": Field((int, float), 10.0, "a summary older than this no longer counts", rng(0.5, 3600)),
        "replay_window_s": Field((int, float), 30.0, "accepted clock difference between nodes", rng(1, 3600)),
        "check_source": Field(bool, True, "drop a datagram or hand-over frame that comes from another address than "
                              "its sender's zone.nodes entry (wrong_source): the key is per zone, so without it "
                              "any member can speak as any node; off only for NAT'd or multi-homed nodes whose "
                              "traffic leaves from another address (docs/protocol.md, Security)"),
        "max_tentative": Field(int, 64, "most tentative reservations a node holds at once", rng(1, 100000)),
        "max_held_per_node": Field(int, 32, "most reservations (offers, commits) one peer may hold here at once, "
                                   "so that one member cannot take every slot of max_tentative (0: no cap of its own)",
                                   rng(0, 100000)),
        "root_from": Field(list, [], "nodes trusted to hand this node jobs that run as root (uid 0): a root job "
                           "runs here only when both its origin and the node handing it here are listed (or are "
                           "this node); default none (docs/protocol.md, Authority)", authority.check_node_list),
        "peer_unknown_uids": Field(str, "refuse", "a job from a peer whose uid has no account here: refuse (the "
                                   "default) or allow (run with no supplementary group, never with gid 0)",
                                   _one_of(*authority.UNKNOWN_UIDS)),
        "packing": Field(str, "bestfit", "which GPUs this node offers: bestfit (the tightest GPU, the hot path) or "
                         "frag (the least-fragmenting GPUs, with a score for packing placements; docs/allocation.md)",
                         _one_of(*PACKING_MODES)),
        "packing_spread": Field(int, PACKING_SPREAD, "zones whose every member a packing placement "
                                "(POST /v1/placements {\"packing\": true}) probes in one round", rng(1, 1000)),
        "nodes": Field(list, [], "the cluster: [[zone.nodes]] id, zone, addr ('IP' or 'IP:PORT'), handover_port, pool, "
                       "owner, pubkey (64 hex digits)",
                       _nodes_check),
    }


try:  # the zone section joins the agent's config schema wherever this module is imported
    from laminar.config import register_section

    register_section("zone", zone_config_fields())
except ImportError:  # pragma: no cover - the simulator runs without the agent package parts
    pass

