"""Issue 27 point 6: a POST /choose body means what it says. A JSON object (or a form) carries
the same parameters with the same validation; any other body is 415; none is ignored.
Over a real socket, against four simulated GPUs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from served import Served, served


@pytest.fixture(scope="module")
def exporter() -> Iterator[Served]:
    with served() as ex:
        yield ex


def post(ex: Served, body: bytes, content_type: str, query: str = "") -> tuple[int, str]:
    req = urllib.request.Request(
        ex.url + "/choose" + query,
        data=body,
        method="POST",
        headers={"Content-Type": content_type, "Accept": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_json_body_is_the_request(exporter: Served) -> None:
    body = {"n": 3, "lease": "0", "format": "index", "max_util": "100%", "max_mem_util": "100%"}
    status, text = post(exporter, json.dumps(body).encode(), "application/json")
    assert status == 200 and len(text.strip().split(",")) == 3, text  # 3 GPUs, no lease
    assert exporter.lease_ids() == set()
    status, text = post(exporter, b'{"n": 1, "lease": "0", "include": [1, 3]}', "application/json")
    assert status == 200 and text.strip().startswith("GPU-"), text


@pytest.mark.parametrize(
    ("body", "content_type", "status", "code"),
    [
        (b'{"n": 1, "colour": "red"}', "application/json", 400, "unknown_parameter"),
        (b'{"n": "many"}', "application/json", 400, "invalid_parameter"),
        (b"[1, 2]", "application/json", 400, "invalid_parameter"),
        (b"{not json", "application/json", 400, "invalid_parameter"),
        (b'{"n": {"deep": 1}}', "application/json", 400, "invalid_parameter"),
        (b"n=3&lease=0", "text/plain", 415, "unsupported_media_type"),
    ],
)
def test_a_body_is_validated_never_ignored(
    exporter: Served, body: bytes, content_type: str, status: int, code: str
) -> None:
    got, text = post(exporter, body, content_type, query="?lease=0")
    assert got == status, text
    assert json.loads(text)["error"]["code"] == code
    assert exporter.lease_ids() == set()


def test_a_name_in_both_the_query_and_the_body_is_refused(exporter: Served) -> None:
    got, text = post(exporter, b'{"n": 2}', "application/json", query="?n=1&lease=0")
    assert got == 400, text


def test_a_form_body_is_read_as_before(exporter: Served) -> None:
    got, text = post(exporter, b"n=2&lease=0&format=index", "application/x-www-form-urlencoded")
    assert got == 200 and len(text.strip().split(",")) == 2, text
