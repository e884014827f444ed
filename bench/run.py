"""The exporter against nvitop-exporter, on the same fake NVML library and the same GPUs.

Run from the repository root::

    .venv/bin/python bench/run.py             # the full run, about 10–13 minutes
    .venv/bin/python bench/run.py --quick     # a smoke run at a small size, under a minute
    .venv/bin/python bench/run.py --report    # only regenerate docs/performance.md's table
    .venv/bin/python bench/run.py --idle-only # group 6 alone → bench/results/idle.json
    .venv/bin/python bench/run.py --report --idle bench/results/idle.json  # its rows in the table
    .venv/bin/python bench/run.py --metric-names gpu-exporter dcgm both  # group 1 per mode
    .venv/bin/python bench/run.py --calls-only # NVML calls per GPU per sample → calls.json
    .venv/bin/python bench/run.py --report --calls bench/results/calls.json  # ... in the table
    .venv/bin/python bench/run.py --latency-only --fake h100  # groups 2 and 1 → latency.json

Both exporters run as subprocesses on 127.0.0.1 with ``LD_LIBRARY_PATH`` pointing at the fake
``libnvidia-ml.so.1`` (``tests/fakenvml``, compiled here with the system C compiler), so
both go through the real ``pynvml`` → ctypes path against identical GPUs. The library counts
every NVML call per function (``FAKENVML_STATS``).

nvitop-exporter is the peer. It is installed, pinned in ``bench/requirements-nvitop.txt``,
into a virtual environment of its own (``bench/.venv-nvitop``, created on first use), never
into the project's: it pins its own ``nvidia-ml-py`` range and brings ``psutil``, and the
project's environment must stay exactly what ``pyproject.toml`` says. If it cannot be
installed (no network), the bench measures this exporter alone and says so.

Measured (the seven groups of docs/performance.md):

1. ``/metrics`` latency: p50/p99 over sequential scrapes on one keep-alive connection (plain,
   and gzip as Prometheus asks), and under 16 concurrent scrapers; both exporters, 8 GPUs.
2. Sampling cost: NVML calls per sample (from the library's counters), and process CPU over
   an idle window at a 1 s interval with nobody scraping; both exporters, 8 GPUs.
3. ``/choose?n=1&lease=0`` throughput, p50 and p99 at 32 concurrent clients, and the same
   server's no-op route ``/healthz`` as the baseline.
4. Scaling: 1, 8, 16 and 64 devices; 0, 100 and 1,000 processes on 8 GPUs: ``/metrics``
   latency and the sampler's own ``gpu_exporter_sample_duration_seconds`` and CPU.
5. RSS after start, and after 100,000 requests (a third each of ``/metrics``, ``/choose``
   and ``/healthz``).
6. Steady-state idle CPU (``bench/idle.py``): 30 s warm-up, 60 s window, nobody scraping;
   8 GPUs with 0 and with 16 compute processes, both exporters at once; 64 GPUs, this one.
7. Hostile clients: the worst p99 of a scraper (``/metrics`` and ``/healthz`` every 100 ms)
   and a job (``/choose?lease=0`` every 100 ms) while 200 slowloris and 200 idle connections
   attack (``bench/hostile.py``; 10 + 10 in ``--quick``, a smoke run only).

NVML calls per GPU and sample (issue 31), both exporters at once on the same fake cards, over
windows of one --slow-interval (30 s, so each window holds one slow read per GPU): 8 GPUs
without and with 16 compute processes, and 64 GPUs. A full run measures them too (group 2);
``--calls-only`` measures only them, into ``bench/results/calls.json``.

Results go to ``bench/results/exporter.json`` (``exporter-quick.json`` for ``--quick``);
``--report`` turns a results file into the table in ``docs/performance.md``, which a full
run also does at the end; with ``--idle``, group 6's rows come from an ``--idle-only`` run
instead (the table's first line says so). Every phase is bounded by a request count and a
deadline, and every process started here is stopped before the script exits.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests"), str(ROOT)]  # this checkout's gpu_exporter

import hostile  # noqa: E402  (bench/hostile.py: the attack of the "hostile clients" row)
import idle  # noqa: E402  (bench/idle.py: steady-state idle CPU, group 6)
import kubelet_row  # noqa: E402  (bench/kubelet_row.py: group 1 with --kubernetes)
import servers  # noqa: E402  (bench/servers.py: load generator and /proc helpers)

import fakenvml  # noqa: E402  (tests/fakenvml, on the path just above)
from fakenvml import FakeGpu  # noqa: E402
from gpu_exporter.config import METRIC_NAMES  # noqa: E402

RESULTS_DIR = HERE / "results"
DOC = ROOT / "docs" / "performance.md"
PEER_VENV = HERE / ".venv-nvitop"
PEER_REQUIREMENTS = HERE / "requirements-nvitop.txt"
HOST = servers.HOST
INTERVAL_SECONDS = 1.0
GPUS = 8
GiB = 2**30
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
    "Accept-Encoding": "gzip",
}
TABLE_START = "<!-- bench-table:start -->"
TABLE_END = "<!-- bench-table:end -->"


@dataclass(frozen=True, slots=True)
class Size:
    sequential: int  # scrapes per sequential latency run
    concurrent: int  # requests over all concurrent clients
    phase_seconds: float  # deadline of each load phase
    idle_seconds: float  # the idle CPU window
    scaling_sequential: int
    scaling_seconds: float  # window for sample cost per scaling point
    devices: tuple[int, ...]
    processes: tuple[int, ...]
    rss_requests: int
    sparse: int  # scrapes spaced more than one sample apart, as from one Prometheus
    idle: idle.IdleSize  # group 6: warm-up and window of the steady-state idle CPU
    hostile: int = 200  # slowloris connections, and as many idle ones (bench/hostile.py)
    hostile_seconds: float = 10.0  # the good clients' window under that attack
    calls_seconds: float = 30.0  # calls per GPU per sample: one --slow-interval per case
    call_cases: tuple[tuple[int, int], ...] = ((8, 0), (8, 16), (64, 0))  # (GPUs, processes)


FULL = Size(
    sequential=2000,
    concurrent=3200,
    phase_seconds=20.0,
    idle_seconds=60.0,
    scaling_sequential=500,
    scaling_seconds=8.0,
    devices=(1, 8, 16, 64),
    processes=(0, 100, 1000),
    rss_requests=100_000,
    sparse=30,
    idle=idle.FULL_IDLE,
)
QUICK = Size(
    sequential=100,
    concurrent=320,
    phase_seconds=3.0,
    idle_seconds=3.0,
    scaling_sequential=30,
    scaling_seconds=2.0,
    devices=(1, 64),
    processes=(1000,),
    rss_requests=1500,
    sparse=3,
    idle=idle.QUICK_IDLE,
    # Few enough for even a fixed pool of threads to survive: a smoke run of the machinery,
    # not the measurement (which takes 200 + 200 connections and 10 s).
    hostile=10,
    hostile_seconds=2.0,
    calls_seconds=3.0,
    call_cases=((8, 16),),
)


def _log(message: str) -> None:
    servers._log(message)


# The bench's fake cards. "rich" (the default) answers every field a data-centre card can:
# besides the A100's ECC counters, remapped rows, clocks, throttle reasons and media engines,
# a fan and retired pages (an H100 PCIe / older Tesla reports both), so nothing is skipped
# as NOT_SUPPORTED and each sample makes every call there is. "a100-sxm" is the card before
# issue 29: no fan, no retired pages (each answered NOT_SUPPORTED once, then never asked).
# "h100" is "rich" with GPM (issue 25), answering what a real H100 gave under bf16 matmuls,
# and per-process utilization for its processes: GPM's two calls per GPU every
# --gpm-interval come on top of every sample's calls.
FAKES = ("rich", "a100-sxm", "h100")
FAKE = FAKES[0]
H100_GPM = {1: 97.0, 2: 96.0, 3: 14.0, 5: 93.0, 6: 0.0, 7: 93.0, 9: 0.0, 10: 25.0, 11: 0.0}
H100_GPM |= {12: 0.0, 13: 0.0, 20: 12.5, 21: 300.0, 60: 0.0, 61: 0.0}
GPM_INTERVAL_SECONDS = 5.0  # the exporter's default --gpm-interval


def lab(gpus: int = GPUS, processes: int = 0) -> list[FakeGpu]:
    """``gpus`` cards of the :data:`FAKE` kind with varied load; ``processes`` compute
    processes spread over them."""
    out = []
    for i in range(gpus):
        share = processes // gpus + (1 if i < processes % gpus else 0)
        rich = FAKE in ("rich", "h100")
        gpm = FAKE == "h100"
        first = fakenvml.SYNTHETIC_PID_BASE + i * 10000  # as fakenvml.c numbers them
        pids = range(first, first + share)
        out.append(
            FakeGpu(
                name="NVIDIA H100 80GB HBM3" if gpm else None,
                memory_used=(i % 5) * 8 * GiB,
                utilization_gpu=(i * 37) % 100,
                utilization_memory=(i * 11) % 100,
                power_usage_mw=60_000 + i * 20_000,
                temperature_c=30 + i,
                fan_percent=30 + i if rich else None,
                synthetic_processes=(share, 2**30) if share else None,
                errors={} if rich else dict(fakenvml.A100_SXM_ERRORS),
                health={"retired_pages": "2 1 0"} if rich else {},
                gpm=H100_GPM if gpm else None,
                process_utilization=tuple((pid, 40, 10) for pid in pids) if gpm else (),
            )
        )
    return out


# -- processes under test ----------------------------------------------------------------------


class Exporter(servers.LoggedProcess):
    """One exporter in its own session, on a free port, over the fake library."""

    def __init__(
        self, kind: str, lib: Path, gpus: list[FakeGpu], work: Path, args: tuple[str, ...] = ()
    ) -> None:
        self.kind = kind
        port = servers.free_port()
        self.config = work / f"{kind}-{port}.conf"
        self.stats = work / f"{kind}-{port}.stats"
        fakenvml.write_config(self.config, gpus)
        env = fakenvml.environment(lib, self.config, self.stats)
        if kind == "gpu-exporter":
            env["GPU_EXPORTER_STATE_DIR"] = str(work / f"state-{port}")
            command = [sys.executable, "-m", "gpu_exporter", "serve"]
            command += ["--listen-address", f"{HOST}:{port}", "--interval", "1", *args]
            ready: dict[str, Any] = {"ready_path": "/readyz"}
        else:  # the peer has no readiness probe: ready once /metrics shows a GPU
            command = [str(PEER_VENV / "bin" / "nvitop-exporter"), "--bind-address", HOST]
            command += ["--port", str(port), "--interval", "1"]
            ready = {"ready_path": "/metrics", "ready_text": b"gpu_utilization"}
        super().__init__(kind, port, command, env, cwd=ROOT, **ready)

    def output(self, tail: int | None = 4000) -> str:
        return super().output(tail)

    def calls(self) -> dict[str, int]:
        return fakenvml.read_stats(self.stats)

    def cpu_seconds(self) -> float | None:
        """CPU time of the process so far: nanosecond ``schedstat`` where the kernel has it
        (``/proc/PID/stat`` counts 10 ms ticks, too coarse for a few idle seconds)."""
        total = 0
        try:
            for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
                with contextlib.suppress(OSError):  # a thread that just ended
                    total += int((task / "schedstat").read_text().split()[0])
        except OSError:
            return servers._cpu_seconds(self.proc.pid)
        return total / 1e9 if total else servers._cpu_seconds(self.proc.pid)

    def rss_mib(self) -> float | None:
        return servers._rss_mib(self.proc.pid)


@contextlib.contextmanager
def running(
    kind: str, lib: Path, gpus: list[FakeGpu], work: Path, args: tuple[str, ...] = ()
) -> Iterator[Exporter]:
    exporter = Exporter(kind, lib, gpus, work, args)
    try:
        exporter.wait_ready()
        time.sleep(INTERVAL_SECONDS * 1.5)  # past the first sample's one-off identity calls
        yield exporter
    finally:
        exporter.stop()


def peer_available(create: bool) -> tuple[bool, str]:
    """Whether nvitop-exporter can run; creates its environment when asked and missing."""
    exe = PEER_VENV / "bin" / "nvitop-exporter"
    if exe.exists():
        return True, _peer_version()
    if not create:
        return False, "not installed (run without --no-peer to create bench/.venv-nvitop)"
    _log(f"creating {PEER_VENV.relative_to(ROOT)} from {PEER_REQUIREMENTS.name}")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True, timeout=120)
        subprocess.run(
            [str(PEER_VENV / "bin" / "pip"), "install", "-q", "-r", str(PEER_REQUIREMENTS)],
            check=True,
            timeout=600,
            capture_output=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        return False, f"could not install nvitop-exporter: {exc} {detail.decode()[-300:]}"
    return True, _peer_version()


def _peer_version() -> str:
    out = subprocess.run(
        [str(PEER_VENV / "bin" / "python"), "-m", "pip", "list", "--format=json"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    versions = {p["name"].lower(): p["version"] for p in json.loads(out or "[]")}
    return ", ".join(
        f"{name} {versions[name]}"
        for name in ("nvitop-exporter", "nvitop", "nvidia-ml-py", "prometheus-client")
        if name in versions
    )


# -- measurements ------------------------------------------------------------------------------


def sequential(
    port: int, path: str, n: int, deadline_s: float, headers: dict[str, str]
) -> dict[str, Any]:
    """p50/p99 of ``n`` requests, one at a time on one (keep-alive where offered) connection."""
    conn = http.client.HTTPConnection(HOST, port, timeout=servers.REQUEST_TIMEOUT_SECONDS)
    latencies: list[float] = []
    errors = 0
    body_bytes = 0
    deadline = time.monotonic() + deadline_s
    try:
        for i in range(n + 20):
            started = time.perf_counter()
            try:
                conn.request("GET", path, headers=headers)
                resp = conn.getresponse()
                body = resp.read()
                status = resp.status
            except (OSError, http.client.HTTPException):
                conn.close()
                status, body = -1, b""
            ms = (time.perf_counter() - started) * 1000
            if i < 20:
                continue  # warm-up
            if status == 200:
                latencies.append(ms)
                body_bytes = len(body)
            else:
                errors += 1
            if time.monotonic() > deadline:
                break
    finally:
        conn.close()
    return {"requests": len(latencies), "errors": errors, "body_bytes": body_bytes} | (
        servers._summary(latencies)
    )


def sparse(exporters: dict[str, Exporter], n: int) -> dict[str, dict[str, Any]]:
    """Latency of scrapes spaced 1.2 samples apart: each one sees a new sample."""
    conns = {
        k: http.client.HTTPConnection(HOST, e.port, timeout=servers.REQUEST_TIMEOUT_SECONDS)
        for k, e in exporters.items()
    }
    latencies: dict[str, list[float]] = {k: [] for k in exporters}
    try:
        for _ in range(n):
            for kind, conn in conns.items():
                started = time.perf_counter()
                conn.request("GET", "/metrics", headers=PROMETHEUS_HEADERS)
                resp = conn.getresponse()
                resp.read()
                if resp.status == 200:
                    latencies[kind].append((time.perf_counter() - started) * 1000)
                if resp.getheader("Connection", "").lower() == "close":
                    conn.close()
            time.sleep(INTERVAL_SECONDS * 1.2)
    finally:
        for conn in conns.values():
            conn.close()
    return {
        k: {"requests": len(v), "max_ms": round(max(v), 3) if v else None} | servers._summary(v)
        for k, v in latencies.items()
    }


def concurrent(
    exporter: Exporter, path: str, requests: int, clients: int, size: Size
) -> dict[str, Any]:
    """bench/servers.py's load generator (it needs only ``.port`` and ``.proc``)."""
    load = replace(servers.QUICK_SIZE, concurrent=requests, phase_seconds=size.phase_seconds)
    procs = 2 if clients % 2 == 0 else 1
    context = servers._client_context()
    return servers.concurrent(exporter, path, load, procs, context, clients)  # type: ignore[arg-type]


