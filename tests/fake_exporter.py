"""A stand-in gpu-exporter speaking the ``/choose`` + ``/leases`` contract, for client tests.

:func:`exporter_under_test` decides what ``tests/test_client.py`` and ``tests/test_run.py`` talk
to, from ``$GPU_EXPORTER_TEST_SERVER``:

* unset or ``fake``: :class:`FakeExporter`, in this process, on 127.0.0.1 and a free port;
* ``real``: ``python -m gpu_exporter serve --simulate 4`` on 127.0.0.1 (the real server);
* ``http://HOST:PORT``: a server already running, with at least 4 GPUs and no leases held.

Tests that need the fake's knobs (injected errors, request log) skip themselves otherwise.

The contract, as the fake implements it:

* ``GET|POST /choose?n&lease&owner&wait&format`` plus filters. ``lease`` defaults to 60 s;
  ``lease=0`` is advice only. A leased GPU is never handed out again until its lease ends.
  200 with ``uuid`` → ``GPU-a,GPU-b\\n``, ``index`` → ``0,3\\n``, ``env`` →
  ``export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=GPU-a,GPU-b GPU_LEASE=<id>\\n``,
  ``json`` → ``{"n", "chosen", "rejected", "lease", "snapshot_age_seconds"}``; header
  ``X-GPU-Lease`` whenever a lease was granted.
* ``DELETE /leases/<id>`` → ``{"released": id}``; ``POST /leases/<id>/renew?ttl=`` → the lease;
  ``GET /leases`` → ``{"leases": [...]}``; an unknown or expired id → 404.
* Errors: ``{"error": {"code", "message", "param"}}`` with ``Accept: application/json`` (or
  ``format=json``), else ``error: <message>\\n``. 400 bad or unknown parameter, 429 lease
  limits, 503 ``not_enough_gpus`` (after ``wait``, if given).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from gpu_exporter.units import parse_bytes, parse_duration, parse_ratio

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
SERVER_ENV = "GPU_EXPORTER_TEST_SERVER"

CHOOSE_PARAMS = (
    "n",
    "lease",
    "owner",
    "wait",
    "format",
    "min_free",
    "min_total",
    "max_util",
    "max_mem_util",
    "max_procs",
    "model",
    "include",
    "exclude",
    "idle_for",
    "sort",
)
FORMATS = ("uuid", "index", "env", "json")


@dataclass
class FakeGpu:
    index: int
    free_gib: float
    util: float
    processes: int = 0
    total_gib: float = 80.0
    name: str = "NVIDIA A100-SXM4-80GB"

    @property
    def uuid(self) -> str:
        return f"GPU-fa4e{self.index:04x}-0000-4000-8000-{self.index:012x}"

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "up": True,
            "name": self.name,
            "memory_total_bytes": int(self.total_gib * GIB),
            "memory_free_bytes": int(self.free_gib * GIB),
            "utilization_ratio": self.util,
            "compute_processes": self.processes,
        }


def default_gpus() -> list[FakeGpu]:
    return [
        FakeGpu(0, 60, 0.3, 1),
        FakeGpu(1, 79, 0.0),
        FakeGpu(2, 40, 0.5, 2),
        FakeGpu(3, 79, 0.0),
    ]


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


@dataclass
class FakeExporter:
    """The contract over a fixed set of GPUs, served by a stdlib HTTP server on loopback."""

    gpus: list[FakeGpu] = field(default_factory=default_gpus)
    leases: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    renewals: dict[str, int] = field(default_factory=dict)
    failures: list[ApiError] = field(default_factory=list)
    url: str = ""

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._httpd: ThreadingHTTPServer | None = None

    @property
    def fake(self) -> FakeExporter:
        return self

    # -- knobs for tests ------------------------------------------------------------------
    def fail_next(self, status: int, code: str, message: str, param: str | None = None) -> None:
        """Answer the next request with this error instead."""
        self.failures.append(ApiError(status, code, message, param))

    def lease_ids(self) -> set[str]:
        return {lease["id"] for lease in get_json(self.url + "/leases")["leases"]}

    # -- serving --------------------------------------------------------------------------
    def start(self) -> FakeExporter:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.handle(self, "GET")

            def do_POST(self) -> None:
                fake.handle(self, "POST")

            def do_DELETE(self) -> None:
                fake.handle(self, "DELETE")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    def handle(self, req: BaseHTTPRequestHandler, method: str) -> None:
        parts = urllib.parse.urlsplit(req.path)
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
        wants_json = "application/json" in req.headers.get("Accept", "") or query.get("format") == [
            "json"
        ]
        self.requests.append((method, parts.path, {k: v[-1] for k, v in query.items()}))
        try:
            if self.failures:
                raise self.failures.pop(0)
            status, body, headers = self.route(method, parts.path, query, req.client_address[0])
        except ApiError as exc:
            status, headers = exc.status, {}
            if wants_json:
                error = {"code": exc.code, "message": exc.message, "param": exc.param}
                body = {"error": error}
            else:
                body = f"error: {exc.message}\n"
        if isinstance(body, str):
            data, ctype = body.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = json.dumps(body).encode(), "application/json"
        req.send_response(status)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(data)))
        req.send_header("Cache-Control", "no-store")
        for key, value in headers.items():
            req.send_header(key, value)
        req.end_headers()
        req.wfile.write(data)

    def route(
        self, method: str, path: str, query: dict[str, list[str]], client: str
    ) -> tuple[int, str | dict[str, Any], dict[str, str]]:
        segments = [s for s in path.split("/") if s]
        if segments == ["choose"] and method in ("GET", "POST"):
            return self.choose(query, client)
        if segments == ["leases"] and method == "GET":
            _only(query, ())
            with self._cond:
                self._expire()
                return 200, {"leases": list(self.leases.values())}, {}
        if len(segments) == 2 and segments[0] == "leases" and method == "DELETE":
            _only(query, ())
            with self._cond:
                self._expire()
                lease_id = urllib.parse.unquote(segments[1])
                if self.leases.pop(lease_id, None) is None:
                    raise ApiError(404, "lease_not_found", f"no lease {lease_id!r}")
                self._cond.notify_all()
                return 200, {"released": lease_id}, {}
        if len(segments) == 3 and segments[::2] == ["leases", "renew"] and method == "POST":
            args = _only(query, ("ttl",))
            ttl = _duration(args, "ttl", 60.0)
            with self._cond:
                self._expire()
                lease_id = urllib.parse.unquote(segments[1])
                lease = self.leases.get(lease_id)
                if lease is None:
                    raise ApiError(404, "lease_not_found", f"no lease {lease_id!r} (expired?)")
                lease["expires_at"] = time.time() + ttl
                self.renewals[lease_id] = self.renewals.get(lease_id, 0) + 1
                return 200, dict(lease), {}
        raise ApiError(404, "not_found", f"Not Found: {path}")

    def choose(
        self, query: dict[str, list[str]], client: str
    ) -> tuple[int, str | dict[str, Any], dict[str, str]]:
        args = _only(query, CHOOSE_PARAMS)
        raw_n = args.get("n", "1")
        if not raw_n.isdigit() or not 1 <= int(raw_n) <= 1024:
            raise ApiError(400, "invalid_parameter", f"n must be 1 to 1024, got {raw_n!r}", "n")
        n = int(raw_n)
        fmt = args.get("format", "uuid")
        if fmt not in FORMATS:
            raise ApiError(400, "invalid_parameter", f"format must be one of {FORMATS}", "format")
        ttl = _duration(args, "lease", 60.0)
        wait = _duration(args, "wait", 0.0)
        checks = _filters(args)
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                self._expire()
                leased = {u for lease in self.leases.values() for u in lease["gpus"]}
                qualified, rejected = [], []
                for gpu in self.gpus:
                    reasons = [why for why in (check(gpu) for check in checks) if why]
                    if gpu.uuid in leased:
                        reasons.append("leased")
                    if reasons:
                        rejected.append((gpu, reasons))
                    else:
                        qualified.append(gpu)
                if len(qualified) >= n:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    details = "; ".join(f"gpu {g.index}: {', '.join(r)}" for g, r in rejected)
                    raise ApiError(
                        503,
                        "not_enough_gpus",
                        f"{len(qualified)} of {len(self.gpus)} GPUs qualify, {n} requested"
                        + (f" ({details})" if details else ""),
                    )
                self._cond.wait(min(remaining, 0.05))
            qualified.sort(key=lambda g: (-(g.free_gib // 1), g.util, -g.index))
            chosen = qualified[:n]
            lease = None
            if ttl > 0:
                now = time.time()
                lease = {
                    "id": "lease-" + secrets.token_hex(6),
                    "gpus": [g.uuid for g in chosen],
                    "created_at": now,
                    "expires_at": now + ttl,
                    "owner": args.get("owner"),
                    "requester": client,
                }
                self.leases[lease["id"]] = lease
        headers = {"X-GPU-Lease": lease["id"]} if lease else {}
        if fmt == "json":
            passed_over = [(g, ["ranked lower"]) for g in qualified[n:]]
            body: dict[str, Any] = {
                "n": n,
                "chosen": [g.to_json() for g in chosen],
                "rejected": [
                    {"index": g.index, "uuid": g.uuid, "reasons": r}
                    for g, r in sorted(rejected + passed_over, key=lambda x: x[0].index)
                ],
                "lease": dict(lease) if lease else None,
                "snapshot_age_seconds": 0.2,
            }
            return 200, body, headers
        uuids = ",".join(g.uuid for g in chosen)
        if fmt == "uuid":
            return 200, uuids + "\n", headers
        if fmt == "index":
            return 200, ",".join(str(g.index) for g in chosen) + "\n", headers
        text = f"export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={uuids}"
        return 200, text + (f" GPU_LEASE={lease['id']}" if lease else "") + "\n", headers

    def _expire(self) -> None:
        now = time.time()
        for lease_id in [i for i, lease in self.leases.items() if lease["expires_at"] <= now]:
            del self.leases[lease_id]


def _only(query: dict[str, list[str]], allowed: tuple[str, ...]) -> dict[str, str]:
    for name, values in query.items():
        if name not in allowed:
            raise ApiError(400, "unknown_parameter", f"unknown parameter {name!r}", name)
        if len(values) > 1:
            raise ApiError(400, "invalid_parameter", f"{name} given more than once", name)
    return {name: values[0] for name, values in query.items()}


def _duration(args: dict[str, str], name: str, default: float) -> float:
    if name not in args:
        return default
    try:
        return parse_duration(args[name])
    except ValueError as exc:
        raise ApiError(400, "invalid_parameter", f"{name}: {exc}", name) from None


def _filters(args: dict[str, str]) -> list[Any]:
    """One check per filter given: GPU → reason it fails, or None."""
    checks: list[Any] = []

    def parsed(name: str, parse: Any) -> Any:
        try:
            return parse(args[name])
        except ValueError as exc:
            raise ApiError(400, "invalid_parameter", f"{name}: {exc}", name) from None

    def selectors(name: str) -> list[str]:
        return [s.strip() for s in args[name].split(",") if s.strip()]

    def named(gpu: FakeGpu, s: str) -> bool:
        return int(s) == gpu.index if s.isdigit() else gpu.uuid.lower().startswith(s.lower())

    if "min_free" in args:
        least = parsed("min_free", parse_bytes)
        checks.append(lambda g: "free memory too low" if g.free_gib * GIB < least else None)
    if "min_total" in args:
        total = parsed("min_total", parse_bytes)
        checks.append(lambda g: "total memory too low" if g.total_gib * GIB < total else None)
    if "max_util" in args:
        most = parsed("max_util", parse_ratio)
        checks.append(lambda g: f"utilization {g.util:.2f} > {most:.2f}" if g.util > most else None)
    if "max_mem_util" in args:
        parsed("max_mem_util", parse_ratio)
    if "max_procs" in args:
        procs = parsed("max_procs", int)
        checks.append(lambda g: "too many processes" if g.processes > procs else None)
    if "idle_for" in args:
        parsed("idle_for", parse_duration)
    if "model" in args:
        model = args["model"].lower()
        checks.append(lambda g: "other model" if model not in g.name.lower() else None)
    if "exclude" in args:
        excluded = selectors("exclude")
        checks.append(lambda g: "excluded" if any(named(g, s) for s in excluded) else None)
    if "include" in args:
        included = selectors("include")
        checks.append(lambda g: None if any(named(g, s) for s in included) else "not included")
    return checks


# -- the real server, and choosing between them -------------------------------------------


def get_json(url: str) -> Any:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    with opener.open(req, timeout=5) as resp:
        return json.loads(resp.read())


@dataclass
class RemoteExporter:
    """A real server: one this fixture started (``proc``), or one given by URL."""

    url: str
    proc: subprocess.Popen[str] | None = None

    @property
    def fake(self) -> None:
        return None

    def lease_ids(self) -> set[str]:
        return {lease["id"] for lease in get_json(self.url + "/leases")["leases"]}


def _start_real(state_dir: Path) -> RemoteExporter:
    from gpu_exporter.web.server import free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpu_exporter",
            "serve",
            "--simulate",
            "4",
            "--interval",
            "0.2",
            "--listen-address",
            f"127.0.0.1:{port}",
            "--state-dir",
            str(state_dir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.communicate()[1]}")
        with contextlib.suppress(OSError):
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                url + "/readyz", timeout=1
            ).close()
            return RemoteExporter(url, proc)
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the real server did not become ready")


@contextlib.contextmanager
def exporter_under_test(tmp_path: Path) -> Iterator[FakeExporter | RemoteExporter]:
    """The server the client tests talk to; see the module docstring."""
    where = os.environ.get(SERVER_ENV, "fake")
    if where == "fake":
        fake = FakeExporter().start()
        try:
            yield fake
        finally:
            fake.stop()
    elif where == "real":
        real = _start_real(tmp_path / "state")
        try:
            yield real
        finally:
            assert real.proc is not None
            real.proc.terminate()
            real.proc.communicate(timeout=10)
    else:
        yield RemoteExporter(where.rstrip("/"))
