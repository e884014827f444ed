"""bench/real_gpu.py, the real-driver check, cannot rot: its --self-test runs every step over
the fake library and a fake nvidia-smi; its comparisons fail where the values differ."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import fakenvml

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("install", "serve", "values", "families", "idle", "claim", "memory lease", "jax")


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("real_gpu", ROOT / "bench" / "real_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["real_gpu"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_self_test_runs_every_step_and_passes(tmp_path: Path) -> None:
    try:
        fakenvml.compiler()
        fakenvml.nvml_header_dir()
    except fakenvml.BuildUnavailable as exc:
        pytest.skip(f"the self-test needs the fake NVML library: {exc}")
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "bench/real_gpu.py", "--self-test", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads((out / "report.json").read_text())
    failed = [c for c in report["checks"] if c["status"] == "fail"]
    assert result.returncode == 0 and not failed, (failed, result.stderr[-3000:])
    by_step: dict[str, list[dict[str, str]]] = {}
    for check in report["checks"]:
        by_step.setdefault(check["step"], []).append(check)
    assert set(STEPS) <= set(by_step), set(by_step)
    # installed from a wheel, not run from the checkout
    (imported,) = [c for c in by_step["install"] if "import" in c["name"]]
    assert "/site/gpu_exporter/" in imported["detail"]
    # the values: every comparison nvidia-smi could answer, and the N/A ones absent here too
    values = [c for c in by_step["values"] if c["status"] == "ok"]
    assert len(values) >= 40
    assert any("fan.speed" in c["name"] and "[N/A]; ours absent" in c["detail"] for c in values)
    # what needs CUDA is skipped, visibly, with the reason
    skipped = {c["name"]: c["detail"] for c in report["checks"] if c["status"] == "skipped"}
    assert skipped["PyTorch's cap, as seen from inside torch"] == "self-test: no CUDA"
    assert "no CUDA" in skipped["JAX's cap (XLA_PYTHON_CLIENT_MEM_FRACTION)"]
    assert all(skipped.values())
    # the lease steps ran for real over the exporter
    ok = {c["name"] for c in report["checks"] if c["status"] == "ok"}
    assert {
        "the claim ends when its job's process arrives",
        "/choose refuses the busy card under the default 'free'",
        "the memory lease holds 8 GiB and names the job's PID",
        "the overrun metric shows memory past the share",
        "run exits with the job's status and releases the lease",
        "gpu-exporter stops on SIGTERM",
        "no process left running",
        # what the exporter gained untested on a real driver, through the fake H100
        "temperature.memory vs gpu_memory_temperature_celsius",
        "GPM at idle: SM and tensor activity present, near 0",
        "the job's PID in gpu_process_sm_utilization_ratio, high",
        "GPM while the matmuls run: SM and tensor activity high",
        "GPM agrees with the probe's own reading during the matmuls",
        "the exporter's NVML calls per GPU per sample (idle)",
        "the exporter's NVML calls per GPU per sample (busy)",
    } <= ok
    details = {c["name"]: c["detail"] for c in report["checks"]}
    assert (
        "nvidia-smi 38, ours 38" in details["temperature.memory vs gpu_memory_temperature_celsius"]
    )
    assert (
        "gpu_sm_active_ratio 0.96, gpu_tensor_active_ratio 0.93"
        in (details["GPM while the matmuls run: SM and tensor activity high"])
    )
    assert report["measurements"]["gpm_busy"]["gpu_dram_active_ratio"] == 0.25
    # the probe counts the exporter's own NVML calls per GPU and sample (issue 31): its fast
    # calls (7 on the fake card) and a 30th of its slow ones, the handle not among them
    calls = report["measurements"]["probe_idle"]["calls"]
    assert 7 <= calls["per_gpu_per_sample"] <= 8, calls
    assert "nvmlDeviceGetHandleByIndex" not in calls["by_function"]
    summary = (out / "summary.md").read_text()
    assert (
        "| Step | Check | Result | Detail |" in summary and "(self-test: fake library)" in summary
    )
    assert "==> gpu-exporter.log <==" in (out / "logs.txt").read_text()


def test_a_comparison_fails_where_the_values_differ() -> None:
    rg = script()
    report = rg.Report(Path("/nonexistent"), "self-test")
    scrape = rg.Scrape(
        "# TYPE gpu_memory_used_bytes gauge\n"
        'gpu_memory_used_bytes{gpu="0",uuid="GPU-a"} 1073741824\n'
    )
    used = rg.Comparison("memory.used", "gpu_memory_used_bytes", scale=rg.MiB, absolute=rg.MiB)
    used.check(report, "1024", scrape, scrape, set())  # 1 GiB both ways
    used.check(report, "2048", scrape, scrape, set())  # nvidia-smi says 2 GiB
    used.check(report, "[N/A]", scrape, scrape, set())  # nvidia-smi cannot, we do
    fan = rg.Comparison("fan.speed", "gpu_fan_speed_ratio", scale=0.01, nvml_field="fan_speed")
    fan.check(report, "30", scrape, scrape, {"fan_speed"})  # nvidia-smi has it, we lack it
    assert [c.status for c in report.checks] == ["ok", "fail", "fail", "fail"]
    assert "fan_speed unsupported" in report.checks[3].detail
    markdown = rg.summary(
        {
            "meta": {"mode": "real", "started": "today"},
            "checks": [c.__dict__ for c in report.checks],
            "measurements": {},
        }
    )
    assert "1 ok, 3 failed" in markdown


def test_the_gpm_checks_without_gpm_and_with_it_wrong() -> None:
    rg = script()
    report = rg.Report(Path("/nonexistent"), "self-test")
    uuid = "GPU-a"
    idle = rg.Scrape(
        "# TYPE gpu_sm_active_ratio gauge\n"
        f'gpu_sm_active_ratio{{gpu="0",uuid="{uuid}"}} 0.4\n'
        "# TYPE gpu_exporter_field_supported gauge\n"
        f'gpu_exporter_field_supported{{gpu="0",uuid="{uuid}",field="gpm"}} 0\n'
    )
    bare = rg.Scrape(
        "# TYPE gpu_exporter_field_supported gauge\n"
        f'gpu_exporter_field_supported{{gpu="0",uuid="{uuid}",field="gpm"}} 0\n'
    )
    without, with_ = {"gpm": {"supported": False}}, {"gpm": {"supported": True, "metrics": {}}}
    rg.gpm_idle(report, bare, uuid, without)  # no GPM, no series, the marker: ok
    rg.gpm_idle(report, idle, uuid, without)  # no GPM, yet a series
    rg.gpm_idle(report, idle, uuid, with_)  # GPM: 0.4 idle, no tensor, and the marker
    rg.gpm_idle(report, bare, uuid, {"gpm": {"supported": "error: ..."}})
    assert [c.status for c in report.checks] == ["ok", "fail", "fail", "info", "skipped"]
    assert 'field="gpm"} 0' in report.checks[0].detail


def test_memory_temperature_skipped_where_nvidia_smi_cannot_say_and_calls_bounded() -> None:
    rg = script()
    report = rg.Report(Path("/nonexistent"), "self-test")
    (memory,) = [c for c in rg.COMPARISONS if c.smi == "temperature.memory"]
    scrape = rg.Scrape(
        "# TYPE gpu_memory_temperature_celsius gauge\n"
        'gpu_memory_temperature_celsius{gpu="0",uuid="GPU-a"} 40\n'
    )
    memory.check(report, "41", scrape, scrape, set())
    memory.check(report, "45", scrape, scrape, set())
    memory.check(report, "[N/A]", scrape, scrape, set())
    calls = {"per_gpu_per_sample": 7.4, "by_function": {"nvmlDeviceGetFieldValues": 1.03}}
    rg.calls_per_sample(report, "idle", calls)
    rg.calls_per_sample(report, "idle", calls | {"per_gpu_per_sample": 8.6})  # over 8
    rg.calls_per_sample(report, "busy", calls | {"per_gpu_per_sample": 8.6})  # a process: 9
    rg.calls_per_sample(report, "idle", {"per_gpu_per_sample": 7.4, "by_function": {}})
    rg.calls_per_sample(report, "idle", {"error": "no NVML"})
    statuses = [c.status for c in report.checks]
    assert statuses == ["ok", "fail", "skipped", "ok", "fail", "ok", "fail", "fail"]
    assert "nothing to compare; ours 40" in report.checks[2].detail
