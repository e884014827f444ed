"""A store that trickles or floods cannot hold ``/cluster/choose``'s exporter (issue 28.12).

Each store here is a real TCP server in this process, speaking just enough HTTP: one that
sends its answer (head included) one byte a second, and one that sends far more than any fleet
read answers. Against the reader directly and against a real ``gpu-exporter serve
--prometheus-url`` process, whose clients hang up, wait for their answer, or see it stopped.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tls_certs import CA

from conftest import build_stack
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.request import parse_cluster_args
from gpu_exporter.client.choosing import http_claimer
from gpu_exporter.client.hostapi import release
from gpu_exporter.fleet.placing import choose_fleet
from gpu_exporter.fleet.reading import PrometheusReader, SourceUnavailable
from gpu_exporter.simulate import Scenario, SimulatedNvml
from harness import exporter, get
from served import served

Handler = Callable[[socket.socket, threading.Event], None]
_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


def trickle(conn: socket.socket, stop: threading.Event) -> None:
    """An answer, its status line first, one byte a second: each byte resets a read timeout."""
    if isinstance(conn, ssl.SSLSocket):
        conn.recv(65536)  # the request, under TLS
    answer = _HEAD + b"Content-Length: 100000\r\n\r\n" + b" " * 100_000
    for i in range(len(answer)):
        if stop.wait(1.0 if i else 0.0):
            return
        conn.sendall(answer[i : i + 1])


def flood(total: int, sent: list[int]) -> Handler:
    """A chunked answer of ``total`` bytes, no length said beforehand; ``sent`` counts them."""
    block = b" " * (1 << 20)
    chunk = b"%x\r\n" % len(block) + block + b"\r\n"

    def handle(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(_HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        while sent[0] < total and not stop.is_set():
            conn.sendall(chunk)
            sent[0] += len(block)
        conn.sendall(b"0\r\n\r\n")

    return handle


@contextlib.contextmanager
def store(handle: Handler, *, read_request: bool = True) -> Iterator[str]:
    """A store at the URL yielded: each connection's request is read (unless ``handle`` reads
    it: TLS), then ``handle`` answers."""
    stop = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                while read_request and b"\r\n\r\n" not in (head := conn.recv(65536)) and head:
                    pass
                handle(conn, stop)
            except OSError:  # the exporter hung up: what a bounded reader does
                pass

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        acceptor.join(5)
        listener.close()


def within(seconds: float, work: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``work`` on another thread; (seconds taken, what it returned or raised). Fails the
    test when it has not ended in ``seconds`` (the old reader never ends on a trickle)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as exc:
            outcome.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still going after {seconds:g} s"
    return time.monotonic() - started, outcome[0]


def read_in_thread(reader: PrometheusReader, seconds: float) -> tuple[float, Any]:
    """Read the fleet :func:`within` ``seconds``."""
    req = parse_cluster_args({"n": "1"})
    return within(seconds, lambda: reader.read(req, time.time()))


def test_a_trickling_store_fails_the_read_at_its_deadline() -> None:
    with store(trickle) as url:
        took, error = read_in_thread(PrometheusReader(url, timeout=2.0), 6.0)
    assert isinstance(error, SourceUnavailable)
    assert f"no answer from {url.removeprefix('http://')} within 2 s" in str(error)
    assert took < 3.0


def test_a_trickling_tls_store_is_cut_at_the_deadline_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = CA.create(tmp_path, "ca")
    issued = ca.issue(tmp_path, "localhost", server=True)
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(issued.cert, issued.key)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca.path))  # the reader trusts the test CA

    def tls_trickle(conn: socket.socket, stop: threading.Event) -> None:
        with server_side.wrap_socket(conn, server_side=True) as tls:
            trickle(tls, stop)

    with store(tls_trickle, read_request=False) as url:
        https = url.replace("http://127.0.0.1", "https://localhost")
        took, error = read_in_thread(PrometheusReader(https, timeout=2.0), 6.0)
    assert isinstance(error, SourceUnavailable) and "within 2 s" in str(error)
    assert took < 3.0


def test_a_flooding_store_is_refused_past_the_limit_without_buffering_it() -> None:
    sent = [0]
    with store(flood(200 << 20, sent)) as url:
        reader = PrometheusReader(url, max_answer_bytes=4 << 20)
        _, error = read_in_thread(reader, 20.0)
    assert isinstance(error, SourceUnavailable)
    assert "more than 4,194,304 bytes, the most the fleet reader takes" in str(error)
    assert sent[0] < 40 << 20  # the reader stopped reading: the rest was never sent


def test_a_store_that_says_its_answer_is_too_long_is_not_read_at_all() -> None:
    def announce(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(_HEAD + b"Content-Length: 1000000000\r\n\r\n")
        stop.wait(10)

    with store(announce) as url:
        took, error = read_in_thread(PrometheusReader(url, max_answer_bytes=1 << 20), 5.0)
    assert isinstance(error, SourceUnavailable) and "more than 1,048,576 bytes" in str(error)
    assert took < 2.0


def test_cluster_choose_answers_503_naming_the_deadline_when_the_store_trickles() -> None:
    with store(trickle) as url:
        s = build_stack(
            lambda c: SimulatedNvml.of(Scenario.with_gpus(1), clock=c.monotonic),
            prometheus_url=url,
        )
        cluster = s.daemon.services.cluster
        assert cluster is not None and cluster.reader.timeout == 10.0  # the default
        cluster.reader.timeout = 2.0
        took, resp = within(6.0, lambda: s.client.get("/cluster/choose?n=1&format=json"))
    assert took < 3.0
    error = resp.get_json()["error"]
    assert (resp.status_code, error["code"]) == (503, "prometheus_unavailable")
    assert f"no answer from {url.removeprefix('http://')} within 2 s" in error["message"]


def test_a_read_is_given_up_at_once_when_its_check_says_so() -> None:
    gone = threading.Event()

    def check() -> None:
        if gone.is_set():
            raise ApiError(499, "client_closed", "the client closed the connection")

    outcome: list[BaseException] = []
    with store(trickle) as url:
        reader = PrometheusReader(url, timeout=30.0)
        req = parse_cluster_args({"n": "1"})

        def run() -> None:
            try:
                reader.read(req, time.time(), check)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        time.sleep(0.5)
        gone.set()
        thread.join(2.0)
    assert outcome and isinstance(outcome[0], ApiError) and outcome[0].code == "client_closed"


def test_a_trickling_host_is_passed_over_at_the_deadline_of_the_whole_read() -> None:
    """``--hosts``: each read had only a per-read timeout, which every trickled byte resets,
    so one such host held the choice for as long as it liked. Now the read of the hosts has
    one deadline; the host still trickling then is passed over, the others are chosen from."""
    with store(trickle) as slow, served(sampling=False) as good:
        took, result = within(
            8.0,
            lambda: choose_fleet(
                {"n": "1", "lease": "0", "max_util": "1", "max_mem_used": "1"},
                hosts=[slow, good.url],
                timeout=2.0,
                claimer=http_claimer,
                release=release,
            ),
        )
    assert took < 4.0
    assert not isinstance(result, BaseException), result
    assert result.placements[0].url == good.url
    passed = {url: why for _, url, why in result.passed_over}
    assert "within 2 s (the deadline of the whole read)" in passed[slow], passed


def test_a_host_trickling_its_claim_answer_is_cut_at_the_claims_deadline() -> None:
    """The chosen host answered the read honestly and then trickled its ``/choose`` answer,
    one byte a second: the claim had only the per-read timeout, which every byte resets, so
    it held the choice as long as the host liked. Now the claim has one deadline."""
    with served(sampling=False) as behind:

        def honest_reads_trickled_claim(conn: socket.socket, stop: threading.Event) -> None:
            head = b""
            while b"\r\n\r\n" not in head and (got := conn.recv(65536)):
                head += got
            path = head.split(b" ", 2)[1].decode()
            if path.startswith("/choose"):
                trickle(conn, stop)
                return
            body = get(behind.url + path)[1].encode()
            conn.sendall(_HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)

        with store(honest_reads_trickled_claim, read_request=False) as host:
            took, result = within(
                8.0,
                lambda: choose_fleet(
                    {"n": "1", "lease": "30s", "max_util": "1", "max_mem_used": "1"},
                    hosts=[host],
                    timeout=2.0,
                    claimer=http_claimer,
                    release=release,
                ),
            )
    assert took < 6.0  # the read, then the claim's 2 s
    assert isinstance(result, ApiError) and result.status == 503, result
    assert "no answer within 2 s (the claim's deadline)" in result.message, result.message


# -- a real exporter process -----------------------------------------------------------------


def ask_and_leave(base: str, path: str, after: float) -> None:
    """Send a GET for ``path`` and hang up ``after`` seconds later without reading."""
    with socket.create_connection(_host_port(base)) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        time.sleep(after)


def _host_port(base: str) -> tuple[str, int]:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


# An exporter with 4 request slots (and 2 waiters, fewer than its slots, as it requires).
FOUR_SLOTS = ("--simulate", "1", "--max-requests-in-flight", "4", "--max-waiters", "2")


def askers(base: str, n: int, after: float) -> list[threading.Thread]:
    """``n`` clients started asking ``/cluster/choose`` that hang up ``after`` seconds."""
    threads = [
        threading.Thread(
            target=ask_and_leave, args=(base, "/cluster/choose?n=1", after), daemon=True
        )
        for _ in range(n)
    ]
    for t in threads:
        t.start()
    return threads


@pytest.mark.slow
def test_clients_that_leave_free_their_slots_and_others_are_answered_meanwhile() -> None:
    with (
        store(trickle) as url,
        exporter(*FOUR_SLOTS, "--prometheus-url", url) as ex,
    ):
        leavers = askers(ex.base, 8, 0.5)
        for t in leavers:
            t.join()
        time.sleep(0.5)  # each left 0.5 s after asking; the exporter notices within 0.1 s
        started = time.monotonic()
        assert get(ex.base + "/metrics")[0] == 200
        status, body = get(ex.base + "/choose?n=1&lease=0&max_util=1&max_mem_used=1")
        assert status == 200, body
        assert time.monotonic() - started < 2.0


@pytest.mark.slow
def test_patient_clients_of_a_trickling_store_leave_slots_for_scrapes_and_choose() -> None:
    """Clients that stay for their answer hold at most ``Limits.store_reads`` request slots;
    before, 4 of them took every slot of ``--max-requests-in-flight 4`` for the 10 s read."""
    with (
        store(trickle) as url,
        exporter(*FOUR_SLOTS, "--prometheus-url", url) as ex,
    ):
        patient = askers(ex.base, 4, 6.0)
        time.sleep(1.5)  # one read is under way, the other three refused store_busy
        for _ in range(3):
            status, body = get(ex.base + "/metrics")
            assert status == 200, body
            status, body = get(ex.base + "/choose?n=1&lease=0&max_util=1&max_mem_used=1")
            assert status == 200, body
        status, body = get(ex.base + "/cluster/choose?n=1&format=json")
        assert status == 503, body
        assert json.loads(body)["error"]["code"] == "store_busy"
        assert "1 fleet read is in progress already" in body
        metrics = get(ex.base + "/metrics")[1]
        assert 'gpu_exporter_requests_rejected_total{reason="store_busy"} 0.0' not in metrics
        assert 'gpu_exporter_requests_rejected_total{reason="store_busy"}' in metrics
        for t in patient:
            t.join()


def _peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.slow
def test_a_flood_is_refused_at_the_default_limit_and_memory_stays_bounded() -> None:
    sent = [0]
    with (
        store(flood(768 << 20, sent)) as url,
        exporter("--simulate", "1", "--prometheus-url", url) as ex,
    ):
        status, body = get(ex.base + "/cluster/choose?n=1&format=json", timeout=60)
        assert status == 503, body
        assert _peak_rss_bytes(ex.proc.pid) < 512 << 20  # the old reader held all 768 MiB
        assert json.loads(body)["error"]["code"] == "prometheus_unavailable"
        assert "more than 268,435,456 bytes, the most the fleet reader takes" in body
        assert sent[0] < 400 << 20


@pytest.mark.slow
def test_sigterm_ends_the_exporter_within_5_s_with_store_reads_in_flight() -> None:
    with (
        store(trickle) as url,
        exporter("--simulate", "1", "--prometheus-url", url) as ex,
    ):
        askers(ex.base, 6, 8.0)
        time.sleep(1.0)  # every read is under way, its clients still waiting
        ex.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        try:
            ex.proc.wait(timeout=5.0)
        except Exception:
            pytest.fail("the exporter was still running 5 s after SIGTERM")
        assert time.monotonic() - started < 5.0
        assert ex.proc.returncode == 0
