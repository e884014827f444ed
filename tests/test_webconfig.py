"""--web-config-file: parsing, basic auth, the auth scope, headers and reloading (in process)."""

from __future__ import annotations

import base64
import json
import logging
import shutil
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from prometheus_client import CollectorRegistry
from tls_certs import CA
from werkzeug.test import Client

from conftest import Stack, build_stack
from gpu_exporter.export.collectors import WebConfigCollector
from gpu_exporter.simulate import Scenario, SimulatedNvml
from gpu_exporter.web.auth import BasicAuth, credentials, is_advice_only, needs_auth
from gpu_exporter.web.webconfig import (
    WebConfigError,
    WebConfigWatcher,
    exposure_warnings,
    load,
    parse,
)
from served import served

COST = 4  # the fastest bcrypt: these tests are about behaviour, not hashing time
ALICE_HASH = bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=COST)).decode()


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


# ---------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tls_config: {}", "tls_config: unknown key; expected one of tls_server_config"),
        ("tls_server_config: {cert_file: a, key_file: b, colour: red}", "colour: unknown key"),
        ("tls_server_config: {key_file: b}", "missing one of cert or cert_file"),
        ("tls_server_config: {cert_file: a}", "missing one of key or key_file"),
        (
            "tls_server_config: {cert_file: a, key_file: b, min_version: TLS9}",
            "min_version: expected one of TLS10, TLS11, TLS12, TLS13, got 'TLS9'",
        ),
        (
            "tls_server_config: {cert_file: a, key_file: b, min_version: TLS13, max_version: TLS12}",
            "min_version is above max_version",
        ),
        (
            "tls_server_config: {cert_file: a, key_file: b, client_auth_type: Maybe}",
            "client_auth_type: expected one of NoClientCert, RequestClientCert",
        ),
        (
            "tls_server_config: {cert_file: a, key_file: b, client_auth_type: RequireAnyClientCert}",
            "RequireAnyClientCert (any certificate, unverified) cannot be served",
        ),
        (
            "tls_server_config: {cert_file: a, key_file: b, client_auth_type: RequireAndVerifyClientCert}",
            "RequireAndVerifyClientCert needs client_ca_file or client_ca",
        ),
        (
            "tls_server_config: {cert_file: a, key_file: b, client_ca_file: ca.pem}",
            "client CAs are configured without a client_auth_type",
        ),
        (
            "tls_server_config: {cert_file: a, key_file: b, cipher_suites: [TLS_FAST]}",
            "unknown cipher suite 'TLS_FAST'",
        ),
        (
            "tls_server_config: {cert_file: a, key_file: b, client_allowed_sans: [x]}",
            "client_allowed_sans: not supported",
        ),
        ("rate_limit: {burst: 1}", "rate_limit: not supported"),
        ("basic_auth_users: {alice: hunter2}", "basic_auth_users.alice: not a bcrypt hash"),
        ("basic_auth_users: {1234: x}", "user name 1234 must be a non-empty string"),
        ("basic_auth_users: [alice]", "expected a mapping of user names to bcrypt hashes"),
        (
            f"basic_auth_users:\n  alice: '{ALICE_HASH}'\n  alice: '{ALICE_HASH}'\n",
            "line 3: duplicate key 'alice'",
        ),
        (
            "http_server_config: {headers: {X-Powered-By: me}}",
            "header 'X-Powered-By' can not be configured",
        ),
        (
            "http_server_config: {headers: {X-Frame-Options: allow}}",
            "X-Frame-Options: expected one of deny, sameorigin, got 'allow'",
        ),
        ("http_server_config: {http2: maybe}", "http2: expected true or false"),
        ("auth_excluded_paths: [metrics]", "'metrics' must start with /"),
        ("tls_server_config: [", "not valid YAML: line 1, column 21"),
        ("- a list", "expected a mapping, got list"),
    ],
)
def test_bad_configs_are_one_line_naming_the_key(text: str, message: str) -> None:
    with pytest.raises(WebConfigError) as info:
        parse(text, Path("/etc/gpu-exporter"))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_good_config_resolves_paths_and_maps_cipher_names() -> None:
    config = parse(
        f"""
tls_server_config:
  cert_file: tls/server.crt
  key_file: /abs/server.key
  cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, TLS_AES_128_GCM_SHA256]
http_server_config:
  http2: false
  headers:
    X-Frame-Options: deny
    Content-Security-Policy: ""
basic_auth_users:
  alice: {ALICE_HASH}
auth_excluded_paths: [/readyz]
""",
        Path("/etc/gpu-exporter"),
    )
    assert config.tls is not None
    assert config.tls.cert_file == Path("/etc/gpu-exporter/tls/server.crt")
    assert config.tls.key_file == Path("/abs/server.key")
    assert config.tls.cipher_suites == ("ECDHE-RSA-AES128-GCM-SHA256",)  # 1.3 suites: fixed
    assert config.headers == (("X-Frame-Options", "deny"),)  # blank means unset
    assert set(config.users) == {"alice"}
    assert config.auth_excluded_paths == ("/readyz",)
    assert config.warnings == ()
    assert parse("", Path("/")).tls is None  # an empty file is a valid (empty) config


