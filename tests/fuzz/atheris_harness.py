"""Coverage-guided fuzzing (atheris) of the pod decoder, the NOTIFY parser and config loading.

Optional: atheris is not a project dependency (``.venv/bin/pip install atheris``). Run one
target, bounded, e.g.::

    .venv/bin/python -m tests.fuzz.atheris_harness decode -atheris_runs=200000
    .venv/bin/python -m tests.fuzz.atheris_harness payload -max_total_time=60
    .venv/bin/python -m tests.fuzz.atheris_harness config -atheris_runs=100000

Each target fails (an uncaught exception, which atheris reports with the crashing input) on
anything but the documented outcome: a snapshot or ``PodDecodeError``; a change or ``None``;
settings or ``ConfigError``. The decode target also checks that no input decodes into a
snapshot that the classifier would reap without the raw JSON having the reapable shape.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable


def load_targets() -> dict[str, Callable[[bytes], None]]:
    """Import the code under test (inside ``atheris.instrument_imports`` when fuzzing)."""
    # ruff: noqa: PLC0415 (late imports are the point: they happen under instrumentation)
    from service.classifier import classify
    from service.config import VARIABLES, ConfigError, load
    from service.domain import ExecutionState
    from service.kube.decode import PodDecodeError, PodDecoder
    from service.pg.payload import parse_payload
    from tests.fuzz.test_fuzz_inputs import raw_has_reapable_shape, retired_row_for

    decoder = PodDecoder()
    names = [v.name for v in VARIABLES]

    def fuzz_decode(data: bytes) -> None:
        try:
            snap = decoder.decode(data)
        except PodDecodeError:
            return
        for state in (ExecutionState.REPLACED, ExecutionState.SUSPENDED):
            decision = classify(snap, retired_row_for(snap, state))
            if decision.verdict is not None:
                doc = json.loads(data)
                if not raw_has_reapable_shape(doc, decision.verdict):
                    raise AssertionError(f"reaped a pod without the reapable shape: {data!r}")

    def fuzz_payload(data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        parsed = parse_payload(text, received_at_s=0.0, namespaces=("sandboxes",))
        if any(not (c.namespace and c.pod_name) for c in parsed.changes):
            raise AssertionError(f"a change without a key: {text!r}")

    def fuzz_config(data: bytes) -> None:
        env: dict[str, str] = {}
        for i, chunk in enumerate(data.split(b"\x00")[:8]):
            if chunk:
                env[names[(chunk[0] + i) % len(names)]] = chunk[1:].decode("utf-8", "replace")
        try:
            loaded = load(env)
        except ConfigError:
            return
        if not 1 <= loaded.threshold_s <= 86400:
            raise AssertionError(f"threshold out of range: {env!r}")

    return {"decode": fuzz_decode, "payload": fuzz_payload, "config": fuzz_config}


def main() -> None:
    import atheris  # type: ignore[import-untyped]  # optional: imported only when fuzzing

    with atheris.instrument_imports():
        targets = load_targets()
    if len(sys.argv) < 2 or sys.argv[1] not in targets:
        raise SystemExit(f"usage: atheris_harness {{{'|'.join(targets)}}} [libFuzzer flags]")
    target = targets[sys.argv[1]]
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
