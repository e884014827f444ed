"""Hostile clients against an HTTP(S) server, and good clients that measure what is left.

Run from the repository root, against any running exporter::

    .venv/bin/python bench/hostile.py run --port 9400 --slowloris 200 --idle 200 --seconds 10
    .venv/bin/python bench/hostile.py run --port 9400 --tls --ca ca.pem --tls-silent 100 ...
    .venv/bin/python bench/hostile.py run --port 9400 --bad-auth 40 --auth alice:secret

It prints one JSON report: for each good client (``/metrics``, ``/healthz``, ``/choose``)
requests, errors (with their kinds) and p50/p99/max latency in ms, and what the attack did.

The attackers (stdlib only, in a subprocess of their own so that their work never competes
with the good clients for this process' GIL):

* ``slowloris``: send a request head one byte per second, forever (the head never ends:
  header lines follow one another); reconnect when the server closes.
* ``idle``: connect (and, on a TLS port, finish the handshake), send nothing; reconnect when
  closed.
* ``tls_silent``: open TCP to the TLS port and never start the handshake; reconnect when closed.
* ``pipeline_unread``: pipeline ``GET /metrics`` requests (one more each second) on a socket
  with a small receive buffer and never read a byte of the answers.
* ``bad_auth``: threads sending ``GET /metrics`` with a wrong basic-auth password, back to
  back, from another loopback address (``127.0.0.2`` by default) so that a server's
  per-address throttling can tell them from the good clients on ``127.0.0.1`` (gpu-exporter
  counts a local client by its user, whatever address it binds: to it they are one client,
  and a good client's password proven before the attack is what keeps it going).

All socket attackers share ONE selector thread (non-blocking sockets, non-blocking TLS
handshakes): 500 attack connections cost a few hundred sends a second, not 500 threads, so
the attack itself does not starve the measuring clients on a 2-core machine.

The good clients, in the calling process: a scraper fetching ``/metrics`` then ``/healthz``
every 100 ms on a keep-alive connection (as Prometheus keeps its connection), and a job
calling ``/choose?lease=0`` every 100 ms on a new connection each time (as job scripts do).
Any exception, timeout or non-200 answer is an error.

Importable: :func:`measure` (start the attack, ramp up, run the good clients, stop the
attack) is what ``tests/test_hostile_clients.py``, ``bench/servers.py --hostile`` and
``bench/run.py``'s "hostile clients" row use.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import os
import resource
import selectors
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

HOST = "127.0.0.1"
BAD_SOURCE = "127.0.0.2"  # all of 127/8 is loopback on Linux
RECONNECT_SECONDS = 0.25  # after the server closes: soon, but not a hot loop of refusals
SLOW_BYTE_SECONDS = 1.0
PIPELINE_EVERY_SECONDS = 1.0
# Requests sent at once on connecting: ~6 MB of /metrics, more than any socket buffer holds.
PIPELINE_FIRST = 64
GOOD_INTERVAL_SECONDS = 0.1
GOOD_TIMEOUT_SECONDS = 5.0
TICK_SECONDS = 0.05


@dataclass(frozen=True)
class Target:
    """Where the server listens, and how a good client talks to it."""

    port: int
    host: str = HOST
    tls: bool = False
    ca_file: str | None = None  # verify the server against this CA; None: no verification
    auth: str | None = None  # "user:password" for the good clients
    choose_path: str = "/choose?lease=0"


@dataclass(frozen=True)
class Attack:
    """How many of each attacker; every count may be 0."""

    slowloris: int = 0
    idle: int = 0
    tls_silent: int = 0  # only meaningful against a TLS port
    pipeline_unread: int = 0
    bad_auth: int = 0  # threads
    bad_auth_user: str = "alice"
    bad_source: str = BAD_SOURCE

    def connections(self) -> int:
        return self.slowloris + self.idle + self.tls_silent + self.pipeline_unread + self.bad_auth


def raise_fd_limit(wanted: int = 8192) -> None:
    """Raise this process' soft RLIMIT_NOFILE towards ``wanted`` (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


# -- the attackers (in the attack subprocess) --------------------------------------------------


def _client_context(target: Target) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=target.ca_file) if target.ca_file else None
    if ctx is None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


