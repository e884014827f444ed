"""A stand-in CUDA runtime for the framework stand-ins (tests/test_frameworks_doc.py).

Like the real one, it reads CUDA_VISIBLE_DEVICES once, when first used, and ignores later
changes: unset means every card of the (imaginary) host, "" means none.
"""

from __future__ import annotations

import os

HOST_GPUS = 4
_count: int | None = None


def count() -> int:
    """Visible devices; initialises the runtime on first use."""
    global _count
    if _count is None:
        mask = os.environ.get("CUDA_VISIBLE_DEVICES")
        _count = HOST_GPUS if mask is None else len([d for d in mask.split(",") if d.strip()])
    return _count


def initialised() -> bool:
    return _count is not None


def check(index: int) -> None:
    if not 0 <= index < count():
        raise RuntimeError(f"invalid device ordinal {index} ({count()} visible)")
