"""Field selectors on pod lists (``kubectl get pods --field-selector status.phase=Succeeded``).

The fields a real server selects pods by (its pod registry's selectable fields), with ``=``,
``==`` and ``!=`` terms joined by commas. A field outside that set is the real server's 400
(``field label not supported``). Lists only: a watch with a field selector is refused (400)
rather than served unfiltered. A filtered page may hold fewer than ``limit`` items, as on a real
server, and carries no ``remainingItemCount`` (unknown once a selector filters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devtools.emulator import statuses as st

POD_FIELDS: dict[str, Callable[[dict[str, Any]], str]] = {
    "metadata.name": lambda p: str((p.get("metadata") or {}).get("name") or ""),
    "metadata.namespace": lambda p: str((p.get("metadata") or {}).get("namespace") or ""),
    "spec.nodeName": lambda p: str((p.get("spec") or {}).get("nodeName") or ""),
    "spec.restartPolicy": lambda p: str((p.get("spec") or {}).get("restartPolicy") or ""),
    "spec.schedulerName": lambda p: str((p.get("spec") or {}).get("schedulerName") or ""),
    "spec.serviceAccountName": lambda p: str((p.get("spec") or {}).get("serviceAccountName") or ""),
    "spec.hostNetwork": lambda p: "true" if (p.get("spec") or {}).get("hostNetwork") else "false",
    "status.phase": lambda p: str((p.get("status") or {}).get("phase") or ""),
    "status.podIP": lambda p: str((p.get("status") or {}).get("podIP") or ""),
    "status.nominatedNodeName": lambda p: str(
        (p.get("status") or {}).get("nominatedNodeName") or ""
    ),
}


def pod_matcher(selector: str) -> Callable[[dict[str, Any]], bool]:
    """A predicate on pod objects; raises the 400 a real server answers for a bad selector."""
    terms: list[tuple[Callable[[dict[str, Any]], str], str, bool]] = []
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negate = "!=" in term
        key, sep, value = term.partition("!=" if negate else "=")
        key, value = key.strip(), value.removeprefix("=").strip()
        if not sep or not key:
            raise st.bad_request(f"invalid field selector: {term!r}")
        field = POD_FIELDS.get(key)
        if field is None:
            raise st.bad_request(f"field label not supported: {key}")
        terms.append((field, value, negate))

    def matches(pod: dict[str, Any]) -> bool:
        return all((field(pod) == value) != negate for field, value, negate in terms)

    return matches