def test_what_python_cannot_honour_is_warned_about() -> None:
    config = parse(
        """
tls_server_config:
  cert_file: a
  key_file: b
  client_auth_type: RequestClientCert
  curve_preferences: [X25519]
""",
        Path("/"),
    )
    assert config.tls is not None and config.tls.client_auth_type == "NoClientCert"
    assert any("RequestClientCert is served as NoClientCert" in w for w in config.warnings)
    assert any("curve_preferences is ignored" in w for w in config.warnings)


def test_loading_reads_the_files(tmp_path: Path) -> None:
    ca = CA.create(tmp_path, "ca")
    server = ca.issue(tmp_path, "server", server=True)
    (tmp_path / "web.yml").write_text(
        f"tls_server_config: {{cert_file: {server.cert.name}, key_file: missing.key}}"
    )
    with pytest.raises(WebConfigError, match=r"cannot read .*missing\.key: No such file"):
        load(tmp_path / "web.yml")
    (tmp_path / "web.yml").write_text(
        f"tls_server_config: {{cert_file: {server.cert.name}, key_file: {server.cert.name}}}"
    )
    with pytest.raises(WebConfigError, match="cannot load the certificate and key"):
        load(tmp_path / "web.yml")
    (tmp_path / "web.yml").write_text(
        f"""tls_server_config:
  cert: |
{_indent(server.cert.read_text())}
  key: |
{_indent(server.key.read_text())}
  client_auth_type: VerifyClientCertIfGiven
  client_ca: |
{_indent(ca.path.read_text())}
  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384]
"""
    )
    active = load(tmp_path / "web.yml")  # inline PEM works too
    assert active.context is not None
    names = {c["name"] for c in active.context.get_ciphers() if c["protocol"] == "TLSv1.2"}
    assert names == {"ECDHE-ECDSA-AES256-GCM-SHA384"}
    with pytest.raises(WebConfigError, match=r"cannot read .*nope\.yml"):
        load(tmp_path / "nope.yml")


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


# ---------------------------------------------------------------------------- basic auth


def test_basic_auth_accepts_the_right_password_only() -> None:
    auth = BasicAuth({"alice": ALICE_HASH.encode()})
    assert auth.verify("alice", b"secret")
    assert not auth.verify("alice", b"Secret")
    assert not auth.verify("bob", b"secret")
    assert not auth.verify("alice", b"secret" + b"x" * 100)  # > 72 bytes: never accepted
    assert credentials("Basic " + base64.b64encode(b"alice:secret").decode()) == (
        "alice",
        b"secret",
    )
    for header in (None, "", "Bearer abc", "Basic !!!", "Basic " + base64.b64encode(b"x").decode()):
        assert credentials(header) is None


