"""Airlock's policy document: thresholds, rung budgets, class weights, hysteresis.

The operator sets it with ``laminarctl policy set FILE`` (JSON or TOML); the agent validates
the *whole* document and refuses it with every problem listed when anything is wrong, keeping
the old one (``policy: threshold 1.7 out of range 0..1 for memory.some``). Accepted documents
are stored versioned in SQLite (table ``airlock_policy``); ``laminarctl policy show`` prints the
one in force with its version. A partial document is merged over the defaults, so
``{"thresholds": {"memory.some": 0.2}}`` is a valid policy.

The defaults, with the reasons for their values::

    {
      "thresholds": {            # fractions 0..1
        "memory.some": 0.10,     # PSI some avg10 of the jobs' subtree: >= 10% stalled -> high
        "memory.full": 0.05,     # PSI full avg10: >= 5% of time nothing ran -> critical
        "usage.high": 0.85,      # share of the node's job budget in use -> high
        "usage.critical": 0.95   # -> critical: the allocator is about to wait at the limit
      },
      "hysteresis": {
        "recover_below": 0.75,   # thaw only once usage is below this share of the budget ...
        "hold_s": 2.0,           # ... and no pressure signal came for this long (PSI lags ~2 s)
        "step_s": 1.0            # one job thawed per step, so recovery cannot re-create the storm
      },
      "rungs": {                 # time budget of each rung before the ladder escalates
        "suspend":   {"budget_s": 5.0},
        "readdress": {"budget_s": 30.0, "max_hops": 2},
        "kill":      {"budget_s": 0.0}     # (``reclaim``, its old name, is read as ``kill``)
      },
      "class_weights": {"long-resident": 100.0, "standard": 10.0, "transient": 1.0},
      "protected": ["long-resident"],   # classes the ladder never acts on
      "readdress": true,                # try re-addressing before killing (needs a checkpoint)
      "work_weight_per_hour": 1.0,      # survival value grows with work at risk ...
      "memory_weight_per_gib": 0.5,     # ... and falls with the memory a job would free
      "class_caps_mb": {},              # admission caps per class (airlock.admission), e.g.
                                        # {transient = 2048}; with [airlock] class_budget_mb the
                                        # smaller holds. Raising one starts queued jobs at once
      "job_default_mb": {}              # memory limit of a job submitted without one, per class
    }
"""

from __future__ import annotations

import copy
import json
import time
import tomllib
from dataclasses import dataclass
from typing import Any

CLASSES = ("long-resident", "standard", "transient")

