"""The snapshot: what one sample of every GPU on this host looked like.

Frozen, slotted dataclasses with the unit in every field name. ``None`` means the value is
absent (this GPU cannot report it, or the call failed this time) — never a stand-in 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from gpu_exporter.readings import CLOCKS as CLOCKS
from gpu_exporter.readings import CLOCKS_EVENT_REASONS as CLOCKS_EVENT_REASONS
from gpu_exporter.readings import ECC_COUNTERS as ECC_COUNTERS
from gpu_exporter.readings import ECC_ERRORS as ECC_ERRORS
from gpu_exporter.readings import NVLINK_ERRORS as NVLINK_ERRORS
from gpu_exporter.readings import PCIE_LINKS as PCIE_LINKS

# The label values, where the code that reads and exports them finds them (explicit re-exports).
from gpu_exporter.readings import READINGS
from gpu_exporter.readings import RETIREMENT_CAUSES as RETIREMENT_CAUSES
from gpu_exporter.readings import TEMPERATURE_THRESHOLDS as TEMPERATURE_THRESHOLDS

# Opt-in process attribution (--process-labels), in label order.
PROCESS_LABELS = ("user", "command", "container", "slurm_job", "pod")
VISIBILITIES = ("full", "partial", "none")  # process_visibility's answers


_SHOWN = (
    "pid",
    "used_memory_bytes",
    *PROCESS_LABELS,
    "sm_utilization_ratio",
    "memory_utilization_ratio",
)


# -- NVML's answers, in base units (gpu_exporter.nvml returns these) ------------------------


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    total_bytes: int
    used_bytes: int
    free_bytes: int
    # Driver-reserved memory; None where only the v1 call exists (then used includes it).
    reserved_bytes: int | None


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    pid: int
    used_memory_bytes: int | None
    # The MIG instance the process runs in (None outside MIG, or on bindings without it).
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass(frozen=True, slots=True)
class Event:
    """One NVML event (``nvmlEventSetWait_v2``): ``data`` is the Xid for Xid events."""

    device_key: int  # gpu_exporter.nvml.handle_key() of the device it happened on
    event_type: int
    data: int
    gpu_instance_id: int | None
    compute_instance_id: int | None


@dataclass(frozen=True, slots=True)
class NvLinkSample:
    """One NVLink of a GPU: whether it is active, and its counters since the driver loaded
    (data bytes, without protocol overhead; errors by :data:`NVLINK_ERRORS`). None: that
    counter did not answer. The exporter keeps the counters from going backwards when the
    driver resets them (:class:`gpu_exporter.counters.MonotonicCounters`)."""

    link: int
    active: bool | None
    transmit_bytes: int | None
    receive_bytes: int | None
    crc_flit_errors: int | None
    crc_data_errors: int | None
    replay_errors: int | None
    recovery_errors: int | None

    def errors(self) -> tuple[int | None, ...]:
        """The error counters, in :data:`NVLINK_ERRORS` order."""
        return (self.crc_flit_errors, self.crc_data_errors, self.replay_errors,
                self.recovery_errors)  # fmt: skip


# -- the snapshot ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessSample:
    """A compute process on one GPU or MIG device.

    The attribution fields are filled only when enabled with ``--process-labels`` (they say
    who runs what on a shared host); otherwise, or when ``/proc`` does not show the process
    (another PID namespace), they are None.
    """

    pid: int
    used_memory_bytes: int | None  # None where the driver cannot say (WDDM, some vGPU)
    user: str | None = None
    command: str | None = None  # argv[0], base name only
    container: str | None = None  # 64-hex container id from /proc/<pid>/cgroup
    slurm_job: str | None = None
    pod: str | None = None  # Kubernetes pod UID
    # For lease attribution only, read whatever --process-labels says and never exported
    # (they would say who runs what): the parent, grandparent … as first seen (None: /proc
    # does not show this process), and its cgroup identity (procinfo.cgroup_key).
    ancestors: tuple[int, ...] | None = None
    cgroup: str | None = None
    # nvmlDeviceGetProcessUtilization: this process's share of the last sample period with
    # its kernels on the SMs, and with its memory reads or writes (0 when NVML lists it not:
    # it lists only processes that did something); None where NVML cannot say (MIG).
    sm_utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None

    def label(self, name: str) -> str:
        value: str | None = getattr(self, name)
        return value or ""

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if name in _SHOWN}


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU at one moment. ``index`` is the NVML index (PCI order), not CUDA's."""

    index: int
    uuid: str  # "GPU-…"; "" when a GPU was lost before its UUID could be read
    up: bool  # False: the GPU did not answer; every value field below is then None
    name: str | None = None
    pci_bus_id: str | None = None
    error: str | None = None  # why up is False, or the last failed field this sample
    down_reason: str | None = None  # when up is False: "lost", "timeout" or "error"
    last_seen_seconds: float | None = None  # wall clock of the last sample it answered

    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None  # excludes reserved, as nvidia-smi ≥ 510
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    utilization_ratio: float | None = None  # 0–1: time a kernel was running
    memory_utilization_ratio: float | None = None  # 0–1: time memory was read or written
    power_draw_watts: float | None = None
    power_limit_watts: float | None = None
    compute_processes: int | None = None  # None when the process list is unsupported
    # Every other value of gpu_exporter.readings, in READINGS' order, read by name as an
    # attribute (gpu.fan_speed_ratio); () when the device reported none of them.
    readings: tuple[Any, ...] = ()
    # Each NVLink that answers (--collect.nvlink); None where the card has none.
    nvlink: tuple[NvLinkSample, ...] | None = None

    # GPM (Hopper and later; None on cards without it): what the SMs, pipes and links did
    # over the GPM interval (--gpm-interval), as ratios 0-1 and byte rates. Per MIG device too.
    graphics_active_ratio: float | None = None  # any graphics or compute engine active
    sm_active_ratio: float | None = None  # share of SMs busy: the real "is it working"
    sm_occupancy_ratio: float | None = None  # resident warps ÷ the maximum
    tensor_active_ratio: float | None = None  # any tensor pipe
    tensor_hmma_active_ratio: float | None = None
    tensor_imma_active_ratio: float | None = None
    tensor_dfma_active_ratio: float | None = None
    fp64_active_ratio: float | None = None  # non-tensor FP64 pipe
    fp32_active_ratio: float | None = None
    fp16_active_ratio: float | None = None
    dram_active_ratio: float | None = None  # DRAM bandwidth used ÷ the maximum
    pcie_transmit_bytes_per_second: float | None = None
    pcie_receive_bytes_per_second: float | None = None
    nvlink_transmit_bytes_per_second: float | None = None  # all links together
    nvlink_receive_bytes_per_second: float | None = None

    # MIG. On a parent GPU: its mode and its MIG devices. A MIG device is a GpuSample too,
    # with the parent's index, its own "MIG-…" uuid, and parent_uuid set.
    mig_mode_enabled: bool | None = None
    mig_devices: tuple[GpuSample, ...] = ()
    parent_uuid: str | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    mig_profile: str | None = None  # "3g.40gb"

    # Processes. None when the driver cannot list them.
    processes: tuple[ProcessSample, ...] | None = None
    # "full": the listed processes account for the memory in use; "partial": some memory
    # has no visible owner; "none": memory is in use and no process is visible (PID
    # namespaces: another container). None when unknown.
    process_visibility: str | None = None

    # (field, supported) for every field asked of this GPU; unsupported ones are not asked
    # again until NVML is re-initialised.
    fields_supported: tuple[tuple[str, bool], ...] = ()

    if TYPE_CHECKING:  # each name of READING_NAMES is a property (below), typed Any

        def __getattr__(self, name: str) -> Any: ...

    @classmethod
    def from_values(cls, **values: Any) -> GpuSample:
        """A sample from attributes by name: its fields, and any of :data:`READING_NAMES`."""
        kept = [values.pop(name, None) for name in READING_NAMES]
        return cls(**values, readings=tuple(kept) if any(v is not None for v in kept) else ())

    @property
    def is_mig_device(self) -> bool:
        return self.parent_uuid is not None

    @property
    def memory_used_ratio(self) -> float | None:
        """Memory occupancy: used ÷ total (what nvidia-smi and GPUtil's ``memoryUtil`` show);
        None when either is unknown."""
        used, total = self.memory_used_bytes, self.memory_total_bytes
        return None if used is None or not total else used / total

    @property
    def memory_free_ratio(self) -> float | None:
        """Free memory ÷ total; None when either is unknown."""
        free, total = self.memory_free_bytes, self.memory_total_bytes
        return None if free is None or not total else free / total

    def devices(self) -> tuple[GpuSample, ...]:
        """This GPU followed by its MIG devices."""
        return (self, *self.mig_devices)

    def to_json(self) -> dict[str, Any]:
        """Every field, absent values as ``null``; instead of ``fields_supported``, the list of
        ``unsupported_fields`` (what NVML answered NOT_SUPPORTED or FUNCTION_NOT_FOUND for: why
        a panel is empty for this GPU; /metrics has them as gpu_exporter_field_supported 0)."""
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            if name == "readings":
                values = map(_json, self.readings or _NO_READINGS)
                out.update(zip(READING_NAMES, values, strict=True))
                continue
            if name == "fields_supported":
                out["unsupported_fields"] = [field for field, ok in self.fields_supported if not ok]
                continue
            value = getattr(self, name)
            if name == "mig_devices":
                value = [d.to_json() for d in value]
            elif name == "processes" and value is not None:
                value = [p.to_json() for p in value]
            elif name == "nvlink" and value is not None:
                value = [asdict(link) for link in value]
            out[name] = _json(value)
        return out


