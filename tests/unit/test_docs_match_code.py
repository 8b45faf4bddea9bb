"""docs/ tell the truth: mechanical checks of what the docs cite against the code.

- every ``tests/...`` path (and bare ``test_*.py`` name) cited in docs/*.md and README.md exists;
- every config key of ``laminard --print-defaults`` is documented in docs/operations.md or in its
  section's page (the table "Components add their own sections" names it), and each default in
  operations.md's configuration table is the code's;
- operations.md's table "laminarctl commands and the control API" lists every route the agent
  registers (``Route(...)`` in agent/laminar) with its privilege, no route that does not exist,
  and every laminarctl command with each of its options;
- docs/bpf-maps.md states the map ABI of bpf/laminar.h: the ABI version, map sizes, flag values
  and each struct's fields in order;
- docs/policy.md's table names every key of the Airlock policy;
- every laminarctl invocation the docs and README show (backticked, or a line of a code block)
  names a real command and only options it has;
- every event phase the docs name (phase `x`) is a string the agent's code has.

Each check reads files only (no agent, no privileges) and names what is missing or wrong.
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md"))
OPS = REPO / "docs" / "operations.md"


def _text(p: Path) -> str:
    return p.read_text(encoding="utf-8")


# ---------------------------------------------------------------- cited tests


def cited_test_paths(text: str) -> set[str]:
    """``tests/...py`` paths (with an optional ``::name``) and bare ``test_*.py`` names in ``text``."""
    paths = set(re.findall(r"\btests/[A-Za-z0-9_/.-]+?\.py(?:::[A-Za-z0-9_]+)?", text))
    bare = set(re.findall(r"(?<![/\w])(test_[A-Za-z0-9_]+\.py)\b", text))
    return paths | bare


def missing_tests(text: str, root: Path = REPO) -> list[str]:
    """The cited test paths of ``text`` that do not exist under ``root`` (a ``::name`` must be
    defined in its file; a bare name must exist in some tests/ directory)."""
    out = []
    for cite in sorted(cited_test_paths(text)):
        path, _, name = cite.partition("::")
        if "/" not in path:
            if not list((root / "tests").glob(f"*/{path}")) and not (root / "tests" / path).exists():
                out.append(cite)
            continue
        f = root / path
        if not f.is_file():
            out.append(cite)
        elif name and not re.search(rf"^\s*(async\s+)?def {re.escape(name)}\b|^class {re.escape(name)}\b",
                                     _text(f), re.M):
            out.append(cite)
    return out


@pytest.mark.parametrize("doc", DOCS + [REPO / "README.md"], ids=lambda p: p.name)
def test_every_test_a_doc_cites_exists(doc: Path) -> None:
    assert missing_tests(_text(doc)) == [], f"{doc.name} cites tests that do not exist (renamed or merged?)"


def test_a_renamed_test_is_caught(tmp_path: Path) -> None:
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_real.py").write_text("def test_one():\n    pass\n")
    text = ("see tests/unit/test_real.py, tests/unit/test_real.py::test_one, test_real.py, and "
            "tests/cluster/test_replica_release_retry.py, tests/unit/test_real.py::test_two, test_gone.py.")
    assert missing_tests(text, tmp_path) == ["test_gone.py", "tests/cluster/test_replica_release_retry.py",
                                             "tests/unit/test_real.py::test_two"]


# ---------------------------------------------------------------- config keys


def _schema() -> dict[str, dict[str, object]]:
    from laminar import config
    from laminar.agent import import_components

    import_components()  # components register their sections on import
    return {s: {k: f.default for k, f in fields.items()} for s, fields in config.SCHEMA.items()}


def section_pages(ops: str) -> dict[str, list[str]]:
    """operations.md's "Components add their own sections" rows: section -> its pages."""
    out: dict[str, list[str]] = {}
    for m in re.finditer(r"^\| `\[(\w+)\]` \| [^|]* \| ([^|]*) \|$", ops, re.M):
        out[m.group(1)] = [p.strip() for p in m.group(2).split(",") if p.strip().endswith(".md")]
    return out