@dataclass
class KindStats:
    opened: int = 0  # connection attempts
    connected: int = 0  # TCP (and, where it applies, TLS) established
    failed: int = 0  # refused, reset or handshake failed
    closed_by_server: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    held_seconds: list[float] = field(default_factory=list)  # until the server closed

    def summary(self) -> dict[str, Any]:
        held = sorted(self.held_seconds)
        out = {k: v for k, v in asdict(self).items() if k != "held_seconds"}
        out["held_p50_seconds"] = round(held[len(held) // 2], 2) if held else None
        out["held_max_seconds"] = round(held[-1], 2) if held else None
        return out


class _Conn:
    __slots__ = ("due", "kind", "lines", "pending", "since", "sock", "state", "tls")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.sock: socket.socket | None = None
        self.state = "closed"  # closed → connecting → (handshake →) open → closed
        self.due = 0.0  # monotonic time of the next action (reconnect, send a byte)
        self.since = 0.0
        self.pending = b""
        self.lines = 0
        self.tls = False


class Swarm:
    """Every socket attacker on one selector thread."""

    def __init__(self, target: Target, attack: Attack) -> None:
        self.target = target
        self.ctx = _client_context(target) if target.tls else None
        kinds = {
            "slowloris": attack.slowloris,
            "idle": attack.idle,
            "tls_silent": attack.tls_silent,
            "pipeline_unread": attack.pipeline_unread,
        }
        self.conns = [_Conn(kind) for kind, n in kinds.items() for _ in range(n)]
        self.stats = {kind: KindStats() for kind, n in kinds.items() if n}
        self.selector = selectors.DefaultSelector()
        self.stopping = threading.Event()
        self.request = (
            f"GET /metrics HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
            "User-Agent: hostile-pipeline\r\n\r\n"
        ).encode()

    # -- life cycle of one connection
    def _open(self, c: _Conn, now: float) -> None:
        self.stats[c.kind].opened += 1
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if c.kind == "pipeline_unread":  # small buffers: the server's writes block sooner
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        sock.connect_ex((self.target.host, self.target.port))
        c.sock, c.state, c.since, c.tls = sock, "connecting", now, False
        c.pending, c.lines = b"", 0
        self.selector.register(sock, selectors.EVENT_WRITE, c)

    def _close(self, c: _Conn, now: float, *, by_server: bool) -> None:
        if c.sock is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(c.sock)
            with contextlib.suppress(OSError):
                c.sock.close()
        if by_server:
            self.stats[c.kind].closed_by_server += 1
            self.stats[c.kind].held_seconds.append(now - c.since)
        c.sock, c.state, c.due = None, "closed", now + RECONNECT_SECONDS

    def _fail(self, c: _Conn, now: float) -> None:
        self.stats[c.kind].failed += 1
        self._close(c, now, by_server=False)

    def _established(self, c: _Conn, now: float) -> None:
        assert c.sock is not None
        self.stats[c.kind].connected += 1
        c.state, c.due = "open", now
        if c.kind == "pipeline_unread":
            # Never read: not registered at all (a readable socket would wake the loop for
            # ever); a failed send says the server closed it.
            self.selector.unregister(c.sock)
            c.pending = self.request * PIPELINE_FIRST
            self._flush(c, now)
            c.due = now + PIPELINE_EVERY_SECONDS
        else:
            self.selector.modify(c.sock, selectors.EVENT_READ, c)

    def _handshake(self, c: _Conn, now: float) -> None:
        assert c.sock is not None
        try:
            c.sock.do_handshake()  # type: ignore[attr-defined]
        except ssl.SSLWantReadError:
            self.selector.modify(c.sock, selectors.EVENT_READ, c)
        except ssl.SSLWantWriteError:
            self.selector.modify(c.sock, selectors.EVENT_WRITE, c)
        except (OSError, ValueError):
            self._fail(c, now)
        else:
            self._established(c, now)

    def _connected(self, c: _Conn, now: float) -> None:
        assert c.sock is not None
        if c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self._fail(c, now)
            return
        if self.ctx is None or c.kind == "tls_silent":
            self._established(c, now)
            return
        self.selector.unregister(c.sock)
        c.sock = self.ctx.wrap_socket(
            c.sock, server_hostname=self.target.host, do_handshake_on_connect=False
        )
        c.tls, c.state = True, "handshake"
        self.selector.register(c.sock, selectors.EVENT_WRITE, c)
        self._handshake(c, now)

    def _flush(self, c: _Conn, now: float) -> None:
        assert c.sock is not None
        try:
            sent = c.sock.send(c.pending) if c.pending else 0
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
            return
        except (OSError, ValueError):
            self._close(c, now, by_server=True)
            return
        self.stats[c.kind].bytes_sent += sent
        c.pending = c.pending[sent:]

    def _readable(self, c: _Conn, now: float) -> None:
        assert c.sock is not None
        try:
            data = c.sock.recv(65536)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
            return
        except (OSError, ValueError):
            data = b""
        if data:
            self.stats[c.kind].bytes_received += len(data)  # e.g. a 408; read on to the close
        else:
            self._close(c, now, by_server=True)

    def _timer(self, c: _Conn, now: float) -> None:
        if c.state == "closed":
            self._open(c, now)
        elif c.state == "open" and c.kind == "slowloris":
            if not c.pending:
                if c.lines == 0:
                    head = f"GET /metrics HTTP/1.1\r\nHost: {self.target.host}\r\n"
                    c.pending = head.encode()
                else:  # the head never ends
                    c.pending = f"X-Slow-{c.lines}: {c.lines}\r\n".encode()
                c.lines += 1
            whole = c.pending
            c.pending = whole[:1]
            self._flush(c, now)
            if c.state == "open":
                c.pending = c.pending + whole[1:]
                c.due = now + SLOW_BYTE_SECONDS
        elif c.state == "open" and c.kind == "pipeline_unread":
            c.pending += self.request
            self._flush(c, now)
            if c.state == "open":
                c.due = now + PIPELINE_EVERY_SECONDS
        elif c.state == "open":
            c.due = now + 3600.0  # idle, tls_silent: only the selector wakes them

    def run(self) -> None:
        for c in self.conns:
            self._open(c, time.monotonic())
        while not self.stopping.is_set():
            for key, _ in self.selector.select(TICK_SECONDS):
                c = key.data
                now = time.monotonic()
                if c.state == "connecting":
                    self._connected(c, now)
                elif c.state == "handshake":
                    self._handshake(c, now)
                elif c.state == "open":
                    self._readable(c, now)
            now = time.monotonic()
            for c in self.conns:
                if c.due <= now and c.state in ("closed", "open"):
                    self._timer(c, now)
        for c in self.conns:
            self._close(c, time.monotonic(), by_server=False)

    def open_now(self) -> int:
        return sum(c.state == "open" for c in self.conns)


class BadAuth:
    """Threads sending wrong basic-auth passwords as fast as the server answers."""

    def __init__(self, target: Target, attack: Attack) -> None:
        self.target, self.attack = target, attack
        self.ctx = _client_context(target) if target.tls else None
        self.statuses: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._one, args=(i,), daemon=True)
            for i in range(attack.bad_auth)
        ]

    def _connection(self) -> http.client.HTTPConnection:
        source = (self.attack.bad_source, 0)
        t = self.target
        if self.ctx is not None:
            return http.client.HTTPSConnection(
                t.host, t.port, timeout=10, source_address=source, context=self.ctx
            )
        return http.client.HTTPConnection(t.host, t.port, timeout=10, source_address=source)

    def _one(self, index: int) -> None:
        creds = f"{self.attack.bad_auth_user}:wrong-{index}".encode()
        headers = {"Authorization": "Basic " + base64.b64encode(creds).decode()}
        conn: http.client.HTTPConnection | None = None
        while not self.stopping.is_set():
            try:
                conn = conn or self._connection()
                conn.request("GET", "/metrics", headers=headers)
                resp = conn.getresponse()
                resp.read()
                outcome = str(resp.status)
                if resp.will_close:
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException) as exc:
                outcome = type(exc).__name__
                if conn is not None:
                    conn.close()
                conn = None
                self.stopping.wait(0.05)
            with self.lock:
                self.statuses[outcome] += 1
        if conn is not None:
            conn.close()


