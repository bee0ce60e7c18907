"""The kit's CauseLog: a line per change of cause and per recovery, with counts; what a cause is."""

from __future__ import annotations

import logging

import pytest

from service.kit.causelog import HOLD_S, SETTLE_S, CauseLog, cause_of
from service.kit.errors import ApiError, Unavailable


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> _Clock:
    return _Clock()


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="test.causelog")
    return caplog


def _log(clock: _Clock) -> CauseLog:
    return CauseLog("lookups fail", logging.getLogger("test.causelog"), now=clock)


def _wrapped(what: str, exc: BaseException) -> Unavailable:
    error = Unavailable(f"{what}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def test_a_cause_is_the_root_failure_without_keys_counts_or_addresses() -> None:
    refused = ConnectionRefusedError(111, "Connect call failed ('10.0.0.7', 5432)")
    a = cause_of(_wrapped("GET pod sandboxes/pod-a", refused))
    b = cause_of(
        _wrapped(
            "GET pod other/pod-b",
            ConnectionRefusedError(111, "Connect call failed ('10.0.0.8', 6443)"),
        )
    )
    assert a == b == "ConnectionRefusedError: [Errno #] Connect call failed (#, #)"
    assert cause_of(_wrapped("GET pod x/y", TimeoutError())) == "TimeoutError"
    # An answer is its status: the server's message may name the pod.
    assert cause_of(ApiError(503, 'pods "pod-a" is unavailable')) == "ApiError 503"
    assert cause_of(ApiError(503, 'pods "pod-b" is down')) == "ApiError 503"
    assert cause_of(ApiError(429, "slow down")) == "ApiError 429"


def test_one_line_per_change_of_cause_and_one_for_the_recovery_with_counts(
    clock: _Clock, logged: pytest.LogCaptureFixture
) -> None:
    log = _log(clock)
    lines = logged.records
    for i in range(1000):
        log.failed("refused", f"refused (key {i})")
    for _ in range(7):
        log.failed("timeout")
    log.ok()
    log.ok()
    assert [r.getMessage() for r in lines] == [
        "lookups fail: refused (key 0)",
        "lookups fail: timeout (the cause changed after 1000 failures)",
        "lookups fail: works again after 1007 failures",
    ]
    assert [(r.levelname, r.failing, r.cause, r.failures) for r in lines] == [  # type: ignore[attr-defined]
        ("WARNING", "lookups fail", "refused", 1),
        ("WARNING", "lookups fail", "timeout", 1001),
        ("INFO", "lookups fail", None, 1007),
    ]
    assert log.cause is None and log.failures == 0


def test_stragglers_of_an_outage_that_just_ended_are_counted_not_logged(
    clock: _Clock, logged: pytest.LogCaptureFixture
) -> None:
    log = _log(clock)
    lines = logged.records
    log.failed("timeout")
    clock.t = 600.0
    log.ok()
    # Requests sent before the recovery time out while new ones work.
    for _ in range(30):
        clock.t += 0.1
        log.failed("timeout", "timeout of a request sent before")
        # What readiness reports still names it, logged or not.
        assert log.cause == "timeout of a request sent before"
        log.ok()
    assert len(lines) == 2
    assert log.cause is None
    # Another cause is logged at once.
    log.failed("refused")
    assert lines[-1].getMessage() == "lookups fail: refused"


def test_the_same_cause_again_is_logged_once_it_persists_or_after_the_hold(
    clock: _Clock, logged: pytest.LogCaptureFixture
) -> None:
    log = _log(clock)
    lines = logged.records
    log.failed("timeout")
    clock.t = 100.0
    log.ok()
    # A second outage right after the first: nothing works any more.
    clock.t += 1.0
    log.failed("timeout")
    assert len(lines) == 2
    clock.t += SETTLE_S
    log.failed("timeout")
    assert lines[-1].getMessage() == "lookups fail: timeout"
    assert lines[-1].failures == 2  # type: ignore[attr-defined]
    log.ok()
    # Long after a recovery, the first failure is logged at once.
    clock.t += HOLD_S
    log.ok()
    log.failed("timeout")
    assert [r.getMessage() for r in lines[-2:]] == [
        "lookups fail: works again after 2 failures",
        "lookups fail: timeout",
    ]
