"""The collectors behind ``/metrics``: fresh metric families built from one snapshot on every
scrape, with the names, help and labels of :mod:`gpu_exporter.export.spec`.

No global gauges, nothing left behind when a GPU disappears, and no NVML call: everything
comes from the snapshot cache and the counters the background threads update.
:class:`GpuCollector` splits its families into those that depend on the snapshot alone (which
:mod:`gpu_exporter.export.exposition` renders once per snapshot) and the live ones.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from itertools import chain
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpu_exporter import __version__
from gpu_exporter.collect.cache import SnapshotCache
from gpu_exporter.config import DEFAULT_PROCESS_SERIES_LIMIT
from gpu_exporter.counters import PcieRates, RequestCounter, XidCounter
from gpu_exporter.export.spec import (
    BUILD_INFO,
    CHOOSE_REQUESTS,
    CHOOSE_WAITERS,
    FIELD_SUPPORTED,
    GPU_DOWN_REASON,
    GPU_INFO,
    GPU_LABELS,
    GPU_LAST_SEEN,
    GPU_LEASE_MEMORY_OVERRUN,
    GPU_LEASED,
    GPU_MEMORY_LEASED,
    GPU_MIG_INFO,
    GPU_POD_INFO,
    GPU_PROCESS_POD_INFO,
    GPU_UP,
    GPU_VALUES,
    GPUS_WITHHELD,
    KUBERNETES_METRICS,
    KUBERNETES_UP,
    LAST_SAMPLE,
    LAST_XID,
    LEASES_DROPPED,
    METRICS,
    NVML_ERRORS,
    NVML_UP,
    PCIE_THROUGHPUT,
    PROCESS_MEMORY,
    PROCESS_MEMORY_UTILIZATION,
    PROCESS_SM_UTILIZATION,
    REQUESTS_REJECTED,
    SAMPLE_DURATION,
    STATE_WRITE_ERRORS,
    WEB_CONFIG_OK,
    WEB_CONFIG_RELOADS,
    XID_ERRORS,
    MetricSpec,
)
from gpu_exporter.model import GpuSample, ProcessSample, Snapshot, all_devices
from gpu_exporter.podallocations import PodAllocations, physical_id, process_owners, resolve


class Leases(Protocol):
    """What the lease families read (:class:`gpu_exporter.choose.leases.LeaseTable` has it)."""

    def holders(self, snapshot: Snapshot) -> Mapping[str, object]:
        """The leases in force for ``snapshot``'s devices, by device UUID."""
        ...

    @property
    def dropped(self) -> Mapping[str, int]:
        """GPUs released from leases before expiry, by reason."""
        ...

    def memory_by_card(self, snapshot: Snapshot) -> Mapping[str, tuple[int, int]]:
        """UUID → (bytes reserved by memory leases, bytes their processes use beyond that),
        for the cards holding memory leases."""
        ...

    @property
    def state_write_errors(self) -> int:
        """Writes of the state file that failed."""
        ...

    def withheld(self, snapshot: Snapshot) -> Mapping[str, str]:
        """UUID → why, for the devices no claim may get after an untrusted state file."""
        ...


class WaiterCount(Protocol):
    """What the waiters gauge reads (:class:`gpu_exporter.choose.claim.Waiters` has it)."""

    @property
    def active(self) -> int:
        """Requests waiting for GPUs now."""
        ...


class ReloadStats(Protocol):
    """What :class:`WebConfigCollector` reads (the ``--web-config-file`` watcher has it)."""

    @property
    def reloads(self) -> Mapping[str, int]:
        """Re-reads of the file by result: success, error."""
        ...

    @property
    def last_reload_ok(self) -> bool: ...


def _family(
    spec: MetricSpec, labels: tuple[str, ...] | None = None
) -> GaugeMetricFamily | CounterMetricFamily:
    cls = CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily
    return cls(
        spec.family_name, spec.exposed_help, labels=spec.labels if labels is None else labels
    )


def _one(spec: MetricSpec, value: float, labels: list[str] | None = None) -> Metric:
    """A family of one series: ``value``, with ``labels`` (none by default)."""
    family = _family(spec)
    family.add_metric(labels or [], value)
    return family


