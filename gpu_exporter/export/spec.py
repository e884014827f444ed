"""The ``/metrics`` spec: one :class:`MetricSpec` per metric, and :data:`METRICS`, all of them.

Names, types, labels, help text, units, the NVML function behind each value and when it is
read. A GPU value's family is derived from its rows in :data:`gpu_exporter.readings.READINGS`
(:data:`GPU_VALUES`); the rest (identity, processes, NVLink per link, Xids, leases, the
exporter's own) are entries here. :mod:`gpu_exporter.export.collectors` builds the families
from it, and :mod:`gpu_exporter.export.readme` the README's metric table
(``scripts/generate_readme.py``); a test keeps the two equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypedDict

from gpu_exporter.collect.fields import FIELDS
from gpu_exporter.counters import (
    CHOOSE_RESULTS,
    REJECTION_REASONS,
    RELEASE_REASONS,
    RELOAD_RESULTS,
)
from gpu_exporter.model import PROCESS_LABELS, GpuSample
from gpu_exporter.readings import NVLINK_ERRORS, READINGS
from gpu_exporter.valuerow import CORE, FAST, ONCE, SAMPLED, Family, Reading

GPU_LABELS = ("gpu", "uuid")
ON = "yes"
AT_SCRAPE = "at scrape"
KUBELET = "every 10 s, own thread"  # --kubernetes: collect/kubelet.py

# (label values after gpu and uuid, value) pairs that one metric has for one device.
Values = Callable[[GpuSample], Iterable[tuple[tuple[str, ...], float]]]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # as exposed; counters end in _total
    type: str  # "gauge" or "counter"
    help: str
    labels: tuple[str, ...]
    source: str  # where the value comes from (the NVML function), for the docs
    field: str | None = None  # GpuSample attribute, for plain per-GPU values
    # For a metric with one extra label: (label value, GpuSample attribute) pairs.
    per_label: tuple[tuple[str, str], ...] = ()
    unit: str = ""  # for the docs: bytes, watts, ratio (0-1), 0/1 …
    default: str = ON  # "yes", or how to turn it on
    values: Values | None = None  # anything the two above cannot express
    mig: bool = False  # also exported for MIG devices (uuid="MIG-…")
    # A counter's closed label set (one label): every value is exported, at 0 until counted,
    # so rate() works on a fresh exporter. Taken from where the counting code names them.
    label_values: tuple[str, ...] = ()
    # More of the description, for the README only: # HELP is sent on every scrape.
    details: str = ""
    updated: str = FAST  # when the value is read: every sample, every --slow-interval, once …
    group: str = CORE  # the --collect.<group> that turns it off; "" for none

    @property
    def family_name(self) -> str:
        return self.name.removesuffix("_total") if self.type == "counter" else self.name

    @property
    def exposed_help(self) -> str:
        """The ``# HELP`` line: without the sampling sentence, which would repeat ~95 bytes
        in 30-odd families of every scrape (gpu_exporter_last_sample_timestamp_seconds and
        the README say it once)."""
        return self.help.removesuffix(SAMPLED)

    @property
    def on_by_default(self) -> bool:
        return self.default.startswith(ON)


class _When(TypedDict):
    updated: str
    group: str


def _read_as(field: str) -> _When:
    """When the values of this field of collect/fields.py are read: its cadence and group
    (the families of readings.READINGS take theirs from their rows)."""
    f = FIELDS[field]
    return {"updated": f.when, "group": f.group}


def _nvlink(attribute: str) -> Values:
    def values(gpu: GpuSample) -> Iterator[tuple[tuple[str, ...], float]]:
        for link in gpu.nvlink or ():
            value = getattr(link, attribute)
            if value is not None:
                yield (str(link.link),), float(value)

    return values


def _nvlink_errors(gpu: GpuSample) -> Iterator[tuple[tuple[str, ...], float]]:
    for link in gpu.nvlink or ():
        for error, value in zip(NVLINK_ERRORS, link.errors(), strict=True):
            if value is not None:
                yield (str(link.link), error), float(value)


GPU_INFO = MetricSpec(
    "gpu_info",
    "gauge",
    "Always 1; labels identify the GPU or MIG device (gpu is the NVML index, in PCI bus order; "
    "a MIG device has its parent's).",
    (*GPU_LABELS, "name", "pci_bus_id", "driver_version", "cuda_driver_version"),
    "nvmlDeviceGetName, nvmlDeviceGetPciInfo, nvmlSystemGetDriverVersion",
    unit="1 (info)",
    mig=True,
    updated=ONCE,
)
GPU_UP = MetricSpec(
    "gpu_up",
    "gauge",
    "1 if the GPU answered the last sample, 0 if it did not (lost, fallen off the bus); "
    "its value series are then absent." + SAMPLED,
    GPU_LABELS,
    "nvmlDeviceGetHandleByIndex and every value call",
    unit="0/1",
    mig=True,
)
GPU_LAST_SEEN = MetricSpec(
    "gpu_last_seen_timestamp_seconds",
    "gauge",
    "Unix time of the last sample in which the GPU answered (kept while it is down)." + SAMPLED,
    GPU_LABELS,
    "the exporter",
    unit="seconds",
    details="time() - this is how long it has been gone.",
)
GPU_DOWN_REASON = MetricSpec(
    "gpu_down_reason",
    "gauge",
    "1 while gpu_up is 0, with why: lost, timeout or error." + SAMPLED,
    (*GPU_LABELS, "reason"),
    "nvmlDeviceGetHandleByIndex and every value call",
    unit="1 (info)",
    details="lost: fell off the bus, needs a reset; timeout: an NVML call for it has not "
    "returned within --nvml-timeout.",
)
_NVLINK = (
    MetricSpec("gpu_nvlink_up", "gauge",
               "1 for each NVLink that is active, 0 for one that is not." + SAMPLED,
               (*GPU_LABELS, "link"), "nvmlDeviceGetFieldValues (NVML_FI_DEV_NVLINK_GET_STATE)",
               unit="0/1", values=_nvlink("active"), default="no: --collect.nvlink",
               **_read_as("nvlink"),
               details="Absent on cards without NVLink."),
    MetricSpec("gpu_nvlink_transmit_bytes_total", "counter",
               "Data sent over each NVLink (payload, without protocol overhead)." + SAMPLED,
               (*GPU_LABELS, "link"),
               "nvmlDeviceGetFieldValues (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX)",
               unit="bytes", values=_nvlink("transmit_bytes"), default="no: --collect.nvlink",
               **_read_as("nvlink"),
               details="Never goes backwards: a driver reset of the counter restarts it from "
               "the exported value. rate() gives bytes/second."),
    MetricSpec("gpu_nvlink_receive_bytes_total", "counter",
               "Data received over each NVLink (payload, without protocol overhead)." + SAMPLED,
               (*GPU_LABELS, "link"),
               "nvmlDeviceGetFieldValues (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)",
               unit="bytes", values=_nvlink("receive_bytes"), default="no: --collect.nvlink",
               **_read_as("nvlink")),
    MetricSpec("gpu_nvlink_errors_total", "counter",
               "NVLink errors per link: crc_flit (flow-control CRC), crc_data, replay, "
               "recovery." + SAMPLED,
               (*GPU_LABELS, "link", "error"),
               "nvmlDeviceGetFieldValues (NVML_FI_DEV_NVLINK_*_ERROR_COUNT_TOTAL)",
               unit="errors", values=_nvlink_errors, default="no: --collect.nvlink",
               **_read_as("nvlink"),
               details="Summed over the link's lanes; never goes backwards (as the byte "
               "counters)."),
)  # fmt: skip


def _source(rows: list[Reading]) -> str:
    """Where the rows' values come from, for the docs: their field values, else getters."""
    getters = list(dict.fromkeys(r.getter for r in rows if r.getter))
    ids = [i.removeprefix("NVML_FI_DEV_") for r in rows for i in r.fields]
    if not ids:
        return ", ".join(getters)
    fields = f"nvmlDeviceGetFieldValues (NVML_FI_DEV_{'/'.join(ids)})"
    return f"{fields}, else {', '.join(getters)}" if getters else fields


