"""``python -m devtools.emulator --port N``: serve the API server emulator until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

from devtools.emulator.core import Emulator
from devtools.emulator.server import start_emulator
from devtools.emulator.watch import WatchListSupport


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m devtools.emulator", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--history-size", type=int, default=10_000)
    parser.add_argument("--bookmark-interval-s", type=float, default=60.0)
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
    parser.add_argument("--namespace", action="append", default=[], help="create this namespace")
    parser.add_argument("--pods", type=int, default=0, help="bulk-create this many sandbox pods")
    return parser.parse_args(argv)


async def _serve(args: argparse.Namespace) -> None:
    emulator = Emulator(
        history_size=args.history_size,
        bookmark_interval_s=args.bookmark_interval_s,
        kubelet_finish_after_s=args.kubelet_finish_after_s,
        watch_list=WatchListSupport(args.watch_list),
    )
    for name in args.namespace:
        emulator.ensure_namespace(name)
    if args.pods:
        emulator.bulk_create_pods(namespace=(args.namespace or ["sandboxes"])[0], count=args.pods)
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
        asyncio.run(_serve(_parse_args(argv)))


if __name__ == "__main__":
    main()
