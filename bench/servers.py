"""Compare WSGI servers for the exporter on this machine: cheroot, waitress, gunicorn.

Run from the repository root::

    .venv/bin/python bench/servers.py            # default size, about 2½ minutes
    .venv/bin/python bench/servers.py --quick    # a smoke run, under 20 s

cheroot is the project's own dependency. waitress and gunicorn are not, and must not be
installed into the project's environment; put them in a separate directory instead::

    .venv/bin/pip install --target /tmp/benchdeps waitress gunicorn

``--deps DIR`` (default ``$BENCH_DEPS`` or ``/tmp/benchdeps``) is added to ``sys.path`` here
and to ``PYTHONPATH`` for the server processes; a server that cannot be imported is skipped
with a note.

Each server runs the real app — 8 simulated GPUs, a sampler thread every second, the lease
table, ``GpuCollector`` and ``ProcessCollector``, wired as ``gpu-exporter serve --simulate 8``
wires them — in a subprocess of its own on a free 127.0.0.1 port:

* ``gpu-exporter``: ``gpu_exporter.web.server.Server``, the production server (the asyncio
  front end since issue 14; cheroot before), 16 request threads;
* ``waitress``: ``create_server(app, threads=16)``;
* ``gunicorn``: one worker, ``-k gthread --threads 16 -w 1``; the app and its sampler are
  built in the worker, after the fork;
* ``cheroot`` (not in ``--quick``; where cheroot is installed): plain cheroot with a listen
  backlog of 1024 instead of its default of 5;
* on request (``--servers``), the candidates of issue 14, which ``bench/candidates.py`` puts
  under hostile clients: ``waitress-1024`` (waitress with ``connection_limit=1024``),
  ``uvicorn`` (asyncio + h11, the WSGI app in a2wsgi's pool of 16 threads), ``hypercorn``
  (asyncio + h11, WSGI mode) and ``granian`` (Rust, one worker process, 16 blocking
  threads). ``BENCH_TLS_CERT``/``BENCH_TLS_KEY`` make each that can serve TLS.

Measured, against ``/healthz`` (the no-op baseline), ``/choose?n=1&lease=0`` and
``/metrics`` (``lease=0``: the same selection under the same lock, without claiming the GPU
for 60 s, which would leave nothing to choose after 8 requests):

* sequential latency: one keep-alive connection, one request at a time;
* throughput: 16 keep-alive connections, each sending its share of a fixed number of
  requests back to back, and the server's CPU time per request over that window.

Every server is started first and they all stay up; the measurements then run in rounds
(3 by default), each round visiting the servers in a rotated order, and the table shows the
median over the rounds, so that drift in a shared machine's speed does not favour whichever
server happened to run first. Rounds after the first are skipped if the time budget is spent.

The load generator is Python (``http.client``). So that its own GIL does not cap the figures,
the 16 client connections are spread over ``--client-procs`` processes (default 2, 8 threads
each; 1 and 4 gave the same figures within noise on 2 cores). With 2 cores the client and the
server share the machine, which is why server CPU time per request is reported too.

Then three probes per server: ``/healthz`` latency while 15, then 20, never-satisfiable
``/choose?wait=`` long-polls hold request threads (16 in every server); 32 new connections
at once, one ``/choose`` each, as from job scripts that start together; and how fast and how
clearly the server fails when its port is already in use. Every phase is bounded by a
request count and a deadline; servers are stopped (SIGTERM, then SIGKILL of their process
group) before the script exits.

Results: a markdown table on stdout and JSON in ``bench/results/servers.json``
(``servers-quick.json`` for ``--quick``, so that a smoke run does not replace real figures).
"""

from __future__ import annotations

