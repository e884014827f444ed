"""Sustained mixed load against a real `gpu-exporter serve`: errors and memory growth.

    .venv/bin/python bench/load.py [--seconds 60] [--min-requests 100000] [--gpus 8]

Starts the exporter (simulated GPUs) on loopback, warms it up (15 s of the same mix, so that
every request thread and allocator arena is in use), then drives it with ``wrk``
(Debian package ``wrk``; bench/load.lua mixes /metrics, /choose advice, /gpus and /readyz
over 16 connections) for ``--seconds``, and keeps going until ``--min-requests`` were served.
Reports requests, requests/s, non-200 answers and socket errors, and the exporter's RSS
after warm-up and at the end. Writes bench/results/load.json unless ``--no-write``.

    .venv/bin/python bench/load.py --throughput

measures instead requests/s and p50/p99 of /healthz (the no-op baseline), /choose advice and
/metrics with wrk's 32 connections, 10 s each, into bench/results/throughput.json. wrk is a
C load generator, so it leaves the server most of the two cores that bench/run.py's Python
clients share with it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import servers  # noqa: E402  (bench/servers.py: ports, readiness, /proc helpers)

LUA = Path(__file__).with_name("load.lua")


@dataclass
class LoadResult:
    seconds: float
    requests: int
    requests_per_second: float
    non_200: int
    socket_errors: int
    rss_after_warmup_bytes: int
    rss_at_end_bytes: int

    @property
    def rss_growth_bytes(self) -> int:
        return self.rss_at_end_bytes - self.rss_after_warmup_bytes


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def wrk(url: str, seconds: float, connections: int = 16) -> tuple[int, int, int]:
    """(requests, non-200 answers, socket errors) of one wrk run."""
    binary = shutil.which("wrk")
    if binary is None:
        raise RuntimeError("wrk not installed (Debian package 'wrk')")
    out = subprocess.run(
        [binary, "-t2", f"-c{connections}", f"-d{max(1, round(seconds))}s", "-s", str(LUA), url],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 60,
    ).stdout
    requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return (
        requests,
        int(non2xx.group(1)) if non2xx else 0,
        sum(int(x) for x in errors.groups()) if errors else 0,
    )


def run(
    seconds: float = 60.0, min_requests: int = 100_000, gpus: int = 8, warmup: float = 15.0
) -> LoadResult:
    with exporter(gpus) as (base, pid):
        wrk(base, warmup)
        rss_start = rss_bytes(pid)
        started = time.monotonic()
        total = non200 = errors = 0
        remaining = seconds
        while True:
            n, bad, err = wrk(base, remaining)
            total, non200, errors = total + n, non200 + bad, errors + err
            if total >= min_requests or time.monotonic() - started > 3 * seconds:
                break
            # Not there yet (a slow or busy machine): go on at the rate seen so far.
            rate = total / (time.monotonic() - started)
            remaining = min(seconds, (min_requests - total) / max(rate, 1.0) + 1)
        elapsed = time.monotonic() - started
        return LoadResult(
            round(elapsed, 1),
            total,
            round(total / elapsed),
            non200,
            errors,
            rss_start,
            rss_bytes(pid),
        )


THROUGHPUT_PATHS = ("/healthz", "/choose?n=1&lease=0", "/metrics")


def throughput(
    seconds: float = 10.0, connections: int = 32, gpus: int = 8
) -> dict[str, dict[str, float]]:
    """Requests/s and latency percentiles per route, wrk with ``connections`` connections."""
    binary = shutil.which("wrk")
    if binary is None:
        raise RuntimeError("wrk not installed (Debian package 'wrk')")
    results = {}
    with exporter(gpus) as (base, _):
        for path in THROUGHPUT_PATHS:
            out = subprocess.run(
                [
                    binary,
                    "-t2",
                    f"-c{connections}",
                    f"-d{round(seconds)}s",
                    "--latency",
                    base + path,
                ],
                capture_output=True,
                text=True,
                check=True,
                timeout=seconds + 60,
            ).stdout
            rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
            p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)", out)
            p99 = re.search(r"99%\s+([\d.]+)(us|ms|s)", out)
            non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
            results[path] = {
                "requests_per_second": float(rate.group(1)) if rate else 0.0,
                "p50_ms": _ms(p50),
                "p99_ms": _ms(p99),
                "non_200": int(non2xx.group(1)) if non2xx else 0,
            }
    return results


def _ms(match: re.Match[str] | None) -> float:
    if match is None:
        return float("nan")
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[match.group(2)]
    return round(float(match.group(1)) * scale, 3)


@contextlib.contextmanager
def exporter(gpus: int) -> Iterator[tuple[str, int]]:
    """``gpu-exporter serve --simulate GPUS`` on a free loopback port: (base URL, pid)."""
    port = servers.free_port()
    base = f"http://127.0.0.1:{port}"
    # stderr to a file, not a pipe: a pipe nobody reads fills up and blocks the server.
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "gpu_exporter", "serve", "--simulate", str(gpus)),
                *("--listen-address", f"127.0.0.1:{port}", "--log-level", "warning"),
            ],
            env={**os.environ, "GPU_EXPORTER_STATE_DIR": tempfile.mkdtemp()},
            cwd=ROOT,
            stderr=log,
        )
        try:
            try:
                servers.wait_until_ok(base + "/readyz", proc, 20, "the exporter")
            except RuntimeError as exc:
                log.seek(0)
                raise RuntimeError(f"{exc}: {log.read()}") from None
            yield base, proc.pid
        finally:
            proc.terminate()
            proc.wait(timeout=15)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--min-requests", type=int, default=100_000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument(
        "--throughput",
        action="store_true",
        help="instead: requests/s and p50/p99 of /healthz, /choose and /metrics, 32 connections",
    )
    args = parser.parse_args()
    if args.throughput:
        rates = throughput(gpus=args.gpus)
        report: dict[str, Any] = {
            "routes": rates,
            "choose_p50_over_healthz_p50": round(
                rates["/choose?n=1&lease=0"]["p50_ms"] / rates["/healthz"]["p50_ms"], 2
            ),
            **_machine(args.gpus),
        }
        _write("throughput.json", report, args.no_write)
        return 0
    result = run(args.seconds, args.min_requests, args.gpus)
    report = {
        **asdict(result),
        "rss_growth_bytes": result.rss_growth_bytes,
        **_machine(args.gpus),
    }
    _write("load.json", report, args.no_write)
    return 0 if result.non_200 == 0 and result.socket_errors == 0 else 1


def _machine(gpus: int) -> dict[str, Any]:
    return {
        "gpus": gpus,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def _write(name: str, report: dict[str, Any], no_write: bool) -> None:
    print(json.dumps(report, indent=2))
    if not no_write:
        out = ROOT / "bench" / "results" / name
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