def gpu_families(
    snapshot: Snapshot,
    process_series_limit: int = DEFAULT_PROCESS_SERIES_LIMIT,
    replaced: frozenset[str] = frozenset(),
) -> Iterator[Metric]:
    """Per-GPU families, with MIG devices as extra series (gpu = the parent's index); none of
    the value families named in ``replaced`` (served under dcgm-exporter's names instead).

    A value the GPU did not report this sample has no series at all.
    """
    info, up = _family(GPU_INFO), _family(GPU_UP)
    down, seen = _family(GPU_DOWN_REASON), _family(GPU_LAST_SEEN)
    specs = [spec for spec in GPU_VALUES if spec.name not in replaced]
    values = [_family(spec) for spec in specs]
    mig_info = _family(GPU_MIG_INFO)
    proc_labels = (*GPU_LABELS, "pid", *snapshot.process_labels)
    procs = _family(PROCESS_MEMORY, proc_labels)
    proc_sm = _family(PROCESS_SM_UTILIZATION, proc_labels)
    proc_mem = _family(PROCESS_MEMORY_UTILIZATION, proc_labels)
    for gpu in all_devices(snapshot.gpus):
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
        if gpu.is_mig_device:
            mig_info.add_metric(
                [
                    *ids,
                    gpu.parent_uuid or "",
                    _text(gpu.gpu_instance_id),
                    _text(gpu.compute_instance_id),
                    gpu.mig_profile or "",
                ],
                1,
            )
        for spec, family in zip(specs, values, strict=True):
            if spec.mig or not gpu.is_mig_device:
                _add_values(spec, family, ids, gpu)
        for p in _largest_processes(gpu, process_series_limit):
            labels = [*ids, str(p.pid), *(p.label(name) for name in snapshot.process_labels)]
            procs.add_metric(labels, p.used_memory_bytes or 0)
            if p.sm_utilization_ratio is not None:
                proc_sm.add_metric(labels, p.sm_utilization_ratio)
            if p.memory_utilization_ratio is not None:
                proc_mem.add_metric(labels, p.memory_utilization_ratio)
    yield info
    yield up
    yield down
    yield seen
    yield from values
    yield mig_info
    yield procs
    yield proc_sm
    yield proc_mem


def _text(value: int | None) -> str:
    return "" if value is None else str(value)


def _largest_processes(gpu: GpuSample, limit: int) -> list[ProcessSample]:
    """The ``limit`` largest processes of one device (unknown memory has none); a GPU in MIG
    mode has none: its processes are its MIG devices', not counted twice."""
    if gpu.mig_devices and not gpu.is_mig_device:
        return []
    known = [p for p in gpu.processes or () if p.used_memory_bytes is not None]
    known.sort(key=lambda p: (-(p.used_memory_bytes or 0), p.pid))
    return known[:limit]


def _add_values(spec: MetricSpec, family: Metric, ids: list[str], gpu: GpuSample) -> None:
    if spec.field is not None:
        value = getattr(gpu, spec.field)
        if value is not None:
            family.add_metric(ids, float(value))  # type: ignore[attr-defined]
    for label_value, field in spec.per_label:
        value = getattr(gpu, field)
        if value is not None:
            family.add_metric([*ids, label_value], float(value))  # type: ignore[attr-defined]
    if spec.values is not None:
        for extra, value in spec.values(gpu):
            family.add_metric([*ids, *extra], value)  # type: ignore[attr-defined]


def field_families(snapshot: Snapshot) -> Iterator[Metric]:
    """The fields a device does not report, at 0; a series per supported field would be
    ~40 per GPU that never change (issue 15), and absence already says "supported"."""
    supported = _family(FIELD_SUPPORTED)
    for gpu in all_devices(snapshot.gpus):
        for field, ok in gpu.fields_supported:
            if not ok:
                supported.add_metric([str(gpu.index), gpu.uuid, field], 0)
    yield supported


def xid_families(xids: XidCounter) -> Iterator[Metric]:
    errors = _family(XID_ERRORS)
    for c in xids.counts():
        errors.add_metric([str(c.index), c.uuid, str(c.xid)], c.count)
    yield errors
    last = _family(LAST_XID)
    for x in xids.last():
        last.add_metric([str(x.index), x.uuid], x.at_seconds)
    yield last


def pcie_families(pcie: PcieRates) -> Iterator[Metric]:
    family = _family(PCIE_THROUGHPUT)
    for r in pcie.rates():
        for direction, value in (("tx", r.tx_bytes_per_second), ("rx", r.rx_bytes_per_second)):
            if value is not None:
                family.add_metric([str(r.index), r.uuid, direction], value)
    yield family