def toml_block_keys(text: str) -> set[tuple[str, str]]:
    """(section, key) of each ``key = ...`` line of a config example in ``text`` (a fenced or an
    indented block), under the ``[section]`` header above it; prose ends a section."""
    out = set()
    section = ""
    for line in text.splitlines():
        if m := re.match(r"\s*(?:```\w*\s*)?\[\[?([\w.]+)\]?\]\s*(#.*)?$", line):
            section = m.group(1)
        elif m := re.match(r"\s*(\w+)\s*=", line):
            if section:
                out.add((section, m.group(1)))
        elif re.match(r"[^\s#`]", line):
            section = ""
    return out


def documented(section: str, key: str, text: str, qualified: bool = False) -> bool:
    """Whether ``text`` names ``section.key``: as section.key, ``[section] key``, a table row
    ``| section | key |`` or a ``key = ...`` line under ``[section]`` in a code block; unless
    ``qualified`` (a key name more than one section has), also as a bare `key`."""
    k, s = re.escape(key), re.escape(section)
    pats = [rf"\b{s}\.{k}\b", rf"\[{s}\]`? `?{k}\b", rf"^\| {s} \| {k} \|"]
    if not qualified:
        pats += [rf"`{k}`", rf"`{k}\s*="]
    return any(re.search(p, text, re.M) for p in pats) or (section, key) in toml_block_keys(text)


def undocumented_keys(schema: dict[str, dict[str, object]], docs_dir: Path) -> list[str]:
    """``section.key`` of the keys of ``schema`` that neither operations.md nor the section's
    pages name; a key name two sections share must be named with its section."""
    ops = _text(docs_dir / "operations.md")
    pages = section_pages(ops)
    names = [k for keys in schema.values() for k in keys]
    out = []
    for section, keys in schema.items():
        text = "\n".join([ops] + [_text(docs_dir / p) for p in pages.get(section, []) if (docs_dir / p).exists()])
        out += [f"{section}.{k}" for k in keys if not documented(section, k, text, names.count(k) > 1)]
    return out


def test_every_config_key_is_documented() -> None:
    schema = _schema()
    pages = section_pages(_text(OPS))
    assert {"airlock", "shaping", "zone", "migrate", "loan"} <= set(pages), pages
    assert undocumented_keys(schema, REPO / "docs") == [], \
        "config keys in neither docs/operations.md nor their section's page"


def test_an_undocumented_key_is_caught(tmp_path: Path) -> None:
    (tmp_path / "operations.md").write_text(
        "| agent | node | host name | x |\n| `[zone]` | ports | protocol.md |\n| `[migrate]` | x | migration.md |\n")
    (tmp_path / "protocol.md").write_text("`[zone] port` and `handover_port`, `listen`\n")
    (tmp_path / "migration.md").write_text("```toml\n[migrate]\n# the port\nport = 7442\n```\nThen\nlisten = 1\n")
    schema: dict[str, dict[str, object]] = {
        "agent": {"node": "", "socket": ""}, "zone": {"port": 1, "handover_port": 2, "check_source": True, "listen": ""},
        "migrate": {"port": 3, "listen": ""}}
    assert undocumented_keys(schema, tmp_path) == ["agent.socket", "zone.check_source", "zone.listen", "migrate.listen"]


def table_defaults(ops: str) -> dict[tuple[str, str], str]:
    """operations.md's configuration table (the one headed ``| section | key | default |``):
    (section, key) -> the default it states."""
    part = ops[ops.index("| section | key | default |"):]
    part = part[:part.index("\n\n")]
    return {(m.group(1), m.group(2)): m.group(3).strip()
            for m in re.finditer(r"^\| (\w+) \| (\w+) \| ([^|]*) \|", part, re.M) if m.group(1) != "section"}


def default_mismatches(rows: dict[tuple[str, str], str], schema: dict[str, dict[str, object]]) -> list[str]:
    """Rows whose stated default is not the code's. An empty default in the code may be stated
    in words (``host name``, ``(bundled)``); anything else must read as the value."""
    out = []
    for (section, key), stated in rows.items():
        if section not in schema or key not in schema[section]:
            out.append(f"{section}.{key}: no such key")
            continue
        real = schema[section][key]
        if real == "":
            continue
        shown = stated.strip("`")
        if isinstance(real, bool):
            ok = shown == str(real).lower()
        elif isinstance(real, int | float):
            try:
                ok = float(shown.replace(",", "")) == float(real)
            except ValueError:
                ok = False
        elif isinstance(real, list):
            ok = shown == "[" + ", ".join(f'"{x}"' if isinstance(x, str) else str(x) for x in real) + "]"
        else:
            ok = shown == str(real)
        if not ok:
            out.append(f"{section}.{key}: the doc says {stated!r}, the code {real!r}")
    return out


