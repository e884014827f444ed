"""`gpu-exporter choose` and `gpu-exporter run` against the /choose + /leases contract.

`run` is tested as a real process (signals, exit statuses, the child's environment);
`choose` in this process through cli.main. The server is the real one, on a loopback thread
of this process (tests/served.py).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpu_exporter import client
from gpu_exporter.choose.filters import Filters
from gpu_exporter.cli import build_parser, main
from gpu_exporter.client.run import run_main
from gpu_exporter.nvml import Nvml
from gpu_exporter.simulate import Fault, Scenario, SimulatedNvml
from harness import ROOT, cli, finish, free_port, get, run
from harness import exporter as real_exporter
from served import Served, served

ENV_LINE = re.compile(
    r"export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=(?P<gpus>GPU-[0-9a-f-]+) "
    r"GPU_LEASE=(?P<lease>\S+)\n"
)


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    with served() as ex:
        monkeypatch.setenv(client.URL_ENV, ex.url)
        yield ex


def read_line(proc: subprocess.Popen[str], timeout: float = 10) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "no output from the command"
    return proc.stdout.readline()


# -- run ---------------------------------------------------------------------------------


def test_run_gives_the_command_its_gpu_and_releases_after(exporter: Served) -> None:
    status, out, err = run(
        "run",
        "-n",
        "1",
        "--",
        "sh",
        "-c",
        'echo "$CUDA_VISIBLE_DEVICES $CUDA_DEVICE_ORDER $GPU_LEASE"',
    )
    assert status == 0, err
    uuid, order, token = out.split()
    lease = token.partition(".")[0]  # GPU_LEASE is the token: <id>.<secret>
    assert uuid.startswith("GPU-") and "," not in uuid
    assert order == "PCI_BUS_ID"
    assert lease not in exporter.lease_ids()
    assert "gpu-exporter run: GPU " in err and lease in err and uuid in err
    assert token not in err  # the secret is never printed
    assert ("DELETE", f"/leases/{token}", {}) in exporter.requests


def test_run_takes_the_command_without_a_separator_and_filters(exporter: Served) -> None:
    status, out, err = run(
        "run",
        "-q",
        "-n",
        "2",
        "--exclude",
        "0,1",
        "--owner",
        "ci",
        "sh",
        "-c",
        "echo $CUDA_VISIBLE_DEVICES",
    )
    assert status == 0, err
    assert err == ""
    uuids = out.strip().split(",")
    assert len(uuids) == 2
    listed = client.choose(2, lease=0, exclude="2,3")
    assert not set(uuids) & set(listed.uuids)


@pytest.mark.parametrize(
    ("script", "expected"), [("exit 7", 7), ("exit 0", 0), ("kill -TERM $$", 128 + 15)]
)
def test_run_exits_with_the_commands_status(exporter: Served, script: str, expected: int) -> None:
    status, _, err = run("run", "-q", "--", "sh", "-c", script)
    assert status == expected, err
    assert exporter.lease_ids() == set()


CHILD = """
import signal, sys, time
def stop(signum, frame):
    print("child got", signal.Signals(signum).name, flush=True)
    sys.exit(5)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
