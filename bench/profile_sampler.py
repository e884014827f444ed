"""In-process cost of sampling: CPU and NVML calls per sample, and a profile.

Builds the exporter with :func:`gpu_exporter.daemon.build` on a clock that advances one
``--interval`` per sample (nobody scrapes), then reports CPU per sample (``time.process_time``
over a loop) and NVML calls per sample and per minute::

    python bench/profile_sampler.py --gpus 8 --processes 2 --samples 600
    python bench/profile_sampler.py --fake --processes 0       # the C fake library, as group 6
    python bench/profile_sampler.py --profile | head -40       # cProfile, by internal time

Each sample is the reader's pass run on this thread, as the reader runs it in ``serve`` (no
watchdog: ``Sampler.sample_once`` would also start a thread per sample).

By default the GPUs are simulated A100s (``--simulate``), whose own cost (computing the
made-up values) is part of the figure; ``--fake`` reads ``tests/fakenvml``'s A100s through
the real ``pynvml`` → ctypes path instead (the library is built and loaded through
``LD_LIBRARY_PATH``, so the script runs itself again with it set), with ``--processes`` real
idle processes per GPU, as ``bench/idle.py`` measures the whole exporter. Timings on a shared
machine are noisy: compare runs, not machines.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, not another one installed

from gpu_exporter.collect.sampler import _Reader  # noqa: E402
from gpu_exporter.config import ServeConfig  # noqa: E402
from gpu_exporter.daemon import build  # noqa: E402
from gpu_exporter.nvml import Nvml  # noqa: E402
from gpu_exporter.simulate import Load, SimGpu, SimulatedNvml  # noqa: E402

_FAKE_DIR = "PROFILE_SAMPLER_FAKE_DIR"  # set when running again over the fake library


class SteppedClock:
    """Wall and monotonic time that move only when told (one interval per sample)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return 1_800_000_000.0 + self.now

    def monotonic(self) -> float:
        return self.now


def _fake_library(argv: list[str]) -> int:
    """Build the fake library and run this script again with it on ``LD_LIBRARY_PATH``."""
    sys.path.insert(0, str(ROOT / "tests"))
    import fakenvml

    with tempfile.TemporaryDirectory(prefix="profile-sampler-") as tmp:
        lib = fakenvml.build(Path(tmp) / "lib")
        env = fakenvml.environment(lib, Path(tmp) / "gpus.conf", Path(tmp) / "calls.stats")
        env[_FAKE_DIR] = tmp
        return subprocess.run([sys.executable, __file__, *argv], env=env).returncode


def _fake_nvml(gpus: int, processes: int) -> tuple[Nvml, Any, list[subprocess.Popen[bytes]]]:
    """The fake library's A100s (``bench/run.py``'s ``lab``) with real idle processes."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]
    from run import lab

    import fakenvml

    tmp = Path(os.environ[_FAKE_DIR])
    sleepers = [subprocess.Popen(["sleep", "3600"]) for _ in range(gpus * processes)]
    fake = lab(gpus)
    for i, gpu in enumerate(fake):
        gpu.processes = tuple((p.pid, 2**30) for p in sleepers[i::gpus])
    fakenvml.write_config(tmp / "gpus.conf", fake)

    def calls() -> int:
        return sum(fakenvml.read_stats(tmp / "calls.stats").values())

    return Nvml(), calls, sleepers


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--processes", type=int, default=2, help="compute processes per GPU")
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--fake", action="store_true", help="the C fake library, not --simulate")
    parser.add_argument("--profile", action="store_true", help="print a cProfile instead")
    args = parser.parse_args(argv)
    if args.fake and _FAKE_DIR not in os.environ:
        return _fake_library(argv)

    profiles: list[cProfile.Profile] = []
    if args.profile:  # every thread started from here on (the sampler's workers) is profiled

        def start_profiling(*_: Any) -> None:
            profiles.append(cProfile.Profile())
            profiles[-1].enable()

        threading.setprofile(start_profiling)
    clock = SteppedClock()
    sleepers: list[subprocess.Popen[bytes]] = []
    if args.fake:
        nvml, count_calls, sleepers = _fake_nvml(args.gpus, args.processes)
    else:
        load = Load("constant", utilization=0.3, memory_used_ratio=0.2, processes=args.processes)
        sim = SimulatedNvml(
            [SimGpu(i, "NVIDIA A100-SXM4-80GB", load) for i in range(args.gpus)],
            clock=clock.monotonic,
        )
        nvml = Nvml(sim, simulated=True)

        def count_calls() -> int:
            return sum(sim.calls.values())

    proc_root = "/proc" if args.fake else "/nonexistent"
    config = ServeConfig(simulate=None, proc_root=proc_root, interval_seconds=args.interval)
    daemon = build(config, nvml=nvml, clock=clock, version="bench")
    sampler = daemon.sampler
    for _ in range(3):  # the first samples read identity and static values
        sampler.sample_once()
        clock.now += args.interval

    reader = _Reader(sampler, None, "profiled")  # its state only: the passes run here

    def loop() -> None:
        for _ in range(args.samples):
            sampler._run(reader, sampler._begin())
            clock.now += args.interval

    calls_before = count_calls()
    try:
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
            cpu, own = time.process_time(), time.thread_time()
            loop()
            cpu, own = time.process_time() - cpu, time.thread_time() - own
            print(
                f"CPU per sample: {1000 * cpu / args.samples:.3f} ms "
                f"(the sampling thread's own: {1000 * own / args.samples:.3f} ms)"
            )
        calls = (count_calls() - calls_before) / args.samples
        print(f"NVML calls per sample: {calls:.1f}; per minute: {calls * 60 / args.interval:.0f}")
    finally:
        daemon.sampler.stop(timeout_seconds=1)
        for p in sleepers:
            p.kill()
            p.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
