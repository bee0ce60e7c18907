"""The ``retired-pod-gc`` command line: ``config`` (and, as they land, the other commands).

Exit codes: 0 success, 1 runtime failure (API or database unreachable), 2 bad configuration or
usage. Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from service import config


def _cmd_config(args: argparse.Namespace) -> int:
    try:
        settings = config.load(os.environ)
    except config.ConfigError as exc:
        print(f"retired-pod-gc: configuration error: {exc}", file=sys.stderr)
        return 2
    for warning in settings.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    rows = config.effective(settings, os.environ)
    width = max(len(name) for name, _, _ in rows)
    print(f"# mode: {settings.mode}")
    for name, value, source in rows:
        print(f"{name:<{width}}  {value}  ({source})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="retired-pod-gc",
        description=(
            "Delete sandbox pods whose execution was retired in PostgreSQL. "
            f"Configured through {config.PREFIX}* environment variables "
            "(see docs/configuration.md)."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "config",
        help="print the effective configuration (secrets masked)",
        description=(
            "Read the environment like `run` does and print every variable's effective value "
            "and whether it came from the environment or the default. Exit 2 naming the "
            "variable when one cannot be parsed."
        ),
    )
    p.set_defaults(func=_cmd_config)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