def test_successes_are_cached_and_the_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bytes] = []
    real = bcrypt.checkpw

    def counting(password: bytes, hashed: bytes) -> bool:
        calls.append(hashed)
        return real(password, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", counting)
    users = {u: bcrypt.hashpw(u.encode(), bcrypt.gensalt(rounds=COST)) for u in "abc"}
    auth = BasicAuth(users, cache_size=2)
    assert auth.verify("a", b"a") and auth.verify("a", b"a")
    assert len(calls) == 1  # the second check came from the cache
    assert not auth.verify("a", b"wrong") and not auth.verify("a", b"wrong")
    assert len(calls) == 3  # failures are never cached
    auth.verify("b", b"b")
    auth.verify("c", b"c")  # evicts "a", the least recently used
    calls.clear()
    assert auth.verify("a", b"a")
    assert len(calls) == 1
    # A new config makes a new BasicAuth: a changed password is never served from a cache.
    assert not BasicAuth({"a": users["b"]}).verify("a", b"a")


def test_unknown_users_are_checked_against_a_hash_of_the_same_cost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[bytes] = []
    real = bcrypt.checkpw
    monkeypatch.setattr(bcrypt, "checkpw", lambda p, h: seen.append(h) or real(p, h))
    cost6 = bcrypt.hashpw(b"x", bcrypt.gensalt(rounds=6))
    auth = BasicAuth({"a": cost6, "b": cost6, "c": ALICE_HASH.encode()})
    assert not auth.verify("mallory", b"x")
    assert len(seen) == 1 and seen[0].startswith(b"$2b$06$")  # the most common cost


def test_unknown_and_known_users_take_similar_time() -> None:
    """No user enumeration by timing: a wrong password costs one bcrypt either way."""
    auth = BasicAuth({"alice": bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=8))})
    known: list[float] = []
    unknown: list[float] = []
    for _ in range(15):  # interleaved, so load from other processes hits both alike
        for user, times in (("alice", known), ("nobody", unknown)):
            started = time.perf_counter()
            assert not auth.verify(user, b"wrong")
            times.append(time.perf_counter() - started)
    ratio = statistics.median(unknown) / statistics.median(known)
    # Skipping bcrypt for unknown users would make this ratio ~0.001.
    assert 0.5 < ratio < 2.0, (statistics.median(known), statistics.median(unknown))


# ---------------------------------------------------------------------------- scope


@pytest.mark.parametrize(
    ("method", "path", "query", "all_", "writes"),
    [
        ("GET", "/metrics", "", True, False),
        ("GET", "/healthz", "", False, False),
        ("GET", "/readyz", "", False, False),
        ("GET", "/gpus", "", True, False),
        ("GET", "/", "", True, False),
        ("HEAD", "/metrics", "", True, False),
        ("GET", "/choose", "n=1", True, True),
        ("GET", "/choose", "n=1&lease=10m", True, True),
        ("GET", "/choose", "n=1&lease=0", True, False),
        ("GET", "/choose", "lease=0s&format=json", True, False),
        ("GET", "/choose", "lease=zero", True, True),
        ("POST", "/choose", "lease=0", True, False),  # bodiless, as the Python client sends
        ("POST", "/choose", "n=1", True, True),
        ("GET", "/leases", "", True, True),
        ("DELETE", "/leases/abc", "", True, True),
        ("POST", "/leases/abc/renew", "ttl=1m", True, True),
        ("GET", "/leases/../choose", "", True, True),
        ("GET", "/no-such-page", "", True, True),
        ("GET", "/cluster/choose", "n=1", True, True),
    ],
)
def test_which_requests_need_credentials(
    method: str, path: str, query: str, all_: bool, writes: bool
) -> None:
    assert needs_auth("all", method, path, query) is all_
    assert needs_auth("writes", method, path, query) is writes


def test_a_post_with_a_body_is_a_write() -> None:
    assert needs_auth("writes", "POST", "/choose", "lease=0", has_body=True)
    assert not needs_auth("writes", "POST", "/choose", "lease=0", has_body=False)


