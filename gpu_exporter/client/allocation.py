"""The GPUs a launcher already gave this job, read from its environment: a choice stays
inside them.

Slurm, a container runtime or an outer script may have allocated this job some of the host's
cards. Choosing among all of them and replacing the mask could put the job on a card
another job was given, so ``run``, ``choose``, ``use_gpus()`` and :func:`choose` ask
``/choose`` for ``include=`` those cards, and the answer (UUIDs) is a subset of them.
``ignore_mask`` (``--ignore-mask``) chooses among every GPU of the host instead.

Where the allocation is read from, first match wins:

1. ``CUDA_VISIBLE_DEVICES`` naming UUIDs (``GPU-…``, ``MIG-…``): exactly those.
2. ``SLURM_JOB_GPUS``, then ``NVIDIA_VISIBLE_DEVICES`` (a list, not ``all``): the host's
   NVML indices or UUIDs. A ``CUDA_VISIBLE_DEVICES`` of indices beside them is the same
   cards (Slurm without device cgroups), or ``0..k-1`` for the k allocated cards (with
   them), or one reading of a subset; a subset that reads differently either way is refused.
3. ``CUDA_VISIBLE_DEVICES`` of indices alone: CUDA's numbering, which is the host's PCI bus
   order under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and otherwise fastest first; mapped through
   the PCI bus ids where that order is certain (``PCI_BUS_ID``, or every card the same
   model), else refused with what to set.

A mask that gives the job no GPU (``CUDA_VISIBLE_DEVICES=-1``, ``NVIDIA_VISIBLE_DEVICES=none``)
is refused: there is nothing to choose from, and the job must not run without a GPU.

:func:`cuda_indices` goes the other way, for tools that cannot take UUIDs: the leased cards'
places among the cards the job's CUDA sees (``--indices``, ``indices=True``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gpu_exporter.client.transport import GpuExporterError

IGNORE_HINT = "--ignore-mask (ignore_mask=True) chooses among every GPU of this host"


@dataclass(frozen=True, slots=True)
class HostGpu:
    """What mapping CUDA's indices needs of one of the host's GPUs."""

    index: int
    uuid: str
    pci_bus_id: str
    name: str


@dataclass(frozen=True, slots=True)
class Allocation:
    include: tuple[str, ...]  # /choose selectors: NVML indices or UUIDs
    source: str  # the variable(s) it came from, for messages: "SLURM_JOB_GPUS=2,3"


def _entries(value: str | None) -> list[str] | None:
    items = [v.strip() for v in (value or "").split(",") if v.strip()]
    return items or None


def _is_uuid(entry: str) -> bool:
    return entry.upper().startswith(("GPU-", "MIG-"))


def _indices(entries: Sequence[str], source: str) -> list[int]:
    if not all(e.isascii() and e.isdigit() for e in entries):
        raise GpuExporterError(
            f"{source}: mixes GPU indices with other names; give CUDA_VISIBLE_DEVICES as UUIDs"
            f" or choose with include= ({IGNORE_HINT})"
        )
    return [int(e) for e in entries]


def allocation(
    environ: Mapping[str, str], host_gpus: Callable[[], Sequence[HostGpu]]
) -> Allocation | None:
    """This job's GPUs from ``environ`` (None: the whole host); ``host_gpus`` is asked only
    when CUDA's indices must be mapped."""
    cuda = _entries(environ.get("CUDA_VISIBLE_DEVICES"))
    nvidia = (environ.get("NVIDIA_VISIBLE_DEVICES") or "").strip()
    for name, value in (
        ("CUDA_VISIBLE_DEVICES", cuda and cuda[0]),
        ("NVIDIA_VISIBLE_DEVICES", nvidia),
    ):
        if value in ("-1", "none", "void", "NoDevFiles"):
            raise GpuExporterError(
                f"{name}={value} gives this job no GPU: nothing to choose from ({IGNORE_HINT})"
            )
    if cuda and all(_is_uuid(e) for e in cuda):
        return Allocation(tuple(cuda), f"CUDA_VISIBLE_DEVICES={','.join(cuda)}")
    host_name, host = "SLURM_JOB_GPUS", _entries(environ.get("SLURM_JOB_GPUS"))
    if host is None and nvidia.lower() != "all":
        host_name, host = "NVIDIA_VISIBLE_DEVICES", _entries(nvidia)
    if host is not None:
        source = f"{host_name}={','.join(host)}"
        if cuda is not None:
            return Allocation(
                _inside(cuda, host, source), f"{source} CUDA_VISIBLE_DEVICES={','.join(cuda)}"
            )
        return Allocation(tuple(host), source)
    if cuda is None:
        return None
    source = f"CUDA_VISIBLE_DEVICES={','.join(cuda)}"
    wanted = _indices(cuda, source)
    gpus = sorted(host_gpus(), key=lambda g: g.pci_bus_id.lower().split(":", 1)[-1])
    models = sorted({g.name for g in gpus})
    if environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and len(models) > 1:
        raise GpuExporterError(
            f"{source} counts this host's GPUs fastest first ({' and '.join(models)} differ), "
            "not in the order the exporter knows them: set CUDA_DEVICE_ORDER=PCI_BUS_ID or "
            f"give CUDA_VISIBLE_DEVICES as UUIDs ({IGNORE_HINT})"
        )
    missing = [i for i in wanted if i >= len(gpus)]
    if missing:
        raise GpuExporterError(f"{source}: this host has {len(gpus)} GPUs, no GPU {missing[0]}")
    return Allocation(tuple(gpus[i].uuid for i in wanted), source)


