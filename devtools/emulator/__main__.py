"""``python -m devtools.emulator --port N``: serve the API server emulator until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from pathlib import Path

from devtools.emulator.auth import DEFAULT_USER, TokenAuth
from devtools.emulator.core import Emulator
from devtools.emulator.flowcontrol import DEFAULT_SEAT_TIME_S, FlowControl
from devtools.emulator.server import start_emulator
from devtools.emulator.watch import WatchListSupport


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m devtools.emulator", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--history-size", type=int, default=10_000)
    parser.add_argument(
        "--bookmark-interval-s",
        type=float,
        default=60.0,
        help="a watch that allows bookmarks gets a BOOKMARK this often (a real server: 60)",
    )
    parser.add_argument(
        "--kubelet-finish-after-s",
        type=float,
        default=None,
        help="finish graceful pod deletions after this many seconds (default: never)",
    )
    parser.add_argument(
        "--watch-list",
        choices=[w.value for w in WatchListSupport],
        default=WatchListSupport.SUPPORTED.value,
        help="streaming lists (sendInitialEvents): supported, rejected (422) or ignored",
    )
    parser.add_argument(
        "--auth",
        action="store_true",
        help="require a bearer token the emulator issued (POST /_emulator/tokens): else 401",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="accept the token this file holds at each request (implies --auth)",
    )
    parser.add_argument(
        "--token-user", default=DEFAULT_USER, help="the user of --token-file's and --token's"
    )
    parser.add_argument(
        "--token", action="append", default=[], help="accept this token (implies --auth)"
    )
    parser.add_argument(
        "--apf-seats",
        type=int,
        default=0,
        help="seats per user: requests beyond them are answered 429 (default 0: no throttling)",
    )
    parser.add_argument("--apf-retry-after-s", type=int, default=1)
    parser.add_argument("--apf-seat-time-s", type=float, default=DEFAULT_SEAT_TIME_S)
    parser.add_argument(
        "--apf-user", action="append", default=None, help="throttle only this user (repeatable)"
    )
    parser.add_argument("--namespace", action="append", default=[], help="create this namespace")
    parser.add_argument("--pods", type=int, default=0, help="bulk-create this many sandbox pods")
    return parser.parse_args(argv)


def build_emulator(args: argparse.Namespace) -> Emulator:
    """The emulator the command line describes."""
    emulator = Emulator(
        history_size=args.history_size,
        bookmark_interval_s=args.bookmark_interval_s,
        kubelet_finish_after_s=args.kubelet_finish_after_s,
        watch_list=WatchListSupport(args.watch_list),
        auth=TokenAuth(
            enabled=bool(args.auth or args.token_file or args.token),
            token_file=args.token_file,
            token_file_user=args.token_user,
        ),
        flow_control=FlowControl(
            seats=args.apf_seats,
            retry_after_s=args.apf_retry_after_s,
            seat_time_s=args.apf_seat_time_s,
            users=args.apf_user,
        )
        if args.apf_seats > 0
        else None,
    )
    for token in args.token:
        emulator.auth.issue(args.token_user, token)
    for name in args.namespace:
        emulator.ensure_namespace(name)
    if args.pods:
        emulator.bulk_create_pods(namespace=(args.namespace or ["sandboxes"])[0], count=args.pods)
    return emulator


async def _serve(args: argparse.Namespace) -> None:
    emulator = build_emulator(args)
    running = await start_emulator(args.host, args.port, emulator=emulator)
    # The one line a parent process reads to learn the URL.
    sys.stdout.write(f"emulator listening on {running.url}\n")
    sys.stdout.flush()
    try:
        await asyncio.Event().wait()
    finally:
        await running.aclose()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(parse_args(argv)))


if __name__ == "__main__":
    main()
