"""A stand-in for ``torch.cuda``: device_count and friends over the stand-in runtime."""

from __future__ import annotations

import _fakecuda

_current = 0


def device_count() -> int:
    return _fakecuda.count()


def is_available() -> bool:
    return _fakecuda.count() > 0


def is_initialized() -> bool:
    return _fakecuda.initialised()


def set_device(index: int) -> None:
    global _current
    _fakecuda.check(index)
    _current = index


def current_device() -> int:
    _fakecuda.check(_current)
    return _current


_fractions: dict[int, float] = {}


def set_per_process_memory_fraction(fraction: float, device: int | None = None) -> None:
    """As torch's: the caching allocator's cap, ``fraction`` (0–1) of the card's total."""
    index = _current if device is None else device
    _fakecuda.check(index)  # initialises the runtime, as the real call does
    if not isinstance(fraction, float) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    _fractions[index] = fraction


def get_per_process_memory_fraction(device: int | None = None) -> float:
    index = _current if device is None else device
    _fakecuda.check(index)
    return _fractions.get(index, 1.0)
