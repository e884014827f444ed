"""The exporter's counters: what threads and requests count, and the label values they use.

Each store is behind one lock, and the collectors read it:

* :class:`RequestCounter` — counts by one label value (``/choose`` results, rejections).
* :class:`XidCounter` — Xid errors from the event listener (:mod:`gpu_exporter.collect.xid`):
  counts per (GPU, Xid) that only ever grow while the process lives, and when the last one
  arrived.
* :class:`PcieRates` — PCIe throughput from its own sampling thread
  (:mod:`gpu_exporter.collect.pcie`), kept off the main sampling path because NVML blocks ~20 ms per
  direction per GPU to measure it.

None imports NVML. The closed label sets of the counters are here too
(:data:`CHOOSE_RESULTS`, :data:`REJECTION_REASONS`, :data:`RELEASE_REASONS`,
:data:`RELOAD_RESULTS`): the code that counts names its values from here, and ``/metrics``
exports every one at 0 from the start, so ``rate()`` panels and alerts work on a fresh
exporter ("avoid missing metrics").
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

# gpu_exporter_choose_requests_total{result}: "ok" or the error code /choose answered with
# (tests/test_series_budget.py checks that every code the /choose path can raise is here).
CHOOSE_RESULTS = (
    "ok",
    "invalid_parameter",
    "unknown_parameter",
    "unsupported_media_type",
    "mig_single_device",
    "invalid_idempotency_key",
    "idempotency_key_reused",
    "lease_ended",
    "lease_too_long",
    "too_many_gpus",
    "too_many_pids",
    "too_many_waiters",
    "not_enough_gpus",
    "not_ready",
    "nvml_unavailable",
    "snapshot_stale",
    "state_unwritable",
    "client_closed",
    "shutting_down",
)
# gpu_exporter_requests_rejected_total{reason}: what the request limits refuse.
TOO_MANY_REQUESTS = "too_many_requests"  # --max-requests-in-flight
TOO_MANY_WAITERS = "too_many_waiters"  # --max-waiters, --max-waiters-per-requester
URI_TOO_LONG = "uri_too_long"
AUTH_THROTTLED = "auth_throttled"  # 429: too many failed logins from that address
AUTH_BUSY = "auth_busy"  # 503: every bcrypt slot busy
TOO_MANY_CONNECTIONS = "too_many_connections"  # every connection at the cap busy with a request
STORE_BUSY = "store_busy"  # 503: every /cluster/choose read slot (Limits.store_reads) busy
REJECTION_REASONS = (
    TOO_MANY_REQUESTS,
    TOO_MANY_WAITERS,
    URI_TOO_LONG,
    AUTH_THROTTLED,
    AUTH_BUSY,
    TOO_MANY_CONNECTIONS,
    STORE_BUSY,
)
# gpu_exporter_lease_gpus_released_total{reason}: why a GPU left its lease before expiry.
ARRIVED = "arrived"  # the job showed up on it
DOWN = "down"
GONE = "gone"
NOT_ON_THIS_HOST = "not_on_this_host"  # restored from --state-dir, not on this host
RELEASE_REASONS = (ARRIVED, DOWN, GONE, NOT_ON_THIS_HOST)
# gpu_exporter_web_config_reloads_total{result}
RELOAD_RESULTS = ("success", "error")


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
        self._last: dict[str, LastXid] = {}

    def record(self, index: int, uuid: str, xid: int, at_seconds: float) -> None:
        with self._lock:
            self._counts[(uuid, xid)] += 1
            self._last[uuid] = LastXid(index, uuid, xid, at_seconds)

    def counts(self) -> tuple[XidCount, ...]:
        with self._lock:
            return tuple(
                XidCount(self._last[uuid].index, uuid, xid, n)
                for (uuid, xid), n in sorted(
                    self._counts.items(), key=lambda kv: (self._last[kv[0][0]].index, kv[0])
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


class MonotonicCounters:
    """Device counters that never go backwards (NVLink's, issue 25): NVML's count, plus what
    was counted before the last time the driver reset it.

    A reading below the last one of the same counter is a reset (a GPU reset, a driver
    reload): the count restarts from that new base, so the exported counter stays where it
    was and grows from there — never a drop, so never a negative ``rate()``, and never more
    than NVML counted. Kept for the exporter's life, across NVML re-initialisations and lost
    GPUs (whose counters are what a reset clears). Keys are whatever names one counter:
    ``(uuid, link, kind)``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[object, tuple[int, int]] = {}  # key → (last reading, offset)

    def value(self, key: object, reading: int) -> int:
        """The exported value of counter ``key`` for NVML's ``reading`` now.

        >>> c = MonotonicCounters()
        >>> [c.value("tx", r) for r in (100, 150, 20, 50, 50)]
        [100, 150, 150, 180, 180]
        """
        with self._lock:
            last, offset = self._last.get(key, (reading, 0))
            if reading < last:  # reset: restart from the new base
                offset += last - reading
            self._last[key] = (reading, offset)
            return reading + offset
