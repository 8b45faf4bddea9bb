"""The schedulers Laminar works beside (pure): which one a job was adopted from, and its id there.

A job taken from a scheduler is *adopted* (docs/operations.md, *Adopted jobs*). Its scheduler is
one of :class:`Scheduler`; its id there is its *scheduler ref*:

* ``slurm``: the Slurm job id, digits only (``"1234"``; a step is not part of the ref: every
  task of one Slurm job on a node is one Laminar job);
* ``kubernetes``: ``"<namespace>/<pod name>"``, the namespace a DNS-1123 label and the pod's
  name a DNS-1123 subdomain, as the API server takes them.

:func:`check_ref` refuses anything else naming the value; :func:`ckpt_dir_name` gives the name of
the job's checkpoint directory under ``[adopt] ckpt_root`` (one per ref, so a requeued job finds
its checkpoints on whatever node runs it next).

    >>> check_ref(Scheduler.SLURM, "1234"), ckpt_dir_name(Scheduler.SLURM, "1234")
    ('1234', 'slurm-1234')
    >>> ckpt_dir_name("kubernetes", "team-a/train-0")
    'kubernetes-team-a_train-0'
"""

from __future__ import annotations

import enum
import hashlib
import re
from typing import Any


class Scheduler(enum.StrEnum):
    """A scheduler whose jobs the agent adopts."""

    SLURM = "slurm"
    KUBERNETES = "kubernetes"


SLURM_REF_RE = re.compile(r"[0-9]{1,10}")
# DNS-1123 label (a namespace: at most 63) and subdomain (a pod's name: at most 253)
_LABEL = r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"
NAMESPACE_RE = re.compile(_LABEL)
# (as Kubernetes checks a subdomain: its whole length bounded, not each label's)
_SUBLABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
POD_NAME_RE = re.compile(rf"{_SUBLABEL}(?:\.{_SUBLABEL})*")
POD_NAME_MAX = 253
KUBERNETES_REF_MAX = 63 + 1 + POD_NAME_MAX
NAME_MAX = 255  # a file name's bytes (the longest ref's name is longer: shortened with a digest)


def parse_scheduler(value: Any) -> Scheduler:
    """The :class:`Scheduler` named ``value``; ValueError naming it and what is right."""
    try:
        return Scheduler(value)
    except ValueError:
        raise ValueError(f"scheduler {str(value)[:40]!r}: expected one of "
                         f"{', '.join(s.value for s in Scheduler)}") from None


def check_ref(scheduler: Scheduler | str, ref: Any) -> str:
    """``ref`` when it is a well-formed ref of ``scheduler`` (the module docs); ValueError naming
    the value and what is right otherwise."""
    sched = parse_scheduler(scheduler)
    if sched is Scheduler.SLURM:
        if not isinstance(ref, str) or SLURM_REF_RE.fullmatch(ref) is None:
            raise ValueError(f"slurm ref {str(ref)[:40]!r}: expected the Slurm job id, 1 to 10 digits (e.g. "
                             "\"1234\"; the step is not part of it)")
        return ref
    if not isinstance(ref, str) or len(ref) > KUBERNETES_REF_MAX or ref.count("/") != 1:
        raise ValueError(f"kubernetes ref {str(ref)[:80]!r}: expected <namespace>/<pod name>")
    ns, pod = ref.split("/")
    if NAMESPACE_RE.fullmatch(ns) is None:
        raise ValueError(f"kubernetes ref {ref[:80]!r}: namespace {ns[:64]!r} is not a DNS-1123 label (lower-case "
                         "letters, digits and '-', at most 63, starting and ending with a letter or digit)")
    if len(pod) > POD_NAME_MAX or POD_NAME_RE.fullmatch(pod) is None:
        raise ValueError(f"kubernetes ref {ref[:80]!r}: pod name {pod[:64]!r} is not a DNS-1123 subdomain "
                         f"(lower-case letters, digits, '-' and '.', at most {POD_NAME_MAX})")
    return ref


def ckpt_dir_name(scheduler: Scheduler | str, ref: str) -> str:
    """The checkpoint directory's name of the job ``ref`` of ``scheduler`` (checked by
    :func:`check_ref`: ValueError otherwise): ``slurm-1234``, ``kubernetes-<namespace>_<pod>``
    (``_`` is in neither a namespace nor a pod's name, so two refs never share a name; ``/`` is
    not in a file's name); one longer than a file's name may be (NAME_MAX) keeps its head and
    ends in ``~`` and 16 hex digits of the ref's SHA-256."""
    sched = parse_scheduler(scheduler)
    check_ref(sched, ref)
    if sched is Scheduler.SLURM:
        return f"slurm-{ref}"
    ns, pod = ref.split("/")
    name = f"kubernetes-{ns}_{pod}"
    if len(name) > NAME_MAX:  # a long pod name: its head and a digest of the whole ref
        name = f"{name[:NAME_MAX - 17]}~{hashlib.sha256(ref.encode()).hexdigest()[:16]}"
    return name


def label(scheduler: Scheduler | str | None, ref: str | None) -> str:
    """``slurm:1234`` (what ``laminarctl jobs`` shows), ``-`` for a job of no scheduler."""
    return f"{scheduler}:{ref}" if scheduler and ref else "-"
