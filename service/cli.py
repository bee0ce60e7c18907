"""The ``retired-pod-gc`` command line: parses the arguments and the configuration, dispatches.

``service/app/commands.py`` does each command. Exit codes: docs/operations.md, "Commands and exit
codes" (here 2: bad configuration or usage; 143 and 130 after SIGTERM or SIGINT from the first
line of :func:`main`, ``service/app/signals.py``). Never a traceback, except for a bug.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib import metadata

from service import config
from service.app import signals
from service.domain import split_key


def _settings_or_exit(*, need_database: bool) -> config.Settings | int:
    try:
        settings = config.load(os.environ)
    except config.ConfigError as exc:
        print(f"retired-pod-gc: configuration error: {exc}", file=sys.stderr)
        return 2
    if need_database and not settings.database.url:
        print(
            f"retired-pod-gc: configuration error: {config.DATABASE_URL.name} (or "
            f"{config.DATABASE_URL_FILE.name}) is required",
            file=sys.stderr,
        )
        return 2
    return settings


def _dispatch(settings: config.Settings, args: argparse.Namespace) -> int:
    # Imported here, under the signal handlers: the adapters take most of a second to import.
    from service.app import commands  # noqa: PLC0415

    match args.command:
        case "run":
            return commands.run(settings)
        case "scan":
            return commands.scan_pods(settings, output=args.output, timeout_s=args.timeout)
        case "explain":
            try:
                split_key(args.pod)
            except ValueError:
                print("retired-pod-gc: explain takes NAMESPACE/POD", file=sys.stderr)
                return 2
            return commands.explain_pod(
                settings, key=args.pod, url=args.url, timeout_s=args.timeout
            )
        case "pending":
            return commands.show_pending(
                settings,
                url=args.url,
                output=args.output,
                timeout_s=args.timeout,
                limit=args.limit,
            )
        case "migrate":
            return commands.migrate_database(settings, with_schema=args.with_schema)
        case "cancel-create":
            return commands.cancel_create_execution(
                settings,
                sandbox_id=args.sandbox_id,
                generation=args.generation,
                activation_attempt=args.activation_attempt,
            )
        case "config":
            return commands.show_config(settings, os.environ)
        case _ as unreachable:
            raise AssertionError(f"no such command: {unreachable}")


DISTRIBUTION = "retired-pod-gc"
DEBUG_PORT = config.DEBUG_BIND_ADDRESS.default[1]
"""The debug listener's default port (loopback only in the pod: reached by port-forward)."""
LEADER_PORT_FORWARD = (
    "LEADER=$(kubectl -n retired-pod-gc get lease retired-pod-gc "
    "-o jsonpath='{.spec.holderIdentity}'); "
    f"kubectl -n retired-pod-gc port-forward pod/${{LEADER%_*}} {DEBUG_PORT}"
)
"""How an operator reaches the leader's debug listener: the Lease's holder identity is
``<pod name>_<pid>`` (the default ``LEADER_IDENTITY``)."""


