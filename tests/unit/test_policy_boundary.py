"""The boundary between policy and mechanism (issue 32), checked on the source's imports.

- :mod:`laminar.policy` is pure: no module in it imports, directly or through other laminar
  modules, anything that does I/O (processes, sockets, SQLite, cffi/ctypes, asyncio, the file
  system, the clock) or any laminar module outside the package.
- The simulator (:mod:`laminar.sim`) runs that policy without the agent's mechanism: no module
  in its import closure inside laminar imports subprocess, socket, sqlite3, cffi or ctypes, and
  the closure stays inside the set the simulator may use.

The closure is computed statically (AST) so that it covers imports inside functions too, which
a run of one code path would miss; imports under ``if TYPE_CHECKING:`` are left out (they never
run). A runtime check confirms that what importing the simulator loads is inside that closure.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import laminar

PKG_DIR = Path(laminar.__file__).parent

# What a policy module must not import (top-level names), and why.
POLICY_BANNED = {
    "subprocess": "processes",
    "socket": "sockets",
    "ssl": "sockets",
    "select": "file descriptors",
    "selectors": "file descriptors",
    "sqlite3": "the store",
    "cffi": "the BPF binding",
    "ctypes": "native calls",
    "asyncio": "the event loop",
    "os": "the file system",
    "pathlib": "the file system",
    "shutil": "the file system",
    "tempfile": "the file system",
    "glob": "the file system",
    "io": "the file system",
    "time": "the clock (a policy takes `now` as an argument)",
    "threading": "threads",
    "multiprocessing": "processes",
    "signal": "signals",
}
# laminar modules outside laminar.policy a policy module may import: none. (The root package
# `laminar` runs whenever any submodule is imported; it holds only __version__ and is checked
# like every other module.)
POLICY_ALLOWED_OUTSIDE: dict[str, str] = {}

# What no module the simulator loads may import: the agent's mechanism.
SIM_BANNED = {"subprocess", "socket", "sqlite3", "cffi", "ctypes"}
# The laminar modules the simulator may reach, besides laminar.sim and laminar.policy, each
# with why (issue 32: policy and the socket-free parts of the zone layer).
SIM_ALLOWED = {
    "laminar": "the root package (only __version__)",
    "laminar.zone": "the zone package (a docstring)",
    "laminar.zone.arbiter": "the node side of placement, socket-free",
    "laminar.zone.submitter": "the submitter side of placement, socket-free",
    "laminar.zone.gangplace": "the submitter side of gang placement, socket-free (issue 33)",
    "laminar.zone.simnet": "the simulated zone transport",
    "laminar.zone.wire": "the datagram format the simulated transport encodes and checks",
    "laminar.zone.keys": "the zone keys the wire signs with (wire imports it)",
    "laminar.zone.membership": "the roster the simulated zone is built from (no socket)",
}
# Modules in the simulator's closure that still import mechanism, each with why: this list
# only shrinks (empty since issue 32's stage 1 split the arbiter and submitter out of
# laminar.zone.component).
SIM_OFFENDERS_LEFT: dict[str, str] = {}


class Tree:
    """The modules of a package directory and their imports."""

    def __init__(self, pkg_dir: Path, pkg: str = "laminar") -> None:
        self.pkg = pkg
        self.files: dict[str, Path] = {}
        for p in pkg_dir.rglob("*.py"):
            parts = [pkg, *p.relative_to(pkg_dir).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            self.files[".".join(parts)] = p
        self._imports: dict[str, set[str]] = {}

    def imports(self, name: str) -> set[str]:
        """Every module ``name`` imports (absolute names, with the packages that importing runs),
        outside ``if TYPE_CHECKING:`` blocks, at any depth."""
        if name in self._imports:
            return self._imports[name]
        path = self.files[name]
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()

        def visit(node: ast.AST) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child.test):
                    for stmt in child.orelse:
                        visit_one(stmt)
                    continue
                visit_one(child)

        def visit_one(node: ast.AST) -> None:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    mod = ".".join([*base, node.module] if node.module else base)
                else:
                    mod = node.module or ""
                found.add(mod)
                found.update(f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in self.files)
            visit(node)

        visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        out = set(found)
        for mod in found:  # importing a.b.c runs a and a.b first
            parts = mod.split(".")
            out.update(".".join(parts[:i]) for i in range(1, len(parts)))
        self._imports[name] = out
        return out

    def closure(self, start: list[str]) -> dict[str, str]:
        """The package's modules reachable from ``start``: module -> the module that imported it."""
        seen: dict[str, str] = {m: m for m in start}
        todo = list(start)
        while todo:
            mod = todo.pop()
            for dep in sorted(self.imports(mod)):
                if dep in self.files and dep not in seen:
                    seen[dep] = mod
                    todo.append(dep)
        return seen

    def package(self, name: str) -> list[str]:
        return sorted(m for m in self.files if m == name or m.startswith(name + "."))

    def banned_in(self, mod: str, banned: set[str] | dict[str, str]) -> list[str]:
        return sorted(i for i in self.imports(mod) if i.split(".")[0] in banned)

    def chain(self, seen: dict[str, str], mod: str) -> str:
        path = [mod]
        while seen[path[-1]] != path[-1]:
            path.append(seen[path[-1]])
        return " <- ".join(path)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _opens_files(path: Path) -> list[int]:
    """Lines of ``path`` that call the builtin ``open``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "open"]


def policy_violations(tree: Tree) -> list[str]:
    start = tree.package(f"{tree.pkg}.policy")
    assert start, "no policy package found"
    seen = tree.closure(start)
    out = []
    for mod in sorted(seen):
        if mod != tree.pkg and not mod.startswith(f"{tree.pkg}.policy") and mod not in POLICY_ALLOWED_OUTSIDE:
            out.append(f"{mod} is mechanism outside the policy package ({tree.chain(seen, mod)})")
        for b in tree.banned_in(mod, POLICY_BANNED):
            out.append(f"{mod} imports {b}: {POLICY_BANNED[b.split('.')[0]]} ({tree.chain(seen, mod)})")
        for line in _opens_files(tree.files[mod]):
            out.append(f"{mod}:{line} calls open(): the file system")
    return out


def sim_violations(tree: Tree) -> list[str]:
    seen = tree.closure(tree.package(f"{tree.pkg}.sim"))
    out = []
    for mod in sorted(seen):
        inside = (mod.startswith(f"{tree.pkg}.sim") or mod.startswith(f"{tree.pkg}.policy")
                  or mod in SIM_ALLOWED or mod in SIM_OFFENDERS_LEFT)
        if not inside:
            out.append(f"{mod} is outside the simulator's allowed set ({tree.chain(seen, mod)})")
        banned = tree.banned_in(mod, SIM_BANNED)
        if banned and mod not in SIM_OFFENDERS_LEFT:
            out.append(f"{mod} imports {', '.join(banned)} ({tree.chain(seen, mod)})")
    return out


def test_policy_imports_no_mechanism() -> None:
    assert policy_violations(Tree(PKG_DIR)) == []


def test_simulator_reaches_no_mechanism() -> None:
    assert sim_violations(Tree(PKG_DIR)) == []


def test_offenders_left_are_still_offenders() -> None:
    # An entry for a module that no longer imports mechanism (or that the simulator no longer
    # reaches) must go: the list only shrinks.
    tree = Tree(PKG_DIR)
    seen = tree.closure(tree.package("laminar.sim"))
    for mod in SIM_OFFENDERS_LEFT:
        assert mod in seen and tree.banned_in(mod, SIM_BANNED), f"{mod}: no longer an offender, remove it"


def test_importing_the_simulator_loads_only_its_static_closure() -> None:
    # The static closure is what the checks above judge; what importing the simulator really
    # loads must be inside it (a dynamic import the analysis cannot see would show here).
    tree = Tree(PKG_DIR)
    static = set(tree.closure(tree.package("laminar.sim")))
    code = ("import sys, importlib\n"
            f"for m in {tree.package('laminar.sim')!r}: importlib.import_module(m)\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m == 'laminar' or m.startswith('laminar.'))))")
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert set(loaded) <= static, sorted(set(loaded) - static)


def _write(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "laminar"
    for rel, text in files.items():
        p = pkg / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return pkg


def test_the_checks_catch_violations(tmp_path: Path) -> None:
    # The analysis itself: a tree with each kind of violation, found through a relative import,
    # an import inside a function and a package's __init__; one under TYPE_CHECKING is ignored.
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "store.py": "import sqlite3\n",
        "zone/__init__.py": "",
        "zone/component.py": "import socket\n",
        "policy/__init__.py": "",
        "policy/good.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from laminar import store\n",
        "policy/bad.py": "from . import helper\n",
        "policy/helper.py": "def f():\n    from laminar.store import x\n    return open('f')\n",
        "sim/__init__.py": "",
        "sim/engine.py": "from laminar.policy import good\nfrom laminar.zone.component import Arbiter\n",
    })
    tree = Tree(pkg)
    policy = policy_violations(tree)
    assert any(v.startswith("laminar.store is mechanism outside") and "laminar.policy.helper" in v for v in policy)
    assert any(v.startswith("laminar.store imports sqlite3") for v in policy)
    assert any(v.startswith("laminar.policy.helper:3 calls open()") for v in policy)
    assert not any("laminar.policy.good" in v.split(" (")[0] for v in policy)
    sim = sim_violations(tree)
    assert "laminar.zone.component is outside the simulator's allowed set (laminar.zone.component <- laminar.sim.engine)" in sim
    assert any(v.startswith("laminar.zone.component imports socket") for v in sim)