def exporter_families(
    snapshot: Snapshot, version: str = __version__, revision: str = "unknown"
) -> Iterator[Metric]:
    yield _one(BUILD_INFO, 1, [version, "simulated" if snapshot.simulated else "nvml", revision])
    yield _one(NVML_UP, 1 if snapshot.nvml_up else 0)
    if snapshot.sequence > 0:  # nothing sampled yet: no timestamp rather than a fake one
        yield _one(LAST_SAMPLE, snapshot.taken_at_seconds)
        yield _one(SAMPLE_DURATION, snapshot.sample_duration_seconds)
    errors = _family(NVML_ERRORS)
    for function, error, count in snapshot.nvml_errors:
        errors.add_metric([function, error], count)
    yield errors


def lease_families(
    snapshot: Snapshot, leases: Leases, requests: RequestCounter
) -> Iterator[Metric]:
    held = leases.holders(snapshot)
    leased = _family(GPU_LEASED)
    for gpu in all_devices(snapshot.gpus):
        leased.add_metric([str(gpu.index), gpu.uuid], 1 if gpu.uuid in held else 0)
    yield leased
    shared = leases.memory_by_card(snapshot)
    if shared:
        reserved, overrun = _family(GPU_MEMORY_LEASED), _family(GPU_LEASE_MEMORY_OVERRUN)
        for gpu in snapshot.gpus:
            if gpu.uuid in shared:
                labels = [str(gpu.index), gpu.uuid]
                reserved.add_metric(labels, shared[gpu.uuid][0])
                overrun.add_metric(labels, shared[gpu.uuid][1])
        yield reserved
        yield overrun
    yield _counts(CHOOSE_REQUESTS, requests.counts())
    yield _counts(LEASES_DROPPED, leases.dropped)
    yield _one(STATE_WRITE_ERRORS, leases.state_write_errors)
    yield _one(GPUS_WITHHELD, len(leases.withheld(snapshot)))


def _counts(spec: MetricSpec, counts: Mapping[str, int]) -> Metric:
    """A one-label counter: every known value (spec.label_values) from the start, at 0 until
    counted, then any other value counted, in name order."""
    family = _family(spec)
    for label in spec.label_values:
        family.add_metric([label], counts.get(label, 0))
    for label, count in sorted(counts.items()):
        if label not in spec.label_values:
            family.add_metric([label], count)
    return family


_WEB_CONFIG_METRICS = (WEB_CONFIG_RELOADS, WEB_CONFIG_OK)  # WebConfigCollector's
_OWN_COLLECTORS = (*_WEB_CONFIG_METRICS, *KUBERNETES_METRICS)  # and PodCollector's


def _with_series(*families: Iterable[Metric]) -> Iterator[Metric]:
    """The families that have a series: an empty one would still cost its # HELP and # TYPE
    lines (~140 bytes) on every scrape, for nothing (no fan, no MIG, no NVML error …)."""
    return (family for family in chain(*families) if family.samples)


class GpuCollector(Collector):
    """A prometheus_client collector over the snapshot cache (and the lease table)."""

    def __init__(
        self,
        cache: SnapshotCache,
        version: str = __version__,
        *,
        leases: Leases | None = None,
        requests: RequestCounter | None = None,
        rejections: RequestCounter | None = None,
        waiters: WaiterCount | None = None,
        xids: XidCounter | None = None,
        pcie: PcieRates | None = None,
        process_series_limit: int = DEFAULT_PROCESS_SERIES_LIMIT,
        revision: str = "unknown",
        replaced: frozenset[str] = frozenset(),
    ) -> None:
        self._cache = cache
        self._version = version
        self._revision = revision  # read once at start-up (gpu_exporter.revision)
        self._leases = leases
        self._requests = requests or RequestCounter()
        self._rejections = rejections
        self._waiters = waiters
        self._xids = xids
        self._pcie = pcie
        self._process_series_limit = process_series_limit
        # Value families served under dcgm-exporter's names only (--metric-names=dcgm).
        self._replaced = replaced

    def describe(self) -> Iterator[Metric]:
        """Every family this collector may produce (empty): the registry learns the names,
        which prometheus_client's ``/metrics?name[]=`` filter needs to find the collector."""
        for spec in METRICS:
            if spec not in _OWN_COLLECTORS and spec.name not in self._replaced:
                yield _family(spec)

    def collect(self) -> Iterator[Metric]:
        snapshot = self._cache.get()  # one snapshot for the whole scrape
        yield from self.snapshot_families(snapshot)
        yield from self.live_families(snapshot)

    def snapshot_families(self, snapshot: Snapshot) -> Iterator[Metric]:
        """Families that depend on the snapshot alone (and the fixed version).

        :mod:`gpu_exporter.export.exposition` renders these once per snapshot and serves the bytes,
        so nothing here may read anything that changes between samples.
        """
        return _with_series(
            gpu_families(snapshot, self._process_series_limit, self._replaced),
            exporter_families(snapshot, self._version, self._revision),
            field_families(snapshot),
        )

    def live_families(self, snapshot: Snapshot) -> Iterator[Metric]:
        """Families that can change between samples: leases, request counters, and the Xid
        and PCIe figures, which their own threads update."""
        return _with_series(self._live(snapshot))

    def _live(self, snapshot: Snapshot) -> Iterator[Metric]:
        if self._xids is not None:
            yield from xid_families(self._xids)
        if self._pcie is not None:
            yield from pcie_families(self._pcie)
        if self._leases is not None:
            yield from lease_families(snapshot, self._leases, self._requests)
        if self._rejections is not None:
            yield _counts(REQUESTS_REJECTED, self._rejections.counts())
        if self._waiters is not None:
            yield _one(CHOOSE_WAITERS, self._waiters.active)


