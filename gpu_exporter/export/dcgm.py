"""dcgm-exporter's names (``--metric-names=dcgm|both``): one :class:`DcgmMetric` per name, in
:data:`DCGM_METRICS`, served from the same snapshot as gpu-exporter's own names.

Each row says what dcgm-exporter says of the name (type and ``# HELP``, word for word from
its ``etc/default-counters.csv``) and which gpu-exporter value it converts (a
:class:`~gpu_exporter.model.GpuSample` field, so the :mod:`~gpu_exporter.export.spec` metric
behind it is found, not restated) and how (:class:`Conversion`: MiB, %, mJ, MHz).
``docs/dcgm-compat.md`` has every name dcgm-exporter has and what gpu-exporter gives for it.

Every series carries dcgm-exporter's labels: ``gpu``, ``UUID``, ``pci_bus_id``, ``device``
(``nvidia<gpu>``), ``modelName``, on MIG devices ``GPU_I_PROFILE`` and ``GPU_I_ID`` (the
parent's ``gpu``, ``UUID``, bus id and model, as dcgm-exporter has them), both ``Hostname``
(its releases to 4.5.3) and ``hostname`` (its main branch since #655), and
``DCGM_FI_DRIVER_VERSION``; with ``--kubernetes``, ``container``, ``namespace`` and ``pod``
on the series of a device the kubelet gave to a container (one series per container on a
shared card, as its ``--kubernetes-virtual-gpus``). A value the device does not report has no
series, as dcgm-exporter skips DCGM's blank values.

The text is written here, not by prometheus_client, because dcgm-exporter's counters have no
``_total``: prometheus_client would name their ``# TYPE`` line ``…_total`` and the samples not.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from gpu_exporter.collect.cache import SnapshotCache
from gpu_exporter.counters import XidCounter
from gpu_exporter.export.spec import GPU_VALUES, MetricSpec
from gpu_exporter.model import GpuSample, Snapshot
from gpu_exporter.podallocations import PodAllocations, resolve
from gpu_exporter.readings import READINGS
from gpu_exporter.valuerow import COUNT, GAUGE, Conversion

HOSTNAME_LABELS = ("Hostname", "hostname")  # dcgm-exporter ≤ 4.5.3, and since its #655
XID_NO_ERROR = "No Error"  # dcgm-exporter's err_msg for Xid 0 (none since start)


@dataclass(frozen=True, slots=True)
class DcgmMetric:
    """One dcgm-exporter name: its type and help, and the gpu-exporter value behind it."""

    name: str
    type: str  # dcgm-exporter's: gauge or counter (without _total)
    help: str  # dcgm-exporter's, word for word
    field: str | None  # the GpuSample field it converts; None: the Xid listener's last Xid
    conversion: Conversion

    @property
    def spec(self) -> MetricSpec | None:
        """The gpu-exporter metric that serves the same value (None for the Xid row)."""
        return None if self.field is None else SPEC_OF_FIELD[self.field]


def _fields(spec: MetricSpec) -> tuple[str, ...]:
    return (*((spec.field,) if spec.field else ()), *(field for _, field in spec.per_label))


SPEC_OF_FIELD = {field: spec for spec in GPU_VALUES for field in _fields(spec)}

# Every name of readings.READINGS' rows (dcgm-exporter's default counter set, and the
# DCGM_FI_PROF_* names its etc/dcp-metrics-included.csv has that GPM gives: Hopper and later,
# absent on older cards, as DCGM's profiling fields are where DCGM cannot read them), and the
# last Xid, which the Xid listener counts.
DCGM_METRICS: tuple[DcgmMetric, ...] = (
    *(
        DcgmMetric(r.dcgm.name, r.dcgm.type, r.dcgm.help, r.attribute, r.dcgm.conversion)
        for r in READINGS
        if r.dcgm is not None
    ),
    DcgmMetric("DCGM_FI_DEV_XID_ERRORS", GAUGE, "Value of the last XID error encountered.",
               None, COUNT),
)  # fmt: skip
XID_ROW = next(m for m in DCGM_METRICS if m.field is None)
SAMPLED_ROWS = tuple(m for m in DCGM_METRICS if m.field is not None)
# The gpu-exporter families a DCGM name replaces: --metric-names=dcgm serves them only under
# DCGM's name; every other family (gpu_up, Xids, ECC, leases, gpu_exporter_*) keeps its own.
REPLACED = frozenset(m.spec.name for m in SAMPLED_ROWS if m.spec is not None)


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _series(name: str, labels: Iterable[tuple[str, str]], value: float) -> str:
    text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return f"{name}{{{text}}} {floatToGoString(value)}\n"  # type: ignore[no-untyped-call]


def _head(metric: DcgmMetric) -> str:
    return f"# HELP {metric.name} {metric.help}\n# TYPE {metric.name} {metric.type}\n"


Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class _Device:
    """One GPU or MIG device as dcgm-exporter labels it, and the pods' labels on it."""

    sample: GpuSample
    labels: Labels  # gpu … DCGM_FI_DRIVER_VERSION
    holders: tuple[Labels, ...]  # (container, namespace, pod) per container; () for none

    def each(self) -> Iterator[Labels]:
        """The label sets of this device's series: one per holder, or one without pods."""
        if not self.holders:
            yield self.labels
        for holder in self.holders:
            yield self.labels + holder