def _values_of(rows: list[Reading]) -> Values:
    """Each row's value with its label values (or its series), where the value is there."""

    def values(gpu: GpuSample) -> Iterator[tuple[tuple[str, ...], float]]:
        for r in rows:
            value = getattr(gpu, r.attribute)
            if value is None:
                continue
            if r.series is not None:
                yield from r.series(value)
            else:
                yield tuple(v for _, v in r.labels), float(value)

    return values


def _spec(family: Family, rows: list[Reading]) -> MetricSpec:
    """A family of readings.READINGS as the exposition and the README have it."""
    labels = tuple(name for name, _ in rows[0].labels)
    whens = [r.when for r in rows]
    each = "; ".join(f"{r.labels[0][1]}: {r.when}" for r in rows if r.labels)
    updated = whens[0] if len(set(whens)) == 1 else each
    field, values = None, None
    per_label: tuple[tuple[str, str], ...] = ()
    if rows[0].series is None and not labels:
        field = rows[0].attribute
    elif rows[0].series is None and len(labels) == 1:
        per_label = tuple((r.labels[0][1], r.attribute) for r in rows)
    else:
        values = _values_of(rows)
    return MetricSpec(
        family.name, family.type, family.help + SAMPLED, (*GPU_LABELS, *labels),
        family.source or _source(rows), field, per_label, family.unit, family.default, values,
        family.mig, details=family.details, updated=updated, group=rows[0].group,
    )  # fmt: skip


