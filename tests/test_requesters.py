"""Who a request comes from (issue 28.10), through real sockets: a client on this host is its
local user, whatever loopback address it binds (every local user has all of 127.0.0.0/8), so
lease limits, waiter caps and ``/leases`` count and show the user; advice waiters never take
a claim's waiting slot.
"""

from __future__ import annotations

import http.client
import os
import pwd
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpu_exporter.simulate import DEFAULT_MODEL, Load, SimGpu, SimulatedNvml
from gpu_exporter.web.peers import UNKNOWN_LOCAL, PeerIdentities, is_local, requester, table_uid
from served import served

SYSTEM_PYTHON = "/usr/bin/python3"  # one that user nobody may run
ME = f"local:{pwd.getpwuid(os.getuid()).pw_name}"


def idle_gpus(n: int) -> SimulatedNvml:
    return SimulatedNvml(
        [SimGpu(i, DEFAULT_MODEL, Load("idle")) for i in range(n)], clock=time.monotonic
    )


def ask(port: int, path: str, source: str, timeout: float = 10) -> tuple[int, str]:
    """``GET path`` from the loopback address ``source``: status and body."""
    conn = http.client.HTTPConnection(
        "127.0.0.1", port, timeout=timeout, source_address=(source, 0)
    )
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def test_a_local_user_is_one_requester_from_any_loopback_address() -> None:
    with served(idle_gpus(4), max_gpus_per_requester=1) as exporter:
        status, body = ask(exporter.port, "/choose?n=1", "127.0.0.2")
        assert status == 200, body
        for source in ("127.0.0.3", "127.1.2.3", "127.0.0.1"):
            status, body = ask(exporter.port, "/choose?n=1", source)
            assert status == 429 and f"{ME} holds 1 GPU" in body, (source, body)
        assert [lease["requester"] for lease in exporter.leases()] == [ME]
        status, page = ask(exporter.port, "/", "127.0.0.4")
        assert status == 200 and ME in page


def test_a_local_users_waiters_are_counted_together() -> None:
    with served(idle_gpus(1), max_waiters=4, max_waiters_per_requester=1) as exporter:
        assert ask(exporter.port, "/choose?n=1", "127.0.0.2")[0] == 200  # nothing free now
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(ask, exporter.port, "/choose?n=1&lease=0&wait=20s", "127.0.0.3")
            time.sleep(1.0)  # it waits in its slot
            status, body = ask(exporter.port, "/choose?n=1&lease=0&wait=20s", "127.0.0.4")
            assert status == 429 and f"{ME} already has 1 request waiting" in body, body
            assert not waiting.done()
            exporter.daemon.shutdown()  # ends the wait
            assert waiting.result(timeout=10)[0] == 503


def test_advice_waiters_never_take_a_claims_slot() -> None:
    with served(idle_gpus(1), max_waiters=2, max_waiters_per_requester=0) as exporter:
        assert ask(exporter.port, "/choose?n=1", "127.0.0.2")[0] == 200  # nothing free now
        with ThreadPoolExecutor(2) as pool:
            advice = [
                pool.submit(ask, exporter.port, "/choose?n=1&lease=0&wait=60s", source)
                for source in ("127.0.0.3", "127.0.0.4")
            ]
            time.sleep(1.0)  # both slots held by advice
            started = time.monotonic()
            status, body = ask(exporter.port, "/choose?n=1&wait=2s", "127.0.0.5")
            assert status == 503 and "already waiting" not in body, body
            assert "0 of 1 GPU qualifies" in body, body
            assert time.monotonic() - started >= 1.5  # it waited its 2 s in a slot
            # The claim took the oldest advice waiter's slot: that one answered long before
            # its 60 s, with what it had.
            answered = [f for f in advice if f.done()]
            assert len(answered) == 1, "one advice waiter gave its slot up"
            assert answered[0].result()[0] == 503
            exporter.daemon.shutdown()
            assert all(f.result(timeout=10)[0] == 503 for f in advice)