def attack_main(target: Target, attack: Attack, seconds: float) -> int:
    """The attack subprocess: run until SIGTERM (or ``seconds``), then print stats as JSON."""
    raise_fd_limit(4 * attack.connections() + 256)
    swarm, bad = Swarm(target, attack), BadAuth(target, attack)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    runner = threading.Thread(target=swarm.run, daemon=True)
    runner.start()
    for t in bad.threads:
        t.start()
    print("started", flush=True)
    done.wait(seconds)
    open_at_end = swarm.open_now()
    swarm.stopping.set()
    bad.stopping.set()
    runner.join(10)
    for t in bad.threads:
        t.join(1)
    report: dict[str, Any] = {k: s.summary() for k, s in swarm.stats.items()}
    for kind, s in report.items():
        s["configured"] = getattr(attack, kind)
    report["open_at_end"] = open_at_end
    if attack.bad_auth:
        report["bad_auth"] = {"threads": attack.bad_auth, "answers": dict(bad.statuses)}
    print(json.dumps(report), flush=True)
    return 0


@contextlib.contextmanager
def attacking(target: Target, attack: Attack, *, limit_seconds: float = 600.0) -> Iterator[Any]:
    """Run the attack in a subprocess while the block runs; yields a dict that is filled
    with the attack's stats when the block ends."""
    stats: dict[str, Any] = {}
    command = [sys.executable, __file__, "attack", *_target_args(target), *_attack_args(attack)]
    command += ["--seconds", str(limit_seconds)]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, bufsize=1
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "started":
            raise RuntimeError(f"the attack did not start (exit status {proc.wait(10)})")
        yield stats
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        with contextlib.suppress(ValueError):
            stats.update(json.loads(out.strip().splitlines()[-1]))


