"""The order of the pipeline's stages is held by types: mypy --strict rejects a DELETE (or a
dry-run report) of a candidate that has not passed verification and the final check.

Each snippet is checked by mypy as the project checks ``service/`` (``--strict``); the one that
follows the stages must pass, so that the errors of the others are the stages' doing."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from mypy import api

_HEADER = """
from service.engine.delete import Deleter
from service.engine.results import ReconcileResult
from service.engine.stages import Checked, Due, Verified
from service.engine.verify import Verifier


async def act(
    verifier: Verifier, deleter: Deleter, due: Due, verified: Verified, checked: Checked
) -> ReconcileResult:
"""

_ALLOWED = "    return await deleter.delete(checked)\n"
_FORBIDDEN = {
    "delete_unverified": (
        "    return await deleter.delete(due)\n",
        'Argument 1 to "delete" of "Deleter" has incompatible type "Due"; expected "Checked"',
    ),
    "delete_unchecked": (
        "    return await deleter.delete(verified)\n",
        'Argument 1 to "delete" of "Deleter" has incompatible type "Verified"; expected "Checked"',
    ),
    "report_unchecked": (
        "    return deleter.report_dry_run(verified)\n",
        'Argument 1 to "report_dry_run" of "Deleter" has incompatible type "Verified"; '
        'expected "Checked"',
    ),
    "final_check_unverified": (
        "    await verifier.final_check(due)\n    return await deleter.delete(checked)\n",
        'Argument 1 to "final_check" of "Verifier" has incompatible type "Due"; '
        'expected "Verified"',
    ),
}


def _mypy(tmp_path: Path, body: str) -> tuple[str, int]:
    snippet = tmp_path / "snippet.py"
    snippet.write_text(textwrap.dedent(_HEADER) + body)
    stdout, stderr, status = api.run(["--strict", "--no-error-summary", str(snippet)])
    return stdout + stderr, status


def test_a_delete_of_a_checked_candidate_type_checks(tmp_path: Path) -> None:
    out, status = _mypy(tmp_path, _ALLOWED)
    assert status == 0, out


@pytest.mark.parametrize("case", sorted(_FORBIDDEN))
def test_skipping_a_stage_is_a_type_error(tmp_path: Path, case: str) -> None:
    body, error = _FORBIDDEN[case]
    out, status = _mypy(tmp_path, body)
    assert status == 1, out
    assert error in out, out
