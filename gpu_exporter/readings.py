"""The GPU values: one :class:`Reading` row per value a GPU (or MIG device) reports, and all
that is said of it once.

A row says where NVML gives the value (a pynvml getter and its constant arguments, and the
``NVML_FI_*`` field values of the same value), how to turn NVML's answer into the base unit,
when it is read (its cadence) and under which ``--collect.<group>``, its metric family
(:class:`Family`: name, type, help, unit; and the row's labels in it), its dcgm-exporter name,
and what ``--simulate`` answers for it. Everything else is derived from the rows:

* the reader (:mod:`gpu_exporter.collect.fields` builds a field per call from them),
* the snapshot (a row's ``attribute`` is a :class:`~gpu_exporter.model.GpuSample` attribute:
  the typed fields the chooser reads, the rest kept by name, :attr:`GpuSample.readings`),
* the exposition and the README's metric table (:mod:`gpu_exporter.export.spec`),
* dcgm-exporter's names (:mod:`gpu_exporter.export.dcgm`),
* the simulator's answers (:mod:`gpu_exporter.simulate.library`).

A value that needs code of its own (the memory struct, processes, NVLink, GPM, a getter with
a fallback name) is a row too, with ``code`` saying where that code is: the table is the one
list of values, and tests fail for a row a place does not handle.

Rows that share one NVML call (the same ``field``) are read by that one call: the remapped
rows' four figures, the power limit's two bounds. Rows of one family are its labelled series,
in table order. Kept as a table, not in ruff's layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Final

from gpu_exporter.valuerow import (
    BYTES_PER_SECOND,
    CELSIUS,
    COUNT,
    COUNTER,
    FAST,
    FLAG,
    GAUGE,
    GPM,
    MHZ,
    MIB,
    MILLIJOULES,
    ONCE,
    PERCENT,
    RATIO,
    SLOW,
    WATTS,
    Dcgm,
    Family,
    Reading,
    Simulated,
)

# -- label values shared with the code that reads or exports them -------------------------
CLOCKS = ("graphics", "sm", "memory", "video")
TEMPERATURE_THRESHOLDS = ("slowdown", "shutdown", "gpu_max", "memory_max")
# The label values of gpu_clocks_event_reasons, in the order they are exported.
CLOCKS_EVENT_REASONS = (
    "sw_power_cap",
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake",
    "sw_thermal_slowdown",
    "sync_boost",
    "gpu_idle",
    "applications_clocks_setting",
    "display_clocks_setting",
)
# nvmlClocksEventReason* bits (called nvmlClocksThrottleReason* before driver 535), by the
# name used in the ``reason`` label of gpu_clocks_event_reasons.
CLOCKS_EVENT_REASON_BITS: Final[dict[str, int]] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake": 0x80,
    "display_clocks_setting": 0x100,
}
ECC_ERRORS = ("corrected", "uncorrected")
ECC_COUNTERS = ("volatile", "aggregate")
RETIREMENT_CAUSES = ("multiple_single_bit", "double_bit")
PCIE_LINKS = ("current", "max")
# NVLink error counters, by the name used in the ``type`` label of gpu_nvlink_errors_total.
NVLINK_ERRORS = ("crc_flit", "crc_data", "replay", "recovery")

# The NVML_FI_* field ids the rows name, with the header's numbers (nvml.h): older bindings
# lack some, and gave others other numbers. A driver that does not know an id answers that
# entry alone (absent).
FIELD_NUMBERS: Final[dict[str, int]] = {
    "NVML_FI_DEV_ECC_CURRENT": 1,
    "NVML_FI_DEV_ECC_SBE_VOL_TOTAL": 3,
    "NVML_FI_DEV_ECC_DBE_VOL_TOTAL": 4,
    "NVML_FI_DEV_ECC_SBE_AGG_TOTAL": 5,
    "NVML_FI_DEV_ECC_DBE_AGG_TOTAL": 6,
    "NVML_FI_DEV_RETIRED_SBE": 29,
    "NVML_FI_DEV_RETIRED_DBE": 30,
    "NVML_FI_DEV_RETIRED_PENDING": 31,
    "NVML_FI_DEV_MEMORY_TEMP": 82,
    "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 83,
    "NVML_FI_DEV_PCIE_REPLAY_COUNTER": 94,
    "NVML_FI_DEV_REMAPPED_COR": 142,
    "NVML_FI_DEV_REMAPPED_UNC": 143,
    "NVML_FI_DEV_REMAPPED_PENDING": 144,
    "NVML_FI_DEV_REMAPPED_FAILURE": 145,
    "NVML_FI_DEV_POWER_AVERAGE": 185,  # mW over 1 s: Ampere and later except GA100
    "NVML_FI_DEV_POWER_INSTANT": 186,  # mW now: every card
    "NVML_FI_DEV_POWER_CURRENT_LIMIT": 190,  # the enforced limit, mW
    "NVML_FI_DEV_GPU_TEMP": 308,  # °C, sub-degree (drivers since 580)
    # How long each reason has held the clocks down since the driver loaded, in ns. The
    # thermal and power-brake ones were 251-253 in headers before 13.0.87 (since given to
    # power smoothing): the current numbers, never the bindings'.
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP": 74,
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST": 76,
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN": 269,
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN": 270,
    "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN": 271,
}


def _same(value: Any) -> Any:
    return value


def _milli(value: Any) -> float:
    return int(value) / 1000.0


def _thousandth(value: Any) -> float:
    return float(value / 1000.0)


def _percent(value: Any) -> float:
    return int(value) / 100.0


def _flag(value: Any) -> bool:
    return int(value) == 1


def _first_flag(answer: Any) -> bool:
    return int(answer[0]) == 1


def _first_percent(answer: Any) -> float:
    return int(answer[0]) / 100.0


def _mhz(value: Any) -> float:
    return int(value) * 1e6


def _part(i: int, convert: Callable[[Any], Any] = int) -> Callable[[Any], Any]:
    """Item ``i`` of a getter's tuple answer, converted."""
    return lambda answer: convert(answer[i])


