"""/metrics: every value and unit against the simulated state, absent fields, promtool."""

from __future__ import annotations

import gzip
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from conftest import Stack, build_stack, sim_of
from conftest import without_process_metrics as bare
from gpu_exporter.export.collectors import GpuCollector, PodCollector, WebConfigCollector
from gpu_exporter.export.readme import metrics_table
from gpu_exporter.export.spec import GPM_VALUES, METRICS, SAMPLED
from gpu_exporter.podallocations import PodAllocations
from gpu_exporter.readings import READINGS
from gpu_exporter.revision import revision
from gpu_exporter.simulate import Fault, Load, SimGpu
from gpu_exporter.web.webconfig import WebConfigWatcher
from served import served

ROOT = Path(__file__).resolve().parent.parent
A100 = "NVIDIA A100-SXM4-80GB"


def mixed() -> Stack:
    s = build_stack(
        sim_of(
            SimGpu(
                0, A100, Load("constant", utilization=0.42, memory_used_ratio=0.25, processes=3)
            ),
            SimGpu(1, "NVIDIA GeForce GTX 1080", Load("busy")),  # half of NVML unsupported
            SimGpu(2, A100, Load("idle")),
            faults=[Fault("*", "GPU_IS_LOST", gpu=2, after_seconds=5)],
        ),
        slow_interval_seconds=10,  # the second sample reads the slow fields (energy) again
    )
    s.sample()
    s.clock.advance(10)
    s.sample()
    return s


def test_each_metric_matches_the_simulated_state_in_base_units() -> None:
    s = mixed()
    st = s.sim.state(0)
    v = s.value
    assert v("gpu_up", 0) == 1
    assert v("gpu_memory_total_bytes", 0) == st.memory_total == 80 * 2**30
    assert v("gpu_memory_used_bytes", 0) == st.memory_used
    assert v("gpu_memory_free_bytes", 0) == st.memory_free
    assert v("gpu_memory_reserved_bytes", 0) == st.memory_reserved
    assert st.memory_used + st.memory_free + st.memory_reserved == st.memory_total
    assert v("gpu_utilization_ratio", 0) == 0.42
    assert v("gpu_memory_utilization_ratio", 0) == st.utilization_memory / 100
    assert v("gpu_power_draw_watts", 0) == st.power_usage_mw / 1000
    assert v("gpu_power_limit_watts", 0) == 400.0
    assert v("gpu_temperature_celsius", 0) == st.temperature_c
    assert v("gpu_compute_processes", 0) == 3
    assert v("gpu_clock_hz", 0, clock="sm") == s.sim.state(0).clocks_mhz[1] * 1e6
    assert v("gpu_clock_hz", 0, clock="memory") == 1593e6
    # 10 s at a constant draw, integrated by the simulator, reported in joules
    assert v("gpu_energy_joules_total", 0) == pytest.approx(10 * st.power_usage_mw / 1000, rel=1e-3)
    info = {
        "gpu": "0",
        "uuid": s.sim.gpus[0].uuid,
        "name": A100,
        "pci_bus_id": "00000000:18:00.0",
        "driver_version": "550.54.15",
        "cuda_driver_version": "12.4",
    }
    assert s.registry.get_sample_value("gpu_info", info) == 1


def test_unsupported_fields_are_absent_not_zero() -> None:
    s = mixed()
    assert s.value("gpu_up", 1) == 1
    assert s.value("gpu_fan_speed_ratio", 1) == s.sim.state(1).fan_percent / 100  # a fan…
    assert s.value("gpu_fan_speed_ratio", 0) is None  # …the A100 does not
    for name in ("gpu_energy_joules_total", "gpu_compute_processes"):
        assert s.value(name, 1) is None
    assert s.value("gpu_clock_hz", 1, clock="sm") is None
    text = generate_latest(s.registry).decode()
    assert "NaN" not in text


