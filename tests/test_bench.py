"""The benchmark runs, quickly, at a small size: bench/run.py --quick (without the peer)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import fakenvml

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
    # 2. sampling: exactly the supported fields of every device, and nothing else
    sampling = report["sampling"]["gpu-exporter"]
    assert sampling["nvml_calls_per_sample"] == sampling["expected_calls_per_sample"] == 121
    assert set(sampling["nvml_calls_by_function"]) >= {"nvmlDeviceGetMemoryInfo_v2"}
    assert "nvmlDeviceGetUUID" not in sampling["nvml_calls_by_function"]  # read once only
    # 3. /choose against the no-op baseline
    for route in ("choose", "healthz"):
        assert report["choose"][route]["requests"] > 0, route
        assert report["choose"][route]["errors"] == 0, route
    # 4. scaling: calls grow linearly with devices (1 + 15 per GPU), 2 calls for a process list
    points = {(p["devices"], p["processes"]): p for p in report["scaling"]}
    assert points[(1, 0)]["nvml_calls_per_sample"] == 1 + 15
    assert points[(64, 0)]["nvml_calls_per_sample"] == 1 + 64 * 15
    assert points[(8, 1000)]["nvml_calls_per_sample"] == 1 + 8 * 16
    # 6. hostile clients: the machinery runs (10 + 10 connections in --quick: a smoke run)
    attacked = report["hostile"]
    assert attacked["worst"]["requests"] > 0
    assert attacked["attack"]["slowloris"]["connected"] > 0
    assert attacked["attack"]["idle"]["connected"] > 0
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
    assert "| 6 | hostile clients (10 slowloris + 10 idle connections)" in text
