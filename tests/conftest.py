"""Shared fixtures: a fake clock and the whole exporter stack over a simulated NVML."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from prometheus_client import CollectorRegistry

from gpu_exporter.choose.leases import LeaseTable
from gpu_exporter.collect.cache import SnapshotCache
from gpu_exporter.collect.sampler import Sampler
from gpu_exporter.config import ServeConfig
from gpu_exporter.counters import PcieRates, XidCounter
from gpu_exporter.daemon import Daemon, build
from gpu_exporter.export.exposition import Exposition
from gpu_exporter.model import Snapshot
from gpu_exporter.nvml import Nvml
from gpu_exporter.simulate import Scenario, SimGpu, SimulatedNvml
from served import NO_PROC


class FakeClock:
    """Wall and monotonic time that only move when a test says so."""

    def __init__(self, wall: float = 1_800_000_000.0, monotonic: float = 1000.0) -> None:
        self._wall = wall
        self._mono = monotonic

    def time(self) -> float:
        return self._wall

    def monotonic(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        self._wall += seconds
        self._mono += seconds


@dataclass
class Stack:
    """Simulator → daemon.build() → app, all on one fake clock; sampled by hand."""

    clock: FakeClock
    sim: SimulatedNvml
    daemon: Daemon
    leases: LeaseTable

    @property
    def nvml(self) -> Nvml:
        return self.daemon.nvml

    @property
    def cache(self) -> SnapshotCache:
        return self.daemon.cache

    @property
    def sampler(self) -> Sampler:
        return self.daemon.sampler

    @property
    def registry(self) -> CollectorRegistry:
        return self.daemon.registry

    @property
    def app(self) -> Flask:
        return self.daemon.app

    @property
    def exposition(self) -> Exposition:
        return self.daemon.exposition

    @property
    def xids(self) -> XidCounter:
        assert self.daemon.xids is not None
        return self.daemon.xids

    @property
    def pcie(self) -> PcieRates | None:
        return self.daemon.pcie

    @property
    def client(self) -> FlaskClient:
        return self.app.test_client()

    def sample(self) -> Snapshot:
        return self.sampler.sample_once()

    def value(self, name: str, gpu: int | None = None, **labels: str) -> float | None:
        if gpu is not None:
            labels = {"gpu": str(gpu), "uuid": self.sim.gpus[gpu].uuid, **labels}
        return self.registry.get_sample_value(name, labels)


def build_stack(
    sim_factory: Callable[[FakeClock], SimulatedNvml],
    *,
    clock: FakeClock | None = None,
    **config: Any,
) -> Stack:
    """The production wiring (:func:`gpu_exporter.daemon.build`) over a simulator.

    ``config`` are :class:`~gpu_exporter.config.ServeConfig` fields; by default leases are
    kept in memory only (no state directory), and ``/proc`` shows no process (simulated pids
    must not meet this machine's real ones; pass ``proc_root`` a :func:`fake_proc` tree).
    """
    clock = clock or FakeClock()
    sim = sim_factory(clock)
    daemon = build(
        ServeConfig(**{"state_dir": None, "proc_root": NO_PROC, **config}),
        nvml=Nvml(sim, simulated=True),
        clock=clock,
        version="test",
    )
    return Stack(clock, sim, daemon, daemon.leases)


@pytest.fixture
def make_stack() -> Callable[..., Stack]:
    return build_stack


@pytest.fixture
def stack() -> Stack:
    """Four default simulated A100s (busy, idle, sine, light), sampled once."""
    s = build_stack(lambda clock: SimulatedNvml.of(Scenario.with_gpus(4), clock=clock.monotonic))
    s.sample()
    return s


def sim_of(*gpus: SimGpu, **kwargs: object) -> Callable[[FakeClock], SimulatedNvml]:
    """A factory for build_stack from explicit simulated GPUs."""
    return lambda clock: SimulatedNvml(list(gpus), clock=clock.monotonic, **kwargs)  # type: ignore[arg-type]


def without_process_metrics(text: bytes) -> bytes:
    """An exposition without prometheus_client's process_* families, whose values (CPU
    seconds, RSS) change from one rendering to the next."""
    return b"".join(
        line
        for line in text.splitlines(keepends=True)
        if not line.startswith((b"process_", b"# HELP process_", b"# TYPE process_"))
    )


# A container id as Docker writes it (64 hex digits).
CID = "3f4e8a1b2c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f7"


def fake_proc(
    root: Path,
    pid: int,
    *,
    uid: int = 1000,
    cmdline: bytes = b"python\0",
    cgroup: str = "0::/\n",
    start: int = 100,
    ppid: int = 0,
) -> None:
    """A /proc/<pid> directory with the files gpu_exporter.collect.procinfo reads."""
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "status").write_text(f"Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    (d / "cmdline").write_bytes(cmdline)
    (d / "comm").write_text("kworker\n")
    (d / "cgroup").write_text(cgroup)
    # Field 2 with spaces and parentheses, as a process can name itself.
    fields = ["S", str(ppid)] + ["0"] * 17 + [str(start)] + ["0"] * 30
    (d / "stat").write_text(f"{pid} (my (odd) name) " + " ".join(fields) + "\n")