def test_excluded_paths_and_advice_only() -> None:
    assert not needs_auth("all", "GET", "/gpus", "", ("/gpus",))
    assert is_advice_only("lease=0") and is_advice_only("n=2&lease=0m")
    assert not is_advice_only("n=2") and not is_advice_only("lease=1s")
    assert not is_advice_only("lease=0&lease=1m")


# ---------------------------------------------------------------------------- middleware


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def secured_stack(config: Path, scope: str = "all") -> Stack:
    """Four simulated GPUs, sampled once, served with ``config`` as --web-config-file."""
    stack = build_stack(
        lambda clock: SimulatedNvml.of(Scenario.with_gpus(4), clock=clock.monotonic),
        web_config_file=str(config),
        auth_scope=scope,
    )
    stack.sample()
    return stack


@pytest.fixture
def secured(tmp_path: Path) -> Callable[..., tuple[Client, WebConfigWatcher]]:
    def make(scope: str = "all", extra: str = "") -> tuple[Client, WebConfigWatcher]:
        config = write_config(
            tmp_path / "web.yml",
            f"basic_auth_users:\n  alice: '{ALICE_HASH}'\n"
            "http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n" + extra,
        )
        stack = secured_stack(config, scope)
        assert stack.daemon.watcher is not None
        return Client(stack.app), stack.daemon.watcher

    return make


def test_missing_or_wrong_credentials_get_401(secured: Callable[..., Any]) -> None:
    client, _ = secured()
    for headers in ({}, basic("alice", "nope"), basic("mallory", "secret")):
        resp = client.get("/metrics", headers=headers)
        assert resp.status_code == 401
        assert resp.headers["WWW-Authenticate"].startswith('Basic realm="gpu-exporter"')
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        assert resp.text.startswith("error: ") and resp.text.count("\n") == 1
    assert "authentication required" in client.get("/metrics").text
    assert "wrong user name or password" in client.get("/metrics", headers=basic("x", "y")).text
    body = json.loads(client.get("/gpus").text)  # JSON where the endpoint speaks JSON
    assert body == {
        "error": {
            "code": "unauthorized",
            "message": "authentication required (HTTP basic auth)",
            "param": None,
        }
    }
    assert client.head("/metrics").status_code == 401


def test_good_credentials_pass_and_headers_are_added(secured: Callable[..., Any]) -> None:
    client, _ = secured()
    resp = client.get("/metrics", headers=basic("alice", "secret"))
    assert resp.status_code == 200 and "gpu_up{" in resp.text
    assert resp.headers["X-Content-Type-Options"] == "nosniff"
    assert client.get("/choose?n=1", headers=basic("alice", "secret")).status_code == 200
    assert client.get("/healthz").status_code == 200  # the probes never need credentials
    assert client.get("/readyz").status_code == 200
    assert client.get("/nope", headers=basic("alice", "secret")).status_code == 404


def test_write_scope_protects_leases_only(secured: Callable[..., Any]) -> None:
    client, _ = secured("writes")
    assert client.get("/metrics").status_code == 200
    assert client.get("/gpus").status_code == 200
    assert client.get("/readyz").status_code == 200
    assert client.get("/choose?n=1&lease=0").status_code == 200  # advice only
    assert client.get("/choose?n=1").status_code == 401  # takes a 60 s lease
    assert client.post("/choose?n=1&lease=0").status_code == 200  # bodiless: advice only
    assert client.post("/choose?n=1&lease=0", data={"owner": "x"}).status_code == 401
    assert client.get("/leases").status_code == 401
    assert client.delete("/leases/abc").status_code == 401
    resp = client.get("/choose?n=1", headers=basic("alice", "secret"))
    assert resp.status_code == 200 and resp.headers["X-GPU-Lease"]
    lease = resp.headers["X-GPU-Lease"]
    assert client.get("/leases", headers=basic("alice", "secret")).status_code == 200
    assert client.delete(f"/leases/{lease}", headers=basic("alice", "secret")).status_code == 200


