"""Issue 13.5: only the claimant (or a --lease-admin) ends a lease; a HEAD never claims.

Through a real socket (tests/served.py) as a careless or hostile client would: the id shown on
the status page and in /leases no longer releases or renews a lease, only the token given to
the claimant does.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import bcrypt
import pytest

import fleets
from gpu_exporter import client
from gpu_exporter.choose.lease import Lease
from gpu_exporter.choose.tokens import token_matches
from gpu_exporter.client.choosing import http_claimer
from gpu_exporter.fleet.reading import PrometheusReader
from gpu_exporter.web.auth import needs_auth
from gpu_exporter.web.cluster import ClusterService
from served import Served, served

Answer = tuple[int, dict[str, str], bytes]


def call(exporter: Served, method: str, path: str, headers: dict[str, str] | None = None) -> Answer:
    conn = http.client.HTTPConnection("127.0.0.1", exporter.port, timeout=10)
    try:
        conn.request(method, path, headers={"Accept": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def claim(exporter: Served, query: str = "n=1", **headers: str) -> dict[str, Any]:
    status, got, body = call(exporter, "GET", f"/choose?{query}&format=json", headers)
    assert status == 200, body
    lease: dict[str, Any] = json.loads(body)["lease"]
    assert got["x-gpu-lease"] == lease["token"]
    return lease


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def test_the_public_id_never_releases_only_the_token_does() -> None:
    """The id renews only from the address that claimed the lease (test_renew_by_id.py)."""
    with served() as exporter:
        lease = claim(exporter)
        lease_id, token = lease["id"], lease["token"]
        assert token.startswith(lease_id + ".") and len(token) > len(lease_id) + 20
        status, _, body = call(exporter, "DELETE", f"/leases/{lease_id}")
        error = json.loads(body)["error"]
        assert (status, error["code"]) == (403, "forbidden")
        assert "token" in error["message"] and token not in error["message"]
        for method, path in (("DELETE", ""), ("POST", "/renew")):
            status, _, body = call(exporter, method, f"/leases/{lease_id}.{'x' * 24}{path}")
            assert (status, json.loads(body)["error"]["code"]) == (403, "forbidden")
        assert exporter.lease_ids() == {lease_id}
        status, _, body = call(exporter, "POST", f"/leases/{token}/renew?ttl=5m")
        assert status == 200 and json.loads(body)["id"] == lease_id
        assert "token" not in json.loads(body)
        status, _, body = call(exporter, "DELETE", f"/leases/{token}")
        assert status == 200 and json.loads(body)["released"] == lease_id
        assert exporter.lease_ids() == set()
        # Unknown ids stay 404, with or without a token.
        assert call(exporter, "DELETE", f"/leases/{token}")[0] == 404
        assert call(exporter, "DELETE", f"/leases/{lease_id}")[0] == 404


def test_the_token_is_shown_nowhere_but_the_claims_answer() -> None:
    with served(interval_seconds=0.05) as exporter:
        secret = claim(exporter)["token"].partition(".")[2]
        env = call(exporter, "GET", "/choose?format=env")[2].decode()
        secret_env = env.split("GPU_LEASE=")[1].strip().partition(".")[2]
        for path in ("/leases", "/", "/metrics", "/gpus", "/choose?lease=0&format=json"):
            status, _, body = call(exporter, "GET", path, {"Accept": "*/*"})
            assert status == 200, path
            assert secret.encode() not in body and secret_env.encode() not in body, path


def test_no_path_form_puts_a_token_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """``POST //leases/$TOKEN/renew`` (what a base URL ending in ``/`` makes) is served as
    ``/leases/…``; its debug log line, and every other form's, keeps only the lease's id."""
    with served() as exporter:
        token = claim(exporter)["token"]
        lease_id, _, secret = token.partition(".")
        forms = (
            f"//leases/{token}/renew",
            f"///leases/{token}/renew",
            f"/leases//{token}/renew",
            f"/leases/{token}//renew",
            f"/./leases/./{token}/renew",
            f"/LEASES/{token}/renew",
        )
        with caplog.at_level(logging.DEBUG, logger="gpu_exporter.requests"):
            assert call(exporter, "POST", forms[0])[0] == 200
            for path in forms[1:]:
                call(exporter, "POST", path)
        logged = [r for r in caplog.records if r.name == "gpu_exporter.requests"]
        assert len(logged) == len(forms)
        fields = [record.__dict__["fields"] for record in logged]
        assert fields[0]["path"] == f"//leases/{lease_id}.…/renew"
        assert not [x for x in fields if secret in repr(x)]

        def broken(*_: object) -> None:
            raise RuntimeError("a bug")

        exporter.daemon.services.leases.renew = broken  # type: ignore[method-assign]
        caplog.clear()
        assert call(exporter, "POST", forms[0])[0] == 500  # the error log names no secret either
        assert f"{lease_id}.…/renew" in caplog.text and secret not in caplog.text


def test_head_choose_never_claims() -> None:
    with served() as exporter:
        for query in ("n=1", "n=2&lease=5m", "n=1&format=env"):
            status, headers, body = call(exporter, "HEAD", f"/choose?{query}")
            assert status == 200 and body == b""
            assert "x-gpu-lease" not in headers
        assert exporter.leases() == []
        # GET still claims: the same query really would have taken a GPU.
        assert claim(exporter, "n=1")["id"] in exporter.lease_ids()


def test_a_head_never_claims_on_any_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flask answers HEAD wherever it answers GET; no such route claims a GPU, the fleet's
    ``/cluster/choose`` (which claims on the chosen host) included."""
    with served() as exporter:
        instance = f"127.0.0.1:{exporter.port}"  # a fleet of one: this exporter
        monkeypatch.setattr(fleets, "NOW", time.time())
        uuids = [g.uuid for g in exporter.daemon.cache.get().gpus]
        cards = [s for i, u in enumerate(uuids) for s in fleets.gpu(instance, i, uuid=u)]
        store = fleets.fake_fetch({"prometheus": fleets.host_results({instance: cards})})
        exporter.daemon.services.cluster = ClusterService(
            PrometheusReader("http://prom:9090", fetch=store), http_claimer, client.release
        )
        routes = [r.rule for r in exporter.daemon.app.url_map.iter_rules() if "HEAD" in r.methods]
        assert {"/choose", "/cluster/choose"} <= set(routes)
        for route in routes:
            path = re.sub(r"<[^>]+>", "x", route)
            for query in ("n=1", "n=1&lease=5m&format=env"):
                status, headers, body = call(exporter, "HEAD", f"{path}?{query}")
                assert body == b"" and "x-gpu-lease" not in headers, route
                if route.endswith("/choose"):
                    assert status == 200, route  # answered as advice, not refused
        assert exporter.leases() == []
        # The same request as a GET does claim, through the fleet.
        status, headers, _ = call(exporter, "GET", "/cluster/choose?n=1")
        assert status == 200 and headers["x-gpu-lease"]
        assert len(exporter.leases()) == 1


