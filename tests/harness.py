"""Real processes for tests: `gpu-exporter` commands, `serve` subprocesses, a real Prometheus.

Everything binds to 127.0.0.1 on a free port and is stopped by the context managers, even
when a test fails. Prometheus is the Debian package (``/usr/bin/prometheus``, installed by
``scripts/test.sh`` when running as root); :func:`require_prometheus` skips with the reason
where it is missing. VictoriaMetrics (Debian package ``victoria-metrics``, single node,
scraping by itself) answers the same query API: :func:`victoria_metrics` yields the same
:class:`Prometheus` handle, so a test can run against either store.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A loopback port that was free a moment ago (nothing listens there now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -m gpu_exporter ARGS`` with a fresh state directory (leases never leak)."""
    return subprocess.Popen(
        [sys.executable, "-m", "gpu_exporter", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "GPU_EXPORTER_STATE_DIR": tempfile.mkdtemp(), **(env or {})},
        cwd=ROOT,
    )


def stop(proc: subprocess.Popen[str]) -> str:
    """Terminate (if still running), drain and close the pipes; returns stderr."""
    if proc.poll() is None:
        proc.terminate()
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=10)
    return err


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """Status and body of a GET; HTTP errors are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_ready(base: str, proc: subprocess.Popen[str], timeout: float = 15.0) -> None:
    """Until the exporter at ``base`` answers /readyz with 200."""
    _wait_ok(base + "/readyz", proc, timeout)


def _wait_ok(url: str, proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args[0]} exited: {stop(proc)}")
        try:
            if get(url, timeout=1)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{url} did not answer 200 within {timeout:.0f} s")


@dataclass
class Exporter:
    """A running ``gpu-exporter serve`` subprocess."""

    base: str  # http://127.0.0.1:PORT
    address: str  # 127.0.0.1:PORT, what a Prometheus target or `instance` label holds
    proc: subprocess.Popen[str]


@contextlib.contextmanager
def exporter(*serve_args: str, env: dict[str, str] | None = None) -> Iterator[Exporter]:
    """``gpu-exporter serve SERVE_ARGS`` on a free loopback port, ready when yielded."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    proc = start("serve", "--listen-address", address, *serve_args, env=env)
    try:
        wait_ready(f"http://{address}", proc)
        yield Exporter(f"http://{address}", address, proc)
    finally:
        stop(proc)


# -- Prometheus ------------------------------------------------------------------------------


def require_prometheus() -> str:
    """Path of the Prometheus server binary, or skip the test saying why."""
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip(
            "prometheus not installed (Debian package 'prometheus'; scripts/test.sh installs "
            "it when run as root)"
        )
    return path