def version() -> str:
    """The installed distribution's version (package metadata), ``unknown`` when not installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {text!r}")
    return value


def _http_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(
            f"needs http:// or https:// (e.g. http://127.0.0.1:{DEBUG_PORT}), got {text!r}"
        )
    return text


COMMANDS: dict[str, tuple[str, str]] = {
    "run": (
        "run the controller",
        "Run the controller: watch pods, LISTEN for execution changes, and delete pods that "
        "stayed in a reapable shape for the threshold. Off unless ENABLED=true; dry run unless "
        "DRY_RUN=false. Serves /metrics, /healthz and /readyz. SIGTERM drains in-flight work and "
        "releases the lease.",
    ),
    "scan": (
        "classify every pod now against the database (read-only)",
        "List every sandbox pod, look up its execution row, and classify it with the "
        "controller's own rules: counts by verdict and skip reason, and the candidates. "
        "Read-only; use it before enabling, and to compare with dry-run counts.",
    ),
    "explain": (
        "show every input of one pod's decision and the rule that decided",
        "GET one pod, read its execution row, and print every input the classifier uses and "
        "the rule that decided. Read-only. With --url, also the pod's live observation clock in "
        "the running replica there (its GET /debug/pending), or why it could not be asked.",
    ),
    "pending": (
        "list the pods whose observation clock runs in a running replica",
        "GET /debug/pending from a running replica (DEBUG_PENDING=true) and print every pod "
        "whose observation clock runs: key, UID, verdict, observed since, due at, and what it "
        "waits for (threshold, verification, budget; reported in a dry run). Only the leader "
        "has clocks (a standby answers an empty list), and a port-forward to the Deployment "
        "may land on the standby: forward to the leader's pod, named in the Lease: "
        f"`{LEADER_PORT_FORWARD}`.",
    ),
    "migrate": (
        "install the change-notify trigger (idempotent)",
        "Install or update the trigger that NOTIFYs execution changes on NOTIFY_CHANNEL. "
        "Running it again changes nothing. Every lock is asked with "
        "MIGRATE_LOCK_TIMEOUT_SECONDS and retried up to MIGRATE_DEADLINE_SECONDS; then exit 3, "
        "naming the sessions holding it, nothing changed. --with-schema also creates the "
        "development schema (never needed against a production database).",
    ),
    "cancel-create": (
        "retire a cancelled create (fenced) and delete its pod if retired",
        "Retire the execution of SANDBOX_ID/GENERATION fenced on ACTIVATION_ATTEMPT. If the "
        "execution naming the pod is retired (by this call or earlier), delete the pod under "
        "its UID precondition; if it is still active (a newer activation owns the pod), leave "
        "the pod alone. Needs the UPDATE grant (deploy/db-role).",
    ),
    "config": (
        "print the effective configuration (secrets masked)",
        "Read the environment like `run` does and print every variable's effective value and "
        "whether it came from the environment or the default. Exit 2 naming the variable when "
        "one cannot be parsed.",
    ),
}
"""Each command's line in ``--help`` and its description (``COMMAND --help``)."""
WITHOUT_DATABASE = frozenset({"pending", "config"})
"""The commands that run without a database URL."""


def _timeout(command: argparse.ArgumentParser, default_s: float, help_: str) -> None:
    command.add_argument("--timeout", type=_positive_float, default=default_s, help=help_)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="retired-pod-gc",
        description=(
            "Delete sandbox pods whose execution was retired in PostgreSQL, safely. "
            f"Configured through {config.PREFIX}* environment variables "
            "(see docs/configuration.md); the Kubernetes connection comes from the "
            "in-cluster service account or KUBECONFIG."
        ),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cmd = {
        name: sub.add_parser(name, help=summary, description=description)
        for name, (summary, description) in COMMANDS.items()
    }
    for name, command in cmd.items():
        command.set_defaults(needs_database=name not in WITHOUT_DATABASE)

    cmd["scan"].add_argument("--output", choices=("text", "json"), default="text")
    _timeout(cmd["scan"], 60.0, "seconds to list pods")

    cmd["explain"].add_argument("pod", metavar="NAMESPACE/POD")
    cmd["explain"].add_argument(
        "--url",
        default=None,
        type=_http_url,
        help=(
            f"the leader's debug listener (DEBUG_BIND_ADDRESS), e.g. http://127.0.0.1:{DEBUG_PORT}"
            " (kubectl port-forward)"
        ),
    )
    _timeout(cmd["explain"], 5.0, "seconds to wait for --url")

    cmd["pending"].add_argument(
        "--url",
        default=f"http://127.0.0.1:{DEBUG_PORT}",
        type=_http_url,
        help="the leader's debug listener, DEBUG_BIND_ADDRESS (default %(default)s)",
    )
    cmd["pending"].add_argument("--output", choices=("text", "json"), default="text")
    cmd["pending"].add_argument(
        "--limit",
        type=_positive_int,
        default=None,
        help="show the N soonest due (the service's default: 1000)",
    )
    _timeout(cmd["pending"], 5.0, "seconds to wait for the answer")

    cmd["migrate"].add_argument(
        "--with-schema", action="store_true", help="also create the dev schema"
    )

    cmd["cancel-create"].add_argument("sandbox_id")
    cmd["cancel-create"].add_argument("generation", type=int)
    cmd["cancel-create"].add_argument("activation_attempt", type=int)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return signals.exit_code_of(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    settings = _settings_or_exit(need_database=args.needs_database)
    if isinstance(settings, int):
        return settings
    return _dispatch(settings, args)


if __name__ == "__main__":
    sys.exit(main())
