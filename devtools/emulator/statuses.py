"""``Status`` bodies exactly as kube-apiserver writes them, and the error that carries one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Resource:
    """One kind the emulator serves."""

    plural: str
    kind: str
    api_version: str
    group: str
    """Empty for the core group."""
    namespaced: bool
    has_status: bool
    unconditional_update: bool
    """Whether a PUT without ``metadata.resourceVersion`` is allowed (pods: no; leases: yes)."""

    @property
    def qualified(self) -> str:
        """``pods`` or ``leases.coordination.k8s.io``, as in error messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def details(self, name: str) -> dict[str, Any]:
        if self.group:
            return {"name": name, "group": self.group, "kind": self.plural}
        return {"name": name, "kind": self.plural}


PODS = Resource("pods", "Pod", "v1", "", True, True, False)
LEASES = Resource(
    "leases", "Lease", "coordination.k8s.io/v1", "coordination.k8s.io", True, False, True
)
NAMESPACES = Resource("namespaces", "Namespace", "v1", "", False, True, True)


class ApiError(Exception):
    """An error answer: the HTTP status and the ``Status`` body (plus optional headers)."""

    def __init__(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        super().__init__(body.get("message", ""))
        self.body = body
        self.code = int(body["code"])
        self.headers = headers or {}


def status(
    code: int,
    reason: str,
    message: str,
    *,
    details: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A failure ``Status`` with the server's key order."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": metadata or {},
        "status": "Failure",
        "message": message,
        "reason": reason,
    }
    if details is not None:
        body["details"] = details
    body["code"] = code
    return body


def not_found(res: Resource, name: str) -> ApiError:
    return ApiError(
        status(404, "NotFound", f'{res.qualified} "{name}" not found', details=res.details(name))
    )


def already_exists(res: Resource, name: str) -> ApiError:
    return ApiError(
        status(
            409,
            "AlreadyExists",
            f'{res.qualified} "{name}" already exists',
            details=res.details(name),
        )
    )


def modified_conflict(res: Resource, name: str) -> ApiError:
    return ApiError(
        status(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {res.qualified} "{name}": the object has been '
            "modified; please apply your changes to the latest version and try again",
            details=res.details(name),
        )
    )


def precondition_uid_conflict(res: Resource, name: str, wanted: str, actual: str) -> ApiError:
    return ApiError(
        status(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {res.kind} "{name}": the UID in the precondition '
            f"({wanted}) does not match the UID in record ({actual}). The object might have been "
            "deleted and then recreated",
            details={"name": name, "kind": res.kind},
        )
    )


def precondition_rv_conflict(res: Resource, name: str, wanted: str, actual: str) -> ApiError:
    return ApiError(
        status(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {res.kind} "{name}": the ResourceVersion in the '
            f"precondition ({wanted}) does not match the ResourceVersion in record ({actual}). "
            "The object might have been modified",
            details={"name": name, "kind": res.kind},
        )
    )


def bad_request(message: str) -> ApiError:
    return ApiError(status(400, "BadRequest", message))


def invalid(res: Resource, name: str, message: str) -> ApiError:
    return ApiError(
        status(
            422,
            "Invalid",
            f'{res.kind} "{name}" is invalid: {message}',
            details={"name": name, "kind": res.kind},
        )
    )


EXPIRED_CONTINUE_MESSAGE = (
    "The provided continue parameter is too old to display a consistent list result. You can "
    "start a new list without the continue parameter, or use the continue token in this response "
    "to retrieve the remainder of the results. Continuing with the provided token results in an "
    "inconsistent list - objects that were created, modified, or deleted between the time the "
    "first chunk was returned and now may show up in the list."
)


def expired_continue(next_token: str) -> ApiError:
    return ApiError(
        status(410, "Expired", EXPIRED_CONTINUE_MESSAGE, metadata={"continue": next_token})
    )


def too_old_watch(requested: str, oldest: int) -> dict[str, Any]:
    return status(410, "Expired", f"too old resource version: {requested} ({oldest})")


def injected(code: int, retry_after_s: int | None) -> ApiError:
    if code == 429:
        seconds = retry_after_s if retry_after_s is not None else 1
        return ApiError(
            status(
                429,
                "TooManyRequests",
                "Too many requests, please try again later.",
                details={"retryAfterSeconds": seconds},
            ),
            headers={"Retry-After": str(seconds)},
        )
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    reason = {
        403: "Forbidden",
        500: "InternalError",
        503: "ServiceUnavailable",
        504: "Timeout",
    }.get(code, "Unknown")
    return ApiError(
        status(code, reason, "Internal error occurred: injected fault"), headers=headers
    )


def invalid_list_options(*causes: tuple[str, str, str]) -> ApiError:
    """422 for request options, as the server words it: ``causes`` are (field, reason, detail)
    with reason ``Forbidden`` or ``Unsupported value``; several are joined in brackets."""
    parts = [f"{field}: {reason}: {detail}" for field, reason, detail in causes]
    joined = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    return ApiError(
        status(
            422,
            "Invalid",
            f'ListOptions.meta.k8s.io "" is invalid: {joined}',
            details={
                "group": "meta.k8s.io",
                "kind": "ListOptions",
                "causes": [
                    {
                        "reason": (
                            "FieldValueForbidden"
                            if reason == "Forbidden"
                            else "FieldValueNotSupported"
                        ),
                        "message": f"{reason}: {detail}",
                        "field": field,
                    }
                    for field, reason, detail in causes
                ],
            },
        )
    )


def list_too_old() -> ApiError:
    return ApiError(status(410, "Expired", "The resourceVersion for the provided list is too old."))


def too_large_resource_version(requested: int, current: int) -> ApiError:
    return ApiError(
        status(
            504,
            "Timeout",
            f"Timeout: Too large resource version: {requested}, current: {current}",
            details={
                "causes": [
                    {"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}
                ],
                "retryAfterSeconds": 1,
            },
        )
    )


_SUBDOMAIN_RULE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used "
    "for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)


def invalid_name(res: Resource, name: str) -> ApiError:
    """422 for a ``metadata.name`` that is not a lowercase RFC 1123 subdomain."""
    detail = f'Invalid value: "{name}": {_SUBDOMAIN_RULE}'
    return ApiError(
        status(
            422,
            "Invalid",
            f'{res.kind} "{name}" is invalid: metadata.name: {detail}',
            details={
                "name": name,
                "kind": res.kind,
                "causes": [
                    {"reason": "FieldValueInvalid", "message": detail, "field": "metadata.name"}
                ],
            },
        )
    )
