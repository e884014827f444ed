"""Waiting ``/choose`` requests through a real socket (issue 13.2): a client that hangs up
stops waiting within a second and claims nothing; a waiter blocks only the GPUs it could use;
advice is never blocked; what waits is shown on ``/``, in ``format=json`` and in ``/metrics``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tls_certs import CA

from gpu_exporter.choose.tokens import lease_id_of
from gpu_exporter.simulate import DEFAULT_MODEL, Load, SimGpu, SimulatedNvml
from gpu_exporter.web.gateway import client_connected
from harness import ROOT
from served import Served, served

ME = f"local:{pwd.getpwuid(os.getuid()).pw_name}"  # the requester a loopback client is
ALL = "max_util=100%25&max_mem_used=100%25"  # busy cards count too, whatever the defaults


def idle_gpus(n: int) -> SimulatedNvml:
    return SimulatedNvml(
        [SimGpu(i, DEFAULT_MODEL, Load("idle")) for i in range(n)], clock=time.monotonic
    )


def call(exporter: Served, path: str, method: str = "GET") -> tuple[int, str, dict[str, str]]:
    """Status, body and headers; HTTP errors are returned, not raised."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(exporter.url + path, method=method)
    try:
        with opener.open(req, timeout=5) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


def waiters_gauge(exporter: Served) -> float | None:
    _, body, _ = call(exporter, "/metrics")
    found = re.search(r"^gpu_exporter_choose_waiters (\S+)$", body, re.MULTILINE)
    return float(found.group(1)) if found else None


