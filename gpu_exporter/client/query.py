"""``/choose``'s query from Python values: durations, filters and the owner's label.

:func:`choose_params` builds the query :func:`~gpu_exporter.client.hostapi.choose_raw` sends and
:mod:`~gpu_exporter.client.choosing` sends across a fleet; :func:`filter_value` also feeds the
local fallback (:mod:`~gpu_exporter.client.local`). A name the server does not know is sent
on, for the server to refuse.
"""

from __future__ import annotations

import getpass
import math
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import TypeAlias

from gpu_exporter.choose.params import BY_NAME, MAX_OWNER_CHARS
from gpu_exporter.units import parse_duration

Duration: TypeAlias = str | float | timedelta
"""``"90s"``, ``"10m"``, ``"500ms"``, a number of seconds, or a :class:`~datetime.timedelta`."""
FilterValue: TypeAlias = str | int | float | Iterable[str | int] | None
"""A ``/choose`` filter value; an iterable is sent comma-separated, ``None`` not at all."""


def default_owner() -> str | None:
    """The login name (``$LOGNAME``/``$USER``, else the password database), so the status page
    and ``/leases`` say who holds what; None where there is none, or it is no valid label."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError, ImportError):  # a container user with no passwd entry
        return None
    ok = 0 < len(name) <= MAX_OWNER_CHARS and name.isprintable()
    return name if ok else None


def format_duration(value: Duration) -> str:
    """A duration as a query value: strings pass through, numbers are seconds.

    >>> [format_duration(d) for d in (60, 0.3, timedelta(minutes=2), "10m")]
    ['60', '0.3', '120', '10m']
    """
    if isinstance(value, str):
        return value.strip()
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"expected a duration of 0 seconds or more, got {value!r}")
    text = f"{seconds:.3f}".rstrip("0").rstrip(".")
    return text or "0"


def duration_seconds(value: Duration) -> float | None:
    """Seconds in ``value``, or None where this client cannot tell (the server will judge)."""
    if isinstance(value, str):
        try:
            return parse_duration(value)
        except ValueError:
            return None
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def filter_value(name: str, value: FilterValue) -> str:
    """A filter's value as ``/choose`` takes it: ``[0, 1]`` → ``"0,1"``, ``0.5`` → ``"0.5"``."""
    if isinstance(value, bool):
        raise TypeError(f"filter {name}: expected a number or text, got {value!r}")
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return format(value, "g") if isinstance(value, float) else str(value)
    if isinstance(value, Iterable):
        return ",".join(str(v) for v in value)
    raise TypeError(f"filter {name}: unsupported value {value!r}")


def choose_params(
    n: int,
    fmt: str,
    lease: Duration | None,
    wait: Duration | None,
    owner: str | None,
    filters: Mapping[str, FilterValue],
) -> dict[str, str]:
    """``/choose``'s query; a name the server does not know is sent on for it to refuse."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a whole number of 1 or more, got {n!r}")
    params = {"n": str(n), "format": fmt}
    if lease is not None:
        params["lease"] = format_duration(lease)
    if wait is not None:
        params["wait"] = format_duration(wait)
    owner = default_owner() if owner is None else owner
    if owner:  # "" sends none
        params["owner"] = owner
    for name, value in filters.items():
        if name in BY_NAME and BY_NAME[name].choose and not BY_NAME[name].filter:
            raise TypeError(f"{name} is not a filter")
        if value is not None:
            params[name] = filter_value(name, value)
    return params