def _gpu_values() -> tuple[MetricSpec, ...]:
    """Every family of readings.READINGS in table order, NVLink's (code) where its row is."""
    families: dict[Family, list[Reading]] = {}
    out: list[MetricSpec | Family] = []
    for r in READINGS:
        if r.attribute == "nvlink":
            out.extend(_NVLINK)
        elif r.family is not None:
            if r.family not in families:
                out.append(r.family)
            families.setdefault(r.family, []).append(r)
    return tuple(x if isinstance(x, MetricSpec) else _spec(x, families[x]) for x in out)


# One GPU or MIG device value per family of readings.READINGS, and NVLink's.
GPU_VALUES: tuple[MetricSpec, ...] = _gpu_values()
GPM_VALUES = tuple(spec for spec in GPU_VALUES if spec.group == "gpm")
GPU_MIG_INFO = MetricSpec(
    "gpu_mig_info",
    "gauge",
    "Always 1 for each MIG device (uuid MIG-…): its parent GPU, instances and profile." + SAMPLED,
    (*GPU_LABELS, "parent_uuid", "gpu_instance_id", "compute_instance_id", "profile"),
    "nvmlDeviceGetMigDeviceHandleByIndex, nvmlDeviceGetGpuInstanceId, "
    "nvmlDeviceGetComputeInstanceId, nvmlDeviceGetName",
    unit="1 (info)",
    details="Whole-card queries leave MIG devices out with `unless on(uuid) gpu_mig_info`.",
)
PROCESS_MEMORY = MetricSpec(
    "gpu_process_memory_used_bytes",
    "gauge",
    "Memory used by one compute process on a GPU or MIG device." + SAMPLED,
    (*GPU_LABELS, "pid", *PROCESS_LABELS),
    "nvmlDeviceGetComputeRunningProcesses, /proc/<pid>/{status,cmdline,cgroup}",
    unit="bytes",
    default="yes; user, command, container, slurm_job, pod labels only with --process-labels",
    details="At most --process-series-limit per device, largest first; memory of processes in "
    "other PID namespaces is in gpu_memory_used_bytes but not here.",
    **_read_as("processes"),
)


def _process_ratio(name: str, help: str) -> MetricSpec:
    """A per-process utilization, with gpu_process_memory_used_bytes' labels and cap."""
    return MetricSpec(
        name,
        "gauge",
        help + SAMPLED,
        PROCESS_MEMORY.labels,
        "nvmlDeviceGetProcessUtilization",
        unit="ratio",
        default=PROCESS_MEMORY.default,
        details="The processes of gpu_process_memory_used_bytes (the same cap); 0 for a "
        "process NVML has no sample of (it lists only those that used the card); absent where "
        "NVML cannot say (MIG).",
        **_read_as("process_utilization"),
    )