import argparse
import concurrent.futures as concurrent_futures
import contextlib
import datetime
import http.client
import importlib.metadata
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from multiprocessing.synchronize import Barrier, Lock
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.context import ForkContext, SpawnContext

    Context = ForkContext | SpawnContext

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
HOST = "127.0.0.1"
SERVERS = ("gpu-exporter", "waitress", "gunicorn")
VARIANTS = ("cheroot",)  # in the default run only
BACKLOG = 1024  # cheroot's listen backlog here; its own default is 5
# What must be importable, where not the name (gpu-exporter: the project itself):
MODULE = {"gpu-exporter": "gpu_exporter", "waitress-1024": "waitress"}
# /choose claims what it picks for 60 s by default, so 8 GPUs would be gone after 8 requests
# and every later one would be a 503; lease=0 runs the same selection under the same lock
# without holding anything.
ENDPOINTS = ("/healthz", "/choose?n=1&lease=0", "/metrics")
SERVER_THREADS = 16
CLIENTS = 16
GPUS = 8
SAMPLE_INTERVAL_SECONDS = 1.0
REQUEST_TIMEOUT_SECONDS = 10.0
READY_TIMEOUT_SECONDS = 30.0
BURST = 32  # new connections at once, as from job scripts that start together
LONG_POLL_WAITERS = (SERVER_THREADS - 1, SERVER_THREADS + 4)  # one thread left; none left
# Never satisfiable (one GPU more than there are), so each such request waits its full time.
LONG_POLL_PATH = f"/choose?n={GPUS + 1}&lease=0&wait={{seconds:g}}s"
VERSIONED = ("cheroot", "waitress", "gunicorn", "flask", "werkzeug", "prometheus-client")


@dataclass(frozen=True, slots=True)
class Size:
    rounds: int  # measurement rounds over all servers; the table shows their median
    rounds_budget_seconds: float  # no further round starts once it would end after this
    sequential: int  # timed requests per endpoint and round, one connection
    warmup: int  # untimed requests before each sequential run
    concurrent: int  # requests per endpoint and round over all clients
    phase_seconds: float  # deadline for each sequential or concurrent phase
    long_poll_seconds: float  # how long the long-poll probe's requests wait
    burst_rounds: int  # rounds of BURST new connections at once
    busy_port_seconds: float  # how long a server may take to give up on a port in use


DEFAULT_SIZE = Size(
    rounds=3,
    rounds_budget_seconds=125.0,
    sequential=600,
    warmup=50,
    concurrent=3200,
    phase_seconds=5.0,
    long_poll_seconds=1.5,
    burst_rounds=3,
    busy_port_seconds=15.0,
)
QUICK_SIZE = Size(
    rounds=1,
    rounds_budget_seconds=10.0,
    sequential=60,
    warmup=20,
    concurrent=240,
    phase_seconds=1.0,
    long_poll_seconds=0.3,
    burst_rounds=1,
    busy_port_seconds=2.0,
)


# -- the server side (runs in the subprocess) --------------------------------------------------


def _build_app() -> tuple[Any, Any]:
    """The app exactly as ``gpu-exporter serve --simulate 8`` builds it (daemon.build, no
    --state-dir), and the daemon whose threads to start after binding."""
    from gpu_exporter.config import ServeConfig
    from gpu_exporter.daemon import build

    config = ServeConfig(
        simulate=str(GPUS),
        interval_seconds=SAMPLE_INTERVAL_SECONDS,
        max_age_seconds=max(10.0, 5 * SAMPLE_INTERVAL_SECONDS),
    )
    daemon = build(config)
    return daemon.app, daemon


def _serve_until_sigterm(server: Any, daemon: Any) -> int:
    """Start the daemon's threads, serve, stop on SIGTERM (cheroot's stop() must not block it)."""

    def on_term(signum: int, frame: object) -> None:
        threading.Thread(target=server.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    daemon.start()  # after binding, as `gpu-exporter serve` does
    try:
        server.serve()
    finally:
        daemon.stop()
    return 0


def _tls_files() -> tuple[str, str] | None:
    """Certificate and key to serve TLS with (``bench/candidates.py --tls`` sets these)."""
    cert, key = os.environ.get("BENCH_TLS_CERT"), os.environ.get("BENCH_TLS_KEY")
    return (cert, key) if cert and key else None


def _serve_project(port: int) -> int:
    import ssl

    from gpu_exporter.web.limits import Limits
    from gpu_exporter.web.server import ListenError, Server

    app, daemon = _build_app()
    tls = None
    if files := _tls_files():
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*files)
        tls = lambda: context  # noqa: E731
    # As `serve` sizes it: one client address, as every load client here is, may use all but
    # 4 threads, so SERVER_THREADS of them, like the others.
    server = Server(app, HOST, port, limits=Limits(max_in_flight=SERVER_THREADS), tls=tls)
    try:
        server.bind()
    except ListenError as exc:
        print(f"gpu-exporter: {exc}", file=sys.stderr)
        return 1
    return _serve_until_sigterm(server, daemon)


