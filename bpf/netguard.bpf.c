// SPDX-License-Identifier: GPL-2.0
/* netguard: Laminar's data plane on the uplink's clsact hook.
 *
 * lm_egress  (clsact egress):  identifies the job by bpf_skb_cgroup_id(), applies the job,
 *                              node-wide and migration-flow kill-switches, steers migration
 *                              flows into HTB leaves through skb->priority, counts.
 * lm_ingress (clsact ingress): identifies the job by the local socket the packet is for
 *                              (bpf_sk_lookup_*, IPv4 and IPv6 TCP/UDP), applies the same
 *                              switches, counts.
 *
 * Migration flows (lm_flows) are IPv4 or IPv6 TCP/UDP 5-tuples (IPv4 keyed v4-mapped); an IPv6
 * packet is matched by the TCP/UDP header behind its extension headers (up to LM_IPV6_MAX_EXT).
 *
 * Everything that matches no job and no flow passes (TC_ACT_OK): attached with empty maps,
 * netguard changes nothing, so the agent may sit on a node's only uplink.
 *
 * All maps are pinned by name (LIBBPF_PIN_BY_NAME) under the pin_root_path the agent passes
 * to libbpf (default /sys/fs/bpf/laminar), so a restarted agent re-adopts them and pressure.bpf.c
 * shares lm_stats. The structs and flags are the map ABI of bpf/laminar.h.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>
#include "laminar.h"

#define TC_ACT_OK   0
#define TC_ACT_SHOT 2
#define ETH_P_IP    0x0800
#define ETH_P_IPV6  0x86DD
#define IP_MF       0x2000
#define IP_OFFSET   0x1fff

char LICENSE[] SEC("license") = "GPL";

/* bpf_sk_cgroup_id() is not offered to tc programs, so the ingress path reads the socket's
 * cgroup through a read-only BTF cast of the looked-up socket (kfunc since 6.2; loads from
 * the cast pointer are fault-safe probe reads). */
extern void *bpf_rdonly_cast(const void *obj__ign, __u32 btf_id) __ksym;

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, LM_MAX_JOBS);
	__type(key, __u64); /* cgroup2 id */
	__type(value, struct lm_job);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lm_jobs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, LM_MAX_JOBS);
	__type(key, __u64); /* cgroup2 id */
	__type(value, struct lm_counters);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lm_job_stats SEC(".maps");

/* One entry: an array, not a hash, so the lookup can never miss and the flag costs one load. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct lm_global);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lm_global SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, LM_MAX_FLOWS);
	__type(key, struct lm_flow_key);
	__type(value, struct lm_flow);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lm_flows SEC(".maps");

/* Datagrams whose first fragment was dropped: their later fragments carry no ports, so they are
 * dropped by this memory of the first. An entry is needed only while its datagram's fragments
 * arrive (back to back at egress, within milliseconds at ingress); it counts for LM_FRAG_TTL_NS
 * only, so a later datagram of the same hosts that reuses the id (IPv4 ids are 16 bits) is not
 * cut by a stale entry, and the LRU reuses old entries. Only fragments ever look here. */
#define LM_FRAG_TTL_NS 1000000000ULL
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, LM_MAX_FRAGS);
	__type(key, struct lm_frag_key);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lm_frags SEC(".maps");

/* Per-CPU so the hot path never contends on a cache line; the agent sums the CPUs.
 * pressure.bpf.c declares the identical map: libbpf reuses the pin only when type, sizes,
 * max_entries and flags all match. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, LM_STAT_MAX);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lm_stats SEC(".maps");

/* Packet bytes at `off` from the network (IP) header. At tc, skb->data is the MAC header on an
 * Ethernet device (the uplink, a VXLAN/GENEVE/gretap tunnel) but the IP header itself on an L3
 * device (ipip, sit, gre, ip6tnl: no MAC header), so offsets are taken from the network header
 * the stack has set on both hooks (__netif_receive_skb_core on ingress, the IP output path on
 * egress), whatever the device's link layer. */
static __always_inline int load_net(struct __sk_buff *skb, __u32 off, void *to, __u32 len)
{
	return bpf_skb_load_bytes_relative(skb, off, to, len, BPF_HDR_START_NET);
}

