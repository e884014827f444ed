"""``gpu_pod_info`` and ``gpu_exporter_kubernetes_up`` (``--kubernetes``): the kubelet's
allocations as info series to join on, never as labels on the value series.

Registered, like the web-config collector, only when the flag is given; rendered on every
scrape after the cached snapshot part (``export/exposition.py``'s live collectors). The
families are built once per change of the allocations or of the sample, so a scrape only
hands the same objects to the encoder.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpu_exporter.collect.cache import SnapshotCache
from gpu_exporter.export.spec import GPU_POD_INFO, GPU_PROCESS_POD_INFO, KUBERNETES_UP, MetricSpec
from gpu_exporter.model import GpuSample, all_devices
from gpu_exporter.podallocations import PodAllocations, physical_id, process_owners, resolve


def _family(spec: MetricSpec) -> GaugeMetricFamily:
    return GaugeMetricFamily(spec.family_name, spec.exposed_help, labels=spec.labels)


class PodCollector(Collector):
    """The allocations of a :class:`~gpu_exporter.podallocations.PodAllocations`, GPU indexes
    from the snapshot cache's latest sample."""

    def __init__(
        self, allocations: PodAllocations, cache: SnapshotCache, process_series_limit: int = 64
    ) -> None:
        self._allocations = allocations
        self._cache = cache
        self._limit = process_series_limit
        self._lock = threading.Lock()
        self._built: tuple[tuple[int, int], list[Metric]] | None = None

    def describe(self) -> Iterator[Metric]:
        """The names, for the ``name[]`` filter (see ``GpuCollector.describe``)."""
        yield _family(GPU_POD_INFO)
        yield _family(KUBERNETES_UP)
        yield _family(GPU_PROCESS_POD_INFO)

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
        up = _family(KUBERNETES_UP)
        up.add_metric([], 1 if self._allocations.up else 0)
        return [f for f in (info, up, self._processes(gpus)) if f.samples]

    def _processes(self, gpus: tuple[GpuSample, ...]) -> Metric:
        """``gpu_process_pod_info`` for the processes ``gpu_process_memory_used_bytes`` has
        (the same ``limit`` largest per device) whose pod the allocations name."""
        family = _family(GPU_PROCESS_POD_INFO)
        uids, containers = process_owners(self._allocations.devices, gpus)
        if not uids and not containers:
            return family
        for gpu in all_devices(gpus):
            if gpu.mig_devices and not gpu.is_mig_device:
                continue  # a GPU in MIG mode has its processes under its MIG devices
            known = [p for p in gpu.processes or () if p.used_memory_bytes is not None]
            known.sort(key=lambda p: (-(p.used_memory_bytes or 0), p.pid))
            for p in known[: self._limit]:
                container = containers.get(p.container or "")
                pod = container[:2] if container else uids.get(p.pod or "")
                if pod is not None:
                    name = container[2] if container and container[:2] == pod else ""
                    family.add_metric([str(gpu.index), gpu.uuid, str(p.pid), *pod, name], 1)
        return family
