"""gpu-exporter: one NVML snapshot per GPU host, served as Prometheus metrics and as /choose.

``from gpu_exporter import use_gpus`` is the client for jobs (see :mod:`gpu_exporter.client`);
it is imported on first use, so ``import gpu_exporter`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["__version__", "use_gpus"]

if TYPE_CHECKING:
    from gpu_exporter.client import use_gpus


def __getattr__(name: str) -> Any:
    if name == "use_gpus":
        from gpu_exporter.client import use_gpus

        return use_gpus
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
