#!/usr/bin/env python3
"""gpu-exporter on a real NVIDIA driver: one prepared check, one command (docs/real-gpu.md).

    python3 bench/real_gpu.py --prepare .whl             # here, with PyPI: the wheels to bring
    python3 bench/real_gpu.py --wheels .whl --out DIR    # there: the GPU host, no network
    python3 bench/real_gpu.py --self-test --out DIR      # anywhere: the fake library (CI)

It installs gpu-exporter (and what the host lacks) from the wheels, serves the real driver
(never ``--simulate``) and checks, step by step: the values against ``nvidia-smi`` at the
same moment, every family the card supports present, the idle cost beside nvitop-exporter,
the Xid listener blocking in the driver, NVML's own costs and what the card offers beyond
today's metrics (GPM, NVLink, memory temperature, per-process utilization), a plain-curl
claim released when its job arrives, the busy card refused, a memory lease under
``gpu-exporter run`` with PyTorch's cap and an overrun, JAX's cap, /metrics latency, and a
clean shutdown. Each step adds checks (ok, fail, skipped with why, info) to ``report.json``
and ``summary.md`` in ``--out``, rewritten after every step so that a run cut short still
leaves what it found. Exit status: 0 when no check failed.

``--self-test`` runs the same steps over the test fake ``libnvidia-ml.so.1`` and a fake
``nvidia-smi`` answering from that library, so the script cannot rot; the job steps then use a
stand-in job that the fake card is told about, and what needs CUDA is reported as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import http.client
import io
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCRIPT = str(Path(__file__).resolve())
HERE = Path(SCRIPT).parent
ROOT = HERE.parent
HOST = "127.0.0.1"
GiB = 2**30
MiB = 2**20
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
    "Accept-Encoding": "gzip",
}

# What the GPU host lacks, by the host's package list (docs/real-gpu.md); the versions the
# test suite runs with. nvitop and nvitop-exporter are the peer measured beside us.
WHEELS = (
    "flask==3.1.3",
    "blinker==1.9.0",
    "itsdangerous==2.2.0",
    "bcrypt==5.0.0",
    "nvitop==1.7.2",
    "nvitop-exporter==1.7.2",
)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


@dataclass(frozen=True)
class Timing:
    """How long each step takes: the real run's, and the self-test's (seconds)."""

    idle_s: float
    busy_s: float
    overrun_s: float
    scrapes: int
    budget_s: float
    # The exporter's --gpm-interval: the default on the real card (its idle CPU is the
    # default's), 1 s in the self-test (whose busy job lasts 4 s).
    gpm_interval_s: float


REAL = Timing(idle_s=60, busy_s=20, overrun_s=6, scrapes=300, budget_s=330, gpm_interval_s=5)
SELF_TEST = Timing(idle_s=3, busy_s=4, overrun_s=4, scrapes=40, budget_s=120, gpm_interval_s=1)


# -- the report --------------------------------------------------------------------------------


@dataclass
class Check:
    step: str
    name: str
    status: str  # ok, fail, skipped, info
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


class Report:
    """Checks and measurements, written to ``out`` as JSON and Markdown after every step."""

    def __init__(self, out: Path, mode: str) -> None:
        self.out = out
        self.started = time.time()
        self.meta: dict[str, Any] = {
            "mode": mode,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.started)),
            "python": sys.version.split()[0],
            "host": platform.node(),
        }
        self.checks: list[Check] = []
        self.measurements: dict[str, Any] = {}
        self.step = "start"

    def add(self, name: str, status: str, detail: str = "", **data: Any) -> Check:
        check = Check(self.step, name, status, detail, data)
        self.checks.append(check)
        _log(f"[{status}] {self.step}: {name}{' — ' + detail if detail else ''}")
        return check

    def expect(self, name: str, ok: bool, detail: str = "", **data: Any) -> bool:
        self.add(name, "ok" if ok else "fail", detail, **data)
        return ok

    def skip(self, name: str, why: str) -> None:
        self.add(name, "skipped", why)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.meta["seconds"] = round(time.time() - self.started, 1)
        data = {
            "meta": self.meta,
            "checks": [asdict(c) for c in self.checks],
            "measurements": self.measurements,
        }
        (self.out / "report.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
        (self.out / "summary.md").write_text(summary(data))


def summary(data: dict[str, Any]) -> str:
    """The Markdown summary of one report (what docs/real-gpu.md gets, dated)."""
    meta, checks, m = data["meta"], data["checks"], data["measurements"]
    counts = {s: sum(c["status"] == s for c in checks) for s in ("ok", "fail", "skipped", "info")}
    lines = [
        f"### {meta['started']}: {meta.get('card', '?')}, driver {meta.get('driver', '?')}"
        + (" (self-test: fake library)" if meta["mode"] == "self-test" else ""),
        "",
        f"{counts['ok']} ok, {counts['fail']} failed, {counts['skipped']} skipped, "
        f"{counts['info']} for information; {meta.get('seconds', '?')} s; gpu-exporter "
        f"{meta.get('revision', '?')}. "
        + ", ".join(f"{k}: {v}" for k, v in sorted(meta.get("versions", {}).items())),
        "",
        "| Step | Check | Result | Detail |",
        "|---|---|---|---|",
    ]
    for c in checks:
        detail = str(c["detail"]).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {c['step']} | {c['name']} | {c['status']} | {detail} |")
    if m:
        lines += ["", "Measurements:", ""]
        for key, value in m.items():
            lines.append(f"- **{key}**: `{json.dumps(value, default=str)[:600]}`")
    return "\n".join(lines) + "\n"


def _log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


# -- scraping ----------------------------------------------------------------------------------


class Scrape:
    """One /metrics answer: values by (name, labels); families by name."""

    def __init__(self, text: str) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        self.text = text
        self.samples: list[tuple[str, dict[str, str], float]] = []
        self.families: set[str] = set()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples.append((s.name, dict(s.labels), s.value))
                self.families.add(s.name)

    def get(self, name: str, **labels: str) -> float | None:
        for n, lab, value in self.samples:
            if n == name and all(lab.get(k) == v for k, v in labels.items()):
                return value
        return None

    def series(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        return [
            (lab, v)
            for n, lab, v in self.samples
            if n == name and all(lab.get(k) == v for k, v in labels.items())
        ]


def http_get(port: int, path: str, method: str = "GET", timeout: float = 10) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def scrape(port: int) -> Scrape:
    status, body = http_get(port, "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}: {body[:200]!r}")
    return Scrape(body.decode())


def get_json(port: int, path: str) -> Any:
    status, body = http_get(port, path)
    if status != 200:
        raise RuntimeError(f"{path} answered {status}: {body[:300]!r}")
    return json.loads(body)


def eventually(what: Callable[[], Any], seconds: float, every: float = 0.25) -> Any:
    """``what()``'s first true answer within ``seconds``, else its last answer."""
    deadline = time.monotonic() + seconds
    while True:
        answer = what()
        if answer or time.monotonic() > deadline:
            return answer
        time.sleep(every)


# -- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class Proc:
    """A process in its own session (so that stopping it stops its children), output to a
    file under the work directory."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], work: Path) -> None:
        self.name = name
        self.log_path = work / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=work,  # not the checkout: the installed gpu-exporter is the one imported
            start_new_session=True,
        )
        self.pid = self.proc.pid

    def output(self, tail: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-tail:]
        return ""

    def stop(self, timeout: float = 5.0) -> tuple[int | None, float]:
        """SIGTERM, then SIGKILL to the whole session after ``timeout``: (status, seconds)."""
        started = time.monotonic()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        seconds = time.monotonic() - started
        status = self.proc.poll()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._log.close()
        return status, seconds


def threads(pid: int) -> dict[int, dict[str, Any]]:
    """Per thread of ``pid``: CPU seconds (schedstat), voluntary context switches, and the
    system call it is in (x86-64 numbers: 16 ioctl, 202 futex, 232 epoll_wait …)."""
    out = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                cpu = int((task / "schedstat").read_text().split()[0]) / 1e9
                status = (task / "status").read_text()
                switches = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
                try:
                    syscall = (task / "syscall").read_text().split()[0]
                except OSError:
                    syscall = "?"
                out[int(task.name)] = {"cpu_s": cpu, "switches": switches, "syscall": syscall}
    return out


def cpu_seconds(pid: int) -> float:
    return sum(t["cpu_s"] for t in threads(pid).values())


# -- the card: real driver, or the fake library ------------------------------------------------


class Card:
    """The real driver: the environment as it is, the real ``nvidia-smi``; the job's work is
    seen by the driver itself."""

    fake = False

    def __init__(self, work: Path) -> None:
        self.work = work
        self.env = dict(os.environ)
        self.smi = shutil.which("nvidia-smi") or "nvidia-smi"

    def job(self, pid: int, used_bytes: int, busy: bool) -> None:
        """Tell the card about the job's work (the fake card only)."""

    def job_ended(self) -> None:
        """The job is gone (the fake card only)."""


