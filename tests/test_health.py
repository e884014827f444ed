"""Health metrics through the simulator: exact values, unsupported fields, call counts, promtool."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from conftest import CID, Stack, build_stack, fake_proc, sim_of
from fakekubelet import fake_kubelet
from gpu_exporter.collect.kubelet import PodResourcesPoller
from gpu_exporter.collect.procinfo import ProcInfoCache
from gpu_exporter.export.spec import METRICS
from gpu_exporter.model import CLOCKS_EVENT_REASONS
from gpu_exporter.simulate import Fault, Health, Load, SimGpu

A100 = "NVIDIA A100-SXM4-80GB"
GTX = "NVIDIA GeForce GTX 1080"
H100 = "NVIDIA H100 80GB HBM3"
V100 = "Tesla V100-SXM2-16GB"

SICK = Health(
    ecc_corrected_volatile=7,
    ecc_corrected_aggregate=120,
    ecc_uncorrected_volatile=1,
    ecc_uncorrected_aggregate=3,
    remapped_rows_correctable=2,
    remapped_rows_uncorrectable=1,
    remapped_rows_pending=True,
    pcie_replays=42,
    pcie_link_width=4,
    clocks_event_reasons=("hw_thermal_slowdown",),
)


def host() -> Stack:
    s = build_stack(
        sim_of(
            SimGpu(
                0,
                A100,
                Load("constant", utilization=0.42, memory_used_ratio=0.25, processes=2),
                health=SICK,
                compute_mode="exclusive_process",
            ),
            SimGpu(1, GTX, Load("busy")),
            SimGpu(
                2,
                V100,
                Load("idle"),
                health=Health(
                    retired_pages_multiple_single_bit=2,
                    retired_pages_double_bit=1,
                    retired_pages_pending=True,
                ),
            ),
        )
    )
    s.sample()
    return s


def reasons(s: Stack, gpu: int) -> dict[str, float | None]:
    return {r: s.value("gpu_clocks_event_reasons", gpu, reason=r) for r in CLOCKS_EVENT_REASONS}


def test_a100_health_values() -> None:
    s = host()
    v = s.value
    assert reasons(s, 0) == {
        r: 1.0 if r == "hw_thermal_slowdown" else 0.0 for r in CLOCKS_EVENT_REASONS
    }
    assert v("gpu_clock_max_hz", 0, clock="sm") == 1410e6
    assert v("gpu_clock_max_hz", 0, clock="graphics") == 1410e6
    assert v("gpu_clock_max_hz", 0, clock="memory") == 1593e6
    assert v("gpu_clock_max_hz", 0, clock="video") == round(1410 * 0.85) * 1e6
    thresholds = {
        t: v("gpu_temperature_threshold_celsius", 0, threshold=t)
        for t in ("slowdown", "shutdown", "gpu_max", "memory_max")
    }
    assert thresholds == {"slowdown": 89, "shutdown": 92, "gpu_max": 87, "memory_max": 95}
    assert v("gpu_performance_state", 0) == 0  # busy: P0
    assert v("gpu_persistence_mode_enabled", 0) == 1
    assert v("gpu_compute_mode", 0, mode="exclusive_process") == 1
    assert v("gpu_compute_mode", 0, mode="default") is None
    assert v("gpu_ecc_mode_enabled", 0) == 1
    ecc = {
        (e, c): v("gpu_ecc_errors_total", 0, error=e, counter=c)
        for e in ("corrected", "uncorrected")
        for c in ("volatile", "aggregate")
    }
    assert ecc == {
        ("corrected", "volatile"): 7,
        ("corrected", "aggregate"): 120,
        ("uncorrected", "volatile"): 1,
        ("uncorrected", "aggregate"): 3,
    }
    assert v("gpu_remapped_rows_total", 0, cause="correctable") == 2
    assert v("gpu_remapped_rows_total", 0, cause="uncorrectable") == 1
    assert v("gpu_remapped_rows_pending", 0) == 1
    assert v("gpu_remapped_rows_failed", 0) == 0
    # Ampere retires rows, not pages: NOT_SUPPORTED, so absent.
    assert v("gpu_retired_pages_total", 0, cause="double_bit") is None
    assert v("gpu_retired_pages_pending", 0) is None
    assert v("gpu_pcie_link_generation", 0, link="current") == 4
    assert v("gpu_pcie_link_generation", 0, link="max") == 4
    assert v("gpu_pcie_link_width", 0, link="current") == 4  # trained down …
    assert v("gpu_pcie_link_width", 0, link="max") == 16  # … from x16
    assert v("gpu_pcie_replay_errors_total", 0) == 42
    assert v("gpu_power_limit_default_watts", 0) == 400
    # The settable power-limit range is a constant of the card: in /gpus, not two series per
    # GPU on every scrape (issue 15).
    gpu0 = s.cache.get().gpus[0].to_json()
    assert (gpu0["power_limit_min_watts"], gpu0["power_limit_max_watts"]) == (100, 400)
    assert v("gpu_power_limit_min_watts", 0) is None
    assert v("gpu_encoder_utilization_ratio", 0) == 0
    assert v("gpu_decoder_utilization_ratio", 0) == s.sim.state(0).decoder_percent / 100 == 0.04
    assert v("gpu_mig_mode_enabled", 0) == 0


def test_geforce_half_unsupported_is_absent_not_zero() -> None:
    s = host()
    v = s.value
    absent = [
        ("gpu_ecc_mode_enabled", {}),
        ("gpu_ecc_errors_total", {"error": "corrected", "counter": "volatile"}),
        ("gpu_remapped_rows_total", {"cause": "correctable"}),
        ("gpu_remapped_rows_pending", {}),
        ("gpu_retired_pages_total", {"cause": "double_bit"}),
        ("gpu_retired_pages_pending", {}),
        ("gpu_pcie_replay_errors_total", {}),
        ("gpu_power_limit_default_watts", {}),
        ("gpu_temperature_threshold_celsius", {"threshold": "slowdown"}),
        ("gpu_mig_mode_enabled", {}),
    ]
    for name, labels in absent:
        assert v(name, 1, **labels) is None, name
    # The clocks-event call is missing from this driver; its older name answers instead.
    assert reasons(s, 1) == {r: 1.0 if r == "sw_power_cap" else 0.0 for r in CLOCKS_EVENT_REASONS}
    assert v("gpu_persistence_mode_enabled", 1) == 0
    assert v("gpu_compute_mode", 1, mode="default") == 1
    assert v("gpu_pcie_link_generation", 1, link="max") == 3
    assert v("gpu_clock_max_hz", 1, clock="sm") == 1733e6
    assert v("gpu_decoder_utilization_ratio", 1) == 0.1
    text = generate_latest(s.registry).decode()
    assert "NaN" not in text


def test_field_supported_lists_only_what_each_gpu_does_not_report() -> None:
    """Issue 15: a series per unsupported field only (supported: no series, not 1), and the
    same list in /gpus — "why is this panel empty for GPU 1?" without ~40 series per GPU."""
    s = host()

    def supported(gpu: int, field: str) -> float | None:
        return s.value("gpu_exporter_field_supported", gpu, field=field)

    assert supported(0, "ecc_mode") is None  # supported: no series
    assert supported(1, "ecc_mode") == 0
    assert supported(1, "energy") == 0
    assert supported(1, "clocks_event_reasons") is None  # via the older function name
    assert supported(0, "retired_pages_double_bit") == 0
    assert supported(2, "retired_pages_double_bit") is None
    assert supported(2, "remapped_rows") == 0
    assert supported(0, "fan_speed") == 0 and supported(1, "fan_speed") is None
    text = generate_latest(s.registry).decode()
    values = [
        line.rsplit(" ", 1)[1]
        for line in text.splitlines()
        if line.startswith("gpu_exporter_field_supported{")
    ]
    assert values and set(values) == {"0.0"}
    # Every GeForce field that answered NOT_SUPPORTED is listed, and about half the new ones are.
    gtx = dict(s.cache.get().gpus[1].fields_supported)
    assert 0.3 < sum(1 for ok in gtx.values() if not ok) / len(gtx) < 0.7
    listed = s.cache.get().gpus[1].to_json()["unsupported_fields"]
    assert listed == [field for field, ok in gtx.items() if not ok]
    assert "energy" in listed and "fan_speed" not in listed


def test_v100_pages_and_idle_link() -> None:
    s = host()
    v = s.value
    assert v("gpu_retired_pages_total", 2, cause="multiple_single_bit") == 2
    assert v("gpu_retired_pages_total", 2, cause="double_bit") == 1
    assert v("gpu_retired_pages_pending", 2) == 1
    assert v("gpu_remapped_rows_total", 2, cause="correctable") is None
    assert v("gpu_pcie_link_generation", 2, link="current") == 1  # idle links drop to gen 1
    assert v("gpu_performance_state", 2) == 8
    assert reasons(s, 2)["gpu_idle"] == 1


def test_unsupported_and_static_fields_are_not_called_again() -> None:
    s = host()  # one sample
    for _ in range(4):
        s.clock.advance(1)
        s.sample()
    calls = s.sim.calls
    # NOT_SUPPORTED: asked once per GPU that lacks it, never again. Health fields are slow:
    # read in the first sample, not again within --slow-interval (30 s). ECC and retired
    # pages are field values (issue 31): one batch per GPU and cadence, no getter call.
    # An entry NOT_SUPPORTED asks its getter once (an older driver lacks field ids the
    # getter answers): the GTX's ECC mode, the A100's and the GTX's retired pages.
    assert calls["nvmlDeviceGetEccMode"] == 1
    assert calls["nvmlDeviceGetRetiredPages"] == 2 + 2
    assert calls["nvmlDeviceGetFieldValues"] == 3 * (1 + 5)  # slow once, fast every sample
    assert calls["nvmlDeviceGetMigMode"] == 1 + 1 + 1  # only the A100 supports MIG
    # FUNCTION_NOT_FOUND once, then the older name for every GPU (a fast field).
    assert calls["nvmlDeviceGetCurrentClocksEventReasons"] == 2
    assert calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 2 + 3 * 4  # GTX, V100; all
    # Static values: once per GPU, not per sample.
    assert calls["nvmlDeviceGetMaxClockInfo"] == 3 * 4
    assert calls["nvmlDeviceGetPowerManagementLimitConstraints"] == 3  # GTX: once, unsupported
    assert calls["nvmlDeviceGetMaxPcieLinkWidth"] == 3
    assert calls["nvmlDeviceGetTotalEccErrors"] == 4  # the GTX: each entry unsupported, once
    # 30 s after the first: the slow fields are read again, the static ones are not.
    s.clock.advance(26)
    s.sample()
    assert calls["nvmlDeviceGetFieldValues"] == 3 * (2 + 6)
    assert calls["nvmlDeviceGetPersistenceMode"] == 3 * 2
    assert calls["nvmlDeviceGetMaxClockInfo"] == 3 * 4


def test_reinitialising_asks_unsupported_and_static_fields_again() -> None:
    s = host()
    # NVML fails for one sample, as after a driver reload: the sampler initialises it again.
    now = s.sim.elapsed()
    s.sim.faults.append(Fault("nvmlDeviceGetCount", "UNINITIALIZED", None, now, for_seconds=0.5))
    assert not s.sample().nvml_up
    s.clock.advance(1)  # the first backoff step; the fault is over
    assert s.sample().nvml_up
    assert s.sim.calls["nvmlDeviceGetMaxClockInfo"] == 3 * 4 * 2
    assert s.sim.calls["nvmlDeviceGetPersistenceMode"] == 3 * 2
    assert s.sim.calls["nvmlDeviceGetHandleByIndex"] == 3 * 2  # asked again after re-init


POD_CGROUP = "0::/kubepods.slice/kubepods-pod0a1b2c3d_0000_4000_8000_000000000001.slice\n"


def full_host(tmp_path: Path) -> Stack:
    """MIG, a GeForce, processes with labels, Xids, PCIe throughput and a kubelet whose pod
    holds GPU 0: everything on."""
    cgroups = [f"0::/system.slice/docker-{CID}.scope\n", "0::/user.slice\n", POD_CGROUP]
    for k in range(3):  # processes of GPU 0 (pids 4000…) visible in /proc, in a container,
        fake_proc(  # a login session and a pod
            tmp_path,
            4000 + k,
            uid=0,
            cmdline=b"/usr/bin/python3\x00train.py\x00",
            cgroup=cgroups[k],
            start=10 + k,
        )
    procinfo = ProcInfoCache(("user", "command", "container", "slurm_job", "pod"), str(tmp_path))
    pod = ("ml", "train", [("main", [("nvidia.com/gpu", ["0"])])])  # GPU 0, by index
    with fake_kubelet([pod]) as kubelet:
        s = build_stack(
            sim_of(
                SimGpu(
                    0, A100, Load("constant", utilization=0.5, memory_used_ratio=0.5, processes=3)
                ),
                SimGpu(1, GTX, Load("busy")),
                # an H100: GPM, for the card and each MIG device
                SimGpu(2, H100, Load("busy"), mig=("3g.40gb", "2g.20gb", "1g.10gb")),
                SimGpu(3, A100, Load("hidden", memory_used_ratio=0.3), health=SICK),
            ),
            process_labels=procinfo.fields,
            proc_root=str(tmp_path),
            pcie_throughput=True,
            kubernetes_socket=kubelet.socket_path,
        )
        (poller,) = [t for t in s.daemon.background if isinstance(t, PodResourcesPoller)]
        assert poller.poll_once()  # asked once, by hand: no thread runs here
    s.sample()
    s.clock.advance(s.daemon.config.gpm_interval_seconds)  # GPM's second sample: its figures
    s.sample()
    # A memory lease (issue 16): gpu_memory_leased_bytes and the overrun have a series.
    # GPU 1: GPU 0 is the pod's (/choose passes over a card the kubelet allocated). GPU 1 is
    # 97 % busy, which a share takes only when it says so (the utilization default applies).
    answer = s.client.get("/choose?mem=512MiB&include=1&max_util=100%")
    assert answer.status_code == 200, answer.text
    s.xids.record(3, s.sim.gpus[3].uuid, 79, s.clock.time())
    s.xids.record(3, s.sim.gpus[3].uuid, 48, s.clock.time())
    from gpu_exporter.counters import PcieRate

    assert s.pcie is not None
    s.pcie.update({s.sim.gpus[0].uuid: PcieRate(0, s.sim.gpus[0].uuid, 1024.0, 2048.0)})
    return s


def test_full_output_has_every_metric(tmp_path: Path) -> None:
    s = full_host(tmp_path)
    text = generate_latest(s.registry).decode()
    # The process_* families are prometheus_client's ProcessCollector, as in production.
    emitted = {n for n in re.findall(r"^# TYPE (\S+) ", text, re.M) if not n.startswith("process_")}
    # Everything but the --web-config-file metrics (no web config here), and the families
    # with no series on this host, which are left out: no card here retires pages (Ampere
    # remaps rows), nothing is down, and no NVML call has failed.
    empty = {"gpu_retired_pages_total", "gpu_retired_pages_pending", "gpu_down_reason"}
    empty.add("gpu_exporter_nvml_errors_total")
    per_link = {"gpu_nvlink_up", "gpu_nvlink_transmit_bytes_total"}
    per_link |= {"gpu_nvlink_receive_bytes_total", "gpu_nvlink_errors_total"}
    empty |= per_link  # --collect.nvlink (GPM's gpu_nvlink_traffic_bytes_per_second is on)
    assert emitted == {m.name for m in METRICS if "web_config" not in m.name} - empty
    samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    # The request, lease and rejection counters have their known label values at 0 already.
    assert {m.name for m in METRICS if "web_config" not in m.name} - samples == empty
    labels = {"gpu": "0", "uuid": s.sim.gpus[0].uuid, "pid": "4000", "user": "root"}
    labels |= {"command": "python3", "container": CID, "slurm_job": "", "pod": ""}
    assert (
        s.registry.get_sample_value("gpu_process_memory_used_bytes", labels)
        == (s.sim.state(0).processes[0][1])
    )


def test_promtool_accepts_the_full_output(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(
            "promtool not installed (Debian package 'prometheus'; scripts/test installs it as root)"
        )
    text = generate_latest(full_host(tmp_path).registry)
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=60
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
