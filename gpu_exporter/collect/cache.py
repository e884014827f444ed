"""The latest snapshot and a bounded history of them, shared by every reader.

The sampler publishes; requests, the collectors and the lease table only read. Publishing
replaces the snapshot in one assignment, so a reader never sees half of one. Whatever must
happen once per sample (the lease table's pruning) subscribes to publishing instead of running
on a read.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import replace

from gpu_exporter.clock import Clock
from gpu_exporter.model import Snapshot, initial_snapshot
from gpu_exporter.nvml import Nvml

# Snapshots kept: 600 intervals, 10 minutes back at the default 1 s interval (idle_for's limit).
HISTORY_LENGTH = 601


class SnapshotCache:
    """The latest snapshot plus a bounded history, shared by every request thread.

    Readers get an immutable :class:`Snapshot`; publishing replaces it in one assignment.
    """

    def __init__(self, initial: Snapshot, history_length: int = HISTORY_LENGTH) -> None:
        self._latest = initial
        self._history: collections.deque[Snapshot] = collections.deque(maxlen=history_length)
        self._changed = threading.Condition()
        self._subscribers: list[Callable[[Snapshot], object]] = []

    def get(self) -> Snapshot:
        return self._latest

    def history(self) -> tuple[Snapshot, ...]:
        """Published snapshots, oldest first (at most ``history_length``)."""
        with self._changed:
            return tuple(self._history)

    def subscribe(self, callback: Callable[[Snapshot], object]) -> None:
        """Call ``callback(snapshot)`` after each publish, on the publishing thread."""
        self._subscribers.append(callback)

    def publish(self, snapshot: Snapshot) -> Snapshot:
        with self._changed:
            snapshot = replace(snapshot, sequence=self._latest.sequence + 1)
            self._latest = snapshot
            self._history.append(snapshot)
            self._changed.notify_all()
        for callback in self._subscribers:
            callback(snapshot)
        return snapshot

    def wait_for_newer(self, sequence: int, timeout_seconds: float) -> Snapshot:
        """Block until a snapshot newer than ``sequence`` is published, or the timeout ends."""
        with self._changed:
            self._changed.wait_for(lambda: self._latest.sequence > sequence, timeout_seconds)
            return self._latest


def new_cache(nvml: Nvml, clock: Clock) -> SnapshotCache:
    return SnapshotCache(
        initial_snapshot(
            simulated=nvml.simulated, monotonic_now=clock.monotonic(), wall_now=clock.time()
        )
    )