def _serve_cheroot(port: int) -> int:
    from cheroot import wsgi

    app, daemon = _build_app()
    server = wsgi.Server((HOST, port), app, numthreads=SERVER_THREADS, request_queue_size=BACKLOG)
    server.server_name = "gpu-exporter"
    try:
        server.prepare()
    except OSError as exc:
        print(f"cheroot: cannot listen on {HOST}:{port}: {exc}", file=sys.stderr)
        return 1
    return _serve_until_sigterm(server, daemon)


def _serve_waitress(port: int, connection_limit: int = 100) -> int:
    from waitress import create_server

    app, daemon = _build_app()
    try:
        server = create_server(
            app, host=HOST, port=port, threads=SERVER_THREADS, connection_limit=connection_limit
        )
    except OSError as exc:
        print(f"waitress: cannot listen on {HOST}:{port}: {exc}", file=sys.stderr)
        return 1
    daemon.start()

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    try:
        server.run()
    finally:
        daemon.stop()
    return 0


def _serve_gunicorn(port: int) -> int:
    from gunicorn.app.base import BaseApplication

    options = {
        "bind": f"{HOST}:{port}",
        "workers": 1,
        "worker_class": "gthread",
        "threads": SERVER_THREADS,
        "loglevel": "warning",
        "graceful_timeout": 2,
        "control_socket_disable": True,  # gunicorn ≥ 25.1 would create ~/.gunicorn/gunicorn.ctl
    }

    class Application(BaseApplication):  # type: ignore[misc]
        def load_config(self) -> None:
            for key, value in options.items():
                if key in self.cfg.settings:
                    self.cfg.set(key, value)

        def load(self) -> Any:
            # Called in the worker, after the fork: the daemon (the NVML owner) starts here.
            app, daemon = _build_app()
            daemon.start()
            return app

    Application().run()
    return 0


def _serve_uvicorn(port: int) -> int:
    """uvicorn (asyncio + h11) with the WSGI app in a2wsgi's bounded thread pool."""
    import uvicorn
    from a2wsgi import WSGIMiddleware

    app, daemon = _build_app()
    files = _tls_files()
    config = uvicorn.Config(
        WSGIMiddleware(app, workers=SERVER_THREADS),
        host=HOST,
        port=port,
        http="h11",
        lifespan="off",
        log_level="warning",
        access_log=False,
        ssl_certfile=files[0] if files else None,
        ssl_keyfile=files[1] if files else None,
    )
    daemon.start()
    try:
        uvicorn.Server(config).run()  # its own SIGTERM handling; exits 1 on a busy port
    finally:
        daemon.stop()
    return 0


def _serve_hypercorn(port: int) -> int:
    """hypercorn (asyncio + h11) in WSGI mode: the app runs in the loop's thread pool."""
    import asyncio

    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    app, daemon = _build_app()
    config = Config()
    config.bind = [f"{HOST}:{port}"]
    config.loglevel = "WARNING"
    config.accesslog = None
    if files := _tls_files():
        config.certfile, config.keyfile = files

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await serve(app, config, shutdown_trigger=stop.wait, mode="wsgi")  # type: ignore[arg-type]

    daemon.start()
    try:
        asyncio.run(main())
    except OSError as exc:
        print(f"hypercorn: cannot listen on {HOST}:{port}: {exc}", file=sys.stderr)
        return 1
    finally:
        daemon.stop()
    return 0


def granian_app() -> Any:
    """granian's factory: runs in granian's worker process, after its fork/spawn."""
    app, daemon = _build_app()
    daemon.start()
    return app


def _serve_granian(port: int) -> int:
    """granian (Rust, hyper) with the WSGI interface: a supervisor and one worker process."""
    from granian import Granian
    from granian.constants import Interfaces
    from granian.log import LogLevels

    files = _tls_files()
    Granian(
        "servers:granian_app",
        factory=True,
        address=HOST,
        port=port,
        interface=Interfaces.WSGI,
        workers=1,
        blocking_threads=SERVER_THREADS,
        log_level=LogLevels.warning,
        log_access=False,
        ssl_cert=Path(files[0]) if files else None,
        ssl_key=Path(files[1]) if files else None,
    ).serve()
    return 0