class DcgmCollector(Collector):
    """dcgm-exporter's families over the snapshot cache (and the Xid listener, the kubelet).

    :meth:`render_snapshot` is the part :mod:`gpu_exporter.export.exposition` renders once
    per snapshot and :attr:`version` of the kubelet's allocations; :meth:`render_live`
    (the last Xid) is rendered on every scrape. :meth:`collect` serves the same values to
    prometheus_client for ``/metrics?name[]=`` (whose text format names a counter's
    ``# TYPE`` line ``…_total``).
    """

    def __init__(
        self,
        cache: SnapshotCache,
        hostname: str,
        *,
        xids: XidCounter | None = None,
        pods: PodAllocations | None = None,
    ) -> None:
        self._cache = cache
        self._hostname = hostname
        self._xids = xids
        self._pods = pods
        self._lock = threading.Lock()
        self._devices: tuple[tuple[int, int], tuple[_Device, ...]] | None = None

    @property
    def version(self) -> int:
        """Changes whenever the kubelet's allocations do (what the snapshot part reads
        besides the snapshot)."""
        return self._pods.version if self._pods is not None else 0

    def devices(self, snapshot: Snapshot) -> tuple[_Device, ...]:
        """Every GPU and MIG device with its labels, built once per snapshot and allocation."""
        key = (snapshot.sequence, self.version)
        with self._lock:
            if self._devices is None or self._devices[0] != key:
                self._devices = (key, tuple(self._label(snapshot)))
            return self._devices[1]

    def _label(self, snapshot: Snapshot) -> Iterator[_Device]:
        holders: dict[str, list[Labels]] = {}
        if self._pods is not None:
            for gpu, pod in resolve(self._pods.devices, snapshot.gpus):
                if gpu is not None:
                    held = (
                        ("container", pod.container),
                        ("namespace", pod.namespace),
                        ("pod", pod.pod),
                    )
                    entry = holders.setdefault(gpu.uuid, [])
                    if held not in entry:  # two replicas of one card in one container
                        entry.append(held)
        hosts = tuple((label, self._hostname) for label in HOSTNAME_LABELS)
        driver = (("DCGM_FI_DRIVER_VERSION", snapshot.driver_version or ""),)
        for gpu in snapshot.gpus:
            card = (
                ("gpu", str(gpu.index)),
                ("UUID", gpu.uuid),
                ("pci_bus_id", gpu.pci_bus_id or ""),
                ("device", f"nvidia{gpu.index}"),
                ("modelName", gpu.name or ""),
            )
            yield _Device(gpu, card + hosts + driver, tuple(holders.get(gpu.uuid, ())))
            for mig in gpu.mig_devices:
                instance = (
                    ("GPU_I_PROFILE", mig.mig_profile or ""),
                    ("GPU_I_ID", "" if mig.gpu_instance_id is None else str(mig.gpu_instance_id)),
                )
                labels = card + instance + hosts + driver
                yield _Device(mig, labels, tuple(holders.get(mig.uuid, ())))

    def render_snapshot(self, snapshot: Snapshot) -> bytes:
        """Every sampled DCGM family of ``snapshot``, as text (both exposition formats)."""
        devices = self.devices(snapshot)
        out: list[str] = []
        for metric in SAMPLED_ROWS:
            lines = [_series(metric.name, labels, v) for labels, v in self._values(metric, devices)]
            if lines:
                out.append(_head(metric))
                out.extend(lines)
        return "".join(out).encode()

    def _values(
        self, metric: DcgmMetric, devices: tuple[_Device, ...]
    ) -> Iterator[tuple[Labels, float]]:
        spec = metric.spec
        if metric.field is None or spec is None:
            return
        for device in devices:
            if device.sample.is_mig_device and not spec.mig:
                continue
            value = getattr(device.sample, metric.field)
            if value is not None:
                converted = metric.conversion(float(value))
                for labels in device.each():
                    yield labels, converted

    def render_live(self, snapshot: Snapshot) -> bytes:
        """``DCGM_FI_DEV_XID_ERRORS``: each whole GPU's last Xid since start, 0 (err_code 0,
        "No Error", as dcgm-exporter) before any; absent without the Xid listener."""
        lines = [_series(XID_ROW.name, labels, v) for labels, v in self._xid(snapshot)]
        return (_head(XID_ROW) + "".join(lines)).encode() if lines else b""

    def _xid(self, snapshot: Snapshot) -> Iterator[tuple[Labels, float]]:
        if self._xids is None:
            return
        last = {x.uuid: x.xid for x in self._xids.last()}
        for device in self.devices(snapshot):
            if device.sample.is_mig_device or not device.sample.up:
                continue
            xid = last.get(device.sample.uuid, 0)
            error: Labels = (("err_code", str(xid)),)
            if xid == 0:
                error += (("err_msg", XID_NO_ERROR),)
            for labels in device.each():
                yield _sorted_tail(labels, error), float(xid)

    def describe(self) -> Iterator[Metric]:
        """The names, for the ``name[]`` filter (as GpuCollector's)."""
        for metric in DCGM_METRICS:
            yield Metric(metric.name, metric.help, metric.type)

    def collect(self) -> Iterator[Metric]:
        snapshot = self._cache.get()
        devices = self.devices(snapshot)
        for row in DCGM_METRICS:
            family = Metric(row.name, row.help, row.type)
            values = self._xid(snapshot) if row is XID_ROW else self._values(row, devices)
            for labels, value in values:
                family.samples.append(Sample(row.name, dict(labels), value))
            if family.samples:
                yield family


def _sorted_tail(labels: Labels, extra: Labels) -> Labels:
    """``extra`` among the pods' labels, in name order after the driver version, as
    dcgm-exporter writes its attributes (container, err_code, err_msg, namespace, pod)."""
    end = next(i for i, (k, _) in enumerate(labels) if k == "DCGM_FI_DRIVER_VERSION") + 1
    return labels[:end] + tuple(sorted(labels[end:] + extra))
