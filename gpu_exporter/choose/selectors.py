"""Which GPU a selector names: an NVML index, a UUID (or its prefix) or a PCI bus id.

``include=``/``exclude=`` of ``/choose`` (:mod:`gpu_exporter.choose.filters`) match GPUs with it.
A selector that names no GPU of the host is a mistake (a typo in ``exclude`` would exclude
nothing, an ``include`` of a card elsewhere would wait for ever): :func:`unmatched` finds them,
and ``/choose`` refuses them (:func:`check_selectors`).
"""

from __future__ import annotations

from collections.abc import Iterable

from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.model import GpuSample, all_devices


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


def unmatched(gpus: Iterable[GpuSample], selectors: Iterable[str]) -> tuple[str, ...]:
    """The selectors that name none of ``gpus`` (cards and their MIG devices).

    >>> g = GpuSample(index=0, uuid="GPU-5a1e", up=True, pci_bus_id="00000000:3B:00.0")
    >>> unmatched([g], ("0", "7", "GPU-5a", "GPU-zzz", "3b:00.0", "4C:00.0"))
    ('7', 'GPU-zzz', '4C:00.0')
    """
    devices = all_devices(tuple(gpus))
    return tuple(s for s in selectors if not any(selector_matches(g, s) for g in devices))


def check_selectors(
    gpus: tuple[GpuSample, ...], include: Iterable[str], exclude: Iterable[str]
) -> None:
    """Refuse (400 ``invalid_parameter``) an ``include``/``exclude`` naming no GPU here.

    >>> check_selectors((GpuSample(index=0, uuid="GPU-5a1e", up=True),), ("0",), ("GPU-zzz",))
    Traceback (most recent call last):
    gpu_exporter.choose.refusal.ApiError: exclude: 'GPU-zzz' names no GPU on this host \
(its GPU: 0; /gpus lists UUIDs and PCI bus ids)
    """
    for param, given in (("include", include), ("exclude", exclude)):
        missing = unmatched(gpus, given)
        if missing:
            names = ", ".join(repr(s) for s in missing)
            verb = "names" if len(missing) == 1 else "name"
            indices = ", ".join(str(i) for i in sorted({g.index for g in gpus})) or "none"
            raise ApiError(
                400,
                "invalid_parameter",
                f"{param}: {names} {verb} no GPU on this host (its "
                f"{'GPU' if len(gpus) == 1 else 'GPUs'}: {indices}; /gpus lists UUIDs and PCI "
                "bus ids)",
                param,
            )
