"""Reading one GPU into a :class:`~gpu_exporter.model.GpuSample`: its handle and identity, its
fields (:mod:`gpu_exporter.collect.fields`), and its MIG devices.

:func:`read_gpu` never raises for a GPU-level error: a GPU that cannot be reached, or is lost
part-way, comes back as ``up=False`` with a ``down_reason``, and nothing read before the loss.
Only :class:`~gpu_exporter.nvml.NvmlUnavailable` (the library as a whole) escapes. The
sampler runs it on a per-GPU worker with a deadline; the client's local fallback calls it
directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from gpu_exporter.collect.fields import (
    GPM_FIELD,
    GPU_FIELDS,
    MIG_DEVICE_COUNT,
    Carry,
    FieldReader,
    UnsupportedFields,
    interned,
    read_values,
    with_processes,
)
from gpu_exporter.collect.gpm import GpmReader
from gpu_exporter.collect.groups import OFF_BY_DEFAULT
from gpu_exporter.collect.procinfo import ProcInfoCache
from gpu_exporter.counters import MonotonicCounters
from gpu_exporter.model import NVLINK_ERRORS, GpuSample, NvLinkSample
from gpu_exporter.nvml import GpuLost, Nvml, NvmlError, NvmlUnavailable

_T = TypeVar("_T")

# GpuSample.down_reason values (the reason label of gpu_down_reason).
DOWN_LOST = "lost"  # GPU_IS_LOST and friends: fell off the bus, needs a reset
DOWN_TIMEOUT = "timeout"  # an NVML call for it did not return within the deadline
DOWN_ERROR = "error"  # any other failure to get a handle
DOWN_REASONS = (DOWN_LOST, DOWN_TIMEOUT, DOWN_ERROR)


@dataclass(frozen=True, slots=True)
class MigIdentity:
    """What is read once per MIG device, and kept while it exists."""

    name: str | None
    profile: str | None
    gpu_instance_id: int | None
    compute_instance_id: int | None


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    """What is read once per GPU after each initialisation, and kept while the GPU lives."""

    uuid: str
    name: str | None
    pci_bus_id: str | None
    # Values that do not change while the driver runs (max clocks, thresholds, power
    # constraints, maximum PCIe link), by field name, once read successfully.
    static: tuple[tuple[str, Any], ...] = ()
    mig: tuple[tuple[str, MigIdentity], ...] = ()  # MIG devices seen, by MIG uuid
    # The slow fields' values at their last read (fields.SLOW), reused until the next one.
    slow: tuple[tuple[str, Any], ...] = ()
    # Until the next slow read: the sample less its fast fields (see fields.Carry).
    carry: Carry | None = None
    # nvmlDeviceGetHandleByIndex's answer, asked once: valid until NVML is shut down (the
    # sampler then drops every identity) or the GPU is lost (forget_values).
    handle: Any = None

    def forget_values(self) -> GpuIdentity:
        """The identity of a GPU that went down: its name stays, its remembered values and
        its handle go, so they are asked again once it answers (after a reset they may
        differ)."""
        return dataclasses.replace(self, static=(), slow=(), mig=(), carry=None, handle=None)


def _read_mig_devices(
    nvml: Nvml, r: FieldReader, identity: GpuIdentity, index: int, procinfo: ProcInfoCache | None
) -> tuple[tuple[GpuSample, ...], dict[str, MigIdentity]]:
    """The MIG devices of the GPU ``r`` reads (in MIG mode), each a GpuSample with the
    parent's index, and their identities by MIG uuid."""
    known = dict(identity.mig)
    r.read(MIG_DEVICE_COUNT, nvml, procinfo)
    slots = r.values.pop("mig_device_count", 0)
    devices = []
    seen: dict[str, MigIdentity] = {}
    for slot in range(slots):
        try:
            handle = nvml.mig_device_handle(r.handle, slot)
            if handle is None:  # an empty slot
                continue
            uuid = nvml.uuid(handle)
            ident = known.get(uuid)
            if ident is None:
                name = optional(nvml.name, handle)
                ident = MigIdentity(
                    name,
                    name.rsplit("MIG ", 1)[1] if name and "MIG " in name else None,
                    optional(nvml.gpu_instance_id, handle),
                    optional(nvml.compute_instance_id, handle),
                )
        except (GpuLost, NvmlUnavailable):
            raise
        except NvmlError as exc:
            r.last_error = str(exc)
            continue
        seen[uuid] = ident
        m = FieldReader(handle, uuid, r.unsupported, disabled=r.disabled)
        read_values(nvml, m, procinfo, whole_gpu=False)
        devices.append(
            GpuSample.from_values(
                index=index,
                uuid=uuid,
                up=True,
                name=ident.name,
                pci_bus_id=identity.pci_bus_id,
                error=m.last_error,
                parent_uuid=r.uuid,
                gpu_instance_id=ident.gpu_instance_id,
                compute_instance_id=ident.compute_instance_id,
                mig_profile=ident.profile,
                fields_supported=m.fields_supported(),
                **with_processes(m.values),
            )
        )
    return tuple(devices), seen


