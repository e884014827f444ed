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
