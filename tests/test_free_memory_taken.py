"""Issue 27, point 1: a card whose memory is taken is not free, and "free" means one thing.

GPUtil's ``getAvailable`` (the default the README cites) is under 50 % load and under 50 %
memory *occupancy* (used ÷ total); the shipped ``--choose-defaults`` had memory-controller
utilization instead, so an idle notebook or a TensorFlow process that mapped 97 % of a card
(0 % busy) left the card "free". Everything that says "free" now means
``max_util=50%&max_mem_used=50%``: ``/choose``, the status page, ``/openapi.json``, the CLI,
the ``gpu:gpu_free:bool`` rule and the ``GpuNoneFree`` alert (checked in promtool against
what a served ``/choose`` answers for the same cards). Each test fails on the code before.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import promql
from gpu_exporter import client
from gpu_exporter.client import NoGpusAvailable
from gpu_exporter.config import DEFAULT_CHOOSE_DEFAULTS
from gpu_exporter.simulate import DEFAULT_MODEL, Load, SimGpu, SimulatedNvml
from harness import get, run
from served import served

FREE = "max_util=50%&max_mem_used=50%"


def box(*loads: Load) -> SimulatedNvml:
    """One simulated A100 per load, which never changes."""
    gpus = [SimGpu(i, DEFAULT_MODEL, load) for i, load in enumerate(loads)]
    return SimulatedNvml(gpus, clock=time.monotonic)


def held(utilization: float, memory: float) -> Load:
    return Load("constant", utilization=utilization, memory_used_ratio=memory, processes=1)


NOTEBOOK = held(0.0, 0.97)  # an idle notebook's process holding the card's memory
TENSORFLOW = held(0.12, 0.97)  # TF maps the whole card by default; 12 % busy


def test_the_shipped_default_is_occupancy_not_memory_bandwidth() -> None:
    assert DEFAULT_CHOOSE_DEFAULTS == FREE


def test_a_card_whose_memory_is_taken_is_not_handed_out_by_a_plain_choose() -> None:
    with served(box(NOTEBOOK, TENSORFLOW)) as srv:
        status, body = get(srv.url + "/choose?n=1")
        assert status == 503, body
        assert body.startswith("error: 0 of 2 GPUs qualify")
        for i in (0, 1):  # 97 % of what the driver leaves usable
            assert re.search(rf"gpu {i}: memory used 0\.9\d > max_mem_used 0\.50", body)
        assert srv.leases() == []
        with pytest.raises(NoGpusAvailable, match="max_mem_used"):
            client.choose(1, srv.url, lease=0)
        # A request overrides the default; the client passes the filter by name.
        assert client.choose(1, srv.url, lease=0, max_mem_used="100%").indices == (0,)
        shown = srv.get_json("/choose?n=1&lease=0&format=json&max_mem_used=100%")["filters"]
        assert shown == {
            "max_mem_used": {"value": 1.0, "from": "request"},
            "max_util": {"value": 0.5, "from": "default"},
        }


def test_min_free_takes_a_share_of_the_total() -> None:
    # 0: 20 % of its memory free; 1: 40 % free. Both idle.
    with served(box(held(0.0, 0.8), held(0.0, 0.6))) as srv:
        any_memory = "&lease=0&format=index&max_mem_used=100%25"
        assert get(srv.url + "/choose?n=1&min_free=25%25" + any_memory) == (200, "1\n")
        status, body = get(srv.url + "/choose?n=1&min_free=50%25" + any_memory)
        assert status == 503
        assert "free memory 0.40 of total < min_free 0.50" in body
        doc = srv.get_json("/choose?n=1&min_free=25%25&format=json&lease=0&max_mem_used=1")
        assert doc["filters"]["min_free"] == {"value": "25%", "from": "request"}
        status, body = get(srv.url + "/choose?n=1&min_free=125%25")
        assert status == 400 and "min_free" in body


def test_the_status_page_openapi_and_cli_say_what_free_means() -> None:
    with served(box(NOTEBOOK, TENSORFLOW)) as srv:
        status, page = get(srv.url + "/")
        assert status == 200
        text = html.unescape(page)
        assert "would find no GPU now" in text
        assert re.search(r"gpu 1: memory used 0\.9\d > max_mem_used 0\.50", text)
        assert f"Free here means {FREE}" in " ".join(
            text.replace("<code>", "").replace("</code>", "").split()
        )
        doc = srv.get_json("/openapi.json")
    params = {p["name"]: p for p in doc["paths"]["/choose"]["get"]["parameters"]}
    assert "used ÷ total" in params["max_mem_used"]["description"]
    assert "shipped 50%" in params["max_mem_used"]["description"]
    assert "not among the shipped" in params["max_mem_util"]["description"]
    assert FREE in doc["paths"]["/choose"]["get"]["description"]
    code, out, _ = run("choose", "--help")
    assert code == 0
    flat = " ".join(out.split())
    assert "--max-mem-used RATIO" in flat
    assert "--max-util 50% --max-mem-used 50%" in flat
    code, out, _ = run("serve", "--help")
    assert FREE in " ".join(out.split())


def test_a_memory_share_takes_the_utilization_default_but_not_the_occupancy_one() -> None:
    """The decision for ``mem=``: a share on a 97 %-busy card runs at a fraction of its speed,
    so the load default applies; memory is the admission rule's, so occupancy does not (a
    card others use part of is where a share belongs)."""
    busy_and_tight = held(0.97, 0.75)  # the least room: best fit would take it
    idle_but_used = held(0.0, 0.6)  # 60 % of its memory used by another job, idle
    idle = Load("idle")
    with served(box(busy_and_tight, idle_but_used, idle)) as srv:
        base = "/choose?n=1&mem=8GiB&lease=0&format=index"
        assert get(srv.url + base) == (200, "1\n")
        assert get(srv.url + base + "&max_util=100%25") == (200, "0\n")  # overridden
        assert get(srv.url + base + "&max_mem_used=50%25") == (200, "2\n")  # asked for
        filters = srv.get_json(base.replace("index", "json"))["filters"]
        assert filters["max_util"] == {"value": 0.5, "from": "default"}
        assert "max_mem_used" not in filters


# -- the rule and the alert agree with /choose, in promtool ----------------------------------


CARDS = {
    # name: (load, leased) — what a host's cards do; /choose and the rule judge each.
    "tensorflow": (TENSORFLOW, False),
    "notebook": (NOTEBOOK, False),
    "busy": (held(0.6, 0.1), False),
    "quiet": (held(0.12, 0.1), False),
    "half": (held(0.5, 0.5), False),
    "leased": (Load("idle"), True),
}
HOSTS = {"full:9400": ("tensorflow", "notebook", "busy", "leased"), "open:9400": tuple(CARDS)}


def _host(names: tuple[str, ...]) -> tuple[dict[int, bool], list[tuple[str, float]]]:
    """Serve one host of these cards: what /choose says of each (free or not), and the
    series of its /metrics."""
    with served(box(*(CARDS[name][0] for name in names))) as srv:
        for i, name in enumerate(names):
            if CARDS[name][1]:
                status, body = get(f"{srv.url}/choose?n=1&include={i}&lease=5m")
                assert status == 200, body
        verdict = {}
        for i in range(len(names)):
            status, body = get(f"{srv.url}/choose?n=1&lease=0&include={i}")
            assert status in (200, 503), body
            verdict[i] = status == 200
        status, text = get(srv.url + "/metrics")
    assert status == 200
    series = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("gpu_") and not sample.name.startswith("gpu_exporter"):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                series.append((f"{sample.name}{{{labels}}}", sample.value))
    return verdict, series


def _labelled(metric: str, instance: str) -> str:
    name, _, rest = metric.partition("{")
    inside = f'job="gpu-exporter",instance="{instance}"' + ("," + rest[:-1] if rest[:-1] else "")
    return f"{name}{{{inside}}}"


def test_the_free_rule_and_gpu_none_free_agree_with_choose_on_the_shipped_defaults(
    tmp_path: Path,
) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus')")
    rule = next(r for r in promql.rules() if r.get("record") == "gpu:gpu_free:bool")
    used = promql.metric_names(rule["expr"])
    inputs: list[dict[str, str]] = []
    free: list[dict[str, Any]] = []
    expected: dict[str, dict[int, bool]] = {}
    for instance, names in HOSTS.items():
        verdict, series = _host(names)
        expected[instance] = verdict
        for metric, value in series:
            if metric.partition("{")[0] in used:
                inputs.append({"series": _labelled(metric, instance), "values": f"{value!r}x40"})
        for i, is_free in verdict.items():
            uuid = next(
                m.split('uuid="')[1].split('"')[0]
                for m, _ in series
                if m.startswith("gpu_up{") and f'gpu="{i}"' in m
            )
            labels = f'job="gpu-exporter",instance="{instance}",gpu="{i}",uuid="{uuid}"'
            free.append({"labels": f"gpu:gpu_free:bool{{{labels}}}", "value": int(is_free)})
    # What /choose said, card by card (the 12 %-busy card with 97 % memory used).
    assert expected["full:9400"] == {0: False, 1: False, 2: False, 3: False}
    assert expected["open:9400"] == {0: False, 1: False, 2: False, 3: True, 4: True, 5: False}
    alert = promql.alerts()["GpuNoneFree"]
    description = alert["annotations"]["description"].replace("{{ $labels.instance }}", "full:9400")
    tests = {
        "rule_files": [str(promql.RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": inputs,
                "promql_expr_test": [
                    {"expr": "gpu:gpu_free:bool", "eval_time": "5m", "exp_samples": free},
                    {
                        "expr": "instance:gpu_free:sum",
                        "eval_time": "5m",
                        "exp_samples": [
                            {
                                "labels": f'instance:gpu_free:sum{{job="gpu-exporter",'
                                f'instance="{instance}"}}',
                                "value": sum(verdict.values()),
                            }
                            for instance, verdict in expected.items()
                        ],
                    },
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "31m",
                        "alertname": "GpuNoneFree",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "warning",
                                    "job": "gpu-exporter",
                                    "instance": "full:9400",
                                },
                                "exp_annotations": {
                                    "summary": "No free GPU on full:9400 for 30 minutes",
                                    "description": description,
                                },
                            }
                        ],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "free.test.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False, width=1000))
    out = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "a /choose there without filters" in description and "503" in description


def test_the_rule_thresholds_are_written_from_the_shipped_defaults() -> None:
    rule = next(r for r in promql.rules() if r.get("record") == "gpu:gpu_free:bool")
    assert "(gpu_utilization_ratio > 0.5)" in rule["expr"]
    assert "(gpu_memory_used_bytes / gpu_memory_total_bytes > 0.5)" in rule["expr"]
    assert "gpu_memory_utilization_ratio" not in rule["expr"]
    panels = {p.get("title"): p for p in promql.dashboards()["gpu-fleet.json"]["panels"]}
    assert "at most 50 % of its memory used" in panels["Free GPUs"]["description"]