static __always_inline void stat_inc(__u32 slot)
{
	__u64 *v = bpf_map_lookup_elem(&lm_stats, &slot);

	if (v)
		*v += 1; /* per-CPU slot: no other CPU writes it */
}

/* Global kill-switch for this job: KILL_JOBS hits every registered job; KILL_LENT (now) or
 * ARMED with a passed deadline hits jobs flagged LM_JOB_LENT. */
static __always_inline bool global_kills(const struct lm_job *job, __u64 now)
{
	__u32 zero = 0;
	struct lm_global *g = bpf_map_lookup_elem(&lm_global, &zero);
	__u32 flags;

	if (!g)
		return false;
	flags = g->flags;
	if (flags & LM_GLOBAL_KILL_JOBS)
		return true;
	if (!(job->flags & LM_JOB_LENT))
		return false;
	if (flags & LM_GLOBAL_KILL_LENT)
		return true;
	return (flags & LM_GLOBAL_ARMED) && now >= g->kill_at_ns;
}

static __always_inline bool job_kills(const struct lm_job *job, __u64 now)
{
	__u32 flags = job->flags;

	if (flags & LM_JOB_KILL)
		return true;
	return (flags & LM_JOB_ARMED) && now >= job->kill_at_ns;
}

static __always_inline struct lm_counters *job_counters(__u64 cgid)
{
	struct lm_counters *c = bpf_map_lookup_elem(&lm_job_stats, &cgid);

	if (c)
		return c;
	/* First packet of the job: create its row. NOEXIST so a racing CPU's row (and its
	 * counts) is kept; either way the second lookup finds the one row. */
	struct lm_counters zero = {};

	bpf_map_update_elem(&lm_job_stats, &cgid, &zero, BPF_NOEXIST);
	return bpf_map_lookup_elem(&lm_job_stats, &cgid);
}

/* parse_tuple's answers other than a family (4 or 6). */
#define PKT_NONE       (-1) /* no TCP/UDP ports to match: passes on (other protocols, ESP, ...) */
#define PKT_LONG_CHAIN (-2) /* IPv6 extension header chain longer than LM_IPV6_MAX_EXT: dropped */
#define PKT_LATER_FRAG (-3) /* a fragment at offset > 0 (no ports): dropped when lm_frags has it */

/* What parse_tuple says of fragmentation (*frag), with the datagram's lm_frags key when it is one. */
#define FRAG_NONE  0
#define FRAG_FIRST 1 /* offset 0, more to come: remembered in lm_frags when dropped */

/* IPv6 extension headers (RFC 8200) that may stand between the IPv6 header and TCP/UDP: the
 * ones the kernel's own input path walks (ipv6_ext_hdr()). ESP hides the ports; anything else
 * is not TCP/UDP. */
#define NEXTHDR_HOP      0
#define NEXTHDR_ROUTING  43
#define NEXTHDR_FRAGMENT 44
#define NEXTHDR_AUTH     51
#define NEXTHDR_DEST     60
#define IP6_OFFSET       0xfff8 /* fragment offset bits of the fragment header's frag_off */

/* How many extension headers parse_tuple walks. A packet that follows RFC 8200 4.1 carries each
 * at most once (destination options twice), so at most 6 precede TCP/UDP: hop-by-hop, destination
 * options, routing, fragment, AH, destination options. A longer chain is one no sender needs and
 * one netguard cannot see the ports behind, so it could carry a cut flow's or cut job's traffic
 * past the switches: it is dropped (counted in LM_STAT_DROP_EXTHDR). */
#define LM_IPV6_MAX_EXT 8

/* The IPv6 part of parse_tuple: walks the extension header chain (bounded) to TCP/UDP. */
static __always_inline int parse_ipv6(struct __sk_buff *skb, struct lm_flow_key *k,
				      struct lm_frag_key *fr, int *frag)
{
	struct ipv6hdr ip6;
	__u32 off = sizeof(ip6);
	__u16 ports[2];
	__u8 nh;
	int i;

