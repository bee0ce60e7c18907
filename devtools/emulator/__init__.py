"""An in-process Kubernetes API server emulator over real HTTP (aiohttp).

It reproduces the wire behaviour the controller depends on (see ``shared/wire-samples``):
paginated lists consistent at one resourceVersion, watch streams with bookmarks and 410 Expired,
preconditioned and graceful pod deletion, Lease optimistic concurrency, the Table form of pods
that ``kubectl get pods`` asks for, and fault injection with an audit log. It powers the
integration tests, the demo, the benchmarks and the runbook's kubectl commands in tests.
"""

from devtools.emulator.core import Emulator
from devtools.emulator.faults import AuditEntry
from devtools.emulator.server import RunningEmulator, build_app, start_emulator

__all__ = ["AuditEntry", "Emulator", "RunningEmulator", "build_app", "start_emulator"]
