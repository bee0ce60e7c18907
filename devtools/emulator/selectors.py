"""Kubernetes label selectors: parsing the query-string form and matching label maps.

Supports the set-based grammar the API server accepts: ``k=v``, ``k==v``, ``k!=v``,
``k in (a,b)``, ``k notin (a,b)``, ``k`` (exists) and ``!k`` (does not exist), comma-joined.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from functools import lru_cache

Matcher = Callable[[Mapping[str, str] | None], bool]

_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_SET_TERM = re.compile(rf"\s*(?P<key>{_KEY})\s+(?P<op>in|notin)\s*\((?P<values>[^)]*)\)\s*")
_EQ_TERM = re.compile(rf"\s*(?P<key>{_KEY})\s*(?P<op>==|!=|=)\s*(?P<value>{_VALUE})\s*")
_EXISTS_TERM = re.compile(rf"\s*(?P<neg>!?)\s*(?P<key>{_KEY})\s*")
_VALUE_RE = re.compile(_VALUE)


class SelectorError(ValueError):
    """A label selector the API server would reject (400 BadRequest)."""


def _split_terms(selector: str) -> list[str]:
    # Commas inside "in (a,b)" belong to the term, not the selector.
    terms: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(selector):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            terms.append(selector[start:i])
            start = i + 1
    terms.append(selector[start:])
    return [t for t in terms if t.strip()]


Requirement = tuple[str, str, frozenset[str]]


def _parse_term(term: str) -> Requirement:
    m = _SET_TERM.fullmatch(term)
    if m:
        values = frozenset(v.strip() for v in m["values"].split(",") if v.strip())
        for v in values:
            if not _VALUE_RE.fullmatch(v):
                raise SelectorError(f"invalid label value {v!r} in {term.strip()!r}")
        return m["key"], m["op"], values
    m = _EQ_TERM.fullmatch(term)
    if m:
        op = "!=" if m["op"] == "!=" else "="
        return m["key"], op, frozenset({m["value"]})
    m = _EXISTS_TERM.fullmatch(term)
    if m:
        return m["key"], "!" if m["neg"] else "exists", frozenset()
    raise SelectorError(f"unable to parse requirement: {term.strip()!r}")


@lru_cache(maxsize=256)
def parse_selector(selector: str) -> tuple[Requirement, ...]:
    """Parse a selector string; the empty string selects everything."""
    return tuple(_parse_term(t) for t in _split_terms(selector))


def _matches(requirements: tuple[Requirement, ...], labels: Mapping[str, str] | None) -> bool:
    lab = labels or {}
    for key, op, values in requirements:
        present = key in lab
        if op == "=":
            if not present or lab[key] not in values:
                return False
        elif op in {"!=", "notin"}:
            if present and lab[key] in values:
                return False
        elif op == "in":
            if not present or lab[key] not in values:
                return False
        elif op == "exists":
            if not present:
                return False
        elif present:  # "!"
            return False
    return True


def compile_selector(selector: str | None) -> Matcher | None:
    """A predicate over label maps, or ``None`` when the selector selects everything."""
    if not selector:
        return None
    requirements = parse_selector(selector)
    if not requirements:
        return None
    return lambda labels: _matches(requirements, labels)
