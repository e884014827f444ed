"""The field table (which NVML call fills which :class:`~gpu_exporter.model.GpuSample`
attributes, how often, under which ``--collect.<group>``), and reading it for one device.

Cadences, as DCGM has them: :data:`FAST` every ``--interval``; :data:`SLOW` every
``--slow-interval`` (health counters and settings; between two slow reads the last value
stays, one whose read failed is absent); :data:`ONCE` once per GPU and NVML initialisation.
A disabled group makes no call; :data:`CORE` fields (what ``/choose`` ranks on) always read.

:class:`FieldReader` isolates every field, so one unsupported or failing call leaves the
others in place, and remembers (device, field) pairs that answered ``NOT_SUPPORTED`` so they
are not asked again until NVML is re-initialised. :func:`read_values` is the list of fields,
for a whole GPU or a MIG device. Only :class:`~gpu_exporter.nvml.GpuLost` and
:class:`~gpu_exporter.nvml.NvmlUnavailable` escape; :mod:`gpu_exporter.collect.read` handles them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gpu_exporter import nvml as nvml_mod
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

FAST = "every sample"
SLOW = "every --slow-interval"
ONCE = "once"
GPM = "every --gpm-interval"  # collect/gpm.py: two samples per device, that far apart
CORE = ""  # no group: always read

# (device uuid, field) pairs that answered NOT_SUPPORTED: not asked again until re-init
UnsupportedFields = set[tuple[str, str]]


class FieldReader:
    """Reads fields of one device, remembering which (device, field) pairs are unsupported.

    Each field is read at its cadence: a :data:`ONCE` field once per identity (``static``),
    a :data:`SLOW` one only when ``slow_due`` (between two slow reads the last value,
    ``slow``, is reused), a field of a ``disabled`` group never.
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
        carry: Carry | None = None,
    ) -> None:
        self.handle = handle
        self.carry = carry
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

    def read(self, f: Field, nvml: Nvml, procinfo: ProcInfoCache | None) -> bool:
        """Store what ``f`` reads under ``f.names`` (a tuple result fills several), or the
        value remembered for a once / slow field that is not due. True if there is a value."""
        field, names, when = f.field, f.names, f.when
        if f.group in self.disabled:
            return False
        if (self.uuid, field) in self.unsupported:
            self.asked[field] = False
            return False
        if f.needs is not None and not self.values.get(f.needs):
            return False
        memo = self.static if when == ONCE else self.slow if when == SLOW else None
        if memo is not None and (when == ONCE or not self.slow_due):
            self.asked[field] = True
            if field not in memo:
                if when == SLOW:  # failed at the last slow read: absent until the next
                    return False
            else:
                self._store(names, memo[field])
                return True
        try:
            value = f.read(nvml, procinfo, self.handle)
        except Unsupported:
            self._unsupported(field)
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

    def read_fast(self, nvml: Nvml, procinfo: ProcInfoCache | None) -> None:
        """The fast fields of :attr:`carry`, on top of its carried values. A field that
        turns out unsupported ends the carry (the next sample walks every field again)."""
        carry, handle = self.carry, self.handle
        assert carry is not None
        self.values = dict(carry.values)
        for f in carry.fast:
            if f.needs is not None and not self.values.get(f.needs):
                continue
            try:
                value = f.read(nvml, procinfo, handle)
            except Unsupported:
                self.asked = self.asked or dict(carry.asked)
                self._unsupported(f.field)
                continue
            except (GpuLost, NvmlUnavailable):
                raise
            except NvmlError as exc:
                self.last_error = str(exc)
                continue
            self._store(f.names, value)

    def fields_supported(self) -> tuple[tuple[str, bool], ...]:
        """(field, supported) for every field asked of this device, in reading order."""
        if self.carry is not None and not self.asked:
            return self.carry.fields_supported
        return interned(tuple(self.asked.items()))

    def next_carry(self, table: tuple[Field, ...]) -> Carry | None:
        """What the next samples start from until the next slow read: None while a
        once-field still has to be read again (it failed), or a fast field turned out
        unsupported during a fast walk."""
        if self.carry is not None:
            return None if self.asked else self.carry
        fast = []
        values: dict[str, Any] = {}
        mig = bool(self.values.get("mig_mode_enabled"))
        for f in table:
            if f.group in self.disabled:
                continue
            supported = (self.uuid, f.field) not in self.unsupported
            if f.when == FAST:
                if supported and not (mig and f.field in PER_MIG_DEVICE):
                    fast.append(f)
            elif f.when == ONCE and supported and f.field not in self.static:
                return None  # failed: asked again next sample
            else:
                values.update((n, self.values[n]) for n in f.names if n in self.values)
        return Carry(values, dict(self.asked), self.fields_supported(), tuple(fast))

    def _unsupported(self, field: str) -> None:
        self.unsupported.add((self.uuid, field))
        self.asked[field] = False
        self.newly_unsupported.append(field)

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


