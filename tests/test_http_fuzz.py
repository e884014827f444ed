"""Raw HTTP bytes over a real socket: never a 500, never a traceback, never a 200 for a
malformed body (issue 14).

Complements tests/test_fuzz.py (query strings through the WSGI app) one layer down: the
request line, the headers and the body framing are what the server itself parses, so these
go through a real loopback socket to the exporter of ``tests/served.py``. Each example sends
its bytes, half-closes the connection (so that a server waiting for more body sees the end at
once) and reads what comes back: either nothing (the server closed) or a well-formed status
line, never 500, never a Python traceback, and for a ``POST /choose`` whose chunked framing
is broken or contradicted by a ``Content-Length``, never 200.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from served import Served, served

pytestmark = pytest.mark.slow

STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([1-5][0-9][0-9])(?: [^\r\n]*)?\r\n")
# A traceback, or Python's own words for a failed conversion leaking into an answer.
TRACEBACK = (
    b"Traceback (most recent call last)",
    b'File "',
    b"Internal Server Error",
    b"invalid literal for",
    b"could not convert",
)
READ_TIMEOUT_SECONDS = 5.0
BIG = 64 * 1024  # the largest request body the exporter accepts
# Every GPU acceptable, no claim: a POST /choose that the server wrongly accepts answers 200.
CHOOSE = "/choose?n=1&lease=0&max_util=100%25&max_mem_used=100%25"
# Bounded so that the whole module runs in well under 30 s; no shrinking phase, which after a
# failure could run far longer than the search did (the failing bytes are printed as found).
FUZZ = settings(
    max_examples=300,
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def exporter() -> Iterator[Served]:
    with served() as s:
        yield s


def exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw``, half-close, and return everything the server sends until it closes
    (or stops sending for READ_TIMEOUT_SECONDS)."""
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_SECONDS) as sock:
        try:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server closed while we were sending: an answer of its own kind
            pass
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            assert received, f"no answer and no close within {READ_TIMEOUT_SECONDS:g} s"
        except OSError:  # reset: closed
            pass
    return received


def check(received: bytes) -> int | None:
    """The first answer's status (None: closed without one), after the checks every answer
    must pass."""
    for marker in TRACEBACK:
        assert marker not in received, received[:2000]
    if not received:
        return None
    match = STATUS_LINE.match(received)
    assert match, f"not a status line: {received[:200]!r}"
    status = int(match.group(1))
    assert status != 500, received[:2000]
    return status


def request(method: str, target: str, headers: list[tuple[str, str]], body: bytes = b"") -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body


def chunked(*chunks: bytes, end: bytes = b"0\r\n\r\n") -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + end


# -- the examples ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "/choose?n=%C2%B2",  # n=² (a Unicode digit), percent-encoded
        "/choose?n=\u00b2",  # ... and as raw UTF-8 in the request line
        "/choose?n=%D9%A3",  # n=٣, an Arabic-Indic 3, which Python's int() reads as 3
        "/choose?min_free=" + "9" * 400,
        "/choose?lease=" + "9" * 400,
    ],
    ids=[
        "n-superscript-two",
        "n-superscript-two-raw",
        "n-arabic-indic-three",
        "min_free-400-digits",
        "lease-400-digits",
    ],
)
def test_odd_numbers_are_400(exporter: Served, target: str) -> None:
    received = exchange(exporter.port, request("GET", target, [("Connection", "close")]))
    assert check(received) == 400, received[:500]


def test_a_chunked_body_over_64_kib_is_413(exporter: Served) -> None:
    body = chunked(b"x" * 8192 * 9)  # 72 KiB in one chunk
    raw = request("POST", CHOOSE, [("Transfer-Encoding", "chunked")], body)
    received = exchange(exporter.port, raw)
    assert check(received) == 413, received[:500]


def test_many_small_chunks_over_64_kib_are_413(exporter: Served) -> None:
    body = chunked(*[b"y" * 1000] * 70)
    raw = request("POST", CHOOSE, [("Transfer-Encoding", "chunked")], body)
    assert check(exchange(exporter.port, raw)) == 413


@pytest.mark.parametrize(
    "body",
    [
        b"zz\r\nhello\r\n0\r\n\r\n",  # not hex
        b"-5\r\nhello\r\n0\r\n\r\n",  # negative
        b"3\r\nhello\r\n0\r\n\r\n",  # shorter than the data
        b"5\r\nhello",  # never ends
        b"ffffffffffffffffffff\r\nx\r\n0\r\n\r\n",  # absurd
        b"5\r\nhelloXX0\r\n\r\n",  # no CRLF after the data
    ],
    ids=["not-hex", "negative", "short", "unterminated", "absurd", "no-crlf"],
)
def test_a_malformed_chunk_size_is_400(exporter: Served, body: bytes) -> None:
    raw = request("POST", CHOOSE, [("Transfer-Encoding", "chunked")], body)
    received = exchange(exporter.port, raw)
    status = check(received)
    assert status is None or status == 400, received[:500]


def test_transfer_encoding_with_content_length_is_400(exporter: Served) -> None:
    body = chunked(b"hello")
    headers = [("Transfer-Encoding", "chunked"), ("Content-Length", str(len(body)))]
    received = exchange(exporter.port, request("POST", CHOOSE, headers, body))
    assert check(received) == 400, received[:500]