def read_gpu(
    nvml: Nvml,
    index: int,
    identity: GpuIdentity | None,
    unsupported: UnsupportedFields,
    *,
    procinfo: ProcInfoCache | None = None,
    slow_due: bool = True,
    disabled: frozenset[str] = frozenset(OFF_BY_DEFAULT),
    seen_at: float | None = None,
    counters: MonotonicCounters | None = None,
    gpm: GpmReader | None = None,
    now: float = 0.0,
) -> tuple[GpuSample, GpuIdentity | None]:
    """One GPU's sample (with its MIG devices and processes), and its identity for next
    time. Never raises for GPU-level errors.

    ``procinfo`` attributes processes from /proc (``--process-labels``); None reads nothing.
    ``slow_due``: read the slow fields now (else their values of the last slow read are
    reused, and only the fast fields are called); ``disabled``: the ``--collect.<group>``
    groups not read at all; ``seen_at``: the sample's ``last_seen_seconds`` if it answers;
    ``counters``: keeps the NVLink counters from going backwards across driver resets (the
    sampler's, for the process's life; None exports NVML's own counts). ``gpm``: the GPM
    state (None: no GPM), read at ``now`` (the sampler's monotonic clock).
    """
    known_uuid = identity.uuid if identity else ""
    try:
        handle = identity.handle if identity is not None else None
        if handle is None:  # once per GPU, NVML initialisation and loss (issue 31)
            handle = nvml.handle(index)
            if identity is None:
                identity = GpuIdentity(
                    nvml.uuid(handle),
                    optional(nvml.name, handle),
                    optional(nvml.pci_bus_id, handle),
                    handle=handle,
                )
            else:
                identity = dataclasses.replace(identity, handle=handle)
    except NvmlUnavailable:
        raise
    except NvmlError as exc:
        reason = DOWN_LOST if isinstance(exc, GpuLost) else DOWN_ERROR
        sample = GpuSample(
            index=index, uuid=known_uuid, up=False, error=str(exc), down_reason=reason
        )
        return sample, identity.forget_values() if identity is not None else None
    assert identity is not None

    r = FieldReader(
        handle,
        identity.uuid,
        unsupported,
        dict(identity.static),
        slow=dict(identity.slow),
        slow_due=slow_due,
        disabled=disabled,
        carry=None if slow_due else identity.carry,
    )
    mig_devices: tuple[GpuSample, ...] = ()
    mig_seen = dict(identity.mig)
    try:
        read_values(nvml, r, procinfo, whole_gpu=True)
        if r.values.get("mig_mode_enabled"):
            mig_devices, mig_seen = _read_mig_devices(nvml, r, identity, index, procinfo)
            procs = [d.processes for d in mig_devices]
            if mig_devices and all(p is not None for p in procs):
                r.values["processes"] = tuple(p for ps in procs if ps for p in ps)
        gpm_supported: tuple[tuple[str, bool], ...] = ()
        if gpm is not None and GPM_FIELD.group not in disabled:
            mig_devices, gpm_supported = _read_gpm(gpm, nvml, index, r, mig_devices, now)
    except GpuLost as exc:
        # Whatever was read before the GPU went away is dropped: no stale values that look fresh.
        return down_sample(index, identity, DOWN_LOST, str(exc)), identity.forget_values()
    carry = r.next_carry(GPU_FIELDS)
    if carry is None or carry is not identity.carry or r.values.get("mig_mode_enabled"):
        identity = dataclasses.replace(
            identity,
            static=tuple(r.static.items()),
            slow=tuple(r.slow.items()),
            mig=tuple(mig_seen.items()),
            carry=carry,
        )
    values = with_processes(r.values)
    if counters is not None and values.get("nvlink"):
        values = {**values, "nvlink": monotonic_nvlinks(counters, identity.uuid, values["nvlink"])}
    sample = GpuSample.from_values(
        index=index,
        uuid=identity.uuid,
        up=True,
        name=identity.name,
        pci_bus_id=identity.pci_bus_id,
        error=r.last_error,
        last_seen_seconds=seen_at,
        mig_devices=mig_devices,
        fields_supported=interned((*r.fields_supported(), *gpm_supported)),
        **values,
    )
    return sample, identity