@dataclasses.dataclass(frozen=True, slots=True)
class Carry:
    """A GPU's sample between two slow reads, less its fast fields: the slow and once
    values as GpuSample attributes, which fields were asked (and supported), and the fast
    fields still to call (enabled, supported). Built after a walk over every field."""

    values: dict[str, Any]
    asked: dict[str, bool]
    fields_supported: tuple[tuple[str, bool], ...]
    fast: tuple[Field, ...]


def _reasons(mask: int) -> tuple[str, ...]:
    bits = nvml_mod.CLOCKS_EVENT_REASON_BITS
    return interned(tuple(r for r in CLOCKS_EVENT_REASONS if mask & bits[r]))


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
        i = procinfo.get(pid) if procinfo is not None else None
        if i is None:
            out.append(ProcessSample(pid, used))
        else:  # (the attribution fields, in ProcessSample's order)
            attribution = (i.user, i.command, i.container, i.slurm_job, i.pod)
            out.append(ProcessSample(pid, used, *attribution, i.ancestors, i.cgroup))
    return tuple(out)


Reader = Callable[[Nvml, "ProcInfoCache | None", Any], Any]  # read(nvml, procinfo, handle)


@dataclasses.dataclass(frozen=True, slots=True)
class Field:
    """One row of the field table: its name (``/gpus``' ``fields_updated``, the
    ``field`` label), the GpuSample attributes its value fills (a tuple value fills several),
    how it is read, its cadence and its ``--collect.<group>``. One NVML call per read."""

    field: str
    names: tuple[str, ...]
    read: Reader
    when: str = FAST
    group: str = CORE
    # Read only when this attribute, read before it, is non-empty (nothing to ask about else).
    needs: str | None = None


def _f(field: str, names: tuple[str, ...] | str, read: Reader, when: str, group: str) -> Field:
    return Field(field, (names,) if isinstance(names, str) else names, read, when, group)


def _m(field: str, name: str, when: str, group: str) -> Field:
    """A field read by the Nvml method of the same name as the GpuSample attribute."""
    return _f(field, name, lambda n, _, h: getattr(n, name)(h), when, group)


def _memory(whole_gpu: bool) -> Reader:
    def read(nvml: Nvml, _: ProcInfoCache | None, h: Any) -> tuple[Any, ...]:
        m = nvml.memory(h, whole_gpu=whole_gpu)
        return m.total_bytes, m.used_bytes, m.free_bytes, m.reserved_bytes

    return read


def _utilization(n: Nvml, _: ProcInfoCache | None, h: Any) -> tuple[float, float]:
    return n.utilization(h)


def _clock(clock: str, maximum: bool = False) -> Field:
    name, method = (
        (f"clock_max_{clock}", "max_clock_hz") if maximum else (f"clock_{clock}", "clock_hz")
    )
    read: Reader = lambda n, _, h: getattr(n, method)(h, clock)  # noqa: E731
    return _f(name, f"{name}_hz", read, ONCE if maximum else FAST, "clocks")


