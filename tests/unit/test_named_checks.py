"""The mutation check disables safety checks by name (tests/chaos/removals.py): every check of
``service/checks.py`` has a removal (or a calibration revert), every rule of the classifier a
rule removal, and each removal replaces a named unit for its duration and puts the original
back."""

from __future__ import annotations

import types

import pytest

from service import checks, classifier
from service.engine.budget import DeleteBudget
from service.engine.controller import Controller
from service.engine.delete import Deleter
from service.engine.reconciler import Reconciler
from service.engine.verify import Verifier
from tests.chaos.removals import REMOVALS, RULE_REMOVALS, replaced
from tests.sim.calibration import REVERTS

_OWNERS = (checks, classifier, Controller, Reconciler, Verifier, Deleter, DeleteBudget)
_APPLIED = {**REMOVALS, **REVERTS, **RULE_REMOVALS}


def _units() -> dict[tuple[str, str], object]:
    """Every function of the checks module and every method of the engine's classes."""
    return {
        (owner.__name__, name): value
        for owner in _OWNERS
        for name, value in vars(owner).items()
        if isinstance(value, types.FunctionType)
    }


def test_each_removal_replaces_named_units_and_restores_them() -> None:
    before = _units()
    for name, removal in _APPLIED.items():
        with removal():
            during = _units()
            assert any(during[unit] is not value for unit, value in before.items()), name
        assert _units() == before, f"{name} did not put the original back"


def test_every_check_of_the_checks_module_has_a_removal() -> None:
    defined = {
        name
        for name, value in vars(checks).items()
        if isinstance(value, types.FunctionType) and value.__module__ == checks.__name__
    }
    original = dict(vars(checks))
    removed: set[str] = set()
    for removal in _APPLIED.values():
        with removal():
            removed |= {name for name in defined if vars(checks)[name] is not original[name]}
    assert removed == defined


def test_every_rule_of_the_classifier_has_a_removal() -> None:
    # A rule answers a skip decision or None; prefilter and _identity_mismatch chain the rules.
    rules = {
        name
        for name, value in vars(classifier).items()
        if isinstance(value, types.FunctionType)
        and value.__module__ == classifier.__name__
        and value.__annotations__.get("return") == "Decision | None"
    } - {"prefilter", "_identity_mismatch"}
    original = dict(vars(classifier))
    removed: set[str] = set()
    for removal in RULE_REMOVALS.values():
        with removal():
            removed |= {name for name in rules if vars(classifier)[name] is not original[name]}
    assert rules and removed == rules


def test_a_removal_of_a_name_that_does_not_exist_raises() -> None:
    with (
        pytest.raises(RuntimeError, match="no check named 'no_such_check'"),
        replaced(checks, "no_such_check", lambda: True),
    ):
        pass
