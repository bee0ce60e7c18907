"""The emulator's watch fan-out: watch history, open watch streams and their faults."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from devtools.emulator import statuses as st
from devtools.emulator.faults import Faults
from devtools.emulator.statuses import PODS, Resource
from devtools.emulator.store import Entry, Store, Table
from devtools.emulator.watcher import Watcher


class WatchExpiredError(Exception):
    """The requested resourceVersion is outside the history window (or a 410 was injected)."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body["message"])
        self.body = body


class WatchListSupport(StrEnum):
    """How the server treats a streaming list (``sendInitialEvents``)."""

    SUPPORTED = "supported"
    """As kube-apiserver with the WatchList feature (on by default since v1.32)."""
    REJECTED = "rejected"
    """422 ``Invalid`` on ``sendInitialEvents``, as a server with the feature gate off (or an
    aggregated API server) answers."""
    IGNORED = "ignored"
    """The streaming parameters are dropped (as by an old server or a proxy that strips them):
    the watch sends the current state as ADDED events but never the initial-events-end
    bookmark."""


class Watches(Store):
    """Store changes fanned out to open watches, and watches opened from a resourceVersion."""

    faults: Faults
    watch_list: WatchListSupport

    def _emit(self, table: Table, etype: bytes, entry: Entry) -> None:
        rv = self._rv
        history = table.history
        if history.maxlen is not None and len(history) == history.maxlen:
            table.compacted_rv = history[0][0]
        history.append((rv, etype, entry))
        if not table.watchers:
            return
        line: bytes | None = None
        for w in table.watchers:
            if w.namespace is not None and w.namespace != entry.namespace:
                continue
            if w.matcher is not None and not w.matcher(entry.labels):
                continue
            if line is None:
                line = self._event_line(table, etype, entry.body)
            w.lines.append(line)
            w.wake.set()

    @staticmethod
    def _event_line(table: Table, etype: bytes, body: bytes) -> bytes:
        return b'{"type":"' + etype + b'","object":' + table.prefix + body[1:] + b"}\n"

    def bookmark_line(self, res: Resource) -> bytes:
        return self._bookmark(res, initial_events_end=False)

    def _bookmark(self, res: Resource, *, initial_events_end: bool) -> bytes:
        annotations = (
            b',"annotations":{"k8s.io/initial-events-end":"true"}' if initial_events_end else b""
        )
        return (
            b'{"type":"BOOKMARK","object":'
            + self.table(res).prefix
            + b'"metadata":{"resourceVersion":"%d"' % self._rv
            + annotations
            + b'},"spec":{"containers":null},"status":{}}}\n'
        )

    # ------------------------------------------------------------------ watch

    def open_watch(
        self,
        res: Resource,
        namespace: str | None,
        *,
        selector: str = "",
        resource_version: str = "",
        resource_version_match: str = "",
        send_initial_events: bool | None = None,
        bookmarks: bool = False,
    ) -> Watcher:
        """Register a watcher and queue what it must see first.

        ``send_initial_events`` (a streaming list) queues the current state as ADDED events and,
        with ``bookmarks``, the BOOKMARK annotated ``k8s.io/initial-events-end`` at the version
        that state is consistent with; how far that is honoured follows :attr:`watch_list`.
        Raises :class:`WatchExpiredError` when ``resource_version`` is older than the history,
        and the 422 or 504 the server answers to options it rejects.
        """
        matcher = self._matcher(selector)
        table = self.table(res)
        if self.watch_list is WatchListSupport.IGNORED:
            resource_version_match, send_initial_events = "", None
        else:
            self._validate_watch_options(resource_version_match, send_initial_events)
        if self.faults.expire_watches > 0:
            self.faults.expire_watches -= 1
            raise WatchExpiredError(st.too_old_watch(resource_version or "0", self._oldest(table)))
        w = Watcher(namespace, matcher)
        if send_initial_events is not None:
            since = self._version(resource_version) if resource_version else 0
            if since > self._rv:
                raise st.too_large_resource_version(since, self._rv)
            if send_initial_events:
                self._queue_state(table, w)
                if bookmarks:
                    w.lines.append(self._bookmark(res, initial_events_end=True))
        elif resource_version in ("", "0"):
            # No version: the current state as ADDED events, then changes.
            self._queue_state(table, w)
        else:
            since = self._version(resource_version)
            if since < table.compacted_rv:
                raise WatchExpiredError(st.too_old_watch(resource_version, self._oldest(table)))
            for rv, etype, e in table.history:
                if rv > since and self._watch_matches(w, e):
                    w.lines.append(self._event_line(table, etype, e.body))
        table.watchers.add(w)
        return w

    def _validate_watch_options(self, match: str, send_initial_events: bool | None) -> None:
        causes: list[tuple[str, str, str]] = []
        if send_initial_events is not None:
            if match != "NotOlderThan":
                causes.append(
                    (
                        "resourceVersionMatch",
                        "Forbidden",
                        "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
                    )
                )
            if self.watch_list is WatchListSupport.REJECTED:
                causes.append(
                    (
                        "sendInitialEvents",
                        "Forbidden",
                        "sendInitialEvents is forbidden for watch unless the WatchList feature "
                        "gate is enabled",
                    )
                )
        if match:
            if send_initial_events is None:
                causes.append(
                    (
                        "resourceVersionMatch",
                        "Forbidden",
                        "resourceVersionMatch is forbidden for watch unless sendInitialEvents "
                        "is provided",
                    )
                )
            if match != "NotOlderThan":
                causes.append(
                    (
                        "resourceVersionMatch",
                        "Unsupported value",
                        f'"{match}": supported values: "NotOlderThan"',
                    )
                )
        if causes:
            raise st.invalid_list_options(*causes)

    @staticmethod
    def _version(raw: str) -> int:
        try:
            return int(raw)
        except ValueError:
            raise st.bad_request(f"invalid resourceVersion {raw!r}") from None

    def _queue_state(self, table: Table, w: Watcher) -> None:
        for key in table.sorted_keys():
            e = table.entries[key]
            if self._watch_matches(w, e):
                w.lines.append(self._event_line(table, b"ADDED", e.body))

    @staticmethod
    def _watch_matches(w: Watcher, e: Entry) -> bool:
        if w.namespace is not None and w.namespace != e.namespace:
            return False
        return w.matcher is None or w.matcher(e.labels)

    def _oldest(self, table: Table) -> int:
        return table.history[0][0] if table.history else self._rv

    def close_watch(self, res: Resource, w: Watcher) -> None:
        self.table(res).watchers.discard(w)

    def open_watch_count(self) -> int:
        return sum(len(t.watchers) for t in self._tables.values())

    # ------------------------------------------------------------------ faults

    def drop_watches(self, *, abrupt: bool = True) -> int:
        """End every open watch stream: ``abrupt`` cuts the connection mid-stream, otherwise the
        stream ends cleanly (as at ``timeoutSeconds``). Returns how many were open."""
        count = 0
        for table in self._tables.values():
            for w in table.watchers:
                w.abort = abrupt
                w.closed = True
                if abrupt:
                    w.lines.clear()  # what was still in flight is lost with the connection
                w.wake.set()
                count += 1
            # Detached at once: changes made from now on are not queued on the old streams.
            table.watchers = set()
        return count

    def inject_watch_line(self, line: bytes, res: Resource = PODS) -> int:
        """Send ``line`` (raw bytes, e.g. a malformed event) on every open watch of ``res``."""
        table = self.table(res)
        for w in table.watchers:
            w.lines.append(line if line.endswith(b"\n") else line + b"\n")
            w.wake.set()
        return len(table.watchers)

    def expire_next_watches(self, count: int = 1) -> None:
        """The next ``count`` watch requests get a 410 Expired ERROR event."""
        self.faults.expire_watches += count

    def compact(self) -> None:
        """Forget the watch history and every paginated list snapshot (as etcd compaction
        would): watches from older versions get 410, continue tokens expire."""
        for table in self._tables.values():
            table.history.clear()
            table.compacted_rv = self._rv
        self._snapshots.clear()