def _settled_calls(exporter: Exporter) -> dict[str, int]:
    """Call counts read between two samples, not in the middle of one (two equal reads)."""
    counts = exporter.calls()
    for _ in range(40):
        time.sleep(0.025)
        again = exporter.calls()
        if again == counts:
            break
        counts = again
    return counts


def sample_cost(exporters: dict[str, Exporter], seconds: float) -> dict[str, dict[str, Any]]:
    """NVML calls per sample and CPU over a window in which nobody scrapes, per exporter."""
    calls_before = {k: _settled_calls(e) for k, e in exporters.items()}
    cpu_before = {k: e.cpu_seconds() for k, e in exporters.items()}
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    out: dict[str, dict[str, Any]] = {}
    for kind, ex in exporters.items():
        after, before = _settled_calls(ex), calls_before[kind]
        delta = {f: after.get(f, 0) - before.get(f, 0) for f in after}
        delta = {f: n for f, n in sorted(delta.items()) if n}
        waits = delta.pop(idle.EVENT_WAIT, 0)  # the Xid listener's blocking wait, not sampling
        # gpu-exporter calls nvmlDeviceGetCount_v2 exactly once per sample; the peer does not
        samples = delta.get("nvmlDeviceGetCount_v2", 0) if kind == "gpu-exporter" else 0
        samples = samples or max(1, round(elapsed / INTERVAL_SECONDS))
        cpu_after, cpu_start = ex.cpu_seconds(), cpu_before[kind]
        cpu = None if cpu_after is None or cpu_start is None else cpu_after - cpu_start
        out[kind] = {
            "window_seconds": round(elapsed, 2),
            "samples": samples,
            "nvml_calls_per_sample": round(sum(delta.values()) / samples, 1),
            "nvml_calls_by_function": {f: round(n / samples, 2) for f, n in delta.items()},
            "event_waits_per_second": round(waits / elapsed, 2),
            "cpu_seconds": None if cpu is None else round(cpu, 3),
            "cpu_percent_of_one_core": None if cpu is None else round(100 * cpu / elapsed, 2),
            "cpu_ms_per_sample": None if cpu is None else round(1000 * cpu / samples, 2),
        }
    return out


