"""``/metrics``: one spec table, and a collector that renders the latest snapshot with it.

:data:`METRICS` is the single source of truth for names, types, labels, help text and the
NVML function behind each value; the README's metric table is generated from it
(``python -m gpu_exporter.metrics``) and a test keeps the two equal.

:class:`GpuCollector` builds fresh metric families from one snapshot on every scrape — no
global gauges, nothing left behind when a GPU disappears — and never calls NVML.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpu_exporter import __version__
from gpu_exporter.model import CLOCKS, GpuSample, Snapshot
from gpu_exporter.sampler import SnapshotCache

if TYPE_CHECKING:
    from gpu_exporter.leases import LeaseTable

GPU_LABELS = ("gpu", "uuid")
SAMPLED = (
    " Sampled in the background every --interval (see gpu_exporter_last_sample_timestamp_seconds)."
)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # as exposed; counters end in _total
    type: str  # "gauge" or "counter"
    help: str
    labels: tuple[str, ...]
    source: str  # where the value comes from, for the docs
    field: str | None = None  # GpuSample attribute, for plain per-GPU values
    # For a metric with one extra label: (label value, GpuSample attribute) pairs.
    per_label: tuple[tuple[str, str], ...] = ()

    @property
    def family_name(self) -> str:
        return self.name.removesuffix("_total") if self.type == "counter" else self.name


def _gpu(name: str, help: str, source: str, field: str, type: str = "gauge") -> MetricSpec:
    return MetricSpec(name, type, help + SAMPLED, GPU_LABELS, source, field)


GPU_INFO = MetricSpec(
    "gpu_info",
    "gauge",
    "Always 1; labels identify the GPU (gpu is the NVML index, in PCI bus order).",
    (*GPU_LABELS, "name", "pci_bus_id", "driver_version", "cuda_driver_version"),
    "nvmlDeviceGetName, nvmlDeviceGetPciInfo, nvmlSystemGetDriverVersion",
)
GPU_UP = MetricSpec(
    "gpu_up",
    "gauge",
    "1 if the GPU answered the last sample, 0 if it did not (lost, fallen off the bus); "
    "its value series are then absent." + SAMPLED,
    GPU_LABELS,
    "nvmlDeviceGetHandleByIndex and every value call",
)
GPU_LAST_SEEN = MetricSpec(
    "gpu_last_seen_timestamp_seconds",
    "gauge",
    "Unix time of the last sample in which the GPU answered; kept while it is down, so "
    "time() - this is how long it has been gone." + SAMPLED,
    GPU_LABELS,
    "the exporter",
)
GPU_DOWN_REASON = MetricSpec(
    "gpu_down_reason",
    "gauge",
    "1 while gpu_up is 0, with why: lost (fell off the bus, needs a reset), timeout (an NVML "
    "call for it has not returned within --nvml-timeout) or error." + SAMPLED,
    (*GPU_LABELS, "reason"),
    "nvmlDeviceGetHandleByIndex and every value call",
)
GPU_VALUES: tuple[MetricSpec, ...] = (
    _gpu(
        "gpu_memory_total_bytes",
        "Total frame-buffer memory.",
        "nvmlDeviceGetMemoryInfo_v2",
        "memory_total_bytes",
    ),
    _gpu(
        "gpu_memory_used_bytes",
        "Frame-buffer memory in use, excluding the driver's reservation (as nvidia-smi >= 510).",
        "nvmlDeviceGetMemoryInfo_v2",
        "memory_used_bytes",
    ),
    _gpu(
        "gpu_memory_free_bytes",
        "Frame-buffer memory free for allocations.",
        "nvmlDeviceGetMemoryInfo_v2",
        "memory_free_bytes",
    ),
    _gpu(
        "gpu_memory_reserved_bytes",
        "Frame-buffer memory reserved by the driver.",
        "nvmlDeviceGetMemoryInfo_v2",
        "memory_reserved_bytes",
    ),
    _gpu(
        "gpu_utilization_ratio",
        "Fraction of the last sample period (0-1) in which a kernel was running.",
        "nvmlDeviceGetUtilizationRates",
        "utilization_ratio",
    ),
    _gpu(
        "gpu_memory_utilization_ratio",
        "Fraction of the last sample period (0-1) in which device memory was read or written.",
        "nvmlDeviceGetUtilizationRates",
        "memory_utilization_ratio",
    ),
    _gpu(
        "gpu_power_draw_watts",
        "Power draw of the whole board.",
        "nvmlDeviceGetPowerUsage",
        "power_draw_watts",
    ),
    _gpu(
        "gpu_power_limit_watts",
        "Power limit the driver enforces.",
        "nvmlDeviceGetEnforcedPowerLimit",
        "power_limit_watts",
    ),
    _gpu(
        "gpu_energy_joules_total",
        "Energy consumed since the driver was loaded.",
        "nvmlDeviceGetTotalEnergyConsumption",
        "energy_joules",
        type="counter",
    ),
    _gpu(
        "gpu_temperature_celsius",
        "GPU core temperature.",
        "nvmlDeviceGetTemperature",
        "temperature_celsius",
    ),
    _gpu(
        "gpu_fan_speed_ratio",
        "Fan speed as a fraction of its maximum (absent on passively cooled cards).",
        "nvmlDeviceGetFanSpeed",
        "fan_speed_ratio",
    ),
    MetricSpec(
        "gpu_clock_hz",
        "gauge",
        "Current clock frequency by clock domain." + SAMPLED,
        (*GPU_LABELS, "clock"),
        "nvmlDeviceGetClockInfo",
        per_label=tuple((c, f"clock_{c}_hz") for c in CLOCKS),
    ),
    _gpu(
        "gpu_compute_processes",
        "Compute processes with a context on the GPU, as far as this process can see them.",
        "nvmlDeviceGetComputeRunningProcesses",
        "compute_processes",
    ),
)
GPU_LEASED = MetricSpec(
    "gpu_leased",
    "gauge",
    "1 while a /choose lease holds the GPU, else 0.",
    GPU_LABELS,
    "the lease table",
)
BUILD_INFO = MetricSpec(
    "gpu_exporter_build_info",
    "gauge",
    'Always 1; the exporter\'s version, and backend="simulated" when --simulate is on.',
    ("version", "backend"),
    "the exporter",
)
NVML_UP = MetricSpec(
    "gpu_exporter_nvml_up",
    "gauge",
    "1 if NVML is initialised and answering, 0 if not (no driver, version mismatch); "
    "initialisation is retried with backoff.",
    (),
    "nvmlInit",
)
LAST_SAMPLE = MetricSpec(
    "gpu_exporter_last_sample_timestamp_seconds",
    "gauge",
    "Unix time at which the sample behind every gpu_* value was taken.",
    (),
    "the exporter",
)
SAMPLE_DURATION = MetricSpec(
    "gpu_exporter_sample_duration_seconds",
    "gauge",
    "How long the last sample of all GPUs took.",
    (),
    "the exporter",
)
NVML_ERRORS = MetricSpec(
    "gpu_exporter_nvml_errors_total",
    "counter",
    "NVML calls that failed, by function and NVML error name (unsupported fields not counted).",
    ("function", "error"),
    "every NVML call",
)
CHOOSE_REQUESTS = MetricSpec(
    "gpu_exporter_choose_requests_total",
    "counter",
    "/choose requests by result: ok, or the error code (not_enough_gpus, invalid_parameter…).",
    ("result",),
    "the exporter",
)
LEASES_DROPPED = MetricSpec(
    "gpu_exporter_lease_gpus_released_total",
    "counter",
    "GPUs released from leases before expiry: arrived (the job showed up), down, gone.",
    ("reason",),
    "the lease table",
)
REQUESTS_REJECTED = MetricSpec(
    "gpu_exporter_requests_rejected_total",
    "counter",
    "Requests refused by the request limits: too_many_requests (--max-requests-in-flight), "
    "too_many_waiters (--max-waiters), uri_too_long.",
    ("reason",),
    "the exporter",
)
EXPORTER_METRICS = (
    BUILD_INFO,
    NVML_UP,
    LAST_SAMPLE,
    SAMPLE_DURATION,
    NVML_ERRORS,
    CHOOSE_REQUESTS,
    LEASES_DROPPED,
    REQUESTS_REJECTED,
)
METRICS: tuple[MetricSpec, ...] = (
    GPU_INFO,
    GPU_UP,
    GPU_DOWN_REASON,
    GPU_LAST_SEEN,
    *GPU_VALUES,
    GPU_LEASED,
    *EXPORTER_METRICS,
)


class RequestCounter:
    """Thread-safe counts by one label value (/choose results, rejected requests)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def inc(self, result: str) -> None:
        with self._lock:
            self._counts[result] += 1

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def _family(spec: MetricSpec) -> GaugeMetricFamily | CounterMetricFamily:
    cls = CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily
    return cls(spec.family_name, spec.help, labels=spec.labels)


