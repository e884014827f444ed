"""Parsing the human units people type into query strings and flags.

Every parser raises :class:`ValueError` with a message that can be shown to the user as is.
"""

from __future__ import annotations

import math
import re

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    # nvidia-smi and most people write "M"/"G" meaning MiB/GiB.
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z%]*)\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "": 1.0, "m": 60.0, "h": 3600.0}


def parse_bytes(text: str) -> int:
    """Bytes from ``"8GiB"``, ``"500MB"``, ``"8G"`` (= GiB) or a plain byte count.

    >>> parse_bytes("8GiB"), parse_bytes("500MB"), parse_bytes("1024")
    (8589934592, 500000000, 1024)
    """
    m = _NUMBER_UNIT.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _BYTE_UNITS:
        raise ValueError(f"expected a size such as 8GiB, 500MB or a byte count, got {text!r}")
    return int(float(m.group(1)) * _BYTE_UNITS[unit])


def parse_ratio(text: str) -> float:
    """A ratio 0–1 from ``"0.3"`` or ``"30%"``.

    >>> parse_ratio("30%"), parse_ratio("0.3")
    (0.3, 0.3)
    """
    m = _NUMBER_UNIT.match(text)
    if not m or m.group(2) not in ("", "%"):
        raise ValueError(f"expected a ratio such as 0.3 or 30%, got {text!r}")
    value = float(m.group(1))
    if m.group(2) == "%":
        value /= 100.0
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"expected a ratio between 0 and 1 (or 0% and 100%), got {text!r}")
    return value


def parse_duration(text: str) -> float:
    """Seconds from ``"500ms"``, ``"90s"``, ``"10m"``, ``"2h"`` or plain seconds.

    >>> parse_duration("10m"), parse_duration("1.5")
    (600.0, 1.5)
    """
    m = _NUMBER_UNIT.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _DURATION_UNITS:
        raise ValueError(f"expected a duration such as 30s, 10m or 1h, got {text!r}")
    value = float(m.group(1)) * _DURATION_UNITS[unit]
    if not math.isfinite(value):
        raise ValueError(f"duration out of range: {text!r}")
    return value


def format_bytes(n: float) -> str:
    """``"79.2 GiB"``: binary units, as nvidia-smi's MiB figures are."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``"1 GPU"``, ``"2 GPUs"``: a count and its noun, for messages (``nouns``: an irregular
    plural).

    >>> plural(1, "GPU"), plural(0, "GPU"), plural(2, "lease"), plural(3, "entry", "entries")
    ('1 GPU', '0 GPUs', '2 leases', '3 entries')
    """
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"
