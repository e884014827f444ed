"""Issue 13, point 9: "free" means free by default (``--choose-defaults``, GPUtil's 50 %/50 %).

Issue 27, point 1: GPUtil's second 50 % is memory occupancy (used ÷ total), not
memory-controller utilization: ``max_util=50%&max_mem_used=50%``.

A ``/choose`` with no filters used to hand out the least-busy card even when every card was
97 % busy, and ``wait=`` without filters never waited. Each test here fails on that code.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from conftest import build_stack, sim_of
from fleets import NOW, claimed, fake_fetch, gpu, host_results
from gpu_exporter import client
from gpu_exporter.choose.defaults import SHIPPED_DEFAULTS, parse_defaults
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.request import parse_choose_args, parse_cluster_args
from gpu_exporter.client import Choice, NoGpusAvailable
from gpu_exporter.client.choosing import http_claimer
from gpu_exporter.daemon import BuildError
from gpu_exporter.fleet.inventory import Fleet, Host
from gpu_exporter.fleet.placing import choose_fleet
from gpu_exporter.nvml import Nvml
from gpu_exporter.simulate import Load, Scenario, SimGpu, SimulatedNvml
from served import served

A100 = "NVIDIA A100-SXM4-80GB"
ANY_LOAD = "max_util=100%&max_mem_used=100%"
SERVE = (sys.executable, "-m", "gpu_exporter", "serve")


def busy_box() -> Any:
    """Two cards, both 97 % busy with 86 % of memory used: nothing is free."""
    return sim_of(SimGpu(0, A100, Load("busy")), SimGpu(1, A100, Load("busy")))


def test_a_busy_card_is_not_handed_out_without_filters() -> None:
    s = build_stack(busy_box())
    s.sample()
    resp = s.client.get("/choose?n=1&format=json")
    assert resp.status_code == 503
    error = resp.get_json()["error"]
    assert error["code"] == "not_enough_gpus"
    assert "utilization 0.97 > max_util 0.50" in error["message"]
    assert "memory used 0.85 > max_mem_used 0.50" in error["message"]
    assert s.leases.active(s.cache.get()) == ()
    # A request overrides each default: 100 % turns it off.
    assert s.client.get(f"/choose?n=2&lease=0&{ANY_LOAD}").status_code == 200
    half = s.client.get("/choose?n=1&lease=0&max_util=100%")  # max_mem_used still 50 %
    assert half.status_code == 503 and "max_mem_used 0.50" in half.text


def test_json_shows_the_filters_applied_and_where_each_came_from() -> None:
    s = build_stack(lambda c: SimulatedNvml.of(Scenario.with_gpus(2), clock=c.monotonic))
    s.sample()
    body = s.client.get("/choose?format=json&lease=0&max_util=0.9&min_free=1GiB").get_json()
    assert body["filters"] == {
        "max_mem_used": {"value": 0.5, "from": "default"},
        "max_util": {"value": 0.9, "from": "request"},
        "min_free": {"value": 2**30, "from": "request"},
    }


def test_the_server_sets_its_own_defaults_and_none_at_all() -> None:
    s = build_stack(busy_box(), choose_defaults="max_util=99%&exclude=1")
    s.sample()
    body = s.client.get("/choose?format=json&lease=0").get_json()
    assert [g["index"] for g in body["chosen"]] == [0]  # 0.97 ≤ 0.99; GPU 1 excluded
    assert body["filters"]["exclude"] == {"value": ["1"], "from": "default"}
    assert "max_mem_used" not in body["filters"]
    none = build_stack(busy_box(), choose_defaults="")
    none.sample()
    assert none.client.get("/choose?n=2&lease=0").status_code == 200
    # The status page's recommendation is what /choose?n=1 would give: nothing here.
    s = build_stack(busy_box())
    s.sample()
    assert "would find no GPU now" in s.client.get("/").text


def test_a_mig_device_passes_a_default_it_cannot_report_but_not_a_requested_filter() -> None:
    s = build_stack(sim_of(SimGpu(0, A100, Load("light"), mig=("3g.40gb",))))
    s.sample()
    assert s.client.get("/choose?mig=only&lease=0").text.startswith("MIG-")
    asked = s.client.get("/choose?mig=only&lease=0&max_util=50%")
    assert asked.status_code == 503 and "utilization unknown" in asked.text


def test_wait_without_filters_really_waits_when_every_card_is_busy() -> None:
    busy = SimulatedNvml(
        [SimGpu(0, A100, Load("busy")), SimGpu(1, A100, Load("busy"))], clock=time.monotonic
    )
    with served(busy) as srv:
        started = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(srv.url + "/choose?n=1&wait=1s", timeout=10)
        waited = time.monotonic() - started
        assert info.value.code == 503
        assert info.value.read().decode().startswith("error: 0 of 2 GPUs qualify")
        assert waited >= 0.9  # it waited for a free card instead of taking a busy one
        assert srv.leases() == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_util=lots", "max_util: expected a ratio"),
        ("n=2", "n is not a filter"),
        ("max_util", "expected NAME=VALUE"),
        ("max_util=1&max_util=2", "given more than once"),
        ("idle_for=20m", "longer than the 600 s of history"),
    ],
)
def test_bad_defaults_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_defaults(text, max_idle_for_seconds=600)
    with pytest.raises(BuildError, match="--choose-defaults"):
        build_stack(busy_box(), choose_defaults=text)


def test_serve_refuses_bad_defaults_in_one_line_with_exit_2() -> None:
    proc = subprocess.run(
        [*SERVE, "--simulate", "1", "--choose-defaults", "max_util=200%"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[1:] == ["try 'gpu-exporter serve --help'"]  # no usage
    assert "--choose-defaults" in proc.stderr and "max_util" in proc.stderr
    shown = subprocess.run(
        [*SERVE, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "max_util=50%&max_mem_used=50%" in shown and "GPUtil" in shown


def busy_fleet() -> dict[str, Any]:
    return host_results({"a:9400": gpu("a:9400", 0, util=0.9)})


def test_the_cluster_chooser_applies_the_same_defaults() -> None:
    fetch = fake_fetch({"prometheus": busy_fleet()})
    common: dict[str, Any] = {
        "prometheus": "prom:9090",
        "fetch": fetch,
        "claimer": lambda *_: claimed,
        "release": client.release,
        "wall_clock": lambda: NOW,
    }
    with pytest.raises(ApiError, match=r"utilization 0\.90 > max_util 0\.50"):
        choose_fleet({"n": "1"}, **common)
    chosen = choose_fleet({"n": "1", "max_util": "100%"}, **common)
    assert chosen.to_json()["filters"]["max_util"] == {"value": 1.0, "from": "request"}
    assert chosen.to_json()["filters"]["max_mem_used"] == {"value": 0.5, "from": "default"}
    assert choose_fleet({"n": "1"}, defaults={}, **common).placements  # told otherwise


def test_the_exporters_cluster_choose_uses_its_defaults_and_the_host_its_own() -> None:
    s = build_stack(busy_box(), prometheus_url="http://prom:9090", choose_defaults="max_util=95%")
    assert s.daemon.services.cluster is not None
    assert s.daemon.services.cluster.defaults == {"max_util": "95%"}
    # Only what the request gave goes to the host, which applies its own defaults again.
    args = {"n": "1", "min_free": "1GiB"}
    req = parse_choose_args(args, defaults=SHIPPED_DEFAULTS)
    assert req.filters.get("max_util") == 0.5
    seen: dict[str, Any] = {}

    def fake_choose(n: int, url: str, **kwargs: Any) -> Choice:
        seen.update(kwargs)
        return claimed(Host(url, "h"), n, kwargs["include"])

    creq = parse_cluster_args(args, defaults=SHIPPED_DEFAULTS)
    claim = http_claimer(args, creq, Fleet((), "prometheus", NOW), 5.0, choose_on_host=fake_choose)
    claim(Host("http://h:9400", "h"), 1, ("GPU-a",))
    assert seen["min_free"] == "1GiB"
    assert "max_util" not in seen and "max_mem_used" not in seen


def test_choosing_locally_without_a_server_applies_the_shipped_defaults() -> None:
    def busy_card() -> Nvml:  # GPU 0 of --simulate is the busy one (97 %)
        return Nvml(SimulatedNvml.of(Scenario.with_gpus(2), clock=time.monotonic), simulated=True)

    with pytest.raises(NoGpusAvailable, match=r"max_util 0\.50"):
        client.choose_locally(1, {"include": "0"}, open_nvml=busy_card)
    loaded = {"include": "0", "max_util": 1, "max_mem_used": 1}
    assert client.choose_locally(1, loaded, open_nvml=busy_card).indices == (0,)
