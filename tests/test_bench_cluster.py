"""bench/cluster.py's quick mode runs, and its synthetic fleet is what the chooser expects."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gpu_exporter.choose.filters import Filters
from gpu_exporter.fleet.ranking import rank_fleet
from gpu_exporter.fleet.reading import parse_full

BENCH = Path(__file__).resolve().parent.parent / "bench" / "cluster.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_cluster", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_quick_mode_writes_every_figure(tmp_path: Path) -> None:
    bench = load_bench()
    out = tmp_path / "cluster.json"
    bench.main(["--quick", "--out", str(out)])  # its exit status is the 50 ms verdict: not ours
    result = json.loads(out.read_text())
    assert result["hosts"] == 50 and result["gpus"] == 400
    assert result["series"]["scraped"] == 50  # every GPU host was scraped
    assert result["answer_bytes"]["values"] > 100_000
    for key in ("fetch_ms", "json_decode_ms", "parse_ms"):
        assert result[key] > 0
    assert set(result["rank"]) == {
        "n=1",
        "n=2 min_free=40GiB max_util=10% max_procs=0",
        "n=16 spread",
    }
    assert all(r["candidate_hosts"] > 0 for r in result["rank"].values())
    assert result["exporter"]["gpus"] == 8 and result["exporter"]["per_gpu_series"] >= 8 * 15
    assert result["meta"]["mode"] == "quick"


def test_the_synthetic_fleet_has_stale_down_and_leased_gpus_that_are_passed_over() -> None:
    bench = load_bench()
    answers = bench.synthetic_answers(400)
    results = {name: doc["data"]["result"] for name, doc in answers.items()}
    fleet = parse_full(results, bench.NOW, 60)
    problems = [h.problem for h in fleet.hosts if h.problem]
    assert sum("target down" in p for p in problems) == 4
    assert sum("400 s old" in p for p in problems) == 2
    ranking = rank_fleet(fleet, 1, Filters())
    leased = {u for h in fleet.hosts for u in h.leased}
    chosen_first = {g.uuid for c in ranking.candidates for g in c.qualified}
    assert leased and not leased & chosen_first


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["", "n=2 max_sm_active=20% sort=sm_active"])
def test_quick_store_mode_times_the_chooser_against_a_real_victoria_metrics(
    tmp_path: Path, choice: str
) -> None:
    """The default choice, and one by GPM's SM activity (the H100s report it; the rest are
    judged by utilization), each read both ways from a real store."""
    if shutil.which("victoria-metrics") is None:
        pytest.skip("victoria-metrics not installed (Debian package 'victoria-metrics')")
    bench = load_bench()
    out = tmp_path / "cluster.json"
    chosen = ["--choice", choice] if choice else []
    bench.main(["--quick", "--store", "victoria-metrics", "--out", str(out), *chosen])
    store = json.loads(out.read_text())["store"]
    assert store["choice"] == (choice or bench.STORE_CHOICE)
    assert store["name"] == "victoria-metrics" and list(store["by_gpus"]) == ["400"]
    size = store["by_gpus"]["400"]
    assert size["hosts"] == 50 and size["samples"] > 4 * 2000  # raw and packed, 4 scrapes
    for path in ("full", "packed"):
        figures = size[path]
        for step in ("read", "rank", "end_to_end"):
            assert figures[step]["median_ms"] > 0
        assert figures["peak_python_mib"] > 0 and figures["candidates"] > 0
    # The same choice both ways (the bench itself checks the best 20 hosts and their GPUs).
    assert size["full"]["chosen"] == size["packed"]["chosen"]
    # The packed read brings only the GPUs that pass: under half of them for the default
    # choice; by SM activity, a partly used card passes where its utilization would not.
    share = 0.5 if not choice else 0.6
    assert size["packed"]["gpus_read"] < size["full"]["gpus_read"] * share
