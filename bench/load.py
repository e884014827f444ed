"""Sustained mixed load against a real `gpu-exporter serve`: errors and memory growth.

    .venv/bin/python bench/load.py [--seconds 60] [--min-requests 100000] [--gpus 8]

Starts the exporter (simulated GPUs) on loopback, warms it up, then drives it with ``wrk``
(Debian package ``wrk``; bench/load.lua mixes /metrics, /choose advice, /gpus and /readyz
over 16 connections) for ``--seconds``, and keeps going until ``--min-requests`` were served.
Reports requests, requests/s, non-200 answers and socket errors, and the exporter's RSS
after warm-up and at the end. Writes bench/results/load.json unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
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


def free_port() -> int:
    sys.path.insert(0, str(ROOT))
    from gpu_exporter.server import free_port as free

    return free()


def run(
    seconds: float = 60.0, min_requests: int = 100_000, gpus: int = 8, warmup: float = 5.0
) -> LoadResult:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # stderr to a file, not a pipe: a pipe nobody reads fills up and blocks the server.
    with tempfile.TemporaryFile(mode="w+") as log:
        return _drive(base, log, seconds, min_requests, gpus, warmup)


def _drive(
    base: str, log: Any, seconds: float, min_requests: int, gpus: int, warmup: float
) -> LoadResult:
    port = base.rsplit(":", 1)[1]
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
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(base + "/readyz", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"exporter did not start: {proc.stderr.read() if proc.stderr else ''}"
                )
            time.sleep(0.1)
        wrk(base, warmup)
        rss_start = rss_bytes(proc.pid)
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
            rss_bytes(proc.pid),
        )
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--min-requests", type=int, default=100_000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    result = run(args.seconds, args.min_requests, args.gpus)
    report = {
        **asdict(result),
        "rss_growth_bytes": result.rss_growth_bytes,
        "gpus": args.gpus,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(report, indent=2))
    if not args.no_write:
        out = ROOT / "bench" / "results" / "load.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if result.non_200 == 0 and result.socket_errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