class FakeCard(Card):
    """The test fake ``libnvidia-ml.so.1`` as one idle H100 (GPM, memory temperature), with
    a fake ``nvidia-smi`` on PATH that answers from the same library (``--as-nvidia-smi``);
    a busy job makes its GPM activity and its process's utilization high."""

    fake = True

    def __init__(self, work: Path) -> None:
        super().__init__(work)
        sys.path.insert(0, str(ROOT / "tests"))
        import fakenvml

        self.fakenvml = fakenvml
        lib = fakenvml.build(work / "fakelib")
        self.config = work / "fakenvml.conf"
        self._write(processes=(), util=0)
        self.env = fakenvml.environment(lib, self.config)
        bindir = work / "bin"
        bindir.mkdir(exist_ok=True)
        self.smi = str(bindir / "nvidia-smi")
        Path(self.smi).write_text(
            f'#!/bin/sh\nexec "{sys.executable}" "{SCRIPT}" --as-nvidia-smi "$@"\n'
        )
        os.chmod(self.smi, 0o755)
        self.env["PATH"] = f"{bindir}{os.pathsep}{self.env.get('PATH', '')}"

    def _write(self, processes: tuple[tuple[int, int], ...], util: int) -> None:
        used = sum(b for _, b in processes)
        gpu = self.fakenvml.FakeGpu(
            name="NVIDIA H100 80GB HBM3",
            uuid="GPU-5e1f7e57-0000-4000-8000-000000000001",
            memory_total=81559 * MiB,
            memory_used=used,
            memory_reserved=573 * MiB,
            utilization_gpu=util,
            utilization_memory=util // 3,
            power_usage_mw=70_000 + util * 5_000,
            temperature_c=31 + util // 10,
            processes=processes,
            errors={"nvmlDeviceGetFanSpeed": "NOT_SUPPORTED"},
            health={"memory_temperature_c": 38 + util // 12},
            # an H100's GPM as the probe read it: idle 0, bf16 matmuls SM 96 %, tensor 93 %
            gpm={GPM_METRICS[name]: value * util / 97 for name, value in FAKE_GPM_BUSY.items()},
            process_utilization=tuple(
                (pid, util * 90 // 97, util * 29 // 97) for pid, _ in processes
            ),
        )
        self.fakenvml.write_config(self.config, [gpu], driver_version="580.159.04")

    def job(self, pid: int, used_bytes: int, busy: bool) -> None:
        self._write(processes=((pid, used_bytes),), util=97 if busy else 0)

    def job_ended(self) -> None:
        self._write(processes=(), util=0)


# -- steps -------------------------------------------------------------------------------------


class Run:
    """One run: the card, the installed exporter, the report; each step a method."""

    def __init__(self, args: argparse.Namespace, card: Card, timing: Timing) -> None:
        self.args = args
        self.card = card
        self.timing = timing
        self.out: Path = args.out
        self.work = card.work
        self.report = Report(self.out, "self-test" if card.fake else "real")
        self.deadline = time.monotonic() + timing.budget_s
        self.env = dict(card.env)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.exporter: Proc | None = None
        self.peer: Proc | None = None
        self.port = 0
        self.peer_port = 0
        self.uuid = ""
        self.total_bytes = 0
        self.procs: list[Proc] = []

    # helpers

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(name, command, env or self.env, self.work)
        self.procs.append(proc)
        return proc

    def step(self, name: str, body: Callable[[], None], needs: float = 0) -> None:
        self.report.step = name
        if self.left() < needs:
            self.report.skip(name, f"{self.left():.0f} s of the budget left, {needs:.0f} needed")
            return
        started = time.monotonic()
        try:
            body()
        except Exception as exc:  # a step that breaks is a finding, and the run goes on
            self.report.add(
                "step ran",
                "fail",
                f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc()[-2000:],
            )
        finally:
            seconds = self.report.measurements.setdefault("step_seconds", {})
            seconds[name] = round(time.monotonic() - started, 1)
            self.report.write()

    # install

    def install(self) -> None:
        site = self.work / "site"
        wheels = sorted(self.args.wheels.glob("*.whl")) if self.args.wheels else []
        if not wheels and self.card.fake:  # the self-test installs this checkout's wheel
            built = self.work / "wheels"
            command = self.python("-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation")
            subprocess.run([*command, "-w", str(built), str(ROOT)], check=True, timeout=300)
            wheels = sorted(built.glob("*.whl"))
        if wheels:
            command = [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--no-cache-dir",
                "--upgrade",
                "--target",
                str(site),
                *map(str, wheels),
            ]
            result = subprocess.run(command, capture_output=True, text=True, timeout=180)
            if not self.report.expect(
                "wheels installed",
                result.returncode == 0,
                f"{len(wheels)} wheels into {site}"
                if result.returncode == 0
                else result.stderr[-800:],
                wheels=[w.name for w in wheels],
            ):
                return
        else:
            self.report.add("wheels installed", "info", "no --wheels: the environment as it is")
        paths = [str(site)] if wheels else []
        if not any(w.name.startswith("gpu_exporter-") for w in wheels):
            paths.append(str(ROOT))  # the checkout itself
        self.env["PYTHONPATH"] = os.pathsep.join(
            [*paths, *filter(None, [self.env.get("PYTHONPATH")])]
        )
        sys.path[:0] = paths  # this process reads the exporter's metric spec too
        probe = (
            "import importlib.metadata as m, json, gpu_exporter, flask, bcrypt, pynvml\n"
            "v = {}\n"
            "for d in ('nvidia-ml-py', 'prometheus-client', 'flask', 'h11', 'torch', 'jax',"
            " 'nvitop-exporter'):\n"
            "    try: v[d] = m.version(d)\n"
            "    except m.PackageNotFoundError: pass\n"
            "v['gpu-exporter'] = gpu_exporter.__version__\n"
            "print(json.dumps({'versions': v, 'from': gpu_exporter.__file__}))\n"
        )
        result = subprocess.run(
            self.python("-c", probe),
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
            cwd=self.work,
        )
        if self.report.expect(
            "gpu-exporter and its dependencies import",
            result.returncode == 0,
            result.stdout.strip()[-400:] if result.returncode == 0 else result.stderr[-800:],
        ):
            found = json.loads(result.stdout)
            self.report.meta["versions"] = found["versions"]

    # serve

    def serve(self) -> None:
        self.port = free_port()
        state = self.work / "state"
        command = self.python(
            "-m",
            "gpu_exporter",
            "serve",
            "--listen-address",
            f"{HOST}:{self.port}",
            "--interval",
            "1",
            "--state-dir",
            str(state),
            "--process-labels",
            "user,command",
            "--gpm-interval",
            f"{self.timing.gpm_interval_s:g}",
        )
        started = time.monotonic()
        self.exporter = self.start("gpu-exporter", command)

        def ready() -> bool:
            if self.exporter is not None and self.exporter.proc.poll() is not None:
                raise RuntimeError(f"gpu-exporter exited:\n{self.exporter.output()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                return http_get(self.port, "/readyz", timeout=2)[0] == 200
            return False

        ok = eventually(ready, 30)
        if not self.report.expect(
            "serve on the driver is ready",
            ok,
            f"/readyz 200 after {time.monotonic() - started:.1f} s"
            if ok
            else self.exporter.output(),
        ):
            raise RuntimeError("gpu-exporter never became ready")
        m = scrape(self.port)
        backend = [lab for lab, _ in m.series("gpu_exporter_build_info")]
        self.report.meta["revision"] = backend[0].get("revision") if backend else None
        self.report.expect(
            "the real driver, not the simulator",
            bool(backend)
            and backend[0].get("backend") != "simulated"
            and m.get("gpu_exporter_nvml_up") == 1,
            f"build_info {backend}, nvml_up {m.get('gpu_exporter_nvml_up')}",
        )
        gpus = get_json(self.port, "/gpus")
        first = gpus["gpus"][0]
        self.uuid = first["uuid"]
        self.total_bytes = int(first["memory_total_bytes"])
        self.report.meta.update(
            card=first.get("name"),
            driver=gpus.get("driver_version"),
            cuda_driver=gpus.get("cuda_driver_version"),
            gpus=len(gpus["gpus"]),
        )
        self.report.add(
            "GPUs seen",
            "info",
            f"{len(gpus['gpus'])}: {first.get('name')} {self.uuid}",
            unsupported_fields=first.get("unsupported_fields", []),
        )

    # values against nvidia-smi

    def values(self) -> None:
        fields = smi_fields(self.card.smi, self.env)
        if not fields:
            self.report.skip("nvidia-smi fields", "nvidia-smi --help-query-gpu listed none")
            return
        wanted = [c for c in COMPARISONS if c.smi in fields]
        wanted += [c for c in IDENTITY if c.smi in fields]
        before = scrape(self.port)
        answer = smi_query(self.card.smi, self.env, [c.smi for c in wanted])
        after = scrape(self.port)
        unsupported = set(get_json(self.port, "/gpus")["gpus"][0].get("unsupported_fields", []))
        self.report.measurements["nvidia-smi"] = answer
        for c in wanted:
            c.check(self.report, answer.get(c.smi, ""), before, after, unsupported)
        missing = [c.smi for c in COMPARISONS if c.smi not in fields]
        if missing:
            self.report.add("nvidia-smi lacks", "info", ", ".join(missing))
        extra = [f for f in UNCOMPARED if f in fields]
        if extra:  # what nvidia-smi has that today's metrics do not (or that moves too fast)
            self.report.add(
                "nvidia-smi only", "info", json.dumps(smi_query(self.card.smi, self.env, extra))
            )

    # every family the card supports

    def families(self) -> None:
        from gpu_exporter.collect.fields import FIELDS
        from gpu_exporter.export.spec import METRICS

        gpu = get_json(self.port, "/gpus")["gpus"][0]
        unsupported = set(gpu.get("unsupported_fields", []))
        m = scrape(self.port)
        by_attribute = {a: f.field for f in FIELDS.values() for a in f.names}
        absent_ok: list[str] = []
        absent_bad: list[str] = []
        present = 0
        for spec in METRICS:
            if not spec.on_by_default or "gpu" not in spec.labels:
                continue
            # (label, value, attribute) for each series one GPU should have
            wanted = (
                [(None, None, spec.field)]
                if spec.field
                else [(spec.labels[-1], value, attribute) for value, attribute in spec.per_label]
            )
            for label, value, attribute in wanted:
                nvml_field = by_attribute.get(attribute or "")
                if nvml_field is None or nvml_field == "gpm":
                    # not a field value (leases, pods, Xids: other steps); GPM has its own
                    # checks (idle, claim): none before its second read, some metrics
                    # per card only
                    continue
                labels = {"uuid": self.uuid} | ({label: value} if label and value else {})
                shown = f"{spec.name}{_labels(labels | {'uuid': '…'})}"
                if m.series(spec.name, **labels):
                    present += 1
                elif nvml_field in unsupported:
                    absent_ok.append(f"{shown}: {nvml_field}")
                else:
                    absent_bad.append(shown)
        errors = [
            f"{lab.get('function')} {lab.get('error')}: {v:g}"
            for lab, v in m.series("gpu_exporter_nvml_errors_total")
            if v
        ]
        self.report.expect(
            "every family the card supports is present",
            not absent_bad,
            f"{present} present; absent without an unsupported field: {absent_bad or 'none'}",
        )
        self.report.add(
            "absent because NVML answered NOT_SUPPORTED/FUNCTION_NOT_FOUND",
            "info",
            "; ".join(absent_ok) or "none",
        )
        self.report.expect(
            "no NVML call failed",
            not errors,
            "; ".join(errors) or "gpu_exporter_nvml_errors_total all 0",
        )
        self.report.measurements["series"] = len(m.samples)
        self.report.measurements["metrics_bytes"] = len(m.text)

    # idle cost beside nvitop-exporter, and the Xid thread

    def idle(self) -> None:
        assert self.exporter is not None
        self.probe("idle")  # first: its NVML calls stay out of the idle window
        peer_ready = self.start_peer()
        time.sleep(3 if self.card.fake else 5)  # past both exporters' first samples
        ours = {"before": threads(self.exporter.pid)}
        peer_before = cpu_seconds(self.peer.pid) if peer_ready and self.peer else None
        started = time.monotonic()
        time.sleep(self.timing.idle_s)
        seconds = time.monotonic() - started
        ours["after"] = threads(self.exporter.pid)
        our_cpu = sum(t["cpu_s"] for t in ours["after"].values()) - sum(
            t["cpu_s"] for t in ours["before"].values()
        )
        row: dict[str, Any] = {
            "seconds": round(seconds, 1),
            "gpu-exporter_cpu_percent": round(100 * our_cpu / seconds, 3),
        }
        if peer_before is not None and self.peer is not None:
            peer_cpu = cpu_seconds(self.peer.pid) - peer_before
            row["nvitop-exporter_cpu_percent"] = round(100 * peer_cpu / seconds, 3)
            row["ratio"] = round(our_cpu / peer_cpu, 3) if peer_cpu else None
        self.report.measurements["idle"] = row
        self.report.add("idle CPU", "info", json.dumps(row))
        m = scrape(self.port)
        self.report.measurements["sample_duration_s"] = m.get(
            "gpu_exporter_sample_duration_seconds"
        )
        self.xid_thread(ours["before"], ours["after"], seconds)
        gpm_idle(self.report, m, self.uuid, self.report.measurements.get("probe_idle", {}))

    def start_peer(self) -> bool:
        check = subprocess.run(
            self.python("-c", "import nvitop_exporter"),
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
        )
        if check.returncode != 0:
            self.report.skip("nvitop-exporter", "not installed: " + check.stderr.strip()[-200:])
            return False
        self.peer_port = free_port()
        self.peer = self.start(
            "nvitop-exporter",
            self.python(
                "-m",
                "nvitop_exporter",
                "--bind-address",
                HOST,
                "--port",
                str(self.peer_port),
                "--interval",
                "1",
            ),
        )

        def ready() -> bool:
            if self.peer is None or self.peer.proc.poll() is not None:
                return False
            with contextlib.suppress(OSError, http.client.HTTPException):
                return http_get(self.peer_port, "/metrics", timeout=2)[0] == 200
            return False

        ok = bool(eventually(ready, 30))
        self.report.expect("nvitop-exporter runs beside it", ok, "" if ok else self.peer.output())
        return ok

    def xid_thread(
        self, before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]], seconds: float
    ) -> None:
        rows = []
        for tid, a in after.items():
            b = before.get(tid)
            if b is None:
                continue
            rows.append(
                {
                    "tid": tid,
                    "syscall": a["syscall"],
                    "cpu_ms": round(1000 * (a["cpu_s"] - b["cpu_s"]), 2),
                    "wakeups_per_min": round(60 * (a["switches"] - b["switches"]) / seconds, 1),
                }
            )
        self.report.measurements["threads"] = rows
        # Waiting on the driver's file: ioctl (16), poll (7) or ppoll (271); a polling loop
        # would sleep in futex (202) or clock_nanosleep (230) and wake up often.
        in_driver = [r for r in rows if r["syscall"] in ("16", "7", "271")]
        if self.card.fake:
            self.report.skip(
                "the Xid listener blocks in the driver",
                "fake library: its event wait is a condition variable, not a driver ioctl",
            )
            return
        busiest = max((r["cpu_ms"] for r in in_driver), default=None)
        self.report.expect(
            "the Xid listener blocks in the driver",
            bool(in_driver) and busiest is not None and busiest < 0.002 * seconds * 1000,
            f"threads waiting on the driver (CPU under 0.2 %): {in_driver}",
        )

    # NVML's own costs, GPM, NVLink, memory temperature (a probe process: its own NVML)

    def probe(self, when: str) -> None:
        path = self.work / f"probe-{when}.json"
        proc = self.start(f"probe-{when}", self.python(SCRIPT, "--probe", str(path)))
        try:
            proc.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.report.add(f"NVML probe ({when})", "fail", "no answer within 60 s")
            return
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            self.report.add(f"NVML probe ({when})", "fail", f"no result: {exc}")
            return
        self.report.measurements[f"probe_{when}"] = found
        gpm = found.get("gpm", {})
        self.report.add(
            f"NVML probe ({when})",
            "info",
            f"GPM {gpm.get('supported')}: {gpm.get('metrics')}; "
            f"memory temp {found.get('fields', {}).get('memory_temp_c')}; "
            f"NVLinks up {found.get('nvlink', {}).get('up')}; the exporter's NVML calls per "
            f"GPU per sample {found.get('calls', {}).get('per_gpu_per_sample')}",
        )
        calls_per_sample(self.report, when, found.get("calls", {}))

    # a plain-curl claim, released when its job arrives; the busy card refused

    def claim_arrival(self) -> None:
        status, body = http_get(self.port, "/choose?n=1&format=json")
        if not self.report.expect(
            "an idle card is chosen and leased", status == 200, body[:300].decode(errors="replace")
        ):
            return
        lease = json.loads(body)["lease"]
        arrived_before = (
            scrape(self.port).get("gpu_exporter_lease_gpus_released_total", reason="arrived") or 0
        )
        progress = self.work / "busy.progress"
        env = dict(self.env, CUDA_VISIBLE_DEVICES=self.uuid, CUDA_DEVICE_ORDER="PCI_BUS_ID")
        job = self.start("job-busy", self.job_command("busy", progress), env)
        started = self.wait_phase(job, progress, "busy", 90)
        if started is None:
            return
        self.card.job(started["pid"], started.get("bytes", 2 * GiB), busy=True)

        def released() -> bool:
            leases = get_json(self.port, "/leases")["leases"]
            return not any(x["id"] == lease["id"] for x in leases)

        t0 = time.monotonic()
        ok = eventually(released, 10)
        arrived = (
            scrape(self.port).get("gpu_exporter_lease_gpus_released_total", reason="arrived") or 0
        )
        self.report.expect(
            "the claim ends when its job's process arrives",
            ok and arrived == arrived_before + 1,
            f"after {time.monotonic() - t0:.1f} s; "
            f"released{{reason=arrived}} {arrived_before:g} → {arrived:g}",
        )
        pid = str(started["pid"])
        seen = eventually(
            lambda: scrape(self.port).series("gpu_process_memory_used_bytes", pid=pid), 8
        )
        self.report.expect(
            "the job's PID in the process metrics",
            bool(seen),
            f"{seen[0] if seen else 'absent'}",
        )
        busy = eventually(
            lambda: (scrape(self.port).get("gpu_utilization_ratio", uuid=self.uuid) or 0) > 0.5, 8
        )
        status, body = http_get(self.port, "/choose?n=1&lease=0")
        text = body.decode(errors="replace").strip()
        self.report.expect(
            "/choose refuses the busy card under the default 'free'",
            bool(busy) and status == 503 and "utilization" in text,
            f"{status}: {text[:300]}",
        )
        self.process_utilization(pid, bool(seen))
        self.probe("busy")  # GPM activity while the matmuls run
        self.gpm_busy()  # within the job's busy seconds: what the run waited for anyway
        done = self.wait_phase(job, progress, "done", self.timing.busy_s + 60)
        if done is not None:
            self.report.add(
                "the job's matmuls",
                "info",
                json.dumps({k: v for k, v in done.items() if k != "phase"}),
            )
        job.proc.wait(30)
        self.card.job_ended()

    def process_utilization(self, pid: str, listed: bool) -> None:
        """The busy job's PID in gpu_process_sm_utilization_ratio, high (its matmuls)."""
        name = "the job's PID in gpu_process_sm_utilization_ratio, high"
        if not listed:
            self.report.skip(name, "the job's PID is not in the process metrics (above)")
            return
        last: dict[str, float | None] = {}

        def high() -> bool:
            m = scrape(self.port)
            last["sm"] = m.get("gpu_process_sm_utilization_ratio", pid=pid)
            last["memory"] = m.get("gpu_process_memory_utilization_ratio", pid=pid)
            return (last["sm"] or 0) > BUSY_RATIO

        t0 = time.monotonic()
        ok = bool(eventually(high, 8))
        self.report.expect(
            name,
            ok,
            f"pid {pid}: gpu_process_sm_utilization_ratio {last['sm']} (over {BUSY_RATIO}), "
            f"gpu_process_memory_utilization_ratio {last['memory']}; "
            f"after {time.monotonic() - t0:.1f} s",
        )

    def gpm_busy(self) -> None:
        """GPM's SM and tensor activity high while the bf16 matmuls run, and near the probe's
        own GPM reading of the same work."""
        name = "GPM while the matmuls run: SM and tensor activity high"
        probes = self.report.measurements
        supported = gpm_supported(probes.get("probe_busy") or probes.get("probe_idle") or {})
        if not supported:
            why = "no GPM on this card" if supported is False else "the probe could not say"
            self.report.skip(name, f"{why} (the probe: {probe_gpm_text(probes)})")
            return
        last: dict[str, float | None] = {}

        def high() -> bool:
            m = scrape(self.port)
            last.update(
                sm=m.get("gpu_sm_active_ratio", uuid=self.uuid),
                tensor=m.get("gpu_tensor_active_ratio", uuid=self.uuid),
            )
            found = gpm_series(m, self.uuid)
            self.report.measurements["gpm_busy"] = found
            return all((v or 0) > BUSY_RATIO for v in (last["sm"], last["tensor"]))

        t0 = time.monotonic()  # a whole --gpm-interval inside the matmuls, and the next sample
        ok = bool(eventually(high, 2 * self.timing.gpm_interval_s + 2))
        self.report.expect(
            name,
            ok,
            f"gpu_sm_active_ratio {last.get('sm')}, gpu_tensor_active_ratio "
            f"{last.get('tensor')} (over {BUSY_RATIO}) after {time.monotonic() - t0:.1f} s, "
            f"--gpm-interval {self.timing.gpm_interval_s:g}",
        )
        theirs = (probes.get("probe_busy") or {}).get("gpm", {}).get("metrics", {})
        pairs = {"sm": theirs.get("sm_activity"), "tensor": theirs.get("any_tensor")}
        agree = "GPM agrees with the probe's own reading during the matmuls"
        if not all(isinstance(v, int | float) for v in pairs.values()):
            self.report.skip(agree, f"the probe has no such reading: {theirs or 'none'}")
            return
        self.report.expect(
            agree,
            all(_near(last.get(k), v / 100, GPM_AGREEMENT) for k, v in pairs.items()),
            f"SM ours {last.get('sm')}, the probe's {pairs['sm']} %; tensor ours "
            f"{last.get('tensor')}, the probe's {pairs['tensor']} %; within {GPM_AGREEMENT} "
            "(its 1 s window against ours)",
        )

    # a memory lease under `gpu-exporter run`: the torch cap, attribution, an overrun

    def memory_lease(self) -> None:
        progress = self.work / "share.progress"
        env = dict(self.env, GPU_EXPORTER_URL=f"http://{HOST}:{self.port}")
        run = self.run_share("run-share", "share", progress, env)
        capped = self.wait_phase(run, progress, "capped", 120)
        if capped is None:
            return
        self.report.add("the job's environment", "info", json.dumps(capped.get("env", {})))
        if capped.get("cap") == "skipped":
            self.report.skip("PyTorch's cap, as seen from inside torch", capped.get("why", ""))
        else:
            self.report.expect(
                "PyTorch's cap, as seen from inside torch",
                bool(capped.get("oom_past_cap"))
                and abs(
                    (capped.get("fraction_seen") or capped["fraction_env"]) - capped["fraction_env"]
                )
                < 1e-6,
                json.dumps(
                    {
                        k: capped.get(k)
                        for k in ("fraction_env", "fraction_seen", "oom_past_cap", "cap_bytes")
                    }
                ),
            )
        busy = self.wait_phase(run, progress, "busy", 60)
        if busy is None:
            return
        self.card.job(busy["pid"], busy.get("bytes", 4 * GiB), busy=True)
        pid = busy["pid"]

        def attributed() -> dict[str, Any] | None:
            for lease in get_json(self.port, "/leases")["leases"]:
                for card in lease.get("memory", []):
                    if pid in card.get("pids", []):
                        return lease
            return None

        lease = eventually(attributed, 10)
        self.report.expect(
            "the memory lease holds 8 GiB and names the job's PID",
            bool(lease) and lease.get("mem_bytes") == 8 * GiB,
            json.dumps(lease)[:400] if lease else json.dumps(get_json(self.port, "/leases"))[:400],
        )
        leased = scrape(self.port).get("gpu_memory_leased_bytes", uuid=self.uuid)
        self.report.expect("gpu_memory_leased_bytes is the share", leased == 8 * GiB, f"{leased}")
        over = self.wait_phase(run, progress, "overrun", self.timing.busy_s + 60)
        if over is None:
            return
        self.card.job(over["pid"], over.get("bytes", 12 * GiB), busy=True)
        overrun = eventually(
            lambda: scrape(self.port).get("gpu_lease_memory_overrun_bytes", uuid=self.uuid) or 0,
            self.timing.overrun_s,
        )
        self.report.expect(
            "the overrun metric shows memory past the share",
            overrun > 0,
            f"gpu_lease_memory_overrun_bytes {overrun:g} "
            f"(the job holds {over.get('bytes', 0) / GiB:.1f} GiB)",
        )
        self.wait_phase(run, progress, "done", 60)
        status = run.proc.wait(60)
        self.card.job_ended()
        left = get_json(self.port, "/leases")["leases"]
        self.report.expect(
            "run exits with the job's status and releases the lease",
            status == 0 and not left,
            f"exit {status}; leases left {len(left)}",
        )

    def jax(self) -> None:
        progress = self.work / "jax.progress"
        env = dict(self.env, GPU_EXPORTER_URL=f"http://{HOST}:{self.port}")
        # A user's own newer-name fraction: beside the one `run` sets, JAX would refuse the GPU.
        env["XLA_CLIENT_MEM_FRACTION"] = "0.5"
        run = self.run_share("run-jax", "jax", progress, env)
        done = self.wait_phase(run, progress, "done", 120)
        run.proc.wait(30)
        if done is None:
            return
        if done.get("cap") == "skipped":
            self.report.skip("JAX's cap (XLA_PYTHON_CLIENT_MEM_FRACTION)", done.get("why", ""))
            return
        self.report.expect(
            "JAX's cap (XLA_PYTHON_CLIENT_MEM_FRACTION), on the GPU",
            self.jax_capped(done),
            json.dumps({k: v for k, v in done.items() if k != "phase"}),
        )
        self.jax_names()

    def jax_capped(self, done: dict[str, Any]) -> bool:
        limit, expected = done.get("bytes_limit"), done.get("expected_bytes")
        near = bool(limit and expected and abs(limit - expected) <= 0.02 * self.total_bytes)
        return near and done.get("backend") == "gpu"

    def jax_names(self) -> None:
        """Which of JAX's two names for the fraction this JAX honours, alone and together."""
        found = {}
        for names in (
            ("XLA_PYTHON_CLIENT_MEM_FRACTION",),
            ("XLA_CLIENT_MEM_FRACTION",),
            ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"),
        ):
            progress = self.work / f"jax-{len(found)}.progress"
            env = {k: v for k, v in self.env.items() if not k.startswith("XLA_")}
            env |= dict.fromkeys(names, "0.2") | {"CUDA_VISIBLE_DEVICES": self.uuid}
            job = self.start(f"jax-names-{len(found)}", self.job_command("jax", progress), env)
            job.proc.wait(90)
            lines = progress.read_text().splitlines() if progress.exists() else []
            last = json.loads(lines[-1]) if lines else {}
            found[" + ".join(names)] = {
                "capped_on_gpu": self.jax_capped(last),
                "backend": last.get("backend"),
                "bytes_limit": last.get("bytes_limit"),
            }
        self.report.measurements["jax_fraction_names"] = found
        self.report.add("JAX's fraction variables, alone and together", "info", json.dumps(found))

    def run_share(self, name: str, kind: str, progress: Path, env: dict[str, str]) -> Proc:
        """``gpu-exporter run -n 1 --mem 8GiB -- <the job>``: a memory lease for its life."""
        # The one card may still read busy from the job before: a share takes a busy card
        # only when it says so (the utilization default applies to --mem).
        command = ["-m", "gpu_exporter", "run", "-n", "1", "--mem", "8GiB", "--max-util", "100%"]
        return self.start(name, self.python(*command, "--", *self.job_command(kind, progress)), env)

    def job_command(self, kind: str, progress: Path) -> list[str]:
        job = f"fake-{kind}" if self.card.fake else kind
        return self.python(
            SCRIPT,
            "--job",
            job,
            "--progress",
            str(progress),
            "--busy-seconds",
            str(self.timing.busy_s),
            "--overrun-seconds",
            str(self.timing.overrun_s),
        )

    def wait_phase(
        self, proc: Proc, progress: Path, phase: str, seconds: float
    ) -> dict[str, Any] | None:
        deadline = time.monotonic() + min(seconds, max(self.left(), 5))
        while time.monotonic() < deadline:
            for line in progress.read_text().splitlines() if progress.exists() else []:
                entry = json.loads(line)
                if entry["phase"] == phase:
                    return dict(entry)
                if entry["phase"] == "error":
                    self.report.add(f"job reached '{phase}'", "fail", entry.get("error", ""))
                    return None
            if proc.proc.poll() is not None and not progress.exists():
                break
            time.sleep(0.2)
        self.report.add(
            f"job reached '{phase}'", "fail", f"not within {seconds:g} s: {proc.output(1500)}"
        )
        return None

    # latency

    def latency(self) -> None:
        rows = {"gpu-exporter": sequential(self.port, self.timing.scrapes)}
        if self.peer is not None and self.peer.proc.poll() is None:
            rows["nvitop-exporter"] = sequential(self.peer_port, self.timing.scrapes)
        self.report.measurements["metrics_latency_ms"] = rows
        self.report.add("/metrics latency", "info", json.dumps(rows))

    # shutdown

    def shutdown(self) -> None:
        for proc in self.procs:
            if proc.proc.poll() is None:
                status, seconds = proc.stop()
                if proc is self.exporter:
                    self.report.expect(
                        "gpu-exporter stops on SIGTERM",
                        status == 0 and seconds < 5,
                        f"exit {status} after {seconds:.1f} s",
                    )
            else:
                proc.stop()
        alive = [p.name for p in self.procs if _session_alive(p.pid)]
        self.report.expect("no process left running", not alive, ", ".join(alive) or "none")

    def all(self) -> int:
        steps: list[tuple[str, Callable[[], None], float]] = [
            ("install", self.install, 0),
            ("serve", self.serve, 0),
            ("values", self.values, 0),
            ("families", self.families, 0),
            ("idle", self.idle, self.timing.idle_s + 20),
            ("claim", self.claim_arrival, self.timing.busy_s + 30),
            ("memory lease", self.memory_lease, self.timing.busy_s + 40),
            ("jax", self.jax, 40),
            ("latency", self.latency, 10),
        ]
        try:
            for name, body, needs in steps:
                self.step(name, body, needs)
                if name == "serve" and self.report.failed:
                    break  # nothing else can be checked without a running exporter
        finally:
            self.report.step = "shutdown"
            self.shutdown()
            self.report.write()
        failed = self.report.failed
        _log(f"{len(failed)} failed; report in {self.out}")
        return 1 if failed else 0


# GPM and per-process utilization: an idle card's activity at most IDLE_RATIO, a card or
# process running bf16 matmuls over BUSY_RATIO (a real H100: SM 96 %, tensor 93 %, the
# process's SM 88-91 %); the exporter's GPM reading within GPM_AGREEMENT of the probe's.
IDLE_RATIO = 0.05
BUSY_RATIO = 0.5
GPM_AGREEMENT = 0.15
# The exporter's NVML calls per GPU and sample (issue 31): at most half of nvitop-exporter's
# (16 idle; with a process, one more call: the processes' utilization).
CALLS_PER_GPU_PER_SAMPLE = 8.0


def _near(ours: float | None, theirs: float, within: float) -> bool:
    return ours is not None and abs(ours - theirs) <= within


def gpm_supported(probe: dict[str, Any]) -> bool | None:
    """Whether the probe found GPM on the card: None where it could not say."""
    supported = probe.get("gpm", {}).get("supported")
    return supported if isinstance(supported, bool) else None


def probe_gpm_text(measurements: dict[str, Any]) -> str:
    return json.dumps(
        {k: measurements[k].get("gpm") for k in ("probe_idle", "probe_busy") if k in measurements}
    )[:300]


def gpm_series(m: Scrape, uuid: str) -> dict[str, float]:
    """The GPM series of one GPU in a scrape: name{label} → value."""
    from gpu_exporter.export.spec import GPM_VALUES

    out = {}
    for spec in GPM_VALUES:
        for labels, value in m.series(spec.name, uuid=uuid):
            which = {k: v for k, v in labels.items() if k in ("pipe", "precision", "direction")}
            out[spec.name + _labels(which)] = value
    return out


def gpm_idle(report: Report, m: Scrape, uuid: str, probe: dict[str, Any]) -> None:
    """After the idle window: on a card with GPM, SM and tensor activity present and near 0;
    on one without, no GPM series and ``gpu_exporter_field_supported{field="gpm"} 0``."""
    supported = gpm_supported(probe)
    marker = m.get("gpu_exporter_field_supported", uuid=uuid, field="gpm")
    found = gpm_series(m, uuid)
    shown = f'gpu_exporter_field_supported{{field="gpm"}} {"absent" if marker is None else marker}'
    if supported is None:
        report.skip(
            "GPM at idle",
            f"the probe could not say whether the card has GPM: {probe.get('gpm')}; {shown}",
        )
        return
    if not supported:
        report.expect(
            "no GPM series where the card has none, and its marker",
            not found and marker == 0,
            f"the probe: GPM not supported; {shown}; GPM series: {found or 'none'}",
        )
        return
    sm, tensor = (
        m.get("gpu_sm_active_ratio", uuid=uuid),
        m.get("gpu_tensor_active_ratio", uuid=uuid),
    )
    theirs = probe.get("gpm", {}).get("metrics", {})
    report.expect(
        "GPM at idle: SM and tensor activity present, near 0",
        marker is None
        and sm is not None
        and tensor is not None
        and sm <= IDLE_RATIO
        and tensor <= IDLE_RATIO,
        f"gpu_sm_active_ratio {sm}, gpu_tensor_active_ratio {tensor} (at most {IDLE_RATIO}); "
        f"the probe's own reading before the window: SM {theirs.get('sm_activity')} %, tensor "
        f"{theirs.get('any_tensor')} %; {shown}",
    )
    report.add("GPM series at idle", "info", json.dumps(found))


def calls_per_sample(report: Report, when: str, calls: dict[str, Any]) -> None:
    """The exporter's own NVML calls per GPU and sample on this driver (the probe's count):
    field values batched (issue 31), at most half of nvitop-exporter's."""
    name = f"the exporter's NVML calls per GPU per sample ({when})"
    if "error" in calls or "per_gpu_per_sample" not in calls:
        report.add(name, "fail", f"the probe could not count them: {calls.get('error')}")
        return
    limit = CALLS_PER_GPU_PER_SAMPLE + (when == "busy")  # the job's process: one more call
    per, by = calls["per_gpu_per_sample"], calls.get("by_function", {})
    batched = by.get("nvmlDeviceGetFieldValues", 0)
    report.expect(
        name,
        per <= limit and batched > 0,
        f"{per} (at most {limit:g}), nvmlDeviceGetFieldValues {batched} of them; {json.dumps(by)}",
    )


def _session_alive(sid: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # session id; not a zombie
                return True
    return False


def sequential(port: int, n: int) -> dict[str, Any]:
    conn = http.client.HTTPConnection(HOST, port, timeout=10)
    times = []
    size = 0
    try:
        for i in range(n + 10):
            started = time.perf_counter()
            conn.request("GET", "/metrics", headers=PROMETHEUS_HEADERS)
            resp = conn.getresponse()
            size = len(resp.read())
            if i >= 10 and resp.status == 200:
                times.append((time.perf_counter() - started) * 1000)
            if resp.getheader("Connection", "").lower() == "close":
                conn.close()
    finally:
        conn.close()
    times.sort()
    return {
        "requests": len(times),
        "p50": round(statistics.median(times), 3) if times else None,
        "p99": round(times[int(0.99 * (len(times) - 1))], 3) if times else None,
        "gzip_bytes": size,
    }


# -- nvidia-smi --------------------------------------------------------------------------------


def smi_fields(smi: str, env: dict[str, str]) -> set[str]:
    """The field names this nvidia-smi accepts (an unknown one fails the whole query)."""
    result = subprocess.run(
        [smi, "--help-query-gpu"], capture_output=True, text=True, env=env, timeout=60
    )
    names = set()
    for line in result.stdout.splitlines():
        line = line.strip()
        if line.startswith('"'):
            names.update(part.strip().strip('"') for part in line.split(" or "))
    return names


def smi_query(smi: str, env: dict[str, str], names: list[str]) -> dict[str, str]:
    result = subprocess.run(
        [smi, "--query-gpu=" + ",".join(names), "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    if result.returncode != 0:
        raise RuntimeError(f"nvidia-smi failed: {result.stderr or result.stdout}")
    row = next(csv.reader(io.StringIO(result.stdout), skipinitialspace=True))
    return dict(zip(names, (v.strip() for v in row), strict=True))


NOT_AVAILABLE = ("[N/A]", "N/A", "[Not Supported]", "Not Supported", "[Unknown Error]", "")


def _number(text: str) -> float:
    words = {"enabled": 1, "disabled": 0, "active": 1, "not active": 0, "yes": 1, "no": 0}
    lowered = text.strip().lower()
    if lowered in words:
        return float(words[lowered])
    if lowered.startswith("p") and lowered[1:].isdigit():
        return float(lowered[1:])  # P-state
    return float(text)


@dataclass(frozen=True)
class Comparison:
    """One nvidia-smi field against one series: ``scale`` turns nvidia-smi's unit into the
    metric's; equal within ``absolute`` or ``relative`` (of the larger), against the scrape
    just before or just after nvidia-smi's answer (the exporter samples once a second)."""

    smi: str
    metric: str
    labels: dict[str, str] = field(default_factory=dict)
    scale: float = 1.0
    absolute: float = 0.0
    relative: float = 0.0
    nvml_field: str = ""  # the exporter's field name, where NVML may not support it
    why: str = ""  # the tolerance's reason, for the report
    # nvidia-smi's [N/A]: skipped (nothing to compare), not "ours must be absent too"
    skip_unavailable: bool = False

    def check(
        self, report: Report, text: str, before: Scrape, after: Scrape, unsupported: set[str]
    ) -> None:
        name = f"{self.smi} vs {self.metric}{_labels(self.labels)}"
        ours = [s.get(self.metric, **self.labels) for s in (before, after)]
        ours_present = [v for v in ours if v is not None]
        if text in NOT_AVAILABLE and self.skip_unavailable:
            report.skip(
                name,
                f"nvidia-smi {text or 'empty'}: nothing to compare; "
                f"ours {'/'.join(f'{v:g}' for v in ours_present) or 'absent'}",
            )
            return
        if text in NOT_AVAILABLE:
            report.expect(
                name,
                not ours_present,
                f"nvidia-smi {text or 'empty'}; ours {ours_present or 'absent'}",
            )
            return
        try:
            theirs = _number(text) * self.scale
        except ValueError:
            report.add(name, "info", f"nvidia-smi {text!r} is not a number")
            return
        if not ours_present:
            why = f" ({self.nvml_field} unsupported)" if self.nvml_field in unsupported else ""
            report.expect(name, False, f"nvidia-smi {text}; ours absent{why}")
            return
        tolerance = max(self.absolute, self.relative * max(abs(theirs), *map(abs, ours_present)))
        ok = any(abs(v - theirs) <= tolerance for v in ours_present)
        report.expect(
            name,
            ok,
            f"nvidia-smi {theirs:g}, ours {'/'.join(f'{v:g}' for v in ours_present)}, "
            f"within {tolerance:g}{' (' + self.why + ')' if self.why else ''}",
        )


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""


_IDLE_CLOCKS = "clocks move between samples while idle"
UNCOMPARED = (
    "power.draw.average",
    "power.draw.instant",
    "clocks_event_reasons.gpu_idle",
    "pcie.link.gen.gpucurrent",
    "pcie.link.gen.gpumax",
    "pcie.link.gen.hostmax",
    "utilization.encoder",
    "utilization.decoder",
    "compute_cap",
    "vbios_version",
)
COMPARISONS: tuple[Comparison, ...] = (
    Comparison("memory.total", "gpu_memory_total_bytes", scale=MiB, absolute=MiB),
    Comparison("memory.reserved", "gpu_memory_reserved_bytes", scale=MiB, absolute=MiB),
    Comparison(
        "memory.used",
        "gpu_memory_used_bytes",
        scale=MiB,
        absolute=32 * MiB,
        why="MiB rounding, a context starting",
    ),
    Comparison("memory.free", "gpu_memory_free_bytes", scale=MiB, absolute=32 * MiB),
    Comparison(
        "utilization.gpu",
        "gpu_utilization_ratio",
        scale=0.01,
        absolute=0.1,
        why="different sample windows",
    ),
    Comparison("utilization.memory", "gpu_memory_utilization_ratio", scale=0.01, absolute=0.1),
    Comparison("temperature.gpu", "gpu_temperature_celsius", absolute=2),
    Comparison(  # NVML_FI_DEV_MEMORY_TEMP, in the exporter's field-value batch
        "temperature.memory",
        "gpu_memory_temperature_celsius",
        absolute=2,
        nvml_field="memory_temperature",
        skip_unavailable=True,
    ),
    Comparison(
        "power.draw",
        "gpu_power_draw_watts",
        absolute=10,
        relative=0.1,
        why="power moves within a second",
    ),
    Comparison("enforced.power.limit", "gpu_power_limit_watts", absolute=0.5),
    Comparison("power.default_limit", "gpu_power_limit_default_watts", absolute=0.5),
    Comparison(
        "clocks.sm", "gpu_clock_hz", {"clock": "sm"}, scale=1e6, relative=0.3, why=_IDLE_CLOCKS
    ),
    Comparison(
        "clocks.gr",
        "gpu_clock_hz",
        {"clock": "graphics"},
        scale=1e6,
        relative=0.3,
        why=_IDLE_CLOCKS,
    ),
    Comparison("clocks.mem", "gpu_clock_hz", {"clock": "memory"}, scale=1e6, absolute=1e6),
    Comparison(
        "clocks.video",
        "gpu_clock_hz",
        {"clock": "video"},
        scale=1e6,
        relative=0.3,
        why=_IDLE_CLOCKS,
    ),
    Comparison("clocks.max.sm", "gpu_clock_max_hz", {"clock": "sm"}, scale=1e6, absolute=1e6),
    Comparison("clocks.max.gr", "gpu_clock_max_hz", {"clock": "graphics"}, scale=1e6, absolute=1e6),
    Comparison("clocks.max.mem", "gpu_clock_max_hz", {"clock": "memory"}, scale=1e6, absolute=1e6),
    Comparison("pstate", "gpu_performance_state", absolute=0, why="read every --slow-interval"),
    Comparison(
        "fan.speed", "gpu_fan_speed_ratio", scale=0.01, absolute=0.02, nvml_field="fan_speed"
    ),
    Comparison("persistence_mode", "gpu_persistence_mode_enabled"),
    Comparison("ecc.mode.current", "gpu_ecc_mode_enabled", nvml_field="ecc_mode"),
    Comparison(
        "ecc.errors.corrected.volatile.total",
        "gpu_ecc_errors_total",
        {"error": "corrected", "counter": "volatile"},
    ),
    Comparison(
        "ecc.errors.uncorrected.volatile.total",
        "gpu_ecc_errors_total",
        {"error": "uncorrected", "counter": "volatile"},
    ),
    Comparison(
        "ecc.errors.corrected.aggregate.total",
        "gpu_ecc_errors_total",
        {"error": "corrected", "counter": "aggregate"},
    ),
    Comparison(
        "ecc.errors.uncorrected.aggregate.total",
        "gpu_ecc_errors_total",
        {"error": "uncorrected", "counter": "aggregate"},
    ),
    Comparison(
        "remapped_rows.correctable",
        "gpu_remapped_rows_total",
        {"cause": "correctable"},
        nvml_field="remapped_rows",
    ),
    Comparison(
        "remapped_rows.uncorrectable",
        "gpu_remapped_rows_total",
        {"cause": "uncorrectable"},
        nvml_field="remapped_rows",
    ),
    Comparison("remapped_rows.pending", "gpu_remapped_rows_pending", nvml_field="remapped_rows"),
    Comparison("remapped_rows.failure", "gpu_remapped_rows_failed", nvml_field="remapped_rows"),
    Comparison("retired_pages.sbe", "gpu_retired_pages_total", {"cause": "multiple_single_bit"}),
    Comparison("retired_pages.dbe", "gpu_retired_pages_total", {"cause": "double_bit"}),
    Comparison(
        "pcie.link.gen.current",
        "gpu_pcie_link_generation",
        {"link": "current"},
        why="read every --slow-interval",
    ),
    Comparison("pcie.link.gen.max", "gpu_pcie_link_generation", {"link": "max"}),
    Comparison("pcie.link.width.current", "gpu_pcie_link_width", {"link": "current"}),
    Comparison("pcie.link.width.max", "gpu_pcie_link_width", {"link": "max"}),
    Comparison("mig.mode.current", "gpu_mig_mode_enabled", nvml_field="mig_mode"),
    *(
        Comparison(f"clocks_event_reasons.{smi}", "gpu_clocks_event_reasons", {"reason": ours})
        for smi, ours in (
            ("sw_power_cap", "sw_power_cap"),
            ("hw_slowdown", "hw_slowdown"),
            ("hw_thermal_slowdown", "hw_thermal_slowdown"),
            ("hw_power_brake_slowdown", "hw_power_brake"),
            ("sw_thermal_slowdown", "sw_thermal_slowdown"),
            ("sync_boost", "sync_boost"),
            ("applications_clocks_setting", "applications_clocks_setting"),
        )
    ),
)


@dataclass(frozen=True)
class Identity(Comparison):
    """A text field of nvidia-smi against a label of ``gpu_info``."""

    def check(
        self, report: Report, text: str, before: Scrape, after: Scrape, unsupported: set[str]
    ) -> None:
        info = [lab for lab, _ in after.series("gpu_info")]
        ours = info[0].get(self.metric) if info else None
        same = ours is not None and ours.lower().lstrip("0:") == text.lower().lstrip("0:")
        if self.smi == "pci.bus_id" and ours is not None:  # 00000000:19:00.0 vs 0000:19:00.0
            same = ours.lower().split(":", 1)[-1] == text.lower().split(":", 1)[-1]
        report.expect(
            f"{self.smi} vs gpu_info{{{self.metric}}}", same, f"nvidia-smi {text!r}, ours {ours!r}"
        )


IDENTITY = (
    Identity("name", "name"),
    Identity("uuid", "uuid"),
    Identity("pci.bus_id", "pci_bus_id"),
    Identity("driver_version", "driver_version"),
)


# -- the probe: NVML's own costs, GPM, NVLink, memory temperature ------------------------------


def probe(path: Path) -> int:
    """Run in its own process (its own NVML): what one call costs on this driver, and what
    the card offers beyond today's metrics. Writes JSON to ``path``."""
    import pynvml as n

    found: dict[str, Any] = {}
    n.nvmlInit()
    try:
        h = n.nvmlDeviceGetHandleByIndex(0)
        calls: dict[str, Callable[[], Any]] = {
            "nvmlDeviceGetHandleByIndex": lambda: n.nvmlDeviceGetHandleByIndex(0),
            "nvmlDeviceGetMemoryInfo_v2": lambda: n.nvmlDeviceGetMemoryInfo(
                h, version=n.nvmlMemory_v2
            ),
            "nvmlDeviceGetUtilizationRates": lambda: n.nvmlDeviceGetUtilizationRates(h),
            "nvmlDeviceGetTemperature": lambda: n.nvmlDeviceGetTemperature(
                h, n.NVML_TEMPERATURE_GPU
            ),
            "nvmlDeviceGetPowerUsage": lambda: n.nvmlDeviceGetPowerUsage(h),
            "nvmlDeviceGetTotalEnergyConsumption": lambda: n.nvmlDeviceGetTotalEnergyConsumption(h),
            "nvmlDeviceGetClockInfo": lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
            "nvmlDeviceGetCurrentClocksEventReasons": lambda: (
                n.nvmlDeviceGetCurrentClocksEventReasons(h)
            ),
            "nvmlDeviceGetComputeRunningProcesses": lambda: n.nvmlDeviceGetComputeRunningProcesses(
                h
            ),
            "nvmlDeviceGetEncoderUtilization": lambda: n.nvmlDeviceGetEncoderUtilization(h),
            "nvmlDeviceGetPerformanceState": lambda: n.nvmlDeviceGetPerformanceState(h),
            "nvmlDeviceGetTotalEccErrors": lambda: n.nvmlDeviceGetTotalEccErrors(
                h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC
            ),
            "nvmlDeviceGetRemappedRows": lambda: n.nvmlDeviceGetRemappedRows(h),
            "nvmlDeviceGetPcieReplayCounter": lambda: n.nvmlDeviceGetPcieReplayCounter(h),
            "nvmlDeviceGetFieldValues(1 field)": lambda: n.nvmlDeviceGetFieldValues(
                h, [n.NVML_FI_DEV_POWER_INSTANT]
            ),
            "nvmlDeviceGetFieldValues(8 fields)": lambda: n.nvmlDeviceGetFieldValues(
                h, list(batch_fields(n).values())
            ),
        }
        costs = {}
        for name, call in calls.items():
            costs[name] = _cost(call)
        found["call_us"] = costs
        found["fields"] = _field_values(n, h)
        found["calls"] = _calls_per_sample()
        found["nvlink"] = _nvlink(n, h)
        found["gpm"] = _gpm(n, h)
        found["process_utilization"] = _process_utilization(n, h)
    finally:
        n.nvmlShutdown()
        path.write_text(json.dumps(found, default=str))
    return 0


def _calls_per_sample(fast_samples: int = 29) -> dict[str, Any]:
    """The exporter's NVML calls per GPU and sample on this driver (issue 31): its own reads
    (``read_gpu``, the default groups) over one --slow-interval — a first sample that reads
    everything, then ``fast_samples`` fast ones and a slow one — counted by its NVML wrapper;
    the first sample's one-off identity and static reads are left out."""
    try:
        from gpu_exporter.collect.read import read_gpu
        from gpu_exporter.nvml import Nvml
    except ImportError as exc:
        return {"error": f"the exporter is not importable here: {exc}"}
    nvml = Nvml(count_calls=True)
    try:
        nvml.init()
        gpus = nvml.device_count()
        identities: dict[int, Any] = {}
        unsupported: set[tuple[str, str]] = set()

        def sample(slow: bool) -> None:
            for g in range(gpus):
                identities[g] = read_gpu(nvml, g, identities.get(g), unsupported, slow_due=slow)[1]

        sample(True)
        assert nvml.calls is not None
        nvml.calls.clear()
        for i in range(fast_samples + 1):
            sample(i == fast_samples)
        made = dict(nvml.calls)
    except Exception as exc:
        return {"error": str(exc)}
    finally:
        nvml.shutdown()
    per = (fast_samples + 1) * max(gpus, 1)
    return {
        "gpus": gpus,
        "samples": fast_samples + 1,
        "per_gpu_per_sample": round(sum(made.values()) / per, 2),
        "by_function": {f: round(n / per, 3) for f, n in sorted(made.items())},
    }


def batch_fields(n: Any) -> dict[str, int]:
    """The field values the probe reads in one call: name → NVML field id."""
    return {
        "power_instant_mw": n.NVML_FI_DEV_POWER_INSTANT,
        "energy_mj": n.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION,
        "memory_temp_c": n.NVML_FI_DEV_MEMORY_TEMP,
        "pcie_replay": n.NVML_FI_DEV_PCIE_REPLAY_COUNTER,
        "ecc_current": n.NVML_FI_DEV_ECC_CURRENT,
        "ecc_sbe_volatile": n.NVML_FI_DEV_ECC_SBE_VOL_TOTAL,
        "ecc_dbe_volatile": n.NVML_FI_DEV_ECC_DBE_VOL_TOTAL,
        "nvlink_count": n.NVML_FI_DEV_NVLINK_LINK_COUNT,
    }


def _cost(call: Callable[[], Any], n: int = 100, budget_s: float = 1.0) -> dict[str, Any]:
    times = []
    error = None
    deadline = time.perf_counter() + budget_s
    for _ in range(n):
        started = time.perf_counter()
        try:
            call()
        except Exception as exc:
            error = str(exc)
            break
        times.append((time.perf_counter() - started) * 1e6)
        if time.perf_counter() > deadline:
            break
    times.sort()
    if not times:
        return {"error": error}
    return {
        "median": round(statistics.median(times), 1),
        "p90": round(times[int(0.9 * (len(times) - 1))], 1),
        "n": len(times),
    }


def _field_values(n: Any, h: Any) -> dict[str, Any]:
    fields = batch_fields(n)
    out: dict[str, Any] = {}
    try:
        values = n.nvmlDeviceGetFieldValues(h, list(fields.values()))
    except Exception as exc:
        return {"error": str(exc)}
    for name, v in zip(fields, values, strict=True):
        if v.nvmlReturn != 0:
            out[name] = f"error {v.nvmlReturn}"
            continue
        out[name] = getattr(v.value, _VALUE_TYPES.get(v.valueType, "ullVal"))
    return out


# nvmlValueType_t → the union member of nvmlValue_t that holds it
_VALUE_TYPES = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def _nvlink(n: Any, h: Any) -> dict[str, Any]:
    up, states = 0, {}
    for link in range(getattr(n, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            state = n.nvmlDeviceGetNvLinkState(h, link)
        except Exception as exc:
            states[link] = str(exc)
            continue
        states[link] = state
        up += state == 1
    return {"up": up, "states": states}


GPM_METRICS = {
    "sm_activity": 2,
    "sm_occupancy": 3,
    "graphics_activity": 1,
    "any_tensor": 5,
    "hmma_tensor": 7,
    "dram_bandwidth": 10,
    "fp64": 11,
    "fp32": 12,
    "fp16": 13,
    "pcie_tx_mib_s": 20,
    "pcie_rx_mib_s": 21,
}
# What the self-test's fake H100 answers for them while its job runs (percent, MiB/s): the
# real H100's readings during bf16 matmuls (docs/real-gpu.md); at idle, 0.
FAKE_GPM_BUSY = {
    "sm_activity": 96,
    "sm_occupancy": 14,
    "graphics_activity": 97,
    "any_tensor": 93,
    "hmma_tensor": 93,
    "dram_bandwidth": 25,
    "fp32": 2,
    "pcie_tx_mib_s": 40,
    "pcie_rx_mib_s": 60,
}


def _gpm(n: Any, h: Any, interval_s: float = 1.0) -> dict[str, Any]:
    try:
        supported = bool(n.nvmlGpmQueryDeviceSupport(h).isSupportedDevice)
    except Exception as exc:
        return {"supported": f"error: {exc}"}
    if not supported:
        return {"supported": False}
    out: dict[str, Any] = {"supported": True}
    samples = []
    try:
        samples = [n.nvmlGpmSampleAlloc(), n.nvmlGpmSampleAlloc()]
        t0 = time.perf_counter()
        n.nvmlGpmSampleGet(h, samples[0])
        out["sample_get_us"] = round((time.perf_counter() - t0) * 1e6, 1)
        time.sleep(interval_s)
        n.nvmlGpmSampleGet(h, samples[1])
        request = n.c_nvmlGpmMetricsGet_t()
        request.version = n.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1, request.sample2 = samples
        for i, metric in enumerate(GPM_METRICS.values()):
            request.metrics[i].metricId = metric
        t0 = time.perf_counter()
        n.nvmlGpmMetricsGet(request)
        out["metrics_get_us"] = round((time.perf_counter() - t0) * 1e6, 1)
        out["metrics"] = {
            name: (
                round(request.metrics[i].value, 3)
                if request.metrics[i].nvmlReturn == 0
                else f"error {request.metrics[i].nvmlReturn}"
            )
            for i, name in enumerate(GPM_METRICS)
        }
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for s in samples:
            with contextlib.suppress(Exception):
                n.nvmlGpmSampleFree(s)
    return out


def _process_utilization(n: Any, h: Any) -> Any:
    try:
        return [
            {"pid": s.pid, "sm": s.smUtil, "mem": s.memUtil, "enc": s.encUtil, "dec": s.decUtil}
            for s in n.nvmlDeviceGetProcessUtilization(h, 0)
        ]
    except Exception as exc:
        return f"error: {exc}"


# -- the jobs (run as `real_gpu.py --job KIND`, under `gpu-exporter run` or alone) -------------


# What a job is given (by `run`, or by the script for a plain claim); never the lease's token.
JOB_ENVIRONMENT = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "GPU_EXPORTER_URL",
    "GPU_MEM_LIMIT_BYTES",
    "GPU_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_CLIENT_MEM_FRACTION",
    "TF_FORCE_GPU_ALLOW_GROWTH",
)


def job(kind: str, progress: Path, busy_s: float, overrun_s: float) -> int:
    """Phases as JSON lines in ``progress``: start, [capped], busy, [overrun], done."""

    def say(phase: str, **data: Any) -> None:
        with progress.open("a") as f:
            f.write(json.dumps({"phase": phase, "pid": os.getpid(), **data}) + "\n")

    env = {k: os.environ[k] for k in JOB_ENVIRONMENT if k in os.environ}
    try:
        say("start", env=env)
        if kind.startswith("fake-"):
            return _fake_job(kind.removeprefix("fake-"), say, env, busy_s, overrun_s)
        if kind == "jax":
            return _jax_job(say, env, busy_s)
        return _torch_job(kind, say, env, busy_s, overrun_s)
    except Exception as exc:
        say("error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-1500:])
        return 1


def _fake_job(
    kind: str, say: Callable[..., None], env: dict[str, str], busy_s: float, overrun_s: float
) -> int:
    if kind == "jax":
        say("done", cap="skipped", why="self-test: no CUDA")
        return 0
    if kind == "share":
        say("capped", env=env, cap="skipped", why="self-test: no CUDA")
    say("busy", bytes=4 * GiB)
    time.sleep(busy_s)
    if kind == "share":
        say("overrun", bytes=12 * GiB)
        time.sleep(overrun_s)
    say("done", tflops=None)
    return 0


def _torch_job(
    kind: str, say: Callable[..., None], env: dict[str, str], busy_s: float, overrun_s: float
) -> int:
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    if kind == "share":
        fraction = float(os.environ["GPU_MEM_FRACTION"])
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        seen = getter(0) if getter else None
        cap = int(fraction * total)
        try:
            big = torch.empty(cap + GiB, dtype=torch.uint8, device="cuda")
            del big
            oom = False
        except torch.OutOfMemoryError:
            oom = True
        torch.cuda.empty_cache()
        say(
            "capped",
            env=env,
            fraction_env=fraction,
            fraction_seen=seen,
            oom_past_cap=oom,
            cap_bytes=cap,
        )
    size = 8192
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    ballast = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    say("busy", bytes=torch.cuda.memory_reserved(0))
    products, started = 0, time.perf_counter()
    while time.perf_counter() - started < busy_s:
        for _ in range(20):
            c = a @ b
        torch.cuda.synchronize()
        products += 20
    seconds = time.perf_counter() - started
    tflops = round(2 * size**3 * products / seconds / 1e12, 1)
    del c
    if kind == "share":
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        extra = torch.empty(8 * GiB, dtype=torch.uint8, device="cuda")
        extra.fill_(1)
        torch.cuda.synchronize()
        say("overrun", bytes=torch.cuda.memory_reserved(0))
        time.sleep(overrun_s)
        del extra
    del ballast
    say("done", tflops=tflops, products=products, seconds=round(seconds, 2), total=total)
    return 0


def _jax_job(say: Callable[..., None], env: dict[str, str], busy_s: float) -> int:
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as exc:
        say("done", cap="skipped", why=f"jax not installed: {exc}")
        return 0
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    x = jnp.ones((4096, 4096), dtype=jnp.bfloat16)
    started = time.perf_counter()
    while time.perf_counter() - started < min(busy_s, 5):
        (x @ x).block_until_ready()
    names = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION")
    given = [float(os.environ[name]) for name in names if name in os.environ]
    fraction = given[0] if given else None
    say(
        "done",
        env={k: os.environ[k] for k in names if k in os.environ},
        jax=jax.__version__,
        backend=jax.default_backend(),
        device=str(device),
        bytes_limit=stats.get("bytes_limit"),
        expected_bytes=int(fraction * _total_bytes()) if fraction is not None else None,
    )
    return 0


def _total_bytes() -> int:
    import pynvml as n

    n.nvmlInit()
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0]
        h = (
            n.nvmlDeviceGetHandleByUUID(visible)
            if visible.startswith("GPU-")
            else n.nvmlDeviceGetHandleByIndex(0)
        )
        return int(n.nvmlDeviceGetMemoryInfo(h).total)
    finally:
        n.nvmlShutdown()


# -- the fake nvidia-smi (self-test) -----------------------------------------------------------


def as_nvidia_smi(argv: list[str]) -> int:
    """Enough of ``nvidia-smi`` for this script, answered from NVML (the fake library)."""
    import pynvml as n

    if "--help-query-gpu" in argv:
        print("\n".join(f'"{name}"' for name in _smi_answers(n, None)))
        return 0
    query = next(a for a in argv if a.startswith("--query-gpu=")).split("=", 1)[1].split(",")
    n.nvmlInit()
    try:
        answers = _smi_answers(n, n.nvmlDeviceGetHandleByIndex(0))
        row = []
        for name in query:
            try:
                row.append(str(answers[name]()))
            except n.NVMLError_NotSupported:
                row.append("[N/A]")
        print(", ".join(row))
    finally:
        n.nvmlShutdown()
    return 0


def _field_value(n: Any, h: Any, field_id: int) -> Any:
    """One ``nvmlDeviceGetFieldValues`` entry's value; its own error as NVMLError."""
    (v,) = n.nvmlDeviceGetFieldValues(h, [field_id])
    if v.nvmlReturn != 0:
        raise n.NVMLError(v.nvmlReturn)
    return getattr(v.value, _VALUE_TYPES.get(v.valueType, "ullVal"))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _smi_answers(n: Any, h: Any) -> dict[str, Callable[[], Any]]:
    def mem(attr: str) -> Callable[[], int]:
        return lambda: getattr(n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2), attr) // MiB

    def clock(kind: int, maximum: bool = False) -> Callable[[], int]:
        return lambda: (n.nvmlDeviceGetMaxClockInfo if maximum else n.nvmlDeviceGetClockInfo)(
            h, kind
        )

    def flag(
        value: Callable[[], Any], on: str = "Enabled", off: str = "Disabled"
    ) -> Callable[[], str]:
        return lambda: on if value() else off

    def reason(bit: int) -> Callable[[], str]:
        return flag(
            lambda: n.nvmlDeviceGetCurrentClocksEventReasons(h) & bit, "Active", "Not Active"
        )

    def ecc(error: int, counter: int) -> Callable[[], int]:
        return lambda: n.nvmlDeviceGetTotalEccErrors(h, error, counter)

    remapped = lambda i: lambda: n.nvmlDeviceGetRemappedRows(h)[i]  # noqa: E731
    return {
        "name": lambda: n.nvmlDeviceGetName(h),
        "uuid": lambda: n.nvmlDeviceGetUUID(h),
        "pci.bus_id": lambda: _text(n.nvmlDeviceGetPciInfo(h).busId),
        "driver_version": lambda: n.nvmlSystemGetDriverVersion(),
        "memory.total": mem("total"),
        "memory.reserved": mem("reserved"),
        "memory.used": mem("used"),
        "memory.free": mem("free"),
        "utilization.gpu": lambda: n.nvmlDeviceGetUtilizationRates(h).gpu,
        "utilization.memory": lambda: n.nvmlDeviceGetUtilizationRates(h).memory,
        "temperature.gpu": lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
        "temperature.memory": lambda: _field_value(n, h, n.NVML_FI_DEV_MEMORY_TEMP),
        "power.draw": lambda: f"{n.nvmlDeviceGetPowerUsage(h) / 1000:.2f}",
        "enforced.power.limit": lambda: f"{n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000:.2f}",
        "power.default_limit": lambda: (
            f"{n.nvmlDeviceGetPowerManagementDefaultLimit(h) / 1000:.2f}"
        ),
        "clocks.sm": clock(n.NVML_CLOCK_SM),
        "clocks.gr": clock(n.NVML_CLOCK_GRAPHICS),
        "clocks.mem": clock(n.NVML_CLOCK_MEM),
        "clocks.video": clock(n.NVML_CLOCK_VIDEO),
        "clocks.max.sm": clock(n.NVML_CLOCK_SM, True),
        "clocks.max.gr": clock(n.NVML_CLOCK_GRAPHICS, True),
        "clocks.max.mem": clock(n.NVML_CLOCK_MEM, True),
        "pstate": lambda: f"P{n.nvmlDeviceGetPerformanceState(h)}",
        "fan.speed": lambda: n.nvmlDeviceGetFanSpeed(h),
        "persistence_mode": flag(lambda: n.nvmlDeviceGetPersistenceMode(h)),
        "ecc.mode.current": flag(lambda: n.nvmlDeviceGetEccMode(h)[0]),
        "ecc.errors.corrected.volatile.total": ecc(
            n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC
        ),
        "ecc.errors.uncorrected.volatile.total": ecc(
            n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC
        ),
        "ecc.errors.corrected.aggregate.total": ecc(
            n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_AGGREGATE_ECC
        ),
        "ecc.errors.uncorrected.aggregate.total": ecc(
            n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_AGGREGATE_ECC
        ),
        "remapped_rows.correctable": remapped(0),
        "remapped_rows.uncorrectable": remapped(1),
        "remapped_rows.pending": flag(remapped(2), "Yes", "No"),
        "remapped_rows.failure": flag(remapped(3), "Yes", "No"),
        "retired_pages.sbe": lambda: len(
            n.nvmlDeviceGetRetiredPages(
                h, n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
            )
        ),
        "retired_pages.dbe": lambda: len(
            n.nvmlDeviceGetRetiredPages(h, n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        ),
        "pcie.link.gen.current": lambda: n.nvmlDeviceGetCurrPcieLinkGeneration(h),
        "pcie.link.gen.max": lambda: n.nvmlDeviceGetMaxPcieLinkGeneration(h),
        "pcie.link.width.current": lambda: n.nvmlDeviceGetCurrPcieLinkWidth(h),
        "pcie.link.width.max": lambda: n.nvmlDeviceGetMaxPcieLinkWidth(h),
        "mig.mode.current": flag(lambda: n.nvmlDeviceGetMigMode(h)[0]),
        "clocks_event_reasons.sw_power_cap": reason(0x4),
        "clocks_event_reasons.hw_slowdown": reason(0x8),
        "clocks_event_reasons.sync_boost": reason(0x10),
        "clocks_event_reasons.sw_thermal_slowdown": reason(0x20),
        "clocks_event_reasons.hw_thermal_slowdown": reason(0x40),
        "clocks_event_reasons.hw_power_brake_slowdown": reason(0x80),
        "clocks_event_reasons.applications_clocks_setting": reason(0x2),
    }


# -- preparing the wheels (here, with PyPI) ----------------------------------------------------


def prepare(dest: Path) -> int:
    """The wheels the GPU host lacks, for CPython 3.12 on manylinux x86-64, and this
    checkout's own wheel: what ``--wheels`` installs there."""
    dest.mkdir(parents=True, exist_ok=True)
    download = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        *(f"--platform={p}" for p in PLATFORMS),
        "-d",
        str(dest),
        *WHEELS,
    ]
    project = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    project += ["-w", str(dest), str(ROOT)]
    print("+", " ".join(download), file=sys.stderr)
    subprocess.run(download, check=True)
    # The wheel says which commit it is (gpu_exporter_build_info{revision}), as a packager's does.
    stamp = ROOT / "gpu_exporter" / "_revision.txt"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    stamp.write_text(head.stdout.strip() or "unknown")
    try:
        print("+", " ".join(project), file=sys.stderr)
        subprocess.run(project, check=True)
    finally:  # and the checkout's own builds go on reading git
        stamp.unlink()
        (ROOT / "build" / "lib" / "gpu_exporter" / "_revision.txt").unlink(missing_ok=True)
    total = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(
        f"{len(list(dest.glob('*.whl')))} wheels, {total / MiB:.1f} MiB in {dest}", file=sys.stderr
    )
    return 0


# -- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--as-nvidia-smi"]:
        return as_nvidia_smi(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT") or "real-gpu-report"),
        help="where report.json and summary.md go (default: $OUT, else ./real-gpu-report)",
    )
    parser.add_argument("--wheels", type=Path, help="wheels to install first (made by --prepare)")
    parser.add_argument(
        "--self-test", action="store_true", help="the fake library and a fake nvidia-smi"
    )
    parser.add_argument(
        "--prepare", type=Path, metavar="DIR", help="download the wheels into DIR and stop"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    parser.add_argument("--probe", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--progress", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--busy-seconds", type=float, default=REAL.busy_s, help=argparse.SUPPRESS)
    parser.add_argument(
        "--overrun-seconds", type=float, default=REAL.overrun_s, help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.prepare:
        return prepare(args.prepare)
    if args.probe:
        return probe(args.probe)
    if args.job:
        return job(args.job, args.progress, args.busy_seconds, args.overrun_seconds)
    work = Path(tempfile.mkdtemp(prefix="real-gpu-"))
    try:
        if args.self_test:
            card: Card = FakeCard(work)
        else:
            card = Card(work)
            if shutil.which("nvidia-smi") is None:
                print(
                    "real_gpu.py: no nvidia-smi here; on a machine without a GPU use --self-test",
                    file=sys.stderr,
                )
                return 2
        status = Run(args, card, SELF_TEST if args.self_test else REAL).all()
        with (args.out / "logs.txt").open("w") as logs:  # every process's output, one file
            for log in sorted(work.glob("*.log")):
                logs.write(f"==> {log.name} <==\n{log.read_text(errors='replace')[-20000:]}\n")
        return status
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
