"""What one row of the GPU value table says: :class:`Reading`, its metric :class:`Family`,
its dcgm-exporter name (:class:`Dcgm`, :class:`Conversion`), and the cadences.

The rows themselves are :data:`gpu_exporter.readings.READINGS`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

# -- cadences and groups ------------------------------------------------------------------
FAST: Final = "every sample"
SLOW: Final = "every --slow-interval"
ONCE: Final = "once"
GPM: Final = "every --gpm-interval"  # collect/gpm.py: two samples per device, that far apart
CORE: Final = ""  # no group: always read

SAMPLED: Final = (
    " Sampled in the background every --interval (see gpu_exporter_last_sample_timestamp_seconds)."
)

Simulated = Callable[..., Any]
"""``(machine, gpu, *args) → pynvml's answer`` on a simulated GPU (args: the row's constants,
resolved); None: the simulated card does not report it (NOT_SUPPORTED)."""


@dataclass(frozen=True, slots=True)
class Conversion:
    """From gpu-exporter's base unit to dcgm-exporter's: times ``times``, divided by ``per``."""

    unit: str  # dcgm-exporter's unit, as its help names it: "(in MHz)"
    times: float = 1.0  # rounded to 6 decimals: a ratio of 0.57 is 57 %, not 56.99999999999999
    per: float = 1.0  # exact where it is a power of two (MiB)

    def __call__(self, value: float) -> float:
        if self.times != 1.0:
            value = round(value * self.times, 6)
        return value / self.per if self.per != 1.0 else value


MHZ = Conversion("MHz", per=1e6)  # from hertz
MIB = Conversion("MiB", per=2**20)  # from bytes
PERCENT = Conversion("%", times=100.0)  # from a ratio 0-1
MILLIJOULES = Conversion("mJ", times=1000.0)  # from joules
CELSIUS = Conversion("C")  # as its help writes it
WATTS = Conversion("W")
COUNT = Conversion("1")
FLAG = Conversion("0/1")  # from a bool
RATIO = Conversion("ratio")  # DCGM_FI_PROF_*: ratios 0-1, as gpu-exporter's
BYTES_PER_SECOND = Conversion("B/s")

GAUGE, COUNTER = "gauge", "counter"


@dataclass(frozen=True, slots=True)
class Dcgm:
    """The same value under dcgm-exporter's name: its type and ``# HELP``, word for word from
    its ``etc/default-counters.csv`` (or ``dcp-metrics-included.csv``), and the conversion."""

    name: str
    type: str  # dcgm-exporter's: gauge or counter (without _total)
    help: str
    conversion: Conversion


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family: every row that names it is one of its series (with its labels)."""

    name: str  # as exposed; counters end in _total
    help: str  # without the sampling sentence, added for every sampled family
    unit: str  # for the docs: bytes, watts, ratio (0-1), 0/1 …
    type: str = GAUGE
    source: str = ""  # where the value comes from, for the docs; derived from the rows if ""
    details: str = ""  # more of the description, for the README only
    default: str = "yes"  # "yes", or how to turn it on
    mig: bool = False  # also exported for MIG devices (uuid="MIG-…")


@dataclass(frozen=True, slots=True)
class Reading:
    """One GPU value: where NVML gives it, its base unit, cadence, group and metric."""

    attribute: str  # the GpuSample attribute, its unit in the name
    family: Family | None  # its metric family; None: not exported (/gpus has it)
    labels: tuple[tuple[str, str], ...] = ()  # its series' labels after gpu and uuid
    when: str = FAST
    group: str = CORE
    # The pynvml getter and the names of the pynvml constants it takes after the handle;
    # ``convert`` turns its answer into the base unit.
    getter: str | None = None
    args: tuple[str, ...] = ()
    convert: Callable[[Any], Any] | None = None
    # The same value as field values: these NVML_FI_* ids, each entry's answer through
    # ``from_fields`` (one argument per id). Read in its cadence's nvmlDeviceGetFieldValues
    # batch, with the getter (if any) where the driver does not know the ids.
    fields: tuple[str, ...] = ()
    from_fields: Callable[..., Any] | None = None  # None: the one id's answer as it is
    partial: bool = False  # from_fields is given a failed entry as its error, not failed
    # A getter that needs code of its own (a struct, a refusal in the answer): the
    # gpu_exporter.nvml.Nvml method of this name reads it, ``getter`` names its function.
    method: str | None = None
    # Rows sharing one call share this name: fields_supported's and the field label's.
    # Empty: the attribute less its unit.
    field: str = ""
    code: str = ""  # where the code that reads it is, for a value no getter row can read
    # Its series where the value names their labels (``labels`` then give the names only):
    # value → (label values, sample value) pairs.
    series: Callable[[Any], Iterable[tuple[tuple[str, ...], float]]] | None = None
    dcgm: Dcgm | None = None
    simulate: Simulated | None = None  # the getter's answer on a simulated GPU
    simulate_field: Simulated | None = None  # each field id's (the getter's if None)

    @property
    def name(self) -> str:
        """The field it belongs to: ``fan_speed`` for ``fan_speed_ratio``."""
        if self.field:
            return self.field
        for unit in _UNITS:
            if self.attribute.endswith(unit):
                return self.attribute.removesuffix(unit)
        return self.attribute


_UNITS = ("_bytes", "_ratio", "_watts", "_joules", "_celsius", "_hz", "_enabled", "_seconds")