def _state(attribute: str) -> Simulated:
    """A simulated GPU's ``attribute`` of its state now (NVML's units)."""
    return lambda m, g, *_: getattr(m.state(g.index), attribute)


def _health(attribute: str, convert: Callable[[Any], Any] = _same) -> Simulated:
    """A simulated GPU's health counter or flag (tests set them; fixed otherwise)."""
    return lambda m, g, *_: convert(getattr(g.health, attribute))


# -- the families of more than one row, and of code rows ----------------------------------
_CLOCK = Family("gpu_clock_hz", "Current clock frequency by clock domain.", "hertz")
_CLOCK_MAX = Family("gpu_clock_max_hz", "Highest clock frequency by clock domain.", "hertz")
_THRESHOLD = Family(
    "gpu_temperature_threshold_celsius",
    "Temperatures at which the GPU slows down, shuts down, and the highest GPU and memory "
    "temperatures for normal operation.",
    "celsius",
)
_ECC = Family(
    "gpu_ecc_errors_total",
    "Memory ECC errors: corrected or uncorrected, since the driver loaded (volatile) or over "
    "the card's life (aggregate).",
    "errors",
    COUNTER,
)
_REMAPPED = Family(
    "gpu_remapped_rows_total",
    "Memory rows remapped because of correctable or uncorrectable errors (Ampere and later).",
    "rows",
    COUNTER,
)
_RETIRED = Family(
    "gpu_retired_pages_total",
    "Memory pages retired for multiple single-bit or for double-bit ECC errors (before Ampere).",
    "pages",
    COUNTER,
)
_PCIE_GENERATION = Family(
    "gpu_pcie_link_generation",
    "PCIe link generation: current (idle links drop to a lower one) and max.",
    "generation",
)
_PCIE_WIDTH = Family(
    "gpu_pcie_link_width",
    "PCIe link width in lanes: current (below max: a link trained down) and max.",
    "lanes",
)
_GPM_SOURCE = "nvmlGpmSampleGet, nvmlGpmMetricsGet"
_GPM_MIG = _GPM_SOURCE + " (MIG: nvmlGpmMigSampleGet)"
_TENSOR_PIPE = Family(
    "gpu_tensor_pipe_active_ratio",
    "Share of the last --gpm-interval (0-1) in which the SMs ran tensor-core instructions of "
    "one kind: hmma (floating point), imma (integer), dfma (FP64).",
    "ratio",
    source=_GPM_SOURCE,
    mig=True,
)
_FP_PIPE = Family(
    "gpu_fp_pipe_active_ratio",
    "Share of the last --gpm-interval (0-1) in which the SMs ran non-tensor floating point "
    "instructions of one precision.",
    "ratio",
    source=_GPM_SOURCE,
    mig=True,
)
_PCIE_TRAFFIC = Family(
    "gpu_pcie_traffic_bytes_per_second",
    "PCIe traffic over the last --gpm-interval by direction (tx: from the GPU, rx: to it), as "
    "GPM counts it.",
    "bytes/second",
    source=_GPM_SOURCE,
    mig=True,
)
_NVLINK_TRAFFIC = Family(
    "gpu_nvlink_traffic_bytes_per_second",
    "NVLink traffic of all links together over the last --gpm-interval by direction (tx: from "
    "the GPU, rx: to it), as GPM counts it.",
    "bytes/second",
    source=_GPM_SOURCE,
    mig=True,
)
_MEMORY_CODE = "collect/fields.py (nvmlDeviceGetMemoryInfo_v2, v1 before driver 510)"
_MEMORY_SOURCE = "nvmlDeviceGetMemoryInfo_v2"