	if (load_net(skb, 0, &ip6, sizeof(ip6)) < 0)
		return PKT_NONE;
	nh = ip6.nexthdr;
	for (i = 0; i < LM_IPV6_MAX_EXT; i++) {
		/* The first 8 bytes of any of these headers: next header, length, and for a
		 * fragment header its offset and flags. */
		struct {
			__u8 nexthdr;
			__u8 len;
			__be16 frag_off;
			__be32 id;
		} h;

		if (nh == IPPROTO_TCP || nh == IPPROTO_UDP)
			break;
		if (nh != NEXTHDR_HOP && nh != NEXTHDR_ROUTING && nh != NEXTHDR_DEST &&
		    nh != NEXTHDR_AUTH && nh != NEXTHDR_FRAGMENT)
			return PKT_NONE;
		if (load_net(skb, off, &h, sizeof(h)) < 0)
			return PKT_NONE;
		if (nh == NEXTHDR_FRAGMENT) {
			/* A later fragment carries no ports (as IPv4's); the first (offset 0) has the
			 * whole header chain and the TCP/UDP header (RFC 7112) and is matched by them. */
			__builtin_memcpy(fr->saddr, &ip6.saddr, sizeof(fr->saddr));
			__builtin_memcpy(fr->daddr, &ip6.daddr, sizeof(fr->daddr));
			fr->id = bpf_ntohl(h.id);
			if (h.frag_off & bpf_htons(IP6_OFFSET))
				return PKT_LATER_FRAG;
			if (h.frag_off & bpf_htons(1)) /* M: more fragments */
				*frag = FRAG_FIRST;
			off += 8;
		} else if (nh == NEXTHDR_AUTH) {
			off += ((__u32)h.len + 2) * 4; /* AH counts 4-byte words, less 2 */
		} else {
			off += ((__u32)h.len + 1) * 8; /* 8-byte units, less the first */
		}
		nh = h.nexthdr;
	}
	if (nh != IPPROTO_TCP && nh != IPPROTO_UDP)
		return PKT_LONG_CHAIN;
	if (load_net(skb, off, ports, sizeof(ports)) < 0)
		return PKT_NONE;
	__builtin_memcpy(k->saddr, &ip6.saddr, sizeof(k->saddr));
	__builtin_memcpy(k->daddr, &ip6.daddr, sizeof(k->daddr));
	k->proto = nh;
	k->sport = ports[0];
	k->dport = ports[1];
	return 6;
}

/* The TCP/UDP 5-tuple of the packet as it is on the wire (network byte order), IPv4 stored
 * v4-mapped (bpf/laminar.h). Returns 4 or 6 (the family) when there is one; IPv6 TCP/UDP is
 * found behind its extension headers (parse_ipv6). Other protocols have none: PKT_NONE; an IPv6
 * chain too long to walk: PKT_LONG_CHAIN; a later fragment: PKT_LATER_FRAG. For a fragment,
 * `fr` (zeroed by the caller) is its datagram's lm_frags key, and a first fragment sets *frag
 * to FRAG_FIRST. Plain packets never touch `fr`. */
static __always_inline int parse_tuple(struct __sk_buff *skb, struct lm_flow_key *k,
				       struct lm_frag_key *fr, int *frag)
{
	__u16 ports[2];
	__u32 l4;

	/* Offsets from the network header (load_net): Ethernet and L3 devices alike. */
	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		struct iphdr ip;

		if (load_net(skb, 0, &ip, sizeof(ip)) < 0)
			return PKT_NONE;
		if (ip.version != 4 || ip.ihl < 5)
			return PKT_NONE;
		if (ip.protocol != IPPROTO_TCP && ip.protocol != IPPROTO_UDP)
			return PKT_NONE;
		if (ip.frag_off & bpf_htons(IP_OFFSET | IP_MF)) {
			fr->saddr[2] = bpf_htonl(0xffff);
			fr->saddr[3] = ip.saddr;
			fr->daddr[2] = bpf_htonl(0xffff);
			fr->daddr[3] = ip.daddr;
			fr->id = bpf_ntohs(ip.id);
			fr->proto = ip.protocol;
			if (ip.frag_off & bpf_htons(IP_OFFSET))
				return PKT_LATER_FRAG; /* a later fragment carries no ports */
			*frag = FRAG_FIRST;
		}
		l4 = ip.ihl * 4;
		if (load_net(skb, l4, ports, sizeof(ports)) < 0)
			return PKT_NONE;
		k->saddr[2] = bpf_htonl(0xffff);
		k->saddr[3] = ip.saddr;
		k->daddr[2] = bpf_htonl(0xffff);
		k->daddr[3] = ip.daddr;
		k->proto = ip.protocol;
		k->sport = ports[0];
		k->dport = ports[1];
		return 4;
	}
	if (skb->protocol == bpf_htons(ETH_P_IPV6))
		return parse_ipv6(skb, k, fr, frag);
	return PKT_NONE;
}

