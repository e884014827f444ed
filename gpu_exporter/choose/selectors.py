"""Which GPU a selector names: an NVML index, a UUID (or its prefix) or a PCI bus id.

``include=``/``exclude=`` of ``/choose`` (:mod:`gpu_exporter.choose.filters`) match GPUs with it.
"""

from __future__ import annotations

from gpu_exporter.model import GpuSample


def selector_matches(gpu: GpuSample, selector: str) -> bool:
    """Does ``selector`` (index, UUID or UUID prefix, PCI bus id) name this GPU?

    >>> g = GpuSample(index=3, uuid="GPU-5a1e0003-abcd", up=True, pci_bus_id="00000000:48:00.0")
    >>> [selector_matches(g, s) for s in ("3", "GPU-5a1e", "gpu-5A1E0003-ABCD", "48:00.0", "4")]
    [True, True, True, True, False]
    """
    s = selector.strip()
    if s.isascii() and s.isdigit():  # int() would take "²" too, and then fail
        return int(s) == gpu.index
    if s.upper().startswith(("GPU-", "MIG-")):
        return gpu.uuid.upper().startswith(s.upper())
    if ":" in s and gpu.pci_bus_id:
        return _normalise_bus_id(gpu.pci_bus_id) == _normalise_bus_id(s)
    return False


def _normalise_bus_id(bus_id: str) -> str:
    """``0000:3b:00.0``, ``3B:00.0`` and ``00000000:3B:00.0`` are the same device."""
    parts = bus_id.upper().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    domain, rest = parts[0], ":".join(parts[1:])
    return f"{int(domain, 16):08X}:{rest}" if _is_hex(domain) else bus_id.upper()


def _is_hex(s: str) -> bool:
    try:
        int(s, 16)
    except ValueError:
        return False
    return True
