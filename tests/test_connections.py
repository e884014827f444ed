"""The connection layer through real sockets (issue 14): slow, idle, hostile and unread
clients cost no worker; deadlines for whole waits; caps; framing errors; HEAD; SIGTERM."""

from __future__ import annotations

import contextlib
import http.client
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

from gpu_exporter.web.gateway import call_app
from gpu_exporter.web.limits import Limits, Timeouts
from gpu_exporter.web.peers import PeerIdentities
from gpu_exporter.web.server import Server
from harness import free_port, start, stop, wait_ready
from served import Served, served

ALL = "max_util=100%25&max_mem_used=100%25"  # busy cards count too


@contextlib.contextmanager
def extra_server(exporter: Served, **options: object) -> Iterator[Server]:
    """A second server for ``exporter``'s app on loopback, with ``options``."""
    server = Server(exporter.daemon.app, "127.0.0.1", 0, **options)  # type: ignore[arg-type]
    server.bind()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(10)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def timed_get(port: int, path: str, method: str = "GET") -> tuple[int, bytes, float]:
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read(), time.monotonic() - started
    finally:
        conn.close()


def closed_within(sock: socket.socket, seconds: float) -> float:
    """How long until the server closed ``sock`` (reading and dropping what it sends)."""
    started = time.monotonic()
    sock.settimeout(seconds)
    with contextlib.suppress(ConnectionResetError):
        while sock.recv(65536):
            pass
    return time.monotonic() - started


def raw(port: int, data: bytes) -> bytes:
    """Send ``data``, read until the server closes."""
    with connect(port) as sock:
        sock.sendall(data)
        out = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                out += chunk
    return out


def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s"
        time.sleep(0.02)


# -- slow and idle clients cost no worker --------------------------------------------------


def test_slowloris_and_idle_connections_do_not_starve_anyone() -> None:
    # 8 workers in all (4 + 4 for probes) held 8 connections for good under cheroot.
    with served(max_requests_in_flight=4) as exporter:
        port = exporter.port
        held = [connect(port) for _ in range(40)]  # idle: never send a byte
        for sock in held[:20]:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # a head never finished
        time.sleep(0.2)
        for path in ("/healthz", "/readyz", "/metrics", f"/choose?n=1&lease=0&{ALL}"):
            status, _, seconds = timed_get(port, path)
            assert status == 200 and seconds < 1.0, (path, status, seconds)
        for sock in held:
            sock.close()


def test_the_request_deadline_is_for_the_whole_head_not_per_byte() -> None:
    timeouts = Timeouts(request_seconds=1.0)
    with (
        served() as exporter,
        extra_server(exporter, timeouts=timeouts) as s,
        connect(s.port) as slow,
        connect(s.port) as idle,
    ):
        slow.sendall(b"GET /metrics HTTP/1.1\r\n")
        started = time.monotonic()
        slow.settimeout(0.2)
        gone = False
        while time.monotonic() - started < 3 and not gone:  # one byte every 0.2 s
            try:
                slow.sendall(b"X")
                gone = slow.recv(1) == b""
            except TimeoutError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                gone = True
        assert gone and time.monotonic() - started < 2.0
        assert closed_within(idle, 2.0) < 2.0  # nothing sent at all: the same deadline


def test_an_unread_answer_is_dropped_after_the_write_deadline() -> None:
    timeouts = Timeouts(write_seconds=1.0)
    with served() as exporter, extra_server(exporter, timeouts=timeouts) as s:
        greedy = [socket.socket() for _ in range(5)]
        for sock in greedy:  # pipelined scrapes, never read: far more than the kernel buffers
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", s.port))
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 400)
        for _ in range(5):
            status, _, seconds = timed_get(s.port, "/metrics")
            assert status == 200 and seconds < 1.0
        assert s.site is not None
        until(lambda: s.site is not None and s.site.slots.held == 0, 5.0)
        for sock in greedy:
            sock.close()


# -- caps -----------------------------------------------------------------------------------


def test_a_new_connection_evicts_its_address_oldest_waiting_one() -> None:
    with (
        served() as exporter,
        extra_server(exporter, limits=Limits(max_waiting_per_peer=5)) as s,
    ):
        idle = [connect(s.port) for _ in range(5)]
        time.sleep(0.1)
        assert timed_get(s.port, "/healthz")[0] == 200  # the good client gets in
        assert closed_within(idle[0], 2.0) < 2.0  # … and the oldest idle one went
        assert s.site is not None and s.site.slots.evicted >= 1
        for sock in idle:
            sock.close()