/* Migration-flow switch and class for the flow `k` (egress orientation).
 * Returns true when the packet must be dropped. */
static __always_inline bool flow_verdict(struct __sk_buff *skb, const struct lm_flow_key *k,
					 __u64 now, bool egress)
{
	struct lm_flow *f = bpf_map_lookup_elem(&lm_flows, k);
	__u32 flags;

	if (!f)
		return false;
	flags = f->flags;
	if ((flags & LM_FLOW_KILL) || ((flags & LM_FLOW_ARMED) && now >= f->kill_at_ns)) {
		stat_inc(LM_STAT_DROP_FLOW);
		return true;
	}
	if (egress && f->priority) {
		/* HTB maps a priority equal to a leaf's handle (major:minor) straight to it. */
		skb->priority = f->priority;
		stat_inc(LM_STAT_SHAPED);
	}
	__sync_fetch_and_add(&f->packets, 1);
	__sync_fetch_and_add(&f->bytes, skb->len);
	return false;
}

/* Applies the job's switches and counts. Returns true when the packet must be dropped. */
static __always_inline bool job_verdict(struct __sk_buff *skb, __u64 cgid, __u64 now, bool egress,
					bool flow_drop)
{
	struct lm_job *job;
	struct lm_counters *c;
	bool drop = flow_drop;

	if (!cgid)
		return drop;
	job = bpf_map_lookup_elem(&lm_jobs, &cgid);
	if (!job)
		return drop;
	if (job_kills(job, now)) {
		stat_inc(LM_STAT_DROP_JOB);
		drop = true;
	} else if (global_kills(job, now)) {
		stat_inc(LM_STAT_DROP_GLOBAL);
		drop = true;
	}
	c = job_counters(cgid);
	if (!c)
		return drop;
	if (drop) {
		__sync_fetch_and_add(&c->drop_packets, 1);
		__sync_fetch_and_add(&c->drop_bytes, skb->len);
	} else if (egress) {
		__sync_fetch_and_add(&c->tx_packets, 1);
		__sync_fetch_and_add(&c->tx_bytes, skb->len);
	} else {
		__sync_fetch_and_add(&c->rx_packets, 1);
		__sync_fetch_and_add(&c->rx_bytes, skb->len);
	}
	return drop;
}

/* The verdict of what parse_tuple did not match to a flow: a chain too long to walk is dropped,
 * and so is a later fragment of a datagram whose first fragment was dropped. */
static __always_inline bool unmatched_drops(int family, const struct lm_frag_key *fr, __u64 now)
{
	if (family == PKT_LONG_CHAIN) {
		stat_inc(LM_STAT_DROP_EXTHDR);
		return true;
	}
	if (family == PKT_LATER_FRAG) {
		__u64 *at = bpf_map_lookup_elem(&lm_frags, fr);

		if (at && now - *at < LM_FRAG_TTL_NS) {
			stat_inc(LM_STAT_DROP_FRAG);
			return true;
		}
	}
	return false;
}

/* The packet is dropped: when it is a first fragment, remember its datagram so that the later
 * fragments (no ports to match) are dropped too. */
static __always_inline void dropped(int frag, const struct lm_frag_key *fr, __u64 now)
{
	if (frag == FRAG_FIRST)
		bpf_map_update_elem(&lm_frags, fr, &now, BPF_ANY);
}

