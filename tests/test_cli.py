"""The real thing: `gpu-exporter serve` as a subprocess on loopback, through the real server."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_exporter.cli import parse_listen_address
from harness import free_port, get, start, stop, wait_ready

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
    any_load = "max_util=1&max_mem_used=1"  # busy cards too, off the default filters
    status, text = get(base + "/choose?n=2&" + any_load)
    assert status == 200
    ids = text.strip().split(",")
    assert len(ids) == 2 and all(i.startswith("GPU-") for i in ids)
    status, text = get(base + "/choose?n=5&" + any_load)
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
    # One plain sentence, no stacked parentheses.
    assert "listening on 127.0.0.1:" in err and " over http; sampling every 0.2 s" in err


def test_every_interface_reads_as_words() -> None:
    from gpu_exporter.web.server import Server

    assert Server(None, "", 9400).address == "every interface, port 9400"
    assert Server(None, "::1", 9400).address == "[::1]:9400"


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


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("nosuchhost.invalid:9400", "cannot resolve the host name"),
        ("192.0.2.1:9400", "no interface of this machine has that address"),  # TEST-NET-1
    ],
)
def test_bad_listen_address_is_one_clear_line(address: str, reason: str) -> None:
    proc = start("serve", "--simulate", "1", "--listen-address", address)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 1
    (line,) = [line for line in err.splitlines() if "level=error" in line]
    assert f"cannot listen on {address}: {reason}" in line
    assert "No socket could be created" not in err and "Errno" not in err
    assert "Traceback" not in err


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


def test_a_variable_that_names_no_flag_is_warned_about_with_the_closest_one() -> None:
    port = free_port()
    proc = start(
        "serve",
        "--simulate=1",
        f"--listen-address=127.0.0.1:{port}",
        env={
            "GPU_EXPORTER_LISTEN_ADRESS": "0.0.0.0:9400",  # misspelt: would have been ignored
            "GPU_EXPORTER_PASWORD": "hunter2",
            "GPU_EXPORTER_URL": "http://gpuhost:9400",  # the client's: known
            "GPU_EXPORTER_NO_COLLECT_MEDIA": "1",  # a flag's: known
        },
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
    finally:
        err = stop(proc)
    warned = [line for line in err.splitlines() if "names no flag" in line]
    assert len(warned) == 2, err
    assert (
        "GPU_EXPORTER_LISTEN_ADRESS names no flag and is ignored; did you mean "
        "GPU_EXPORTER_LISTEN_ADDRESS (--listen-address)?" in warned[0]
    )
    assert "did you mean GPU_EXPORTER_PASSWORD (the client's, not serve's)?" in warned[1]
    assert "level=warn" in warned[0] and "hunter2" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--simulate", "nope.toml"],
            "--simulate: 'nope.toml' is neither a GPU count, a scenario file nor a bundled scenario (a100, fleet, lab)",
        ),
        (["--simulate", "0"], "--simulate takes 1 to 64 GPUs, got 0"),
        (["--listen-address", "9400"], "--listen-address: expected HOST:PORT"),
        (["--interval", "0"], "expected 0.05 to 3600 seconds"),
        (["--log-level", "loud"], "invalid choice: 'loud'"),
        (["--process-labels", "user,email"], "--process-labels: unknown process labels email"),
        (["--process-series-limit", "-1"], "--process-series-limit must be 0 or more"),
    ],
)
def test_bad_flags_are_one_clear_message(args: list[str], message: str) -> None:
    proc = start("serve", "--listen-address", f"127.0.0.1:{free_port()}", *args)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 2
    assert message in err
    assert "Traceback" not in err
    if not args[0].startswith("--simulate"):  # argparse's: one line and the hint, no usage
        assert err.splitlines() == [
            f"gpu-exporter serve: error: {err.split('error: ', 1)[1].splitlines()[0]}",
            "try 'gpu-exporter serve --help'",
        ]


@pytest.mark.parametrize(
    ("argv", "prog", "message"),
    [
        (["choose", "-n", "0"], "gpu-exporter choose", "argument -n: expected a whole number"),
        (["choose", "--bogus"], "gpu-exporter choose", "unrecognized arguments: --bogus"),
        (["release", "a", "b"], "gpu-exporter release", "unrecognized arguments: b"),
        (["run", "--wait", "x", "--", "true"], "gpu-exporter run", "argument --wait: expected"),
        (["serve", "--listen-address", "9400"], "gpu-exporter serve", "--listen-address: "),
        (["serve", "--choose-defaults", "x=1"], "gpu-exporter serve", "--choose-defaults: "),
        (["serve", "--prometheus-url", "ftp://p"], "gpu-exporter serve", "--prometheus-url: not"),
        (["nope"], "gpu-exporter", "argument COMMAND: invalid choice: 'nope'"),
        ([], "gpu-exporter", "the following arguments are required: COMMAND"),
    ],
)
def test_a_mistake_is_one_line_naming_the_subcommand_and_its_help(
    argv: list[str], prog: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpu_exporter.cli import main

    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    first, hint = capsys.readouterr().err.splitlines()  # no usage screen before it
    assert first.startswith(f"{prog}: error: {message}")
    assert hint == f"try '{prog} --help'"


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


def test_health_mig_xids_pcie_and_process_labels_end_to_end(tmp_path: Path) -> None:
    scenario = tmp_path / "host.toml"
    scenario.write_text(
        "[[gpus]]\n"
        'model = "NVIDIA A100-SXM4-80GB"\n'
        'load = "busy"\n'
        'mig = ["3g.40gb", "1g.10gb"]\n'
        "[[gpus]]\n"
        'model = "NVIDIA GeForce GTX 1080"\n'
        "[[xid_events]]\n"
        "gpu = 0\n"
        "xid = 79\n"
        "every_seconds = 0.2\n"
    )
    port = free_port()
    proc = start(
        "serve",
        "--simulate",
        str(scenario),
        "--listen-address",
        f"127.0.0.1:{port}",
        "--interval",
        "0.1",
        "--process-labels",
        "user,command",
        env={"GPU_EXPORTER_COLLECT_PCIE_THROUGHPUT": "true"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        deadline = time.monotonic() + 15
        text = ""
        while time.monotonic() < deadline:
            text = get(base + "/metrics")[1]
            if "gpu_xid_errors_total{" in text and "gpu_pcie_throughput_bytes_per_second{" in text:
                break
            time.sleep(0.1)
        assert 'gpu_xid_errors_total{gpu="0",uuid="GPU-' in text and 'xid="79"' in text
        assert 'direction="tx"' in text
        assert text.count("gpu_mig_info{") == 2
        assert 'profile="3g.40gb"' in text
        # Process series carry the opt-in labels (the simulated pids are not in this /proc).
        line = next(x for x in text.splitlines() if x.startswith("gpu_process_memory_used_bytes{"))
        assert 'command=""' in line and 'user=""' in line and 'container="' not in line
        # The busy card's MIG devices hold most of their memory: free only to a request
        # that accepts that.
        status, body = get(base + "/choose?n=1&mig=only&lease=0&max_mem_used=100%25")
        assert status == 200 and body.startswith("MIG-")
    finally:
        err = stop(proc)
    assert "Traceback" not in err
    assert 'msg="listening for Xid errors on 1 GPU"\n' in err


def test_every_serve_flag_has_a_row_in_the_readme() -> None:
    """The README's flag table is where admins look; a flag missing there does not exist."""
    import argparse

    from gpu_exporter.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    missing = [
        longs[0]
        for action in sub.choices["serve"]._actions
        if action.help != argparse.SUPPRESS
        for longs in [[o for o in action.option_strings if o.startswith("--") and o != "--help"]]
        if longs and not any(f"| `{o}" in readme for o in longs)
    ]
    assert missing == []
