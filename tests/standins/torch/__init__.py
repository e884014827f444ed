"""A stand-in for the parts of ``torch`` that docs/frameworks.md uses."""

from __future__ import annotations

from torch import cuda

__all__ = ["cuda", "device"]


class device:  # torch's own spelling
    def __init__(self, spec: str) -> None:
        kind, _, index = spec.partition(":")
        if kind not in ("cuda", "cpu"):
            raise RuntimeError(f"unknown device type {kind!r}")
        self.type = kind
        self.index = int(index) if index else None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        return f"device(type='{self.type}', index={self.index})"
