"""Issue 13.6: a retried claim never leaks a lease (``Idempotency-Key``).

The server part through the app (and a seeded state machine over claims, retries, releases
and expiry); the client's retry through a real socket whose first answer is lost.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import harness
from conftest import Stack, build_stack, sim_of
from gpu_exporter.cli import main as client_main
from gpu_exporter.client import ServerUnreachable, choose, release
from gpu_exporter.simulate import DEFAULT_MODEL, Load, SimGpu
from served import served

KEY = "Idempotency-Key"


def idle(n: int = 4, **config: Any) -> Stack:
    s = build_stack(sim_of(*(SimGpu(i, DEFAULT_MODEL, Load("idle")) for i in range(n))), **config)
    s.sample()
    return s


def get(s: Stack, query: str, key: str | None = None, addr: str = "10.0.0.1") -> Any:
    headers = {KEY: key} if key is not None else {}
    return s.client.get(f"/choose?{query}", headers=headers, environ_base={"REMOTE_ADDR": addr})


# -- the server --------------------------------------------------------------------------


def test_a_retry_with_the_same_key_gets_the_same_lease_and_token() -> None:
    s = idle()
    first = get(s, "n=2&format=json", '"8e03978e-40d5-43e8-bc93-6894a57f9324"')
    again = get(s, "n=2&format=json", '"8e03978e-40d5-43e8-bc93-6894a57f9324"')
    assert first.status_code == again.status_code == 200
    assert again.headers["X-GPU-Lease"] == first.headers["X-GPU-Lease"]
    assert again.get_json()["lease"] == first.get_json()["lease"]
    assert [g["uuid"] for g in again.get_json()["chosen"]] == [
        g["uuid"] for g in first.get_json()["chosen"]
    ]
    assert len(s.leases.active()) == 1
    # Text formats answer byte for byte the same; the key may come unquoted too.
    text = [get(s, "n=1&format=env", "job-42").text for _ in range(2)]
    assert text[0] == text[1] and "GPU_LEASE=" in text[0]
    assert len(s.leases.active()) == 2
    # A new key is a new claim.
    assert get(s, "n=1", "job-43").headers["X-GPU-Lease"] not in text[0]
    assert len(s.leases.active()) == 3


def test_a_key_is_scoped_to_its_requester() -> None:
    s = idle()
    mine = get(s, "n=1", "k1", addr="10.0.0.1").headers["X-GPU-Lease"]
    theirs = get(s, "n=1", "k1", addr="10.0.0.2").headers["X-GPU-Lease"]
    assert mine != theirs and len(s.leases.active()) == 2


def test_a_key_reused_with_other_parameters_is_422() -> None:
    s = idle()
    assert get(s, "n=1", "k").status_code == 200
    resp = get(s, "n=2&format=json", "k")
    assert resp.status_code == 422
    assert resp.get_json()["error"]["code"] == "idempotency_key_reused"
    assert "new key" in resp.get_json()["error"]["message"]
    assert len(s.leases.active()) == 1


@pytest.mark.parametrize(
    "junk", ["", '""', "a b", 'a"b', "x" * 256, "caf\u00e9", "tab\there", "back\\slash"]
)
def test_a_malformed_key_is_400(junk: str) -> None:
    s = idle()
    try:
        resp = get(s, "n=1&format=json", junk)
    except ValueError:  # werkzeug's test client refuses some headers before sending
        return
    assert resp.status_code == 400, resp.text
    assert resp.get_json()["error"]["code"] == "invalid_idempotency_key"
    assert s.leases.active() == ()


def test_two_keys_in_one_request_are_400_over_http() -> None:
    """A header sent twice reaches the app joined by a comma ("aaa,bbb"): refused, as the
    README says, never taken as one key; a quoted key may hold a comma."""
    with served() as exporter:
        conn = http.client.HTTPConnection("127.0.0.1", exporter.port, timeout=10)
        conn.putrequest("GET", "/choose?n=1&format=json")
        conn.putheader(KEY, "aaa")
        conn.putheader(KEY, "bbb")
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 400
        assert json.loads(resp.read())["error"]["code"] == "invalid_idempotency_key"
        assert exporter.leases() == []
        conn.request("GET", "/choose?n=1", headers={KEY: '"aaa,bbb"'})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read()
        conn.close()


def test_a_key_whose_lease_was_released_is_409_until_its_expiry_then_free() -> None:
    s = idle()
    token = get(s, "n=1&lease=60s", "k").headers["X-GPU-Lease"]
    assert s.client.delete(f"/leases/{token}").status_code == 200
    late = get(s, "n=1&lease=60s&format=json", "k")
    assert late.status_code == 409 and late.get_json()["error"]["code"] == "lease_ended"
    assert s.leases.active() == ()
    s.clock.advance(61)
    s.sample()
    assert get(s, "n=1&lease=60s", "k").status_code == 200
    assert len(s.leases.active()) == 1


def test_keys_survive_a_restart(tmp_path: Path) -> None:
    s = idle(state_dir=str(tmp_path))
    key = "my-own-key-0d6c2a"
    token = get(s, "n=1", key).headers["X-GPU-Lease"]
    saved = (tmp_path / "leases.json").read_text()
    assert key not in saved and token.partition(".")[2] not in saved
    restarted = build_stack(
        sim_of(*(SimGpu(i, DEFAULT_MODEL, Load("idle")) for i in range(4))),
        clock=s.clock,
        state_dir=str(tmp_path),
    )
    restarted.sample()
    assert get(restarted, "n=1", key).headers["X-GPU-Lease"] == token
    assert len(restarted.leases.active()) == 1


def test_a_released_key_stays_refused_after_a_restart(tmp_path: Path) -> None:
    """Issue 28.2: claim with K, release, restart, retry with K gave a new lease."""
    key = "job-7f3a-retry"

    def claim(base: str) -> tuple[int, str, str]:
        req = urllib.request.Request(f"{base}/choose?n=1&lease=10m", headers={KEY: key})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.headers["X-GPU-Lease"], resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, "", exc.read().decode()

    args = ("--simulate", "2", "--state-dir", str(tmp_path))
    with harness.exporter(*args) as ex:
        status, token, _ = claim(ex.base)
        assert status == 200
        req = urllib.request.Request(f"{ex.base}/leases/{token}", method="DELETE")
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
        assert claim(ex.base)[0] == 409
    saved = (tmp_path / "leases.json").read_text()
    assert key not in saved  # hashed
    with harness.exporter(*args) as ex:
        status, _, body = claim(ex.base)
        assert status == 409 and "already ended" in body, body
        assert json.loads(harness.get(ex.base + "/leases")[1])["leases"] == []


def test_advice_and_head_ignore_the_key() -> None:
    s = idle()
    assert get(s, "n=1&lease=0", "k").status_code == 200
    assert s.client.head("/choose?n=1", headers={KEY: "k"}).status_code == 200
    assert s.leases.active() == ()
    assert get(s, "n=1", "k").status_code == 200  # the key was not used up


def test_a_retry_does_not_queue_behind_waiters() -> None:
    s = idle(2)
    token = get(s, "n=1", "k").headers["X-GPU-Lease"]
    assert get(s, "n=1").status_code == 200  # the last GPU
    resp = get(s, "n=1", "k")  # all taken, yet the retry is answered at once
    assert resp.status_code == 200 and resp.headers["X-GPU-Lease"] == token


# -- the state machine -------------------------------------------------------------------


@dataclass
class Held:
    token: str
    gpus: frozenset[str]
    expires_at: float
    query: str


@dataclass
class Model:
    """What the exporter must have done: by (requester, key), the lease a claim made."""

    live: dict[tuple[str, str], Held] = field(default_factory=dict)
    ended: dict[tuple[str, str], float] = field(default_factory=dict)  # released → expiry
    unkeyed: dict[str, Held] = field(default_factory=dict)

    def expire(self, now: float) -> None:
        self.live = {k: h for k, h in self.live.items() if h.expires_at > now}
        self.unkeyed = {t: h for t, h in self.unkeyed.items() if h.expires_at > now}


@pytest.mark.parametrize("seed", range(12))
def test_claims_retries_releases_and_expiry_never_double_grant(seed: int) -> None:
    rnd = random.Random(seed)
    s = idle(4)
    model = Model()
    seen: Counter[str] = Counter()
    requesters, keys = ("10.0.0.1", "10.0.0.2"), ("k1", "k2", "k3", "k4", "k5")
    queries = ("n=1&lease=10s", "n=2&lease=10s", "n=1&lease=30s")
    for _ in range(80):
        now = s.clock.time()
        op = rnd.random()
        if op < 0.55:  # a claim, often a retry of an earlier one
            who, key = rnd.choice(requesters), rnd.choice((*keys, None))
            query = rnd.choice(queries)
            if model.live and rnd.random() < 0.5:  # a client retrying, mostly as it should
                (who, key), held = rnd.choice(list(model.live.items()))
                query = held.query if rnd.random() < 0.8 else query
            resp = get(s, query + "&format=json", key, addr=who)
            slot = (who, key) if key is not None else None
            if slot is not None and slot in model.live:
                held = model.live[slot]
                seen["retry"] += 1
                if query != held.query:
                    assert resp.status_code == 422, resp.text
                else:
                    assert resp.status_code == 200, resp.text
                    assert resp.headers["X-GPU-Lease"] == held.token
                    assert {g["uuid"] for g in resp.get_json()["chosen"]} == held.gpus
            elif slot is not None and model.ended.get(slot, 0.0) > now:
                assert resp.status_code == 409, resp.text
                seen["ended"] += 1
            elif resp.status_code == 200:
                body = resp.get_json()
                held = Held(
                    resp.headers["X-GPU-Lease"],
                    frozenset(g["uuid"] for g in body["chosen"]),
                    body["lease"]["expires_at"],
                    query,
                )
                if slot is not None:
                    model.live[slot] = held
                else:
                    model.unkeyed[held.token] = held
            else:
                assert resp.status_code == 503, resp.text
                seen["full"] += 1
        elif op < 0.75:  # the holder releases
            everything = [*model.live.items(), *((None, h) for h in model.unkeyed.values())]
            if everything:
                slot, held = rnd.choice(everything)
                assert s.client.delete(f"/leases/{held.token}").status_code == 200
                if slot is None:
                    del model.unkeyed[held.token]
                else:
                    del model.live[slot]
                    model.ended[slot] = held.expires_at
        elif op < 0.85:  # a stranger tries the public id
            held_any = [*model.live.values(), *model.unkeyed.values()]
            if held_any:
                lease_id = rnd.choice(held_any).token.partition(".")[0]
                assert s.client.delete(f"/leases/{lease_id}").status_code == 403
        else:  # time passes
            s.clock.advance(rnd.choice((1.0, 4.0, 12.0)))
            s.sample()
        model.expire(s.clock.time())
        # Invariants: one lease per key, no GPU in two leases, the table is the model.
        active = s.leases.active()
        keyed = [x.keyed.key_hash for x in active if x.keyed is not None]
        assert len(keyed) == len(set(keyed))
        uuids = [u for lease in active for u in lease.uuids]
        assert len(uuids) == len(set(uuids))
        expected = [*model.live.values(), *model.unkeyed.values()]
        assert {x.id for x in active} == {h.token.partition(".")[0] for h in expected}
    assert seen["retry"] >= 5, seen  # the sequence did exercise what it is about


# -- the client: a first answer that never arrives ---------------------------------------


class LosingProxy:
    """A TCP proxy in front of the exporter that passes requests on but, for the first
    ``lose`` connections, drops the exporter's answer and closes the client's socket."""

    def __init__(self, port: int, lose: int = 1) -> None:
        self.target = port
        self.lose = lose
        self.connections = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            losing = self.connections <= self.lose
            threading.Thread(target=self._serve, args=(conn, losing), daemon=True).start()

    def _serve(self, client: socket.socket, losing: bool) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=_pump, args=(client, upstream), daemon=True).start()
        with client, upstream:
            while data := upstream.recv(65536):  # the server answers and closes
                if not losing:
                    client.sendall(data)
            client.shutdown(socket.SHUT_RDWR)  # now, though _pump still reads from it

    def close(self) -> None:
        self.listener.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass


@contextmanager
def losing_proxy(port: int, lose: int = 1) -> Iterator[LosingProxy]:
    proxy = LosingProxy(port, lose)
    try:
        yield proxy
    finally:
        proxy.close()


def test_a_claim_whose_answer_is_lost_is_retried_and_holds_one_lease() -> None:
    with served() as exporter, losing_proxy(exporter.port) as proxy:
        gpus = choose(1, proxy.url)
        assert proxy.connections == 2  # the lost try, and the retry
        assert exporter.lease_ids() == {gpus.lease_id}  # one lease, and it is ours
        release(gpus)
        assert exporter.lease_ids() == set()


def test_the_cli_retries_a_lost_answer_too(capsys: pytest.CaptureFixture[str]) -> None:
    with served() as exporter, losing_proxy(exporter.port) as proxy:
        assert client_main(["choose", "--url", proxy.url, "--format", "env"]) == 0
        token = capsys.readouterr().out.split("GPU_LEASE=")[1].strip()
        assert exporter.lease_ids() == {token.partition(".")[0]}


def test_when_every_answer_is_lost_at_most_one_lease_is_left_to_expire() -> None:
    with served() as exporter, losing_proxy(exporter.port, lose=2) as proxy:
        with pytest.raises(ServerUnreachable):
            choose(1, proxy.url)
        assert proxy.connections == 2
        assert len(exporter.lease_ids()) == 1  # the documented window: until its TTL


class ClosedPipe:
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_the_cli_gives_the_lease_back_when_nobody_reads_its_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with served() as exporter:
        monkeypatch.setattr("sys.stdout", ClosedPipe())
        assert client_main(["choose", "--url", exporter.url]) == 1
        assert exporter.lease_ids() == set()
