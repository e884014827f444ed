"""PCIe throughput (``--collect.pcie-throughput``), sampled on its own thread.

``nvmlDeviceGetPcieThroughput`` measures over a 20 ms window and blocks for it, per
direction and per GPU: 8 GPUs cost about 320 ms. Done in the main sampler, that would
slow every sample; here it runs once per interval on its own thread and publishes to a
:class:`~gpu_exporter.counters.PcieRates` that the collector reads. Unsupported GPUs are
remembered and not asked again; a lost GPU simply drops out until it answers again.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gpu_exporter.collect.background import NvmlThread
from gpu_exporter.counters import PcieRate, PcieRates
from gpu_exporter.nvml import Nvml, NvmlError, NvmlUnavailable, Unsupported

log = logging.getLogger(__name__)


class PcieThroughputSampler(NvmlThread):
    name = "nvml-pcie-throughput"

    def __init__(self, nvml: Nvml, rates: PcieRates, *, interval_seconds: float = 1.0) -> None:
        super().__init__(nvml)
        self.rates = rates
        self.interval_seconds = interval_seconds
        self._uuids: dict[int, str] = {}
        self._unsupported: set[tuple[str, str]] = set()

    def setup(self) -> None:
        self._uuids.clear()
        self._unsupported.clear()

    def step(self) -> None:
        started = time.monotonic()
        self.rates.update(self.sample_once())
        self.wait(max(0.0, self.interval_seconds - (time.monotonic() - started)))

    def sample_once(self) -> dict[str, PcieRate]:
        out: dict[str, PcieRate] = {}
        for index in range(self.nvml.device_count()):
            if self.stopping:
                break
            try:
                handle = self.nvml.handle(index)
                uuid = self._uuids.get(index) or self.nvml.uuid(handle)
                self._uuids[index] = uuid
                tx = self._read(handle, uuid, "tx")
                rx = self._read(handle, uuid, "rx")
            except NvmlUnavailable:
                raise
            except NvmlError as exc:  # lost, or failing: no values this pass
                log.debug("PCIe throughput of GPU %d: %s", index, exc)
                continue
            if tx is not None or rx is not None:
                out[uuid] = PcieRate(index, uuid, tx, rx)
        return out

    def _read(self, handle: Any, uuid: str, direction: str) -> float | None:
        if (uuid, direction) in self._unsupported:
            return None
        try:
            return self.nvml.pcie_throughput_bytes_per_second(handle, direction)
        except Unsupported:
            self._unsupported.add((uuid, direction))
            log.info("GPU %s does not report PCIe %s throughput; not asking again", uuid, direction)
            return None