SERVE = {
    "gpu-exporter": _serve_project,
    "waitress": _serve_waitress,
    "gunicorn": _serve_gunicorn,
    "cheroot": _serve_cheroot,
    # waitress with room for the hostile clients' 400 connections (its default is 100)
    "waitress-1024": lambda port: _serve_waitress(port, connection_limit=1024),
    "uvicorn": _serve_uvicorn,
    "hypercorn": _serve_hypercorn,
    "granian": _serve_granian,
}


# -- process bookkeeping -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def wait_until_ok(url: str, proc: subprocess.Popen[Any], timeout: float, what: str) -> None:
    """Poll ``url`` until it answers 200; RuntimeError if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
            if resp.status == 200:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become ready ({url})")
        time.sleep(0.1)


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (field 3 onwards), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _tree(root: int) -> list[int]:
    """``root`` and its descendants (gunicorn's worker is a child of its arbiter)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat is not None:
                parents[int(entry.name)] = int(stat[1])
    found, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += frontier
    return found


def _cpu_seconds(root: int) -> float | None:
    """User + system CPU time of the process tree, or None where /proc is not available."""
    if not Path("/proc/self/stat").exists():
        return None
    ticks = 0
    for pid in _tree(root):
        stat = _proc_stat(pid)
        if stat is not None:
            ticks += int(stat[11]) + int(stat[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _rss_mib(root: int) -> float | None:
    total = 0
    for pid in _tree(root):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return round(total / 1024, 1) if total else None


class LoggedProcess:
    """A server in a subprocess of its own session, its output in a temporary file; ready
    once ``ready_path`` answers 200 (and, where given, with ``ready_text`` in the body)."""

    def __init__(
        self,
        name: str,
        port: int,
        command: list[str],
        env: dict[str, str],
        *,
        cwd: Path | None = None,
        ready_path: str = "/readyz",
        ready_text: bytes = b"",
    ) -> None:
        self.name = name
        self.port = port
        self.ready_path, self.ready_text = ready_path, ready_text
        self._log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**env, "PYTHONUNBUFFERED": "1"},
            cwd=cwd,
            start_new_session=True,
        )

    def output(self, tail: int | None = None) -> str:
        self._log.seek(0)
        text = self._log.read().decode(errors="replace")
        return text if tail is None else text[-tail:]

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Seconds until it is ready; raises if it exits or never is."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.output()}")
            conn = http.client.HTTPConnection(HOST, self.port, timeout=2)
            errors = (OSError, http.client.HTTPException)  # not listening yet
            with contextlib.suppress(*errors), contextlib.closing(conn):
                conn.request("GET", self.ready_path)
                resp = conn.getresponse()
                if resp.status == 200 and self.ready_text in resp.read():
                    return time.monotonic() - started
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready after {timeout:g} s:\n{self.output()}")

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


class ServerProcess(LoggedProcess):
    """One candidate server (``--serve NAME``) on ``port``, importing from ``deps``."""

    def __init__(self, name: str, port: int, deps: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (deps, env.get("PYTHONPATH")) if p)
        command = [sys.executable, __file__, "--serve", name, "--port", str(port)]
        super().__init__(name, port, command, env)


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, then after 5 s SIGKILL to the server's own session (it and its workers)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def running(name: str, deps: str) -> Iterator[ServerProcess]:
    server = ServerProcess(name, free_port(), deps)
    try:
        yield server
    finally:
        server.stop()


# -- the client side ---------------------------------------------------------------------------


def _get(conn: http.client.HTTPConnection, path: str) -> int:
    conn.request("GET", path)
    resp = conn.getresponse()
    resp.read()
    return resp.status


def _request(conn: http.client.HTTPConnection, path: str) -> tuple[float, int]:
    """(milliseconds, HTTP status or -1 for a failed connection) for one request."""
    started = time.perf_counter()
    try:
        status = _get(conn, path)
    except (OSError, http.client.HTTPException):
        conn.close()  # http.client reconnects on the next request
        status = -1
    return (time.perf_counter() - started) * 1000, status


def _timed_get(conn: http.client.HTTPConnection, path: str) -> float | None:
    """Milliseconds for one request; None when it did not give 200."""
    ms, status = _request(conn, path)
    return ms if status == 200 else None


def _record(ms: float, status: int, latencies: list[float], errors: Counter[int]) -> None:
    """Successes are timed; anything else is counted by status (-1: no response)."""
    if status == 200:
        latencies.append(ms)
    else:
        errors[status] += 1


