"""Should "free" (the shipped --choose-defaults) use GPM's SM activity where a card has it?

Runs each bundled simulator scenario with every card made an H100 (so every card has GPM),
through the real sampler, for ten simulated minutes, and compares per whole-card sample the
shipped "free" (``max_util=50%&max_mem_used=50%``) with the same on SM activity
(``max_sm_active=50%&max_mem_used=50%``): how often they disagree, and what the cards they
disagree on are doing. Run from the repository root::

    .venv/bin/python bench/gpm_free.py

docs/performance.md ("Choosing by SM activity") has the figures and the decision.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_exporter.choose.filters import rejection_reasons
from gpu_exporter.choose.request import filters_of
from gpu_exporter.collect.cache import SnapshotCache
from gpu_exporter.collect.sampler import Sampler
from gpu_exporter.model import initial_snapshot
from gpu_exporter.nvml import Nvml
from gpu_exporter.simulate.library import SimulatedNvml
from gpu_exporter.simulate.scenario import Scenario, bundled_scenarios

H100 = "NVIDIA H100 80GB HBM3"
MINUTES, STEP_S = 10, 5.0
BY_UTIL = filters_of(max_util=0.5, max_mem_used=0.5)
BY_SM = filters_of(max_sm_active=0.5, max_mem_used=0.5)


class _Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def time(self) -> float:
        return 1.7e9 + self.t

    def monotonic(self) -> float:
        return self.t


def measure(name: str) -> dict[str, object]:
    scenario = Scenario.from_argument(name)
    gpus = [dataclasses.replace(g, model_name=H100) for g in scenario.gpus]
    clock = _Clock()
    sim = SimulatedNvml(gpus, faults=list(scenario.faults), clock=clock.monotonic)
    cache = SnapshotCache(initial_snapshot(simulated=True, monotonic_now=0.0, wall_now=0.0))
    sampler = Sampler(
        Nvml(sim, simulated=True),
        cache,
        interval_seconds=STEP_S,
        clock=clock,
        gpm_interval_seconds=STEP_S,
    )
    samples = agree = only_sm = only_util = 0
    only_sm_busy: list[float] = []
    for _ in range(int(MINUTES * 60 / STEP_S)):
        snap = sampler.sample_once()
        clock.t += STEP_S
        for gpu in snap.gpus:
            if not gpu.up or gpu.mig_devices or gpu.sm_active_ratio is None:
                continue
            samples += 1
            util_free = not rejection_reasons(gpu, BY_UTIL)
            sm_free = not rejection_reasons(gpu, BY_SM)
            agree += util_free == sm_free
            if sm_free and not util_free:
                only_sm += 1
                only_sm_busy.append(gpu.utilization_ratio or 0.0)
                assert gpu.compute_processes, "a card free by SM activity alone has a job on it"
            only_util += util_free and not sm_free
    sampler.stop()
    return {
        "scenario": name,
        "card_samples": samples,
        "agree": agree,
        "free_by_sm_only": only_sm,
        "free_by_util_only": only_util,
        "their_utilization": [min(only_sm_busy, default=0), max(only_sm_busy, default=0)],
    }


if __name__ == "__main__":
    for scenario in bundled_scenarios():
        print(json.dumps(measure(scenario)))