def test_operations_config_table_defaults_are_the_codes() -> None:
    rows = table_defaults(_text(OPS))
    assert ("agent", "shutdown_timeout_s") in rows and ("jobs", "max_per_user") in rows
    assert default_mismatches(rows, _schema()) == []


def test_a_wrong_default_is_caught() -> None:
    rows = table_defaults("| section | key | default | meaning |\n| --- | --- | --- | --- |\n"
                          "| agent | log_level | info | x |\n| jobs | keep_ended | 1,000 | y |\n"
                          "| net | ingress | true | z |\n| net | bogus | 1 | w |\n\n| other | table | 1 | v |\n")
    schema: dict[str, dict[str, object]] = {"agent": {"log_level": "info"}, "jobs": {"keep_ended": 10000}, "net": {"ingress": True}}
    assert default_mismatches(rows, schema) == ["jobs.keep_ended: the doc says '1,000', the code 10000",
                                                "net.bogus: no such key"]


# ---------------------------------------------------------------- routes and commands


def code_routes(root: Path) -> dict[tuple[str, str], bool]:
    """Every ``Route("METHOD", "/path", handler, privileged=...)`` under ``root``: -> privileged."""
    out: dict[tuple[str, str], bool] = {}
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(_text(f))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "Route"):
                continue
            args = [a.value for a in node.args[:2] if isinstance(a, ast.Constant)]
            if len(args) < 2:
                continue
            priv = next((kw.value for kw in node.keywords if kw.arg == "privileged"), None)
            if priv is None and len(node.args) > 3:
                priv = node.args[3]
            out[(str(args[0]), str(args[1]))] = bool(priv.value) if isinstance(priv, ast.Constant) else False
    return out


def command_table(ops: str) -> list[tuple[str, str, str, str]]:
    """The rows (command, options, route, who) of the table under "laminarctl commands and the
    control API"."""
    part = ops[ops.index("## laminarctl commands and the control API"):]
    part = part[:part.index("\n## ", 3)]
    rows = []
    for line in part.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 4 and cells[0] not in ("command", "---"):
            rows.append((cells[0], cells[1], cells[2], cells[3]))
    return rows


def table_routes(rows: list[tuple[str, str, str, str]]) -> dict[tuple[str, str], set[bool]]:
    out: dict[tuple[str, str], set[bool]] = {}
    for _, _, route, who in rows:
        for m in re.finditer(r"`(GET|POST|PUT|DELETE) (/v1/[^`\s]*)`", route):
            out.setdefault((m.group(1), m.group(2)), set()).add(who.startswith("root, control group"))
    return out


def route_mismatches(code: dict[tuple[str, str], bool], doc: dict[tuple[str, str], set[bool]]) -> list[str]:
    out = [f"{m} {p}: not in the table" for (m, p) in sorted(set(code) - set(doc))]
    out += [f"{m} {p}: in the table, not served" for (m, p) in sorted(set(doc) - set(code))]
    for r in sorted(set(code) & set(doc)):
        if doc[r] != {code[r]}:
            out.append(f"{r[0]} {r[1]}: privileged={code[r]} in the code, the table says "
                       + ("root, control group" if True in doc[r] else "not privileged"))
    return out


def test_every_route_is_in_the_table_with_its_privilege() -> None:
    code = code_routes(REPO / "agent" / "laminar")
    assert len(code) > 30 and code[("POST", "/v1/reclaim/cancel")] is True
    assert route_mismatches(code, table_routes(command_table(_text(OPS)))) == []