def hold_long_polls(exporter: Served, port: int, n: int, source: str = "") -> list[socket.socket]:
    """``n`` connections to ``port``, each busy in a waiting ``/choose`` (never evictable
    as waiting): every GPU is leased first."""
    assert timed_get(exporter.port, f"/choose?n=4&lease=1h&{ALL}")[0] == 200  # all taken
    busy = [socket.create_connection(("127.0.0.1", port), 5, (source, 0)) for _ in range(n)]
    for sock in busy:
        sock.sendall(f"GET /choose?n=1&wait=3s&{ALL} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    until(lambda: exporter.daemon.services.waiters.active == n)
    return busy


def test_beyond_the_global_cap_with_nothing_to_evict_is_503_at_once() -> None:
    limits = Limits(max_connections=2, probe_connections=0)
    with (
        served() as exporter,
        extra_server(exporter, limits=limits, rejections=exporter.daemon.rejections) as s,
    ):
        busy = hold_long_polls(exporter, s.port, 2)
        answer = raw(s.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert answer.endswith(b"\r\n\r\nerror: too many connections; retry in a second\n")
        assert exporter.daemon.rejections.counts()["too_many_connections"] == 1
        for sock in busy:
            sock.close()


def test_a_probe_always_gets_a_connection() -> None:
    # Issue 28.11: a full cap made /healthz 503, and a liveness probe restarts the exporter.
    with (
        served() as exporter,
        extra_server(exporter, limits=Limits(max_connections=2)) as s,
    ):
        busy = hold_long_polls(exporter, s.port, 2)  # the same peer as the probe
        assert timed_get(s.port, "/healthz")[0] == 200
        assert timed_get(s.port, "/readyz")[0] == 200
        status, body, _ = timed_get(s.port, "/metrics")  # held for probes only
        assert status == 503 and body == b"error: too many connections; retry in a second\n"
        for sock in busy:
            sock.close()


def test_a_refusal_lingering_on_a_probe_connection_is_closed_when_the_server_stops() -> None:
    """A request refused on a connection held for probes lingers (its rest is dropped);
    stopping the server closes it too, long before its linger would end."""
    with served() as exporter:
        lingering = Timeouts(linger_seconds=60.0)
        with extra_server(exporter, limits=Limits(max_connections=2), timeouts=lingering) as s:
            busy = hold_long_polls(exporter, s.port, 2)
            sock = connect(s.port)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            site = s.site
            assert site is not None
            until(lambda: "LINGERING" in {c.state.name for c in site.slots.connections()})
        assert site.slots.connections() == []
        assert closed_within(sock, 5.0) < 5.0
        for held in (sock, *busy):
            held.close()


def test_unread_answers_are_the_first_to_go_at_the_cap() -> None:
    # Issue 28.11: connections pipelining scrapes into a tiny receive buffer and reading
    # nothing held the whole cap until the write deadline (10 s), and every new connection
    # got 503 meanwhile.
    with served() as exporter, extra_server(exporter, limits=Limits(max_connections=10)) as s:
        greedy = [socket.socket() for _ in range(10)]
        try:
            for sock in greedy:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect(("127.0.0.1", s.port))
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 400)
            # Their answers fill the buffers and all ten stall (well within 2.5 s, on a busy
            # machine too): a new connection is then served at once, where the old code
            # answered 503 until the 10 s write deadline freed the cap.
            time.sleep(2.5)
            for _ in range(5):
                status, _, seconds = timed_get(s.port, "/metrics")
                assert status == 200 and seconds < 2.0
        finally:
            for sock in greedy:
                sock.close()


class EachAddressAPeer(PeerIdentities):
    """Names each loopback address a peer of its own, as if each were another host."""

    def identify(self, peer: tuple[str, int], local: tuple[str, int]) -> str:
        return peer[0]


def test_one_peer_cannot_take_the_whole_cap() -> None:
    # Issue 28.11: the cap is shared fairly; one peer's busy connections give way to another's.
    peers = EachAddressAPeer()
    with (
        served() as exporter,
        extra_server(exporter, limits=Limits(max_connections=2), peers=peers) as s,
    ):
        busy = hold_long_polls(exporter, s.port, 2, source="127.0.0.2")
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=5)
        conn.request("GET", "/metrics")
        assert conn.getresponse().status == 200
        conn.close()
        assert closed_within(busy[0], 2.0) < 2.0  # the hog's oldest went
        for sock in busy:
            sock.close()


# -- framing --------------------------------------------------------------------------------