@dataclass
class Prometheus:
    base: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen[str]

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/PATH?params; returns ``data`` or raises with Prometheus' error."""
        url = f"{self.base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        status, body = get(url, timeout=10)
        doc = json.loads(body)
        if status != 200 or doc.get("status") != "success":
            raise AssertionError(f"{url}: {status} {body}")
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the result vector (or matrix) as Prometheus returns it."""
        result: list[dict[str, Any]] = self.api("query", query=expr)["result"]
        return result

    def wait_for(self, expr: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Poll an instant query until it returns at least one series."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"no data for {expr!r} after {timeout:.0f} s")
            time.sleep(0.25)

    def without_data(self, exprs: dict[str, str], timeout: float = 30.0) -> dict[str, str]:
        """Poll every expression until it returns data; {name: expr} of those that never did."""
        pending = dict(exprs)
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            pending = {name: e for name, e in pending.items() if not self.query(e)}
            if pending:
                time.sleep(0.5)
        return pending

    def wait_for_targets_up(self, count: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            up = self.query("up == 1")
            if len(up) >= count:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(up)} of {count} targets up after {timeout:.0f} s")
            time.sleep(0.25)


@contextlib.contextmanager
def prometheus(
    targets: Sequence[str],
    *,
    scrape_interval: str = "1s",
    rule_files: Sequence[Path] = (),
    evaluation_interval: str = "1s",
    extra_scrape_config: str = "",
    job: str = "gpu",
) -> Iterator[Prometheus]:
    """A real Prometheus on loopback scraping ``targets`` (``host:port``), stopped after.

    ``extra_scrape_config`` is YAML appended to the one scrape job (indented by the caller
    to sit under ``- job_name:``), e.g. relabelling rules. ``job`` names the scrape job
    (the shipped rules expect ``gpu-exporter``).
    """
    binary = require_prometheus()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="prometheus-") as tmp:
        config = Path(tmp, "prometheus.yml")
        lines = [
            "global:",
            f"  scrape_interval: {scrape_interval}",
            f"  evaluation_interval: {evaluation_interval}",
        ]
        if rule_files:
            lines.append("rule_files:")
            lines += [f"  - {Path(f).resolve()}" for f in rule_files]
        lines += [
            "scrape_configs:",
            f"  - job_name: {job}",
            "    static_configs:",
            f"      - targets: {json.dumps(list(targets))}",
        ]
        config.write_text("\n".join(lines) + "\n" + extra_scrape_config)
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp}/data",
                f"--web.listen-address=127.0.0.1:{port}",
                "--web.enable-lifecycle",
                "--log.level=warn",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_ok(base + "/-/ready", proc, timeout=30)
            yield Prometheus(base, proc)
        finally:
            stop(proc)


# -- VictoriaMetrics -------------------------------------------------------------------------

# How long VictoriaMetrics hides fresh samples from queries. Its default is 30 s, so every
# figure the chooser reads is at least 30 s old (docs/cluster.md); the tests want fresh ones.
VM_LATENCY_OFFSET = "1s"


def require_victoria_metrics() -> str:
    """Path of the VictoriaMetrics single-node binary, or skip the test saying why."""
    path = shutil.which("victoria-metrics")
    if path is None:
        pytest.skip(
            "victoria-metrics not installed (Debian package 'victoria-metrics'; scripts/test.sh "
            "installs it when run as root)"
        )
    return path


@contextlib.contextmanager
def victoria_metrics(
    targets: Sequence[str],
    *,
    scrape_interval: str = "1s",
    job: str = "gpu",
    rule_files: Sequence[Path] = (),
) -> Iterator[Prometheus]:
    """A single-node VictoriaMetrics on loopback scraping ``targets`` itself, stopped after.

    Same handle as :func:`prometheus`: VictoriaMetrics answers ``/api/v1/query`` too.
    ``rule_files`` are evaluated every second by a vmalert (same package) writing back into it.
    """
    binary = require_victoria_metrics()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="victoria-metrics-") as tmp:
        config = Path(tmp, "scrape.yml")
        config.write_text(
            "\n".join(
                [
                    "global:",
                    f"  scrape_interval: {scrape_interval}",
                    "scrape_configs:",
                    f"  - job_name: {job}",
                    "    static_configs:",
                    f"      - targets: {json.dumps(list(targets))}",
                ]
            )
            + "\n"
        )
        proc = subprocess.Popen(
            [
                binary,
                f"-promscrape.config={config}",
                f"-storageDataPath={tmp}/data",
                f"-httpListenAddr=127.0.0.1:{port}",
                f"-search.latencyOffset={VM_LATENCY_OFFSET}",
                "-loggerLevel=WARN",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        base = f"http://127.0.0.1:{port}"
        with contextlib.ExitStack() as stack:
            stack.callback(stop, proc)
            _wait_ok(base + "/health", proc, timeout=30)
            if rule_files:
                stack.enter_context(_vmalert(base, rule_files))
            yield Prometheus(base, proc)


@contextlib.contextmanager
def _vmalert(base: str, rule_files: Sequence[Path]) -> Iterator[None]:
    binary = shutil.which("vmalert")
    if binary is None:
        pytest.skip("vmalert not installed (Debian package 'victoria-metrics')")
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            *(f"-rule={Path(f).resolve()}" for f in rule_files),
            f"-datasource.url={base}",
            f"-remoteWrite.url={base}",
            "-evaluationInterval=1s",
            f"-httpListenAddr=127.0.0.1:{port}",
            "-loggerLevel=WARN",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_ok(f"http://127.0.0.1:{port}/health", proc, timeout=30)
        yield
    finally:
        stop(proc)


# -- gpu-exporter commands ---------------------------------------------------------------


def cli(*args: str, **popen: object) -> subprocess.Popen[str]:
    """`gpu-exporter ARGS` in its own session (no controlling terminal), pipes for output."""
    return subprocess.Popen(
        [sys.executable, "-m", "gpu_exporter", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
        **popen,  # type: ignore[call-overload]
    )


def finish(proc: subprocess.Popen[str], timeout: float = 20) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"gpu-exporter did not finish: {out!r} {err!r}") from None
    return proc.returncode, out, err


def run(*args: str) -> tuple[int, str, str]:
    return finish(cli(*args))