def gpu_families(snapshot: Snapshot) -> Iterator[Metric]:
    """Per-GPU families. A value the GPU did not report this sample has no series at all."""
    info, up = _family(GPU_INFO), _family(GPU_UP)
    down, seen = _family(GPU_DOWN_REASON), _family(GPU_LAST_SEEN)
    values = [_family(spec) for spec in GPU_VALUES]
    for gpu in snapshot.gpus:
        ids = [str(gpu.index), gpu.uuid]
        info.add_metric(
            [
                *ids,
                gpu.name or "",
                gpu.pci_bus_id or "",
                snapshot.driver_version or "",
                snapshot.cuda_driver_version or "",
            ],
            1,
        )
        up.add_metric(ids, 1 if gpu.up else 0)
        if not gpu.up and gpu.down_reason is not None:
            down.add_metric([*ids, gpu.down_reason], 1)
        if gpu.last_seen_seconds is not None:
            seen.add_metric(ids, gpu.last_seen_seconds)
        for spec, family in zip(GPU_VALUES, values, strict=True):
            _add_values(spec, family, ids, gpu)
    yield info
    yield up
    yield down
    yield seen
    yield from values


def _add_values(spec: MetricSpec, family: Metric, ids: list[str], gpu: GpuSample) -> None:
    if spec.field is not None:
        value = getattr(gpu, spec.field)
        if value is not None:
            family.add_metric(ids, value)  # type: ignore[attr-defined]
    for label_value, field in spec.per_label:
        value = getattr(gpu, field)
        if value is not None:
            family.add_metric([*ids, label_value], value)  # type: ignore[attr-defined]