def test_head_metrics_is_200_without_a_body(exporter: Served) -> None:
    received = exchange(exporter.port, request("HEAD", "/metrics", [("Connection", "close")]))
    assert check(received) == 200, received[:500]
    _, _, body = received.partition(b"\r\n\r\n")
    assert body == b"", f"HEAD answered a body of {len(body)} bytes"


# -- fuzzing -----------------------------------------------------------------------------------

METHODS = st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "G ET", "get", ""])
TARGETS = st.sampled_from(
    ["/metrics", "/healthz", "/readyz", CHOOSE, "/choose?n=\u00b2", "*", "http://x/metrics",
     "/%zz", "//", "/gpus?format=json", "/leases", "/../etc/passwd", "/" + "a" * 9000,
     "/choose?min_free=" + "9" * 400, "/metrics?x=%00", "/healthz?"]
) | st.text(max_size=40)  # fmt: skip
VERSIONS = st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/1.1x", "", "HTTP/9.9"])
HEADER_NAMES = st.sampled_from(
    ["Content-Length", "Transfer-Encoding", "Host", "Connection", "Expect", "Authorization",
     "Accept-Encoding", "Content-Type", "X-Forwarded-For", " Content-Length", "Content-Length ",
     ""]
) | st.text(max_size=20)  # fmt: skip
HEADER_VALUES = st.sampled_from(
    ["0", "-1", "5", "99999999999999999999", "chunked", "gzip, chunked", "chunked, gzip",
     "identity", "close", "keep-alive", "100-continue", "Basic !!!", "Basic " + "A" * 5000,
     "gzip", "application/x-www-form-urlencoded", "\x00", "a\r\n b", "x" * 9000]
) | st.text(max_size=40)  # fmt: skip


@st.composite
def chunk_bodies(draw: st.DrawFn) -> bytes:
    """Chunked framing, sometimes right, often wrong: sizes that lie, are not hex, are huge;
    missing CRLFs; trailers; no last chunk."""
    out = b""
    for data in draw(st.lists(st.binary(max_size=40), max_size=4)):
        size = draw(
            st.sampled_from([b"%x" % len(data), b"%X" % len(data), b"%x" % (len(data) + 3), b"zz",
                             b"-1", b"ffffffffffffffff", b"%x;ext=1" % len(data), b" %x" % len(data),
                             b"0x%x" % len(data)])
        )  # fmt: skip
        crlf = draw(st.sampled_from([b"\r\n", b"\n", b""]))
        out += size + b"\r\n" + data + crlf
    out += draw(st.sampled_from([b"0\r\n\r\n", b"0\r\nX-Trailer: 1\r\n\r\n", b"", b"0\r\n"]))
    return out


def is_well_framed_chunked(body: bytes) -> bool:
    """Whether ``body`` starts with one valid chunked body (extensions and trailers allowed).

    Bytes after a complete chunked body are the next request on the connection, not part of
    this one: the first answer may rightly be 200 (the next one is then a 400).
    """
    # RFC 9112 2.2: a recipient MAY take a bare LF as a line end (h11 does), so a body whose
    # framing is complete that way may be answered too.
    rest = body
    while True:
        line, sep, rest = rest.partition(b"\n")
        line = line.removesuffix(b"\r")
        if not sep or not re.fullmatch(rb"[0-9a-fA-F]{1,8}(;[!-~]*)?", line):
            return False
        size = int(line.split(b";")[0], 16)
        if size == 0:
            return re.match(rb"([!-9;-~]+:[ -~]*\r?\n)*\r?\n", rest) is not None
        if len(rest) < size + 2 or rest[size : size + 2] != b"\r\n":
            return False
        rest = rest[size + 2 :]


@FUZZ
@given(
    method=METHODS,
    target=TARGETS,
    version=VERSIONS,
    headers=st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=5),
    body=st.binary(max_size=200) | chunk_bodies(),
)
def test_raw_requests(
    exporter: Served,
    method: str,
    target: str,
    version: str,
    headers: list[tuple[str, str]],
    body: bytes,
) -> None:
    head = f"{method} {target} {version}\r\nHost: x\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers)
    raw = head.encode("utf-8", "surrogateescape") + b"\r\n" + body
    check(exchange(exporter.port, raw))


@FUZZ
@given(body=chunk_bodies(), content_length=st.none() | st.integers(-1, 300))
@example(body=b"zz\r\nhello\r\n0\r\n\r\n", content_length=None)
@example(body=b"5\r\nhello\r\n0\r\n\r\n", content_length=18)
def test_broken_chunked_framing_is_never_200(
    exporter: Served, body: bytes, content_length: int | None
) -> None:
    headers = [("Transfer-Encoding", "chunked")]
    if content_length is not None:  # TE and CL together: the request is malformed (RFC 9112)
        headers.append(("Content-Length", str(content_length)))
    status = check(exchange(exporter.port, request("POST", CHOOSE, headers, body)))
    if content_length is not None or not is_well_framed_chunked(body):
        assert status != 200, body


@FUZZ
@given(garbage=st.binary(min_size=1, max_size=300))
@example(garbage=b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a TLS ClientHello's start
@example(garbage=b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 2000 + b"\r\n")  # too many headers
@example(garbage=b"\r\n" * 100 + b"GET /healthz HTTP/1.1\r\n\r\n")
def test_garbage_bytes(exporter: Served, garbage: bytes) -> None:
    check(exchange(exporter.port, garbage))