def test_excluded_paths_are_open(secured: Callable[..., Any]) -> None:
    client, _ = secured(extra="auth_excluded_paths: [/gpus]\n")
    assert client.get("/gpus").status_code == 200
    assert client.get("/metrics").status_code == 401


def test_a_changed_file_is_reloaded_and_a_broken_one_keeps_the_old(
    secured: Callable[..., Any], tmp_path: Path
) -> None:
    client, watcher = secured()
    registry = CollectorRegistry()
    registry.register(WebConfigCollector(watcher))
    assert watcher.check() is None  # nothing changed
    bob = bcrypt.hashpw(b"builder", bcrypt.gensalt(rounds=COST)).decode()
    write_config(tmp_path / "web.yml", f"basic_auth_users:\n  bob: '{bob}'\n")
    assert watcher.check() is True
    assert client.get("/metrics", headers=basic("bob", "builder")).status_code == 200
    assert client.get("/metrics", headers=basic("alice", "secret")).status_code == 401
    assert "X-Content-Type-Options" not in client.get("/healthz").headers

    write_config(tmp_path / "web.yml", "basic_auth_users: {bob: plaintext}\n")
    assert watcher.check() is False
    assert client.get("/metrics", headers=basic("bob", "builder")).status_code == 200
    value = registry.get_sample_value
    assert value("gpu_exporter_web_config_reloads_total", {"result": "success"}) == 1
    assert value("gpu_exporter_web_config_reloads_total", {"result": "error"}) == 1
    assert value("gpu_exporter_web_config_last_reload_successful") == 0

    write_config(tmp_path / "web.yml", f"basic_auth_users:\n  bob: '{bob}'\n  carol: '{bob}'\n")
    assert watcher.check() is True
    assert value("gpu_exporter_web_config_last_reload_successful") == 1


