"""Output for laminarctl: human tables by default, JSON for scripts (``-o json``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

# Piped output (scripts, logs, less) is not squeezed to 80 columns: tables keep whole values.
_console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
# errors are never wrapped by us: a script or a log gets each message whole, on one line (rich
# wrapped them at 80 columns, in the middle of a long path too)
_err = Console(stderr=True, highlight=False, soft_wrap=True)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | Sequence[tuple[str, str]], title: str | None = None) -> None:
    """Prints rows as a table; columns are keys or (key, header) pairs."""
    cols = [(c, c.upper()) if isinstance(c, str) else c for c in columns]
    t = Table(title=title, box=None, pad_edge=False, header_style="bold")
    for _, header in cols:
        t.add_column(header)
    for row in rows:
        # Text, not str: a value is shown as it is, never read as rich markup ("[/]" in a job's
        # stop reason would otherwise fail the whole table, "[red]x[/red]" would show as "x").
        t.add_row(*[Text(fmt(row.get(k))) for k, _ in cols])
    _console.print(t)


def kv(pairs: dict[str, Any], title: str | None = None) -> None:
    if title:
        _console.print(f"[bold]{title}[/bold]")
    width = max((len(k) for k in pairs), default=0)
    for k, v in pairs.items():
        _console.print(f"  {k.ljust(width)}  {fmt(v)}", markup=False)


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    if isinstance(v, dict | list):
        return json.dumps(v, default=str)
    return str(v)


def emit(obj: Any, fmt_name: str, human: Any = None) -> None:
    """JSON when asked for, else calls human(obj) (or prints key/values for a dict)."""
    if fmt_name == "json":
        print_json(obj)
    elif human is not None:
        human(obj)
    elif isinstance(obj, dict):
        kv(obj)
    else:
        print_json(obj)


def error(message: str) -> None:
    _err.print(f"laminarctl: {message}", markup=False)


def info(message: str) -> None:
    _console.print(message, markup=False)
