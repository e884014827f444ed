"""End to end through the real ctypes layer: `gpu-exporter serve` over a fake libnvidia-ml.so.1.

The fake library (tests/fakenvml/fakenvml.c) is compiled against NVIDIA's nvml.h, so pynvml
resolves the same versioned symbols (``nvmlDeviceGetCount_v2``, ``..._v3``), passes the same
structs and runs the same two-call size protocol as against a driver. The rest of the suite
uses the simulator, which replaces pynvml itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import fakenvml
from fakenvml import Fabric, FakeGpu
from gpu_exporter.readings import READINGS
from harness import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30

# What gpu_exporter/nvml.py resolves through pynvml today (pynvml's own symbol names).
NEEDED_BY_THE_EXPORTER = {
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlSystemGetCudaDriverVersion",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetFanSpeed",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    # … and everything else a real A100 answers (issue 15: measure on a fake that reports
    # what a real A100 reports): limits, health, PCIe link, modes, Xid events.
    "nvmlDeviceGetMaxClockInfo",
    "nvmlDeviceGetTemperatureThreshold",
    "nvmlDeviceGetPowerManagementDefaultLimit",
    "nvmlDeviceGetPowerManagementLimitConstraints",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetPerformanceState",
    "nvmlDeviceGetPersistenceMode",
    "nvmlDeviceGetComputeMode",
    "nvmlDeviceGetEccMode",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetPcieReplayCounter",
    "nvmlDeviceGetPcieThroughput",
    "nvmlDeviceGetEncoderUtilization",
    "nvmlDeviceGetDecoderUtilization",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetCreate",
    "nvmlEventSetWait_v2",
    "nvmlEventSetFree",
    # Issue 31: power, temperatures, energy, ECC, remapped rows, retired pages, PCIe replays
    # and NVLink in one call per GPU and cadence.
    "nvmlDeviceGetFieldValues",
    # GPM and per-process utilization (issue 25)
    "nvmlGpmQueryDeviceSupport",
    "nvmlGpmSampleAlloc",
    "nvmlGpmSampleFree",
    "nvmlGpmSampleGet",
    "nvmlGpmMigSampleGet",
    "nvmlGpmMetricsGet",
    "nvmlDeviceGetProcessUtilization",
}


@pytest.fixture(scope="session")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake library, compiled once per test session."""
    try:
        return fakenvml.build(tmp_path_factory.mktemp("fakenvml"))
    except fakenvml.BuildUnavailable as exc:
        pytest.skip(f"cannot build the fake libnvidia-ml.so.1: {exc}")