def exporter_families(snapshot: Snapshot, version: str = __version__) -> Iterator[Metric]:
    build = _family(BUILD_INFO)
    build.add_metric([version, "simulated" if snapshot.simulated else "nvml"], 1)
    yield build
    nvml_up = _family(NVML_UP)
    nvml_up.add_metric([], 1 if snapshot.nvml_up else 0)
    yield nvml_up
    if snapshot.sequence > 0:  # nothing sampled yet: no timestamp rather than a fake one
        last = _family(LAST_SAMPLE)
        last.add_metric([], snapshot.taken_at_seconds)
        yield last
        duration = _family(SAMPLE_DURATION)
        duration.add_metric([], snapshot.sample_duration_seconds)
        yield duration
    errors = _family(NVML_ERRORS)
    for function, error, count in snapshot.nvml_errors:
        errors.add_metric([function, error], count)
    yield errors


def lease_families(
    snapshot: Snapshot, leases: LeaseTable, requests: RequestCounter
) -> Iterator[Metric]:
    held = leases.holders(snapshot)
    leased = _family(GPU_LEASED)
    for gpu in snapshot.gpus:
        leased.add_metric([str(gpu.index), gpu.uuid], 1 if gpu.uuid in held else 0)
    yield leased
    yield _counts(CHOOSE_REQUESTS, requests)
    dropped = _family(LEASES_DROPPED)
    for reason, count in sorted(leases.dropped.items()):
        dropped.add_metric([reason], count)
    yield dropped


def _counts(spec: MetricSpec, counter: RequestCounter) -> Metric:
    family = _family(spec)
    for label, count in sorted(counter.counts().items()):
        family.add_metric([label], count)
    return family


class GpuCollector(Collector):
    """A prometheus_client collector over the snapshot cache (and the lease table)."""

    def __init__(
        self,
        cache: SnapshotCache,
        version: str = __version__,
        *,
        leases: LeaseTable | None = None,
        requests: RequestCounter | None = None,
        rejections: RequestCounter | None = None,
    ) -> None:
        self._cache = cache
        self._version = version
        self._leases = leases
        self._requests = requests or RequestCounter()
        self._rejections = rejections

    def collect(self) -> Iterator[Metric]:
        snapshot = self._cache.get()  # one snapshot for the whole scrape
        yield from gpu_families(snapshot)
        if self._leases is not None:
            yield from lease_families(snapshot, self._leases, self._requests)
        yield from exporter_families(snapshot, self._version)
        if self._rejections is not None:
            yield _counts(REQUESTS_REJECTED, self._rejections)


def markdown_table() -> str:
    """The README's metric table."""
    rows = [
        "| Metric | Type | Labels | Source | Description |",
        "|---|---|---|---|---|",
    ]
    for spec in METRICS:
        help_text = spec.help.removesuffix(SAMPLED).replace("|", "\\|")
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "—"
        rows.append(f"| `{spec.name}` | {spec.type} | {labels} | {spec.source} | {help_text} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(markdown_table(), end="")