def monotonic_nvlinks(
    counters: MonotonicCounters, uuid: str, links: tuple[NvLinkSample, ...]
) -> tuple[NvLinkSample, ...]:
    """``links`` with each counter as :class:`MonotonicCounters` keeps it (the carried raw
    readings are passed again between slow reads: an unchanged reading is unchanged)."""

    def kept(link: int, kind: str, reading: int | None) -> int | None:
        return None if reading is None else counters.value((uuid, link, kind), reading)

    return tuple(
        NvLinkSample(
            n.link,
            n.active,
            kept(n.link, "transmit", n.transmit_bytes),
            kept(n.link, "receive", n.receive_bytes),
            *(kept(n.link, e, v) for e, v in zip(NVLINK_ERRORS, n.errors(), strict=True)),
        )
        for n in links
    )


def _read_gpm(
    gpm: GpmReader,
    nvml: Nvml,
    index: int,
    r: FieldReader,
    mig_devices: tuple[GpuSample, ...],
    now: float,
) -> tuple[tuple[GpuSample, ...], tuple[tuple[str, bool], ...]]:
    """GPM of the GPU ``r`` reads (into ``r.values``) and of its MIG devices (returned with
    theirs), and the GPU's ("gpm", supported) for its fields_supported."""
    instances = [d.gpu_instance_id for d in mig_devices if d.gpu_instance_id is not None]
    supported, found = gpm.read(nvml, index, r.handle, r.uuid, instances, now)
    r.values.update(found.get(None, {}))
    if found and mig_devices:
        mig_devices = tuple(
            dataclasses.replace(d, **found.get(d.gpu_instance_id, {}))  # type: ignore[arg-type]
            for d in mig_devices
        )
    return mig_devices, () if supported is None else ((GPM_FIELD.field, supported),)


def optional(fn: Callable[[Any], _T], handle: Any) -> _T | None:
    """``fn(handle)``, or None when that one call fails (a lost GPU or library still raises)."""
    try:
        return fn(handle)
    except (GpuLost, NvmlUnavailable):
        raise
    except NvmlError:
        return None


def down_sample(index: int, identity: GpuIdentity | None, reason: str, error: str) -> GpuSample:
    """A down GPU: what its identity knows, and no values."""
    return GpuSample(
        index=index,
        uuid=identity.uuid if identity else "",
        up=False,
        name=identity.name if identity else None,
        pci_bus_id=identity.pci_bus_id if identity else None,
        error=error,
        down_reason=reason,
    )