CALLS_RATIO_TARGET = 0.5  # ≤ ½ of the peer's NVML calls per GPU per sample
# Called exactly once per GPU and sample by each exporter: how samples are counted.
ONCE_PER_GPU_AND_SAMPLE = "nvmlDeviceGetUtilizationRates"


def calls_per_gpu(lib: Path, work: Path, size: Size, peer: bool) -> list[dict[str, Any]]:
    """NVML calls per GPU per sample of both exporters, started together on the same cards,
    over one window of ``size.calls_seconds`` in which nobody scrapes, for each of
    ``size.call_cases``.
    Samples are counted by a call each exporter makes once per GPU and sample (utilization),
    so the two are compared per sample each really took."""
    out = []
    kinds = ["gpu-exporter"] + (["nvitop-exporter"] if peer else [])
    for gpus, processes in size.call_cases:
        _log(f"2. NVML calls per GPU and sample: {gpus} GPUs, {processes} processes")
        with contextlib.ExitStack() as stack:
            exporters = {
                k: stack.enter_context(running(k, lib, lab(gpus, processes), work)) for k in kinds
            }
            cost = sample_cost(exporters, size.calls_seconds)
        case: dict[str, Any] = {"gpus": gpus, "processes": processes}
        for kind, result in cost.items():
            by_function = result["nvml_calls_by_function"]
            samples = by_function.get(ONCE_PER_GPU_AND_SAMPLE, 0) * result["samples"] / gpus
            total = sum(by_function.values()) * result["samples"]
            case[kind] = {
                "samples": round(samples, 1),
                "nvml_calls_per_gpu_per_sample": round(total / (samples * gpus), 2)
                if samples
                else None,
                "nvml_calls_by_function": by_function,
            }
        ours, other = case["gpu-exporter"], case.get("nvitop-exporter")
        if other and other["nvml_calls_per_gpu_per_sample"]:
            ratio = ours["nvml_calls_per_gpu_per_sample"] / other["nvml_calls_per_gpu_per_sample"]
            case["ratio_calls"] = round(ratio, 3)
        out.append(case)
    return out