def _memory(what: str, help: str, dcgm: Dcgm | None = None) -> Reading:
    family = Family(f"gpu_memory_{what}_bytes", help, "bytes", source=_MEMORY_SOURCE, mig=True)
    return Reading(f"memory_{what}_bytes", family, field="memory", code=_MEMORY_CODE, dcgm=dcgm)


def _gpm(attribute: str, family: Family, dcgm: Dcgm, *labels: tuple[str, str]) -> Reading:
    """A GPM figure: read by collect/gpm.py, two samples --gpm-interval apart."""
    return Reading(attribute, family, labels, GPM, "gpm", field="gpm", code="collect/gpm.py",
                   dcgm=dcgm)  # fmt: skip


def _gpm_family(name: str, help: str, *, mig_source: bool = True) -> Family:
    source = _GPM_MIG if mig_source else _GPM_SOURCE
    unit = "bytes/second" if name.endswith("_per_second") else "ratio"
    return Family(name, help, unit, source=source, mig=True)


_CLOCK_TYPES = {"graphics": "NVML_CLOCK_GRAPHICS", "sm": "NVML_CLOCK_SM",
                "memory": "NVML_CLOCK_MEM", "video": "NVML_CLOCK_VIDEO"}  # fmt: skip
# The SM (and graphics, the same domain) clock shows throttling and boost from one second to
# the next; the memory and video clocks move with the P-state, itself a slow field.
_CLOCK_CADENCE = {"graphics": FAST, "sm": FAST, "memory": SLOW, "video": SLOW}
_DCGM_CLOCK = {
    "sm": Dcgm("DCGM_FI_DEV_SM_CLOCK", GAUGE, "SM clock frequency (in MHz).", MHZ),
    "memory": Dcgm("DCGM_FI_DEV_MEM_CLOCK", GAUGE, "Memory clock frequency (in MHz).", MHZ),
}


def _clock(clock: str, maximum: bool = False) -> Reading:
    if maximum:
        return Reading(f"clock_max_{clock}_hz", _CLOCK_MAX, (("clock", clock),), ONCE, "clocks",
                       "nvmlDeviceGetMaxClockInfo", (_CLOCK_TYPES[clock],), _mhz,
                       simulate=lambda m, g, t: m.max_clock_mhz(g, t))  # fmt: skip
    return Reading(f"clock_{clock}_hz", _CLOCK, (("clock", clock),), _CLOCK_CADENCE[clock],
                   "clocks", "nvmlDeviceGetClockInfo", (_CLOCK_TYPES[clock],), _mhz,
                   dcgm=_DCGM_CLOCK.get(clock),
                   simulate=lambda m, g, t: m.state(g.index).clocks_mhz[t])  # fmt: skip


_THRESHOLD_TYPES = {
    "shutdown": "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN",
    "slowdown": "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN",
    "memory_max": "NVML_TEMPERATURE_THRESHOLD_MEM_MAX",
    "gpu_max": "NVML_TEMPERATURE_THRESHOLD_GPU_MAX",
}


def _threshold(t: str) -> Reading:
    return Reading(f"temperature_{t}_celsius", _THRESHOLD, (("threshold", t),), ONCE,
                   "temperature", "nvmlDeviceGetTemperatureThreshold", (_THRESHOLD_TYPES[t],),
                   float, field=f"temperature_threshold_{t}",
                   simulate=lambda m, g, k: m.temperature_threshold(g, k))  # fmt: skip


_ECC_TYPES = {"corrected": "NVML_MEMORY_ERROR_TYPE_CORRECTED",
              "uncorrected": "NVML_MEMORY_ERROR_TYPE_UNCORRECTED",
              "volatile": "NVML_VOLATILE_ECC", "aggregate": "NVML_AGGREGATE_ECC"}  # fmt: skip
_ECC_IDS = {  # corrected = single-bit, uncorrected = double-bit
    ("corrected", "volatile"): "NVML_FI_DEV_ECC_SBE_VOL_TOTAL",
    ("uncorrected", "volatile"): "NVML_FI_DEV_ECC_DBE_VOL_TOTAL",
    ("corrected", "aggregate"): "NVML_FI_DEV_ECC_SBE_AGG_TOTAL",
    ("uncorrected", "aggregate"): "NVML_FI_DEV_ECC_DBE_AGG_TOTAL",
}


def _ecc(error: str, counter: str) -> Reading:
    return Reading(f"ecc_errors_{error}_{counter}", _ECC, (("error", error), ("counter", counter)),
                   SLOW, "health", "nvmlDeviceGetTotalEccErrors",
                   (_ECC_TYPES[error], _ECC_TYPES[counter]), int, (_ECC_IDS[error, counter],),
                   simulate=_health(f"ecc_{error}_{counter}"))  # fmt: skip