def _ecc(error: str, counter: str) -> Field:
    name = f"ecc_errors_{error}_{counter}"
    return _f(name, name, lambda n, _, h: n.ecc_errors(h, error, counter), SLOW, "health")


def _threshold(t: str) -> Field:
    read: Reader = lambda n, _, h: n.temperature_threshold_celsius(h, t)  # noqa: E731
    return _f(f"temperature_threshold_{t}", f"temperature_{t}_celsius", read, ONCE, "temperature")


def _link(what: str, link: str) -> Field:
    name = f"pcie_link_{what}_{link}"  # Nvml.pcie_link_generation or pcie_link_width
    read: Reader = lambda n, _, h: getattr(n, f"pcie_link_{what}")(h, link)  # noqa: E731
    return _f(name, name, read, SLOW if link == "current" else ONCE, "pcie")


def _retired(cause: str) -> Field:
    name = f"retired_pages_{cause}"
    return _f(name, name, lambda n, _, h: n.retired_pages(h, cause), SLOW, "health")


_MEMORY_FIELDS = tuple(f"memory_{x}_bytes" for x in ("total", "used", "free", "reserved"))
_PROCESSES = _f("processes", "processes", lambda n, p, h: _processes(n, h, p), FAST, "processes")


# -- per-process utilization: merged into the process list by with_processes -------------
# NVML keeps a few seconds of per-process samples; the latest within this look-back is the
# process's utilization now (a listed process without one did nothing: 0).
PROCESS_UTILIZATION_LOOKBACK_SECONDS = 3.0


def _process_utilization(n: Nvml, _: ProcInfoCache | None, h: Any) -> dict[int, Any]:
    since = time.time() - PROCESS_UTILIZATION_LOOKBACK_SECONDS
    return n.process_utilization(h, int(since * 1e6))


# Asked only of a device with compute processes: with none, there is nobody to attribute to.
_PROCESS_UTILIZATION = dataclasses.replace(
    _f("process_utilization", "process_utilization", _process_utilization, FAST, "processes"),
    needs="processes",
)
# Whole-GPU fields that a GPU in MIG mode reads per MIG device (or, NVML, not at all).
PER_MIG_DEVICE = ("processes", "process_utilization")


# -- GPM: read by collect/gpm.py, which keeps two samples per device; a row here for its
# cadence, group and support, like every other field (not in GPU_FIELDS: not walked) -------
def _read_by_gpm_module(n: Nvml, _: ProcInfoCache | None, h: Any) -> Any:
    raise NotImplementedError("GPM is read by collect.gpm.GpmReader, two samples apart")


