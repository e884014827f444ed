"""A stand-in for ``jax.devices``/``jax.device_count`` over the stand-in runtime."""

from __future__ import annotations

from dataclasses import dataclass

import _fakecuda


@dataclass(frozen=True)
class CudaDevice:
    id: int


def devices(backend: str | None = None) -> list[CudaDevice]:
    return [CudaDevice(i) for i in range(_fakecuda.count())]


def device_count() -> int:
    return len(devices())