# -- the good clients (in the calling process) -------------------------------------------------


@dataclass
class Record:
    latencies_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        ms = sorted(self.latencies_ms)

        def pct(p: float) -> float | None:
            return round(ms[min(len(ms) - 1, int(p * len(ms)))], 1) if ms else None

        return {
            "requests": len(ms),
            "errors": sum(self.errors.values()),
            "error_kinds": dict(self.errors),
            "p50_ms": pct(0.5),
            "p99_ms": pct(0.99),
            "max_ms": round(ms[-1], 1) if ms else None,
        }


class GoodClients:
    """A scraper (``/metrics`` + ``/healthz`` every 100 ms, keep-alive) and a job
    (``/choose`` every 100 ms, a new connection each), measuring every request."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.ctx = _client_context(target) if target.tls else None  # one, as a client keeps
        self.headers = {"User-Agent": "good-client"}
        if target.auth:
            token = base64.b64encode(target.auth.encode()).decode()
            self.headers["Authorization"] = "Basic " + token
        self.records = {
            "/metrics": Record(),
            "/healthz": Record(),
            target.choose_path: Record(),
        }
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._scraper, daemon=True),
            threading.Thread(target=self._job, daemon=True),
        ]

    def _connection(self) -> http.client.HTTPConnection:
        t = self.target
        if self.ctx is not None:
            return http.client.HTTPSConnection(
                t.host, t.port, timeout=GOOD_TIMEOUT_SECONDS, context=self.ctx
            )
        return http.client.HTTPConnection(t.host, t.port, timeout=GOOD_TIMEOUT_SECONDS)

    def _get(
        self, conn: http.client.HTTPConnection | None, path: str
    ) -> http.client.HTTPConnection | None:
        """One timed GET, recorded; returns the connection to reuse (None: make a new one)."""
        record = self.records[path]
        started = time.perf_counter()
        try:
            conn = conn or self._connection()
            conn.request("GET", path, headers=self.headers)
            resp = conn.getresponse()
            resp.read()
        except (OSError, http.client.HTTPException) as exc:
            record.latencies_ms.append((time.perf_counter() - started) * 1000)
            record.errors[type(exc).__name__] += 1
            if conn is not None:
                conn.close()
            return None
        record.latencies_ms.append((time.perf_counter() - started) * 1000)
        if resp.status != 200:
            record.errors[str(resp.status)] += 1
        if resp.will_close:
            conn.close()
            return None
        return conn

    def _every(self, step: Any) -> None:
        next_at = time.monotonic()
        while not self.stopping.is_set():
            step()
            next_at += GOOD_INTERVAL_SECONDS
            self.stopping.wait(max(0.0, next_at - time.monotonic()))
            next_at = max(next_at, time.monotonic() - GOOD_INTERVAL_SECONDS)

    def _scraper(self) -> None:
        conn: list[http.client.HTTPConnection | None] = [None]

        def step() -> None:
            conn[0] = self._get(conn[0], "/metrics")
            conn[0] = self._get(conn[0], "/healthz")

        self._every(step)
        if conn[0] is not None:
            conn[0].close()

    def _job(self) -> None:
        def step() -> None:
            conn = self._get(None, self.target.choose_path)
            if conn is not None:
                conn.close()

        self._every(step)

    def run(self, seconds: float) -> dict[str, Any]:
        for t in self.threads:
            t.start()
        self.stopping.wait(seconds)
        self.stopping.set()
        for t in self.threads:
            t.join(GOOD_TIMEOUT_SECONDS * 2 + 1)
        return {path: r.summary() for path, r in self.records.items()}


def measure(
    target: Target, attack: Attack, *, seconds: float = 10.0, ramp_seconds: float = 2.0
) -> dict[str, Any]:
    """Start the attack, let it take hold for ``ramp_seconds``, run the good clients for
    ``seconds``, stop the attack. ``{"good": {path: summary}, "attack": {kind: stats}}``."""
    raise_fd_limit(4 * attack.connections() + 256)
    with attacking(target, attack) as attack_stats:
        time.sleep(ramp_seconds)
        good = GoodClients(target).run(seconds)
    return {"good": good, "attack": attack_stats, "seconds": seconds}


def worst(report: dict[str, Any]) -> dict[str, Any]:
    """The good clients' totals: errors, and the largest p99 and max over the endpoints."""
    good = report["good"].values()
    return {
        "errors": sum(g["errors"] for g in good),
        "p99_ms": max((g["p99_ms"] or 0.0) for g in good),
        "max_ms": max((g["max_ms"] or 0.0) for g in good),
        "requests": sum(g["requests"] for g in good),
    }


