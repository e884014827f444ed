"""The fields (one NVML call each, filling :class:`~gpu_exporter.model.GpuSample` attributes,
how often, under which ``--collect.<group>``), and reading them for one device.

The fields are built from the rows of :data:`gpu_exporter.readings.READINGS` (rows of one
name share a call: a getter, its batch entries); a row whose value needs code of its own
(the memory struct, the process list, NVLink per link) is read by that code here.

Cadences, as DCGM has them: :data:`FAST` every ``--interval``; :data:`SLOW` every
``--slow-interval`` (health counters and settings; between two slow reads the last value
stays, one whose read failed is absent); :data:`ONCE` once per GPU and NVML initialisation.
A disabled group makes no call; :data:`CORE` fields (what ``/choose`` ranks on) always read.

:class:`FieldReader` isolates every field, so one unsupported or failing call leaves the
others in place, and remembers (device, field) pairs that answered ``NOT_SUPPORTED`` so they
are not asked again until NVML is re-initialised. :func:`read_values` is the list of fields,
for a whole GPU or a MIG device.

Fields NVML also offers as field values (:class:`Batched`: power, temperatures, energy, ECC,
remapped rows, retired pages, PCIe replays, NVLink) are read with one
``nvmlDeviceGetFieldValues`` call per GPU and cadence (issue 31): the fast batch never holds
a slow field (one slow entry makes the whole call as slow: energy costs ~3 ms on an H100).
An entry that fails fails its field alone; an entry the driver does not know sends that
field back to its single getter; a batch that fails as a whole sends every field of that GPU
back to its getter (logged once), until NVML is re-initialised.

Only :class:`~gpu_exporter.nvml.GpuLost` and :class:`~gpu_exporter.nvml.NvmlUnavailable`
escape; :mod:`gpu_exporter.collect.read` handles them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gpu_exporter import nvml as nvml_mod
from gpu_exporter.collect.procinfo import ProcInfoCache
from gpu_exporter.model import NvLinkSample, ProcessSample, process_visibility
from gpu_exporter.nvml import FIELD_IDS, GpuLost, Nvml, NvmlError, NvmlUnavailable, Unsupported
from gpu_exporter.readings import NVLINK_ERRORS, READINGS
from gpu_exporter.valuerow import CORE, FAST, GPM, ONCE, SLOW, Reading

log = logging.getLogger(__name__)
_T = TypeVar("_T")


# (device uuid, field) pairs that answered NOT_SUPPORTED: not asked again until re-init;
# also (uuid, BY_GETTER + field): a batched field read by its getter (the driver does not
# know its field id), and (uuid, NO_BATCH): that GPU's batches failed, every field by getter.
UnsupportedFields = set[tuple[str, str]]
BY_GETTER = "getter:"
NO_BATCH = "nvmlDeviceGetFieldValues"


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
        # This read's field-value batches: the cadences fetched, each field's answers.
        self.fetched: set[str] = set()
        self.batched: dict[str, list[Any]] = {}

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
            value = self._value(f, nvml, procinfo)
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
        carry = self.carry
        assert carry is not None
        self.values = dict(carry.values)
        for f in carry.fast:
            if f.needs is not None and not self.values.get(f.needs):
                continue
            try:
                value = self._value(f, nvml, procinfo)
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

    def _value(self, f: Field, nvml: Nvml, procinfo: ProcInfoCache | None) -> Any:
        """``f``'s value now: from its cadence's batch (fetched at the first batched field of
        that cadence), else from its getter. Raises what the entry or the getter raised."""
        if f.batch is not None and (self.uuid, BY_GETTER + f.field) not in self.unsupported:
            if f.when not in self.fetched:
                self._fetch(f.when, nvml)
            answers = self.batched.pop(f.field, None)
            if answers is not None:
                try:
                    return f.batch.convert(answers)
                except Unsupported:
                    if f.read is None:
                        raise
                    # The driver does not know this field id: its getter from now on.
                    self.unsupported.add((self.uuid, BY_GETTER + f.field))
        if f.read is None:  # a field value only, and this GPU's batch failed
            raise Unsupported(NO_BATCH, _NOT_SUPPORTED, "only a field value")
        return f.read(nvml, procinfo, self.handle)

    def _fetch(self, when: str, nvml: Nvml) -> None:
        """One ``nvmlDeviceGetFieldValues`` call for every batched field of cadence ``when``
        still to read on this device; their answers into :attr:`batched`."""
        self.fetched.add(when)
        if (self.uuid, NO_BATCH) in self.unsupported:
            return
        due = [
            (f, f.batch.entries(self))
            for f in BATCHED
            if f.batch is not None
            and f.when == when
            and f.group not in self.disabled
            and (self.uuid, f.field) not in self.unsupported
            and (self.uuid, BY_GETTER + f.field) not in self.unsupported
            and not (when == ONCE and f.field in self.static)
        ]
        entries = [e for _, fe in due for e in fe]
        if not entries:
            self.batched.update((f.field, []) for f, _ in due)
            return
        try:
            answers = nvml.field_values(self.handle, entries)
        except (GpuLost, NvmlUnavailable):
            raise
        except NvmlError as exc:
            self.unsupported.add((self.uuid, NO_BATCH))
            log.warning(
                "GPU %s: %s; reading its fields one call each until NVML is re-initialised",
                self.uuid,
                exc,
            )
            return
        start = 0
        for f, fe in due:
            self.batched[f.field] = answers[start : start + len(fe)]
            start += len(fe)

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
_NOT_SUPPORTED = nvml_mod.error_code("NOT_SUPPORTED")


@dataclasses.dataclass(frozen=True, slots=True)
class Batched:
    """How a field is read from ``nvmlDeviceGetFieldValues``: its ``(field id, scope id)``
    entries on one device, and its value from their answers (each a value or the entry's
    :class:`~gpu_exporter.nvml.NvmlError`; ``convert`` raises one to fail the field)."""

    entries: Callable[[FieldReader], tuple[tuple[int, int], ...]]
    convert: Callable[[list[Any]], Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Field:
    """One row of the field table: its name (``/gpus``' ``fields_updated``, the
    ``field`` label), the GpuSample attributes its value fills (a tuple value fills several),
    how it is read, its cadence and its ``--collect.<group>``. One NVML call per read, or
    one entry of its cadence's field-value batch (``batch``; ``read`` is then the getter it
    falls back to, None where there is none)."""

    field: str
    names: tuple[str, ...]
    read: Reader | None
    when: str = FAST
    group: str = CORE
    batch: Batched | None = None
    # Read only when this attribute, read before it, is non-empty (nothing to ask about else).
    needs: str | None = None


def _f(
    field: str,
    names: tuple[str, ...] | str,
    read: Reader | None,
    when: str,
    group: str,
    batch: Batched | None = None,
) -> Field:
    return Field(field, (names,) if isinstance(names, str) else names, read, when, group, batch)


def _every(convert: Callable[..., Any], *entries: tuple[int, int]) -> Batched:
    """Fields whose value needs every one of its entries: the first failing entry fails it."""

    def values(answers: list[Any]) -> Any:
        for a in answers:
            if isinstance(a, NvmlError):
                raise a
        return convert(*answers)

    return Batched(lambda _r: entries, values)


def _link_count(n: int) -> int:
    if n <= 0:
        raise Unsupported(nvml_mod.FIELD_VALUES, _NOT_SUPPORTED, "no NVLink")
    return n


# Per NVLink, in this order: state, data transmitted and received (KiB), then the error
# counters of model.NVLINK_ERRORS, each summed over the link's lanes.
_NVLINK_IDS = (
    "NVML_FI_DEV_NVLINK_GET_STATE",
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX",
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX",
    "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
)
assert len(_NVLINK_IDS) == 3 + len(NVLINK_ERRORS)


def _nvlink_entries(r: FieldReader) -> tuple[tuple[int, int], ...]:
    links = int(r.static.get("nvlink_link_count") or 0)
    return tuple((FIELD_IDS[name], link) for link in range(links) for name in _NVLINK_IDS)


def _nvlinks(answers: list[Any]) -> tuple[NvLinkSample, ...]:
    """Each link that answers anything, with what it answers: one failing link or counter
    never hides the others; unsupported only when no entry of any link answers."""
    got = [None if isinstance(a, NvmlError) else int(a) for a in answers]
    if not any(v is not None for v in got):
        errors = [a for a in answers if isinstance(a, NvmlError)]
        failed = next((e for e in errors if not isinstance(e, Unsupported)), None)
        raise failed or Unsupported(nvml_mod.FIELD_VALUES, _NOT_SUPPORTED, "no NVLink answers")
    n = len(_NVLINK_IDS)
    links = []
    for link in range(len(got) // n):
        state, tx, rx, flit, data, replay, recovery = got[link * n : (link + 1) * n]
        if all(v is None for v in got[link * n : (link + 1) * n]):
            continue
        active = None if state is None else state == 1
        sent, received = (None if v is None else v * 1024 for v in (tx, rx))
        links.append(NvLinkSample(link, active, sent, received, flit, data, replay, recovery))
    return tuple(links)


def _memory(whole_gpu: bool) -> Reader:
    def read(nvml: Nvml, _: ProcInfoCache | None, h: Any) -> tuple[Any, ...]:
        m = nvml.memory(h, whole_gpu=whole_gpu)
        return m.total_bytes, m.used_bytes, m.free_bytes, m.reserved_bytes

    return read


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
# How many MIG devices a GPU in MIG mode can have (read.py reads it before its devices).
MIG_DEVICE_COUNT = _f(
    "mig_device_count", "mig_device_count", lambda n, _, h: n.max_mig_device_count(h), ONCE, CORE
)
# The NVLink link count: first, as the SLOW batch's NVLink entries need it (--collect.nvlink).
_LINK_COUNT = _f("nvlink_link_count", (), None, ONCE, "nvlink",
                 _every(_link_count, (FIELD_IDS["NVML_FI_DEV_NVLINK_LINK_COUNT"], 0)))  # fmt: skip

_MEMORY_FIELDS = tuple(f"memory_{x}_bytes" for x in ("total", "used", "free", "reserved"))
# The rows of readings.READINGS no getter row can read, by name: the code that reads them.
# (tests/test_readings.py checks each agrees with its rows on cadence and group.)
_CODE: dict[str, tuple[Field, ...]] = {
    "memory": (_f("memory", _MEMORY_FIELDS, _memory(True), FAST, CORE),),
    # The process list; compute_processes, its length, follows from it (with_processes).
    "processes": (_PROCESSES, _PROCESS_UTILIZATION),
    "nvlink": (_f("nvlink", "nvlink", None, SLOW, "nvlink", Batched(_nvlink_entries, _nvlinks)),),
}


def _getter(rows: tuple[Reading, ...]) -> Reader | None:
    """One call of the rows' getter, each row's value from its answer."""
    first = rows[0]
    if first.getter is None:
        return None
    getter, args, method = first.getter, first.args, first.method
    converts = tuple(r.convert or _same for r in rows)

    def call(n: Nvml, h: Any) -> Any:
        return getattr(n, method)(h) if method else n.get(getter, h, *args)

    if len(rows) == 1:
        convert = converts[0]
        return lambda n, _, h: convert(call(n, h))

    def read(n: Nvml, _: ProcInfoCache | None, h: Any) -> tuple[Any, ...]:
        answer = call(n, h)
        return tuple(convert(answer) for convert in converts)

    return read


def _batch(rows: tuple[Reading, ...]) -> Batched | None:
    """The rows' field-value entries, in one batch of their cadence: every entry must
    answer (but for a row given its failed entries), each row's value from its own."""
    if not any(r.fields for r in rows):
        return None
    entries = tuple((FIELD_IDS[name], 0) for r in rows for name in r.fields)
    spans = []
    start = 0
    for r in rows:
        spans.append((r, start, start + len(r.fields)))
        start += len(r.fields)

    def values(answers: list[Any]) -> Any:
        out = []
        for r, a, b in spans:
            mine = answers[a:b]
            if not r.partial:
                for answer in mine:
                    if isinstance(answer, NvmlError):
                        raise answer
            out.append(r.from_fields(*mine) if r.from_fields is not None else mine[0])
        return out[0] if len(out) == 1 else tuple(out)

    return Batched(lambda _r: entries, values)


