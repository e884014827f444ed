"""TLS through the real server on 127.0.0.1, and `gpu-exporter serve` with a web config."""

from __future__ import annotations

import base64
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest
from tls_certs import CA, Issued

from conftest import build_stack
from gpu_exporter.simulate import Scenario, SimulatedNvml
from gpu_exporter.web.webconfig import WebConfigWatcher
from harness import free_port, start, stop

pytestmark = pytest.mark.slow


@dataclass
class Pki:
    ca: CA
    server: Issued
    client: Issued  # issued by ca
    stranger: Issued  # a client certificate from another CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = CA.create(d, "ca"), CA.create(d, "other-ca")
    return Pki(
        ca,
        ca.issue(d, "server", server=True),
        ca.issue(d, "client", server=False),
        other.issue(d, "stranger", server=False),
    )


def serve_in_thread(config: Path) -> Iterator[tuple[str, WebConfigWatcher]]:
    """Four simulated GPUs, sampled once, served on loopback with ``config``."""
    stack = build_stack(
        lambda clock: SimulatedNvml.of(Scenario.with_gpus(4), clock=clock.monotonic),
        web_config_file=str(config),
    )
    stack.sample()
    watcher = stack.daemon.watcher
    assert watcher is not None
    server = stack.daemon.make_server("127.0.0.1", 0)  # TLS from the config
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.port}", watcher
    finally:
        server.stop()
        thread.join(timeout=10)


@pytest.fixture
def tls_server(pki: Pki, tmp_path: Path) -> Iterator[tuple[str, WebConfigWatcher]]:
    config = tmp_path / "web.yml"
    config.write_text(
        f"tls_server_config: {{cert_file: {pki.server.cert}, key_file: {pki.server.key}}}\n"
    )
    yield from serve_in_thread(config)


@pytest.fixture
def mtls_server(pki: Pki, tmp_path: Path) -> Iterator[tuple[str, WebConfigWatcher]]:
    config = tmp_path / "web.yml"
    config.write_text(
        f"""tls_server_config:
  cert_file: {pki.server.cert}
  key_file: {pki.server.key}
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: {pki.ca.path}
"""
    )
    yield from serve_in_thread(config)


def client_context(
    pki: Pki,
    *,
    version: ssl.TLSVersion | None = None,
    cert: Issued | None = None,
) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca.path))
    if version is not None:
        with warnings.catch_warnings():  # TLS 1.0/1.1 are deprecated: that is the point
            warnings.simplefilter("ignore", DeprecationWarning)
            ctx.minimum_version = ctx.maximum_version = version
        if version < ssl.TLSVersion.TLSv1_2:
            ctx.set_ciphers("DEFAULT:@SECLEVEL=0")  # let this client offer it at all
    if cert is not None:
        ctx.load_cert_chain(cert.cert, cert.key)
    return ctx


def handshake(base: str, ctx: ssl.SSLContext) -> str:
    """The negotiated TLS version, after a request that must succeed."""
    port = int(base.rsplit(":", 1)[1])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        version = tls.version()
        tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := tls.recv(4096):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200 OK"), reply[:100]
        assert version is not None
        return version


def test_tls_1_2_and_1_3_are_accepted(tls_server: tuple[str, WebConfigWatcher], pki: Pki) -> None:
    base, _ = tls_server
    assert handshake(base, client_context(pki, version=ssl.TLSVersion.TLSv1_2)) == "TLSv1.2"
    assert handshake(base, client_context(pki, version=ssl.TLSVersion.TLSv1_3)) == "TLSv1.3"
    with urllib.request.urlopen(base + "/metrics", context=client_context(pki)) as resp:
        assert resp.status == 200 and b"gpu_up{" in resp.read()


def test_tls_1_1_is_refused_by_the_server(
    tls_server: tuple[str, WebConfigWatcher], pki: Pki
) -> None:
    base, _ = tls_server
    with pytest.raises(ssl.SSLError) as info:
        handshake(base, client_context(pki, version=ssl.TLSVersion.TLSv1_1))
    # The server's alert, not the client declining to offer TLS 1.1:
    assert "PROTOCOL_VERSION" in str(info.value) or "protocol version" in str(info.value)


def test_an_idle_connection_does_not_stall_the_server(
    tls_server: tuple[str, WebConfigWatcher], pki: Pki
) -> None:
    base, _ = tls_server
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)):  # connects, never says hello
        time.sleep(0.2)
        started = time.monotonic()
        handshake(base, client_context(pki))
        assert time.monotonic() - started < 3.0  # cheroot's own TLS adapter waited 10 s here


def test_plain_http_to_the_tls_port_gets_nothing(tls_server: tuple[str, WebConfigWatcher]) -> None:
    base, _ = tls_server
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(base.replace("https", "http") + "/metrics", timeout=5)


