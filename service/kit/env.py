"""Typed environment variables: each declared once, read with its parser, kept in its range.

A :class:`Var` holds everything about one variable: name, parser, default, range, documentation
and the attribute path its value fills (:func:`assemble` builds the settings objects,
:func:`attribute` reads a value back). A value that cannot be parsed raises :class:`ConfigError`
naming the variable; a number outside its range is clamped, with a warning.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_TRUE = frozenset({"1", "true", "yes", "on", "y", "t"})
_FALSE = frozenset({"0", "false", "no", "off", "n", "f"})


class ConfigError(ValueError):
    """A variable that cannot be parsed. ``str()`` is one line naming the variable."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable


def boolean(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in _TRUE | _FALSE:
        return lowered in _TRUE
    raise ValueError("expected a boolean (true/false, yes/no, on/off, 1/0)")


def integer(raw: str) -> int:
    try:
        return int(raw.strip(), 10)
    except ValueError:
        raise ValueError("expected an integer") from None


def optional_integer(raw: str) -> int | None:
    return None if not raw.strip() else integer(raw)


def number(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError("expected a number") from None
    if not math.isfinite(value):
        raise ValueError("expected a finite number")
    return value


def text(raw: str) -> str:
    return raw.strip()


def host_port(raw: str) -> tuple[str, int]:
    """``HOST:PORT`` (an empty host is every interface)."""
    host, sep, port = raw.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("expected HOST:PORT with a port from 0 to 65535")
    return host.strip("[]") or "0.0.0.0", int(port)


def matching(pattern: re.Pattern[str], what: str) -> Callable[[str], str]:
    """A parser of text that ``pattern`` matches whole (``what`` names it in errors)."""

    def parse(raw: str) -> str:
        value = raw.strip()
        if not pattern.fullmatch(value):
            raise ValueError(f"expected {what}")
        return value

    return parse


@dataclass(frozen=True)
class Choice:
    """A parser of one of ``options`` (any case); the chart's schema lists them."""

    options: tuple[str, ...]

    def __call__(self, raw: str) -> str:
        value = raw.strip().lower()
        if value not in self.options:
            raise ValueError(f"expected one of {', '.join(self.options)}")
        return value


@dataclass(frozen=True, slots=True)
class Var(Generic[T]):
    """One environment variable, ``prefix + suffix``, and the attribute ``path`` it fills
    (dotted; a tuple value may fill several, comma-separated). ``show`` gives the value the
    effective view prints when reading the path back is not it; ``secret`` values are masked."""

    suffix: str
    default: T
    parse: Callable[[str], T]
    doc: str
    path: str
    lo: float | None = None
    hi: float | None = None
    secret: bool = False
    show: Callable[[Any], object] | None = None
    prefix: str = ""

    @property
    def name(self) -> str:
        return self.prefix + self.suffix

    @property
    def shown_default(self) -> str:
        """The default as ``config`` and docs/configuration.md show it."""
        default: Any = self.default
        if default is None or default in ("", ()):
            return "(empty)"
        if isinstance(default, tuple):
            return ":".join(map(str, default))
        return str(default).lower() if isinstance(default, bool) else str(default)

    def read(self, env: Mapping[str, str], warnings: list[str]) -> T:
        raw = env.get(self.name)
        if raw is None or (raw.strip() == "" and self.default is not None):
            return self.default
        try:
            value = self.parse(raw)
        except ValueError as exc:
            shown = "***" if self.secret else repr(raw)
            raise ConfigError(self.name, f"{exc}, got {shown}") from None
        return self._clamp(raw, value, warnings)

    def _clamp(self, raw: str, value: T, warnings: list[str]) -> T:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return value
        clamped: float = value
        if self.lo is not None and clamped < self.lo:
            clamped = self.lo
        if self.hi is not None and clamped > self.hi:
            clamped = self.hi
        if clamped == value:
            return value
        used: Any = int(clamped) if isinstance(value, int) else float(clamped)
        warnings.append(f"{self.name}={raw!r} is outside [{self.lo}, {self.hi}]; using {used}")
        return used  # type: ignore[no-any-return]


def attribute(obj: object, path: str) -> Any:
    """The value at ``path`` under ``obj`` (a tuple when ``path`` names several)."""
    values = []
    for one in path.split(","):
        value = obj
        for name in one.split("."):
            value = getattr(value, name)
        values.append(value)
    return values[0] if len(values) == 1 else tuple(values)


def assemble(
    build: Callable[..., T], values: Mapping[str, Any], sections: Mapping[str, Callable[..., Any]]
) -> T:
    """``build(**fields)`` from ``values`` keyed by attribute path. Each of ``sections`` (dotted
    paths, innermost first) is built from its own fields, then lands in its parent by name."""
    flat: dict[str, Any] = {}
    for path, value in values.items():
        flat.update(zip(path.split(","), value if "," in path else (value,), strict=True))
    for section, make in sections.items():
        prefix = f"{section}."
        own = [p for p in flat if p.startswith(prefix) and "." not in p.removeprefix(prefix)]
        flat[section] = make(**{p.removeprefix(prefix): flat.pop(p) for p in own})
    return build(**flat)
