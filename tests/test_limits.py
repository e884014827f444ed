"""Request limits: a burst of clients or long-polling waiters never takes the whole server."""

from __future__ import annotations

import http.client
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from conftest import build_stack
from gpu_exporter.choose.filters import Filters
from gpu_exporter.clock import SystemClock
from gpu_exporter.config import ServeConfig
from gpu_exporter.daemon import build
from gpu_exporter.nvml import Nvml
from gpu_exporter.simulate import Scenario, SimulatedNvml
from gpu_exporter.web.limits import Limits

LIMITS = Limits()
MAX_QUERY_BYTES = LIMITS.max_query_bytes
MAX_HEADER_BYTES, MAX_BODY_BYTES = LIMITS.max_header_bytes, LIMITS.max_body_bytes


class Running:
    """One simulated GPU behind the real server, with the given limits, leased for an
    hour: ``/choose?wait=`` requests wait for it."""

    def __init__(self, *, max_in_flight: int, max_waiters: int) -> None:
        clock = SystemClock()
        nvml = Nvml(SimulatedNvml.of(Scenario.with_gpus(1), clock=clock.monotonic), simulated=True)
        config = ServeConfig(max_requests_in_flight=max_in_flight, max_waiters=max_waiters)
        daemon = build(config, nvml=nvml, clock=clock)
        daemon.sampler.sample_once()
        daemon.leases.claim(
            daemon.cache.get(), 1, Filters(), ttl_seconds=3600, requester="someone else"
        )
        self.rejections = daemon.rejections
        self.registry = daemon.registry
        self.stopping = daemon.stopping
        self.waiters = daemon.services.waiters
        self.server = daemon.make_server("127.0.0.1", 0)
        threading.Thread(target=self.server.serve, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.port}"

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str, dict]:
        req = urllib.request.Request(self.base + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read().decode(), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(), dict(exc.headers)

    def in_background(self, path: str) -> tuple[threading.Thread, list]:
        out: list = []
        thread = threading.Thread(target=lambda: out.append(self.get(path)))
        thread.start()
        return thread, out


@pytest.fixture
def running() -> Iterator[Running]:
    r = Running(max_in_flight=2, max_waiters=2)
    try:
        yield r
    finally:
        r.stopping.set()
        r.server.stop()


def wait_for_waiters(r: Running, count: int) -> None:
    """Until ``count`` /choose requests are inside their wait loop."""
    deadline = time.monotonic() + 10
    while r.waiters.active < count:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_beyond_the_in_flight_limit_answers_503_promptly_but_probes_pass(running: Running) -> None:
    r = running
    # Two requests wait for the leased GPU: both slots are taken for a while.
    waiters = [r.in_background("/choose?n=1&wait=3s&lease=0") for _ in range(2)]
    wait_for_waiters(r, 2)

    started = time.monotonic()
    status, body, headers = r.get("/metrics")
    assert status == 503 and time.monotonic() - started < 2
    assert body == "error: 2 requests are already being handled; retry in a second\n"
    assert headers["Retry-After"] == "1"
    status, body, _ = r.get("/gpus")  # a JSON endpoint gets the JSON error body
    assert status == 503 and '"code": "too_many_requests"' in body

    # Liveness and readiness are exempt and have threads of their own.
    assert r.get("/healthz")[0] == 200
    assert r.get("/readyz")[0] == 200

    for thread, out in waiters:
        thread.join()
        assert out[0][0] == 503  # the waiters gave up after 3 s: still leased
    assert r.get("/metrics")[0] == 200  # slots are free again
    rejected = r.registry.get_sample_value(
        "gpu_exporter_requests_rejected_total", {"reason": "too_many_requests"}
    )
    assert rejected == 2


def status_line(r: Running, method: str, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", r.server.port, timeout=10)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        resp.read()
        return resp.status, resp.reason
    finally:
        conn.close()


def test_every_status_line_has_its_reason_phrase(running: Running) -> None:
    r = running
    assert status_line(r, "GET", "/healthz") == (200, "OK")
    assert status_line(r, "GET", "/metrics?x=1") == (400, "Bad Request")
    assert status_line(r, "GET", "/nope") == (404, "Not Found")
    assert status_line(r, "DELETE", "/metrics") == (405, "Method Not Allowed")
    assert status_line(r, "GET", "/metrics?" + "x" * 5000) == (414, "URI Too Long")
    waiters = [r.in_background("/choose?n=1&wait=2s&lease=0") for _ in range(2)]
    wait_for_waiters(r, 2)
    assert status_line(r, "GET", "/metrics") == (503, "Service Unavailable")  # too_many_requests
    for thread, _ in waiters:
        thread.join()


def test_waiters_have_their_own_smaller_cap() -> None:
    r = Running(max_in_flight=8, max_waiters=1)
    try:
        thread, _ = r.in_background("/choose?n=1&wait=2s&lease=0")
        wait_for_waiters(r, 1)
        started = time.monotonic()
        status, body, _ = r.get("/choose?n=1&wait=2s&lease=0", {"Accept": "application/json"})
        assert status == 503 and time.monotonic() - started < 1.5
        assert '"code": "too_many_waiters"' in body and '"param": "wait"' in body
        # Everything else is unaffected.
        assert r.get("/metrics")[0] == 200
        assert r.get("/gpus")[0] == 200
        thread.join()
        assert r.rejections.counts() == {"too_many_waiters": 1}
    finally:
        r.server.stop()


def test_shutdown_ends_waiting_requests_at_once(running: Running) -> None:
    r = running
    thread, out = r.in_background("/choose?n=1&wait=60s&lease=0")
    wait_for_waiters(r, 1)
    started = time.monotonic()
    r.stopping.set()
    thread.join(timeout=5)
    assert time.monotonic() - started < 2
    assert out[0][0] == 503 and out[0][1] == "error: the exporter is shutting down\n"


def test_a_long_query_string_is_414(running: Running) -> None:
    status, body, _ = running.get("/choose?owner=" + "x" * MAX_QUERY_BYTES)
    assert status == 414
    assert body == f"error: the query string is {MAX_QUERY_BYTES + 6} bytes; at most 4096\n"


def test_unknown_parameters_are_rejected_everywhere() -> None:
    client = build_stack(
        lambda c: SimulatedNvml.of(Scenario.with_gpus(1), clock=c.monotonic)
    ).client
    for path in ("/gpus?verbose=1", "/leases?all=1", "/choose?gpus=2"):
        resp = client.get(path, headers={"Accept": "application/json"})
        assert resp.status_code == 400, path
        assert resp.json["error"]["code"] == "unknown_parameter"


def test_oversized_headers_are_431_and_bodies_413_one_line(running: Running) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", running.server.port, timeout=10)
    conn.request("GET", "/gpus", headers={"X-Padding": "a" * MAX_HEADER_BYTES})
    resp = conn.getresponse()
    assert resp.status == 431
    assert resp.read() == b"error: the request head is over 16384 bytes\n"
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", running.server.port, timeout=10)
    conn.request("POST", "/choose", body=b"n=1&" * MAX_BODY_BYTES)
    resp = conn.getresponse()
    assert resp.status == 413
    assert resp.read() == b"error: the request body is over 65536 bytes\n"
    conn.close()


def test_requests_without_wait_are_never_waiters() -> None:
    """Concurrent wait=0 requests are served as they come: none takes a waiter slot."""
    s = build_stack(
        lambda c: SimulatedNvml.of(Scenario.with_gpus(2), clock=c.monotonic), max_waiters=0
    )
    s.sample()
    rejections, app = s.daemon.rejections, s.app
    out: list[int] = []
    threads = [
        threading.Thread(
            target=lambda: out.append(app.test_client().get("/choose?lease=0").status_code)
        )
        for _ in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=5)
    assert out == [200] * 6
    assert rejections.counts() == {}