def fetch(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize(
    "text",
    [
        "",  # emptied: `: > web.yml`
        None,  # removed
        "basic_auth_users: {alice: [\n",  # half written
        "http_server_config:\n  headers:\n    X-Frame-Options: deny\n",  # every user gone
        f"basic_auth_users:\n  alice: '{ALICE_HASH}'\nauth_excluded_paths: [/choose]\n",
    ],
    ids=["emptied", "removed", "unparsable", "no users", "a path opened"],
)
def test_a_reload_never_lowers_protection(
    tmp_path: Path, text: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    config = write_config(tmp_path / "web.yml", f"basic_auth_users:\n  alice: '{ALICE_HASH}'\n")
    with served(web_config_file=str(config)) as exporter:
        watcher = exporter.daemon.watcher
        assert watcher is not None
        if text is None:
            config.unlink()
        else:
            write_config(config, text)
        with caplog.at_level(logging.ERROR):
            watcher.check()  # or the watcher's own thread did
        assert fetch(exporter.url + "/choose?n=1")[0] == 401  # still no lease without a password
        assert fetch(exporter.url + "/choose?n=1", basic("alice", "secret"))[0] == 200
        metrics = fetch(exporter.url + "/metrics", basic("alice", "secret"))[1]
        assert 'gpu_exporter_web_config_reloads_total{result="error"} 1.0' in metrics
        assert "gpu_exporter_web_config_last_reload_successful 0.0" in metrics
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any("not reloaded, the previous configuration stays" in m for m in errors)


def test_only_weaker_configs_are_refused(tmp_path: Path) -> None:
    ca = CA.create(tmp_path, "ca")
    server = ca.issue(tmp_path, "server", server=True)
    tls = f"tls_server_config: {{cert_file: {server.cert}, key_file: {server.key}"
    users = f"basic_auth_users: {{alice: '{ALICE_HASH}'}}\n"
    config = write_config(tmp_path / "web.yml", tls + ", min_version: TLS13}\n" + users)
    watcher = WebConfigWatcher(config)
    for weaker_text in (users, tls + "}\n" + users, tls + ", min_version: TLS13}\n"):
        write_config(config, weaker_text)  # TLS off; TLS 1.2 allowed; no users
        assert watcher.check() is False, weaker_text
        assert watcher.active.config.users and watcher.active.config.tls is not None
    bob = f"basic_auth_users: {{alice: '{ALICE_HASH}', bob: '{ALICE_HASH}'}}\n"
    write_config(config, tls + ", min_version: TLS13}\n" + bob)  # another user: reloaded
    assert watcher.check() is True and set(watcher.active.config.users) == {"alice", "bob"}
    assert watcher.reloads == {"error": 3, "success": 1}


def test_unauthenticated_views_name_no_holder_and_no_file(tmp_path: Path) -> None:
    """``--auth-scope writes`` leaves ``/``, advice and ``/readyz`` open: to a client that
    proved no user they show counts and GPU states, never who holds or awaits which GPU
    (owner, requester address) or where the state file is."""
    config = write_config(tmp_path / "web.yml", f"basic_auth_users:\n  alice: '{ALICE_HASH}'\n")
    state_dir = tmp_path / "state"
    alice = basic("alice", "secret")
    with served(web_config_file=str(config), auth_scope="writes", state_dir=str(state_dir)) as ex:
        anything = "max_util=1&max_mem_util=1&format=json"  # any GPU qualifies
        held = fetch(f"{ex.url}/choose?n=3&{anything}&owner=alice-secret-project", alice)
        assert held[0] == 200
        token = json.loads(held[1])["lease"]["token"]
        waiter = threading.Thread(
            target=fetch, args=(f"{ex.url}/choose?n=2&wait=3s&owner=bob-waits", alice)
        )
        waiter.start()
        deadline = time.monotonic() + 10
        while ex.daemon.services.waiters.active == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        secrets = ("alice-secret-project", "bob-waits", "127.0.0.1", str(tmp_path))
        advice = f"/choose?n=1&lease=0&{anything}"

        page = fetch(ex.url + "/")[1]
        assert not [x for x in secrets if x in page]
        assert "1 active lease; who holds them is shown to authenticated users" in page
        assert "leased, " in page and '<li class="waiter">2 GPUs' in page  # states, counts
        status, body = fetch(ex.url + advice)
        answer = json.loads(body)
        assert status == 200 and not [x for x in secrets if x in body]
        assert [r["reasons"][0][:12] for r in answer["rejected"]] == ["leased until"] * 3
        assert answer["waiting"][0]["requester"] is None and answer["waiting"][0]["n"] == 2
        status, body = fetch(ex.url + "/choose?n=4&lease=0")  # why not: the same reasons
        assert status == 503 and "leased until" in body and not [x for x in secrets if x in body]

        # Whoever proves a user sees them on the same open views; a wrong password is 401.
        assert "alice-secret-project" in fetch(ex.url + "/", alice)[1]
        assert "bob-waits" in fetch(ex.url + "/", alice)[1]
        assert "by alice-secret-project" in fetch(ex.url + advice, alice)[1]
        assert fetch(ex.url + "/", basic("alice", "wrong"))[0] == 401
        waiter.join()

        # A lease that cannot be saved: /readyz says so, naming no file (it is a probe:
        # it never asks for credentials, so it shows nobody the path).
        shutil.rmtree(state_dir)
        state_dir.write_text("not a directory\n")
        assert fetch(f"{ex.url}/leases/{token}/renew", alice, "POST")[0] == 503
        for headers in ({}, alice):
            status, body = fetch(ex.url + "/readyz", headers)
            assert (status, body) == (
                503,
                "not ready: leases cannot be saved (the log says where and why)\n",
            )


def test_turning_tls_on_needs_a_restart(tmp_path: Path) -> None:
    ca = CA.create(tmp_path, "ca")
    server = ca.issue(tmp_path, "server", server=True)
    config = write_config(tmp_path / "web.yml", "")
    watcher = WebConfigWatcher(config)
    write_config(config, f"tls_server_config: {{cert_file: {server.cert}, key_file: {server.key}}}")
    assert watcher.check() is False
    assert watcher.active.context is None


# ---------------------------------------------------------------------------- warnings


def test_start_up_warnings() -> None:
    tls_and_users = parse(
        f"tls_server_config: {{cert_file: a, key_file: b}}\n"
        f"basic_auth_users: {{alice: '{ALICE_HASH}'}}",
        Path("/"),
    )
    assert exposure_warnings("127.0.0.1", None, 1000) == []
    assert exposure_warnings("::1", None, 1000) == []
    assert exposure_warnings("localhost", None, 1000) == []
    open_ = exposure_warnings("", None, 1000)
    assert len(open_) == 2
    assert "plain HTTP on every interface" in open_[0]
    assert "anyone who can reach this port can take and release GPU leases" in open_[1]
    assert exposure_warnings("10.0.0.5", tls_and_users, 1000) == []
    users_only = parse(f"basic_auth_users: {{alice: '{ALICE_HASH}'}}", Path("/"))
    assert [w[:18] for w in exposure_warnings("0.0.0.0", users_only, 1000)] == [
        "serving plain HTTP"
    ]
    root = exposure_warnings("127.0.0.1", None, 0)
    assert len(root) == 1 and "running as root" in root[0] and "/dev/nvidiactl" in root[0]


def test_the_readme_example_is_a_valid_config() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = readme.index("# /etc/gpu-exporter/web.yml")
    example = readme[start : readme.index("```", start)]
    config = parse(example, Path("/etc/gpu-exporter"))
    assert config.tls is not None and config.tls.cert_file == Path("/etc/gpu-exporter/gpuhost.crt")
    assert set(config.users) == {"prometheus", "jobs"}
    assert dict(config.headers)["X-Content-Type-Options"] == "nosniff"


def test_unknown_and_known_users_take_similar_time_over_http(tmp_path: Path) -> None:
    hashed = bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=8)).decode()
    config = write_config(tmp_path / "web.yml", f"basic_auth_users: {{alice: '{hashed}'}}\n")
    client = Client(secured_stack(config).app)
    known: list[float] = []
    unknown: list[float] = []
    for i in range(10):
        for user, times in (("alice", known), ("nobody", unknown)):
            # A client address of its own each time: five failures from one are throttled.
            address = {"REMOTE_ADDR": f"10.0.{len(times)}.{i}"}
            started = time.perf_counter()
            resp = client.get("/metrics", headers=basic(user, "wrong"), environ_overrides=address)
            assert resp.status_code == 401
            times.append(time.perf_counter() - started)
    ratio = statistics.median(unknown) / statistics.median(known)
    assert 0.5 < ratio < 2.0, (statistics.median(known), statistics.median(unknown))