def test_a_route_mismatch_is_caught() -> None:
    rows = command_table("## laminarctl commands and the control API\n\n| command | options | route | who may |\n"
                         "| --- | --- | --- | --- |\n| `laminarctl a` | | `GET /v1/a` | anyone |\n"
                         "| `laminarctl b` | | `POST /v1/b` | anyone |\n| `laminarctl c` | | `GET /v1/c` | anyone |\n\n## next\n")
    code = {("GET", "/v1/a"): False, ("POST", "/v1/b"): True, ("GET", "/v1/d"): False}
    assert route_mismatches(code, table_routes(rows)) == [
        "GET /v1/d: not in the table", "GET /v1/c: in the table, not served",
        "POST /v1/b: privileged=True in the code, the table says not privileged"]


GLOBAL_OPTIONS = {"-h", "--help", "-o", "--output", "--socket", "--version"}


def cli_commands(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """Every laminarctl command that runs something (a parser without subcommands, or one with
    a default of its own): its words -> its long options (global ones left out)."""
    out: dict[str, set[str]] = {}

    def walk(p: argparse.ArgumentParser, words: list[str]) -> None:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if words and (not subs or p.get_default("func") is not None):
            out[" ".join(words)] = {o for a in p._actions for o in a.option_strings
                                    if o.startswith("--") and o not in GLOBAL_OPTIONS}
        for s in subs:
            for name, sp in s.choices.items():
                walk(sp, words + [name])

    walk(parser, [])
    return out


def row_command(cell: str, commands: set[str]) -> str | None:
    """The longest laminarctl command a table cell starts with (``laminarctl net transfers add``)."""
    m = re.match(r"`laminarctl ([^`]*)`", cell)
    if not m:
        return None
    words = m.group(1).split()
    for n in range(len(words), 0, -1):
        if " ".join(words[:n]) in commands:
            return " ".join(words[:n])
    return None


def command_mismatches(commands: dict[str, set[str]], rows: list[tuple[str, str, str, str]]) -> list[str]:
    seen: dict[str, str] = {}
    for cmd_cell, options, _, _ in rows:
        for cell in re.findall(r"`laminarctl [^`]*`", cmd_cell):
            c = row_command(cell, set(commands))
            if c is not None:
                seen[c] = seen.get(c, "") + " " + options
    out = [f"laminarctl {c}: not in the table" for c in sorted(set(commands) - set(seen))]
    for c in sorted(set(commands) & set(seen)):
        out += [f"laminarctl {c} {o}: not in its row" for o in sorted(commands[c])
                if not re.search(rf"`{re.escape(o)}[`\s/]", seen[c])]
    return out


def test_every_command_and_option_is_in_the_table() -> None:
    sys.path.insert(0, str(REPO / "ctl"))
    from laminarctl.main import build_parser

    commands = cli_commands(build_parser())
    assert {"reclaim", "replicas", "zone submit", "pool", "net transfers add"} <= set(commands)
    assert command_mismatches(commands, command_table(_text(OPS))) == []


def test_a_missing_command_or_option_is_caught() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    a = sub.add_parser("jobs")
    a.add_argument("--last")
    a.add_argument("--active")
    b = sub.add_parser("zone").add_subparsers()
    b.add_parser("peers")
    b.add_parser("keys")
    rows = [("`laminarctl jobs`", "`--last N`", "", ""), ("`laminarctl zone peers`", "", "", ""),
            ("`laminarctl zone keys reload`", "", "", "")]
    commands = cli_commands(p)
    assert set(commands) == {"jobs", "zone peers", "zone keys"}
    assert command_mismatches(commands, rows) == ["laminarctl jobs --active: not in its row"]
    assert command_mismatches(commands, rows[:1]) == ["laminarctl zone keys: not in the table",
                                                      "laminarctl zone peers: not in the table",
                                                      "laminarctl jobs --active: not in its row"]


# ---------------------------------------------------------------- the map ABI


def header_abi(h: str) -> tuple[dict[str, int], dict[str, list[str]]]:
    """bpf/laminar.h: its integer #defines and each struct's field names in order."""
    defines: dict[str, int] = {}
    for name, expr in re.findall(r"^#define (LM_\w+)\s+(.+?)\s*(?:/\*.*)?$", h, re.M):
        try:
            defines[name] = int(eval(expr.replace("U", ""), {}, {}))  # noqa: S307 (the project's own header)
        except Exception:
            continue
    structs = {}
    for name, body in re.findall(r"^struct (lm_\w+) \{(.*?)^\};", re.sub(r"/\*.*?\*/", "", h, flags=re.S), re.M | re.S):
        structs[name] = re.findall(r"(\w+)(?:\[\d+\])?;", body)
    return defines, structs


def abi_mismatches(h: str, doc: str) -> list[str]:
    defines, structs = header_abi(h)
    out = []
    if not re.search(rf"`LM_ABI_VERSION` \(now \*\*{defines['LM_ABI_VERSION']}\*\*\)", doc):
        out.append(f"LM_ABI_VERSION is {defines['LM_ABI_VERSION']}")
    for name in ("LM_MAX_JOBS", "LM_MAX_FLOWS", "LM_STAT_MAX"):
        if f"`{name}` ({defines[name]})" not in doc:
            out.append(f"{name} is {defines[name]}")
    if f"`LM_RINGBUF_BYTES` ({defines['LM_RINGBUF_BYTES'] >> 10} KiB)" not in doc:
        out.append(f"LM_RINGBUF_BYTES is {defines['LM_RINGBUF_BYTES'] >> 10} KiB")
    for flag in [d for d in defines if re.match(r"LM_(JOB|GLOBAL|FLOW)_[A-Z_]+$", d)]:
        if f"`{flag}` {defines[flag]}:" not in doc:
            out.append(f"{flag} is {defines[flag]}")
    for name, fields in structs.items():
        m = re.search(rf"`struct {name} \{{([^`]*)\}}`", doc)
        if m is None:
            out.append(f"struct {name}: not shown")
            continue
        shown = re.findall(r"(\w+)(?:\[\d+\])?\s*[,;]", m.group(1))
        if shown != fields:
            out.append(f"struct {name}: the doc shows {shown}, the header has {fields}")
    return out


def test_bpf_maps_doc_states_the_header() -> None:
    h, doc = _text(REPO / "bpf" / "laminar.h"), _text(REPO / "docs" / "bpf-maps.md")
    defines, structs = header_abi(h)
    assert defines["LM_ABI_VERSION"] >= 2 and len(structs) >= 6
    assert abi_mismatches(h, doc) == []


def test_a_stale_layout_is_caught() -> None:
    h = _text(REPO / "bpf" / "laminar.h")
    doc = _text(REPO / "docs" / "bpf-maps.md")
    stale = (doc.replace("(now **2**)", "(now **1**)")
             .replace("`LM_MAX_FLOWS` (1024)", "`LM_MAX_FLOWS` (512)")
             .replace("__u32 job_id, flags, priority, _pad;", "__u32 job_id, flags, priority;")
             .replace("`LM_JOB_ARMED` 4:", "`LM_JOB_ARMED` 8:"))
    assert stale != doc  # every plant took: the doc still has the text replaced
    assert abi_mismatches(h, stale) == [
        "LM_ABI_VERSION is 2", "LM_MAX_FLOWS is 1024", "LM_JOB_ARMED is 4",
        "struct lm_flow: the doc shows ['job_id', 'flags', 'priority', 'kill_at_ns', 'packets', 'bytes'], the header "
        "has ['job_id', 'flags', 'priority', '_pad', 'kill_at_ns', 'packets', 'bytes']"]


# ---------------------------------------------------------------- the policy language


def policy_keys(doc: dict[str, object], prefix: str = "") -> list[str]:
    """The policy's keys as policy.md's table names them: nested sections down to their leaves
    (``thresholds."memory.some"``, ``rungs.suspend.budget_s``), maps of classes as one key."""
    out = []
    for k, v in doc.items():
        name = prefix + (f'"{k}"' if "." in k else k)
        if isinstance(v, dict) and v and k not in ("class_weights",):
            out += policy_keys(v, name + ".")
        else:
            out.append(name)
    return out


def test_every_policy_key_is_in_policy_md() -> None:
    from laminar.airlock.policy import DEFAULT

    keys = policy_keys(DEFAULT)
    assert 'thresholds."memory.some"' in keys and "rungs.readdress.max_hops" in keys and "job_default_mb" in keys
    doc = _text(REPO / "docs" / "policy.md")
    assert [k for k in keys if f"| `{k}` |" not in doc] == [], "policy keys missing from docs/policy.md's table"


def command_lines(text: str) -> list[str]:
    """laminarctl invocations in ``text``: backticked spans and lines of fenced blocks that start
    with ``laminarctl`` (prose such as "laminarctl exits 1" is not one)."""
    out = re.findall(r"`(laminarctl [^`\n]+)`", text)
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S):
        out += [ln.strip() for ln in block.splitlines() if ln.strip().startswith("laminarctl ")]
    return out