class WebConfigCollector(Collector):
    """Reloads of --web-config-file; registered only when one is given."""

    def __init__(self, watcher: ReloadStats) -> None:
        self._watcher = watcher

    def describe(self) -> Iterator[Metric]:
        """The names, for the ``name[]`` filter (see :meth:`GpuCollector.describe`)."""
        for spec in _WEB_CONFIG_METRICS:
            yield _family(spec)

    def collect(self) -> Iterator[Metric]:
        yield _counts(WEB_CONFIG_RELOADS, self._watcher.reloads)
        yield _one(WEB_CONFIG_OK, 1 if self._watcher.last_reload_ok else 0)


class PodCollector(Collector):
    """``gpu_pod_info`` and ``gpu_exporter_kubernetes_up`` (``--kubernetes``): the kubelet's
    allocations (:class:`~gpu_exporter.podallocations.PodAllocations`) as info series to join
    on, never as labels on the value series; GPU indexes from the cache's latest sample.

    Registered, like :class:`WebConfigCollector`, only when the flag is given. The families
    are built once per change of the allocations or of the sample, so a scrape only hands the
    same objects to the encoder.
    """

    def __init__(
        self,
        allocations: PodAllocations,
        cache: SnapshotCache,
        process_series_limit: int = DEFAULT_PROCESS_SERIES_LIMIT,
    ) -> None:
        self._allocations = allocations
        self._cache = cache
        self._limit = process_series_limit
        self._lock = threading.Lock()
        self._built: tuple[tuple[int, int], list[Metric]] | None = None

    def describe(self) -> Iterator[Metric]:
        """The names, for the ``name[]`` filter (see :meth:`GpuCollector.describe`)."""
        for spec in KUBERNETES_METRICS:
            yield _family(spec)

    def collect(self) -> Iterator[Metric]:
        snapshot = self._cache.get()
        key = (self._allocations.version, snapshot.sequence)
        with self._lock:
            if self._built is None or self._built[0] != key:
                self._built = (key, self._families(snapshot.gpus))
            families = self._built[1]
        return iter(families)

    def _families(self, gpus: tuple[GpuSample, ...]) -> list[Metric]:
        info = _family(GPU_POD_INFO)
        seen: set[tuple[str, ...]] = set()
        for gpu, device in resolve(self._allocations.devices, gpus):
            # A device this host does not know still names its pod: gpu="" and the ID.
            ids = [str(gpu.index), gpu.uuid] if gpu else ["", physical_id(device.device_id)]
            labels = (*ids, device.namespace, device.pod, device.container)
            if labels not in seen:  # two replicas of one card in one container: one series
                seen.add(labels)
                info.add_metric(list(labels), 1)
        up = _one(KUBERNETES_UP, 1 if self._allocations.up else 0)
        return [f for f in (info, up, self._processes(gpus)) if f.samples]

    def _processes(self, gpus: tuple[GpuSample, ...]) -> Metric:
        """``gpu_process_pod_info`` for the processes ``gpu_process_memory_used_bytes`` has
        (the same ``limit`` largest per device) whose pod the allocations name."""
        family = _family(GPU_PROCESS_POD_INFO)
        uids, containers = process_owners(self._allocations.devices, gpus)
        if not uids and not containers:
            return family
        for gpu in all_devices(gpus):
            for p in _largest_processes(gpu, self._limit):
                container = containers.get(p.container or "")
                pod = container[:2] if container else uids.get(p.pod or "")
                if pod is not None:
                    name = container[2] if container and container[:2] == pod else ""
                    family.add_metric([str(gpu.index), gpu.uuid, str(p.pid), *pod, name], 1)
        return family