def test_credentials_are_checked_outside_the_request_limits(secured: Callable[..., Any]) -> None:
    client, _ = secured()
    # Credentials first, so that wrong passwords never hold a request slot (see
    # test_auth_throttle.py); then the limits, and the configured headers on their answers.
    assert client.get("/metrics?" + "x" * 5000).status_code == 401
    resp = client.get("/metrics?" + "x" * 5000, headers=basic("alice", "secret"))
    assert resp.status_code == 414
    assert resp.headers["X-Content-Type-Options"] == "nosniff"


def test_the_python_client_sends_credentials_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpu_exporter import client

    config = write_config(tmp_path / "web.yml", f"basic_auth_users: {{alice: '{ALICE_HASH}'}}\n")
    server = secured_stack(config, "writes").daemon.make_server("127.0.0.1", 0)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        monkeypatch.delenv("GPU_EXPORTER_USER", raising=False)
        with pytest.raises(client.ServerError) as info:
            client.choose(1, base)
        assert info.value.status == 401 and info.value.code == "unauthorized"
        assert client.choose(1, base, lease=0).uuids  # advice only: open in this scope
        monkeypatch.setenv("GPU_EXPORTER_USER", "alice")
        monkeypatch.setenv("GPU_EXPORTER_PASSWORD", "secret")
        choice = client.choose(1, base)
        assert choice.lease_id
        client.release(choice, base)
    finally:
        server.stop()
        thread.join(timeout=10)
