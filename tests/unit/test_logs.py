"""Structured logs: one JSON object a line, reconcile id carried by context."""

from __future__ import annotations

import io
import json
import logging

from service import logs


def _capture(fmt: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(fmt)
    logger = logging.getLogger("test.logs")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, stream


def test_json_lines_carry_message_extra_fields_and_reconcile_id() -> None:
    logger, stream = _capture(logs.JsonFormatter())
    token = logs.reconcile_id.set("r-42")
    try:
        logger.info("would reap %s", "sandboxes/p1", extra={"verdict": "terminal_retired"})
    finally:
        logs.reconcile_id.reset(token)
    logger.info("outside")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["msg"] == "would reap sandboxes/p1"
    assert first["verdict"] == "terminal_retired"
    assert first["reconcile_id"] == "r-42"
    assert first["level"] == "info"
    assert "reconcile_id" not in second


def test_exceptions_stay_on_one_line() -> None:
    logger, stream = _capture(logs.JsonFormatter())
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("failed")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert "RuntimeError: boom" in json.loads(lines[0])["exc"]