_RETIRED_IDS = {"multiple_single_bit": "NVML_FI_DEV_RETIRED_SBE",
                "double_bit": "NVML_FI_DEV_RETIRED_DBE"}  # fmt: skip
_RETIREMENT_TYPES = {
    "multiple_single_bit": "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS",
    "double_bit": "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR",
}


def _retired(cause: str) -> Reading:
    count = _health(f"retired_pages_{cause}")
    return Reading(f"retired_pages_{cause}", _RETIRED, (("cause", cause),), SLOW, "health",
                   "nvmlDeviceGetRetiredPages", (_RETIREMENT_TYPES[cause],), len,
                   (_RETIRED_IDS[cause],), simulate_field=count,
                   simulate=lambda m, g, *_: [0x1000 * (k + 1) for k in range(count(m, g))],
                   )  # fmt: skip


def _link(what: str, link: str) -> Reading:
    family = _PCIE_GENERATION if what == "generation" else _PCIE_WIDTH
    which = "Curr" if link == "current" else "Max"
    getter = f"nvmlDeviceGet{which}PcieLink{what.capitalize()}"
    simulate = (_state(f"pcie_{what}") if link == "current"
                else lambda m, g, *_: getattr(g.model, f"pcie_{what}"))  # fmt: skip
    return Reading(f"pcie_link_{what}_{link}", family, (("link", link),),
                   SLOW if link == "current" else ONCE, "pcie", getter, convert=int,
                   simulate=simulate)  # fmt: skip


def _power_draw(average: Any, instant: Any) -> float:
    """What nvmlDeviceGetPowerUsage reports (its header): the 1 s average on Ampere and
    later except GA100, the instant value on the others. An entry that failed is its error."""
    for answer in (average, instant):
        if not isinstance(answer, Exception):
            return float(answer) / 1000.0
    raise instant


def _remapped(
    what: str,
    i: int,
    convert: Callable[[Any], Any],
    fid: str,
    family: Family,
    *labels: tuple[str, str],
    dcgm: Dcgm | None = None,
) -> Reading:
    simulate = None
    if i == 0:  # the one call's answer, on the first of its rows
        simulate = lambda m, g, *_: (g.health.remapped_rows_correctable,  # noqa: E731
                                     g.health.remapped_rows_uncorrectable,
                                     int(g.health.remapped_rows_pending),
                                     int(g.health.remapped_rows_failed))  # fmt: skip
    return Reading(f"remapped_rows_{what}", family, labels, SLOW, "health",
                   "nvmlDeviceGetRemappedRows", (), _part(i, convert), (fid,),
                   lambda v: convert(v) if convert is int else v == 1, field="remapped_rows",
                   dcgm=dcgm, simulate=simulate,
                   simulate_field=_health(f"remapped_rows_{what}", int))  # fmt: skip


_EVENT_DURATION = Family(
    "gpu_clocks_event_duration_seconds_total",
    "How long each reason has held the clocks below their maximum since the driver loaded.",
    "seconds",
    COUNTER,
    details="rate() is the share of the time a reason held the clocks down: "
    'rate(gpu_clocks_event_duration_seconds_total{reason="hw_thermal_slowdown"}[5m]) > 0.1 is '
    "a card throttled for heat a tenth of the time. Absent where the driver does not report "
    "it (drivers before 535, consumer cards).",
)
# reason (gpu_clocks_event_reasons' label) → its duration's field id; the simulated card
# spends this share of its time under the reason (a datacenter card; none on the others).
_EVENT_DURATIONS = {
    "sw_power_cap": ("NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP", 0.05),
    "sync_boost": ("NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST", 0.0),
    "sw_thermal_slowdown": ("NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN", 0.01),
    "hw_thermal_slowdown": ("NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN", 0.0),
    "hw_power_brake": ("NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN", 0.0),
}


def _event_duration(reason: str) -> Reading:
    """Nanoseconds the reason held the clocks down, in the slow field-value batch."""
    fid, share = _EVENT_DURATIONS[reason]
    return Reading(f"clocks_event_duration_{reason}_seconds", _EVENT_DURATION,
                   (("reason", reason),), SLOW, "clocks", fields=(fid,),
                   from_fields=lambda ns: ns / 1e9, simulate_field=lambda m, g, *_: (
                       round(m.elapsed() * share * 1e9) if g.model.memory_temperature else None
                   ))  # fmt: skip


def _fabric(m: Any, g: Any, info: Any) -> int | None:
    """nvmlDeviceGetGpuFabricInfoV on a simulated card: an H100 SXM (GPM and NVLink) is in an
    NVSwitch fabric, registered (state 3, status 0) in clique 1; the others have none."""
    if not (g.model.gpm and g.model.nvlinks):
        return None
    info = getattr(info, "_obj", info)  # ctypes.byref(struct)
    info.state, info.status, info.cliqueId = 3, 0, 1
    return 0