SEC("tc")
int lm_egress(struct __sk_buff *skb)
{
	struct lm_flow_key k = {};
	__u64 now = bpf_ktime_get_ns(); /* CLOCK_MONOTONIC, the clock of every kill_at_ns */
	struct lm_frag_key fr = {};
	bool drop;
	int frag = FRAG_NONE;
	int family = parse_tuple(skb, &k, &fr, &frag);

	if (family > 0)
		drop = flow_verdict(skb, &k, now, true);
	else
		drop = unmatched_drops(family, &fr, now);
	/* 0 when the packet has no local socket (forwarded traffic): no job. */
	drop = job_verdict(skb, bpf_skb_cgroup_id(skb), now, true, drop);
	if (drop) {
		dropped(frag, &fr, now);
		return TC_ACT_SHOT;
	}
	stat_inc(LM_STAT_PASS);
	return TC_ACT_OK;
}

/* The cgroup2 id of the local socket for tuple `t` (tuple_len: its ipv4 or ipv6 part), 0 when
 * none. At clsact ingress the stack has not demuxed the packet yet (skb->sk is unset), so look
 * the socket up the way the stack will. The helpers take the tuple as it is in the packet
 * (source = remote peer, destination = us). BPF_F_CURRENT_NETNS: the netns of skb->dev. */
static __always_inline __u64 sock_cgroup_id(struct __sk_buff *skb, struct bpf_sock_tuple *t, __u32 tuple_len,
					    __u8 proto)
{
	struct bpf_sock *sk;
	__u64 cgid;

	if (proto == IPPROTO_TCP)
		sk = bpf_sk_lookup_tcp(skb, t, tuple_len, BPF_F_CURRENT_NETNS, 0);
	else
		sk = bpf_sk_lookup_udp(skb, t, tuple_len, BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return 0;
	/* The lookup returns a full socket (the listener for a request sock), which carries the
	 * cgroup2 cgroup it was created in: sk->sk_cgrp_data.cgroup, whose kernfs id is what
	 * bpf_skb_cgroup_id() gives on egress. The reference must be dropped on every path. */
	struct sock *s = bpf_rdonly_cast(sk, bpf_core_type_id_kernel(struct sock));

	cgid = BPF_CORE_READ(s, sk_cgrp_data.cgroup, kn, id);
	bpf_sk_release(sk);
	return cgid;
}

/* The cgroup2 id of the local socket an ingress packet (its tuple `k` as on the wire, family
 * `family` from parse_tuple) is for, 0 when none. */
static __always_inline __u64 ingress_cgroup_id(struct __sk_buff *skb, const struct lm_flow_key *k, int family)
{
	struct bpf_sock_tuple t = {};

	if (family == 4) {
		t.ipv4.saddr = k->saddr[3];
		t.ipv4.daddr = k->daddr[3];
		t.ipv4.sport = k->sport;
		t.ipv4.dport = k->dport;
		return sock_cgroup_id(skb, &t, sizeof(t.ipv4), k->proto);
	}
	__builtin_memcpy(t.ipv6.saddr, k->saddr, sizeof(t.ipv6.saddr));
	__builtin_memcpy(t.ipv6.daddr, k->daddr, sizeof(t.ipv6.daddr));
	t.ipv6.sport = k->sport;
	t.ipv6.dport = k->dport;
	return sock_cgroup_id(skb, &t, sizeof(t.ipv6), k->proto);
}

SEC("tc")
int lm_ingress(struct __sk_buff *skb)
{
	struct lm_flow_key k = {}, fk = {};
	__u64 now = bpf_ktime_get_ns();
	__u64 cgid = 0;
	struct lm_frag_key fr = {};
	bool drop = false;
	int frag = FRAG_NONE;
	int family = parse_tuple(skb, &k, &fr, &frag);

	if (family > 0) {
		/* lm_flows is keyed in egress orientation (local -> remote): swap. */
		__builtin_memcpy(fk.saddr, k.daddr, sizeof(fk.saddr));
		__builtin_memcpy(fk.daddr, k.saddr, sizeof(fk.daddr));
		fk.sport = k.dport;
		fk.dport = k.sport;
		fk.proto = k.proto;
		drop = flow_verdict(skb, &fk, now, false);
		cgid = ingress_cgroup_id(skb, &k, family);
	} else {
		drop = unmatched_drops(family, &fr, now);
	}
	drop = job_verdict(skb, cgid, now, false, drop);
	if (drop) {
		dropped(frag, &fr, now);
		return TC_ACT_SHOT;
	}
	stat_inc(LM_STAT_PASS);
	return TC_ACT_OK;
}