def test_client_certificates_from_the_right_ca_only(
    mtls_server: tuple[str, WebConfigWatcher], pki: Pki
) -> None:
    base, _ = mtls_server
    assert handshake(base, client_context(pki, cert=pki.client)) == "TLSv1.3"
    for cert in (pki.stranger, None):
        # TLS 1.3 sends the refusal after the client's Finished: it surfaces on first read.
        with pytest.raises((ssl.SSLError, ConnectionError)):
            handshake(base, client_context(pki, cert=cert))
        with pytest.raises((ssl.SSLError, ConnectionError)):
            handshake(base, client_context(pki, cert=cert, version=ssl.TLSVersion.TLSv1_2))


def test_a_rotated_certificate_is_served_without_a_restart(
    tls_server: tuple[str, WebConfigWatcher], pki: Pki, tmp_path: Path
) -> None:
    base, watcher = tls_server
    new_ca = CA.create(tmp_path, "new-ca")
    rotated = new_ca.issue(tmp_path, "rotated", server=True)
    pki.server.cert.write_bytes(rotated.cert.read_bytes())  # a cert file renewed in place
    pki.server.key.write_bytes(rotated.key.read_bytes())
    try:
        assert watcher.check() is True
        new_client = ssl.create_default_context(cafile=str(new_ca.path))
        with urllib.request.urlopen(base + "/healthz", context=new_client) as resp:
            assert resp.status == 200
    finally:
        # the module's PKI is shared: put the old pair back
        pki.ca.issue(pki.server.cert.parent, "server", server=True)


# ---------------------------------------------------------------------------- the command


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def fetch(url: str, ctx: ssl.SSLContext, headers: dict[str, str] | None = None) -> int:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, context=ctx, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


def test_serve_with_tls_basic_auth_and_reload(pki: Pki, tmp_path: Path) -> None:
    alice = bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=4)).decode()
    config = tmp_path / "web.yml"
    tls = f"tls_server_config: {{cert_file: {pki.server.cert}, key_file: {pki.server.key}}}\n"
    config.write_text(tls + f"basic_auth_users: {{alice: '{alice}'}}\n")
    port = free_port()
    base = f"https://127.0.0.1:{port}"
    proc = start(
        "serve",
        "--simulate",
        "2",
        "--listen-address",
        f"127.0.0.1:{port}",
        "--web-config-file",
        str(config),
    )
    ctx = client_context(pki)
    try:
        deadline = time.monotonic() + 15
        while True:
            assert proc.poll() is None, "server exited"
            try:
                if fetch(base + "/healthz", ctx) == 200:
                    break
            except OSError:
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.1)
        assert fetch(base + "/metrics", ctx) == 401
        assert fetch(base + "/metrics", ctx, basic("alice", "secret")) == 200
        assert fetch(base + "/metrics", ctx, basic("bob", "builder")) == 401

        bob = bcrypt.hashpw(b"builder", bcrypt.gensalt(rounds=4)).decode()
        config.write_text(tls + f"basic_auth_users: {{bob: '{bob}'}}\n")
        deadline = time.monotonic() + 10  # checked once a second
        while fetch(base + "/metrics", ctx, basic("bob", "builder")) != 200:
            assert time.monotonic() < deadline, "the changed file was not re-read"
            time.sleep(0.2)
        assert fetch(base + "/metrics", ctx, basic("alice", "secret")) == 401

        config.write_text("basic_auth_users: [broken\n")
        time.sleep(2.5)
        assert fetch(base + "/metrics", ctx, basic("bob", "builder")) == 200  # old one stays
        request = urllib.request.Request(base + "/metrics", headers=basic("bob", "builder"))
        with urllib.request.urlopen(request, context=ctx, timeout=5) as resp:
            text = resp.read().decode()
        assert 'gpu_exporter_web_config_reloads_total{result="error"} 1.0' in text
        assert 'gpu_exporter_web_config_reloads_total{result="success"} 1.0' in text
    finally:
        err = stop(proc)
    assert "not reloaded, the previous configuration stays in force" in err
    assert " over https; sampling every " in err
    assert "serving plain HTTP" not in err and "no authentication" not in err
    if os.geteuid() == 0:
        assert "running as root: gpu-exporter needs only read access to /dev/nvidiactl" in err
    assert "Traceback" not in err, err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("basic_auth_users: {alice: x}", "basic_auth_users.alice: not a bcrypt hash"),
        ("tls_server_config: {cert_file: /nope.crt, key_file: /nope.key}", "cannot read /nope"),
        ("colour: red", "colour: unknown key"),
    ],
)
def test_a_bad_web_config_stops_start_up_with_one_line(
    tmp_path: Path, text: str, message: str
) -> None:
    config = tmp_path / "web.yml"
    config.write_text(text)
    proc = start(
        "serve",
        "--simulate",
        "1",
        "--listen-address",
        f"127.0.0.1:{free_port()}",
        "--web-config-file",
        str(config),
    )
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 2
    assert message in err and f"--web-config-file {config}" in err
    assert "Traceback" not in err


def test_hash_password_prints_a_bcrypt_hash() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gpu_exporter", "hash-password", "--cost", "5"],
        input="correct horse\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out.startswith("$2b$05$")
    assert bcrypt.checkpw(b"correct horse", out.encode())
    bad = subprocess.run(
        [sys.executable, "-m", "gpu_exporter", "hash-password"],
        input="",
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and "empty password" in bad.stderr
