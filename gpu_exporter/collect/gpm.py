"""GPM (GPU Performance Monitoring, Hopper and later): two samples per device, one
``--gpm-interval`` apart, and the metrics between them.

NVML's utilization says only whether a kernel ran; GPM says how much of the card worked (SM
activity, occupancy, tensor and FP pipes, DRAM bandwidth, PCIe and NVLink traffic). It needs
two samples of a device's counters: :class:`GpmReader` keeps the previous one per device (a
whole GPU, or a MIG GPU instance read through its parent) and swaps two native buffers, so
each read costs one ``nvmlGpmSampleGet`` and one ``nvmlGpmMetricsGet`` (0.6-0.7 ms and 4.4-5.4
ms on a real H100, docs/real-gpu.md): hence its own cadence, not every sample. Between two
reads the last metrics stay; the first read of a device has none yet (absent, never 0).

The sampler calls :meth:`GpmReader.read` inside a GPU's step, so a hung GPM call is under the
same watchdog as every other call of that GPU. Buffers are freed when a device is lost
(:meth:`GpmReader.forget`), when NVML is initialised again and on shutdown
(:meth:`GpmReader.close`), never while a stuck call may still be using them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gpu_exporter.nvml import GpuLost, Nvml, NvmlError, NvmlUnavailable, Unsupported

log = logging.getLogger(__name__)

DEFAULT_GPM_INTERVAL_SECONDS = 5.0
# nvml.h: two samples of a device should be over 100 ms apart (the counters' refresh rate).
MIN_GPM_INTERVAL_SECONDS = 0.1
# A device: (GPU index, MIG GPU instance id or None for the whole GPU).
Key = tuple[int, "int | None"]


@dataclass(slots=True, eq=False)
class _GpmDevice:
    """One device's two buffers: ``older`` holds the last sample (taken at ``taken_at``,
    None before the first), ``spare`` is filled next; ``values`` the last metrics."""

    older: Any
    spare: Any
    taken_at: float | None = None
    due_at: float = 0.0  # when the next read is due (taken_at + the interval, less tolerance)
    values: dict[str, float] = field(default_factory=dict)


class GpmReader:
    """The GPM state of every device: support per GPU, buffers and last metrics per device."""

    def __init__(
        self, interval_seconds: float = DEFAULT_GPM_INTERVAL_SECONDS, tolerance_seconds: float = 0.0
    ) -> None:
        self.interval_seconds = interval_seconds
        # Read half a sampler interval early rather than one late: jitter must not stretch it.
        self.tolerance_seconds = tolerance_seconds
        self._supported: dict[tuple[int, str], bool] = {}  # (index, GPU uuid) → GPM answers
        self._devices: dict[Key, _GpmDevice] = {}
        self._failed: set[Key] = set()  # MIG instances whose GPM said NOT_SUPPORTED
        self._split: set[int] = set()  # GPUs with MIG instances read last time

    def read(
        self,
        nvml: Nvml,
        index: int,
        handle: Any,
        uuid: str,
        instances: Iterable[int],
        now: float,
    ) -> tuple[bool | None, dict[int | None, dict[str, float]]]:
        """Whether GPU ``index`` has GPM (None: the question failed; asked again next time),
        and the metrics of it (key None) and of each MIG GPU instance id in ``instances``:
        read now if due, else the last ones. Raises only GpuLost and NvmlUnavailable."""
        known = self._supported.get((index, uuid))
        if known is None:
            try:
                known = nvml.gpm_supported(handle)
            except (GpuLost, NvmlUnavailable):
                raise
            except Unsupported:
                known = False
            except NvmlError as exc:
                log.debug("GPM support of GPU %s: %s", uuid, exc)
                return None, {}
            self.forget(nvml, index)  # another GPU at this index: start afresh
            self._supported = {k: v for k, v in self._supported.items() if k[0] != index}
            self._supported[(index, uuid)] = known
        if not known:
            return False, {}
        wanted: list[int | None] = [None, *instances]
        if len(wanted) > 1 or index in self._split:  # MIG: instances may come and go
            for key in [k for k in self._devices if k[0] == index and k[1] not in wanted]:
                self._free(nvml, key)  # a MIG instance that is gone
            if len(wanted) > 1:
                self._split.add(index)
            else:
                self._split.discard(index)
        out: dict[int | None, dict[str, float]] = {}
        for instance in wanted:
            key = (index, instance)
            if key in self._failed:
                continue
            device = self._devices.get(key)  # not due: its last metrics, nothing called
            if device is not None and device.taken_at is not None and now < device.due_at:
                out[instance] = device.values
            else:
                out[instance] = self._read_device(nvml, key, handle, now)
        return True, out

    def _read_device(self, nvml: Nvml, key: Key, handle: Any, now: float) -> dict[str, float]:
        device = self._devices.get(key)
        due = self.interval_seconds - self.tolerance_seconds
        if device is not None and device.taken_at is not None and now < device.due_at:
            return device.values
        try:
            if device is None:
                device = self._devices[key] = _GpmDevice(*self._alloc_pair(nvml))
            if device.taken_at is None:  # the first sample: no metrics until the next
                nvml.gpm_sample_get(handle, device.older, key[1])
                device.taken_at, device.due_at, device.values = now, now + due, {}
                return device.values
            nvml.gpm_sample_get(handle, device.spare, key[1])
            device.older, device.spare = device.spare, device.older
            device.taken_at, device.due_at = now, now + due
            device.values = nvml.gpm_metrics(device.spare, device.older)
        except (GpuLost, NvmlUnavailable):
            raise
        except Unsupported as exc:  # a MIG instance GPM cannot sample: not asked again
            log.info("GPM of device %s cannot be sampled (%s); not asking again", key, exc)
            self._failed.add(key)
            self._free(nvml, key)
            return {}
        except NvmlError as exc:  # this device, this time: absent, and sampled afresh
            log.debug("GPM of device %s: %s", key, exc)
            if device is not None:
                device.taken_at, device.values = None, {}
            return {}
        return device.values

    @staticmethod
    def _alloc_pair(nvml: Nvml) -> tuple[Any, Any]:
        first = nvml.gpm_sample_alloc()
        try:
            return first, nvml.gpm_sample_alloc()
        except NvmlError:
            with contextlib.suppress(NvmlError):
                nvml.gpm_sample_free(first)
            raise

    def forget(self, nvml: Nvml, index: int) -> None:
        """GPU ``index`` is lost (or gone): free its devices' buffers, ask its support again."""
        for key in [k for k in self._devices if k[0] == index]:
            self._free(nvml, key)
        self._failed = {k for k in self._failed if k[0] != index}
        self._split.discard(index)
        self._supported = {k: v for k, v in self._supported.items() if k[0] != index}

    def close(self, nvml: Nvml, keep: Iterable[int] = ()) -> None:
        """Free every buffer but those of the GPUs in ``keep`` (a call of theirs is stuck and
        may still be writing to one); forget what is known (NVML is shutting down or was
        initialised again)."""
        kept = set(keep)
        for key in [k for k in self._devices if k[0] not in kept]:
            self._free(nvml, key)
        self._failed.clear()
        self._split.clear()
        self._supported.clear()

    def buffers(self) -> int:
        """Sample buffers held now (two per device read)."""
        return sum((d.older is not None) + (d.spare is not None) for d in self._devices.values())

    def _free(self, nvml: Nvml, key: Key) -> None:
        device = self._devices.pop(key, None)
        if device is None:
            return
        for sample in (device.older, device.spare):
            if sample is not None:
                with contextlib.suppress(NvmlError):
                    nvml.gpm_sample_free(sample)
