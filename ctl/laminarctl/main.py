"""laminarctl: operate the Laminar agent on this node.

Every command talks to the local agent over its Unix socket (--socket or $LAMINAR_SOCKET,
default /run/laminar/laminard.sock) and accepts -o json. Exit codes: 0 success, 1 refused or
failed, 2 bad input, 3 agent not running, 4 permission denied, 5 (net transfers) a transfer is
infeasible or late.
"""

# Command groups live in cmd_*.py modules, each with register(subparsers, common).

from __future__ import annotations

import argparse
import functools
import importlib
import pkgutil
import sys
from typing import Any

from . import __version__
from .client import EXIT_FAILED, EXIT_USAGE, Client, CtlError
from .output import error


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse exits 2 on usage errors; keep its message clear
        self.print_usage(sys.stderr)
        error(message)
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("-o", "--output", choices=["table", "json"], default=argparse.SUPPRESS,
                        help="output format (default: table)")
    common.add_argument("--socket", default=argparse.SUPPRESS, help="agent control socket")
    parser = _Parser(prog="laminarctl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                     parents=[common])
    parser.add_argument("--version", action="version", version=f"laminarctl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for mod in command_modules():
        mod.register(sub, common)
    return parser


@functools.cache
def command_modules() -> list[Any]:
    """The cmd_* modules, imported once (listing the package directory happens only here)."""
    pkg = importlib.import_module("laminarctl")
    names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name.startswith("cmd_"))
    return [importlib.import_module(f"laminarctl.{name}") for name in names]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.output = getattr(args, "output", "table")
    args.client = Client(getattr(args, "socket", None))
    try:
        return int(args.func(args) or 0)
    except CtlError as e:
        error(e.message)
        return e.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except ValueError as e:
        error(str(e))
        return EXIT_USAGE
    except Exception as e:  # a bug in the client: say so without a traceback wall
        error(f"internal error: {type(e).__name__}: {e}")
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