print("ready", flush=True)
time.sleep(20)
print("not interrupted", flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_run_forwards_signals_to_the_command(exporter: Served, signum: signal.Signals) -> None:
    proc = cli("run", "-q", "--", sys.executable, "-c", CHILD)
    try:
        assert read_line(proc) == "ready\n"
        assert len(exporter.lease_ids()) == 1
        proc.send_signal(signum)  # to `gpu-exporter run` alone, not its process group
        status, out, err = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert out == f"child got {signum.name}\n", err
    assert status == 5
    assert exporter.lease_ids() == set()


def test_run_renews_the_lease_while_the_command_runs(exporter: Served) -> None:
    check = (
        "import os, time; from gpu_exporter.client import leases\n"
        "time.sleep(3)  # three times the TTL\n"
        "print([l.id for l in leases()] == [os.environ['GPU_LEASE'].partition('.')[0]])\n"
    )
    # A 1 s lease renewed every 1/3 s tolerates a 2/3 s hiccup on a busy CI machine.
    status, out, err = run("run", "--lease", "1s", "--", sys.executable, "-c", check)
    assert (status, out) == (0, "True\n"), err
    assert "renewed every 0.333 s" in err
    assert exporter.lease_ids() == set()


def test_run_does_not_start_the_command_when_no_gpus_qualify(exporter: Served) -> None:
    status, out, err = run("run", "-n", "99", "--", "sh", "-c", "echo ran")
    assert status == 3
    assert out == ""
    assert err.startswith("gpu-exporter run: error: ") and err.count("\n") == 1


def test_run_reports_a_missing_command(exporter: Served) -> None:
    status, _, err = run("run", "--", "no-such-command-here")
    assert status == 127
    assert "cannot run 'no-such-command-here'" in err
    assert exporter.lease_ids() == set()


def test_run_warns_before_replacing_a_schedulers_cuda_visible_devices(
    exporter: Served,
) -> None:
    """With --ignore-mask (test_allocation.py: without it, run chooses inside the mask)."""
    proc = cli(
        "run", "--ignore-mask", "--", sys.executable, "-c",
        "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])",
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"},
    )  # fmt: skip
    status, out, err = finish(proc)
    assert status == 0 and out.startswith("GPU-")
    assert "warning: replacing CUDA_VISIBLE_DEVICES=0,1 with the chosen GPUs" in err


def test_run_needs_a_command() -> None:
    status, _, err = run("run", "-n", "1")
    assert status == 2 and "no command given" in err


@pytest.fixture
def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def run_with_nvml(argv: list[str], nvml: Callable[[], Nvml]) -> int:
    """`gpu-exporter run ARGV` in this process, choosing from ``nvml`` if no server answers."""
    return run_main(build_parser().parse_args(["run", *argv]), open_nvml=nvml)


def test_run_without_a_server_falls_back_to_local_nvml_with_a_warning(
    closed_port_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    nvml = Nvml(SimulatedNvml.of(Scenario.with_gpus(2), clock=time.monotonic), simulated=True)
    assert run_with_nvml(["--url", closed_port_url, "--", "sh", "-c", "exit 4"], lambda: nvml) == 4
    err = capsys.readouterr().err
    assert "warning: cannot reach gpu-exporter" in err and "No lease protects" in err
    assert "without a lease" in err


def test_run_without_a_server_or_a_driver_refuses(
    closed_port_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    sim = SimulatedNvml([], faults=[Fault("nvmlInit", "DRIVER_NOT_LOADED")], clock=time.monotonic)
    no_driver = lambda: Nvml(sim, simulated=True)  # noqa: E731
    marker = Path(os.devnull)
    command = ["sh", "-c", f"echo ran > {marker}"]
    assert run_with_nvml(["--url", closed_port_url, "--", *command], no_driver) == 1
    err = capsys.readouterr().err
    assert "cannot reach gpu-exporter" in err and "no NVIDIA driver" in err
    assert "refusing to run without a GPU" in err
    assert (
        run_with_nvml(["--no-local-fallback", "--url", closed_port_url, "--", "true"], no_driver)
        == 1
    )
    assert "choose locally" not in capsys.readouterr().err


# -- choose ------------------------------------------------------------------------------


def test_choose_env_format_prints_an_export_line_with_the_lease(
    exporter: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["choose", "--format", "env"]) == 0
    out = capsys.readouterr().out
    match = ENV_LINE.fullmatch(out)
    assert match, out
    assert match["lease"].partition(".")[0] in exporter.lease_ids()


def test_choose_prints_exactly_what_choose_answers(
    exporter: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["choose", "-n", "2", "--lease", "0", "--url", exporter.url]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"GPU-[0-9a-f-]+,GPU-[0-9a-f-]+\n", out), out
    assert main(["choose", "--format", "index", "--lease", "0"]) == 0
    assert re.fullmatch(r"\d+\n", capsys.readouterr().out)
    assert main(["choose", "--format", "json", "--lease", "0"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["lease"] is None and len(data["chosen"]) == 1
    assert exporter.lease_ids() == set()


def test_choose_passes_every_flag_to_the_server(
    exporter: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["choose", "-n", "1", "--lease", "2m", "--wait", "1s", "--owner", "me"]
    gpu2 = next(g for g in exporter.get_json("/gpus")["gpus"] if g["index"] == 2)
    filters = {
        "--min-free": "1GiB",
        "--min-total": "16GiB",
        "--max-util": "50%",
        "--max-mem-used": "60%",
        "--max-mem-util": "0.9",
        "--max-procs": "2",
        "--model": "A100",
        "--include": "1,2,3",
        "--exclude": gpu2["uuid"][:12],  # a name this host has (else a 400)
        "--idle-for": "0s",
        "--sort": "free",
    }
    for flag, value in filters.items():
        argv += [flag, value]
    assert main(argv) == 0, capsys.readouterr().err
    method, path, params = exporter.requests[-2]
    assert (method, path) == ("POST", "/choose")
    # then the job script's shell (our parent) is registered with the lease
    assert exporter.requests[-1][0::2] == ("POST", {"pid": str(os.getppid())})
    assert exporter.requests[-1][1].endswith("/pids")
    assert params == {
        "n": "1",
        "format": "uuid",
        "lease": "2m",
        "wait": "1s",
        "owner": "me",
        **{flag[2:].replace("-", "_"): value for flag, value in filters.items()},
    }


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["-n", "99"], 3, "error: "),
        (["--min-free", "lots"], 2, "error: min_free"),
        (["--url", "CLOSED"], 1, "error: cannot reach gpu-exporter at CLOSED"),
    ],
)
def test_choose_errors_are_one_line_and_an_exit_status(
    exporter: Served,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    status: int,
    message: str,
    closed_port_url: str,
) -> None:
    argv = [closed_port_url if a == "CLOSED" else a for a in argv]
    assert main(["choose", *argv]) == status
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        captured.err.startswith(message.replace("CLOSED", closed_port_url))
        and captured.err.count("\n") == 1
    )


def test_choose_exits_3_on_503_and_1_on_429(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with served(max_gpus_per_requester=1) as exporter:
        monkeypatch.setenv(client.URL_ENV, exporter.url)
        # Jobs on four other machines hold a GPU each: every GPU.
        leases, snapshot = exporter.daemon.leases, exporter.daemon.cache.get()
        held = [
            leases.claim(snapshot, 1, Filters(), ttl_seconds=60, requester=f"10.0.0.{i}")[1]
            for i in range(4)
        ]
        assert main(["choose"]) == 3
        err = capsys.readouterr().err
        assert err.startswith("error: 0 of 4 GPUs qualify, 1 requested") and err.count("\n") == 1
        for lease in held:
            assert lease is not None
            leases.release(lease.id)
        assert main(["choose"]) == 0  # this local user now holds one GPU: its limit
        capsys.readouterr()
        assert main(["choose"]) == 1
        me = f"local:{pwd.getpwuid(os.getuid()).pw_name}"
        assert capsys.readouterr().err == (
            f"error: {me} holds 1 GPU in leases; 1 more would exceed the limit of 1 per requester\n"
        )


@pytest.mark.parametrize("argv", [["-n", "0"], ["--lease", "forever"], ["--format", "yaml"]])
def test_choose_rejects_bad_flags_with_status_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["choose", *argv])
    assert caught.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_choose_and_run_read_the_url_from_the_environment(
    exporter: Served,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    closed_port_url: str,
) -> None:
    assert os.environ[client.URL_ENV] == exporter.url
    assert main(["choose", "--lease", "0"]) == 0
    assert capsys.readouterr().out.startswith("GPU-")
    monkeypatch.setenv(client.URL_ENV, closed_port_url)
    assert main(["choose", "--lease", "0"]) == 1
    assert closed_port_url in capsys.readouterr().err
    assert main(["run", "--no-local-fallback", "--", "true"]) == 1
    assert closed_port_url in capsys.readouterr().err


def test_help_lists_the_new_commands() -> None:
    status, out, _ = run("--help")
    assert status == 0 and "choose" in out and "run" in out
    started = time.monotonic()
    status, out, _ = run("run", "--help")
    assert status == 0 and "-- COMMAND" in out and "--max-util" in out
    assert time.monotonic() - started < 10


COUNTING_CHILD = """
import signal, sys, time
seen = []
signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
print("ready", flush=True)
deadline = time.monotonic() + 20
while not seen and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.3)  # a second, forwarded copy would arrive in this time
print(f"SIGINT x{len(seen)}", flush=True)
sys.exit(5)
"""

# Makes the pty on stdin the controlling terminal of this new session, then runs argv.
TAKE_TERMINAL = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def test_ctrl_c_on_a_terminal_reaches_the_command_once(exporter: Served) -> None:
    """The terminal sends ^C's SIGINT to the whole foreground group: no second copy from us."""
    command = ["run", "-q", "--", sys.executable, "-c", COUNTING_CHILD]
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", TAKE_TERMINAL, sys.executable, "-m", "gpu_exporter", *command],
            stdin=slave,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            assert read_line(proc) == "ready\n"
            os.write(master, b"\x03")  # ^C
            status, out, err = finish(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    finally:
        os.close(master)
        os.close(slave)
    assert (status, out) == (5, "SIGINT x1\n"), err
    assert exporter.lease_ids() == set()


@pytest.mark.slow
def test_run_against_the_real_server() -> None:
    """One round trip through `gpu-exporter serve` itself, a process of its own."""
    with real_exporter("--simulate", "4", "--interval", "0.2") as real:
        proc = cli(
            "run",
            "-n",
            "2",
            "--lease",
            "300ms",
            "--url",
            real.base,
            "--",
            sys.executable,
            "-c",
            "import os, time; time.sleep(0.5); print(os.environ['CUDA_VISIBLE_DEVICES'])",
        )
        status, out, err = finish(proc)
        assert status == 0, err
        assert len(out.strip().split(",")) == 2
        assert json.loads(get(real.base + "/leases")[1])["leases"] == []
        assert main(["choose", "--url", real.base, "-n", "99"]) == 3


# -- release -----------------------------------------------------------------------------


def test_release_gives_back_the_lease_in_gpu_lease(exporter: Served) -> None:
    status, out, _ = run("choose", "--format", "env")
    token = ENV_LINE.fullmatch(out).group("lease")  # type: ignore[union-attr]
    lease = token.partition(".")[0]
    assert lease in exporter.lease_ids()
    proc = cli("release", env={**os.environ, "GPU_LEASE": token})
    assert finish(proc) == (0, "", "")
    assert lease not in exporter.lease_ids()
    # Twice: the job is over either way, so a script ending in `release` still succeeds,
    # with one line saying nothing was released; --strict makes it its own exit status.
    status, out, err = run("release", token)
    assert status == 0 and out == ""
    assert err.startswith("gpu-exporter: note: nothing to release: ") and err.count("\n") == 1
    status, out, err = run("release", "--strict", token)
    assert status == 4 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1


def test_a_lease_token_never_reads_as_an_option(
    exporter: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 39.2: lease ids come from token_urlsafe, so one in 64 started with "-" and
    `gpu-exporter release TOKEN` took it for an option (exit 2): a red test by chance. An id
    is drawn again until it does not, and `release -- TOKEN` works for any token."""
    drawn = ["-firstDRAWN1", "secondDRAWN2"]
    real = secrets.token_urlsafe

    def token_urlsafe(nbytes: int | None = None) -> str:
        return drawn.pop(0) if nbytes == 9 and drawn else real(nbytes)

    monkeypatch.setattr(secrets, "token_urlsafe", token_urlsafe)
    _, out, _ = run("choose", "--format", "env")
    token = ENV_LINE.fullmatch(out).group("lease")  # type: ignore[union-attr]
    assert token.partition(".")[0] == "secondDRAWN2" in exporter.lease_ids()
    assert run("release", token) == (0, "", "")
    assert "secondDRAWN2" not in exporter.lease_ids()
    _, out, _ = run("choose", "--format", "env")
    token = ENV_LINE.fullmatch(out).group("lease")  # type: ignore[union-attr]
    assert run("release", "--", token) == (0, "", "")
    assert token.partition(".")[0] not in exporter.lease_ids()


def test_a_lease_records_who_asked_by_default(
    exporter: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --owner the login name goes with the claim, so the status page says who
    holds what; --owner '' sends none."""
    monkeypatch.setenv("LOGNAME", "alice")

    def last_claim() -> dict[str, str]:
        return [query for _, path, query in exporter.requests if path == "/choose"][-1]

    assert main(["choose", "-n", "1"]) == 0
    assert last_claim()["owner"] == "alice"
    assert {lease.owner for lease in exporter.daemon.leases.active()} == {"alice"}
    assert main(["choose", "-n", "1", "--owner", ""]) == 0
    assert "owner" not in last_claim()


def test_release_without_a_lease_is_a_usage_error(exporter: Served) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GPU_LEASE"}
    status, _, err = finish(cli("release", env=env))
    assert status == 2 and err == "error: no lease given and GPU_LEASE is not set\n"


def test_run_registers_itself_so_the_commands_work_is_the_leases(exporter: Served) -> None:
    proc = cli("run", "-q", "--", sys.executable, "-c", "import os; print(os.getppid())")
    status, out, err = finish(proc)
    assert status == 0, err
    assert int(out) == proc.pid  # COMMAND is run's child: a descendant of the registered pid
    registered = [(p, q) for m, p, q in exporter.requests if m == "POST" and p.endswith("/pids")]
    assert [q for _, q in registered] == [{"pid": str(proc.pid)}]