@pytest.mark.skipif(
    os.getuid() != 0 or not os.path.exists(SYSTEM_PYTHON), reason="runs a client as nobody"
)
def test_another_local_user_has_limits_of_its_own() -> None:
    with served(idle_gpus(4), max_gpus_per_requester=1) as exporter:
        assert ask(exporter.port, "/choose?n=1", "127.0.0.2")[0] == 200
        script = (
            "import http.client;"
            f"c=http.client.HTTPConnection('127.0.0.1',{exporter.port},timeout=10,"
            "source_address=('127.0.0.7',0));"
            "c.request('GET','/choose?n=1');print(c.getresponse().status)"
        )
        done = subprocess.run(
            [SYSTEM_PYTHON, "-c", script], user=65534, capture_output=True, text=True, timeout=30
        )
        assert done.stdout.strip() == "200", done.stderr
        nobody = f"local:{pwd.getpwuid(65534).pw_name}"
        assert sorted(lease["requester"] for lease in exporter.leases()) == sorted([ME, nobody])


def test_the_socket_table_names_a_loopback_peers_owner(tmp_path: Path) -> None:
    (tmp_path / "net").mkdir()
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
    rows = [
        # the peer 127.0.0.2:40000 → the server 127.0.0.1:9400, owned by uid 1000
        "   0: 0200007F:9C40 0100007F:24B8 01 00000000:00000000 00:00000000 00000000  1000 0 1",
        # the same pair after it closed (TIME_WAIT): uid 0 is not its owner
        "   1: 0300007F:9C40 0100007F:24B8 06 00000000:00000000 03:00000000 00000000     0 0 0",
    ]
    (tmp_path / "net" / "tcp").write_text(head + "\n".join(rows) + "\n")
    server = ("127.0.0.1", 9400)
    assert table_uid(("127.0.0.2", 40000), server, tmp_path) == 1000
    assert table_uid(("::ffff:127.0.0.2", 40000), ("::ffff:127.0.0.1", 9400), tmp_path) == 1000
    assert table_uid(("127.0.0.3", 40000), server, tmp_path) is None
    peers = PeerIdentities(tmp_path, diag=False)
    assert peers.identify(("127.0.0.3", 40000), server) == UNKNOWN_LOCAL  # never root
    assert peers.identify(("10.0.0.5", 40000), ("10.0.0.1", 9400)) == "10.0.0.5"
    assert peers.identify(("::ffff:10.0.0.5", 1), ("::ffff:10.0.0.1", 9400)) == "10.0.0.5"
    assert is_local("::1", "::1") and is_local("10.0.0.1", "10.0.0.1")
    assert not is_local("10.0.0.5", "10.0.0.1")


def test_the_kernel_names_a_real_peers_owner() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.socket()
        client.bind(("127.0.0.9", 0))
        client.connect(listener.getsockname())
        with client, listener.accept()[0] as conn:
            peer, local = client.getsockname(), conn.getsockname()
            assert PeerIdentities().identify(peer, local) == ME
            assert PeerIdentities(diag=False).identify(peer, local) == ME


def test_a_peer_that_closed_before_its_accept_is_nobody_in_particular() -> None:
    # A socket its owner closed is listed with uid 0: taken at its word, that is root.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.socket()
        client.bind(("127.0.0.9", 0))
        client.connect(listener.getsockname())
        peer = client.getsockname()
        client.close()
        time.sleep(0.1)
        with listener.accept()[0] as conn:
            local = conn.getsockname()
            assert PeerIdentities().identify(peer, local) == UNKNOWN_LOCAL
            assert PeerIdentities(diag=False).identify(peer, local) == UNKNOWN_LOCAL


def test_a_proved_user_is_counted_by_name() -> None:
    environ = {"REMOTE_USER": "alice", "gpu_exporter.peer": ME, "REMOTE_ADDR": "127.0.0.2"}
    assert requester(environ) == "alice"
    assert requester({"gpu_exporter.peer": ME, "REMOTE_ADDR": "127.0.0.2"}) == ME
