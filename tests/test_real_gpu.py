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
    } <= ok
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
