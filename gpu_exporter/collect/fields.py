"""The values of one device: which NVML call fills which :class:`~gpu_exporter.model.GpuSample`
field, read one field at a time.

:class:`FieldReader` isolates every field, so one unsupported or failing call leaves the
others in place, and remembers (device, field) pairs that answered ``NOT_SUPPORTED`` so they
are not asked again until NVML is re-initialised. :func:`read_values` is the list of fields,
for a whole GPU or a MIG device. Only :class:`~gpu_exporter.nvml.GpuLost` and
:class:`~gpu_exporter.nvml.NvmlUnavailable` escape; :mod:`gpu_exporter.collect.read` handles them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from gpu_exporter import nvml as nvml_mod
from gpu_exporter.collect import groups
from gpu_exporter.collect.procinfo import ProcInfoCache
from gpu_exporter.model import (
    CLOCKS,
    CLOCKS_EVENT_REASONS,
    ECC_COUNTERS,
    ECC_ERRORS,
    RETIREMENT_CAUSES,
    TEMPERATURE_THRESHOLDS,
    ProcessSample,
    process_visibility,
)
from gpu_exporter.nvml import GpuLost, Nvml, NvmlError, NvmlUnavailable, Unsupported

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# (device uuid, field) pairs that answered NOT_SUPPORTED: not asked again until NVML is
# initialised again (the owner clears the set then).
UnsupportedFields = set[tuple[str, str]]


class FieldReader:
    """Reads fields of one device, remembering which (device, field) pairs are unsupported.

    Each field is read at its cadence (:mod:`gpu_exporter.collect.groups`): a :data:`ONCE`
    field once per identity (``static``), a :data:`SLOW` one only when ``slow_due`` (between
    two slow reads the last value, ``slow``, is reused), a field of a ``disabled`` group never.
    """

    def __init__(
        self,
        handle: Any,
        uuid: str,
        unsupported: UnsupportedFields,
        static: dict[str, Any] | None = None,
        *,
        slow: dict[str, Any] | None = None,
        slow_due: bool = True,
        disabled: frozenset[str] = frozenset(),
    ) -> None:
        self.handle = handle
        self.uuid = uuid
        self.unsupported = unsupported
        self.static: dict[str, Any] = dict(static or {})
        self.slow: dict[str, Any] = dict(slow or {})
        self.slow_due = slow_due
        self.disabled = disabled
        self.values: dict[str, Any] = {}
        self.asked: dict[str, bool] = {}  # field → supported
        self.last_error: str | None = None
        self.newly_unsupported: list[str] = []  # logged together, one line per device

    def read(self, field: str, names: tuple[str, ...], fn: Callable[[Any], Any]) -> bool:
        """Store ``fn(handle)`` under ``names`` (a tuple result fills several), or the value
        remembered for a once / slow field that is not due. True if there is a value."""
        when, group = groups.FIELDS[field]
        if group in self.disabled:
            return False
        if (self.uuid, field) in self.unsupported:
            self.asked[field] = False
            return False
        memo = self.static if when == groups.ONCE else self.slow if when == groups.SLOW else None
        if memo is not None and (when == groups.ONCE or not self.slow_due):
            self.asked[field] = True
            if field not in memo:
                if when == groups.SLOW:  # failed at the last slow read: absent until the next
                    return False
            else:
                self._store(names, memo[field])
                return True
        try:
            value = fn(self.handle)
        except Unsupported:
            self.unsupported.add((self.uuid, field))
            self.asked[field] = False
            self.newly_unsupported.append(field)
            return False
        except (GpuLost, NvmlUnavailable):
            raise
        except NvmlError as exc:
            self.asked[field] = True
            self.last_error = str(exc)
            if memo is not None:
                memo.pop(field, None)
            return False
        self.asked[field] = True
        self._store(names, value)
        if memo is not None:
            memo[field] = value
        return True

    def _store(self, names: tuple[str, ...], value: Any) -> None:
        if len(names) == 1:
            self.values[names[0]] = value
        elif names:
            self.values.update(zip(names, value, strict=True))

    def log_unsupported(self) -> None:
        """One INFO line naming every field this device turned out not to support: a consumer
        card lacks a dozen, and a line each buried the start-up log."""
        if self.newly_unsupported:
            log.info(
                "GPU %s cannot report %s; not asking again",
                self.uuid,
                ", ".join(self.newly_unsupported),
            )
            self.newly_unsupported.clear()


def _reasons(mask: int) -> tuple[str, ...]:
    return interned(
        tuple(r for r in CLOCKS_EVENT_REASONS if mask & nvml_mod.CLOCKS_EVENT_REASON_BITS[r])
    )


_INTERNED: dict[Any, Any] = {}


def interned(value: _T) -> _T:
    """One shared object for equal tuples that repeat in every sample (which fields a GPU
    supports, active throttle reasons), so the 600-snapshot history does not hold copies."""
    if len(_INTERNED) > 4096:  # only ever a handful of distinct values; never grow unbounded
        _INTERNED.clear()
    found: _T = _INTERNED.setdefault(value, value)
    return found


def _processes(
    nvml: Nvml, handle: Any, procinfo: ProcInfoCache | None
) -> tuple[ProcessSample, ...]:
    """The compute processes on one device, one entry per pid (memory summed), attributed
    from /proc as ``procinfo`` reads it."""
    memory: dict[int, int | None] = {}
    for p in nvml.compute_processes(handle):
        if p.pid in memory:
            known = [m for m in (memory[p.pid], p.used_memory_bytes) if m is not None]
            memory[p.pid] = sum(known) if known else None
        else:
            memory[p.pid] = p.used_memory_bytes
    out = []
    for pid, used in memory.items():
        info = procinfo.get(pid) if procinfo is not None else None
        if info is None:
            out.append(ProcessSample(pid, used))
        else:
            out.append(
                ProcessSample(
                    pid,
                    used,
                    info.user,
                    info.command,
                    info.container,
                    info.slurm_job,
                    info.pod,
                    info.ancestors,
                    info.cgroup,
                )
            )
    return tuple(out)


def read_values(
    nvml: Nvml, r: FieldReader, procinfo: ProcInfoCache | None, *, whole_gpu: bool
) -> None:
    """Every field of one device into ``r.values``; ``whole_gpu`` False for a MIG device,
    which answers only memory, utilization (not at all, in practice) and processes."""
    try:
        _read_values(nvml, r, procinfo, whole_gpu=whole_gpu)
    finally:
        r.log_unsupported()


def _read_values(
    nvml: Nvml, r: FieldReader, procinfo: ProcInfoCache | None, *, whole_gpu: bool
) -> None:
    r.read("memory", _MEMORY_FIELDS, lambda h: _astuple_memory(nvml, h, whole_gpu))
    r.read("utilization", ("utilization_ratio", "memory_utilization_ratio"), nvml.utilization)
    if not whole_gpu:
        r.read("processes", ("processes",), lambda h: _processes(nvml, h, procinfo))
        return
    r.read("mig_mode", ("mig_mode_enabled",), nvml.mig_mode_enabled)
    r.read("power_draw", ("power_draw_watts",), nvml.power_draw_watts)
    r.read("power_limit", ("power_limit_watts",), nvml.power_limit_watts)
    r.read("energy", ("energy_joules",), nvml.energy_joules)
    r.read("temperature", ("temperature_celsius",), nvml.temperature_celsius)
    r.read("fan_speed", ("fan_speed_ratio",), nvml.fan_speed_ratio)
    for clock in CLOCKS:
        r.read(
            f"clock_{clock}", (f"clock_{clock}_hz",), functools.partial(nvml.clock_hz, clock=clock)
        )
    if not r.values.get("mig_mode_enabled"):  # in MIG mode, processes are read per MIG device
        r.read("processes", ("processes",), lambda h: _processes(nvml, h, procinfo))
    r.read(
        "clocks_event_reasons",
        ("clocks_event_reasons",),
        lambda h: _reasons(nvml.clocks_event_reasons(h)),
    )
    r.read("performance_state", ("performance_state",), nvml.performance_state)
    r.read("persistence_mode", ("persistence_mode_enabled",), nvml.persistence_mode_enabled)
    r.read("compute_mode", ("compute_mode",), nvml.compute_mode)
    r.read("ecc_mode", ("ecc_mode_enabled",), nvml.ecc_mode_enabled)
    for error in ECC_ERRORS:
        for counter in ECC_COUNTERS:
            r.read(
                f"ecc_errors_{error}_{counter}",
                (f"ecc_errors_{error}_{counter}",),
                functools.partial(nvml.ecc_errors, error=error, counter=counter),
            )
    r.read(
        "remapped_rows",
        (
            "remapped_rows_correctable",
            "remapped_rows_uncorrectable",
            "remapped_rows_pending",
            "remapped_rows_failed",
        ),
        lambda h: dataclasses.astuple(nvml.remapped_rows(h)),
    )
    for cause in RETIREMENT_CAUSES:
        r.read(
            f"retired_pages_{cause}",
            (f"retired_pages_{cause}",),
            functools.partial(nvml.retired_pages, cause=cause),
        )
    r.read("retired_pages_pending", ("retired_pages_pending",), nvml.retired_pages_pending)
    r.read(
        "pcie_link_generation_current",
        ("pcie_link_generation_current",),
        functools.partial(nvml.pcie_link_generation, link="current"),
    )
    r.read(
        "pcie_link_width_current",
        ("pcie_link_width_current",),
        functools.partial(nvml.pcie_link_width, link="current"),
    )
    r.read("pcie_replay_errors", ("pcie_replay_errors",), nvml.pcie_replay_errors)
    r.read("encoder_utilization", ("encoder_utilization_ratio",), nvml.encoder_utilization_ratio)
    r.read("decoder_utilization", ("decoder_utilization_ratio",), nvml.decoder_utilization_ratio)
    # Read once per GPU and initialisation (groups.ONCE): these do not change while the
    # driver runs.
    for clock in CLOCKS:
        r.read(
            f"clock_max_{clock}",
            (f"clock_max_{clock}_hz",),
            functools.partial(nvml.max_clock_hz, clock=clock),
        )
    for threshold in TEMPERATURE_THRESHOLDS:
        r.read(
            f"temperature_threshold_{threshold}",
            (f"temperature_{threshold}_celsius",),
            functools.partial(nvml.temperature_threshold_celsius, threshold=threshold),
        )
    r.read("power_limit_default", ("power_limit_default_watts",), nvml.power_limit_default_watts)
    r.read(
        "power_limit_constraints",
        ("power_limit_min_watts", "power_limit_max_watts"),
        nvml.power_limit_constraints_watts,
    )
    r.read(
        "pcie_link_generation_max",
        ("pcie_link_generation_max",),
        functools.partial(nvml.pcie_link_generation, link="max"),
    )
    r.read(
        "pcie_link_width_max",
        ("pcie_link_width_max",),
        functools.partial(nvml.pcie_link_width, link="max"),
    )


_MEMORY_FIELDS = (
    "memory_total_bytes",
    "memory_used_bytes",
    "memory_free_bytes",
    "memory_reserved_bytes",
)


def with_processes(values: dict[str, Any]) -> dict[str, Any]:
    """Fill compute_processes and process_visibility from the process list."""
    procs = values.get("processes")
    if procs is not None:
        values["compute_processes"] = len(procs)
    values["process_visibility"] = process_visibility(values.get("memory_used_bytes"), procs)
    return values


def _astuple_memory(
    nvml: Nvml, handle: Any, whole_gpu: bool = True
) -> tuple[int, int, int, int | None]:
    m = nvml.memory(handle, whole_gpu=whole_gpu)
    return m.total_bytes, m.used_bytes, m.free_bytes, m.reserved_bytes