def error_line(answer: bytes) -> tuple[int, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert body.endswith(b"\n") and body.count(b"\n") == 1 and body.startswith(b"error: "), answer
    assert b"Traceback" not in answer
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (  # a chunked body over 64 KiB: was 500
            b"POST /leases HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + (b"4000\r\n" + b"a" * 0x4000 + b"\r\n") * 5
            + b"0\r\n\r\n",
            413,
        ),
        (  # declared too long: answered before the body is read
            b"POST /leases HTTP/1.1\r\nHost: x\r\nContent-Length: 70000\r\n\r\n",
            413,
        ),
        (  # both framings: was 200 with the body ignored
            b"POST /leases HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Length: 5\r\n\r\n0\r\n\r\n",
            400,
        ),
        (  # a chunk size that is not hex
            b"POST /leases HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n",
            400,
        ),
        (b"POST /leases HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
        (b"GET /healthz\x00 HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"NOT A REQUEST\r\n\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\nno colon here\r\n\r\n", 400),
        (b"GET healthz HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\n", 431),
    ],
)
def test_malformed_requests_get_one_4xx_line(request_bytes: bytes, status: int) -> None:
    with served(sampling=False) as exporter:
        assert error_line(raw(exporter.port, request_bytes))[0] == status


def test_good_framing_still_works() -> None:
    with served(sampling=False) as exporter:
        port = exporter.port
        # Two pipelined requests on one connection, the second closing it.
        answer = raw(
            port,
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        assert answer.count(b"HTTP/1.1 200 OK") == 2
        # A small chunked body reaches the app (an unknown lease: 404, not ignored).
        answer = raw(
            port,
            b"POST /leases/nope/release HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        )
        assert answer.startswith(b"HTTP/1.1 404 ")
        # HTTP/1.0 without a Host header.
        assert raw(port, b"GET /healthz HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 200 OK")


# -- HEAD -----------------------------------------------------------------------------------


def test_head_works_wherever_get_does_without_a_body_or_a_claim() -> None:
    with served() as exporter:
        paths = ("/", "/metrics", "/gpus", "/leases", "/healthz", "/readyz", "/openapi.json")
        for path in (*paths, f"/choose?n=1&{ALL}"):
            get_status = timed_get(exporter.port, path + ("&lease=0" if "?" in path else ""))[0]
            status, body, _ = timed_get(exporter.port, path, "HEAD")
            assert (status, body) == (get_status, b""), path
        assert exporter.leases() == []  # HEAD /choose claimed nothing


# -- TLS ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca = CA.create(d, "ca")
    issued = ca.issue(d, "server", server=True)
    config = d / "web.yml"
    config.write_text(f"tls_server_config: {{cert_file: {issued.cert}, key_file: {issued.key}}}\n")
    return config, ca.path


def tls_healthz(port: int, ca: Path) -> float:
    ctx = ssl.create_default_context(cafile=str(ca))
    started = time.monotonic()
    conn = http.client.HTTPSConnection("localhost", port, timeout=5, context=ctx)
    try:
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    return time.monotonic() - started


def test_clients_that_never_handshake_do_not_delay_probes(tls_files: tuple[Path, Path]) -> None:
    config, ca = tls_files
    with served(web_config_file=str(config), max_requests_in_flight=4) as exporter:
        silent = [connect(exporter.port) for _ in range(40)]  # TCP, never a ClientHello
        time.sleep(0.2)
        slowest = max(tls_healthz(exporter.port, ca) for _ in range(10))
        assert slowest < 1.0
        for sock in silent:
            sock.close()


def test_the_tls_handshake_has_a_deadline(tls_files: tuple[Path, Path]) -> None:
    config, _ = tls_files
    timeouts = Timeouts(handshake_seconds=0.5)
    with served(web_config_file=str(config)) as exporter:
        watcher = exporter.daemon.watcher
        assert watcher is not None
        with (
            extra_server(exporter, tls=watcher.tls_context, timeouts=timeouts) as s,
            connect(s.port) as silent,
        ):
            silent.sendall(b"\x16\x03\x01")  # the start of a ClientHello, then nothing
            assert closed_within(silent, 3.0) < 1.5


# -- SIGTERM --------------------------------------------------------------------------------


def test_sigterm_ends_the_process_within_5_s_whatever_the_clients_do() -> None:
    port = free_port()
    proc = start("serve", "--simulate", "1", "--listen-address", f"127.0.0.1:{port}")
    held: list[socket.socket] = []
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        assert timed_get(port, f"/choose?n=1&lease=1h&{ALL}")[0] == 200
        waiter = connect(port)  # waits for the one GPU, leased above
        waiter.sendall(f"GET /choose?n=1&wait=60s&{ALL} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        for _ in range(40):
            sock = connect(port)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # slowloris
            held.append(sock)
        held.extend(connect(port) for _ in range(40))  # idle
        time.sleep(0.5)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        assert time.monotonic() - started < 5.0
        waiter.settimeout(5)
        answer = waiter.recv(65536)
        assert answer.startswith(b"HTTP/1.1 503 ")
        assert answer.endswith(b"error: the exporter is shutting down\n")
        waiter.close()
    finally:
        for sock in held:
            sock.close()
        err = stop(proc)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def test_a_busy_pool_queues_requests_and_never_refuses_one() -> None:
    """The pool bounds threads, not requests (RequestLimits does): jobs beyond its size wait
    for a thread, in order, and all run."""
    from gpu_exporter.web.gateway import Workers

    workers = Workers(2, "test")
    release, lock = threading.Event(), threading.Lock()
    running, most, done = [0], [0], []

    def hold(i: int) -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(5)
        with lock:
            running[0] -= 1
            done.append(i)

    for i in range(5):
        workers.submit(lambda i=i: hold(i))
    time.sleep(0.1)
    assert running[0] == 2 and done == []  # two threads, three jobs waiting for them
    release.set()
    deadline = time.monotonic() + 5
    while len(done) < 5:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert most[0] == 2 and sorted(done) == [0, 1, 2, 3, 4]
    workers.stop()


def test_one_keep_alive_connection_answers_request_after_request() -> None:
    """A scraper reuses its connection: each later request, sent after the answer to the one
    before (not pipelined), is answered on the same connection, and the last one closes it."""
    with served() as exporter:
        conn = http.client.HTTPConnection("127.0.0.1", exporter.port, timeout=5)
        try:
            for path in ("/healthz", "/metrics", "/choose?n=1&lease=0", "/gpus"):
                conn.request("GET", path)
                response = conn.getresponse()
                response.read()
                assert response.status == 200, path
                assert response.getheader("Connection") is None, path  # kept alive
            conn.request("GET", "/healthz", headers={"Connection": "close"})
            response = conn.getresponse()
            assert response.read() == b"ok\n"
            assert response.getheader("Connection") == "close"
            sock = conn.sock
            assert sock is None or sock.recv(1) == b""  # and the server closed it
        finally:
            conn.close()


def test_a_request_slot_is_free_before_its_answer_is_handed_back() -> None:
    """A client that sends its next request the moment it has the answer finds its slot free
    (16 keep-alive clients from one address otherwise got 503 now and then): RequestLimits
    collects the whole body and gives the slot back before the worker hands the answer on."""
    from gpu_exporter.web.limits import RequestLimits

    def app(environ: dict, start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok\n"]

    limits = RequestLimits(app, Limits(max_in_flight=1))
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/gpus", "QUERY_STRING": ""}
    for _ in range(3):
        assert call_app(limits, dict(environ)).status == 200


def test_a_header_with_a_line_break_is_never_sent() -> None:
    """No response splitting: an answer whose header holds CR/LF is dropped, not written."""

    def app(environ: dict[str, object], start_response: Callable[..., object]) -> list[bytes]:
        start_response("200 OK", [("X-Note", "a\r\nSet-Cookie: stolen=1")])
        return [b"body"]

    server = Server(app, "127.0.0.1", 0)
    server.bind()
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        with connect(server.port) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            received = b""
            while chunk := sock.recv(4096):
                received += chunk
        assert b"stolen" not in received and b"body" not in received
    finally:
        server.stop()
        thread.join(10)


def test_the_connection_state_machine_moves_only_along_its_table() -> None:
    """Every state can end in CLOSED, CLOSED leads nowhere else, and a move that is not in
    the table raises instead of leaving a connection half in two states."""
    from gpu_exporter.web.connection import _NEXT, HttpConnection, State

    assert set(_NEXT) == set(State)
    assert all(State.CLOSED in moves for moves in _NEXT.values())
    assert _NEXT[State.CLOSED] == {State.CLOSED}
    conn = HttpConnection(None, ("127.0.0.1", 1), ("127.0.0.1", 2), "local:me")  # type: ignore[arg-type]
    assert conn.state is State.OPENING
    with pytest.raises(RuntimeError, match="OPENING → WORKING"):
        conn._to(State.WORKING)
    conn._to(State.READING)
    assert conn.state is State.READING