# -- command line ------------------------------------------------------------------------------


def _target_args(t: Target) -> list[str]:
    args = ["--host", t.host, "--port", str(t.port), "--choose-path", t.choose_path]
    if t.tls:
        args.append("--tls")
    if t.ca_file:
        args += ["--ca", t.ca_file]
    if t.auth:
        args += ["--auth", t.auth]
    return args


def _attack_args(a: Attack) -> list[str]:
    return [
        f"--slowloris={a.slowloris}",
        f"--idle={a.idle}",
        f"--tls-silent={a.tls_silent}",
        f"--pipeline-unread={a.pipeline_unread}",
        f"--bad-auth={a.bad_auth}",
        f"--bad-auth-user={a.bad_auth_user}",
        f"--bad-source={a.bad_source}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("mode", choices=("run", "attack"), help="run: attack and measure")
    parser.add_argument("--host", default=HOST)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tls", action="store_true", help="the port speaks TLS")
    parser.add_argument("--ca", help="CA file to verify the server (default: no verification)")
    parser.add_argument("--auth", help="USER:PASSWORD for the good clients")
    parser.add_argument("--choose-path", default="/choose?lease=0")
    for name in ("slowloris", "idle", "tls-silent", "pipeline-unread", "bad-auth"):
        parser.add_argument(f"--{name}", type=int, default=0)
    parser.add_argument("--bad-auth-user", default="alice")
    parser.add_argument("--bad-source", default=BAD_SOURCE)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--ramp-seconds", type=float, default=2.0)
    args = parser.parse_args(argv)
    target = Target(args.port, args.host, args.tls, args.ca, args.auth, args.choose_path)
    attack = Attack(
        args.slowloris,
        args.idle,
        args.tls_silent,
        args.pipeline_unread,
        args.bad_auth,
        args.bad_auth_user,
        args.bad_source,
    )
    if args.mode == "attack":
        return attack_main(target, attack, args.seconds)
    report = measure(target, attack, seconds=args.seconds, ramp_seconds=args.ramp_seconds)
    report["worst"] = worst(report)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
