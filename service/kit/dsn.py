"""PostgreSQL connection URLs: checked at start, masked for every log line, read from a file."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from service.kit.env import ConfigError

_DSN_SCHEMES = frozenset({"postgresql", "postgres"})
TARGET_SESSION_ATTRS = frozenset({"any", "primary", "read-write"})
"""The ``target_session_attrs`` a URL may ask for (every connection goes to the primary whatever
it asks, ``service/pg/connect.py``)."""


def mask_dsn(url: str) -> str:
    """Hide the password of a PostgreSQL URL or keyword DSN."""
    if "://" in url:
        try:
            parts = urlsplit(url)
        except ValueError:
            return "***"
        if parts.password is not None:
            userinfo = f"{parts.username or ''}:***"
            host = parts.netloc.rpartition("@")[2]
            return urlunsplit(parts._replace(netloc=f"{userinfo}@{host}"))
        return re.sub(r"(password=)[^&]*", r"\1***", url)
    return re.sub(r"(password\s*=\s*)('[^']*'|\S+)", r"\1***", url)


def _check_hosts(hostlist: str) -> None:
    """libpq's host list: ``host[:port]`` or ``[v6addr][:port]``, comma-separated."""
    for spec in hostlist.split(","):
        if spec.startswith("["):
            addr, sep, rest = spec[1:].partition("]")
            if not sep or not addr or (rest and not rest.startswith(":")):
                raise ValueError(f"bad host {spec!r}")
            port = rest[1:]
        else:
            addr, _, port = spec.partition(":")
        if not addr and len(hostlist.split(",")) > 1:
            raise ValueError("an empty host in the host list")
        if port and not (port.isascii() and port.isdigit() and 0 < int(port) <= 65535):
            raise ValueError(
                f"port {port!r} of host {addr or spec!r} is not a number from 1 to 65535"
            )


def check_dsn(url: str) -> None:
    """Raise ``ValueError`` (its message safe to print) unless ``url`` parses as a PostgreSQL
    URL the driver accepts: one host or libpq's multi-host list, and a ``target_session_attrs``
    the service can honour. Reachability is not checked: an unreachable server is retried."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _DSN_SCHEMES:
        raise ValueError(
            f"expected a URL starting with postgresql:// or postgres://, got {mask_dsn(url)!r}"
        )
    netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
    hostlist = netloc.rpartition("@")[2]
    try:
        _check_hosts(hostlist)
        query = urlsplit(url).query
    except ValueError as exc:
        raise ValueError(f"{exc} in {mask_dsn(url)!r}") from None
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name == "target_session_attrs" and value not in TARGET_SESSION_ATTRS:
            raise ValueError(
                f"target_session_attrs={value!r}: retired-pod-gc needs the primary "
                f"(use one of {', '.join(sorted(TARGET_SESSION_ATTRS))})"
            )


def read_url_file(path: str, variable: str) -> str:
    """The URL held by the file at ``path`` (``variable`` names it in a :class:`ConfigError`)."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(variable, f"cannot read {path!r}: {exc.strerror}") from None
    except ValueError as exc:  # e.g. a NUL byte in the path
        raise ConfigError(variable, f"not a usable path: {exc}") from None
    if not text:
        raise ConfigError(variable, f"{path!r} is empty")
    try:
        check_dsn(text)
    except ValueError as exc:
        raise ConfigError(variable, f"{path!r} holds no usable URL: {exc}") from None
    return text
