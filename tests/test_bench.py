"""The benchmark runs, quickly, at a small size: bench/run.py --quick (without the peer)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import fakenvml
from gpu_exporter.collect.groups import calls_per_gpu
from gpu_exporter.valuerow import FAST, SLOW

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def test_quick_bench_measures_every_group_and_regenerates_the_table(tmp_path: Path) -> None:
    try:
        fakenvml.compiler()
        fakenvml.nvml_header_dir()
    except fakenvml.BuildUnavailable as exc:
        pytest.skip(f"the bench needs the fake NVML library: {exc}")
    out = tmp_path / "exporter-quick.json"
    result = subprocess.run(
        [sys.executable, "bench/run.py", "--quick", "--no-peer", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["meta"]["mode"] == "quick"
    assert "skipped (--no-peer)" in report["meta"]["peer"]

    # 1. /metrics latency
    latency = report["latency"]["gpu-exporter"]
    for phase in ("sequential", "sequential_gzip", "concurrent_16", "sparse"):
        assert latency[phase]["requests"] > 0 and latency[phase].get("errors", 0) == 0, phase
        assert 0 < latency[phase]["p50_ms"] <= latency[phase]["p99_ms"]
    assert latency["sequential_gzip"]["body_bytes"] < latency["sequential"]["body_bytes"] / 3
    # 1. with --kubernetes (a fake kubelet) and without, side by side
    k8s = report["kubernetes"]
    assert k8s["with"]["requests"] > 0 and k8s["with"]["errors"] == 0
    assert k8s["pod_info_series"] == 8 + 2 and k8s["kubelet_calls"] > 0
    assert k8s["without"]["p99_ms"] > 0 and k8s["with"]["p99_ms"] > 0
    # 2. sampling: exactly the fast calls of every device, and nothing else (issue 31: the
    # handle kept; power and temperatures in one field-value batch; memory and video clocks,
    # fan, encoder and decoder every --slow-interval): memory, utilization, the batch, two
    # clocks, clocks event reasons, processes per GPU (no process, so no process
    # utilization; no GPM: the "h100" fake has it); the slow calls (their getters and the
    # slow batch) every 30 s on top. Both counted from the field table (issue 36).
    fast, slow = calls_per_gpu(FAST), calls_per_gpu(SLOW)
    sampling = report["sampling"]["gpu-exporter"]
    assert sampling["expected_calls_per_sample"] == 1 + 8 * fast
    assert 1 + 8 * fast <= sampling["nvml_calls_per_sample"] <= 1 + 8 * fast + 8 * slow / 30 + 0.01
    assert sampling["slow_calls_per_sample"] == 8 * slow / 30
    assert set(sampling["nvml_calls_by_function"]) >= {"nvmlDeviceGetMemoryInfo_v2"}
    assert "nvmlDeviceGetUUID" not in sampling["nvml_calls_by_function"]  # read once only
    assert "nvmlDeviceGetHandleByIndex_v2" not in sampling["nvml_calls_by_function"]
    # 2. calls per GPU per sample (--quick: 8 GPUs with 16 processes; no peer here)
    (calls,) = report["calls"]
    assert (calls["gpus"], calls["processes"]) == (8, 16)
    # (as above, and the processes' utilization: these cards have processes)
    per_gpu = calls["gpu-exporter"]["nvml_calls_per_gpu_per_sample"]
    assert fast + 1 <= per_gpu <= fast + 1 + slow / 30 + 0.01
    # 3. /choose against the no-op baseline
    for route in ("choose", "healthz"):
        assert report["choose"][route]["requests"] > 0, route
        assert report["choose"][route]["errors"] == 0, route
    # 4. scaling: calls grow linearly with devices (1 + 7 per GPU), 1 call for a process list
    # and 1 for its utilization (NOT_FOUND: none of them did anything)
    points = {(p["devices"], p["processes"]): p for p in report["scaling"]}
    assert points[(1, 0)]["nvml_calls_per_sample"] == 1 + 7
    assert points[(64, 0)]["nvml_calls_per_sample"] == 1 + 64 * 7
    assert points[(8, 1000)]["nvml_calls_per_sample"] == 1 + 8 * 8
    # 6. steady-state idle CPU (--quick: 16 processes on 8 GPUs, and 64 GPUs), nobody scraping
    cases = {(c["gpus"], c["processes"]): c["gpu-exporter"] for c in report["idle"]}
    assert set(cases) == {(8, 16), (64, 0)}
    for case in cases.values():
        assert case["cpu_percent_of_one_core"] > 0 and case["nvml_calls_per_minute"] > 0
        assert "nvmlDeviceGetMemoryInfo_v2" in case["nvml_calls_per_minute_by_function"]
    # 7. hostile clients: the machinery runs (10 + 10 connections in --quick: a smoke run)
    attacked = report["hostile"]
    assert attacked["worst"]["requests"] > 0
    assert attacked["attack"]["slowloris"]["connected"] > 0
    assert attacked["attack"]["idle"]["connected"] > 0
    assert attacked["unread"]["worst"]["requests"] > 0
    assert attacked["unread"]["attack"]["pipeline_unread"]["connected"] > 0
    # 5. RSS
    assert 10 < report["rss"]["after_start_mib"] < 500
    assert report["rss"]["requests"] > 1000

    doc = tmp_path / "performance.md"
    doc.write_text("# x\n<!-- bench-table:start -->\nold\n<!-- bench-table:end -->\nrest\n")
    subprocess.run(
        [sys.executable, "bench/run.py", "--report", str(out), "--doc", str(doc)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    )
    text = doc.read_text()
    assert "old" not in text and text.endswith("<!-- bench-table:end -->\nrest\n")
    assert "**Preliminary**" in text and "| 64 | 0 |" in text
    assert "| 1 | `/metrics` p99 ms with / without `--kubernetes`" in text
    assert "| 6 | idle CPU % of one core (s per minute), 64 GPUs, 0 processes |" in text
    assert "| 7 | hostile clients (10 slowloris + 10 idle connections)" in text
    assert "| 7 | hostile clients (2 connections pipelining requests, never reading)" in text


def test_report_takes_group_6_from_an_idle_only_run(tmp_path: Path) -> None:
    """``--report --idle IDLE.json``: the table's group 6 rows come from an ``--idle-only``
    run, and its first line names that run; everything else from the full run's file."""
    full = json.loads((ROOT / "bench" / "results" / "exporter.json").read_text())
    idle_run = {
        "meta": {"date": "2030-01-02T03:04:05+00:00", "wall_seconds": 271.5},
        "idle": [
            {
                "gpus": 8,
                "processes": 0,
                "warmup_seconds": 30.0,
                "ratio_cpu": 0.25,
                "gpu-exporter": {
                    "cpu_percent_of_one_core": 0.123,
                    "cpu_seconds_per_minute": 0.074,
                    "nvml_calls_per_minute": 7004,
                },
                "nvitop-exporter": {
                    "cpu_percent_of_one_core": 0.492,
                    "cpu_seconds_per_minute": 0.295,
                    "nvml_calls_per_minute": 7680,
                },
            }
        ],
    }
    idle_file = tmp_path / "idle.json"
    idle_file.write_text(json.dumps(idle_run))
    full_file = tmp_path / "full.json"
    full_file.write_text(json.dumps(full))
    doc = tmp_path / "performance.md"
    doc.write_text("<!-- bench-table:start -->\nold\n<!-- bench-table:end -->\n")
    command = [sys.executable, "bench/run.py", "--report", str(full_file), "--doc", str(doc)]
    subprocess.run(
        [*command, "--idle", str(idle_file)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    )
    text = doc.read_text()
    assert "Group 6 from a later `--idle-only` run, 2030-01-02T03:04:05+00:00" in text
    assert "(`bench/results/idle.json`, 271.5 s)" in text
    row = "| 6 | idle CPU % of one core (s per minute), 8 GPUs, 0 processes | 0.12 (0.07 s) |"
    assert row in text
    assert "(is 0.25×) | yes |" in text
    assert "16 processes" not in text  # only the idle run's cases
    sequential = full["latency"]["gpu-exporter"]["sequential"]["requests"]
    assert f"| 1 | `/metrics` p50 ms, {sequential:,} sequential |" in text
