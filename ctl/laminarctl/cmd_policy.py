"""Airlock policy: show the one in force, set a new one, validate a file without setting it.

    laminarctl policy show
    laminarctl policy validate policy.toml     # JSON or TOML; exit 1 with every problem listed
    laminarctl policy set policy.toml          # root or the control group; refused whole if invalid
    laminarctl policy set - < policy.json      # FILE "-" reads standard input

See docs/policy.md for the keys, their defaults and the reasons for them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .client import CtlError
from .output import emit, info, print_json


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("policy", parents=[common], help="Airlock policy: show, set, validate")
    psub = p.add_subparsers(dest="policy_cmd", metavar="SUBCOMMAND")
    psub.required = True
    s = psub.add_parser("show", parents=[common], help="the policy in force, with its version")
    s.set_defaults(func=cmd_show)
    s = psub.add_parser("set", parents=[common], help="validate FILE and put it in force as a new version")
    s.add_argument("file", help="policy document (JSON or TOML); - reads standard input")
    s.set_defaults(func=cmd_set)
    s = psub.add_parser("validate", parents=[common], help="check FILE; changes nothing")
    s.add_argument("file", help="policy document (JSON or TOML); - reads standard input")
    s.set_defaults(func=cmd_validate)


def _load(path: str) -> Any:
    from laminar.airlock.policy import PolicyError, parse

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as e:
        raise ValueError(f"policy file {path}: {e.strerror}") from None
    try:
        return parse(text)
    except PolicyError as e:
        raise CtlError(str(e)) from None


def cmd_show(args: argparse.Namespace) -> int:
    pol = args.client.get("/v1/policy")

    def human(p: dict[str, Any]) -> None:
        info(f"policy v{p['version']}" + (" (built-in default)" if not p["version"] else ""))
        print_json(p["policy"])

    emit(pol, args.output, human)
    return 0


def cmd_set(args: argparse.Namespace) -> int:
    pol = args.client.put("/v1/policy", _load(args.file))
    emit(pol, args.output, lambda p: info(f"policy v{p['version']} in force"))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    res = args.client.post("/v1/policy/validate", _load(args.file))
    emit(res, args.output, lambda r: info(f"{args.file}: valid"))
    return 0
