"""Issue 27 point 5: a job array that starts 256 tasks at once on one host sends 256 claims
from one address; every one gets a grant or a real refusal (not_enough_gpus), none is told
to retry (the README's `CUDA_VISIBLE_DEVICES=$(curl -fsS …) || exit 1` would fail the job).
The request one over --max-requests-in-flight waits its turn (Limits.slot_wait_seconds, in
the workers' first-come-first-served queue) instead of a 503. A real server process. On the
code before that wait (f8b23fd^), 232 of the 256 got 503 too_many_requests."""

from __future__ import annotations

import collections
import http.client
import json
import tempfile
import threading

import pytest

from harness import exporter

pytestmark = pytest.mark.slow


def test_a_burst_of_256_claims_from_one_address_is_served_not_bounced() -> None:
    answers: collections.Counter[tuple[int, str]] = collections.Counter()
    state = tempfile.mkdtemp(prefix="burst-")
    with exporter(
        "--simulate",
        "64",
        "--state-dir",
        state,
        "--max-requests-in-flight",
        "4",
        "--max-waiters",
        "2",
    ) as ex:
        port = int(ex.address.rsplit(":", 1)[1])
        start = threading.Barrier(256)

        def claim() -> None:
            start.wait()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            try:
                query = "/choose?n=1&max_util=100%25&max_mem_util=100%25&max_mem_used=100%25"
                conn.request("POST", query, headers={"Accept": "application/json"})
                resp = conn.getresponse()
                body = resp.read()
                code = "ok" if resp.status == 200 else json.loads(body)["error"]["code"]
                answers[(resp.status, code)] += 1
            finally:
                conn.close()

        threads = [threading.Thread(target=claim) for _ in range(256)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert answers == {(200, "ok"): 64, (503, "not_enough_gpus"): 192}, answers
