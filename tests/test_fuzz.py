"""Hostile query strings: never a 5xx that is not documented, never a body off the contract.

Complements the schemathesis run in test_openapi.py (which sticks to the documented
parameters) with raw query strings: unknown and repeated names, odd encodings, huge and
non-finite numbers, control characters.
"""

from __future__ import annotations

import json
import urllib.parse

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Stack, build_stack
from gpu_exporter.choose.params import CHOOSE_PARAMS
from gpu_exporter.simulate import Scenario, SimulatedNvml

DOCUMENTED_503 = {
    "not_enough_gpus",
    "nvml_unavailable",
    "snapshot_stale",
    "not_ready",
    "too_many_requests",
    "too_many_waiters",
    "shutting_down",
}
ALLOWED = {200, 400, 404, 405, 414, 429, 503}

NAMES = st.sampled_from([*CHOOSE_PARAMS, "ttl", "gpus", "N", "n[]", "", "x" * 100]) | st.text(
    max_size=12
)
VALUES = st.sampled_from(
    [
        "", "0", "1", "-1", "8", "1024", "1025", "99999999999999999999", "1e400", "nan", "inf",
        "-inf", "0x10", "1.5", "10GiB", "10 GB", "-5GiB", "80%", "0.5", "2", "1h", "-1s", "5m",
        "9999h", "json", "env", "uuid", "GPU-", "MIG-x", "0,1,2", ",,,", "00000000:18:00.0",
        "A100", "\x00", "\n", "é", "🙂", "%", "%zz",
    ]
) | st.text(max_size=30)  # fmt: skip
QUERY = st.lists(st.tuples(NAMES, VALUES), max_size=6).map(urllib.parse.urlencode) | st.text(
    max_size=80
).map(lambda s: urllib.parse.quote(s, safe="=&%+"))

_stack: Stack | None = None


def stack() -> Stack:
    """One stack for every example (building one per example would dominate the run)."""
    global _stack
    if _stack is None:
        _stack = build_stack(lambda c: SimulatedNvml.of(Scenario.with_gpus(4), clock=c.monotonic))
        _stack.sample()
    return _stack


def check(resp: object, accept_json: bool) -> None:
    status = resp.status_code  # type: ignore[attr-defined]
    body = resp.get_data(as_text=True)  # type: ignore[attr-defined]
    assert status in ALLOWED, (status, body)
    assert "Traceback" not in body and "<html" not in body.lower()
    if status < 400:
        return
    if resp.mimetype == "application/json":  # type: ignore[attr-defined]
        error = json.loads(body)["error"]
        assert set(error) == {"code", "message", "param"}
        assert isinstance(error["message"], str) and error["message"]
        code = error["code"]
    else:
        assert not accept_json or status in (404, 405), body
        assert body.startswith("error: ") and body.endswith("\n") and body.count("\n") == 1
        code = None
    if status == 503 and code is not None:
        assert code in DOCUMENTED_503, code


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.sampled_from(["/choose", "/gpus", "/leases", "/leases/abc/renew", "/leases/abc"]),
    method=st.sampled_from(["GET", "POST", "DELETE"]),
    query=QUERY,
    accept_json=st.booleans(),
)
def test_any_query_string_gets_a_documented_answer(
    path: str, method: str, query: str, accept_json: bool
) -> None:
    s = stack()
    headers = {"Accept": "application/json"} if accept_json else {}
    resp = s.client.open(f"{path}?{query}", method=method, headers=headers)
    check(resp, accept_json)
    # Let leases the fuzzer was granted expire, so later examples still find free GPUs.
    s.clock.advance(120)
    s.sample()


@settings(max_examples=100, deadline=None)
@given(body=st.binary(max_size=2000), query=QUERY)
def test_any_post_body_gets_a_documented_answer(body: bytes, query: str) -> None:
    s = stack()
    resp = s.client.post(
        f"/choose?{query}",
        data=body,
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    check(resp, False)
