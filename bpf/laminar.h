/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* The Laminar map ABI: every struct and constant that crosses the kernel boundary.
 *
 * Python mirrors each struct in agent/laminar/bpf/abi.py; tests/kernel/test_abi.py checks
 * every mirrored size and field offset against the BTF of the compiled objects, so the two
 * sides cannot drift. Fixed-width types only; explicit padding so no compiler inserts any.
 * Bump LM_ABI_VERSION on any incompatible change: the agent never re-adopts pins whose
 * lm_global.abi_version differs (netguard replaces them all and reads none of their entries),
 * except a version it knows how to upgrade (agent/laminar/bpf/abi.py UPGRADES: 1 -> 2 converts
 * the IPv4 lm_flows keys), whose entries it converts; a pin of the same version whose size
 * changed is replaced and its entries carried over.
 */
#ifndef __LAMINAR_H
#define __LAMINAR_H

#define LM_ABI_VERSION 2 /* 2: lm_flow_key holds IPv6 (IPv4 v4-mapped); 1: IPv4 only */

/* Map sizes. Jobs per node are few (tens); flows are checkpoint transfers (a few at a time). */
#define LM_MAX_JOBS   4096
#define LM_MAX_FLOWS  1024
#define LM_MAX_FRAGS  1024 /* fragmented datagrams whose first fragment was dropped, remembered (LRU) */
#define LM_RINGBUF_BYTES (256 * 1024)

/* lm_jobs value flags */
#define LM_JOB_KILL   (1U << 0) /* drop every packet of this job, both directions, now */
#define LM_JOB_LENT   (1U << 1) /* runs on lent capacity: covered by LM_GLOBAL_KILL_LENT */
#define LM_JOB_ARMED  (1U << 2) /* drop once bpf_ktime_get_ns() >= kill_at_ns */

/* lm_global flags (the one entry of an array map) */
#define LM_GLOBAL_KILL_JOBS (1U << 0) /* drop the traffic of every job in lm_jobs */
#define LM_GLOBAL_KILL_LENT (1U << 1) /* drop the traffic of every job flagged LM_JOB_LENT */
#define LM_GLOBAL_ARMED     (1U << 2) /* apply KILL_LENT once bpf_ktime_get_ns() >= kill_at_ns */

/* lm_flows value flags */
#define LM_FLOW_KILL  (1U << 0) /* drop this flow now */
#define LM_FLOW_ARMED (1U << 1) /* drop once bpf_ktime_get_ns() >= kill_at_ns */

/* Pressure event types (lm_pressure_event.type) */
#define LM_EV_DIRECT_RECLAIM_BEGIN 1 /* vmscan/mm_vmscan_direct_reclaim_begin */
#define LM_EV_DIRECT_RECLAIM_END   2 /* vmscan/mm_vmscan_direct_reclaim_end (value = pages reclaimed) */
#define LM_EV_MEMCG_RECLAIM_BEGIN  3 /* vmscan/mm_vmscan_memcg_reclaim_begin */
#define LM_EV_MEMCG_RECLAIM_END    4 /* vmscan/mm_vmscan_memcg_reclaim_end (value = pages reclaimed) */
#define LM_EV_OOM_VICTIM           5 /* oom/mark_victim: the kernel chose pid as an OOM victim */

/* Counter slots of lm_stats (per-CPU array, summed by the agent) */
#define LM_STAT_PASS        0 /* packets passed by netguard */
#define LM_STAT_DROP_JOB    1 /* dropped: the job's own switch (now or armed) */
#define LM_STAT_DROP_GLOBAL 2 /* dropped: the node-wide switch */
#define LM_STAT_DROP_FLOW   3 /* dropped: a migration flow's switch */
#define LM_STAT_SHAPED      4 /* steered into an HTB class */
#define LM_STAT_EV_LOST     5 /* pressure events lost to a full ring buffer */
#define LM_STAT_DROP_EXTHDR 6 /* dropped: an IPv6 extension header chain too long to find TCP/UDP behind */
#define LM_STAT_DROP_FRAG   7 /* dropped: a later fragment of a datagram whose first fragment was dropped */
#define LM_STAT_MAX         8

/* lm_jobs: HASH, key __u64 cgroup2 id (what bpf_skb_cgroup_id() returns) */
struct lm_job {
	__u32 job_id;     /* the agent's numeric id of the job */
	__u32 flags;      /* LM_JOB_* */
	__u64 kill_at_ns; /* CLOCK_MONOTONIC deadline, used with LM_JOB_ARMED */
};

/* lm_job_stats: HASH, key __u64 cgroup2 id; updated atomically by netguard */
struct lm_counters {
	__u64 tx_packets;
	__u64 tx_bytes;
	__u64 rx_packets;
	__u64 rx_bytes;
	__u64 drop_packets;
	__u64 drop_bytes;
};

/* lm_global: ARRAY of one entry */
struct lm_global {
	__u32 flags;       /* LM_GLOBAL_* */
	__u32 abi_version; /* LM_ABI_VERSION of the agent that wrote it */
	__u64 kill_at_ns;  /* CLOCK_MONOTONIC deadline, used with LM_GLOBAL_ARMED */
};

/* lm_flows: HASH keyed by the egress 5-tuple as seen on the uplink (local -> remote).
 * Addresses are IPv6; an IPv4 address is stored v4-mapped (::ffff:a.b.c.d: bytes 0-9 zero,
 * 10-11 0xff, 12-15 the IPv4 address), so one key holds either family and the two never meet.
 * Addresses and ports in network byte order, exactly as in the packet headers. Ingress
 * packets of the flow are matched with source and destination swapped. */
struct lm_flow_key {
	__u32 saddr[4];   /* IPv6 address, or ::ffff:IPv4 */
	__u32 daddr[4];
	__u16 sport;
	__u16 dport;
	__u8 proto;       /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 _pad[3];
};

struct lm_flow {
	__u32 job_id;
	__u32 flags;      /* LM_FLOW_* */
	__u32 priority;   /* skb->priority to set on egress (HTB major:minor), 0 = leave alone */
	__u32 _pad;
	__u64 kill_at_ns; /* CLOCK_MONOTONIC deadline, used with LM_FLOW_ARMED */
	__u64 packets;    /* egress + ingress, updated atomically */
	__u64 bytes;
};

/* lm_frags: LRU_HASH keyed by a fragmented datagram whose first fragment netguard dropped (any
 * switch), value __u64 bpf_ktime_get_ns() of that drop; its later fragments (no ports) are
 * dropped too. Addresses as in the packet (not swapped), IPv4 v4-mapped. */
struct lm_frag_key {
	__u32 saddr[4];   /* IPv6 address, or ::ffff:IPv4 */
	__u32 daddr[4];
	__u32 id;         /* fragment identification, host byte order (IPv4: 16 bits) */
	__u8 proto;       /* IPv4: the protocol field; IPv6: 0 (fragments' next headers may differ) */
	__u8 _pad[3];
};

/* lm_events: RINGBUF of these */
struct lm_pressure_event {
	__u64 ts_ns;      /* bpf_ktime_get_ns() when the tracepoint fired */
	__u64 cgroup_id;  /* cgroup2 id of the task concerned (the victim for LM_EV_OOM_VICTIM) */
	__u64 value;      /* pages reclaimed (END events), allocation order (BEGIN events) */
	__u32 type;       /* LM_EV_* */
	__u32 pid;        /* tgid of the task concerned */
	char comm[16];
};

#endif /* __LAMINAR_H */
