"""--log.format (logfmt, json), --log.level, the debug request log, and the Prometheus-style
flag names (--web.listen-address, --web.config.file, --web.telemetry-path)."""

from __future__ import annotations

import base64
import io
import json
import logging
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest

from conftest import build_stack
from gpu_exporter import logs
from gpu_exporter.cli import build_parser
from gpu_exporter.config import APP_PATHS, parse_telemetry_path
from gpu_exporter.simulate import Scenario, SimulatedNvml
from harness import free_port, get, start, stop, wait_ready


def record(msg: str, *, level: int = logging.INFO, **fields: object) -> logging.LogRecord:
    rec = logging.LogRecord(
        "gpu_exporter", level, "/src/gpu_exporter/daemon.py", 88, msg, None, None
    )
    rec.created, rec.msecs = 1_764_044_982.5, 500.0
    if fields:
        rec.fields = fields  # what extra={"fields": …} sets
    return rec


def test_logfmt_is_the_go_exporters_line() -> None:
    line = logs.LogfmtFormatter().format(record("listening on :9400", path="/metrics", n=2))
    assert line == (
        'ts=2025-11-25T04:29:42.500Z level=info caller=daemon.py:88 msg="listening on :9400" '
        "path=/metrics n=2"
    )
    warn = logs.LogfmtFormatter().format(record('a "quoted"\nline', level=logging.WARNING))
    assert 'level=warn caller=daemon.py:88 msg="a \\"quoted\\"\\nline"' in warn
    assert "\n" not in warn


def test_json_is_one_object_per_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec = record("failed", level=logging.ERROR, status=500)
        rec.exc_info = sys.exc_info()
    line = logs.JsonFormatter().format(rec)
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["ts"] == "2025-11-25T04:29:42.500Z" and obj["level"] == "error"
    assert obj["caller"] == "daemon.py:88" and obj["msg"] == "failed" and obj["status"] == 500
    assert "ValueError: boom" in obj["err"]


def test_setup_sends_the_chosen_format_at_the_chosen_level() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        logs.setup("warn", "json", stream)
        logging.getLogger("gpu_exporter.x").info("hidden")
        logging.getLogger("gpu_exporter.x").warning("shown")
        assert [json.loads(x)["msg"] for x in stream.getvalue().splitlines()] == ["shown"]
        with pytest.raises(ValueError, match="log format must be one of logfmt, json"):
            logs.setup("info", "xml")
    finally:
        root.handlers[:], root.level = saved[0], saved[1]


def test_the_flags_prometheus_admins_type_are_accepted() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--web.listen-address=127.0.0.1:9500",
            "--web.config.file=/etc/web.yml",
            "--web.telemetry-path=/gpu/metrics",
            "--log.level=warn",
            "--log.format=json",
        ]
    )
    assert args.listen_address == "127.0.0.1:9500" and args.web_config_file == "/etc/web.yml"
    assert args.telemetry_path == "/gpu/metrics"
    assert (args.log_level, args.log_format) == ("warn", "json")
    old = build_parser().parse_args(["serve", "--listen-address=:1", "--log-level=warning"])
    assert old.listen_address == ":1" and old.log_level == "warning" and old.log_format == "logfmt"


@pytest.mark.parametrize("path", ["metrics", "/", "/metrics/", "/leases", "/choose/x", "/a b"])
def test_a_telemetry_path_the_app_uses_is_refused(path: str) -> None:
    with pytest.raises(ValueError, match=r"taken by|expected a"):
        parse_telemetry_path(path)


def test_app_paths_cover_every_route() -> None:
    stack = build_stack(lambda c: SimulatedNvml.of(Scenario.with_gpus(1), clock=c.monotonic))
    for rule in stack.app.url_map.iter_rules():
        static = rule.rule.split("<")[0].rstrip("/") or "/"
        with pytest.raises(ValueError, match=r"taken by the exporter|expected a path"):
            parse_telemetry_path(static)  # the metrics would hide this route
    assert parse_telemetry_path("/gpu/metrics") == "/gpu/metrics"
    assert "/static" in APP_PATHS


@pytest.fixture
def debug_exporter(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    hashed = bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=4)).decode()
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  prom: '{hashed}'\n")
    port = free_port()
    proc = start(
        "serve",
        "--simulate",
        "2",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--web.config.file={config}",
        "--web.telemetry-path=/gpu/metrics",
        "--log.level=debug",
        "--log.format=json",
        "--interval=0.2",
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        yield base, proc
    finally:
        stop(proc)


def fetch(url: str, auth: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.slow
def test_telemetry_path_and_the_debug_request_log(
    debug_exporter: tuple[str, subprocess.Popen[str]],
) -> None:
    base, proc = debug_exporter
    status, text = fetch(base + "/gpu/metrics", "prom:secret")
    assert status == 200 and "gpu_up{" in text
    assert fetch(base + "/metrics", "prom:secret")[0] == 404  # only the configured path
    status, page = fetch(base + "/", "prom:secret")
    assert status == 200 and '<a href="gpu/metrics">/gpu/metrics</a>' in page
    doc = json.loads(fetch(base + "/openapi.json", "prom:secret")[1])
    assert "/gpu/metrics" in doc["paths"] and "/metrics" not in doc["paths"]
    assert fetch(base + "/gpu/metrics", "prom:wrong")[0] == 401
    token = json.loads(
        fetch(base + "/choose?n=1&format=json&max_util=1&max_mem_used=1", "prom:secret")[1]
    )["lease"]["token"]
    assert fetch(base + f"/leases/{token}/renew?ttl=30s", "prom:secret")[0] == 405  # GET
    assert get(base + "/healthz")[0] == 200
    err = stop(proc)
    lines = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
    assert len(lines) == len(err.splitlines()), err  # every line is JSON
    requests = [x for x in lines if x["msg"] == "request"]
    seen = {(x["method"], x["path"], x["status"]) for x in requests}
    assert ("GET", "/gpu/metrics", "200") in seen and ("GET", "/gpu/metrics", "401") in seen
    assert ("GET", "/metrics", "404") in seen and ("GET", "/healthz", "200") in seen
    for x in requests:
        assert x["level"] == "debug" and x["remote"] == "127.0.0.1"
        assert float(x["duration_seconds"]) >= 0
    assert token.split(".")[1] not in err  # the lease's secret is never logged
    assert "secret" not in err and "cHJvbTpzZWNyZXQ" not in err  # nor credentials
