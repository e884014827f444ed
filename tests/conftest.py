"""Shared fixtures: a fake clock and the whole exporter stack over a simulated NVML."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from flask import Flask
from flask.testing import FlaskClient
from prometheus_client import CollectorRegistry

from gpu_exporter.app import create_app
from gpu_exporter.leases import LeaseTable
from gpu_exporter.metrics import GpuCollector, RequestCounter
from gpu_exporter.model import Snapshot
from gpu_exporter.nvml import Nvml
from gpu_exporter.sampler import Sampler, SnapshotCache, new_cache
from gpu_exporter.simulate import SimGpu, SimulatedNvml


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
    """Simulator → Nvml → Sampler → cache → collector/app, all on one fake clock."""

    clock: FakeClock
    sim: SimulatedNvml
    nvml: Nvml
    cache: SnapshotCache
    sampler: Sampler
    registry: CollectorRegistry
    app: Flask
    leases: LeaseTable

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
    max_age: float = 10.0,
    clock: FakeClock | None = None,
    leases: LeaseTable | None = None,
    nvml_timeout: float = 5.0,
) -> Stack:
    clock = clock or FakeClock()
    sim = sim_factory(clock)
    nvml = Nvml(sim, simulated=True)
    cache = new_cache(nvml, clock)
    sampler = Sampler(
        nvml, cache, interval_seconds=1.0, nvml_timeout_seconds=nvml_timeout, clock=clock
    )
    table = leases or LeaseTable(clock)
    requests, rejections = RequestCounter(), RequestCounter()
    registry = CollectorRegistry()
    registry.register(
        GpuCollector(cache, version="test", leases=table, requests=requests, rejections=rejections)
    )
    app = create_app(
        cache,
        registry,
        clock=clock,
        max_age_seconds=max_age,
        leases=table,
        requests=requests,
        rejections=rejections,
    )
    return Stack(clock, sim, nvml, cache, sampler, registry, app, table)


@pytest.fixture
def make_stack() -> Callable[..., Stack]:
    return build_stack


@pytest.fixture
def stack() -> Stack:
    """Four default simulated A100s (busy, idle, sine, light), sampled once."""
    s = build_stack(lambda clock: SimulatedNvml.with_gpus(4, clock=clock.monotonic))
    s.sample()
    return s


def sim_of(*gpus: SimGpu, **kwargs: object) -> Callable[[FakeClock], SimulatedNvml]:
    """A factory for build_stack from explicit simulated GPUs."""
    return lambda clock: SimulatedNvml(list(gpus), clock=clock.monotonic, **kwargs)  # type: ignore[arg-type]