def _errors(counts: Counter[int]) -> dict[str, int]:
    return {str(status): n for status, n in sorted(counts.items())}


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def _summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "p50_ms": round(_percentile(ordered, 0.50), 3),
        "p99_ms": round(_percentile(ordered, 0.99), 3),
        "mean_ms": round(statistics.fmean(ordered), 3) if ordered else math.nan,
    }


def sequential(port: int, path: str, size: Size) -> dict[str, Any]:
    conn = http.client.HTTPConnection(HOST, port, timeout=REQUEST_TIMEOUT_SECONDS)
    try:
        for _ in range(size.warmup):
            _timed_get(conn, path)
        conn.request("GET", path)
        body_bytes = len(conn.getresponse().read())
        latencies: list[float] = []
        errors: Counter[int] = Counter()
        deadline = time.monotonic() + size.phase_seconds
        for _ in range(size.sequential):
            _record(*_request(conn, path), latencies, errors)
            if time.monotonic() > deadline:
                break
    finally:
        conn.close()
    return {
        "requests": len(latencies),
        "errors": sum(errors.values()),
        "error_statuses": _errors(errors),
        "body_bytes": body_bytes,
    } | _summary(latencies)


# One client thread's result: latencies (ms), errors by status, monotonic start and end.
ThreadResult = tuple[list[float], Counter[int], float, float]


