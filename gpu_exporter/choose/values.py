"""Readers of single query values for :data:`gpu_exporter.choose.params.PARAMS`.

A reader takes the parameter's name and its text and returns the value, or raises ValueError
with the whole message a client sees (it names the parameter), e.g. ``min_free: expected a
size such as 8GiB, 500MB or a byte count, got 'lots'``.

>>> whole_number(1, 1024)("n", "2"), selectors("exclude", "0, GPU-5a1e")
(2, ('0', 'GPU-5a1e'))
>>> flag("spread", " True ")
True

Numbers are ASCII digits only, and short: ``str.isdigit()`` and ``int()`` take ``²`` and
``٣`` too, which no one means in a query (``n=²`` once answered 500).

>>> whole_number(1, 1024)("n", "²")
Traceback (most recent call last):
ValueError: n must be a whole number from 1 to 1024, got '²' (ASCII digits only)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from gpu_exporter.units import parse_ratio, shown

Reader: TypeAlias = Callable[[str, str], Any]
"""(parameter name, query value) → the value; ValueError says why not."""


def units(parse: Callable[[str], Any], maximum: float | None = None) -> Reader:
    """A :mod:`gpu_exporter.units` parser (sizes, ratios, durations), at most ``maximum`` s."""

    def read(name: str, text: str) -> Any:
        try:
            value = parse(text)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        if maximum is not None and value > maximum:
            raise ValueError(f"{name}: at most {maximum:g} s, got {shown(text)}")
        return value

    return read


@dataclass(frozen=True, slots=True)
class OfTotal:
    """A share of a card's total memory (``min_free=25%``), rather than a size."""

    ratio: float  # 0–1

    def __str__(self) -> str:
        return f"{self.ratio * 100:g}% of total"


def size_or_share(parse_size: Callable[[str], int]) -> Reader:
    """A size (``8GiB``) or, ending in ``%``, a share of the card's total memory (``25%``).

    >>> read = size_or_share(lambda text: int(text))
    >>> read("min_free", "1024"), read("min_free", " 25% ")
    (1024, OfTotal(ratio=0.25))
    """
    sizes, shares = units(parse_size), units(parse_ratio)

    def read(name: str, text: str) -> int | OfTotal:
        if text.strip().endswith("%"):
            return OfTotal(shares(name, text))
        value: int = sizes(name, text)
        return value

    return read


def positive(reader: Reader) -> Reader:
    """``reader``, refusing 0 (and less)."""

    def read(name: str, text: str) -> Any:
        value = reader(name, text)
        if value <= 0:
            raise ValueError(f"{name} must be more than 0")
        return value

    return read


def one_of(choices: tuple[str, ...]) -> Reader:
    def read(name: str, text: str) -> str:
        if text not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {shown(text)}")
        return text

    return read


MAX_PID = 4_194_304  # Linux's largest pid_max (2^22): no GPU runs more processes either
MAX_DIGITS = 9  # any count or index here fits; int() of a long string is never reached
MAX_TEXT_CHARS = 256  # a model name, a selector


def digits(text: str) -> int | None:
    """``text`` as a whole number if it is 1 to :data:`MAX_DIGITS` ASCII digits, else None.

    >>> digits("42"), digits("²"), digits("٣"), digits("-1"), digits("9" * 400)
    (42, None, None, None, None)
    """
    if 0 < len(text) <= MAX_DIGITS and text.isascii() and text.isdigit():
        return int(text)
    return None


def whole_number(least: int, most: int) -> Reader:
    def read(name: str, text: str) -> int:
        value = digits(text)
        if value is None or not least <= value <= most:
            raise ValueError(
                f"{name} must be a whole number from {least} to {most}, got {shown(text)}"
            )
        return value

    return read


def process_count(name: str, text: str) -> int:
    value = digits(text)
    if value is None or value > MAX_PID:
        raise ValueError(
            f"{name} must be a whole number from 0 to {MAX_PID} (0 = no processes), "
            f"got {shown(text)}"
        )
    return value


def label(most: int) -> Reader:
    """Printable text of at most ``most`` characters (an owner shown in /leases)."""

    def read(name: str, text: str) -> str:
        if len(text) > most or not text.isprintable():
            raise ValueError(f"{name} must be at most {most} printable characters")
        return text

    return read


def not_empty(name: str, text: str) -> str:
    if not text.strip():
        raise ValueError(f"{name} must not be empty")
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"{name}: at most {MAX_TEXT_CHARS} characters, got {len(text)}")
    return text


MAX_SELECTORS = 64


def selectors(name: str, text: str) -> tuple[str, ...]:
    """GPUs named by NVML index, UUID (or its prefix) or PCI bus id, comma-separated."""
    found = tuple(s.strip() for s in text.split(",") if s.strip())
    if len(found) > MAX_SELECTORS:
        raise ValueError(f"{name}: at most {MAX_SELECTORS} GPUs, got {len(found)}")
    for selector in found:
        if len(selector) > MAX_TEXT_CHARS or not (
            digits(selector) is not None
            or selector.upper().startswith(("GPU-", "MIG-"))
            or ":" in selector
        ):
            raise ValueError(
                f"{name}: {shown(selector)} is not an NVML index, a UUID (GPU-…) or a PCI bus id"
            )
    return found


def flag(name: str, text: str) -> bool:
    """``0``/``1`` (or ``false``/``true``, any case, spaces around)."""
    text = text.strip().lower()
    if text not in ("0", "1", "false", "true"):
        raise ValueError(f"{name} must be 0 or 1, got {text!r}")
    return text in ("1", "true")


def pid_list(most: int) -> Reader:
    """Process ids, comma-separated: ``4242`` or ``4242,4243``; each from 1 to 2^22.

    >>> pid_list(4)("pid", "4242, 17")
    (4242, 17)
    """

    def read(name: str, text: str) -> tuple[int, ...]:
        items = [s.strip() for s in text.split(",")]
        for item in items:
            pid = digits(item)
            if pid is None or not 1 <= pid <= MAX_PID:
                raise ValueError(
                    f"{name} must be process ids (whole numbers from 1 to {MAX_PID}, "
                    f"comma-separated), got {shown(text)}"
                )
        if len(items) > most:
            raise ValueError(f"{name}: at most {most} process ids, got {len(items)}")
        return tuple(dict.fromkeys(int(item) for item in items))

    return read