def test_lost_gpu_exports_up_zero_and_no_values() -> None:
    s = mixed()
    assert s.value("gpu_up", 2) == 0
    uuid = s.sim.gpus[2].uuid
    text = generate_latest(s.registry).decode()
    lines = [line for line in text.splitlines() if uuid in line and not line.startswith("#")]
    assert sorted(line.split("{")[0] for line in lines) == [
        "gpu_down_reason",
        "gpu_info",
        "gpu_last_seen_timestamp_seconds",
        "gpu_leased",
        "gpu_up",
    ]
    assert s.value("gpu_down_reason", 2, reason="lost") == 1
    # Lost 10 s ago: the last sample it answered stays visible while it is down.
    assert s.value("gpu_last_seen_timestamp_seconds", 2) == s.clock.time() - 10
    assert s.value("gpu_last_seen_timestamp_seconds", 0) == s.clock.time()
    assert s.value("gpu_memory_used_bytes", 0) is not None  # the others stay


def test_exporter_self_metrics() -> None:
    s = mixed()
    r = s.registry
    labels = {"version": "test", "backend": "simulated", "revision": revision()}
    assert r.get_sample_value("gpu_exporter_build_info", labels) == 1
    assert r.get_sample_value("gpu_exporter_nvml_up") == 1
    assert r.get_sample_value("gpu_exporter_last_sample_timestamp_seconds") == s.clock.time()
    assert r.get_sample_value("gpu_exporter_sample_duration_seconds") == 0.0  # fake clock
    # The handle is kept from the first sample (issue 31): the loss shows in the first call
    # of the next one, the memory; the handle is asked again only after that.
    errors = {"function": "nvmlDeviceGetMemoryInfo", "error": "GPU_IS_LOST"}
    assert r.get_sample_value("gpu_exporter_nvml_errors_total", errors) == 1
    errors["function"] = "nvmlDeviceGetHandleByIndex"
    assert r.get_sample_value("gpu_exporter_nvml_errors_total", errors) is None


def test_before_the_first_sample_nothing_is_invented() -> None:
    s = build_stack(sim_of(SimGpu(0, A100, Load("idle"))))
    text = generate_latest(s.registry).decode()
    assert s.registry.get_sample_value("gpu_exporter_nvml_up") == 0
    assert "gpu_up{" not in text
    assert "gpu_exporter_last_sample_timestamp_seconds " not in text


def test_help_text_says_values_are_sampled() -> None:
    text = generate_latest(mixed().registry).decode()
    assert "# HELP gpu_memory_used_bytes" in text
    # Xid errors arrive as events, and PCIe throughput has its own thread; neither is sampled
    # with the snapshot, and their help says so instead.
    own_timing = {"gpu_xid_errors_total", "gpu_last_xid_timestamp_seconds"}
    own_timing |= {"gpu_pcie_throughput_bytes_per_second", "gpu_pod_info", "gpu_process_pod_info"}
    for spec in METRICS:
        if spec.name in own_timing:
            assert not spec.help.endswith(SAMPLED), spec.name
        elif spec.name.startswith("gpu_") and not spec.name.startswith(
            ("gpu_exporter_", "gpu_info", "gpu_leased", "gpu_memory_leased", "gpu_lease_memory")
        ):
            assert spec.help.endswith(SAMPLED), spec.name


def test_names_follow_prometheus_conventions() -> None:
    for spec in METRICS:
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", spec.name), spec.name
        assert spec.name.endswith("_total") == (spec.type == "counter"), spec.name
        assert "percent" not in spec.name and "mib" not in spec.name
        if spec.name.startswith("gpu_") and not spec.name.startswith("gpu_exporter_"):
            assert spec.labels[:2] == ("gpu", "uuid"), spec.name


def with_web_config(s: Stack, tmp_path: Path) -> Stack:
    """Also the --web-config-file families, which exist only when a file is given."""
    (tmp_path / "web.yml").write_text("")
    s.registry.register(WebConfigCollector(WebConfigWatcher(tmp_path / "web.yml")))
    return s


