"""Steady-state idle CPU of both exporters on identical fake A100s (issue 15).

What an exporter costs while nobody scrapes it, paid on every GPU node all the time: both
exporters are started together on the same fake GPUs (every health field an A100 reports,
``tests/fakenvml``), left alone for a warm-up (30 s in the full run: past start-up, the
first samples' one-off identity and static reads, imports and caches), then measured over one
window (60 s) in which neither is scraped. Three cases: 8 GPUs with no compute process, 8
GPUs with 16 (two per card: the process list costs a second NVML call and the peer looks
each one up with psutil; they are real, idle processes, so /proc has them), and 64 GPUs (this
exporter alone; target ≤ 2 % of a core). ``--quick`` runs the last two, briefly.

For each exporter and case: CPU as % of one core and seconds per minute (the kernel's
per-thread ``schedstat``, nanoseconds), and NVML calls per minute by function from the fake
library's counters (without ``nvmlEventSetWait_v2``: the Xid listener's blocking wait, twice a
second by design and costing no CPU; counted apart). The target is ≤ ½ of the peer's CPU in
both 8-GPU cases.

Used by ``bench/run.py`` (group 6); it passes in how to start an exporter, so this module
knows nothing of subprocesses.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from fakenvml import FakeGpu

OURS, PEER = "gpu-exporter", "nvitop-exporter"
RATIO_TARGET = 0.5  # ≤ ½ of the peer's idle CPU
CPU_TARGET_64_GPUS_PERCENT = 2.0


class Measured(Protocol):
    """What is read from a running exporter (``bench/run.py``'s ``Exporter``)."""

    kind: str

    def cpu_seconds(self) -> float | None: ...

    def calls(self) -> dict[str, int]: ...


Start = Callable[[str, list[FakeGpu]], AbstractContextManager[Measured]]


# (GPUs, compute processes, with the peer?)
Case = tuple[int, int, bool]
CASES: tuple[Case, ...] = ((8, 0, True), (8, 16, True), (64, 0, False))
EVENT_WAIT = "nvmlEventSetWait_v2"


@dataclass(frozen=True, slots=True)
class IdleSize:
    warmup_seconds: float
    window_seconds: float
    cases: tuple[Case, ...] = CASES


FULL_IDLE = IdleSize(warmup_seconds=30.0, window_seconds=60.0)
QUICK_IDLE = IdleSize(warmup_seconds=0.5, window_seconds=1.5, cases=CASES[1:])


def idle_cpu(
    start: Start, lab: Callable[[int, int], list[FakeGpu]], size: IdleSize, peer: bool
) -> list[dict[str, Any]]:
    """One result per case in :data:`CASES`; both exporters of a case run at the same time."""
    out = []
    for gpus, processes, with_peer in size.cases:
        kinds = [OURS, PEER] if with_peer and peer else [OURS]
        with contextlib.ExitStack() as stack:
            fake = lab(gpus, 0)
            if processes:
                pids = stack.enter_context(_sleepers(processes))
                for i, gpu in enumerate(fake):
                    gpu.processes = tuple((pid, 2**30) for pid in pids[i :: len(fake)])
            running = {k: stack.enter_context(start(k, fake)) for k in kinds}
            time.sleep(size.warmup_seconds)
            result: dict[str, Any] = {"gpus": gpus, "processes": processes}
            result["warmup_seconds"] = size.warmup_seconds
            result |= _window(running, size.window_seconds)
            result["load_average"] = [round(x, 2) for x in os.getloadavg()]  # at its end
        ours, other = result[OURS], result.get(PEER)
        if other and other["cpu_seconds_per_minute"]:
            result["ratio_cpu"] = round(
                ours["cpu_seconds_per_minute"] / other["cpu_seconds_per_minute"], 3
            )
        out.append(result)
    return out


@contextlib.contextmanager
def _sleepers(n: int) -> Iterator[list[int]]:
    """``n`` real processes that do nothing, as the GPUs' compute processes: both exporters
    then look up live PIDs in /proc, as on a real node (made-up PIDs would cost them less)."""
    procs = [subprocess.Popen(["sleep", "3600"]) for _ in range(n)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _window(running: dict[str, Measured], seconds: float) -> dict[str, dict[str, Any]]:
    """CPU and NVML calls of each exporter over one window in which nobody scrapes."""
    calls_before = {k: e.calls() for k, e in running.items()}
    cpu_before = {k: e.cpu_seconds() for k, e in running.items()}
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    out: dict[str, dict[str, Any]] = {}
    for kind, ex in running.items():
        cpu_after, calls_after = ex.cpu_seconds(), ex.calls()
        cpu = None
        if cpu_after is not None and cpu_before[kind] is not None:
            cpu = cpu_after - cpu_before[kind]  # type: ignore[operator]
        per_minute = 60.0 / elapsed
        delta = {f: n - calls_before[kind].get(f, 0) for f, n in calls_after.items()}
        waits = delta.pop(EVENT_WAIT, 0)
        out[kind] = {
            "window_seconds": round(elapsed, 1),
            "cpu_percent_of_one_core": None if cpu is None else round(100 * cpu / elapsed, 3),
            "cpu_seconds_per_minute": None if cpu is None else round(cpu * per_minute, 3),
            "nvml_calls_per_minute": round(sum(delta.values()) * per_minute),
            "event_waits_per_minute": round(waits * per_minute),
            "nvml_calls_per_minute_by_function": {
                f: round(n * per_minute, 1) for f, n in sorted(delta.items()) if n
            },
        }
    return out


def rows(results: list[dict[str, Any]]) -> Iterator[tuple[str, Any, Any, str, bool | None]]:
    """(measure, ours, peer, target, met) for the report table."""
    for case in results:
        ours, other = case[OURS], case.get(PEER)
        what = f"{case['gpus']} GPUs, {case['processes']} processes"
        if case["gpus"] == 64:
            cpu = ours["cpu_percent_of_one_core"]
            met = cpu is not None and cpu <= CPU_TARGET_64_GPUS_PERCENT
            target = f"≤ {CPU_TARGET_64_GPUS_PERCENT:g} % of a core"
        else:
            ratio = case.get("ratio_cpu")
            met = None if ratio is None else ratio <= RATIO_TARGET
            target = f"≤ {RATIO_TARGET:g}× peer" + ("" if ratio is None else f" (is {ratio:.2f}×)")
        load = case.get("load_average")  # the machine's, at the window's end
        yield (
            f"idle CPU % of one core (s per minute), {what}",
            (_cpu(ours) or "—") + (f"; load average {load[0]:.2f}" if load else ""),
            other and _cpu(other),
            target,
            met,
        )
        yield (
            f"NVML calls per minute, {what}",
            ours["nvml_calls_per_minute"],
            other and other["nvml_calls_per_minute"],
            "",
            None,
        )


def _cpu(result: dict[str, Any]) -> str | None:
    if result["cpu_percent_of_one_core"] is None:
        return None
    return f"{result['cpu_percent_of_one_core']:.2f} ({result['cpu_seconds_per_minute']:.2f} s)"
