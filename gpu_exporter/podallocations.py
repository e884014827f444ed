"""Which Kubernetes container the kubelet gave each GPU: :class:`PodDevice` and the
:class:`PodAllocations` the ``--kubernetes`` poller publishes and the rest reads.

Vocabulary only (no I/O): :mod:`gpu_exporter.collect.kubelet` fills a :class:`PodAllocations`
from the kubelet's PodResources API every 10 s; ``gpu_pod_info``
(:class:`~gpu_exporter.export.collectors.PodCollector`) and ``/choose`` (through a callable
:func:`gpu_exporter.daemon.build` injects) read it.

Device IDs are what the NVIDIA device plugin hands the kubelet: a GPU's UUID (``GPU-…``), a
MIG device's UUID (``MIG-…``), either with a time-slicing replica suffix (``GPU-…::3``), or,
with the plugin's ``deviceIDStrategy=index``, the GPU's index (``"0"``). :func:`resolve`
names the device of the snapshot each one means.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpu_exporter.model import GpuSample, all_devices

NVIDIA_RESOURCES = "nvidia.com/"  # nvidia.com/gpu, nvidia.com/mig-1g.10gb, nvidia.com/gpu.shared
REPLICA_SEPARATOR = "::"  # the device plugin's time-slicing replicas: GPU-<uuid>::<n>


@dataclass(frozen=True, slots=True)
class PodDevice:
    """One device the kubelet allocated to one container (its ID as the kubelet lists it)."""

    namespace: str
    pod: str
    container: str
    resource: str  # e.g. nvidia.com/gpu, nvidia.com/mig-1g.10gb
    device_id: str

    @property
    def pod_ref(self) -> str:
        """``namespace/pod``, as ``kubectl`` names a pod."""
        return f"{self.namespace}/{self.pod}"


def physical_id(device_id: str) -> str:
    """The device behind a time-slicing replica ID; other IDs unchanged.

    >>> physical_id("GPU-5a1e0000-0000-4000-8000-c0ffee000000::3")
    'GPU-5a1e0000-0000-4000-8000-c0ffee000000'
    >>> physical_id("MIG-abc")
    'MIG-abc'
    """
    return device_id.split(REPLICA_SEPARATOR, 1)[0]


def resolve(
    devices: Iterable[PodDevice], gpus: tuple[GpuSample, ...]
) -> list[tuple[GpuSample | None, PodDevice]]:
    """Each allocated GPU device with the snapshot's GPU or MIG device it names (None: an
    NVIDIA device this host does not show); other devices (NICs, FPGAs …) are left out.

    A UUID (``GPU-…``, ``MIG-…``, replica suffix removed) names that device, whatever the
    resource is called; a plain number names the whole GPU of that NVML index, for an
    ``nvidia.com/…`` resource only (``deviceIDStrategy=index``).
    """
    by_uuid = {d.uuid: d for d in all_devices(gpus)}
    by_index = {str(g.index): g for g in gpus}
    out: list[tuple[GpuSample | None, PodDevice]] = []
    for device in devices:
        wanted = physical_id(device.device_id)
        nvidia = device.resource.startswith(NVIDIA_RESOURCES)
        gpu = by_uuid.get(wanted) or (by_index.get(wanted) if nvidia else None)
        if gpu is not None or nvidia:
            out.append((gpu, device))
    return out


def allocated_to(pods: set[str]) -> str:
    """Why a card the kubelet gave to pods is passed over, as ``/choose`` says it (on the host,
    and across the fleet from ``gpu_pod_info``).

    >>> allocated_to({"ml/train-0"}), allocated_to({"b/y", "a/x"})
    ('allocated to pod ml/train-0', 'allocated to pods a/x, b/y')
    """
    if len(pods) == 1:
        return f"allocated to pod {next(iter(pods))}"
    return f"allocated to pods {', '.join(sorted(pods))}"


def taken_reasons(devices: Iterable[PodDevice], gpus: tuple[GpuSample, ...]) -> dict[str, str]:
    """UUID → ``allocated to pod ns/name`` for every device of ``gpus`` a container holds;
    a time-sliced card several pods share names them all (``pods a/x, b/y``)."""
    holders: dict[str, set[str]] = {}
    for gpu, device in resolve(devices, gpus):
        if gpu is not None:
            holders.setdefault(gpu.uuid, set()).add(device.pod_ref)
    return {uuid: allocated_to(pods) for uuid, pods in holders.items()}


Owner = tuple[str, ...]  # (namespace, pod) or (namespace, pod, container)


def _infer(cards: list[tuple[set[Owner], set[str]]]) -> dict[str, Owner]:
    """Which owner each key (a cgroup's pod UID or container id) is, from the cards: the
    owners the kubelet gave each card and the keys of the processes running on it.

    A key is named when a card leaves exactly one unnamed owner and one unnamed key (a card
    one pod holds, or the last of a shared card's pods), repeated until nothing changes. A
    name that another card contradicts (its key on a card its owner was not given) is
    withdrawn and everything inferred again without that key.
    """
    excluded: set[str] = set()
    while True:
        named: dict[str, Owner] = {}
        changed = True
        while changed:
            changed = False
            for owners, keys in cards:
                owners_left = owners - set(named.values())
                keys_left = keys - named.keys() - excluded
                if len(owners_left) == 1 and len(keys_left) == 1:
                    named[keys_left.pop()] = owners_left.pop()
                    changed = True
        wrong = {k for owners, keys in cards for k in keys if k in named and named[k] not in owners}
        if not wrong:
            return named
        excluded |= wrong


def process_owners(
    devices: Iterable[PodDevice], gpus: tuple[GpuSample, ...]
) -> tuple[dict[str, Owner], dict[str, Owner]]:
    """(pod UID → (namespace, pod), container id → (namespace, pod, container)) for the
    processes' cgroup keys (``--process-labels=pod,container``), as far as the allocations
    determine them: the PodResources API names pods, never their UIDs or container ids, so a
    key is named only where a card's owners and processes pin it down (:func:`_infer`)."""
    pods: dict[str, set[Owner]] = {}
    containers: dict[str, set[Owner]] = {}
    for gpu, d in resolve(devices, gpus):
        if gpu is not None:
            pods.setdefault(gpu.uuid, set()).add((d.namespace, d.pod))
            containers.setdefault(gpu.uuid, set()).add((d.namespace, d.pod, d.container))
    held = [g for g in all_devices(gpus) if g.uuid in pods]
    return (
        _infer([(pods[g.uuid], {p.pod for p in g.processes or () if p.pod}) for g in held]),
        _infer(
            [
                (containers[g.uuid], {p.container for p in g.processes or () if p.container})
                for g in held
            ]
        ),
    )


class PodAllocations:
    """The kubelet's last answer, replaced whole (thread-safe), and whether it answers now.

    While the kubelet does not answer (``up`` False) the last answer is kept: a restarting
    kubelet does not free the GPUs its pods hold, so ``/choose`` keeps treating them as taken.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._devices: tuple[PodDevice, ...] = ()
        self._up = False
        self.version = 0  # bumped on every change of devices or up

    def publish(self, devices: Iterable[PodDevice]) -> None:
        """A successful ``List``: these devices are allocated now."""
        devices = tuple(devices)
        with self._lock:
            if devices != self._devices or not self._up:
                self._devices, self._up = devices, True
                self.version += 1

    def fail(self) -> None:
        """``List`` failed (socket missing, kubelet down, timeout, garbage)."""
        with self._lock:
            if self._up:
                self._up = False
                self.version += 1

    @property
    def up(self) -> bool:
        return self._up

    @property
    def devices(self) -> tuple[PodDevice, ...]:
        return self._devices

    def taken(self, gpus: tuple[GpuSample, ...]) -> Mapping[str, str]:
        """:func:`taken_reasons` of the last answer (what ``/choose`` must not hand out)."""
        return taken_reasons(self._devices, gpus)
