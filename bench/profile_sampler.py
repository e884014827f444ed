"""In-process cost of sampling: CPU and NVML calls per ``Sampler.sample_once``, and a profile.

Builds the exporter with :func:`gpu_exporter.daemon.build` over simulated A100s on a clock
that advances one ``--interval`` per sample (nobody scrapes), then reports CPU per sample
(``time.process_time`` over a loop) and NVML calls per sample and per minute::

    python bench/profile_sampler.py --gpus 8 --processes 2 --samples 600
    python bench/profile_sampler.py --profile | head -40   # cProfile, by cumulative time

The simulator's own cost (computing the made-up values) is part of the figure; ``--profile``
shows how much. Timings on a shared machine are noisy: compare runs, not machines.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import threading
import time
from typing import Any

from gpu_exporter.config import ServeConfig
from gpu_exporter.daemon import build
from gpu_exporter.nvml import Nvml
from gpu_exporter.simulate import Load, SimGpu, SimulatedNvml


class SteppedClock:
    """Wall and monotonic time that move only when told (one interval per sample)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return 1_800_000_000.0 + self.now

    def monotonic(self) -> float:
        return self.now


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=2, help="compute processes per GPU")
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--profile", action="store_true", help="print a cProfile instead")
    args = parser.parse_args(argv)

    profiles: list[cProfile.Profile] = []
    if args.profile:  # every thread started from here on (the sampler's workers) is profiled

        def start_profiling(*_: Any) -> None:
            profiles.append(cProfile.Profile())
            profiles[-1].enable()

        threading.setprofile(start_profiling)
    clock = SteppedClock()
    load = Load("constant", utilization=0.3, memory_used_ratio=0.2, processes=args.processes)
    sim = SimulatedNvml(
        [SimGpu(i, "NVIDIA A100-SXM4-80GB", load) for i in range(args.gpus)],
        clock=clock.monotonic,
    )
    config = ServeConfig(simulate=None, proc_root="/nonexistent", interval_seconds=args.interval)
    daemon = build(config, nvml=Nvml(sim, simulated=True), clock=clock, version="bench")
    sampler = daemon.sampler
    for _ in range(3):  # the first samples read identity and static values
        sampler.sample_once()
        clock.now += args.interval

    def loop() -> None:
        for _ in range(args.samples):
            sampler.sample_once()
            clock.now += args.interval

    calls_before = sum(sim.calls.values())
    if args.profile:
        profiler = cProfile.Profile()
        for p in profiles:  # the warm-up is not part of the profile
            p.disable()
            p.clear()
            p.enable()
        profiler.runcall(loop)
        stats = pstats.Stats(profiler, stream=sys.stdout)
        for p in profiles:
            p.create_stats()
            stats.add(p)
        stats.sort_stats("tottime").print_stats(30)
    else:
        cpu = time.process_time()
        loop()
        cpu = time.process_time() - cpu
        print(f"CPU per sample: {1000 * cpu / args.samples:.3f} ms")
    calls = (sum(sim.calls.values()) - calls_before) / args.samples
    print(f"NVML calls per sample: {calls:.1f}; per minute: {calls * 60 / args.interval:.0f}")
    daemon.sampler.stop(timeout_seconds=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