def calls_rows(cases: list[dict[str, Any]]) -> Iterator[tuple[str, Any, Any, str, bool | None]]:
    """(measure, ours, peer, target, met) for the calls-per-GPU rows."""
    for case in cases:
        ours, other = case["gpu-exporter"], case.get("nvitop-exporter")
        ratio = case.get("ratio_calls")
        what = f"{case['gpus']} GPUs, {case['processes']} processes"
        yield (
            f"NVML calls per GPU per sample, {what}",
            ours["nvml_calls_per_gpu_per_sample"],
            other and other["nvml_calls_per_gpu_per_sample"],
            f"≤ {CALLS_RATIO_TARGET:g}× peer" + ("" if ratio is None else f" (is {ratio:.2f}×)"),
            None if ratio is None else ratio <= CALLS_RATIO_TARGET,
        )


def sample_duration(exporter: Exporter) -> float | None:
    conn = http.client.HTTPConnection(HOST, exporter.port, timeout=5)
    with contextlib.closing(conn):
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    found = re.search(r"^gpu_exporter_sample_duration_seconds (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def group_latency(exporters: dict[str, Exporter], size: Size) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, ex in exporters.items():
        _log(f"1. /metrics latency: {kind}")
        out[kind] = {
            "sequential": sequential(
                ex.port, "/metrics", size.sequential, size.phase_seconds * 3, {}
            ),
            "sequential_gzip": sequential(
                ex.port, "/metrics", size.sequential, size.phase_seconds * 3, PROMETHEUS_HEADERS
            ),
            "concurrent_16": concurrent(ex, "/metrics", size.concurrent, 16, size),
        }
    if len(out) == 2:
        ours, peer = out["gpu-exporter"], out["nvitop-exporter"]
        out["ratio_p50"] = round(ours["sequential"]["p50_ms"] / peer["sequential"]["p50_ms"], 3)
        out["ratio_p99"] = round(ours["sequential"]["p99_ms"] / peer["sequential"]["p99_ms"], 3)
    return out


def group_sampling(exporters: dict[str, Exporter], size: Size) -> dict[str, Any]:
    _log(f"2. sampling cost: {', '.join(exporters)} together, {size.idle_seconds:g} s idle")
    out: dict[str, Any] = sample_cost(exporters, size.idle_seconds)
    ours = out["gpu-exporter"]
    ours["sample_duration_ms"] = round(1000 * (sample_duration(exporters["gpu-exporter"]) or 0), 2)
    peer = out.get("nvitop-exporter")
    if peer and peer["cpu_seconds"]:
        out["ratio_cpu"] = round((ours["cpu_seconds"] or 0) / peer["cpu_seconds"], 3)
    return out


def group_choose(ex: Exporter, size: Size) -> dict[str, Any]:
    _log("3. /choose vs /healthz at 32 clients")
    out = {
        "healthz": concurrent(ex, "/healthz", size.concurrent * 2, 32, size),
        "choose": concurrent(ex, "/choose?n=1&lease=0", size.concurrent * 2, 32, size),
    }
    out["ratio_p50"] = round(out["choose"]["p50_ms"] / out["healthz"]["p50_ms"], 3)
    return out


def group_hostile(ex: Exporter, size: Size) -> dict[str, Any]:
    """The scraper's and the job's latency while slowloris and idle clients attack, and
    then while clients pipeline requests and never read the answers."""
    _log(f"6. hostile clients: {size.hostile} slowloris + {size.hostile} idle connections")
    ramp = min(2.0, size.hostile_seconds / 2)
    target = hostile.Target(ex.port)
    attack = hostile.Attack(slowloris=size.hostile, idle=size.hostile)
    report = hostile.measure(target, attack, seconds=size.hostile_seconds, ramp_seconds=ramp)
    report["worst"] = hostile.worst(report)
    report["connections"] = {"slowloris": size.hostile, "idle": size.hostile}
    unread = size.hostile // 5
    _log(f"6. hostile clients: {unread} pipelining connections that never read")
    pipelined = hostile.measure(
        target,
        hostile.Attack(pipeline_unread=unread),
        seconds=size.hostile_seconds,
        ramp_seconds=ramp,
    )
    pipelined["worst"] = hostile.worst(pipelined)
    pipelined["connections"] = {"pipeline_unread": unread}
    report["unread"] = pipelined
    return report


def group_scaling(lib: Path, work: Path, size: Size) -> list[dict[str, Any]]:
    points = [(d, 0) for d in size.devices] + [(GPUS, p) for p in size.processes]
    out = []
    for devices, processes in points:
        _log(f"4. scaling: {devices} devices, {processes} processes")
        with running("gpu-exporter", lib, lab(devices, processes), work) as ex:
            idle = sample_cost({ex.kind: ex}, size.scaling_seconds)[ex.kind]  # never scraped
            latency = sequential(
                ex.port, "/metrics", size.scaling_sequential, size.phase_seconds, {}
            )
            # scraped a moment ago: each new sample is now also rendered ahead
            scraped = sample_cost({ex.kind: ex}, size.scaling_seconds)[ex.kind]
            out.append(
                {
                    "devices": devices,
                    "processes": processes,
                    "metrics_p50_ms": latency["p50_ms"],
                    "metrics_p99_ms": latency["p99_ms"],
                    "body_bytes": latency["body_bytes"],
                    "sample_duration_ms": round(1000 * (sample_duration(ex) or 0), 2),
                    "nvml_calls_per_sample": idle["nvml_calls_per_sample"],
                    "cpu_percent_of_one_core": idle["cpu_percent_of_one_core"],
                    "cpu_percent_of_one_core_scraped": scraped["cpu_percent_of_one_core"],
                }
            )
    return out


def group_rss(ex: Exporter, size: Size, peer: Exporter | None) -> dict[str, Any]:
    """RSS after start, after a short warm-up of every route, and after ``rss_requests``."""
    _log(f"5. RSS after start and after {size.rss_requests} requests")
    out: dict[str, Any] = {"after_start_mib": ex.rss_mib()}
    if peer is not None:
        out["nvitop_exporter_after_start_mib"] = peer.rss_mib()
    paths = ("/metrics", "/choose?n=1&lease=0", "/healthz")
    load = replace(size, phase_seconds=120.0)
    for path in paths:  # warm-up: thread stacks, allocator arenas, caches
        concurrent(ex, path, 320, 16, load)
    out["after_warmup_mib"] = ex.rss_mib()
    done = 0
    out["after_each_third_mib"] = []
    for path in paths:
        done += concurrent(ex, path, size.rss_requests // 3, 16, load)["requests"]
        out["after_each_third_mib"].append(ex.rss_mib())
    out["requests"] = done
    out["after_requests_mib"] = ex.rss_mib()
    if out["after_start_mib"] and out["after_requests_mib"]:
        out["growth_mib"] = round(out["after_requests_mib"] - out["after_start_mib"], 1)
        out["growth_after_warmup_mib"] = round(
            out["after_requests_mib"] - (out["after_warmup_mib"] or 0), 1
        )
    return out


# -- report --------------------------------------------------------------------------------------


def _f(value: Any, digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _pp(result: dict[str, Any] | None) -> str | None:
    """``"p50 / p99"`` of a latency result, in ms."""
    if result is None:
        return None
    return f"{_f(result['p50_ms'])} / {_f(result['p99_ms'])}"


def _load(result: dict[str, Any] | None) -> str | None:
    """``"req/s; p50 / p99; server CPU µs per request"`` of a concurrent result."""
    if result is None:
        return None
    cpu = result.get("server_cpu_us_per_request")
    return f"{result['requests_per_second']}; {_pp(result)}; {_f(cpu)}"


def markdown(report: dict[str, Any]) -> str:
    """The results table of docs/performance.md, with the targets and whether each is met."""
    meta = report["meta"]
    lat, smp, cho, rss = (report[k] for k in ("latency", "sampling", "choose", "rss"))
    ours_l, ours_s = lat["gpu-exporter"], smp["gpu-exporter"]
    peer_l, peer_s = lat.get("nvitop-exporter"), smp.get("nvitop-exporter")
    quick = meta["mode"] == "quick"
    label = "**Preliminary** (`--quick`: small sizes)" if quick else "Full run"
    idle_note = ""
    if idle_meta := meta.get("idle_from"):
        idle_note = (
            f" Group 6 from a later `--idle-only` run, {idle_meta['date']} "
            f"(`bench/results/{idle_meta['file']}`, {idle_meta['wall_seconds']} s)."
        )
    if calls_meta := meta.get("calls_from"):
        idle_note += (
            f" NVML calls per GPU per sample from a later `--calls-only` run, "
            f"{calls_meta['date']} (`bench/results/{calls_meta['file']}`)."
        )
    lines = [
        f"{label}, {meta['date']}: {meta['cpu_count']} CPUs ({meta['cpu']}), "
        f"{meta['platform']}, Python {meta['python']}, gpu-exporter "
        f"{meta['gpu_exporter_version']}; peer: {meta['peer']}. "
        f"Raw figures: `bench/results/{meta['file']}` ({meta['wall_seconds']} s).{idle_note}",
        "",
        "| # | Measure (8 GPUs unless said) | gpu-exporter | nvitop-exporter | Target | Met |",
        "|---|---|--:|--:|---|---|",
    ]

    def row(group: str, what: str, ours: Any, peer: Any, target: str, met: bool | None) -> None:
        mark = "" if met is None else ("yes" if met else "**no**")
        lines.append(f"| {group} | {what} | {_f(ours)} | {_f(peer)} | {target} | {mark} |")

    seq, peer_seq = ours_l["sequential"], peer_l["sequential"] if peer_l else None
    half = peer_seq is None or seq["p50_ms"] <= peer_seq["p50_ms"] / 2
    n_seq = f"{seq['requests']:,}"
    row(
        "1",
        f"`/metrics` p50 ms, {n_seq} sequential",
        seq["p50_ms"],
        peer_seq and peer_seq["p50_ms"],
        "≤ 1; ≤ ½ peer",
        seq["p50_ms"] <= 1 and half,
    )
    row(
        "1",
        "`/metrics` p99 ms, sequential",
        seq["p99_ms"],
        peer_seq and peer_seq["p99_ms"],
        "≤ 3",
        seq["p99_ms"] <= 3,
    )
    row(
        "1",
        "`/metrics` p50 / p99 ms, gzip + OpenMetrics (as Prometheus asks)",
        _pp(ours_l["sequential_gzip"]),
        _pp(peer_l and peer_l["sequential_gzip"]),
        "",
        None,
    )
    if "sparse" in ours_l:
        row(
            "1",
            f"`/metrics` p50 / max ms, gzip, {ours_l['sparse']['requests']} scrapes each "
            "1.2 samples apart (as one Prometheus sees it)",
            f"{_f(ours_l['sparse']['p50_ms'])} / {_f(ours_l['sparse']['max_ms'])}",
            f"{_f(peer_l['sparse']['p50_ms'])} / {_f(peer_l['sparse']['max_ms'])}"
            if peer_l
            else None,
            "",
            None,
        )
    for what, value, target, met in kubelet_row.rows(report.get("kubernetes")):
        row("1", what, value, None, target, met)
    row(
        "1",
        "`/metrics`, 16 concurrent scrapers: req/s; p50 / p99 ms; CPU µs/request",
        _load(ours_l["concurrent_16"]),
        _load(peer_l and peer_l["concurrent_16"]),
        "",
        None,
    )
    expected = ours_s.get("expected_calls_per_sample")
    calls = ours_s["nvml_calls_per_sample"]
    # (results from before issue 31 have no figure: then 19 slow calls per GPU on the card)
    slow = ours_s.get("slow_calls_per_sample", GPUS * 19 / 30)
    row(
        "2",
        "NVML calls per sample",
        calls,
        peer_s and peer_s["nvml_calls_per_sample"],
        f"fast calls × devices + 1 = {expected}, + slow calls every 30 s",
        # + 0.05: the figure is rounded to one decimal
        expected is not None
        and expected <= calls <= expected + slow + gpm_calls_per_sample() + 0.05,
    )
    cpu = ours_s["cpu_percent_of_one_core"]
    peer_cpu = peer_s and peer_s["cpu_percent_of_one_core"]
    cpu_ok = cpu is not None and cpu <= 1 and (not peer_cpu or cpu <= peer_cpu / 2)
    row(
        "2",
        f"CPU % of one core, idle, 1 s interval, {ours_s['window_seconds']:.0f} s window",
        cpu,
        peer_cpu,
        "≤ 1; ≤ ½ peer",
        cpu_ok,
    )
    row(
        "2",
        "CPU ms per sample",
        ours_s["cpu_ms_per_sample"],
        peer_s and peer_s["cpu_ms_per_sample"],
        "",
        None,
    )
    row(
        "2",
        "sample duration ms (`gpu_exporter_sample_duration_seconds`)",
        ours_s.get("sample_duration_ms"),
        None,
        "",
        None,
    )
    for what, ours, peer, target, met in calls_rows(report.get("calls", [])):
        row("2", what, ours, peer, target, met)
    ch, hz = cho["choose"], cho["healthz"]
    rate = ch["requests_per_second"] or 0
    row(
        "3",
        "`/choose`, 32 clients: req/s; p50 / p99 ms; CPU µs/request",
        _load(ch),
        None,
        "≥ 2,000 req/s",
        rate >= 2000,
    )
    row(
        "3",
        "`/healthz` (no-op baseline), 32 clients: req/s; p50 / p99 ms; CPU µs/request",
        _load(hz),
        None,
        "",
        None,
    )
    row(
        "3",
        "`/choose` p50 ÷ `/healthz` p50",
        cho["ratio_p50"],
        None,
        "≤ 1.3",
        cho["ratio_p50"] <= 1.3,
    )
    growth = rss.get("growth_mib")
    row(
        "5",
        "RSS MiB after start",
        rss["after_start_mib"],
        rss.get("nvitop_exporter_after_start_mib"),
        "≤ 60 MB",
        (rss["after_start_mib"] or 0) <= 57.2,
    )
    row(
        "5",
        "RSS MiB after a warm-up (320 requests to each route); after each third of the load",
        f"{_f(rss.get('after_warmup_mib'))}; "
        + " / ".join(_f(x) for x in rss.get("after_each_third_mib", [])),
        None,
        "",
        None,
    )
    row(
        "5",
        f"RSS growth MiB over {rss['requests']:,} requests (from start; from warm-up)",
        f"{_f(growth)}; {_f(rss.get('growth_after_warmup_mib'))}",
        None,
        "≤ 5 MB",
        growth is not None and growth <= 4.7,
    )
    for what, ours, peer, target, met in idle.rows(report.get("idle", [])):
        row("6", what, ours, peer, target, met)
    if hostile_report := report.get("hostile"):
        worst, conns = hostile_report["worst"], hostile_report["connections"]
        row(
            "7",
            f"hostile clients ({conns['slowloris']} slowloris + {conns['idle']} idle "
            "connections): the scraper's and job's worst p99 ms; errors of "
            f"{worst['requests']:,} requests",
            f"{_f(worst['p99_ms'])}; {worst['errors']}",
            None,
            "≤ 100 ms, 0 errors",
            worst["p99_ms"] <= 100 and worst["errors"] == 0,
        )
    if unread_report := (report.get("hostile") or {}).get("unread"):
        worst = unread_report["worst"]
        row(
            "7",
            f"hostile clients ({unread_report['connections']['pipeline_unread']} connections "
            "pipelining requests, never reading): the scraper's and job's worst p99 ms; "
            f"errors of {worst['requests']:,} requests",
            f"{_f(worst['p99_ms'])}; {worst['errors']}",
            None,
            "≤ 100 ms, 0 errors",
            worst["p99_ms"] <= 100 and worst["errors"] == 0,
        )
    lines += [
        "",
        "Scaling (group 4), gpu-exporter:",
        "",
        "| Devices | Processes | `/metrics` p50 / p99 ms | Body KiB | Sample ms | NVML calls "
        "per sample | CPU %: idle; recently scraped | Target | Met |",
        "|--:|--:|--:|--:|--:|--:|--:|---|---|",
    ]
    for point in report["scaling"]:
        target, met = (
            ("p99 ≤ 10 ms", point["metrics_p99_ms"] <= 10) if point["devices"] == 64 else ("", None)
        )
        mark = "" if met is None else ("yes" if met else "**no**")
        lines.append(
            f"| {point['devices']} | {point['processes']:,} | "
            f"{_f(point['metrics_p50_ms'])} / {_f(point['metrics_p99_ms'])} | "
            f"{point['body_bytes'] / 1024:.1f} | {_f(point['sample_duration_ms'])} | "
            f"{_f(point['nvml_calls_per_sample'], 0)} | {_f(point['cpu_percent_of_one_core'])}; "
            f"{_f(point.get('cpu_percent_of_one_core_scraped'))} | "
            f"{target} | {mark} |"
        )
    return "\n".join(lines) + "\n"


def write_doc_table(report: dict[str, Any], doc: Path = DOC) -> None:
    text = doc.read_text()
    start = text.index(TABLE_START) + len(TABLE_START)
    end = text.index(TABLE_END)
    doc.write_text(text[:start] + "\n" + markdown(report) + text[end:])


# -- main ------------------------------------------------------------------------------------------


def measure(size: Size, peer: bool, work: Path, lib: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    kinds = ["gpu-exporter"] + (["nvitop-exporter"] if peer else [])
    with contextlib.ExitStack() as stack:
        exporters: dict[str, Exporter] = {}
        for kind in kinds:
            _log(f"starting {kind} on 8 fake GPUs")
            exporters[kind] = stack.enter_context(running(kind, lib, lab(), work))
        report["rss_start"] = {k: e.rss_mib() for k, e in exporters.items()}
        report["sampling"] = group_sampling(exporters, size)  # first: nobody has scraped yet
        report["sampling"]["gpu-exporter"]["expected_calls_per_sample"] = _expected_calls()
        report["sampling"]["gpu-exporter"]["slow_calls_per_sample"] = slow_calls_per_sample()
        report["latency"] = group_latency(exporters, size)
        _log(f"1. /metrics latency, {size.sparse} scrapes each a new sample apart")
        for kind, result in sparse(exporters, size.sparse).items():
            report["latency"][kind]["sparse"] = result
        report["choose"] = group_choose(exporters["gpu-exporter"], size)
        report["hostile"] = group_hostile(exporters["gpu-exporter"], size)  # last: it may harm
    _log("1. /metrics latency with --kubernetes (a fake kubelet) and without, side by side")
    report["kubernetes"] = kubelet_row.measure(
        lambda args: running("gpu-exporter", lib, lab(), work, args),
        lambda port: sequential(port, "/metrics", size.sequential, size.phase_seconds * 3, {}),
        GPUS,
    )
    report["scaling"] = group_scaling(lib, work, size)
    report["calls"] = calls_per_gpu(lib, work, size, peer)
    _log(
        f"6. steady-state idle CPU: {size.idle.warmup_seconds:g} s warm-up, "
        f"{size.idle.window_seconds:g} s window, cases {size.idle.cases}"
    )
    report["idle"] = idle.idle_cpu(
        lambda kind, gpus: running(kind, lib, gpus, work), lab, size.idle, peer
    )
    with running("gpu-exporter", lib, lab(), work) as ex:
        report["rss"] = group_rss(ex, size, None)
    report["rss"]["nvitop_exporter_after_start_mib"] = report["rss_start"].get("nvitop-exporter")
    return report


def _expected_calls() -> int:
    """One nvmlDeviceGetCount_v2, then per GPU its fast calls (the handle is kept)."""
    return 1 + GPUS * per_sample_calls()


def _calls(when: str) -> int:
    """NVML calls per GPU to read the fields of cadence ``when`` (default groups, MIG off)."""
    from gpu_exporter.collect.groups import calls_per_gpu

    return calls_per_gpu(when)


def slow_calls_per_sample() -> float:
    """The slow calls (``collect/fields.py`` SLOW) for 8 GPUs every --slow-interval (30
    samples): what a window averages at most on top of :func:`_expected_calls`. The
    "a100-sxm" card has no fan (asked once, then never again)."""
    from gpu_exporter.valuerow import SLOW

    return GPUS * (_calls(SLOW) - (FAKE == "a100-sxm")) / 30


def gpm_calls_per_sample() -> float:
    """GPM's nvmlGpmSampleGet and nvmlGpmMetricsGet for 8 GPUs every --gpm-interval, on
    average per sample, on the "h100" card (none on the others: they have no GPM)."""
    return GPUS * 2 * INTERVAL_SECONDS / GPM_INTERVAL_SECONDS if FAKE == "h100" else 0.0


def per_sample_calls() -> int:
    """The calls made every (fast) sample on a GPU of :func:`lab` (MIG off)."""
    from gpu_exporter.valuerow import FAST

    return _calls(FAST)


def with_idle(report: dict[str, Any], idle_run: dict[str, Any], file: str) -> dict[str, Any]:
    """``report`` with group 6 taken from an ``--idle-only`` run (``idle_run``, read from
    ``bench/results/<file>``), which the table's first line then names."""
    meta = idle_run["meta"]
    idle_from = {"date": meta["date"], "file": file, "wall_seconds": meta["wall_seconds"]}
    return {**report, "meta": {**report["meta"], "idle_from": idle_from}, "idle": idle_run["idle"]}


def _idle_only(
    size: Size, peer: bool, note: str, work: Path, lib: Path, out: Path | None, started: float
) -> int:
    """``--idle-only``: group 6 alone, its rows printed and written to ``idle.json``."""
    results = idle.idle_cpu(lambda k, g: running(k, lib, g, work), lab, size.idle, peer)
    report = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": servers.cpu_model(),
            "cpu_count": os.cpu_count(),
            "peer": f"nvitop-exporter ({note})" if peer else note,
            "fake": FAKE,
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "idle": asdict(size.idle),
            "wall_seconds": round(time.monotonic() - started, 1),
        },
        "idle": results,
    }
    path = out or RESULTS_DIR / "idle.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    for what, ours, other, target, met in idle.rows(results):
        mark = "" if met is None else ("yes" if met else "**no**")
        print(f"| 6 | {what} | {_f(ours)} | {_f(other)} | {target} | {mark} |")
    print(f"JSON: {path}")
    return 0


def _metric_names_only(
    size: Size, modes: list[str], work: Path, lib: Path, out: Path | None, started: float
) -> int:
    """``--metric-names``: group 1 (``/metrics`` latency) of gpu-exporter alone, once per
    ``serve --metric-names`` mode, one after another on the same machine; printed and written
    to ``metric-names.json``."""
    results: dict[str, Any] = {}
    load_before = [round(x, 2) for x in os.getloadavg()]
    for mode in modes:
        _log(f"starting gpu-exporter --metric-names={mode} on {GPUS} fake GPUs")
        with running("gpu-exporter", lib, lab(), work, ("--metric-names", mode)) as ex:
            results[mode] = group_latency({"gpu-exporter": ex}, size)["gpu-exporter"]
    report = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": servers.cpu_model(),
            "cpu_count": os.cpu_count(),
            "fake": FAKE,
            "load_average_before_after": [load_before, [round(x, 2) for x in os.getloadavg()]],
            "wall_seconds": round(time.monotonic() - started, 1),
        },
        "metric_names": results,
    }
    path = out or RESULTS_DIR / "metric-names.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(
        "| `--metric-names` | body KiB (gzip) | p50 / p99 ms | gzip + OpenMetrics p50 / p99 ms "
        "| 16 concurrent: req/s; p50 / p99 ms; CPU µs/request |"
    )
    print("|---|--:|--:|--:|--:|")
    for mode, r in results.items():
        plain, gzipped = (r[k]["body_bytes"] / 1024 for k in ("sequential", "sequential_gzip"))
        kib = f"{plain:.1f} ({gzipped:.1f})"
        print(
            f"| `{mode}` | {kib} | {_pp(r['sequential'])} | {_pp(r['sequential_gzip'])} "
            f"| {_load(r['concurrent_16'])} |"
        )
    after = report["meta"]["load_average_before_after"][1]  # type: ignore[index]
    print(f"load average before / after: {load_before} / {after}")
    print(f"JSON: {path}")
    return 0