def _client_process(
    port: int,
    path: str,
    threads: int,
    per_thread: int,
    phase_seconds: float,
    connect_lock: Lock,
    barrier: Barrier,
    results: Any,  # multiprocessing.Queue[list[ThreadResult]]
) -> None:
    """Runs in a client process: ``threads`` keep-alive connections, ``per_thread`` requests."""
    out: list[ThreadResult] = []
    lock = threading.Lock()

    def client() -> None:
        conn = http.client.HTTPConnection(HOST, port, timeout=REQUEST_TIMEOUT_SECONDS)
        latencies: list[float] = []
        errors: Counter[int] = Counter()
        with contextlib.suppress(OSError), connect_lock:
            conn.connect()  # one at a time: cheroot's listen backlog is only 5
        _timed_get(conn, path)  # warm up before the clock starts
        try:
            barrier.wait(READY_TIMEOUT_SECONDS)
        except threading.BrokenBarrierError:
            per = 0
        else:
            per = per_thread
        started = time.monotonic()
        deadline = started + phase_seconds
        for _ in range(per):
            _record(*_request(conn, path), latencies, errors)
            if time.monotonic() > deadline:
                break
        ended = time.monotonic()
        conn.close()
        with lock:
            out.append((latencies, errors, started, ended))

    workers = [threading.Thread(target=client) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    results.put(out)


def concurrent(
    server: ServerProcess,
    path: str,
    size: Size,
    procs: int,
    ctx: Context,
    clients_total: int = CLIENTS,
) -> dict[str, Any]:
    threads = clients_total // procs
    per_thread = max(1, size.concurrent // clients_total)
    barrier = ctx.Barrier(procs * threads + 1)
    queue = ctx.Queue()
    args = (
        server.port,
        path,
        threads,
        per_thread,
        size.phase_seconds,
        ctx.Lock(),
        barrier,
        queue,
    )
    clients = [ctx.Process(target=_client_process, args=args, daemon=True) for _ in range(procs)]
    for c in clients:
        c.start()
    try:
        barrier.wait(READY_TIMEOUT_SECONDS)  # every connection is open and warm
        cpu_before = _cpu_seconds(server.proc.pid)
        per_proc: list[list[ThreadResult]] = [
            queue.get(timeout=size.phase_seconds + 3 * REQUEST_TIMEOUT_SECONDS) for _ in clients
        ]
        cpu_after = _cpu_seconds(server.proc.pid)
    finally:
        for c in clients:
            c.join(5)
            if c.is_alive():
                c.kill()
    flat = [r for results in per_proc for r in results]
    latencies = [ms for r in flat for ms in r[0]]
    errors = sum((r[1] for r in flat), Counter[int]())
    seconds = max(r[3] for r in flat) - min(r[2] for r in flat)
    cpu_us = None
    if cpu_before is not None and cpu_after is not None and latencies:
        cpu_us = round((cpu_after - cpu_before) / len(latencies) * 1e6)
    return {
        "requests": len(latencies),
        "errors": sum(errors.values()),
        "error_statuses": _errors(errors),
        "seconds": round(seconds, 3),
        "requests_per_second": round(len(latencies) / seconds) if seconds > 0 else None,
        "server_cpu_us_per_request": cpu_us,
    } | _summary(latencies)


def long_poll(port: int, waiters: int, wait_seconds: float) -> dict[str, Any]:
    """Hold ``waiters`` requests in ``/choose?wait=``, then time one ``/healthz``.

    Every server here runs the app on a pool of SERVER_THREADS threads, so a waiting request
    holds a thread; this shows what happens to a scrape when the waits use them all.
    """
    path = LONG_POLL_PATH.format(seconds=wait_seconds)
    statuses: list[int] = []

    def wait_request(conn: http.client.HTTPConnection) -> None:
        try:
            statuses.append(_get(conn, path))
        except (OSError, http.client.HTTPException):
            statuses.append(-1)
        finally:
            conn.close()

    # Connect one at a time first, so that a short listen backlog cannot delay some of the
    # waiters and leave their threads free; then send all the requests.
    conns = []
    for _ in range(waiters):
        conn = http.client.HTTPConnection(
            HOST, port, timeout=wait_seconds + REQUEST_TIMEOUT_SECONDS
        )
        conn.connect()
        conns.append(conn)
    threads = [threading.Thread(target=wait_request, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    time.sleep(min(0.3, wait_seconds / 2))  # let every waiter reach the app
    conn = http.client.HTTPConnection(HOST, port, timeout=wait_seconds + REQUEST_TIMEOUT_SECONDS)
    ms = _timed_get(conn, "/healthz")
    conn.close()
    for t in threads:
        t.join()
    return {
        "waiters": waiters,
        "wait_seconds": wait_seconds,
        "healthz_ms": None if ms is None else round(ms, 1),
        "waiter_statuses": sorted(set(statuses)),
    }


def _burst_round(port: int, path: str) -> list[float | None]:
    go = threading.Event()
    results: list[float | None] = []

    def one() -> None:
        conn = http.client.HTTPConnection(HOST, port, timeout=REQUEST_TIMEOUT_SECONDS)
        go.wait()
        results.append(_timed_get(conn, path))  # connect, request, response
        conn.close()

    threads = [threading.Thread(target=one) for _ in range(BURST)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    go.set()
    for t in threads:
        t.join()
    return results


def burst(port: int, rounds: int) -> dict[str, Any]:
    """BURST new connections at once, one ``/choose`` each, as job scripts starting together."""
    latencies: list[float] = []
    errors = 0
    for _ in range(rounds):
        results = _burst_round(port, ENDPOINTS[1])
        latencies += [ms for ms in results if ms is not None]
        errors += sum(ms is None for ms in results)
        time.sleep(0.1)
    ordered = sorted(latencies)
    return {
        "connections": BURST,
        "rounds": rounds,
        "errors": errors,
        "p50_ms": round(_percentile(ordered, 0.5), 1),
        "max_ms": round(ordered[-1], 1) if ordered else None,
        "over_900ms": sum(ms > 900 for ms in ordered),  # a dropped SYN is retried after 1 s
    }


def busy_port(name: str, deps: str, timeout: float) -> dict[str, Any]:
    """Start the server on a port that is already listening; how fast and how does it fail?"""
    with socket.socket() as blocker:
        blocker.bind((HOST, 0))
        blocker.listen()
        server = ServerProcess(name, blocker.getsockname()[1], deps)
        started = time.monotonic()
        try:
            server.proc.wait(timeout)
            exited_after: float | None = round(time.monotonic() - started, 2)
        except subprocess.TimeoutExpired:
            exited_after = None
        output = server.output().strip().splitlines()
        returncode = server.proc.returncode
        server.stop()
    return {
        "exit_seconds": exited_after,  # None: still running after timeout_seconds
        "timeout_seconds": timeout,
        "returncode": returncode,
        "message": output[-1] if output else "",
        "output_lines": len(output),
    }


# -- the run -----------------------------------------------------------------------------------


def available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for dist in VERSIONED:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _client_context() -> Context:
    # fork starts client processes in milliseconds; this process holds no threads then.
    if "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


_T0 = time.monotonic()


def _log(message: str) -> None:
    print(f"[{time.monotonic() - _T0:5.1f} s] {message}", file=sys.stderr, flush=True)


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One phase over several rounds: counts summed, every other number the median."""
    combined: dict[str, Any] = {"rounds": len(rounds)}
    for key, first in rounds[0].items():
        values = [r[key] for r in rounds]
        if key in ("requests", "errors"):
            combined[key] = sum(values)
        elif key == "error_statuses":
            total = sum((Counter({int(k): n for k, n in v.items()}) for v in values), Counter())
            combined[key] = _errors(total)
        elif isinstance(first, int | float) and None not in values:
            median = statistics.median(values)
            combined[key] = round(median) if isinstance(first, int) else round(median, 3)
        else:
            combined[key] = first
    if "requests_per_second" in combined and None not in (
        rps := [r["requests_per_second"] for r in rounds]
    ):
        combined["requests_per_second_range"] = [min(rps), max(rps)]
    return combined


def measure(
    names: list[str], deps: str, size: Size, procs: int, ctx: Context, *, quick: bool
) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    runs: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {
        name: {path: {"sequential": [], "concurrent": []} for path in ENDPOINTS} for name in names
    }
    with contextlib.ExitStack() as stack:
        servers: dict[str, ServerProcess] = {}
        for name in names:  # one at a time, so that the start-up times are comparable
            servers[name] = stack.enter_context(running(name, deps))
            ready = servers[name].wait_ready(READY_TIMEOUT_SECONDS)
            results[name] = {"server": name, "available": True, "startup_seconds": round(ready, 2)}
            _log(f"{name}: ready")
        started = time.monotonic()
        for round_index in range(size.rounds):
            elapsed = time.monotonic() - started
            if (
                round_index
                and elapsed / round_index * (round_index + 1) > size.rounds_budget_seconds
            ):
                _log(f"round {round_index + 1}: skipped, the time budget is spent")
                break
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for path in ENDPOINTS:
                for name in order:
                    phases = runs[name][path]
                    phases["sequential"].append(sequential(servers[name].port, path, size))
                    phases["concurrent"].append(concurrent(servers[name], path, size, procs, ctx))
            _log(f"round {round_index + 1}: done")
        for name, server in servers.items():
            result = results[name]
            result["endpoints"] = {
                path: {phase: combine(rounds) for phase, rounds in phases.items()}
                for path, phases in runs[name].items()
            }
            result["rounds"] = runs[name]
            result["long_poll"] = [
                long_poll(server.port, waiters, size.long_poll_seconds)
                for waiters in LONG_POLL_WAITERS
            ]
            result["burst"] = burst(server.port, size.burst_rounds)
            result["rss_mib_after"] = _rss_mib(server.proc.pid)
            result["processes"] = len(_tree(server.proc.pid))
            _log(f"{name}: probes done")
    if quick:  # side by side: gunicorn's retries are seconds of sleep, the others' a fraction
        with concurrent_futures.ThreadPoolExecutor(max_workers=len(names) or 1) as pool:
            probes = {
                name: pool.submit(busy_port, name, deps, size.busy_port_seconds) for name in names
            }
            for name, probe in probes.items():
                results[name]["busy_port"] = probe.result()
    else:  # one at a time, so that the exit times do not include each other's start-up
        for name in names:
            results[name]["busy_port"] = busy_port(name, deps, size.busy_port_seconds)
    _log("busy-port probes done")
    return results


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _error_cell(*phases: dict[str, Any]) -> str:
    """``0``, or ``178 (503)``: non-200 answers over the phases, with their statuses."""
    total: Counter[str] = Counter()
    for phase in phases:
        total.update(phase["error_statuses"])
    count = sum(total.values())
    return f"{count} ({', '.join(sorted(total))})" if count else "0"


def _exit_cell(busy: dict[str, Any]) -> str:
    if busy["exit_seconds"] is None:
        return f"still retrying after {busy['timeout_seconds']:g} s"
    return f"{busy['exit_seconds']:.2f} ({busy['returncode']})"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| server | endpoint | seq p50 ms | seq p99 ms | 16 clients req/s (range) "
        "| 16 clients p50 ms | 16 clients p99 ms | server CPU µs/req | errors |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    measured = [s for s in report["servers"] if s["available"]]
    for path in ENDPOINTS:
        for s in measured:
            seq, con = s["endpoints"][path]["sequential"], s["endpoints"][path]["concurrent"]
            low, high = con.get("requests_per_second_range", (None, None))
            lines.append(
                f"| {s['server']} | `{path}` | {_fmt(seq['p50_ms'])} | {_fmt(seq['p99_ms'])} "
                f"| {_fmt(con['requests_per_second'])} ({_fmt(low)}–{_fmt(high)}) "
                f"| {_fmt(con['p50_ms'], 1)} | {_fmt(con['p99_ms'], 1)} "
                f"| {_fmt(con['server_cpu_us_per_request'])} "
                f"| {_error_cell(seq, con)} |"
            )
    lines += [
        "",
        "| server | processes | RSS MiB | ready after s | port in use: exits after s (rc) "
        "| /healthz ms, {} / {} long-polls waiting "
        "| {} new connections: p50 / max ms, > 0.9 s |".format(*LONG_POLL_WAITERS, BURST),
        "|---|--:|--:|--:|---|---|---|",
    ]
    for s in measured:
        busy, b = s["busy_port"], s["burst"]
        lines.append(
            f"| {s['server']} | {s['processes']} | {_fmt(s['rss_mib_after'], 1)} "
            f"| {_fmt(s['startup_seconds'])} "
            f"| {_exit_cell(busy)} "
            f"| {' / '.join(_fmt(p['healthz_ms'], 1) for p in s['long_poll'])} "
            f"| {_fmt(b['p50_ms'], 1)} / {_fmt(b['max_ms'], 1)}, "
            f"{b['over_900ms']} of {b['connections'] * b['rounds']} |"
        )
    for s in report["servers"]:
        if not s["available"]:
            lines.append(f"\n{s['server']}: skipped — {s['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run, under 20 s")
    parser.add_argument(
        "--deps",
        default=os.environ.get("BENCH_DEPS", "/tmp/benchdeps"),
        help="directory with waitress and gunicorn (pip install --target); default %(default)s",
    )
    parser.add_argument(
        "--client-procs",
        type=int,
        choices=(1, 2, 4, 8, 16),
        default=2,
        help="processes the 16 client connections are spread over (default %(default)s)",
    )
    parser.add_argument(
        "--servers",
        help=f"comma-separated, from {', '.join(SERVE)} (default: all; --quick: the first 3)",
    )
    parser.add_argument("--out", type=Path, help="JSON file (default bench/results/servers.json)")
    parser.add_argument("--serve", choices=tuple(SERVE), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.deps and args.deps not in sys.path:
        sys.path.insert(0, args.deps)
    if args.serve:
        return SERVE[args.serve](args.port)

    size = QUICK_SIZE if args.quick else DEFAULT_SIZE
    out: Path = args.out or RESULTS_DIR / ("servers-quick.json" if args.quick else "servers.json")
    requested = args.servers.split(",") if args.servers else [*SERVERS, *VARIANTS]
    if args.quick and not args.servers:
        requested = list(SERVERS)
    for name in requested:
        if name not in SERVE:
            parser.error(f"unknown server {name!r}; choose from {', '.join(SERVE)}")

    started = time.monotonic()
    skipped: list[dict[str, Any]] = []
    names: list[str] = []
    for name in requested:
        if available(MODULE.get(name, name)):
            names.append(name)
        else:
            note = f"not importable; pip install --target {args.deps} {MODULE.get(name, name)}"
            _log(f"{name}: skipped ({note})")
            skipped.append({"server": name, "available": False, "note": note})
    measured = measure(
        names, args.deps, size, args.client_procs, _client_context(), quick=args.quick
    )
    report: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "mode": "quick" if args.quick else "default",
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "versions": versions(),
            "size": asdict(size),
            "gpus": GPUS,
            "server_threads": SERVER_THREADS,
            "client": f"http.client keep-alive, {CLIENTS} connections in {args.client_procs} "
            f"processes × {CLIENTS // args.client_procs} threads",
            "wall_seconds": round(time.monotonic() - started, 1),
        },
        "servers": [measured[name] for name in names] + skipped,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out)
    meta = report["meta"]
    print(
        f"{meta['cpu_count']} CPUs ({meta['cpu']}), Python {meta['python']}, {meta['client']}; "
        f"median of {size.rounds} round(s); {meta['wall_seconds']} s\n"
    )
    print(markdown(report))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
