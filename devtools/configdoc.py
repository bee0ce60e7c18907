"""``python -m devtools.configdoc [--write]``: the variable table of docs/configuration.md.

The table is written from the declarations in ``service/config.py`` (name, default, range,
description), so that the document cannot drift from the code: ``--write`` replaces the table in
the document and keeps the prose around it; without it the table is printed.
``tests/unit/test_config.py`` checks that the document holds exactly this table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from service.config import VARIABLES

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
HEADER = "| variable | default | range | effect |\n|---|---|---|---|\n"


def table() -> str:
    """The markdown table, one row per variable in declaration order."""
    rows = []
    for var in VARIABLES:
        span = "" if var.lo is None else f"{var.lo} \N{EN DASH} {var.hi}"
        rows.append(f"| `{var.suffix}` | `{var.shown_default}` | {span} | {var.doc} |\n")
    return HEADER + "".join(rows)


def documented_table(text: str) -> str:
    """The table as the document holds it: from its header to the first line not in it."""
    start = text.index(HEADER)
    end = start
    while end < len(text) and text.startswith("|", end):
        end = text.index("\n", end) + 1
    return text[start:end]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {DOC}")
    if not parser.parse_args(argv).write:
        print(table(), end="")
        return 0
    text = DOC.read_text(encoding="utf-8")
    DOC.write_text(text.replace(documented_table(text), table()), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