def _same(value: Any) -> Any:
    return value


def _fields_of_rows() -> tuple[Field, ...]:
    """A field per NVML call of readings.READINGS (rows of one name share it), in their
    order: a getter row's getter and batch entries, a code row's code (:data:`_CODE`)."""
    by_name: dict[str, list[Reading]] = {}
    for r in READINGS:
        by_name.setdefault(r.name, []).append(r)
    out: list[Field] = []
    for name, listed in by_name.items():
        if name == GPM_FIELD.field:
            continue  # collect/gpm.py's
        rows = tuple(listed)
        if rows[0].code:
            out.extend(_CODE[name])
            continue
        names = tuple(r.attribute for r in rows)
        out.append(Field(name, names, _getter(rows), rows[0].when, rows[0].group, _batch(rows)))
    return tuple(out)


# A whole GPU, in the order read (MIG mode before processes: in MIG mode, processes are
# read per MIG device instead), then the once-fields.
GPU_FIELDS = (_LINK_COUNT, *_fields_of_rows())
_BY_NAME = {f.field: f for f in GPU_FIELDS}
# A MIG device answers only memory, utilization (not at all, in practice) and processes.
MIG_FIELDS = (
    _f("memory", _MEMORY_FIELDS, _memory(False), FAST, CORE),
    _BY_NAME["utilization"],
    _PROCESSES,
)
# The fields read from field-value batches (one nvmlDeviceGetFieldValues call per cadence).
BATCHED = tuple(f for f in GPU_FIELDS if f.batch is not None)
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