DEFAULT: dict[str, Any] = {
    "thresholds": {"memory.some": 0.10, "memory.full": 0.05, "usage.high": 0.85, "usage.critical": 0.95},
    "hysteresis": {"recover_below": 0.75, "hold_s": 2.0, "step_s": 1.0},
    "rungs": {"suspend": {"budget_s": 5.0}, "readdress": {"budget_s": 30.0, "max_hops": 2},
              "kill": {"budget_s": 0.0}},
    "class_weights": {"long-resident": 100.0, "standard": 10.0, "transient": 1.0},
    "protected": ["long-resident"],
    "readdress": True,
    "work_weight_per_hour": 1.0,
    "memory_weight_per_gib": 0.5,
    "class_caps_mb": {},
    "job_default_mb": {},
}

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS airlock_policy (
        version INTEGER PRIMARY KEY,
        ts REAL NOT NULL,
        uid INTEGER,
        doc TEXT NOT NULL)""",
]


# A policy given as text (``POST /v1/policy/validate`` with {"text": ...}): real documents are
# under 4 KiB. CPython's TOML parser is quadratic in dotted keys (3.7 s for 32 KB, an hour for
# the API's 1 MiB body) and recursive (nested arrays: RecursionError), so text that is not JSON
# is parsed in a child process (`parse_bounded`) killed after POLICY_PARSE_S, never on the loop.
POLICY_TEXT_MAX = 64 << 10
POLICY_PARSE_S = 2.0
# An invalid policy lists at most this many problems (a document of 100,000 unknown keys was a
# multi-megabyte answer), then how many more there were.
PROBLEMS_SHOWN = 20


class PolicyError(ValueError):
    """An invalid policy; `problems` lists every one (the first PROBLEMS_SHOWN, then how many
    more), each naming the key and the value."""

    def __init__(self, problems: list[str], reason: str = "policy_invalid") -> None:
        self.reason = reason  # counted in api.refused_by_reason
        if len(problems) > PROBLEMS_SHOWN:
            problems = [*problems[:PROBLEMS_SHOWN], f"policy: ... and {len(problems) - PROBLEMS_SHOWN} more problems"]
        super().__init__("\n".join(problems))
        self.problems = problems


MIB_MAX = 1 << 30  # 1 PiB in MiB: anything larger is a typo


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# Rungs' old names, read as the new ones for one release (a policy file or a stored document
# written before the rename): Airlock's last rung was called ``reclaim``, a word now kept for an
# owner taking a node back with notice.
OLD_RUNG_NAMES = {"reclaim": "kill"}


def _new_rung_names(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with its rungs' old names (OLD_RUNG_NAMES) replaced; a document that gives a rung
    under both names is refused (PolicyError) rather than one silently winning."""
    rungs = doc.get("rungs")
    if not isinstance(rungs, dict) or not any(k in rungs for k in OLD_RUNG_NAMES):
        return doc
    new = dict(rungs)
    for old, name in OLD_RUNG_NAMES.items():
        if old in new:
            if name in new:
                raise PolicyError([f"policy: rungs.{old} is the old name of rungs.{name}; give one of them"])
            new[name] = new.pop(old)
    return {**doc, "rungs": new}


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: tables merge key by key, everything else replaces."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def validate(doc: Any, config_caps_mb: dict[str, int] | None = None) -> dict[str, Any]:
    """The effective policy (defaults merged under `doc`), or PolicyError listing every problem.

    `config_caps_mb` are the class caps the agent's config sets (``[airlock] class_budget_mb``):
    a ``job_default_mb`` above one of them is refused like one above the policy's own cap. (A
    stored policy is read back without them: a config lowered later must not stop the agent.)"""
    if not isinstance(doc, dict):
        raise PolicyError([f"policy: expected a JSON object / TOML table, got {type(doc).__name__}"])
    problems: list[str] = []
    unknown = sorted(set(doc) - set(DEFAULT))
    for k in unknown[:PROBLEMS_SHOWN + 1]:
        problems.append(f"policy: unknown key {_brief(k)}; allowed: {', '.join(sorted(DEFAULT))}")
    problems += [""] * max(0, len(unknown) - PROBLEMS_SHOWN - 1)  # counted, not formatted
    for section in ("thresholds", "hysteresis", "rungs", "class_weights", "class_caps_mb", "job_default_mb"):
        if section in doc and not isinstance(doc[section], dict):
            problems.append(f"policy: {section} must be a table, got {doc[section]!r}")
    if problems:
        raise PolicyError(problems)
    doc = _new_rung_names(doc)
    try:
        p = merge(DEFAULT, doc)
    except RecursionError:
        raise PolicyError(["policy: nested too deeply (a policy is tables of one or two levels)"]) from None

    for key, v in p["thresholds"].items():
        if key not in DEFAULT["thresholds"]:
            problems.append(f"policy: unknown threshold {key!r}; allowed: {', '.join(DEFAULT['thresholds'])}")
        elif not _num(v) or not 0 <= v <= 1:
            problems.append(f"policy: threshold {v!r} out of range 0..1 for {key}")
    t = p["thresholds"]
    if all(_num(t.get(k)) for k in ("usage.high", "usage.critical")) and t["usage.high"] > t["usage.critical"]:
        problems.append(f"policy: usage.high {t['usage.high']} must not exceed usage.critical {t['usage.critical']}")

    h = p["hysteresis"]
    for key, v in h.items():
        if key not in DEFAULT["hysteresis"]:
            problems.append(f"policy: unknown hysteresis key {key!r}; allowed: {', '.join(DEFAULT['hysteresis'])}")
        elif key == "recover_below":
            if not _num(v) or not 0 < v <= 1:
                problems.append(f"policy: hysteresis.recover_below {v!r} out of range 0..1 (share of the budget)")
        elif not _num(v) or not 0 <= v <= 3600:
            problems.append(f"policy: hysteresis.{key} {v!r} out of range 0..3600 seconds")
    if _num(h.get("recover_below")) and _num(t.get("usage.high")) and h["recover_below"] >= t["usage.high"]:
        problems.append(f"policy: hysteresis.recover_below {h['recover_below']} must be below usage.high "
                        f"{t['usage.high']}, or recovery and suspension would flap")

    for rung, body in p["rungs"].items():
        if rung not in DEFAULT["rungs"]:
            problems.append(f"policy: unknown rung {rung!r}; allowed: {', '.join(DEFAULT['rungs'])}")
            continue
        if not isinstance(body, dict):
            problems.append(f"policy: rungs.{rung} must be a table, got {body!r}")
            continue
        for key, v in body.items():
            if key not in DEFAULT["rungs"][rung]:
                problems.append(f"policy: unknown key rungs.{rung}.{key}; allowed: {', '.join(DEFAULT['rungs'][rung])}")
            elif key == "budget_s" and (not _num(v) or not 0 <= v <= 3600):
                problems.append(f"policy: rungs.{rung}.budget_s {v!r} out of range 0..3600 seconds")
            elif key == "max_hops" and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 16):
                problems.append(f"policy: rungs.{rung}.max_hops {v!r} out of range 0..16")

    for cls, w in p["class_weights"].items():
        if cls not in CLASSES:
            problems.append(f"policy: unknown class {cls!r} in class_weights; allowed: {', '.join(CLASSES)}")
        elif not _num(w) or not 0 < w <= 1e6:
            problems.append(f"policy: class weight {w!r} out of range (0, 1e6] for {cls}")
    prot = p["protected"]
    if not isinstance(prot, list) or any(c not in CLASSES for c in prot):
        problems.append(f"policy: protected {prot!r}: expected a list of classes from {', '.join(CLASSES)}")
    if not isinstance(p["readdress"], bool):
        problems.append(f"policy: readdress {p['readdress']!r}: expected true or false")
    for key in ("work_weight_per_hour", "memory_weight_per_gib"):
        if not _num(p[key]) or not 0 <= p[key] <= 1e6:
            problems.append(f"policy: {key} {p[key]!r} out of range 0..1e6")
    for key in ("class_caps_mb", "job_default_mb"):
        for cls, mb in p[key].items():
            if cls not in CLASSES:
                problems.append(f"policy: unknown class {cls!r} in {key}; allowed: {', '.join(CLASSES)}")
            elif isinstance(mb, bool) or not isinstance(mb, int) or not 1 <= mb <= MIB_MAX:
                problems.append(f"policy: {key}.{cls} {mb!r}: expected MiB as an integer 1..{MIB_MAX}")
    for cls, mb in p["job_default_mb"].items():
        cap = p["class_caps_mb"].get(cls)
        conf = (config_caps_mb or {}).get(cls)
        if _int(mb) and _int(cap) and mb > cap:
            problems.append(f"policy: job_default_mb.{cls} {mb} exceeds class_caps_mb.{cls} {cap}: "
                            "a job given that default could never start")
        elif _int(mb) and _int(conf) and mb > conf:
            problems.append(f"policy: job_default_mb.{cls} {mb} exceeds the {cls} class's cap of {conf} MiB "
                            f"([airlock] class_budget_mb in the agent's config): a job given that default could "
                            f"never start; set it to at most {conf}")
    if problems:
        raise PolicyError(problems)
    return p


