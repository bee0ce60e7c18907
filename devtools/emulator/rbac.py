"""RBAC authorization of the emulator's API requests, off until a test installs a policy.

A kube-apiserver authorizes every request. Once a :class:`RbacPolicy` is installed
(``Emulator.rbac``), every API request acts as the policy's one subject (a service account) —
or, with token authentication on (``auth.py``), as its token's user, who is granted nothing
unless it is that subject — and is allowed only when a rule bound to that subject grants it, as
the RBAC authorizer decides:

- a RoleBinding in namespace N grants the rules of its Role (or ClusterRole) for requests in N;
- a ClusterRoleBinding grants its ClusterRole's rules everywhere, cluster-scoped requests and
  requests across all namespaces included;
- a rule matches when its apiGroups, resources (``pods``, ``pods/status``) and verbs hold the
  request's (or ``*``), and its resourceNames, when listed, hold the request's name (so such a
  rule never grants ``create``, ``list`` or ``watch``).

Verbs are the API server's: GET of a name is ``get``, of a collection ``list`` (``watch`` with
``watch=true``), POST ``create``, PUT ``update``, PATCH ``patch``, DELETE ``delete`` (of a
collection, ``deletecollection``). Discovery (``/api``, ``/apis``, ``/version``) is always
allowed, as ``system:discovery`` allows it to everybody. A denied request is answered 403 with
the Status a kube-apiserver writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from devtools.emulator import statuses as st

_VERB_OF_METHOD = {"POST": "create", "PUT": "update", "PATCH": "patch"}


@dataclass(frozen=True, slots=True)
class Attributes:
    """What the authorizer judges about one request."""

    verb: str
    group: str
    resource: str
    """The plural, with ``/subresource`` when there is one."""
    namespace: str | None
    """``None``: cluster-scoped, or across all namespaces."""
    name: str | None


def attributes(method: str, path: str, query: Mapping[str, str]) -> Attributes | None:
    """The request's attributes; ``None`` for a request that is not about a resource."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        return None
    if not rest:
        return None
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] not in ("status", "finalize"):
        namespace, rest = rest[1], rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"
    if method == "GET":
        if name is not None:
            verb = "get"
        else:
            verb = "watch" if query.get("watch", "") in ("true", "1") else "list"
    elif method == "DELETE":
        verb = "delete" if name is not None else "deletecollection"
    else:
        verb = _VERB_OF_METHOD.get(method, method.lower())
    return Attributes(verb, group, resource, namespace, name)


def _matches(rule: Mapping[str, Any], a: Attributes) -> bool:
    def holds(key: str, value: str) -> bool:
        values = rule.get(key) or []
        return "*" in values or value in values

    names = rule.get("resourceNames") or []
    return (
        holds("apiGroups", a.group)
        and holds("resources", a.resource)
        and holds("verbs", a.verb)
        and (not names or (a.name is not None and a.name in names))
    )


class RbacPolicy:
    """The rules bound to one service account, from Role, ClusterRole, RoleBinding and
    ClusterRoleBinding objects (rendered manifests); other kinds are ignored."""

    def __init__(
        self, objects: Iterable[Mapping[str, Any]], *, namespace: str, service_account: str
    ) -> None:
        self.user = f"system:serviceaccount:{namespace}:{service_account}"
        objs = list(objects)
        roles = {
            (o["metadata"]["namespace"], o["metadata"]["name"]): o.get("rules") or []
            for o in objs
            if o["kind"] == "Role"
        }
        cluster_roles = {
            o["metadata"]["name"]: o.get("rules") or [] for o in objs if o["kind"] == "ClusterRole"
        }
        self.namespaced: dict[str, list[Mapping[str, Any]]] = {}
        """Namespace → the rules granted in it."""
        self.cluster: list[Mapping[str, Any]] = []
        """The rules granted everywhere."""
        for o in objs:
            if o["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
                continue
            if not any(
                (s.get("kind"), s.get("name"), s.get("namespace"))
                == ("ServiceAccount", service_account, namespace)
                for s in o.get("subjects") or []
            ):
                continue
            ref = o["roleRef"]
            if ref["kind"] == "ClusterRole":
                rules = cluster_roles.get(ref["name"], [])
            elif o["kind"] == "RoleBinding":
                rules = roles.get((o["metadata"]["namespace"], ref["name"]), [])
            else:
                rules = []  # a ClusterRoleBinding cannot refer to a Role
            if o["kind"] == "ClusterRoleBinding":
                self.cluster.extend(rules)
            else:
                self.namespaced.setdefault(o["metadata"]["namespace"], []).extend(rules)

    def allows(self, a: Attributes) -> bool:
        rules = list(self.cluster)
        if a.namespace is not None:
            rules.extend(self.namespaced.get(a.namespace, []))
        return any(_matches(rule, a) for rule in rules)

    def forbidden(self, a: Attributes, user: str | None = None) -> st.ApiError:
        """The 403 a kube-apiserver answers ``user`` (by default the policy's subject) for
        ``a``."""
        what = f'resource "{a.resource.split("/")[0]}" in API group "{a.group}"'
        scope = f'in the namespace "{a.namespace}"' if a.namespace else "at the cluster scope"
        subject = f"{a.resource}" + (f' "{a.name}"' if a.name else "")
        message = (
            f'{subject} is forbidden: User "{user or self.user}" cannot {a.verb} {what} {scope}'
        )
        details: dict[str, Any] = {"kind": a.resource.split("/")[0]}
        if a.name:
            details = {"name": a.name, **details}
        return st.ApiError(st.status(403, "Forbidden", message, details=details))
