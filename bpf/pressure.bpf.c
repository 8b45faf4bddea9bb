// SPDX-License-Identifier: GPL-2.0
/* pressure: memory-pressure signals for Airlock, pushed through the lm_events ring buffer.
 *
 * Reclaim stalls and OOM victims arrive within microseconds of the kernel deciding; a poll loop
 * over PSI or memory.events would see them after the fact. Every event carries
 * bpf_ktime_get_ns(), the cgroup2 id of the task concerned, its tgid and comm.
 *
 * tp_btf programs (BTF-typed raw tracepoints) rather than SEC("tracepoint/..."): they need no
 * tracefs mounted, cost less per event, and give mark_victim the victim's task_struct, whose
 * cgroup2 id we read directly (the OOM victim is rarely the task that is running).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "laminar.h"

char LICENSE[] SEC("license") = "GPL";

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, LM_RINGBUF_BYTES);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lm_events SEC(".maps");

/* Identical to netguard.bpf.c's lm_stats, so libbpf reuses one pinned map for both. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, LM_STAT_MAX);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lm_stats SEC(".maps");

static __always_inline void lost_event(void)
{
	__u32 slot = LM_STAT_EV_LOST;
	__u64 *v = bpf_map_lookup_elem(&lm_stats, &slot);

	if (v)
		*v += 1;
}

/* An event about the current task (reclaim runs in the allocating task's context). */
static __always_inline int emit_current(__u32 type, __u64 value)
{
	struct lm_pressure_event *e;

	/* A ring buffer map has no value type, so clang would emit no BTF for the event struct.
	 * This CO-RE relocation (a constant after loading; the branch is never taken) keeps it
	 * in the object's BTF, where tests/kernel/test_abi.py checks the Python mirror, without
	 * adding a .bss map. */
	if (bpf_core_type_id_local(struct lm_pressure_event) == 0)
		return 0;
	e = bpf_ringbuf_reserve(&lm_events, sizeof(*e), 0);
	if (!e) {
		lost_event();
		return 0;
	}
	e->ts_ns = bpf_ktime_get_ns();
	e->cgroup_id = bpf_get_current_cgroup_id(); /* cgroup2 (the default hierarchy) */
	e->value = value;
	e->type = type;
	e->pid = bpf_get_current_pid_tgid() >> 32;
	bpf_get_current_comm(e->comm, sizeof(e->comm));
	bpf_ringbuf_submit(e, 0);
	return 0;
}

SEC("tp_btf/mm_vmscan_direct_reclaim_begin")
int BPF_PROG(lm_direct_reclaim_begin, int order, gfp_t gfp_flags)
{
	return emit_current(LM_EV_DIRECT_RECLAIM_BEGIN, order);
}

SEC("tp_btf/mm_vmscan_direct_reclaim_end")
int BPF_PROG(lm_direct_reclaim_end, unsigned long nr_reclaimed)
{
	return emit_current(LM_EV_DIRECT_RECLAIM_END, nr_reclaimed);
}

SEC("tp_btf/mm_vmscan_memcg_reclaim_begin")
int BPF_PROG(lm_memcg_reclaim_begin, int order, gfp_t gfp_flags)
{
	return emit_current(LM_EV_MEMCG_RECLAIM_BEGIN, order);
}

SEC("tp_btf/mm_vmscan_memcg_reclaim_end")
int BPF_PROG(lm_memcg_reclaim_end, unsigned long nr_reclaimed)
{
	return emit_current(LM_EV_MEMCG_RECLAIM_END, nr_reclaimed);
}

/* The victim is an argument, not current: an OOM is often decided in another task's
 * allocation. Its cgroup2 id is task->cgroups->dfl_cgrp->kn->id, what
 * bpf_get_current_cgroup_id() would return in the victim's own context. */
SEC("tp_btf/mark_victim")
int BPF_PROG(lm_oom_victim, struct task_struct *task)
{
	struct lm_pressure_event *e = bpf_ringbuf_reserve(&lm_events, sizeof(*e), 0);

	if (!e) {
		lost_event();
		return 0;
	}
	e->ts_ns = bpf_ktime_get_ns();
	e->cgroup_id = BPF_CORE_READ(task, cgroups, dfl_cgrp, kn, id);
	e->value = 0;
	e->type = LM_EV_OOM_VICTIM;
	e->pid = BPF_CORE_READ(task, tgid);
	BPF_CORE_READ_STR_INTO(&e->comm, task, comm);
	bpf_ringbuf_submit(e, 0);
	return 0;
}
