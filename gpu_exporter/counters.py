"""Stores that background NVML threads write and the collector reads, behind one lock each.

* :class:`XidCounter` — Xid errors from the event listener (:mod:`gpu_exporter.collect.xid`):
  counts per (GPU, Xid) that only ever grow while the process lives, and when the last one
  arrived.
* :class:`PcieRates` — PCIe throughput from its own sampling thread
  (:mod:`gpu_exporter.collect.pcie`), kept off the main sampling path because NVML blocks ~20 ms per
  direction per GPU to measure it.

Neither imports NVML; requests and the collector only read them.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class XidCount:
    index: int
    uuid: str
    xid: int
    count: int


@dataclass(frozen=True, slots=True)
class LastXid:
    index: int
    uuid: str
    xid: int
    at_seconds: float  # Unix time it was received


class XidCounter:
    """Xid errors seen since the exporter started; never reset (not even by an NVML
    re-initialisation), so ``increase()`` in PromQL sees every repeat."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, int]] = Counter()
        self._index: dict[str, int] = {}
        self._last: dict[str, LastXid] = {}

    def record(self, index: int, uuid: str, xid: int, at_seconds: float) -> None:
        with self._lock:
            self._counts[(uuid, xid)] += 1
            self._index[uuid] = index
            self._last[uuid] = LastXid(index, uuid, xid, at_seconds)

    def counts(self) -> tuple[XidCount, ...]:
        with self._lock:
            return tuple(
                XidCount(self._index[uuid], uuid, xid, n)
                for (uuid, xid), n in sorted(
                    self._counts.items(), key=lambda kv: (self._index[kv[0][0]], kv[0])
                )
            )

    def last(self) -> tuple[LastXid, ...]:
        with self._lock:
            return tuple(sorted(self._last.values(), key=lambda x: (x.index, x.uuid)))

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


@dataclass(frozen=True, slots=True)
class PcieRate:
    index: int
    uuid: str
    tx_bytes_per_second: float | None
    rx_bytes_per_second: float | None


class PcieRates:
    """The latest PCIe throughput per GPU."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rates: dict[str, PcieRate] = {}

    def update(self, rates: dict[str, PcieRate]) -> None:
        """Replace every GPU's rates with one pass's (GPUs not in it are dropped)."""
        with self._lock:
            self._rates = dict(rates)

    def rates(self) -> tuple[PcieRate, ...]:
        with self._lock:
            return tuple(sorted(self._rates.values(), key=lambda r: (r.index, r.uuid)))


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