PROCESS_SM_UTILIZATION = _process_ratio(
    "gpu_process_sm_utilization_ratio",
    "Share of the driver's last sample period (0-1) in which this process had kernels on the SMs.",
)
PROCESS_MEMORY_UTILIZATION = _process_ratio(
    "gpu_process_memory_utilization_ratio",
    "Share of the driver's last sample period (0-1) in which this process read or wrote "
    "device memory.",
)
XID_ERRORS = MetricSpec(
    "gpu_xid_errors_total",
    "counter",
    "Critical Xid errors reported by the driver, by Xid code, since the exporter started.",
    (*GPU_LABELS, "xid"),
    "nvmlEventSetWait_v2 (nvmlEventTypeXidCriticalError)",
    unit="errors",
    details="79: fallen off the bus, 48: double-bit ECC, 13/31/43: application faults …",
    updated="on event",
    group="xid",
)
LAST_XID = MetricSpec(
    "gpu_last_xid_timestamp_seconds",
    "gauge",
    "Unix time at which the last Xid error of this GPU was received (absent until one is).",
    GPU_LABELS,
    "nvmlEventSetWait_v2",
    unit="seconds",
    updated="on event",
    group="xid",
)
PCIE_THROUGHPUT = MetricSpec(
    "gpu_pcie_throughput_bytes_per_second",
    "gauge",
    "PCIe traffic by direction (tx: from the GPU, rx: to it), measured by NVML over 20 ms "
    "on its own thread every --interval.",
    (*GPU_LABELS, "direction"),
    "nvmlDeviceGetPcieThroughput",
    unit="bytes/second",
    default="no: --collect.pcie-throughput",
    updated="every --interval, own thread",
)
GPU_LEASED = MetricSpec(
    "gpu_leased",
    "gauge",
    "1 while a /choose lease holds the GPU or MIG device, else 0.",
    GPU_LABELS,
    "the lease table",
    unit="0/1",
    updated=AT_SCRAPE,
)
GPU_MEMORY_LEASED = MetricSpec(
    "gpu_memory_leased_bytes",
    "gauge",
    "Memory reserved on the card by memory leases (/choose?mem=).",
    GPU_LABELS,
    "the lease table",
    unit="bytes",
    default="on cards holding memory leases",
    details="Absent on cards without memory leases. A card holding memory leases is never "
    "handed out whole.",
)
GPU_LEASE_MEMORY_OVERRUN = MetricSpec(
    "gpu_lease_memory_overrun_bytes",
    "gauge",
    "Memory the card's memory leases' processes use beyond their reservations.",
    GPU_LABELS,
    "the lease table, nvmlDeviceGetComputeRunningProcesses",
    unit="bytes",
    default="on cards holding memory leases",
    details="Σ over the card's memory leases of max(0, used by the processes attributed to "
    "the lease − reserved). The exporter never kills a process: the GpuLeaseMemoryOverrun "
    "alert tells people instead.",
)
BUILD_INFO = MetricSpec(
    "gpu_exporter_build_info",
    "gauge",
    "Always 1; the exporter's version, backend and source revision.",
    ("version", "backend", "revision"),
    "the exporter",
    unit="1 (info)",
    details='With --simulate, backend="simulated"; revision is "unknown" where none was recorded.',
    updated=ONCE,
)
NVML_UP = MetricSpec(
    "gpu_exporter_nvml_up",
    "gauge",
    "1 if NVML is initialised and answering, 0 if not (no driver, version mismatch); "
    "initialisation is retried with backoff.",
    (),
    "nvmlInit",
    unit="0/1",
)
LAST_SAMPLE = MetricSpec(
    "gpu_exporter_last_sample_timestamp_seconds",
    "gauge",
    "Unix time at which the sample behind every gpu_* value was taken.",
    (),
    "the exporter",
    unit="seconds",
)
SAMPLE_DURATION = MetricSpec(
    "gpu_exporter_sample_duration_seconds",
    "gauge",
    "How long the last sample of all GPUs took.",
    (),
    "the exporter",
    unit="seconds",
)
NVML_ERRORS = MetricSpec(
    "gpu_exporter_nvml_errors_total",
    "counter",
    "NVML calls that failed, by function and NVML error name (unsupported fields not counted).",
    ("function", "error"),
    "every NVML call",
    unit="calls",
)
FIELD_SUPPORTED = MetricSpec(
    "gpu_exporter_field_supported",
    "gauge",
    "0 for each field NVML does not report for this GPU or MIG device; supported ones have no "
    "series.",
    (*GPU_LABELS, "field"),
    "every NVML value call",
    unit="0 (unsupported)",
    details="NVML answered NOT_SUPPORTED or FUNCTION_NOT_FOUND (asked once per "
    "initialisation); /gpus lists the same fields as unsupported_fields.",
)
CHOOSE_REQUESTS = MetricSpec(
    "gpu_exporter_choose_requests_total",
    "counter",
    "/choose requests by result: ok, or the error code.",
    ("result",),
    "the exporter",
    unit="requests",
    label_values=CHOOSE_RESULTS,
    updated=AT_SCRAPE,
)
LEASES_DROPPED = MetricSpec(
    "gpu_exporter_lease_gpus_released_total",
    "counter",
    "GPUs released from leases before expiry, by reason.",
    ("reason",),
    "the lease table",
    unit="GPUs",
    details="Reasons: arrived (the job showed up), down, gone, not_on_this_host (restored "
    "from --state-dir for a GPU this host does not have).",
    label_values=RELEASE_REASONS,
    updated=AT_SCRAPE,
)
STATE_WRITE_ERRORS = MetricSpec(
    "gpu_exporter_state_write_errors_total",
    "counter",
    "Writes of <--state-dir>/leases.json that failed.",
    (),
    "the lease table",
    unit="writes",
    details="While they fail (full or read-only file system), /choose claims nothing (503 "
    "state_unwritable) and /readyz is 503.",
    updated=AT_SCRAPE,
)
GPUS_WITHHELD = MetricSpec(
    "gpu_exporter_gpus_withheld",
    "gauge",
    "GPUs and MIG devices no claim may get because a leases.json that could not be trusted "
    "may have leased them.",
    (),
    "the lease table",
    unit="devices",
    details="A leases.json that was set aside (leases.corrupt) or held malformed entries "
    "could have leased them: they are refused until its longest lease could have ended "
    "(--max-lease after the file last changed, at most --max-lease after the start), or a "
    "start with --discard-leases. The status page and /choose's refusals say for how long.",
    updated=AT_SCRAPE,
)
REQUESTS_REJECTED = MetricSpec(
    "gpu_exporter_requests_rejected_total",
    "counter",
    "Requests refused by the request limits, by reason.",
    ("reason",),
    "the exporter",
    unit="requests",
    details="Reasons: too_many_requests (--max-requests-in-flight), too_many_waiters "
    "(--max-waiters, --max-waiters-per-requester), uri_too_long; and before checking a "
    "password: auth_throttled (429: too many failed logins from that address), auth_busy "
    "(503: every bcrypt slot busy); too_many_connections (every connection at the connection "
    "cap busy with a request).",
    label_values=REJECTION_REASONS,
    updated=AT_SCRAPE,
)
CHOOSE_WAITERS = MetricSpec(
    "gpu_exporter_choose_waiters",
    "gauge",
    "Requests waiting for GPUs now (/choose and /cluster/choose with wait=), each in one "
    "--max-waiters slot.",
    (),
    "the exporter",
    unit="requests",
    updated=AT_SCRAPE,
)
WEB_CONFIG_RELOADS = MetricSpec(
    "gpu_exporter_web_config_reloads_total",
    "counter",
    "Re-reads of a changed --web-config-file by result: success, or error (broken, missing, "
    "empty, or protecting less than the configuration in force, which stays). Absent "
    "without --web-config-file.",
    ("result",),
    "the exporter",
    unit="reloads",
    default="with --web-config-file",
    label_values=RELOAD_RESULTS,
    updated=AT_SCRAPE,
)
WEB_CONFIG_OK = MetricSpec(
    "gpu_exporter_web_config_last_reload_successful",
    "gauge",
    "1 if the last re-read of --web-config-file worked (or there was none yet), 0 if it was "
    "refused and an older configuration is in force. Absent without --web-config-file.",
    (),
    "the exporter",
    unit="0/1",
    default="with --web-config-file",
    updated=AT_SCRAPE,
)
GPU_POD_INFO = MetricSpec(
    "gpu_pod_info",
    "gauge",
    "Always 1 for each GPU or MIG device the kubelet allocated to a Kubernetes container; "
    "asked of the kubelet every 10 s on its own thread.",
    (*GPU_LABELS, "namespace", "pod", "container"),
    "kubelet PodResources v1 List",
    unit="1 (info)",
    default="with --kubernetes",
    details="For joins, on the left: `gpu_pod_info * on(instance, uuid) group_left "
    "gpu_memory_used_bytes`. A time-sliced card has one series per container sharing it "
    '(replica IDs `GPU-…::N` are the card); a device this host does not know has `gpu=""`.',
    updated=KUBELET,
)
KUBERNETES_UP = MetricSpec(
    "gpu_exporter_kubernetes_up",
    "gauge",
    "1 if the kubelet's PodResources API answered the last List, 0 if not (gpu_pod_info then "
    "shows its last answer).",
    (),
    "kubelet PodResources v1 List",
    unit="0/1",
    default="with --kubernetes",
    updated=KUBELET,
)
GPU_PROCESS_POD_INFO = MetricSpec(
    "gpu_process_pod_info",
    "gauge",
    "Always 1 for a GPU process whose pod (and container) the kubelet's allocations name; "
    "asked of the kubelet every 10 s on its own thread.",
    (*GPU_LABELS, "pid", "namespace", "pod", "container"),
    "kubelet PodResources v1 List, /proc/<pid>/cgroup",
    unit="1 (info)",
    default="with --kubernetes and --process-labels=pod (container names: and container)",
    details="For `gpu_process_memory_used_bytes * on(instance, uuid, pid) "
    "group_left(namespace, pod, container) gpu_process_pod_info`. The API names pods, not "
    "their UIDs: a cgroup's pod UID is named where a card's pods and processes pin it down "
    '(a card one pod holds, or the last unnamed pod of a shared one); `container` is "" '
    "where only the pod is known. At most --process-series-limit per device, largest first.",
    updated=KUBELET + "; processes every sample",
    group="processes",
)
KUBERNETES_METRICS = (GPU_POD_INFO, KUBERNETES_UP, GPU_PROCESS_POD_INFO)  # PodCollector's
EXPORTER_METRICS = (
    BUILD_INFO,
    NVML_UP,
    LAST_SAMPLE,
    SAMPLE_DURATION,
    NVML_ERRORS,
    FIELD_SUPPORTED,
    CHOOSE_REQUESTS,
    LEASES_DROPPED,
    STATE_WRITE_ERRORS,
    GPUS_WITHHELD,
    REQUESTS_REJECTED,
    CHOOSE_WAITERS,
    WEB_CONFIG_RELOADS,
    WEB_CONFIG_OK,
    KUBERNETES_UP,
)
METRICS: tuple[MetricSpec, ...] = (
    GPU_INFO,
    GPU_UP,
    GPU_DOWN_REASON,
    GPU_LAST_SEEN,
    *GPU_VALUES,
    GPU_MIG_INFO,
    PROCESS_MEMORY,
    PROCESS_SM_UTILIZATION,
    PROCESS_MEMORY_UTILIZATION,
    XID_ERRORS,
    LAST_XID,
    PCIE_THROUGHPUT,
    GPU_LEASED,
    GPU_POD_INFO,
    GPU_PROCESS_POD_INFO,
    GPU_MEMORY_LEASED,
    GPU_LEASE_MEMORY_OVERRUN,
    *EXPORTER_METRICS,
)