def bad_invocations(lines: list[str], commands: dict[str, set[str]]) -> list[str]:
    """The invocations that name no laminarctl command, or an option their command lacks."""
    groups = {" ".join(c.split()[:i]) for c in commands for i in range(1, len(c.split()))}
    out = []
    for line in lines:
        words = line.split("#")[0].split()[1:]
        while words[:2] == ["-o", "json"] or words[:1] == ["--version"]:
            words = words[2:] if words[0] == "-o" else words[1:]
        path: list[str] = []
        for w in words:
            if " ".join(path + [w]) in commands or " ".join(path + [w]) in groups:
                path.append(w)
            else:
                break
        cmd = " ".join(path)
        if not words:
            continue
        if cmd not in commands:
            if cmd not in groups:
                out.append(f"{line}: no such command")
            continue
        for w in words[len(path):]:
            if w == "--":
                break
            opt = re.sub(r"[=,;:)`'\"].*$", "", w)
            if opt.startswith("--") and opt not in commands[cmd] and opt not in GLOBAL_OPTIONS:
                out.append(f"{line}: laminarctl {cmd} has no {opt}")
    return out


@pytest.mark.parametrize("doc", DOCS + [REPO / "README.md"], ids=lambda p: p.name)
def test_every_laminarctl_line_in_the_docs_is_a_real_command(doc: Path) -> None:
    sys.path.insert(0, str(REPO / "ctl"))
    from laminarctl.main import build_parser

    assert bad_invocations(command_lines(_text(doc)), cli_commands(build_parser())) == []