def within(seconds: float, condition: Callable[[], bool]) -> float:
    """How long ``condition`` took to hold; fails after ``seconds``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < seconds, f"not within {seconds} s"
        time.sleep(0.02)
    return time.monotonic() - start


@contextlib.contextmanager
def raw_request(exporter: Served, path: str) -> Iterator[socket.socket]:
    """A client that sends ``GET path`` and reads nothing: leaving the block hangs up."""
    sock = socket.create_connection(("127.0.0.1", exporter.port), timeout=5)
    try:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
        yield sock
    finally:
        sock.close()


def test_a_client_that_hangs_up_stops_waiting_at_once_and_claims_nothing() -> None:
    with served(idle_gpus(3)) as exporter:
        status, _, headers = call(exporter, f"/choose?n=2&lease=10m&{ALL}")
        assert status == 200
        held = headers["X-GPU-Lease"]
        with raw_request(exporter, f"/choose?n=2&wait=30s&owner=gone&{ALL}"):
            time.sleep(0.5)  # it is waiting now: the third GPU alone is not enough
            # Only the GPUs it could use are reserved; advice is not blocked at all.
            status, body, _ = call(exporter, f"/choose?n=1&lease=0&format=json&{ALL}")
            assert status == 200, body
            waiting = json.loads(body)["waiting"]
            assert [(w["n"], w["owner"], w["requester"]) for w in waiting] == [(2, "gone", ME)]
            assert waiting[0]["filters"] == {"max_util_ratio": 1.0, "max_mem_used_ratio": 1.0}
            status, body, _ = call(exporter, f"/choose?n=1&{ALL}")
            assert status == 503 and "reserved for an earlier request waiting for 2 GPUs" in body
            _, page, _ = call(exporter, "/")
            assert "1 request is waiting for GPUs" in page and "2 GPUs" in page
            assert waiters_gauge(exporter) == 1
        time.sleep(1.0)  # gone within a second of the hang-up
        status, _, _ = call(exporter, f"/leases/{held}", "DELETE")
        assert status == 200
        status, body, headers = call(exporter, f"/choose?n=2&{ALL}")
        assert status == 200, body
        time.sleep(0.3)  # had the abandoned waiter claimed, its lease would show by now
        assert exporter.lease_ids() == {lease_id_of(headers["X-GPU-Lease"])}
        _, metrics, _ = call(exporter, "/metrics")
        assert 'gpu_exporter_choose_requests_total{result="client_closed"} 1.0' in metrics
        assert waiters_gauge(exporter) == 0


def test_ctrl_c_on_gpu_exporter_choose_wait_frees_its_place() -> None:
    with served(idle_gpus(1)) as exporter:
        status, _, headers = call(exporter, f"/choose?n=1&lease=10m&{ALL}")
        assert status == 200
        argv = ["choose", "--url", exporter.url, "--wait", "30s", "--max-util", "100%"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpu_exporter", *argv, "--max-mem-util", "100%"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "NO_PROXY": "*"},
            # As from a terminal: a suite started in the background (`cmd &` in a script)
            # hands its children SIGINT ignored, and Ctrl-C would then never reach this one.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            within(15, lambda: any(r[1] == "/choose" for r in exporter.requests[1:]))
            time.sleep(0.3)  # waiting now
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=10)
            time.sleep(1.0)  # gone within a second of the hang-up
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        call(exporter, f"/leases/{headers['X-GPU-Lease']}", "DELETE")
        status, body, _ = call(exporter, f"/choose?n=1&{ALL}")
        assert status == 200, body
        assert len(exporter.leases()) == 1
        assert waiters_gauge(exporter) == 0


def test_more_gpus_than_the_host_has_is_refused_at_once() -> None:
    with served(idle_gpus(2)) as exporter:
        start = time.monotonic()
        status, body, _ = call(exporter, "/choose?n=3&wait=60s&lease=0&format=json")
        assert time.monotonic() - start < 1.0
        error: dict[str, Any] = json.loads(body)["error"]
        assert (status, error["code"], error["param"]) == (503, "not_enough_gpus", None)
        assert error["message"] == (
            "2 of 2 GPUs qualify, 3 requested; at most 2 of the 2 GPUs here could ever qualify"
        )
        status, _, _ = call(exporter, "/choose?n=1")
        assert status == 200


def test_one_requester_may_wait_only_so_many_times() -> None:
    with served(idle_gpus(1), max_waiters_per_requester=1) as exporter:
        assert call(exporter, f"/choose?n=1&lease=10m&{ALL}")[0] == 200
        with raw_request(exporter, f"/choose?n=1&wait=30s&{ALL}"):
            time.sleep(0.3)  # waiting now
            status, body, _ = call(exporter, f"/choose?n=1&wait=30s&{ALL}")
        assert status == 429
        assert body == (
            f"error: {ME} already has 1 request waiting for GPUs (--max-waiters-per-requester 1)\n"
        )


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """(the server's end, the client's end) of a loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname(), timeout=5)
        server, _ = listener.accept()
    return server, client


def test_client_connected_sees_a_hang_up_but_not_pipelined_bytes() -> None:
    server, client = tcp_pair()
    with server:
        assert client_connected(server)
        client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # a pipelined request
        time.sleep(0.05)
        assert client_connected(server)
        client.close()
        time.sleep(0.05)
        assert not client_connected(server)  # though the pipelined bytes are still unread
    assert not client_connected(server)  # closed on our side too


def test_client_connected_under_tls(tmp_path: Path) -> None:
    ca = CA.create(tmp_path, "ca")
    issued = ca.issue(tmp_path, "127.0.0.1", server=True)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(issued.cert, issued.key)
    client_ctx = ssl.create_default_context(cafile=str(ca.path))
    raw_server, raw_client = tcp_pair()
    handshake = ThreadPoolExecutor(1)
    server_side = handshake.submit(server_ctx.wrap_socket, raw_server, server_side=True)
    client = client_ctx.wrap_socket(raw_client, server_hostname="127.0.0.1")
    with server_side.result(timeout=5) as server:
        assert client_connected(server)
        client.sendall(b"GET / HTTP/1.1\r\n\r\n")
        time.sleep(0.05)
        assert client_connected(server)
        client.close()
        time.sleep(0.05)
        assert not client_connected(server)
    handshake.shutdown()
