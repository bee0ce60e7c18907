"""``python -m devtools.chartschema [--write | --check]``: the chart's schema of ``config``.

The Helm chart takes every variable of ``service/config.py`` that it does not set from a value
of its own as ``config.<NAME>`` (NAME without the prefix). The schema of those values
(``deploy/helm/retired-pod-gc/values.schema.json``, ``properties.config.properties``) is written
from the declarations: type from the parser, choices, range, default and description, so that the
chart cannot drift from the code. The rest of the schema (image, resources, monitoring, ...) is
written by hand in the same file and kept as it is. ``--write`` rewrites the file, ``--check``
exits 1 when it differs from what the declarations give; without either it is printed.
``tests/deploy/test_helm_chart.py`` checks that the file is exactly this.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from service.config import VARIABLES
from service.kit import env

SCHEMA = (
    Path(__file__).resolve().parent.parent
    / "deploy"
    / "helm"
    / "retired-pod-gc"
    / "values.schema.json"
)
CHART_OWNED = {
    "ENABLED": "mode",
    "DRY_RUN": "mode",
    "NAMESPACE": "sandboxNamespaces",
    "NAMESPACES": "sandboxNamespaces",
    "DATABASE_URL": "never a value: database.secretName, mounted as DATABASE_URL_FILE",
    "DATABASE_URL_FILE": "database.secretName",
    "LISTENER_DATABASE_URL": "never a value: database.listenerSecretName",
    "LISTENER_DATABASE_URL_FILE": "database.listenerSecretName",
    "METRICS_BIND_ADDRESS": "metrics.port",
    "LEASE_NAMESPACE": "the pod's namespace (downward API)",
    "LEADER_IDENTITY": "the pod's name (downward API)",
}
"""Variables the chart sets from a value of its own (or the pod), and from which; every other
one is ``config.<NAME>``."""
_TYPES: dict[object, str] = {
    env.boolean: "boolean",
    env.integer: "integer",
    env.optional_integer: "integer",
    env.number: "number",
}
"""JSON type of each parser's values; any other parser reads a string."""
_HOST_PORT = "^[^:]*:[0-9]{1,5}$"


def _property(var: env.Var[Any]) -> dict[str, Any]:
    prop: dict[str, Any] = {"type": _TYPES.get(var.parse, "string")}
    if isinstance(var.parse, env.Choice):
        prop["enum"] = list(var.parse.options)
    if var.parse is env.host_port:
        prop["pattern"] = _HOST_PORT
    if var.lo is not None:
        prop["minimum"] = var.lo
        prop["maximum"] = var.hi
    if var.default is not None:
        prop["default"] = var.shown_default if isinstance(var.default, tuple) else var.default
    prop["description"] = var.doc
    return prop


def config_properties(variables: Iterable[env.Var[Any]] = VARIABLES) -> dict[str, Any]:
    """The schema of each ``config`` value, in declaration order."""
    return {v.suffix: _property(v) for v in variables if v.suffix not in CHART_OWNED}


def render(text: str, variables: Iterable[env.Var[Any]] = VARIABLES) -> str:
    """``text`` (the schema file) with its ``config`` properties written from ``variables``."""
    schema = json.loads(text)
    schema["properties"]["config"]["properties"] = config_properties(variables)
    return json.dumps(schema, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite {SCHEMA}")
    mode.add_argument("--check", action="store_true", help=f"exit 1 when {SCHEMA} differs")
    args = parser.parse_args(argv)
    text = SCHEMA.read_text(encoding="utf-8")
    generated = render(text)
    if args.write:
        SCHEMA.write_text(generated, encoding="utf-8")
    elif args.check:
        if generated != text:
            print(f"{SCHEMA} differs: python -m devtools.chartschema --write", file=sys.stderr)
            return 1
    else:
        print(generated, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
