"""Issue 27 point 6: a client from before lease tokens renews by the lease's id. Refusing it
let the lease expire under the running job and the card go to someone else; renewing never
takes a card from anyone, so the requester that claimed the lease (a local client: its user,
from any address) may renew it by id (logged once, as deprecated). Releasing still takes the
token; another requester gets 403."""

from __future__ import annotations

import http.client
import json
import logging
import os
import subprocess

import pytest

from served import served

SYSTEM_PYTHON = "/usr/bin/python3"  # one that user nobody may run


def ask(port: int, method: str, path: str, source: str = "127.0.0.1") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    try:
        conn.request(method, path, headers={"Accept": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def test_the_claimant_renews_by_id_others_and_releases_need_the_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with served() as ex, caplog.at_level(logging.WARNING):
        status, body = ask(ex.port, "POST", "/choose?n=1&lease=30s&format=json&max_util=100%25")
        assert status == 200, body
        lease = body["lease"]
        status, renewed = ask(ex.port, "POST", f"/leases/{lease['id']}/renew?ttl=10m")
        assert status == 200, renewed
        assert renewed["expires_at"] > lease["expires_at"] + 500
        ask(ex.port, "POST", f"/leases/{lease['id']}/renew?ttl=10m")
        deprecated = [r for r in caplog.records if "renewed by its id" in r.getMessage()]
        assert len(deprecated) == 1  # once per lease
        # The same local user from another loopback address is the same requester (28.10).
        status, body = ask(ex.port, "POST", f"/leases/{lease['id']}/renew", source="127.0.0.2")
        assert status == 200, body
        if os.getuid() == 0 and os.path.exists(SYSTEM_PYTHON):  # another user: forbidden
            script = (
                f"import http.client;c=http.client.HTTPConnection('127.0.0.1',{ex.port});"
                f"c.request('POST','/leases/{lease['id']}/renew');print(c.getresponse().status)"
            )
            run = [SYSTEM_PYTHON, "-c", script]
            done = subprocess.run(run, user=65534, capture_output=True, text=True, timeout=30)
            assert done.stdout.strip() == "403", done.stderr
        status, body = ask(ex.port, "DELETE", f"/leases/{lease['id']}")
        assert status == 403 and body["error"]["code"] == "forbidden"
        assert ask(ex.port, "DELETE", f"/leases/{lease['token']}")[0] == 200