def _calls_only(
    size: Size, peer: bool, note: str, work: Path, lib: Path, out: Path | None, started: float
) -> int:
    """``--calls-only``: NVML calls per GPU per sample alone, printed and written to
    ``calls.json``."""
    results = calls_per_gpu(lib, work, size, peer)
    report = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "peer": f"nvitop-exporter ({note})" if peer else note,
            "fake": FAKE,
            "window_seconds": size.calls_seconds,
            "wall_seconds": round(time.monotonic() - started, 1),
        },
        "calls": results,
    }
    path = out or RESULTS_DIR / "calls.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    for what, ours, other, target, met in calls_rows(results):
        mark = "" if met is None else ("yes" if met else "**no**")
        print(f"| 2 | {what} | {_f(ours)} | {_f(other)} | {target} | {mark} |")
    print(f"JSON: {path}")
    return 0


def _latency_only(
    size: Size, peer: bool, note: str, work: Path, lib: Path, out: Path | None
) -> int:
    """``--latency-only``: groups 2 (sampling cost, nobody scraping) and 1 (``/metrics``
    latency) alone, both exporters side by side, into ``latency.json``."""
    report: dict[str, Any] = {"meta": {"peer": note, "fake": FAKE, "cpu": servers.cpu_model()}}
    kinds = ["gpu-exporter"] + (["nvitop-exporter"] if peer else [])
    with contextlib.ExitStack() as stack:
        exporters = {k: stack.enter_context(running(k, lib, lab(), work)) for k in kinds}
        report["sampling"] = group_sampling(exporters, size)
        report["latency"] = group_latency(exporters, size)
    report["meta"]["load_average"] = [round(x, 2) for x in os.getloadavg()]
    path = out or RESULTS_DIR / "latency.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    for kind in kinds:
        seq, cpu = report["latency"][kind]["sequential"], report["sampling"][kind]
        print(
            f"{kind}: /metrics p50 {seq['p50_ms']} ms, p99 {seq['p99_ms']} ms; idle CPU "
            f"{cpu['cpu_percent_of_one_core']} % of a core; {cpu['nvml_calls_per_sample']} calls"
        )
    for key in ("ratio_p50", "ratio_p99"):
        print(f"{key}: {report['latency'].get(key)}")
    print(f"ratio_cpu: {report['sampling'].get('ratio_cpu')}")
    print(f"JSON: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument("--no-peer", action="store_true", help="measure gpu-exporter only")
    parser.add_argument("--out", type=Path, help="JSON file (default bench/results/exporter.json)")
    parser.add_argument(
        "--report",
        nargs="?",
        const=RESULTS_DIR / "exporter.json",
        type=Path,
        metavar="RESULTS.json",
        help="only regenerate the table in docs/performance.md from a results file",
    )
    parser.add_argument(
        "--doc", type=Path, default=DOC, help="the document whose table --report rewrites"
    )
    parser.add_argument(
        "--idle",
        type=Path,
        metavar="IDLE.json",
        help="with --report: group 6's rows from this --idle-only results file instead",
    )
    parser.add_argument(
        "--fake", choices=FAKES, default=FAKES[0], help="the fake cards (default: every field)"
    )
    parser.add_argument(
        "--idle-window",
        type=float,
        nargs=2,
        metavar=("WARMUP", "WINDOW"),
        help="with --idle-only: warm-up and window seconds (default 30 60)",
    )
    parser.add_argument(
        "--idle-only",
        action="store_true",
        help="only group 6 (steady-state idle CPU), into bench/results/idle.json",
    )
    parser.add_argument(
        "--metric-names",
        nargs="+",
        choices=METRIC_NAMES,
        metavar="MODE",
        help="only group 1 (/metrics latency) of gpu-exporter, once per serve --metric-names "
        "MODE given (gpu-exporter, dcgm, both), into bench/results/metric-names.json",
    )
    parser.add_argument(
        "--calls-only",
        action="store_true",
        help="only NVML calls per GPU per sample (group 2), into bench/results/calls.json",
    )
    parser.add_argument(
        "--calls",
        type=Path,
        metavar="CALLS.json",
        help="with --report: the calls-per-GPU rows from this --calls-only results file",
    )
    parser.add_argument(
        "--latency-only",
        action="store_true",
        help="only groups 2 and 1 (sampling cost, /metrics latency), into "
        "bench/results/latency.json",
    )
    args = parser.parse_args(argv)
    if args.report is not None:
        report = json.loads(args.report.read_text())
        if args.idle is not None:
            report = with_idle(report, json.loads(args.idle.read_text()), args.idle.name)
        if args.calls is not None:
            calls_run = json.loads(args.calls.read_text())
            meta = {**report["meta"], "calls_from": {"date": calls_run["meta"]["date"]}}
            report = {**report, "meta": meta, "calls": calls_run["calls"]}
            report["meta"]["calls_from"]["file"] = args.calls.name
        write_doc_table(report, args.doc)
        print(markdown(report))
        return 0

    global FAKE
    FAKE = args.fake
    size = QUICK if args.quick else FULL
    if args.idle_window:
        warmup, window = args.idle_window
        size = replace(size, idle=replace(size.idle, warmup_seconds=warmup, window_seconds=window))
    hostile.raise_fd_limit()  # before any exporter starts: they inherit it (group 7)
    out: Path = args.out or RESULTS_DIR / ("exporter-quick.json" if args.quick else "exporter.json")
    started = time.monotonic()
    peer, peer_note = (
        (False, "skipped (--no-peer)")
        if args.no_peer or args.metric_names
        else peer_available(create=True)
    )
    if not peer:
        _log(f"nvitop-exporter: {peer_note}; measuring gpu-exporter alone")
    from gpu_exporter import __version__

    with tempfile.TemporaryDirectory(prefix="gpu-exporter-bench-") as tmp:
        work = Path(tmp)
        lib = fakenvml.build(work / "lib")
        if args.idle_only:
            return _idle_only(size, peer, peer_note, work, lib, args.out, started)
        if args.metric_names:
            return _metric_names_only(size, args.metric_names, work, lib, args.out, started)
        if args.calls_only:
            return _calls_only(size, peer, peer_note, work, lib, args.out, started)
        if args.latency_only:
            return _latency_only(size, peer, peer_note, work, lib, args.out)
        report = measure(size, peer, work, lib)
    report = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "mode": "quick" if args.quick else "full",
            "file": out.name,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu": servers.cpu_model(),
            "cpu_count": os.cpu_count(),
            "gpu_exporter_version": __version__,
            "versions": servers.versions(),
            "peer": peer_note if not peer else f"nvitop-exporter ({peer_note})",
            "size": asdict(size),
            "gpus": GPUS,
            "interval_seconds": INTERVAL_SECONDS,
            "wall_seconds": round(time.monotonic() - started, 1),
        },
        **report,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(out.name + ".tmp")
    tmp_out.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp_out, out)
    table = markdown(report)
    print(table)
    if not args.quick and not args.out:
        write_doc_table(report)
        print(f"updated {DOC.relative_to(ROOT)}")
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