def test_every_emitted_family_is_in_the_spec_and_vice_versa(tmp_path: Path) -> None:
    text = generate_latest(with_web_config(mixed(), tmp_path).registry).decode()
    emitted = set(re.findall(r"^# TYPE (\S+) ", bare(text.encode()).decode(), re.M))
    # Opt-in families are absent unless turned on (see test_health.py for the full set); the
    # web config ones are turned on above. A family with no series is left out entirely (its
    # # HELP would cost every scrape for nothing): these GPUs have no MIG, Xid or retired page.
    on = {m.name for m in METRICS if m.on_by_default or "web_config" in m.name}
    no_series = {"gpu_mig_info", "gpu_xid_errors_total", "gpu_last_xid_timestamp_seconds"}
    no_series |= {"gpu_retired_pages_total", "gpu_retired_pages_pending"}
    no_series |= {spec.name for spec in GPM_VALUES}  # A100s: GPM is Hopper's and later
    no_series |= {r.family.name for r in READINGS if r.name == "fabric" and r.family}  # NVSwitch
    assert emitted == on - no_series
    for name in emitted:
        family = name.removesuffix("_total") if name.endswith("_total") else name
        assert re.search(rf"^{family}(_total)?[{{ ]", text, re.M), name
    # … but every family is described, for prometheus_client's ?name[]= filter.
    cache = mixed().cache
    pods = PodCollector(PodAllocations(), cache)  # --kubernetes: a collector of its own
    described = {f.name for c in (GpuCollector(cache), pods) for f in c.describe()}
    assert described == {m.family_name for m in METRICS if "web_config" not in m.name}


def test_readme_metric_table_is_generated_from_the_spec() -> None:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- metrics-table:start -->") + len("<!-- metrics-table:start -->\n")
    end = readme.index("<!-- metrics-table:end -->")
    assert readme[start:end] == metrics_table(), (
        "README metric table is out of date: run `python scripts/generate_readme.py`"
    )


def test_promtool_check_metrics_accepts_the_exposition(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(
            "promtool not installed (Debian package 'prometheus'; scripts/test installs it as root)"
        )
    text = generate_latest(with_web_config(mixed(), tmp_path).registry)
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=60
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_served_metrics_equal_generate_latest_byte_for_byte() -> None:
    """/metrics formats each snapshot's families once; the bytes must not change for it."""
    s = mixed()
    client = s.client
    for _ in range(3):
        first = client.get("/metrics")
        assert first.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert bare(first.data) == bare(generate_latest(s.registry))
        assert bare(client.get("/metrics").data) == bare(
            generate_latest(s.registry)
        )  # from the cache
        s.client.get("/choose?n=1&lease=0")  # a counter changes between scrapes …
        assert bare(client.get("/metrics").data) == bare(generate_latest(s.registry))  # … and shows
        s.clock.advance(1)
        s.sample()
    zipped = client.get("/metrics", headers={"Accept-Encoding": "gzip"})
    assert zipped.headers["Content-Encoding"] == "gzip"
    assert bare(gzip.decompress(zipped.data)) == bare(generate_latest(s.registry))
    om = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["Content-Type"].startswith("application/openmetrics-text")
    assert om.data.endswith(b"# EOF\n")
    # name[] filters are prometheus_client's own, served by it (not from the cache).
    assert client.get("/metrics?name[]=gpu_up").data == generate_latest(
        s.registry.restricted_registry(["gpu_up"])
    )


def test_name_filter_serves_exactly_the_named_metrics() -> None:
    """``/metrics?name[]=`` as client_python documents it: only those series, through a real
    socket; an unknown parameter is a 400 in one line, as on every other endpoint."""
    from urllib.error import HTTPError
    from urllib.request import urlopen

    with served(sampling=False) as ex:
        url = ex.url + "/metrics?name[]=gpu_up&name[]=gpu_exporter_build_info"
        with urlopen(url, timeout=10) as resp:
            body = resp.read().decode()
        samples = [line for line in body.splitlines() if not line.startswith("#")]
        assert {line.split("{")[0] for line in samples} == {"gpu_up", "gpu_exporter_build_info"}
        assert sum(line.startswith("gpu_up{") for line in samples) == 4
        for query in ("x=1", "name=gpu_up", "name[]=gpu_up&format=json"):
            with pytest.raises(HTTPError) as err:
                urlopen(ex.url + "/metrics?" + query, timeout=10)
            assert err.value.code == 400
            (line,) = err.value.read().decode().splitlines()
            # One line: plain, or the JSON error object when format=json asks for it.
            assert "unknown parameter" in line and "/metrics takes only name[]" in line
