"""The real thing: `gpu-exporter serve` as a subprocess on loopback, through cheroot."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from gpu_exporter.cli import parse_listen_address
from gpu_exporter.server import free_port
from harness import get, start, stop, wait_ready

pytestmark = pytest.mark.slow


@pytest.fixture
def server() -> Iterator[tuple[str, subprocess.Popen[str]]]:
    port = free_port()
    proc = start(
        "serve", "--simulate", "3", "--listen-address", f"127.0.0.1:{port}", "--interval", "0.2"
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        yield base, proc
    finally:
        stop(proc)


def test_serves_metrics_and_choose(server: tuple[str, subprocess.Popen[str]]) -> None:
    base, _ = server
    status, text = get(base + "/metrics")
    assert status == 200
    assert text.count("gpu_up{") == 3
    assert 'gpu_exporter_build_info{backend="simulated"' in text
    assert "process_resident_memory_bytes" in text
    status, text = get(base + "/choose?n=2")
    assert status == 200
    ids = text.strip().split(",")
    assert len(ids) == 2 and all(i.startswith("GPU-") for i in ids)
    status, text = get(base + "/choose?n=5")
    # the two GPUs just chosen are leased for 60 s, so only one qualifies now
    assert status == 503 and text.startswith("error: 1 of 3 GPUs qualify, 5 requested")


def test_samples_keep_coming(server: tuple[str, subprocess.Popen[str]]) -> None:
    base, _ = server

    def stamp() -> float:
        text = get(base + "/metrics")[1]
        line = next(
            x
            for x in text.splitlines()
            if x.startswith("gpu_exporter_last_sample_timestamp_seconds ")
        )
        return float(line.split()[1])

    first = stamp()
    time.sleep(0.6)
    assert stamp() > first


def test_sigterm_exits_cleanly(server: tuple[str, subprocess.Popen[str]]) -> None:
    _, proc = server
    proc.send_signal(signal.SIGTERM)
    err = stop(proc)
    assert proc.returncode == 0
    assert "received SIGTERM, shutting down" in err


def test_port_in_use_fails_fast_with_a_clear_message() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = start("serve", "--simulate", "1", "--listen-address", f"127.0.0.1:{port}")
        _, err = proc.communicate(timeout=10)
        elapsed = time.monotonic() - started
    assert proc.returncode == 1
    assert "port is already in use" in err
    assert "--listen-address" in err
    assert "Traceback" not in err
    assert elapsed < 2.0 + 1.5  # 2 s budget plus interpreter start-up on a slow CI box


def test_environment_variables_configure_flags() -> None:
    port = free_port()
    proc = start(
        "serve",
        env={
            "GPU_EXPORTER_LISTEN_ADDRESS": f"127.0.0.1:{port}",
            "GPU_EXPORTER_SIMULATE": "2",
            "GPU_EXPORTER_INTERVAL": "0.1",
        },
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        assert get(f"http://127.0.0.1:{port}/metrics")[1].count("gpu_up{") == 2
    finally:
        stop(proc)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--simulate", "nope.toml"],
            "--simulate: 'nope.toml' is neither a GPU count nor a scenario file",
        ),
        (["--simulate", "0"], "--simulate takes 1 to 64 GPUs, got 0"),
        (["--listen-address", "9400"], "--listen-address: expected HOST:PORT"),
        (["--interval", "0"], "expected 0.05 to 3600 seconds"),
        (["--log-level", "loud"], "invalid choice: 'loud'"),
    ],
)
def test_bad_flags_are_one_clear_message(args: list[str], message: str) -> None:
    proc = start("serve", "--listen-address", f"127.0.0.1:{free_port()}", *args)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 2
    assert message in err
    assert "Traceback" not in err


def test_help_and_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gpu_exporter", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--listen-address" in out and "GPU_EXPORTER_" in out and "dcgm-exporter" in out
    version = subprocess.run(
        [sys.executable, "-m", "gpu_exporter", "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert version.startswith("gpu-exporter ")


def test_listen_address_parsing() -> None:
    assert parse_listen_address(":9400") == ("", 9400)
    assert parse_listen_address("0.0.0.0:1") == ("0.0.0.0", 1)
    assert parse_listen_address("[::]:9400") == ("::", 9400)
    for bad in ("9400", "host:", "host:99999", ":http"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_listen_address(bad)