def _brief(v: Any) -> str:
    from laminar.inputs import brief

    return brief(v)


# The child that parses policy text (`parse_bounded`): JSON, else TOML, printed back as JSON;
# its address space and CPU time are limited before it reads a byte.
_PARSE_CHILD = """
import json, os, resource, sys, tomllib
os.setpriority(os.PRIO_PROCESS, 0, 19)  # a user's parse, not the agent's work: not at its Nice=-10
resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))
resource.setrlimit(resource.RLIMIT_CPU, (5, 5))
text = sys.stdin.buffer.read().decode("utf-8", errors="replace")
try:
    try:
        doc = json.loads(text)
    except ValueError:
        doc = tomllib.loads(text)
    out = {"doc": doc}
except tomllib.TOMLDecodeError as e:
    out = {"error": f"policy: neither valid JSON nor valid TOML: {e}"}
except (RecursionError, MemoryError):
    out = {"error": "policy: nested too deeply or too large (a policy is tables of one or two levels)"}
try:
    data = json.dumps(out)
except (RecursionError, ValueError):
    data = json.dumps({"error": "policy: nested too deeply (a policy is tables of one or two levels)"})
sys.stdout.write(data)
"""


async def parse_bounded(text: str) -> Any:
    """:func:`parse` for text a caller sent, bounded: at most POLICY_TEXT_MAX characters; JSON
    is read here (linear), anything else in a child process (``python -I -S``, 512 MiB, killed
    after POLICY_PARSE_S). Raises PolicyError naming what was wrong."""
    import asyncio
    import subprocess
    import sys

    if len(text) > POLICY_TEXT_MAX:
        raise PolicyError([f"policy: {len(text)} characters of text, at most {POLICY_TEXT_MAX} (a policy is a few "
                           "KiB: docs/policy.md)"], "policy_too_large")
    try:
        return json.loads(text)
    except RecursionError:
        raise PolicyError(["policy: nested too deeply (a policy is tables of one or two levels)"]) from None
    except ValueError:
        pass
    proc = await asyncio.create_subprocess_exec(sys.executable, "-I", "-S", "-c", _PARSE_CHILD,
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(text.encode("utf-8", "surrogatepass")), POLICY_PARSE_S)
    except TimeoutError:
        raise PolicyError([f"policy: the text took longer than {POLICY_PARSE_S:g} s to parse (TOML's dotted keys "
                           "cost the parser quadratic time); send it as JSON, or shorter"], "policy_parse_timeout") from None
    finally:
        if proc.returncode is None:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            await proc.wait()  # killed, never in uninterruptible sleep: it only reads a pipe
    try:
        res = json.loads(out) if len(out) <= 4 * POLICY_TEXT_MAX else {"error": "policy: too large once parsed"}
    except (ValueError, RecursionError):
        res = None
    if not isinstance(res, dict) or ("doc" not in res and "error" not in res):
        raise PolicyError(["policy: the text could not be parsed (the parser failed: out of memory or CPU time)"])
    if "error" in res:
        raise PolicyError([str(res["error"])[:2000]])
    return res["doc"]