@dataclass
class Exporter:
    base: str
    config: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def write(self, gpus: list[FakeGpu], **kwargs: object) -> None:
        fakenvml.write_config(self.config, gpus, **kwargs)

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=timeout) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics by (name, sorted labels)."""
        status, text = self.get("/metrics")
        assert status == 200, text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def value(self, name: str, **labels: str) -> float | None:
        return self.samples().get((name, tuple(sorted(labels.items()))))

    def wait_for(self, condition: Callable[[], bool], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            assert self.proc.poll() is None, self.log.read_text()
            time.sleep(0.05)
        raise AssertionError(f"condition not met within {timeout} s; log:\n{self.log.read_text()}")


@pytest.fixture
def start_exporter(fake_lib: Path, tmp_path: Path) -> Iterator[Callable[..., Exporter]]:
    """Start `gpu-exporter serve` (no --simulate) with the fake library on its load path."""
    started: list[Exporter] = []

    def start(
        gpus: list[FakeGpu],
        *,
        ready: bool = True,
        args: tuple[str, ...] = (),
        stats: Path | None = None,
        **kwargs: object,
    ) -> Exporter:
        config = tmp_path / f"fakenvml-{len(started)}.conf"
        fakenvml.write_config(config, gpus, **kwargs)
        port = free_port()
        log = tmp_path / f"exporter-{len(started)}.log"
        env = fakenvml.environment(fake_lib, config, stats)
        env["GPU_EXPORTER_STATE_DIR"] = tempfile.mkdtemp(dir=tmp_path)
        command = ["serve", "--interval", "0.1", "--listen-address", f"127.0.0.1:{port}", *args]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gpu_exporter", *command],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )
        exporter = Exporter(f"http://127.0.0.1:{port}", config, proc, log)
        started.append(exporter)
        if ready:
            exporter.wait_for(lambda: _ready(exporter))
        return exporter

    yield start
    for exporter in started:
        if exporter.proc.poll() is None:
            exporter.proc.terminate()
        try:
            exporter.proc.wait(10)
        except subprocess.TimeoutExpired:
            exporter.proc.kill()
            exporter.proc.wait()


def _ready(exporter: Exporter) -> bool:
    try:
        return exporter.get("/readyz", timeout=1)[0] == 200
    except OSError:
        return False


def _run_python(fake_lib: Path, config: Path, code: str) -> str:
    """Run ``code`` in a fresh interpreter that loads the fake library; returns stdout."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=fakenvml.environment(fake_lib, config),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_exports_exactly_what_it_implements_and_all_the_exporter_needs(fake_lib: Path) -> None:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not installed; it comes with gcc")
    out = subprocess.run(
        [nm, "-D", "--defined-only", str(fake_lib / fakenvml.LIBRARY_NAME)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    exported = sorted(line.split()[-1] for line in out.splitlines() if " T " in line)
    assert exported == fakenvml.exported_functions()
    assert set(exported) >= NEEDED_BY_THE_EXPORTER
    # the unversioned compatibility names are NOT exported, as -DNVML_NO_UNVERSIONED_FUNC_DEFS
    # keeps them distinct: pynvml must ask for the _v2/_v3 symbols
    assert "nvmlDeviceGetCount" not in exported
    assert "nvmlDeviceGetComputeRunningProcesses" not in exported


def test_metric_values_in_base_units(start_exporter: Callable[..., Exporter]) -> None:
    gpus = [
        FakeGpu(
            name="NVIDIA H100 80GB HBM3",
            memory_total=80 * GiB,
            memory_used=30 * GiB,
            memory_reserved=GiB // 2,
            utilization_gpu=42,
            utilization_memory=17,
            power_usage_mw=312_500,
            power_limit_mw=700_000,
            energy_mj=123_456_789,
            temperature_c=61,
            fan_percent=55,
        ),
        FakeGpu(memory_total=40 * GiB, memory_used=GiB, utilization_gpu=3),
    ]
    ex = start_exporter(gpus, driver_version="560.35.03", cuda_driver_version=12060)
    s = ex.samples()
    uuid0 = "GPU-fa4e0000-0000-4000-8000-000000000000"
    ids0 = (("gpu", "0"), ("uuid", uuid0))

    def v(name: str, ids: tuple[tuple[str, str], ...] = ids0, **extra: str) -> float | None:
        return s.get((name, tuple(sorted((*ids, *extra.items())))))

    assert v("gpu_up") == 1
    assert v("gpu_memory_total_bytes") == 80 * GiB
    assert v("gpu_memory_used_bytes") == 30 * GiB
    assert v("gpu_memory_reserved_bytes") == GiB // 2
    assert v("gpu_memory_free_bytes") == 80 * GiB - 30 * GiB - GiB // 2
    assert v("gpu_utilization_ratio") == 0.42
    assert v("gpu_memory_utilization_ratio") == 0.17
    assert v("gpu_power_draw_watts") == 312.5
    assert v("gpu_power_limit_watts") == 700.0
    assert v("gpu_energy_joules_total") == 123_456.789
    assert v("gpu_temperature_celsius") == 61
    assert v("gpu_fan_speed_ratio") == 0.55
    assert v("gpu_clock_hz", clock="memory") == 1593e6
    assert v("gpu_compute_processes") == 0
    info = {
        "gpu": "0",
        "uuid": uuid0,
        "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": "00000000:10:00.0",
        "driver_version": "560.35.03",
        "cuda_driver_version": "12.6",
    }
    assert s[("gpu_info", tuple(sorted(info.items())))] == 1
    ids1 = (("gpu", "1"), ("uuid", "GPU-fa4e0001-0000-4000-8000-000000000001"))
    assert v("gpu_memory_total_bytes", ids1) == 40 * GiB
    assert v("gpu_utilization_ratio", ids1) == 0.03
    assert s[("gpu_exporter_nvml_up", ())] == 1
    assert ('gpu_exporter_build_info{backend="nvml"') in ex.get("/metrics")[1]


def test_a_gpu_lost_mid_run_is_down_while_the_others_keep_reporting(
    start_exporter: Callable[..., Exporter],
) -> None:
    ex = start_exporter([FakeGpu(), FakeGpu(), FakeGpu()])
    uuid1 = "GPU-fa4e0001-0000-4000-8000-000000000001"
    assert ex.value("gpu_up", gpu="1", uuid=uuid1) == 1
    ex.write([FakeGpu(), FakeGpu(errors={"*": "GPU_IS_LOST"}), FakeGpu()])
    ex.wait_for(lambda: ex.value("gpu_up", gpu="1", uuid=uuid1) == 0)
    s = ex.samples()
    # the lost GPU keeps its uuid label (read before it was lost) and has no values at all
    assert not [k for k in s if dict(k[1]).get("uuid") == uuid1 and k[0].startswith("gpu_m")]
    assert s[("gpu_up", (("gpu", "0"), ("uuid", uuid1.replace("0001", "0000"))))] == 1
    assert s[("gpu_up", (("gpu", "2"), ("uuid", uuid1.replace("0001", "0002"))))] == 1
    errors = {k: v for k, v in s.items() if k[0] == "gpu_exporter_nvml_errors_total"}
    assert errors and all(dict(k[1])["error"] == "GPU_IS_LOST" for k in errors)
    status, body = ex.get("/choose?n=3&lease=0")
    assert status == 503 and "2 of 3 GPUs qualify" in body


def test_a_not_supported_field_is_absent_and_not_an_error(
    start_exporter: Callable[..., Exporter],
) -> None:
    ex = start_exporter(
        [
            FakeGpu(fan_percent=30, errors={"nvmlDeviceGetFanSpeed": "NOT_SUPPORTED"}),
            FakeGpu(fan_percent=30),
        ]
    )
    s = ex.samples()
    fans = {dict(k[1])["gpu"]: value for k, value in s.items() if k[0] == "gpu_fan_speed_ratio"}
    assert fans == {"1": 0.3}
    assert not [k for k in s if k[0] == "gpu_exporter_nvml_errors_total"]
    assert "NaN" not in ex.get("/metrics")[1]


def test_memory_and_utilization_changes_are_picked_up(
    start_exporter: Callable[..., Exporter],
) -> None:
    ex = start_exporter([FakeGpu(memory_used=GiB, utilization_gpu=5)])
    ids = {"gpu": "0", "uuid": "GPU-fa4e0000-0000-4000-8000-000000000000"}
    assert ex.value("gpu_memory_used_bytes", **ids) == GiB
    ex.write([FakeGpu(memory_used=20 * GiB, utilization_gpu=95)])
    ex.wait_for(lambda: ex.value("gpu_memory_used_bytes", **ids) == 20 * GiB)
    assert ex.value("gpu_utilization_ratio", **ids) == 0.95
    gpus = json.loads(ex.get("/gpus")[1])["gpus"]
    assert gpus[0]["memory_used_bytes"] == 20 * GiB


def test_processes_with_real_pids_cross_the_two_call_protocol_intact(
    fake_lib: Path, start_exporter: Callable[..., Exporter], tmp_path: Path
) -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as child:
        try:
            real = ((os.getpid(), 3 * GiB), (child.pid, 512 * 2**20))
            gpus = [FakeGpu(processes=real), FakeGpu(synthetic_processes=(1000, 2**20))]
            ex = start_exporter(gpus)
            assert ex.value("gpu_compute_processes", gpu="0", uuid=_uuid(0)) == 2
            assert ex.value("gpu_compute_processes", gpu="1", uuid=_uuid(1)) == 1000
            # The wrapper's own view: PIDs and bytes exactly as configured, so the struct is
            # the 24-byte v2 layout pynvml expects (a 16-byte one would garble every PID
            # after the first).
            out = _run_python(
                fake_lib,
                ex.config,
                "from gpu_exporter.nvml import Nvml\n"
                "n = Nvml(); n.init()\n"
                "for i in range(2):\n"
                "    ps = n.compute_processes(n.handle(i))\n"
                "    print(len(ps), [(p.pid, p.used_memory_bytes) for p in ps[:3]], ps[-1].pid)\n",
            )
            first, second = out.splitlines()
            assert first == f"2 {[real[0], real[1]]} {child.pid}"
            base = fakenvml.SYNTHETIC_PID_BASE + 10000
            expected = [(base, 2**20), (base + 1, 2**20), (base + 2, 2**20)]
            assert second == f"1000 {expected} {base + 999}"
        finally:
            child.kill()


def _uuid(index: int) -> str:
    return f"GPU-fa4e{index:04x}-0000-4000-8000-00000000{index:04x}"


def test_a_function_the_library_lacks_is_unsupported_not_an_error(
    fake_lib: Path, tmp_path: Path
) -> None:
    config = tmp_path / "one.conf"
    fakenvml.write_config(config, [FakeGpu()])
    out = _run_python(
        fake_lib,
        config,
        "from gpu_exporter.nvml import Nvml, Unsupported\n"
        "n = Nvml(); n.init(); h = n.handle(0)\n"
        "try:\n"
        "    n._call('nvmlDeviceGetBoardId', h)\n"
        "except Unsupported as exc:\n"
        "    print(exc.error, n.error_counts())\n",
    )
    assert out.strip() == "FUNCTION_NOT_FOUND {}"


def test_an_a100_reports_every_health_field_and_xid_events(
    start_exporter: Callable[..., Exporter],
) -> None:
    """What the benchmark runs both exporters on: every field a real A100-SXM4 reports, so
    the only unsupported fields are the ones a real one lacks (fan, retired pages)."""
    sick = {
        "ecc_corrected_volatile": 7,
        "ecc_corrected_aggregate": 120,
        "ecc_uncorrected_aggregate": 1,
        "remapped_correctable": 2,
        "remapped_pending": 1,
        "clocks_event_reasons": 0x4 | 0x40,  # power cap, hardware thermal slowdown
        "pcie_width": 8,
        "pcie_replays": 5,
        "pstate": 2,
    }
    a100 = fakenvml.A100_SXM_ERRORS
    ex = start_exporter([FakeGpu(health=sick, errors=a100), FakeGpu(errors=a100)])
    s = ex.samples()
    ids = (("gpu", "0"), ("uuid", _uuid(0)))

    def v(name: str, **extra: str) -> float | None:
        return s.get((name, tuple(sorted((*ids, *extra.items())))))

    assert v("gpu_ecc_errors_total", error="corrected", counter="volatile") == 7
    assert v("gpu_ecc_errors_total", error="corrected", counter="aggregate") == 120
    assert v("gpu_ecc_errors_total", error="uncorrected", counter="aggregate") == 1
    assert v("gpu_ecc_errors_total", error="uncorrected", counter="volatile") == 0
    assert v("gpu_ecc_mode_enabled") == 1
    assert v("gpu_remapped_rows_total", cause="correctable") == 2
    assert v("gpu_remapped_rows_pending") == 1 and v("gpu_remapped_rows_failed") == 0
    assert v("gpu_clocks_event_reasons", reason="sw_power_cap") == 1
    assert v("gpu_clocks_event_reasons", reason="hw_thermal_slowdown") == 1
    assert v("gpu_clocks_event_reasons", reason="gpu_idle") == 0
    assert v("gpu_pcie_link_width", link="current") == 8
    assert v("gpu_pcie_link_width", link="max") == 16
    assert v("gpu_pcie_link_generation", link="max") == 4
    assert v("gpu_pcie_replay_errors_total") == 5
    assert v("gpu_performance_state") == 2
    assert v("gpu_persistence_mode_enabled") == 1
    assert v("gpu_compute_mode", mode="default") == 1
    assert v("gpu_mig_mode_enabled") == 0
    assert v("gpu_temperature_threshold_celsius", threshold="slowdown") == 89
    assert v("gpu_clock_max_hz", clock="sm") == 1410e6
    assert v("gpu_power_limit_default_watts") == 400
    # The only fields an A100-SXM4 does not report: the fan, retired pages (it remaps rows),
    # and GPM and the fabric registration (Hopper and later).
    unsupported = {
        dict(k[1])["field"]
        for k in s
        if k[0] == "gpu_exporter_field_supported" and dict(k[1])["gpu"] == "1"
    }
    assert unsupported == {
        "fan_speed",
        "gpm",
        "fabric",
        "retired_pages_multiple_single_bit",
        "retired_pages_double_bit",
        "retired_pages_pending",
    }
    assert not [k for k in s if k[0] == "gpu_exporter_nvml_errors_total"]
    # An Xid after the listener registered is delivered once, to the GPU it names.
    ex.write([FakeGpu(health=sick, errors=a100), FakeGpu(errors=a100, xids=(79,))])
    xid = ("gpu_xid_errors_total", (("gpu", "1"), ("uuid", _uuid(1)), ("xid", "79")))
    ex.wait_for(lambda: ex.samples().get(xid) == 1)
    time.sleep(1.2)  # two more waits of the listener: no repeat
    assert ex.samples().get(xid) == 1


def test_the_library_counts_every_call_by_function(fake_lib: Path, tmp_path: Path) -> None:
    """How the benchmark reports NVML calls per minute of each exporter: a shared mapping of
    64-byte records, readable at any moment from outside."""
    config, stats = tmp_path / "one.conf", tmp_path / "calls.stats"
    fakenvml.write_config(config, [FakeGpu(), FakeGpu()])
    env = fakenvml.environment(fake_lib, config, stats)
    code = (
        "from gpu_exporter.nvml import Nvml\n"
        "n = Nvml(); n.init()\n"
        "for i in range(2):\n"
        "    h = n.handle(i)\n"
        "    for _ in range(3):\n"
        "        n._call('nvmlDeviceGetTotalEccErrors', h, 0, 1)\n"
        "        n._call('nvmlDeviceGetRemappedRows', h)\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60, cwd=ROOT)
    calls = fakenvml.read_stats(stats)
    assert calls["nvmlDeviceGetTotalEccErrors"] == 6
    assert calls["nvmlDeviceGetRemappedRows"] == 6
    assert calls["nvmlDeviceGetHandleByIndex_v2"] == 2
    assert set(calls) <= set(fakenvml.exported_functions())


def test_a_hung_driver_call_never_slows_a_scrape(start_exporter: Callable[..., Exporter]) -> None:
    ex = start_exporter([FakeGpu(), FakeGpu()])
    hang_seconds = 3.0
    ex.write([FakeGpu(hangs={"nvmlDeviceGetPowerUsage": hang_seconds}), FakeGpu()])
    time.sleep(0.5)  # the sampler is now inside the hung call
    for _ in range(5):
        started = time.monotonic()
        assert ex.get("/metrics")[0] == 200
        assert time.monotonic() - started < hang_seconds / 2
    ex.wait_for(
        lambda: (ex.value("gpu_exporter_sample_duration_seconds") or 0) >= hang_seconds * 0.9
    )


def test_a_call_past_the_deadline_marks_that_gpu_down_until_it_returns(
    start_exporter: Callable[..., Exporter],
) -> None:
    ex = start_exporter([FakeGpu(), FakeGpu()], args=("--nvml-timeout", "1"))
    ex.write([FakeGpu(hangs={"nvmlDeviceGetPowerUsage": 4}), FakeGpu()])
    reason = {"gpu": "0", "uuid": _uuid(0), "reason": "timeout"}
    ex.wait_for(lambda: ex.value("gpu_down_reason", **reason) == 1)
    assert ex.value("gpu_up", gpu="0", uuid=_uuid(0)) == 0
    assert ex.value("gpu_up", gpu="1", uuid=_uuid(1)) == 1  # the other GPU keeps reporting
    ex.write([FakeGpu(), FakeGpu()])
    ex.wait_for(lambda: ex.value("gpu_up", gpu="0", uuid=_uuid(0)) == 1)


def test_driver_not_loaded_at_start_then_recovers(start_exporter: Callable[..., Exporter]) -> None:
    ex = start_exporter([FakeGpu()], ready=False, errors={"nvmlInitWithFlags": "DRIVER_NOT_LOADED"})
    ex.wait_for(lambda: _scrape_ok(ex) and ex.value("gpu_exporter_nvml_up") == 0)
    status, body = ex.get("/readyz")
    assert status == 503 and "Driver Not Loaded" in body
    ex.write([FakeGpu()])
    ex.wait_for(lambda: _ready(ex))  # init is retried with backoff (1 s first)
    assert ex.value("gpu_up", gpu="0", uuid=_uuid(0)) == 1


def _scrape_ok(ex: Exporter) -> bool:
    try:
        return ex.get("/metrics", timeout=1)[0] == 200
    except OSError:
        return False


def test_the_getters_and_the_xid_wait_over_the_real_bindings(
    fake_lib: Path, tmp_path: Path
) -> None:
    """Over the real bindings and a C library: the hot getters read the library's values and
    the Xid wait gives an event, then a timeout as None (an answer, not a counted error)."""
    config = tmp_path / "one.conf"
    gpu = FakeGpu(utilization_gpu=37, utilization_memory=12, power_usage_mw=123_000)
    fakenvml.write_config(config, [gpu, FakeGpu(temperature_c=61, memory_reserved=2**29)])
    out = _run_python(
        fake_lib,
        config,
        "import pathlib, sys; sys.path.insert(0, 'tests'); import fakenvml\n"
        "from gpu_exporter.nvml import Nvml, handle_key\n"
        "from gpu_exporter.readings import BY_ATTRIBUTE as R\n"
        "n = Nvml(); n.init(); h = n.handle(0); m = n.memory(n.handle(1))\n"
        "v = lambda a, h: R[a].convert(n.get(R[a].getter, h, *R[a].args))\n"
        "print(v('temperature_celsius', n.handle(1)), m.reserved_bytes)\n"
        "u = v('utilization_ratio', h), v('memory_utilization_ratio', h)\n"
        "print(u, v('power_draw_watts', h), n.memory(h), v('temperature_celsius', h))\n"
        "s = n.event_set_create(); n.register_events(h, 8, s)\n"
        f"fakenvml.write_config(pathlib.Path({str(config)!r}), [fakenvml.FakeGpu(xids=(79,))])\n"
        "e = n.event_wait(s, 10)\n"
        "print(e.device_key == handle_key(h), e.event_type, e.data, n.event_wait(s, 10))\n"
        "n.event_set_free(s)\n"
        "print(dict(n.error_counts()))\n",
    )
    second, values, event, errors = out.splitlines()
    assert second == f"61.0 {2**29}"
    assert values.startswith("(0.37, 0.12) 123.0 MemoryInfo(") and event == "True 8 79 None"
    assert errors == "{}"  # a wait's timeout is an answer, not an error


# -- issue 31: field values in batches; issue 25: memory temperature and NVLink --------------


def _rich(**health: int | str) -> FakeGpu:
    """A card answering every field, with health counters that are not all 0."""
    values: dict[str, int | str] = {"retired_pages": "2 1 0", "ecc_corrected_volatile": 7}
    values |= {"remapped_correctable": 2, "pcie_replays": 5, **health}
    return FakeGpu(fan_percent=40, energy_mj=123_456_789, temperature_c=61, health=values)


def _gpu_samples(ex: Exporter) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The GPU series of a scrape (the exporter's own change with time and calls)."""
    return {
        k: v for k, v in ex.samples().items() if k[0].startswith("gpu_") and k[0] not in _VOLATILE
    }


_VOLATILE = {  # when the sample was taken, and how long it took
    "gpu_last_seen_timestamp_seconds",
    "gpu_exporter_last_sample_timestamp_seconds",
    "gpu_exporter_sample_duration_seconds",
}


def test_a_full_scrape_is_the_same_batched_and_one_call_per_field(
    start_exporter: Callable[..., Exporter],
) -> None:
    """Every exported value equal, series by series, whether the fields come from
    nvmlDeviceGetFieldValues or from one getter each (the batch refused on every GPU)."""
    gpus = [_rich(), _rich(ecc_uncorrected_aggregate=1), FakeGpu(power_usage_mw=250_500)]
    batched = start_exporter(gpus)
    single = start_exporter(
        gpus, every_gpu=FakeGpu(errors={"nvmlDeviceGetFieldValues": "NOT_SUPPORTED"})
    )
    ex_b, ex_s = _gpu_samples(batched), _gpu_samples(single)

    # Values NVML gives as field values only (memory temperature, the clock-event durations):
    # present batched, unsupported one by one; every other value the same either way.
    only = [r for r in READINGS if r.fields and r.getter is None]
    families = {r.family.name for r in only if r.family is not None}

    def field_only(k: tuple[str, tuple[tuple[str, str], ...]]) -> bool:
        return k[0] in families or any(("field", r.name) in k[1] for r in only)

    def memory_temperature(k: tuple[str, tuple[tuple[str, str], ...]]) -> bool:
        return k[0] == "gpu_memory_temperature_celsius" or ("field", "memory_temperature") in k[1]

    assert [v for k, v in ex_b.items() if memory_temperature(k)] == [35, 35, 35]
    assert [v for k, v in ex_s.items() if field_only(k)] == [0] * 3 * len(only)
    assert {k: v for k, v in ex_b.items() if not field_only(k)} == {
        k: v for k, v in ex_s.items() if not field_only(k)
    }
    assert len(ex_b) > 3 * 50
    # The values that moved into the batch, for the record.
    ids = (("gpu", "1"), ("uuid", _uuid(1)))
    assert (
        ex_b[("gpu_ecc_errors_total", (("counter", "aggregate"), ("error", "uncorrected"), *ids))]
        == 1
    )
    assert ex_b[("gpu_energy_joules_total", ids)] == 123_456.789
    assert ex_b[("gpu_retired_pages_total", (("cause", "double_bit"), *ids))] == 1
    assert ex_b[("gpu_power_draw_watts", (("gpu", "2"), ("uuid", _uuid(2))))] == 250.5
    # Neither run counted an error: NOT_SUPPORTED is an answer, not a failure.
    assert not [k for k in batched.samples() if k[0] == "gpu_exporter_nvml_errors_total"]


def test_one_failing_entry_fails_its_field_on_that_gpu_alone(
    start_exporter: Callable[..., Exporter],
) -> None:
    gpus = [
        FakeGpu(errors={"field:82": "UNKNOWN"}, health={"memory_temperature_c": 46}),
        FakeGpu(errors={"field:82": "NOT_SUPPORTED"}),
        FakeGpu(health={"memory_temperature_c": 38}),
    ]
    ex = start_exporter(gpus)
    s = ex.samples()

    def v(name: str, gpu: int, **extra: str) -> float | None:
        return s.get((name, tuple(sorted({"gpu": str(gpu), "uuid": _uuid(gpu), **extra}.items()))))

    assert v("gpu_memory_temperature_celsius", 0) is None  # failed: absent, not 0
    assert v("gpu_memory_temperature_celsius", 1) is None  # not supported: absent
    assert v("gpu_memory_temperature_celsius", 2) == 38
    # The same batch's other entries are there; the GPU is up.
    assert (
        v("gpu_up", 0) == 1
        and v("gpu_power_draw_watts", 0) == 60
        and v("gpu_temperature_celsius", 0) == 30
    )
    # A failure is counted under the call and the field; NOT_SUPPORTED is remembered.
    function = "nvmlDeviceGetFieldValues(NVML_FI_DEV_MEMORY_TEMP)"
    errors = {k: n for k, n in s.items() if k[0] == "gpu_exporter_nvml_errors_total"}
    assert set(errors) == {
        ("gpu_exporter_nvml_errors_total", (("error", "UNKNOWN"), ("function", function)))
    }
    assert v("gpu_exporter_field_supported", 1, field="memory_temperature") == 0
    assert v("gpu_exporter_field_supported", 0, field="memory_temperature") is None
    # Fixed: the field is back at the next sample.
    ex.write([FakeGpu(health={"memory_temperature_c": 46}), *gpus[1:]])
    ex.wait_for(lambda: ex.value("gpu_memory_temperature_celsius", gpu="0", uuid=_uuid(0)) == 46)


def test_a_batch_that_fails_whole_falls_back_to_the_getters_and_says_so_once(
    start_exporter: Callable[..., Exporter], tmp_path: Path
) -> None:
    stats = tmp_path / "calls.stats"
    gpus = [
        FakeGpu(),
        FakeGpu(errors={"nvmlDeviceGetFieldValues": "UNKNOWN"}, power_usage_mw=99_000),
    ]
    ex = start_exporter(gpus, stats=stats)
    first = fakenvml.read_stats(stats)
    ex.wait_for(
        lambda: (
            fakenvml.read_stats(stats)["nvmlDeviceGetCount_v2"]
            >= first["nvmlDeviceGetCount_v2"] + 5
        )
    )
    s = ex.samples()
    ids1 = (("gpu", "1"), ("uuid", _uuid(1)))
    assert s[("gpu_up", ids1)] == 1
    assert s[("gpu_power_draw_watts", ids1)] == 99  # from nvmlDeviceGetPowerUsage
    assert s[("gpu_energy_joules_total", ids1)] == 1000  # from its getter too
    assert ("gpu_memory_temperature_celsius", ids1) not in s  # no getter: absent
    assert s[("gpu_memory_temperature_celsius", (("gpu", "0"), ("uuid", _uuid(0))))] == 35
    # Counted once: the call is not made again for that GPU until NVML is re-initialised.
    key = (
        "gpu_exporter_nvml_errors_total",
        (("error", "UNKNOWN"), ("function", "nvmlDeviceGetFieldValues")),
    )
    assert s[key] == 1
    calls = fakenvml.read_stats(stats)
    samples = calls["nvmlDeviceGetCount_v2"]
    assert calls["nvmlDeviceGetPowerUsage"] >= samples - 1  # GPU 1 only, every sample
    assert (
        calls["nvmlDeviceGetFieldValues"] <= 2 * samples + 1
    )  # GPU 0's two batches, GPU 1's one try
    log = ex.log.read_text()
    assert log.count("reading its fields one call each") == 1, log


def test_nvlink_per_link_on_a_card_with_links_and_none_without(
    start_exporter: Callable[..., Exporter],
) -> None:
    links = {0: (1, 100, 200, 1, 2, 3, 4), 1: (0, 0, 0, 0, 0, 0, 0)}
    gpus = [FakeGpu(health={"nvlink_links": 2}, nvlinks=links), FakeGpu()]
    ex = start_exporter(gpus, args=("--collect.nvlink",))
    s = ex.samples()
    nvlink = {k: v for k, v in s.items() if k[0].startswith("gpu_nvlink_")}

    def link(n: int) -> tuple[tuple[str, str], ...]:
        return (("gpu", "0"), ("link", str(n)), ("uuid", _uuid(0)))

    assert nvlink[("gpu_nvlink_up", link(0))] == 1
    assert nvlink[("gpu_nvlink_up", link(1))] == 0
    assert nvlink[("gpu_nvlink_transmit_bytes_total", link(0))] == 100 * 1024
    assert nvlink[("gpu_nvlink_receive_bytes_total", link(0))] == 200 * 1024
    errors = {
        dict(k[1])["error"]: v
        for k, v in nvlink.items()
        if k[0] == "gpu_nvlink_errors_total" and dict(k[1])["link"] == "0"
    }
    assert errors == {"crc_flit": 1, "crc_data": 2, "replay": 3, "recovery": 4}
    assert len(nvlink) == 2 * 7  # two links of GPU 0, nothing for GPU 1
    assert not [k for k in s if k[0] == "gpu_exporter_nvml_errors_total"]
    # Off by default: no NVLink series, no NVLink entries asked.
    plain = start_exporter(gpus)
    assert not [k for k in plain.samples() if k[0].startswith("gpu_nvlink_")]


def test_nvlink_counters_never_go_backwards_across_a_driver_reset(
    start_exporter: Callable[..., Exporter], tmp_path: Path
) -> None:
    def card(tx: int, replays: int) -> list[FakeGpu]:
        return [FakeGpu(health={"nvlink_links": 1}, nvlinks={0: (1, tx, 10, 0, 0, replays, 0)})]

    stats = tmp_path / "calls.stats"
    args = ("--collect.nvlink", "--slow-interval", "0.1")
    ex = start_exporter(card(1000, 5), args=args, stats=stats)
    ids = {"gpu": "0", "uuid": _uuid(0), "link": "0"}
    tx, replay = "gpu_nvlink_transmit_bytes_total", {"error": "replay", **ids}

    def read_twice_more() -> None:  # a few slow reads (batches) after the change
        batches = fakenvml.read_stats(stats)["nvmlDeviceGetFieldValues"]
        ex.wait_for(lambda: fakenvml.read_stats(stats)["nvmlDeviceGetFieldValues"] >= batches + 6)

    assert ex.value(tx, **ids) == 1000 * 1024
    ex.write(card(40, 1))  # a GPU reset: the driver's counters start again, lower
    read_twice_more()
    assert ex.value(tx, **ids) == 1000 * 1024  # restarted from the new base: no drop
    assert ex.value("gpu_nvlink_errors_total", **replay) == 5
    ex.write(card(100, 3))  # and counts on from there
    ex.wait_for(lambda: ex.value(tx, **ids) == (1000 + 60) * 1024)
    assert ex.value("gpu_nvlink_errors_total", **replay) == 7


def test_the_handle_is_asked_once_and_again_after_a_loss_or_reinitialisation(
    start_exporter: Callable[..., Exporter], tmp_path: Path
) -> None:
    stats = tmp_path / "calls.stats"
    ex = start_exporter([FakeGpu(), FakeGpu()], stats=stats)

    def calls(function: str) -> int:
        return fakenvml.read_stats(stats).get(function, 0)

    def samples_later(n: int) -> None:
        count = calls("nvmlDeviceGetCount_v2")
        ex.wait_for(lambda: calls("nvmlDeviceGetCount_v2") >= count + n)

    samples_later(3)
    # Once per GPU by the sampler (and once by the Xid listener), not once per sample.
    base = calls("nvmlDeviceGetHandleByIndex_v2")
    assert base <= 2 * 2
    samples_later(10)
    assert calls("nvmlDeviceGetHandleByIndex_v2") == base
    # GPU 1 is lost, then answers again: its handle is asked again (while lost, every sample).
    uuid1 = _uuid(1)
    ex.write([FakeGpu(), FakeGpu(errors={"*": "GPU_IS_LOST"})])
    ex.wait_for(lambda: ex.value("gpu_up", gpu="1", uuid=uuid1) == 0)
    ex.write([FakeGpu(), FakeGpu()])
    ex.wait_for(lambda: ex.value("gpu_up", gpu="1", uuid=uuid1) == 1)
    after_loss = calls("nvmlDeviceGetHandleByIndex_v2")
    assert after_loss > base
    samples_later(5)
    assert calls("nvmlDeviceGetHandleByIndex_v2") == after_loss  # kept again
    # NVML stops working and is initialised again: every handle is asked again, once.
    ex.write([FakeGpu(), FakeGpu()], errors={"nvmlDeviceGetCount_v2": "UNINITIALIZED"})
    ex.wait_for(lambda: ex.value("gpu_exporter_nvml_up") == 0)
    ex.write([FakeGpu(), FakeGpu()])
    ex.wait_for(lambda: ex.value("gpu_exporter_nvml_up") == 1)
    samples_later(3)
    after_init = calls("nvmlDeviceGetHandleByIndex_v2")
    assert after_init >= after_loss + 2
    samples_later(5)
    assert calls("nvmlDeviceGetHandleByIndex_v2") == after_init


def test_a_process_list_takes_one_call_not_two(
    start_exporter: Callable[..., Exporter], tmp_path: Path
) -> None:
    """pynvml asks for the count, then the list; the exporter passes a buffer big enough for
    the longest list so far, and asks again only when a list outgrows it."""
    stats = tmp_path / "calls.stats"
    gpus = [FakeGpu(synthetic_processes=(3, 2**30)), FakeGpu(synthetic_processes=(40, 2**20))]
    ex = start_exporter(gpus, stats=stats)
    assert ex.value("gpu_compute_processes", gpu="1", uuid=_uuid(1)) == 40
    samples, made = calls_over_samples(ex, stats, 5)
    lists = made["nvmlDeviceGetComputeRunningProcesses_v3"]
    assert samples * 2 <= lists <= (samples + 1) * 2  # one call per GPU and sample


def calls_over_samples(ex: Exporter, stats: Path, at_least: int) -> tuple[int, Counter[str]]:
    """Wait until ``ex`` has sampled ``at_least`` more times (one device count each); the
    samples counted and the calls made meanwhile, by function."""
    before = fakenvml.read_stats(stats)
    samples = "nvmlDeviceGetCount_v2"
    ex.wait_for(lambda: fakenvml.read_stats(stats)[samples] >= before[samples] + at_least)
    made = Counter(fakenvml.read_stats(stats))
    made.subtract(before)
    return made[samples], made


def test_an_entry_the_driver_does_not_know_is_read_by_its_getter(
    start_exporter: Callable[..., Exporter], tmp_path: Path
) -> None:
    """A driver before 580 has no NVML_FI_DEV_GPU_TEMP (308): that entry answers alone
    (INVALID_ARGUMENT or NOT_SUPPORTED), and the temperature comes from its getter from then
    on, every sample — present, equal, and no error counted."""
    stats = tmp_path / "calls.stats"
    old_driver = {"field:308": "INVALID_ARGUMENT", "field:185": "NOT_SUPPORTED"}  # + no average
    gpus = [FakeGpu(temperature_c=64, power_usage_mw=70_000, errors=old_driver), FakeGpu()]
    ex = start_exporter(gpus, stats=stats)
    s = ex.samples()
    ids0 = (("gpu", "0"), ("uuid", _uuid(0)))
    assert s[("gpu_temperature_celsius", ids0)] == 64
    assert s[("gpu_power_draw_watts", ids0)] == 70  # the instant value: no getter needed
    assert not [k for k in s if k[0] == "gpu_exporter_nvml_errors_total"]
    unsupported = {dict(k[1])["field"] for k in s if k[0] == "gpu_exporter_field_supported"}
    assert not unsupported & {"temperature", "power_draw"}
    samples, made = calls_over_samples(ex, stats, 4)
    getter = made["nvmlDeviceGetTemperature"]
    assert samples <= getter <= samples + 1  # GPU 0 only; GPU 1's comes from the batch
    assert "nvmlDeviceGetPowerUsage" not in fakenvml.read_stats(stats)


# -- GPM and per-process utilization (issue 25) -------------------------------------------------
# What a real H100 answered under bf16 matmuls (docs/real-gpu.md): SM activity 96 %, tensor
# 93 %, occupancy 14 %, DRAM 25 %, the non-tensor pipes 0; PCIe in MiB/s.
H100_BUSY = {1: 97.0, 2: 96.0, 3: 14.0, 5: 93.0, 7: 93.0, 9: 0.0, 6: 0.0, 10: 25.0}
H100_BUSY |= {11: 0.0, 12: 0.0, 13: 0.0, 20: 12.5, 21: 300.0, 60: 0.0, 61: 0.0}
GPM = ("--gpm-interval", "0.2")


def test_gpm_through_the_real_bindings_in_base_units_and_absent_without_it(
    start_exporter: Callable[..., Exporter],
) -> None:
    gpus = [
        FakeGpu(name="NVIDIA H100 80GB HBM3", gpm=H100_BUSY, process_utilization=((77, 91, 30),),
                processes=((77, GiB),)),
        FakeGpu(processes=((88, GiB),)),  # an A100: no GPM, and NVML saw no process working
    ]  # fmt: skip
    ex = start_exporter(gpus, args=GPM)
    ids0 = {"gpu": "0", "uuid": _uuid(0)}
    ex.wait_for(lambda: ex.value("gpu_sm_active_ratio", **ids0) is not None)
    s = ex.samples()

    def v(name: str, gpu: int = 0, **extra: str) -> float | None:
        labels = {"gpu": str(gpu), "uuid": _uuid(gpu), **extra}
        return s.get((name, tuple(sorted(labels.items()))))

    assert v("gpu_sm_active_ratio") == 0.96
    assert v("gpu_graphics_active_ratio") == 0.97
    assert v("gpu_sm_occupancy_ratio") == 0.14
    assert v("gpu_tensor_active_ratio") == 0.93
    assert v("gpu_tensor_pipe_active_ratio", pipe="hmma") == 0.93
    assert v("gpu_tensor_pipe_active_ratio", pipe="imma") == 0.0
    assert v("gpu_fp_pipe_active_ratio", precision="fp64") == 0.0
    assert v("gpu_dram_active_ratio") == 0.25
    assert v("gpu_pcie_traffic_bytes_per_second", direction="tx") == 12.5 * 2**20
    assert v("gpu_pcie_traffic_bytes_per_second", direction="rx") == 300 * 2**20
    assert v("gpu_nvlink_traffic_bytes_per_second", direction="tx") == 0.0
    # GPU 1 (an A100) has no GPM: no series at all, and "gpm" among its unsupported fields.
    assert not [k for k in s if k[0].startswith(("gpu_sm_", "gpu_tensor", "gpu_dram")) and
                dict(k[1])["gpu"] == "1"]  # fmt: skip
    assert v("gpu_exporter_field_supported", 1, field="gpm") == 0
    assert v("gpu_exporter_field_supported", 0, field="gpm") is None
    # Per process: the job's sample; NOT_FOUND on GPU 1 (nobody worked) is 0, not an error.
    assert v("gpu_process_sm_utilization_ratio", pid="77") == 0.91
    assert v("gpu_process_memory_utilization_ratio", pid="77") == 0.30
    assert v("gpu_process_sm_utilization_ratio", 1, pid="88") == 0.0
    assert not [k for k in s if k[0] == "gpu_exporter_nvml_errors_total"]


def test_a_failing_gpm_call_on_one_gpu_and_a_lost_gpu_frees_its_gpm_samples(
    start_exporter: Callable[..., Exporter], tmp_path: Path
) -> None:
    stats = tmp_path / "gpm.stats"
    h100 = {"name": "NVIDIA H100 80GB HBM3", "gpm": H100_BUSY}
    gpus = [
        FakeGpu(**h100),  # type: ignore[arg-type]
        FakeGpu(**h100, errors={"nvmlGpmMetricsGet": "UNKNOWN"}),  # type: ignore[arg-type]
        FakeGpu(**h100),  # type: ignore[arg-type]
    ]
    ex = start_exporter(gpus, args=GPM, stats=stats)
    ids = [{"gpu": str(i), "uuid": _uuid(i)} for i in range(3)]
    ex.wait_for(lambda: ex.value("gpu_sm_active_ratio", **ids[2]) is not None)
    assert ex.value("gpu_sm_active_ratio", **ids[0]) == 0.96
    assert ex.value("gpu_sm_active_ratio", **ids[1]) is None  # absent, not 0 …
    assert ex.value("gpu_up", **ids[1]) == 1  # … and the GPU is still up
    errors = {"function": "nvmlGpmMetricsGet", "error": "UNKNOWN"}
    assert (ex.value("gpu_exporter_nvml_errors_total", **errors) or 0) >= 1
    calls = fakenvml.read_stats(stats)
    assert calls["nvmlGpmSampleAlloc"] == 6 and calls.get("nvmlGpmSampleFree", 0) == 0
    # GPU 2 falls off the bus: its two buffers are freed, the others keep theirs.
    ex.write([gpus[0], gpus[1], FakeGpu(**h100, errors={"*": "GPU_IS_LOST"})])  # type: ignore[arg-type]
    ex.wait_for(lambda: ex.value("gpu_up", **ids[2]) == 0)
    ex.wait_for(lambda: fakenvml.read_stats(stats).get("nvmlGpmSampleFree", 0) == 2)
    assert ex.value("gpu_sm_active_ratio", **ids[0]) == 0.96
    # It comes back: new buffers, and GPM again.
    ex.write(gpus)
    ex.wait_for(lambda: ex.value("gpu_sm_active_ratio", **ids[2]) == 0.96)
    assert fakenvml.read_stats(stats)["nvmlGpmSampleAlloc"] == 8
    # On shutdown every buffer still held is freed.
    ex.proc.terminate()
    ex.proc.wait(10)
    calls = fakenvml.read_stats(stats)
    assert calls["nvmlGpmSampleFree"] == calls["nvmlGpmSampleAlloc"] == 8


def test_mig_gpu_instance_gpm_and_the_structs_versions_through_the_bindings(
    fake_lib: Path, tmp_path: Path
) -> None:
    """nvmlGpmMigSampleGet through the parent's handle, per-metric return codes, and the
    version fields nvml.h asks for (the fake refuses a wrong one, as the driver does)."""
    config = tmp_path / "mig.conf"
    fakenvml.write_config(config, [FakeGpu(gpm=H100_BUSY, gpm_instances={1: 40, 2: 7})])
    out = _run_python(
        fake_lib,
        config,
        "from gpu_exporter.nvml import Nvml\n"
        "n = Nvml(); n.init(); h = n.handle(0)\n"
        "a, b = n.gpm_sample_alloc(), n.gpm_sample_alloc()\n"
        "for gi in (1, 2, None):\n"
        "    n.gpm_sample_get(h, a, gi); n.gpm_sample_get(h, b, gi)\n"
        "    m = n.gpm_metrics(a, b)\n"
        "    print(gi, m['sm_active_ratio'], len(m))\n"
        "try:\n"
        "    n.gpm_sample_get(h, a, 5)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc.error)\n"
        "n.gpm_sample_free(a); n.gpm_sample_free(b)\n",
    )
    assert out.splitlines() == [
        "1 0.4 1",  # an instance answers SM activity only: the rest are left out, not 0
        "2 0.07 1",
        f"None 0.96 {len(H100_BUSY)}",
        "NvmlError NOT_FOUND",
    ]


# -- clock event reason durations and fabric info, read through pynvml itself ----------------
# (not through gpu_exporter: the fake is the oracle the exporter's reading is checked against)

THROTTLE_IDS = [*fakenvml.CLOCKS_EVENT_FIELDS.values(), 75]  # 75: PERF_POLICY_THERMAL
READ_THROTTLE = (
    "import json, pathlib, sys, time\n"
    "import pynvml\n"
    "sys.path.insert(0, 'tests')\n"
    "import fakenvml\n"
    "pynvml.nvmlInit()\n"
    "def read(gpus, ids):\n"
    "    start = time.monotonic()\n"
    "    values = [[(v.nvmlReturn, v.valueType, v.value.ullVal) for v in\n"
    "               pynvml.nvmlDeviceGetFieldValues(pynvml.nvmlDeviceGetHandleByIndex(i), ids)]\n"
    "              for i in range(gpus)]\n"
    "    return start, time.monotonic(), values\n"
)
ULL = 3  # NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
NOT_SUPPORTED = 3  # NVML_ERROR_NOT_SUPPORTED


def _grew_at(before: Any, after: Any, gpu: int, entry: int, rate: float) -> bool:
    """Whether that entry grew by ``rate`` (ns/s) times the time between the two reads: at
    least from the first read's end to the second's start, at most from start to end."""
    (s0, e0, values0), (s1, e1, values1) = before, after
    (r0, t0, v0), (r1, t1, v1) = values0[gpu][entry], values1[gpu][entry]
    assert (r0, t0, r1, t1) == (0, ULL, 0, ULL)
    return rate * (s1 - e0) - 1 <= v1 - v0 <= rate * (e1 - s0) + 1


def test_clock_event_durations_grow_at_their_rates_through_the_real_bindings(
    fake_lib: Path, tmp_path: Path
) -> None:
    config = tmp_path / "throttle.conf"
    gpus = [
        FakeGpu(
            clocks_event_rates={"sw_power_cap": 2e8, "hw_therm_slowdown": 1e9},
            clocks_event_ns={"sync_boost": 12_345},
        ),
        FakeGpu(),  # idle (the default): nothing grows
        FakeGpu(utilization_gpu=80),  # under load: its power cap now and then
        FakeGpu(health={"clocks_event_reasons": 0x4}),  # power capped now: all along
        FakeGpu(utilization_gpu=80, clocks_event_durations=False),
    ]
    fakenvml.write_config(config, gpus)
    out = _run_python(
        fake_lib,
        config,
        READ_THROTTLE
        + f"a = read(5, {THROTTLE_IDS}); time.sleep(0.3); b = read(5, {THROTTLE_IDS})\n"
        "print(json.dumps([a, b]))\n",
    )
    a, b = json.loads(out)
    sw_power_cap, sync_boost, sw_therm, hw_therm, hw_brake, perf_policy_thermal = range(6)
    assert _grew_at(a, b, 0, sw_power_cap, 2e8) and _grew_at(a, b, 0, hw_therm, 1e9)
    for read in (a, b):
        assert read[2][0][sync_boost] == [0, ULL, 12_345]  # its value at load, growing at 0
        assert read[2][0][sw_therm] == read[2][0][hw_brake] == [0, ULL, 0]
        assert read[2][0][perf_policy_thermal] == read[2][0][sw_therm]
        assert read[2][1] == [[0, ULL, 0]] * 6
        assert [entry[2] for entry in read[2][2][1:]] == [0] * 5
        assert [entry[0] for entry in read[2][4]] == [NOT_SUPPORTED] * 6
    assert _grew_at(a, b, 2, sw_power_cap, fakenvml.LOADED_SW_POWER_CAP_NS_PER_S)
    assert b[2][2][sw_power_cap][2] > a[2][2][sw_power_cap][2] > 0
    assert _grew_at(a, b, 3, sw_power_cap, 1e9)


def test_a_new_rate_counts_from_then_and_the_slowdown_ids_can_be_the_older_ones(
    fake_lib: Path, tmp_path: Path
) -> None:
    """A duration never goes backwards when the file changes: the time so far stays at the old
    rate. And the three slowdown durations can answer at 251-253 (nvml.h 13.0.39, nvidia-ml-py
    12.575 to 13.580.65) instead of 269-271, which then answer NOT_SUPPORTED."""
    config = tmp_path / "rates.conf"
    fakenvml.write_config(config, [FakeGpu(clocks_event_rates={"hw_power_brake_slowdown": 1e9})])
    out = _run_python(
        fake_lib,
        config,
        READ_THROTTLE + "ids = [251, 252, 253, 269, 270, 271]\n"
        "a = read(1, ids); time.sleep(0.2); b = read(1, ids)\n"
        f"fakenvml.write_config(pathlib.Path({str(config)!r}), [fakenvml.FakeGpu(\n"
        "    clocks_event_rates={'hw_power_brake_slowdown': 0})],\n"
        "    clocks_event_slowdown_ids=(251, 252, 253))\n"
        "c = read(1, ids); time.sleep(0.2); d = read(1, ids)\n"
        "print(json.dumps([a, b, c, d]))\n",
    )
    a, b, c, d = json.loads(out)
    assert [e[0] for e in a[2][0][:3]] == [NOT_SUPPORTED] * 3  # 251-253: power smoothing's
    assert _grew_at(a, b, 0, 5, 1e9)
    before = b[2][0][5][2]
    assert [e[0] for e in c[2][0][3:]] == [NOT_SUPPORTED] * 3
    assert c[2][0][:2] == d[2][0][:2] == [[0, ULL, 0]] * 2
    assert c[2][0][2][2] >= before  # not back to 0, and what it grew until the change
    assert d[2][0][2] == c[2][0][2]  # at 0 ns/s since


FABRIC_V = (
    "import ctypes, pathlib, sys\n"
    "import pynvml\n"
    "sys.path.insert(0, 'tests')\n"
    "import fakenvml\n"
    "pynvml.nvmlInit()\n"
    "def fabric(i, info=None, function=pynvml.nvmlDeviceGetGpuFabricInfoV):\n"
    "    info = pynvml.c_nvmlGpuFabricInfoV_t() if info is None else info\n"
    "    try:\n"
    "        function(pynvml.nvmlDeviceGetHandleByIndex(i), ctypes.byref(info))\n"
    "    except pynvml.NVMLError as exc:\n"
    "        return exc.value\n"
    "    return info\n"
)


def test_fabric_info_through_the_real_bindings_and_not_supported_per_gpu(
    fake_lib: Path, tmp_path: Path
) -> None:
    config = tmp_path / "fabric.conf"
    uuid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    gpus = [
        FakeGpu(fabric=Fabric(clique_id=7, cluster_uuid=uuid, health_mask=0xAA, health_summary=1)),
        FakeGpu(fabric="NOT_SUPPORTED"),  # overrides every_gpu's
        FakeGpu(fabric=Fabric(state=fakenvml.FABRIC_STATE_IN_PROGRESS, clique_id=0)),
        FakeGpu(fabric=Fabric(status="UNKNOWN")),  # registration failed
        FakeGpu(fabric=Fabric(state=fakenvml.FABRIC_STATE_NOT_SUPPORTED, clique_id=0)),
        FakeGpu(errors={"nvmlDeviceGetGpuFabricInfoV": "GPU_IS_LOST"}),
    ]
    fakenvml.write_config(config, gpus, every_gpu=FakeGpu(fabric=Fabric()))
    out = _run_python(
        fake_lib,
        config,
        FABRIC_V + "for i in range(6):\n"
        "    f = fabric(i)\n"
        "    print(f if isinstance(f, int) else (hex(f.version), bytes(f)[4:20].hex(), f.status,\n"
        "          f.cliqueId, f.state, f.healthMask))\n"
        # v3 (nvml.h's nvmlGpuFabricInfoV_t) adds healthSummary; a v2 call leaves it alone
        "v3 = fabric(0, pynvml.c_nvmlGpuFabricInfo_v3_t())\n"
        "v2 = pynvml.c_nvmlGpuFabricInfo_v3_t(); v2.version = pynvml.nvmlGpuFabricInfo_v2\n"
        "v2.healthSummary = 0x5A; fabric(0, v2)\n"
        "odd = pynvml.c_nvmlGpuFabricInfo_v3_t(); odd.version = 0x01000024\n"
        "print(v3.healthSummary, v3.cliqueId, v2.healthSummary, v2.cliqueId, fabric(0, odd))\n"
        # the deprecated unversioned call: nvmlGpuFabricInfo_t, no health
        "v1 = fabric(0, pynvml.c_nvmlGpuFabricInfo_t(), pynvml.nvmlDeviceGetGpuFabricInfo)\n"
        "print(bytes(v1)[:16].hex(), v1.status, v1.cliqueId, v1.state)\n"
        # the default: NOT_SUPPORTED, as an A100 answers
        f"fakenvml.write_config(pathlib.Path({str(config)!r}), [fakenvml.FakeGpu()])\n"
        "print(fabric(0), fabric(0, pynvml.c_nvmlGpuFabricInfo_t(), pynvml.nvmlDeviceGetGpuFabricInfo))\n",
    )
    hex_uuid, default_uuid = uuid.replace("-", ""), Fabric().cluster_uuid.replace("-", "")
    assert out.splitlines() == [
        f"('0x2000024', '{hex_uuid}', 0, 7, 3, 170)",
        "3",  # NVML_ERROR_NOT_SUPPORTED
        f"('0x2000024', '{default_uuid}', 0, 0, 2, 0)",
        f"('0x2000024', '{default_uuid}', 999, 1, 3, 0)",
        f"('0x2000024', '{default_uuid}', 0, 0, 0, 0)",  # answered, its state NOT_SUPPORTED
        "15",  # NVML_ERROR_GPU_IS_LOST
        "1 7 90 7 25",  # 25: NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        f"{hex_uuid} 0 7 3",
        "3 3",
    ]


# -- issue 36: values added through one row of gpu_exporter/readings.py ------------------------


def test_the_exporter_counts_each_clock_event_reason_in_seconds_and_none_where_unsupported(
    start_exporter: Callable[..., Exporter],
) -> None:
    """NVML's cumulative ns per reason as gpu_clocks_event_duration_seconds_total, from the
    slow field-value batch; a card whose driver refuses them has no such series (and says
    so in gpu_exporter_field_supported), the others keep theirs, nothing counts as an error."""
    still = dict.fromkeys(fakenvml.CLOCKS_EVENT_FIELDS, 0.0)  # exact values: nothing grows
    ex = start_exporter(
        [
            FakeGpu(
                clocks_event_rates=still,
                clocks_event_ns={"sw_power_cap": 3_000_000_000, "hw_therm_slowdown": 500_000_000},
            ),
            FakeGpu(clocks_event_rates=still, clocks_event_durations=False),
        ]
    )
    s = ex.samples()
    durations = {
        (labels["gpu"], labels["reason"]): value
        for (name, pairs), value in s.items()
        if name == "gpu_clocks_event_duration_seconds_total"
        for labels in (dict(pairs),)
    }
    assert durations == {
        ("0", "sw_power_cap"): 3.0,
        ("0", "sync_boost"): 0.0,
        ("0", "sw_thermal_slowdown"): 0.0,
        ("0", "hw_thermal_slowdown"): 0.5,
        ("0", "hw_power_brake"): 0.0,
    }
    unsupported = {
        dict(pairs)["field"]
        for (name, pairs), _ in s.items()
        if name == "gpu_exporter_field_supported" and dict(pairs)["gpu"] == "1"
    }
    assert "clocks_event_duration_sw_power_cap" in unsupported
    assert not [k for k in s if k[0] == "gpu_exporter_nvml_errors_total"]


def test_the_fabric_state_status_and_clique_where_the_gpu_has_a_fabric_and_none_elsewhere(
    start_exporter: Callable[..., Exporter],
) -> None:
    """nvmlDeviceGetGpuFabricInfoV through the real bindings: a registered card, one whose
    probe failed, and absent both where the call refuses and where it answers the state
    NOT_SUPPORTED (an H100 PCIe); no error counted for either."""
    ex = start_exporter(
        [
            FakeGpu(fabric=fakenvml.Fabric(clique_id=7)),
            FakeGpu(fabric="NOT_SUPPORTED"),
            FakeGpu(fabric=fakenvml.Fabric(state=fakenvml.FABRIC_STATE_NOT_SUPPORTED)),
            FakeGpu(fabric=fakenvml.Fabric(state=fakenvml.FABRIC_STATE_IN_PROGRESS, status=3)),
        ]
    )
    s = ex.samples()
    fabric = {
        (name, dict(pairs)["gpu"]): value
        for (name, pairs), value in s.items()
        if name.startswith("gpu_fabric_")
    }
    assert fabric == {
        ("gpu_fabric_state", "0"): 3,
        ("gpu_fabric_status", "0"): 0,
        ("gpu_fabric_clique_id", "0"): 7,
        ("gpu_fabric_state", "3"): 2,
        ("gpu_fabric_status", "3"): 3,
        ("gpu_fabric_clique_id", "3"): 1,
    }
    unsupported = {
        dict(pairs)["gpu"]
        for (name, pairs), _ in s.items()
        if name == "gpu_exporter_field_supported" and dict(pairs)["field"] == "fabric"
    }
    assert unsupported == {"1", "2"}
    assert not [k for k in s if k[0] == "gpu_exporter_nvml_errors_total"]