GPM_FIELD = _f("gpm", tuple(nvml_mod.GPM_METRICS), _read_by_gpm_module, GPM, "gpm")
_UTILIZATION = _f(
    "utilization", ("utilization_ratio", "memory_utilization_ratio"), _utilization, FAST, CORE
)
# A MIG device answers only memory, utilization (not at all, in practice) and processes.
MIG_FIELDS = (_f("memory", _MEMORY_FIELDS, _memory(False), FAST, CORE), _UTILIZATION, _PROCESSES)
# How many MIG devices a GPU in MIG mode can have (read.py reads it before its devices).
MIG_DEVICE_COUNT = _f(
    "mig_device_count", "mig_device_count", lambda n, _, h: n.max_mig_device_count(h), ONCE, CORE
)
# A whole GPU, in the order read (MIG mode before processes: in MIG mode, processes are
# read per MIG device instead), then the once-fields. Kept as a table, not in ruff's layout.
GPU_FIELDS = (
    _f("memory", _MEMORY_FIELDS, _memory(True), FAST, CORE),
    _UTILIZATION,
    _m("mig_mode", "mig_mode_enabled", SLOW, CORE),
    _m("power_draw", "power_draw_watts", FAST, "power"),
    _m("power_limit", "power_limit_watts", SLOW, "power"),
    # Read as a health counter: one call takes ~3 ms on an H100 (docs/real-gpu.md), the
    # other getters 2-10 µs; a counter loses nothing but resolution between two reads.
    _m("energy", "energy_joules", SLOW, "power"),
    _m("temperature", "temperature_celsius", FAST, "temperature"),
    _m("fan_speed", "fan_speed_ratio", FAST, "temperature"),
    *(_clock(clock) for clock in CLOCKS),
    _PROCESSES,
    _PROCESS_UTILIZATION,
    _f("clocks_event_reasons", "clocks_event_reasons",
       lambda n, _, h: _reasons(n.clocks_event_reasons(h)), FAST, "clocks"),
    _m("performance_state", "performance_state", SLOW, "clocks"),
    _m("persistence_mode", "persistence_mode_enabled", SLOW, "health"),
    _m("compute_mode", "compute_mode", SLOW, "health"),
    _m("ecc_mode", "ecc_mode_enabled", SLOW, "health"),
    *(_ecc(error, counter) for error in ECC_ERRORS for counter in ECC_COUNTERS),
    _f("remapped_rows",
       tuple(f"remapped_rows_{x}" for x in ("correctable", "uncorrectable", "pending", "failed")),
       lambda n, _, h: dataclasses.astuple(n.remapped_rows(h)), SLOW, "health"),
    *(_retired(cause) for cause in RETIREMENT_CAUSES),
    _m("retired_pages_pending", "retired_pages_pending", SLOW, "health"),
    _link("generation", "current"),
    _link("width", "current"),
    _m("pcie_replay_errors", "pcie_replay_errors", SLOW, "pcie"),
    _m("encoder_utilization", "encoder_utilization_ratio", FAST, "media"),
    _m("decoder_utilization", "decoder_utilization_ratio", FAST, "media"),
    *(_clock(clock, maximum=True) for clock in CLOCKS),
    *(_threshold(t) for t in TEMPERATURE_THRESHOLDS),
    _m("power_limit_default", "power_limit_default_watts", ONCE, "power"),
    _f("power_limit_constraints", ("power_limit_min_watts", "power_limit_max_watts"),
       lambda n, _, h: n.power_limit_constraints_watts(h), ONCE, "power"),
    _link("generation", "max"),
    _link("width", "max"),
)  # fmt: skip
# Every field by name, whole GPU or MIG device.
FIELDS: dict[str, Field] = {f.field: f for f in (*GPU_FIELDS, MIG_DEVICE_COUNT, GPM_FIELD)}


def read_values(
    nvml: Nvml, r: FieldReader, procinfo: ProcInfoCache | None, *, whole_gpu: bool
) -> None:
    """Every field of one device into ``r.values``; ``whole_gpu`` False for a MIG device.

    With ``r.carry`` (a whole GPU between two slow reads, every once-field known), only the
    fast fields are called and the rest is the carried values: no per-field bookkeeping.
    """
    try:
        if r.carry is not None:
            r.read_fast(nvml, procinfo)
            return
        for f in GPU_FIELDS if whole_gpu else MIG_FIELDS:
            if f.field in PER_MIG_DEVICE and r.values.get("mig_mode_enabled"):
                continue  # in MIG mode, processes are read per MIG device
            r.read(f, nvml, procinfo)
    finally:
        r.log_unsupported()


def with_processes(values: dict[str, Any]) -> dict[str, Any]:
    """Fill compute_processes and process_visibility from the process list, and each listed
    process's utilization from process_utilization (which goes: it is no GpuSample field)."""
    procs = values.get("processes")
    busy = values.pop("process_utilization", None)
    if procs is not None and busy is not None:  # NVML lists only processes that did something
        procs = values["processes"] = tuple(
            dataclasses.replace(
                p,
                sm_utilization_ratio=busy.get(p.pid, (0.0, 0.0))[0],
                memory_utilization_ratio=busy.get(p.pid, (0.0, 0.0))[1],
            )
            for p in procs
        )
    if procs is not None:
        values["compute_processes"] = len(procs)
    values["process_visibility"] = process_visibility(values.get("memory_used_bytes"), procs)
    return values