def _fabric_row(attribute: str, family: Family, part: str) -> Reading:
    """One figure of the GPU's registration with the NVLink fabric (one call for all)."""
    return Reading(attribute, family, when=SLOW, group="health",
                   getter="nvmlDeviceGetGpuFabricInfoV", method="gpu_fabric_info",
                   convert=lambda info: int(getattr(info, part)), field="fabric",
                   simulate=_fabric if part == "state" else None)  # fmt: skip


@functools.lru_cache(maxsize=512)  # one tuple per mask: the 600-snapshot history shares them
def _reasons(mask: int) -> tuple[str, ...]:
    """The reasons set in an nvmlClocksEventReason* bitmask, in label order."""
    return tuple(r for r in CLOCKS_EVENT_REASONS if mask & CLOCKS_EVENT_REASON_BITS[r])


def _each_reason(reasons: tuple[str, ...]) -> Iterable[tuple[tuple[str, ...], float]]:
    return (((r,), 1.0 if r in reasons else 0.0) for r in CLOCKS_EVENT_REASONS)


# Kept as a table, not in ruff's layout. In reading order: MIG mode before the processes (in
# MIG mode, processes are read per MIG device), processes before what needs them.
READINGS: tuple[Reading, ...] = (
    _memory("total", "Total frame-buffer memory."),
    _memory("used",
            "Frame-buffer memory in use, excluding the driver's reservation (as nvidia-smi "
            ">= 510).",
            Dcgm("DCGM_FI_DEV_FB_USED", GAUGE, "Framebuffer memory used (in MiB).", MIB)),
    _memory("free", "Frame-buffer memory free for allocations.",
            Dcgm("DCGM_FI_DEV_FB_FREE", GAUGE, "Framebuffer memory free (in MiB).", MIB)),
    _memory("reserved", "Frame-buffer memory reserved by the driver.",
            Dcgm("DCGM_FI_DEV_FB_RESERVED", GAUGE, "Framebuffer memory reserved (in MiB).", MIB)),
    Reading("utilization_ratio",
            Family("gpu_utilization_ratio",
                   "Fraction of the last sample period (0-1) in which a kernel was running "
                   "(absent in MIG mode: NVML does not report it).", "ratio", mig=True),
            getter="nvmlDeviceGetUtilizationRates", convert=lambda u: u.gpu / 100.0,
            field="utilization", dcgm=Dcgm("DCGM_FI_DEV_GPU_UTIL", GAUGE,
                                           "GPU utilization (in %).", PERCENT),
            simulate=lambda m, g, *_: m.utilization(g)),
    Reading("memory_utilization_ratio",
            Family("gpu_memory_utilization_ratio",
                   "Fraction of the last sample period (0-1) in which device memory was read or "
                   "written.", "ratio", mig=True),
            getter="nvmlDeviceGetUtilizationRates", convert=lambda u: u.memory / 100.0,
            field="utilization", dcgm=Dcgm("DCGM_FI_DEV_MEM_COPY_UTIL", GAUGE,
                                           "Memory utilization (in %).", PERCENT)),
    Reading("mig_mode_enabled",
            Family("gpu_mig_mode_enabled",
                   "1 if MIG mode is on: the GPU is split into the MIG devices of gpu_mig_info.",
                   "0/1"),
            when=SLOW, getter="nvmlDeviceGetMigMode", convert=_first_flag,
            simulate=lambda m, g, *_: [int(bool(g.mig))] * 2),
    Reading("power_draw_watts",
            Family("gpu_power_draw_watts", "Power draw of the whole board.", "watts"),
            group="power", getter="nvmlDeviceGetPowerUsage", convert=_milli,
            fields=("NVML_FI_DEV_POWER_AVERAGE", "NVML_FI_DEV_POWER_INSTANT"),
            from_fields=_power_draw, partial=True,
            dcgm=Dcgm("DCGM_FI_DEV_POWER_USAGE", GAUGE, "Power draw (in W).", WATTS),
            simulate=_state("power_usage_mw")),
    Reading("power_limit_watts",
            Family("gpu_power_limit_watts", "Power limit the driver enforces.", "watts"),
            when=SLOW, group="power", getter="nvmlDeviceGetEnforcedPowerLimit", convert=_milli,
            fields=("NVML_FI_DEV_POWER_CURRENT_LIMIT",), from_fields=_thousandth,
            simulate=_state("power_limit_mw")),
    # Read as a health counter: one call takes ~3 ms on an H100 (docs/real-gpu.md), the other
    # getters 2-10 µs; a counter loses nothing but resolution between two reads. In the slow
    # batch only: a batch costs what its slowest field costs.
    Reading("energy_joules",
            Family("gpu_energy_joules_total", "Energy consumed since the driver was loaded.",
                   "joules", COUNTER),
            when=SLOW, group="power", getter="nvmlDeviceGetTotalEnergyConsumption",
            convert=_milli, fields=("NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION",),
            from_fields=_thousandth,
            dcgm=Dcgm("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", COUNTER,
                      "Total energy consumption since boot (in mJ).", MILLIJOULES),
            simulate=lambda m, g, *_: m.energy_mj(g.index)),
    Reading("temperature_celsius",
            Family("gpu_temperature_celsius", "GPU core temperature.", "celsius"),
            group="temperature", getter="nvmlDeviceGetTemperature",
            args=("NVML_TEMPERATURE_GPU",), convert=float, fields=("NVML_FI_DEV_GPU_TEMP",),
            from_fields=float,
            dcgm=Dcgm("DCGM_FI_DEV_GPU_TEMP", GAUGE, "GPU temperature (in C).", CELSIUS),
            simulate=_state("temperature_c"),
            simulate_field=lambda m, g, *_: float(m.state(g.index).temperature_c)),
    Reading("memory_temperature_celsius",
            Family("gpu_memory_temperature_celsius", "Memory (HBM) temperature.", "celsius"),
            group="temperature", fields=("NVML_FI_DEV_MEMORY_TEMP",), from_fields=float,
            dcgm=Dcgm("DCGM_FI_DEV_MEMORY_TEMP", GAUGE, "Memory temperature (in C).", CELSIUS),
            simulate_field=lambda m, g, *_: (m.state(g.index).temperature_c + 6
                                             if g.model.memory_temperature else None)),
    Reading("fan_speed_ratio",
            Family("gpu_fan_speed_ratio",
                   "Fan speed as a fraction of its maximum (absent on passively cooled cards).",
                   "ratio"),
            when=SLOW, group="temperature", getter="nvmlDeviceGetFanSpeed", convert=_percent,
            simulate=_state("fan_percent")),
    *(_clock(clock) for clock in CLOCKS),
    Reading("compute_processes",
            Family("gpu_compute_processes",
                   "Compute processes with a context on the GPU, as far as this process can see "
                   "them.", "processes", source="nvmlDeviceGetComputeRunningProcesses", mig=True),
            group="processes", field="processes",
            code="collect/fields.py (the process list, attributed from /proc)"),
    Reading("clocks_event_reasons",
            Family("gpu_clocks_event_reasons",
                   "1 for each reason the clocks are held below their maximum now, 0 for the "
                   "others.", "0/1",
                   details="Reasons: power cap, thermal or hardware slowdown, power brake, "
                   "idle …"),
            (("reason", ""),), group="clocks", getter="nvmlDeviceGetCurrentClocksEventReasons",
            convert=_reasons, method="clocks_event_reasons", series=_each_reason,
            simulate=_state("clocks_event_reasons")),
    *(_event_duration(reason) for reason in _EVENT_DURATIONS),
    Reading("performance_state",
            Family("gpu_performance_state",
                   "Performance state: 0 (P0, fastest) to 15 (P15, slowest).", "P-state",
                   source="nvmlDeviceGetPerformanceState"),
            when=SLOW, group="clocks", getter="nvmlDeviceGetPerformanceState",
            method="performance_state", simulate=_state("performance_state")),
    Reading("persistence_mode_enabled",
            Family("gpu_persistence_mode_enabled",
                   "1 if persistence mode is on (the driver stays loaded with no client).", "0/1"),
            when=SLOW, group="health", getter="nvmlDeviceGetPersistenceMode", convert=_flag,
            simulate=lambda m, g, *_: 1 if g.model.persistence_mode else 0),
    Reading("compute_mode",
            Family("gpu_compute_mode",
                   "Always 1; the compute mode (default, exclusive_process, prohibited) is the "
                   "mode label.", "1 (info)", source="nvmlDeviceGetComputeMode"),
            (("mode", ""),), SLOW, "health", getter="nvmlDeviceGetComputeMode",
            method="compute_mode", series=lambda mode: (((mode,), 1.0),)),
    Reading("ecc_mode_enabled",
            Family("gpu_ecc_mode_enabled", "1 if ECC is on for the frame-buffer memory.", "0/1"),
            when=SLOW, group="health", getter="nvmlDeviceGetEccMode", convert=_first_flag,
            fields=("NVML_FI_DEV_ECC_CURRENT",), from_fields=_flag,
            simulate=lambda m, g, *_: [1, 1], simulate_field=lambda m, g, *_: 1),
    *(_ecc(error, counter) for error in ECC_ERRORS for counter in ECC_COUNTERS),
    _remapped("correctable", 0, int, "NVML_FI_DEV_REMAPPED_COR", _REMAPPED,
              ("cause", "correctable"),
              dcgm=Dcgm("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", COUNTER,
                        "Number of remapped rows for correctable errors", COUNT)),
    _remapped("uncorrectable", 1, int, "NVML_FI_DEV_REMAPPED_UNC", _REMAPPED,
              ("cause", "uncorrectable"),
              dcgm=Dcgm("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", COUNTER,
                        "Number of remapped rows for uncorrectable errors", COUNT)),
    _remapped("pending", 2, bool, "NVML_FI_DEV_REMAPPED_PENDING",
              Family("gpu_remapped_rows_pending",
                     "1 if a row remapping is pending: reset the GPU to apply it.", "0/1")),
    _remapped("failed", 3, bool, "NVML_FI_DEV_REMAPPED_FAILURE",
              Family("gpu_remapped_rows_failed",
                     "1 if a row remapping failed: the GPU needs service.", "0/1"),
              dcgm=Dcgm("DCGM_FI_DEV_ROW_REMAP_FAILURE", GAUGE,
                        "Whether remapping of rows has failed", FLAG)),
    *(_retired(cause) for cause in RETIREMENT_CAUSES),
    Reading("retired_pages_pending",
            Family("gpu_retired_pages_pending",
                   "1 if a page retirement is pending: reboot or reset to apply it.", "0/1"),
            when=SLOW, group="health", getter="nvmlDeviceGetRetiredPagesPendingStatus",
            convert=_flag, fields=("NVML_FI_DEV_RETIRED_PENDING",), from_fields=_flag,
            simulate=_health("retired_pages_pending", int)),
    _link("generation", "current"),
    _link("width", "current"),
    Reading("pcie_replay_errors",
            Family("gpu_pcie_replay_errors_total",
                   "PCIe replays (retransmissions after link errors) since the driver loaded.",
                   "replays", COUNTER),
            when=SLOW, group="pcie", getter="nvmlDeviceGetPcieReplayCounter", convert=int,
            fields=("NVML_FI_DEV_PCIE_REPLAY_COUNTER",),
            dcgm=Dcgm("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", COUNTER,
                      "Total number of PCIe retries.", COUNT),
            simulate=_health("pcie_replays")),
    _fabric_row("fabric_state",
                Family("gpu_fabric_state",
                       "The GPU's registration with the NVLink fabric of an NVSwitch system: 1 "
                       "not started, 2 in progress, 3 completed (absent without a fabric).",
                       "state",
                       details="Alert on `gpu_fabric_state != 3` or `gpu_fabric_status != 0`: "
                       "a GPU out of its fabric runs jobs without NVLink to its peers."),
                "state"),
    _fabric_row("fabric_status",
                Family("gpu_fabric_status",
                       "The fabric probe's result once completed: 0 success, else NVML's error "
                       "code (nvmlReturn_t).", "nvmlReturn_t"),
                "status"),
    _fabric_row("fabric_clique_id",
                Family("gpu_fabric_clique_id",
                       "The fabric clique (NVLink partition) the GPU belongs to.", "id"),
                "cliqueId"),
    Reading("nvlink", None, when=SLOW, group="nvlink",
            code="collect/fields.py (field values per link; export/spec.py's gpu_nvlink_*)"),
    Reading("encoder_utilization_ratio",
            Family("gpu_encoder_utilization_ratio",
                   "Fraction of time (0-1) the video encoder was busy.", "ratio"),
            when=SLOW, group="media", getter="nvmlDeviceGetEncoderUtilization",
            convert=_first_percent,
            dcgm=Dcgm("DCGM_FI_DEV_ENC_UTIL", GAUGE, "Encoder utilization (in %).", PERCENT),
            simulate=lambda m, g, *_: [m.state(g.index).encoder_percent, 167000]),
    Reading("decoder_utilization_ratio",
            Family("gpu_decoder_utilization_ratio",
                   "Fraction of time (0-1) the video decoder was busy.", "ratio"),
            when=SLOW, group="media", getter="nvmlDeviceGetDecoderUtilization",
            convert=_first_percent,
            dcgm=Dcgm("DCGM_FI_DEV_DEC_UTIL", GAUGE, "Decoder utilization (in %).", PERCENT),
            simulate=lambda m, g, *_: [m.state(g.index).decoder_percent, 167000]),
    *(_clock(clock, maximum=True) for clock in CLOCKS),
    *(_threshold(t) for t in TEMPERATURE_THRESHOLDS),
    Reading("power_limit_default_watts",
            Family("gpu_power_limit_default_watts", "Power limit the board ships with.",
                   "watts"),
            when=ONCE, group="power", getter="nvmlDeviceGetPowerManagementDefaultLimit",
            convert=_milli,
            simulate=lambda m, g, *_: round(g.model.power_limit_watts * 1000)),
    # The range the power limit may be set in: /gpus has it, not a series (issue 15).
    Reading("power_limit_min_watts", None, when=ONCE, group="power",
            getter="nvmlDeviceGetPowerManagementLimitConstraints", convert=_part(0, _milli),
            field="power_limit_constraints",
            # a quarter of the limit … the limit
            simulate=lambda m, g, *_: [round(g.model.power_limit_watts * 250),
                                       round(g.model.power_limit_watts * 1000)]),
    Reading("power_limit_max_watts", None, when=ONCE, group="power",
            getter="nvmlDeviceGetPowerManagementLimitConstraints", convert=_part(1, _milli),
            field="power_limit_constraints"),
    _link("generation", "max"),
    _link("width", "max"),
    # GPM (Hopper and later; absent on older cards, never 0): ratios and byte rates over the
    # last --gpm-interval, as nvmlGpmMetricsGet gives them between two samples.
    _gpm("sm_active_ratio",
         _gpm_family("gpu_sm_active_ratio",
                     "Average share of the SMs busy over the last --gpm-interval (0-1): how much "
                     "of the card works, where gpu_utilization_ratio says only that some kernel "
                     "ran."),
         Dcgm("DCGM_FI_PROF_SM_ACTIVE", GAUGE,
              "The ratio of cycles an SM has at least 1 warp assigned.", RATIO)),
    _gpm("sm_occupancy_ratio",
         _gpm_family("gpu_sm_occupancy_ratio",
                     "Resident warps as a share of the SMs' maximum, over the last "
                     "--gpm-interval (0-1)."),
         Dcgm("DCGM_FI_PROF_SM_OCCUPANCY", GAUGE,
              "The ratio of number of warps resident on an SM.", RATIO)),
    _gpm("graphics_active_ratio",
         _gpm_family("gpu_graphics_active_ratio",
                     "Share of the last --gpm-interval (0-1) in which the graphics or compute "
                     "engine was active.", mig_source=False),
         Dcgm("DCGM_FI_PROF_GR_ENGINE_ACTIVE", GAUGE,
              "Ratio of time the graphics engine is active.", RATIO)),
    _gpm("tensor_active_ratio",
         _gpm_family("gpu_tensor_active_ratio",
                     "Share of the last --gpm-interval (0-1) in which the SMs ran any "
                     "tensor-core instructions."),
         Dcgm("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", GAUGE,
              "Ratio of cycles the tensor (HMMA) pipe is active.", RATIO)),
    *(_gpm(f"tensor_{k}_active_ratio", _TENSOR_PIPE,
           Dcgm(f"DCGM_FI_PROF_PIPE_TENSOR_{k.upper()}_ACTIVE", GAUGE,
                f"Ratio of cycles the tensor ({k.upper()}) pipe is active.", RATIO),
           ("pipe", k)) for k in ("hmma", "imma", "dfma")),
    *(_gpm(f"{p}_active_ratio", _FP_PIPE,
           Dcgm(f"DCGM_FI_PROF_PIPE_{p.upper()}_ACTIVE", GAUGE,
                f"Ratio of cycles the {p} pipes are active.", RATIO),
           ("precision", p)) for p in ("fp64", "fp32", "fp16")),
    _gpm("dram_active_ratio",
         _gpm_family("gpu_dram_active_ratio",
                     "DRAM bandwidth used as a share of the maximum, over the last "
                     "--gpm-interval (0-1)."),
         Dcgm("DCGM_FI_PROF_DRAM_ACTIVE", GAUGE,
              "Ratio of cycles the device memory interface is active sending or receiving "
              "data.", RATIO)),
    _gpm("pcie_transmit_bytes_per_second", _PCIE_TRAFFIC,
         Dcgm("DCGM_FI_PROF_PCIE_TX_BYTES", GAUGE,
              "The rate of data transmitted over the PCIe bus - including both protocol headers "
              "and data payloads - in bytes per second.", BYTES_PER_SECOND), ("direction", "tx")),
    _gpm("pcie_receive_bytes_per_second", _PCIE_TRAFFIC,
         Dcgm("DCGM_FI_PROF_PCIE_RX_BYTES", GAUGE,
              "The rate of data received over the PCIe bus - including both protocol headers "
              "and data payloads - in bytes per second.", BYTES_PER_SECOND), ("direction", "rx")),
    _gpm("nvlink_transmit_bytes_per_second", _NVLINK_TRAFFIC,
         Dcgm("DCGM_FI_PROF_NVLINK_TX_BYTES", GAUGE,
              "The rate of data transmitted over NVLink, in bytes per second.", BYTES_PER_SECOND),
         ("direction", "tx")),
    _gpm("nvlink_receive_bytes_per_second", _NVLINK_TRAFFIC,
         Dcgm("DCGM_FI_PROF_NVLINK_RX_BYTES", GAUGE,
              "The rate of data received over NVLink, in bytes per second.", BYTES_PER_SECOND),
         ("direction", "rx")),
)  # fmt: skip
BY_ATTRIBUTE: dict[str, Reading] = {r.attribute: r for r in READINGS}
assert len(BY_ATTRIBUTE) == len(READINGS), "an attribute named twice"