def _inside(cuda: list[str], host: list[str], source: str) -> tuple[str, ...]:
    """CUDA's indices within a launcher's allocation of the host's cards ``host``."""
    both = f"{source} and CUDA_VISIBLE_DEVICES={','.join(cuda)}"
    if not all(h.isascii() and h.isdigit() for h in host):  # UUIDs: CUDA counts within them
        relative = _indices(cuda, both)
        if any(i >= len(host) for i in relative):
            raise GpuExporterError(f"{both}: an index past the allocated GPUs ({IGNORE_HINT})")
        return tuple(host[i] for i in relative)
    wanted = set(_indices(cuda, both))
    allocated = sorted(int(h) for h in host)
    readings = set()
    if wanted <= set(allocated):  # the host's numbering (Slurm without device cgroups)
        readings.add(tuple(sorted(wanted)))
    if max(wanted) < len(allocated):  # the job's own 0..k-1 (with them)
        readings.add(tuple(sorted(allocated[i] for i in wanted)))
    if len(readings) != 1:
        how = "can name different cards" if readings else "names no allocated card"
        raise GpuExporterError(
            f"{both} {how} (the host's numbering, or the job's own 0..k-1): give "
            f"CUDA_VISIBLE_DEVICES as UUIDs ({IGNORE_HINT})"
        )
    return tuple(str(i) for i in readings.pop())


def cuda_indices(
    uuids: Sequence[str], environ: Mapping[str, str], host_gpus: Callable[[], Sequence[HostGpu]]
) -> tuple[int, ...]:
    """The indices CUDA gives the cards ``uuids`` under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, in
    the job ``environ`` describes (before the choice replaced its mask): their places, in
    PCI bus order, among the cards its CUDA enumerates — the whole host, or what a container
    (``NVIDIA_VISIBLE_DEVICES``) or Slurm's device cgroup lets it see. For tools that cannot
    take UUIDs in ``CUDA_VISIBLE_DEVICES``."""
    if any(_is_uuid(u) and u.upper().startswith("MIG-") for u in uuids):
        raise GpuExporterError("a MIG device can be named by its UUID only, not an index")
    gpus = sorted(host_gpus(), key=lambda g: g.pci_bus_id.lower().split(":", 1)[-1])
    seen = gpus
    nvidia = (environ.get("NVIDIA_VISIBLE_DEVICES") or "").strip()
    slurm = _entries(environ.get("SLURM_JOB_GPUS"))
    cuda = _entries(environ.get("CUDA_VISIBLE_DEVICES"))
    if nvidia and nvidia.lower() != "all":  # a container sees its devices only
        names = _entries(nvidia) or []
        seen = [g for g in gpus if str(g.index) in names or any(_named(g, n) for n in names)]
    elif slurm is not None:  # with device cgroups CUDA sees the job's cards, else all
        if cuda is not None and set(cuda) == set(slurm):
            seen = gpus
        elif cuda == [str(i) for i in range(len(slurm))]:
            seen = [g for g in gpus if str(g.index) in slurm]
        else:
            raise GpuExporterError(
                f"SLURM_JOB_GPUS={','.join(slurm)}: cannot tell whether CUDA here numbers the "
                "host's cards or only the job's (Slurm's device cgroup); use UUIDs"
            )
    place = {g.uuid: i for i, g in enumerate(seen)}
    missing = [u for u in uuids if u not in place]
    if missing:
        raise GpuExporterError(f"{missing[0]} is not among the cards this job's CUDA sees")
    return tuple(place[u] for u in uuids)


def _named(gpu: HostGpu, name: str) -> bool:
    return _is_uuid(name) and gpu.uuid.upper().startswith(name.upper())
