"""The client pointed at something that is not a gpu-exporter: one clear line, at once.

A real web server (``http.server`` on a loopback socket) answers every request with an HTML
page, as a misconfigured ``GPU_EXPORTER_URL`` (a proxy, another service on the port) would;
an ``ftp://`` URL must be refused before urllib tries to speak FTP.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpu_exporter import client
from gpu_exporter.cli import main

PAGE = b"<!DOCTYPE HTML>\n<html><head><title>Error</title></head><body>Not Found</body></html>\n"


def web_server(status: int) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def answer(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(PAGE)))
            self.end_headers()
            self.wfile.write(PAGE)

        do_GET = do_POST = do_DELETE = answer

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def html_404() -> Iterator[str]:
    yield from web_server(404)


@pytest.fixture
def html_200() -> Iterator[str]:
    yield from web_server(200)


def test_choose_from_a_web_server_says_it_is_not_an_exporter(
    html_404: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(client.URL_ENV, html_404)
    assert main(["choose", "--lease", "0"]) == 1
    assert capsys.readouterr().err == (
        f"error: {html_404} does not look like a gpu-exporter "
        f"(HTTP 404 Not Found from {html_404}/choose)\n"
    )
    with pytest.raises(client.NotAnExporter) as caught:
        client.choose(1, html_404)
    assert caught.value.status == 404 and "DOCTYPE" not in str(caught.value)
    assert main(["release", "--url", html_404, "some-token"]) == 1
    assert "does not look like a gpu-exporter (HTTP 404" in capsys.readouterr().err


def test_a_200_web_page_is_not_an_answer(html_200: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["choose", "--url", html_200, "--lease", "0"]) == 1
    out, err = capsys.readouterr()
    assert out == ""  # the page is never printed as if it named GPUs
    assert err == (
        f"error: {html_200} does not look like a gpu-exporter "
        f"(HTTP 200 OK from {html_200}/choose)\n"
    )
    with pytest.raises(client.NotAnExporter, match="does not look like a gpu-exporter"):
        client.leases(html_200)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:9", "file:///etc/passwd", "gopher://x"])
def test_a_url_that_is_not_http_is_refused_at_once(
    url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(client.URL_ENV, url)
    started = time.monotonic()
    assert main(["choose"]) == 1
    assert main(["run", "--", "true"]) == 1  # no local fallback either: the URL is wrong
    assert time.monotonic() - started < 1.0
    line = f"error: {url}: not an http:// or https:// URL (from --url, ${client.URL_ENV} or "
    assert capsys.readouterr().err.splitlines() == [
        f"{line}{client.DEFAULT_URL})",
        f"gpu-exporter run: {line}{client.DEFAULT_URL})",
    ]
    with pytest.raises(client.GpuExporterError, match="not an http"):
        client.choose(1, url)


@pytest.mark.parametrize(
    ("flags", "where"),
    [
        (["--prometheus", "ftp://prom:9090"], "ftp://prom:9090"),
        (["--hosts", "a,ftp://b"], "ftp://b"),
    ],
)
def test_a_fleet_source_that_is_not_http_is_refused_at_once(
    flags: list[str], where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    assert main(["choose", *flags]) == 2
    assert time.monotonic() - started < 1.0
    assert capsys.readouterr().err == f"error: {where}: not an http:// or https:// URL\n"