def _json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# The GpuSample attributes kept in GpuSample.readings: every reading without a field of its own.
READING_NAMES = tuple(
    r.attribute for r in READINGS if r.attribute not in GpuSample.__dataclass_fields__
)
_NO_READINGS = (None,) * len(READING_NAMES)


def _reading(i: int) -> property:
    return property(lambda self: self.readings[i] if self.readings else None)


for _i, _name in enumerate(READING_NAMES):  # gpu.fan_speed_ratio: a value of its readings
    setattr(GpuSample, _name, _reading(_i))


def all_devices(gpus: tuple[GpuSample, ...]) -> tuple[GpuSample, ...]:
    """Every GPU and, after each, its MIG devices."""
    return tuple(d for g in gpus for d in g.devices())


def process_visibility(
    memory_used_bytes: int | None,
    processes: tuple[ProcessSample, ...] | None,
    slack_bytes: int = 64 * 2**20,
) -> str | None:
    """How much of the memory in use the visible processes account for.

    >>> p = (ProcessSample(1, 900),)
    >>> [process_visibility(u, ps) for u, ps in ((900, p), (5 * 2**30, p), (5 * 2**30, ()))]
    ['full', 'partial', 'none']
    """
    if processes is None or memory_used_bytes is None:
        return None
    owned = sum(p.used_memory_bytes or 0 for p in processes)
    if memory_used_bytes - owned <= slack_bytes:
        return "full"
    return "partial" if processes else "none"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """All GPUs of this host from one sampling pass. Replaced whole, never mutated."""

    taken_at_seconds: float  # wall clock (Unix time) when the sample started
    monotonic_seconds: float  # the same moment on the monotonic clock, for ages
    sample_duration_seconds: float
    nvml_up: bool
    simulated: bool
    gpus: tuple[GpuSample, ...] = ()
    nvml_error: str | None = None  # why nvml_up is False
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    # Failed NVML calls since start, by (function, error name); copied in at sample time.
    nvml_errors: tuple[tuple[str, str, int], ...] = field(default=())
    sequence: int = 0  # increases by one with every published snapshot
    # The opt-in attribution fields filled in ProcessSample (--process-labels).
    process_labels: tuple[str, ...] = ()
    # When each field is read (collect.groups): (field, "every sample" | "every
    # --slow-interval" | "once" | "off"), for /gpus.
    fields_updated: tuple[tuple[str, str], ...] = ()

    def age_seconds(self, monotonic_now: float) -> float:
        return max(0.0, monotonic_now - self.monotonic_seconds)


def initial_snapshot(*, simulated: bool, monotonic_now: float, wall_now: float) -> Snapshot:
    """What the cache holds before the first sample: NVML not (yet) up, no GPUs."""
    return Snapshot(
        taken_at_seconds=wall_now,
        monotonic_seconds=monotonic_now,
        sample_duration_seconds=0.0,
        nvml_up=False,
        simulated=simulated,
        nvml_error="not sampled yet",
    )