def parse(text: str | bytes) -> Any:
    """A policy file's content: JSON, or TOML when it is not JSON. Raises PolicyError."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PolicyError([f"policy: neither valid JSON nor valid TOML: {e}"]) from None


@dataclass
class Policy:
    """A validated policy with its stored version (0 = the built-in default)."""

    doc: dict[str, Any]
    version: int = 0
    ts: float = 0.0

    def __getitem__(self, key: str) -> Any:
        return self.doc[key]

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "ts": self.ts, "policy": self.doc}


class PolicyStore:
    """Versioned policies in the agent's SQLite store. `current()` is the newest valid one."""

    def __init__(self, store: Any) -> None:
        self.store = store
        store.ensure_schema("airlock_policy", SCHEMA)

    def current(self) -> Policy:
        row = self.store.db.execute("SELECT version, ts, doc FROM airlock_policy ORDER BY version DESC LIMIT 1").fetchone()
        if row is None:
            return Policy(validate({}), 0, 0.0)
        return Policy(validate(json.loads(row[2])), int(row[0]), float(row[1]))

    def set(self, doc: Any, uid: int | None = None, config_caps_mb: dict[str, int] | None = None) -> Policy:
        """Validate whole (`validate`), then store as a new version. PolicyError leaves
        everything as it was."""
        effective = validate(doc, config_caps_mb)
        ts = time.time()
        with self.store.tx() as db:
            cur = db.execute("INSERT INTO airlock_policy(version, ts, uid, doc) VALUES("
                             "(SELECT COALESCE(MAX(version), 0) + 1 FROM airlock_policy), ?, ?, ?)",
                             (ts, uid, json.dumps(effective)))
            version = int(db.execute("SELECT version FROM airlock_policy WHERE rowid=?", (cur.lastrowid,)).fetchone()[0])
        return Policy(effective, version, ts)

    def history(self, limit: int = 20) -> list[dict[str, Any]]:
        rows = self.store.db.execute("SELECT version, ts, uid FROM airlock_policy ORDER BY version DESC LIMIT ?",
                                     (limit,)).fetchall()
        return [{"version": r[0], "ts": r[1], "uid": r[2]} for r in rows]
