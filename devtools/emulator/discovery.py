"""API discovery as kube-apiserver serves it: ``/version``, ``/api``, ``/api/v1``, ``/apis``,
``/apis/<group>`` and ``/apis/<group>/<version>``, in the legacy form and, when the client's
Accept header asks for it, the aggregated form (``apidiscovery.k8s.io/v2``).

What is discovered is :data:`SERVED`: add an :class:`ApiResource` there when the emulator learns
a new resource, and every document (and its group) follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from devtools.emulator.events import EVENTS
from devtools.emulator.statuses import LEASES, NAMESPACES, PODS, Resource

AGGREGATED = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
_CRUD = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
_STATUS = ("get", "patch", "update")

VERSION: dict[str, str] = {
    "major": "1",
    "minor": "36",
    "emulationMajor": "1",
    "emulationMinor": "36",
    "minCompatibilityMajor": "1",
    "minCompatibilityMinor": "35",
    "gitVersion": "v1.36.2-emulator",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-11-30T00:00:00Z",
    "goVersion": "go1.27.3",
    "compiler": "gc",
    "platform": "linux/amd64",
}


@dataclass(frozen=True, slots=True)
class ApiResource:
    """One served resource as discovery describes it."""

    res: Resource
    singular: str
    verbs: tuple[str, ...]
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    storage_version_hash: str = ""
    subresources: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(subresource, verbs); only those the emulator serves."""

    @property
    def group_version(self) -> str:
        return self.res.api_version


SERVED: tuple[ApiResource, ...] = (
    ApiResource(
        PODS,
        "pod",
        _CRUD,
        short_names=("po",),
        categories=("all",),
        storage_version_hash="xPOwRZ+Yhw8=",
        subresources=(("status", _STATUS),),
    ),
    ApiResource(
        NAMESPACES,
        "namespace",
        ("create", "delete", "get", "list", "patch", "update", "watch"),
        short_names=("ns",),
        storage_version_hash="Q3oi5N2YM8M=",
        subresources=(("status", _STATUS),),
    ),
    ApiResource(LEASES, "lease", _CRUD, storage_version_hash="gqkMMb/YqFM="),
    # Only the verbs the emulator serves for Events (a real server has all of them).
    ApiResource(
        EVENTS,
        "event",
        ("create", "get", "list"),
        short_names=("ev",),
        storage_version_hash="r2yiGXH7wu8=",
    ),
)


def wants_aggregated(accept: str) -> bool:
    """Whether an Accept header asks for aggregated discovery (clients list it first)."""
    for part in accept.split(","):
        params = {p.strip() for p in part.split(";")[1:]}
        if {"g=apidiscovery.k8s.io", "v=v2", "as=APIGroupDiscoveryList"} <= params:
            return True
    return False


def _split(group_version: str) -> tuple[str, str]:
    group, _, version = group_version.rpartition("/")
    return group, version


def _of(group: str, version: str) -> list[ApiResource]:
    return sorted(
        (r for r in SERVED if _split(r.group_version) == (group, version)),
        key=lambda r: r.res.plural,
    )


def groups() -> list[str]:
    """The named groups served, in order of first appearance."""
    return list(dict.fromkeys(r.res.group for r in SERVED if r.res.group))


def _versions(group: str) -> list[str]:
    return list(dict.fromkeys(_split(r.group_version)[1] for r in SERVED if r.res.group == group))


def api_versions(server_address: str) -> dict[str, Any]:
    """``GET /api``."""
    return {
        "kind": "APIVersions",
        "versions": _versions(""),
        "serverAddressByClientCIDRs": [
            {"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}
        ],
    }


def _group_entry(group: str) -> dict[str, Any]:
    versions = [{"groupVersion": f"{group}/{v}", "version": v} for v in _versions(group)]
    return {"name": group, "versions": versions, "preferredVersion": versions[0]}


def api_group_list() -> dict[str, Any]:
    """``GET /apis``."""
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [_group_entry(g) for g in groups()],
    }


def api_group(group: str) -> dict[str, Any] | None:
    """``GET /apis/<group>``."""
    if group not in groups():
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group_entry(group)}


def resource_list(group: str, version: str) -> dict[str, Any] | None:
    """``GET /api/v1`` or ``GET /apis/<group>/<version>``."""
    served = _of(group, version)
    if not served:
        return None
    resources: list[dict[str, Any]] = []
    for r in served:
        entry: dict[str, Any] = {
            "name": r.res.plural,
            "singularName": r.singular,
            "namespaced": r.res.namespaced,
            "kind": r.res.kind,
            "verbs": list(r.verbs),
        }
        _add_names(entry, r)
        if r.storage_version_hash:
            entry["storageVersionHash"] = r.storage_version_hash
        resources.append(entry)
        resources.extend(
            {
                "name": f"{r.res.plural}/{sub}",
                "singularName": "",
                "namespaced": r.res.namespaced,
                "kind": r.res.kind,
                "verbs": list(verbs),
            }
            for sub, verbs in r.subresources
        )
    resources.sort(key=lambda e: e["name"])
    head: dict[str, Any] = {"kind": "APIResourceList"}
    if group:
        head["apiVersion"] = "v1"
    return {
        **head,
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": resources,
    }


def _add_names(entry: dict[str, Any], r: ApiResource) -> None:
    """The optional fields both forms carry only when set."""
    if r.short_names:
        entry["shortNames"] = list(r.short_names)
    if r.categories:
        entry["categories"] = list(r.categories)


def _aggregated_resource(r: ApiResource) -> dict[str, Any]:
    kind = {"group": "", "version": "", "kind": r.res.kind}
    entry: dict[str, Any] = {
        "resource": r.res.plural,
        "responseKind": kind,
        "scope": "Namespaced" if r.res.namespaced else "Cluster",
        "singularResource": r.singular,
        "verbs": list(r.verbs),
    }
    _add_names(entry, r)
    if r.subresources:
        entry["subresources"] = [
            {"subresource": sub, "responseKind": kind, "verbs": list(verbs)}
            for sub, verbs in r.subresources
        ]
    return entry


def aggregated(*, core: bool) -> dict[str, Any]:
    """``GET /api`` (``core``) or ``GET /apis`` in the aggregated form."""
    names = [""] if core else groups()
    items = [
        {
            "metadata": {"name": g} if g else {},
            "versions": [
                {
                    "version": v,
                    "resources": [_aggregated_resource(r) for r in _of(g, v)],
                    "freshness": "Current",
                }
                for v in _versions(g)
            ],
        }
        for g in names
    ]
    return {
        "kind": "APIGroupDiscoveryList",
        "apiVersion": "apidiscovery.k8s.io/v2",
        "metadata": {},
        "items": items,
    }