def test_a_wrong_invocation_is_caught() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    sub.add_parser("jobs").add_argument("--last")
    sub.add_parser("zone").add_subparsers().add_parser("submit").add_argument("--gpus")
    text = ("`laminarctl stop job-3`, `laminarctl jobs --last 5`, `laminarctl jobs --all`, laminarctl exits 1\n"
            "```\nlaminarctl zone submit --gpus 1 -- python t.py --epochs 3   # --nope in a comment\n"
            "laminarctl -o json zone\nlaminarctl zone submit --gpu 1\n```\n")
    assert bad_invocations(command_lines(text), cli_commands(p)) == [
        "laminarctl stop job-3: no such command", "laminarctl jobs --all: laminarctl jobs has no --all",
        "laminarctl zone submit --gpu 1: laminarctl zone submit has no --gpu"]


# ---------------------------------------------------------------- event phases


def doc_phases(text: str) -> set[str]:
    """Event phases a doc names: ``phase `x``` and ``phases `x`, `y` and `z```."""
    out: set[str] = set()
    for run in re.findall(r"\bphases? ((?:`[a-z][a-z-]*`(?:,? (?:and |or )?)?)+)", text):
        out |= set(re.findall(r"`([a-z][a-z-]*)`", run))
    return out


@functools.lru_cache(maxsize=4)
def code_strings(root: Path) -> frozenset[str]:
    """Every string constant in the Python files under ``root``."""
    out: set[str] = set()
    for f in root.rglob("*.py"):
        out |= {n.value for n in ast.walk(ast.parse(_text(f))) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return frozenset(out)


def test_every_event_phase_a_doc_names_is_emitted_by_the_code() -> None:
    phases = set().union(*(doc_phases(_text(d)) for d in DOCS))
    assert {"reclaim-cancelled", "reclaim-cleared", "replica-dropped"} <= phases
    strings = code_strings(REPO / "agent" / "laminar")
    assert sorted(phases - strings) == [], "event phases in docs/ that no code emits"


def test_an_unknown_phase_is_caught() -> None:
    text = "a `migrate` event, phase `reclaim-cancelled`; phases `held`, `waiting` and `unheard-of`."
    assert doc_phases(text) == {"reclaim-cancelled", "held", "waiting", "unheard-of"}
    assert sorted(doc_phases(text) - code_strings(REPO / "agent" / "laminar")) == ["unheard-of"]
