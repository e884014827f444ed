"""Wrong passwords cannot starve right ones: throttled per address, bcrypt bounded, no slot held.

40 threads sending wrong basic-auth passwords once made a scraper with the right password get
503 on 33 of 39 scrapes: each failed bcrypt held one of the request slots. Now a failing
address is answered 429 with ``Retry-After`` before any bcrypt (web/auth.py), credentials
are checked outside the request limits, and a password already proven passes from the cache
whatever anyone else does.
"""

from __future__ import annotations

import base64
import http.client
import threading
import time
from collections import Counter
from pathlib import Path

import bcrypt
import pytest
from werkzeug.test import Client

from conftest import FakeClock, build_stack
from gpu_exporter.simulate import Scenario, SimulatedNvml
from gpu_exporter.web.auth import AuthThrottle
from gpu_exporter.web.limits import Limits
from served import served

LIMITS = Limits()
FREE_FAILURES, BASE_DELAY_SECONDS = LIMITS.auth_free_failures, LIMITS.auth_base_delay_seconds
MAX_DELAY_SECONDS = LIMITS.auth_max_delay_seconds
BAD_THREADS = 40
ATTACK_SECONDS = 3.0


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def web_config(tmp_path: Path, cost: int) -> str:
    hashed = bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=cost)).decode()
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    return str(path)


def test_wrong_passwords_from_one_address_do_not_starve_a_right_one(tmp_path: Path) -> None:
    # Cost 10: the shipped `hash-password` default, about 70 ms of a core per check.
    with served(web_config_file=web_config(tmp_path, 10)) as exporter:
        port = exporter.port
        good = basic("prometheus", "secret")
        bad = basic("prometheus", "guess")
        stop = threading.Event()
        bad_answers: Counter[int] = Counter()
        retry_afters: set[str] = set()
        lock = threading.Lock()

        def attacker() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            # Another address, but the same local user: one peer to the throttle (28.10); the
            # scraper's proven password passes from the cache all the same.
            conn.source_address = ("127.0.0.2", 0)
            try:
                attack(conn)
            finally:
                conn.close()

        def attack(conn: http.client.HTTPConnection) -> None:
            while not stop.is_set():
                try:
                    conn.request("GET", "/metrics", headers=bad)
                    resp = conn.getresponse()
                    resp.read()
                except (OSError, http.client.HTTPException):
                    conn.close()
                    continue
                with lock:
                    bad_answers[resp.status] += 1
                    if resp.status == 429:
                        retry_afters.add(resp.headers.get("Retry-After", ""))
                if resp.will_close:
                    conn.close()

        def scrape() -> int:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                conn.request("GET", "/metrics", headers=good)
                resp = conn.getresponse()
                resp.read()
                return resp.status
            finally:
                conn.close()

        assert scrape() == 200  # Prometheus was scraping before the attack began
        threads = [threading.Thread(target=attacker, daemon=True) for _ in range(BAD_THREADS)]
        for t in threads:
            t.start()
        statuses = []
        deadline = time.monotonic() + ATTACK_SECONDS
        while time.monotonic() < deadline:
            statuses.append(scrape())
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(15)
        metrics = exporter.daemon.app.test_client().get("/metrics", headers=good).text

    assert statuses and set(statuses) == {200}, Counter(statuses)
    # Five free failures, then one more try each time the wait (1 s, 2 s …) runs out.
    assert 0 < bad_answers[401] <= FREE_FAILURES + 3, bad_answers
    assert bad_answers[429] > bad_answers[401], bad_answers
    assert set(bad_answers) <= {401, 429, 503}, bad_answers
    assert retry_afters and all(value.isdigit() and int(value) >= 1 for value in retry_afters)
    assert 'gpu_exporter_requests_rejected_total{reason="auth_throttled"}' in metrics


def test_throttled_answers_follow_the_error_contract(tmp_path: Path) -> None:
    clock = FakeClock()
    stack = build_stack(
        lambda c: SimulatedNvml.of(Scenario.with_gpus(2), clock=c.monotonic),
        clock=clock,
        web_config_file=web_config(tmp_path, 4),
    )
    stack.sample()
    client = Client(stack.app)
    mallory = {"REMOTE_ADDR": "10.0.0.66"}
    for _ in range(FREE_FAILURES):
        resp = client.get("/metrics", headers=basic("prometheus", "x"), environ_overrides=mallory)
        assert resp.status_code == 401
    resp = client.get("/metrics", headers=basic("prometheus", "x"), environ_overrides=mallory)
    assert resp.status_code == 429 and resp.headers["Retry-After"] == "1"
    assert resp.text == "error: too many failed logins from 10.0.0.66; retry in 1 second\n"
    resp = client.get(
        "/gpus", headers=basic("prometheus", "secret"), environ_overrides=mallory
    )  # even the right password waits: it would cost a bcrypt, and guesses look the same
    assert resp.status_code == 429
    assert resp.json == {
        "error": {
            "code": "auth_throttled",
            "message": "too many failed logins from 10.0.0.66; retry in 1 second",
            "param": None,
        }
    }
    other = {"REMOTE_ADDR": "10.0.0.7"}  # another address is not held back by mallory's
    ok = client.get("/metrics", headers=basic("prometheus", "secret"), environ_overrides=other)
    assert ok.status_code == 200
    # Proven once, the password passes from the cache, from mallory's address too.
    ok = client.get("/metrics", headers=basic("prometheus", "secret"), environ_overrides=mallory)
    assert ok.status_code == 200
    clock.advance(BASE_DELAY_SECONDS)
    resp = client.get("/metrics", headers=basic("prometheus", "y"), environ_overrides=mallory)
    assert resp.status_code == 401  # the wait is over: one more guess, then twice as long
    resp = client.get("/metrics", headers=basic("prometheus", "y"), environ_overrides=mallory)
    assert resp.status_code == 429 and resp.headers["Retry-After"] == "2"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


def fail(throttle: AuthThrottle, address: str) -> None:
    assert throttle.begin(address) == 0.0
    throttle.end(address, ok=False)


def test_the_wait_doubles_to_a_minute_and_a_success_forgets() -> None:
    clock = Clock()
    throttle = AuthThrottle(clock)
    for _ in range(FREE_FAILURES):
        fail(throttle, "a")
    waits = []
    for _ in range(10):
        waits.append(throttle.begin("a"))
        clock.now += waits[-1]
        fail(throttle, "a")
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0, 60.0]
    assert waits[-1] == MAX_DELAY_SECONDS
    assert throttle.begin("b") == 0.0  # other addresses are untouched
    clock.now += 60.0
    assert throttle.begin("a") == 0.0
    throttle.end("a", ok=True)  # the right password: a clean slate
    assert all(throttle.begin("a") == 0.0 for _ in range(FREE_FAILURES))


def test_checks_in_flight_count_so_a_burst_gets_only_the_free_ones() -> None:
    throttle = AuthThrottle(Clock())
    allowed = [throttle.begin("a") == 0.0 for _ in range(BAD_THREADS)]
    assert allowed.count(True) == FREE_FAILURES
    throttle.cancel("a")  # one found no bcrypt slot: it does not count
    assert throttle.begin("a") == 0.0


@pytest.mark.parametrize("max_addresses", [1, 3])
def test_addresses_remembered_are_bounded(max_addresses: int) -> None:
    clock = Clock()
    throttle = AuthThrottle(clock, Limits(auth_max_addresses=max_addresses))
    for i in range(100):
        fail(throttle, f"10.0.0.{i}")
    assert len(throttle._addresses) <= max_addresses