def test_lease_admins_may_release_any_lease_by_id(tmp_path: Path) -> None:
    hashed = {
        user: bcrypt.hashpw(b"pw-" + user.encode(), bcrypt.gensalt(rounds=4)).decode()
        for user in ("alice", "bob")
    }
    config = tmp_path / "web.yml"
    config.write_text("basic_auth_users:\n" + "".join(f"  {u}: '{h}'\n" for u, h in hashed.items()))
    with served(web_config_file=str(config), lease_admins=("alice",)) as exporter:
        bob = basic("bob", "pw-bob")
        alice = basic("alice", "pw-alice")
        first, second = claim(exporter, **bob), claim(exporter, **alice)
        # bob is no admin: his credentials do not make another's id a token ...
        status, _, _ = call(exporter, "DELETE", f"/leases/{second['id']}", bob)
        assert status == 403
        # ... and a REMOTE_USER or Remote-User header from the client proves nothing.
        spoof = {**bob, "Remote-User": "alice", "X-Remote-User": "alice"}
        assert call(exporter, "DELETE", f"/leases/{second['id']}", spoof)[0] == 403
        # alice is: she renews and releases anyone's lease by its id.
        assert call(exporter, "POST", f"/leases/{first['id']}/renew", alice)[0] == 200
        assert call(exporter, "DELETE", f"/leases/{first['id']}", alice)[0] == 200
        held = json.loads(call(exporter, "GET", "/leases", bob)[2])["leases"]
        assert [x["id"] for x in held] == [second["id"]]


def test_without_basic_auth_there_are_no_admins() -> None:
    with served(lease_admins=("alice",)) as exporter:
        lease = claim(exporter)
        headers = {"Remote-User": "alice", **basic("alice", "anything")}
        assert call(exporter, "DELETE", f"/leases/{lease['id']}", headers)[0] == 403
        assert exporter.lease_ids() == {lease["id"]}


def test_only_a_hash_of_the_secret_is_saved_and_it_survives_a_restart(tmp_path: Path) -> None:
    with served(state_dir=str(tmp_path)) as exporter:
        lease = claim(exporter)
    saved = (tmp_path / "leases.json").read_text()
    assert lease["token"].partition(".")[2] not in saved
    with served(state_dir=str(tmp_path)) as exporter:
        assert exporter.lease_ids() == {lease["id"]}
        assert call(exporter, "DELETE", f"/leases/{lease['id']}")[0] == 403
        assert call(exporter, "DELETE", f"/leases/{lease['token']}")[0] == 200


def test_leases_saved_before_tokens_load_and_their_id_is_their_token(tmp_path: Path) -> None:
    with served() as probe:
        uuid = probe.sim.gpus[1].uuid
        now = probe.daemon.clock.time()
    old = {  # leases.json as the exporter wrote it before tokens
        "version": 1,
        "leases": [
            {
                "id": "oldLease1234",
                "gpus": [uuid],
                "indices": [1],
                "created_at": now,
                "expires_at": now + 600,
                "requester": "127.0.0.1",
                "owner": "old-job",
                "held": [[uuid, 1, 0, 0]],
            }
        ],
    }
    (tmp_path / "leases.json").write_text(json.dumps(old))
    with served(state_dir=str(tmp_path)) as exporter:
        assert exporter.lease_ids() == {"oldLease1234"}
        assert call(exporter, "DELETE", "/leases/oldLease1234.guess")[0] == 403
        assert call(exporter, "POST", "/leases/oldLease1234/renew")[0] == 200
        assert call(exporter, "DELETE", "/leases/oldLease1234")[0] == 200


def test_token_checks_are_strict() -> None:
    legacy = Lease("abc", (), 0.0, 1.0, "x")
    assert legacy.accepts("abc") and not legacy.accepts("abc.") and not legacy.accepts("ab")
    assert not token_matches("abc", "0" * 64, "abc")  # a new lease: the id is no token
    assert not token_matches("abc", "0" * 64, "abd.secret")


def test_head_choose_is_a_read_for_auth() -> None:
    assert not needs_auth("writes", "HEAD", "/choose", "n=1")
    assert needs_auth("writes", "GET", "/choose", "n=1")
    assert needs_auth("all", "HEAD", "/choose", "n=1")
