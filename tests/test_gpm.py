"""GPM (Hopper and later) and per-process utilization, over the simulator: values in base
units, absent where a card has none, one device's failure leaving the others, buffers freed
when a device is lost and on shutdown, MIG GPU instances, and the watchdog over a hung call.
The same paths through the real pynvml and a fake libnvidia-ml.so.1: tests/test_fakenvml.py.
"""

from __future__ import annotations

import json
import time

import pytest

from conftest import Stack, build_stack, sim_of
from gpu_exporter.nvml import GPM_METRICS
from gpu_exporter.simulate import HANG, Fault, Load, SimGpu
from gpu_exporter.simulate.state import gpm_values
from harness import exporter, get

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
GTX = "NVIDIA GeForce GTX 1080"  # an old driver: no nvmlGpmQueryDeviceSupport at all
GPM_INTERVAL = 5.0


def host(*gpus: SimGpu, faults: tuple[Fault, ...] = (), **config: object) -> Stack:
    return build_stack(
        sim_of(*gpus, faults=list(faults)),
        interval_seconds=1.0,
        gpm_interval_seconds=GPM_INTERVAL,
        **config,
    )


def mixed(*faults: Fault, **config: object) -> Stack:
    """Two H100s (busy; light: "12 % utilized", SMs nearly idle), an A100 and a GTX 1080."""
    return host(
        SimGpu(0, H100, Load("busy")),
        SimGpu(1, H100, Load("light")),
        SimGpu(2, A100, Load("busy")),
        SimGpu(3, GTX, Load("busy")),
        faults=faults,
        **config,
    )


def two_gpm_reads(s: Stack) -> None:
    s.sample()  # the first GPM sample of each device: no metrics yet
    s.clock.advance(GPM_INTERVAL)
    s.sample()


def expected(s: Stack, index: int, name: str, t0: float, t1: float, gi: int | None = None) -> float:
    """What GPM answers for ``name`` between two samples at t0 and t1, in base units."""
    metric_id, per_base_unit = GPM_METRICS[name]
    gpu = s.sim.gpus[index]
    mean = (gpm_values(gpu, t0, gi)[metric_id] + gpm_values(gpu, t1, gi)[metric_id]) / 2
    return mean / per_base_unit


def test_gpm_values_in_base_units_over_the_interval_and_absent_without_gpm() -> None:
    s = mixed()
    first = s.sample()
    assert all(g.sm_active_ratio is None for g in first.gpus)  # one sample is no interval
    assert s.value("gpu_sm_active_ratio", 0) is None
    s.clock.advance(GPM_INTERVAL)
    gpus = s.sample().gpus
    t0, t1 = 0.0, GPM_INTERVAL
    for index in (0, 1):
        for name in GPM_METRICS:
            assert getattr(gpus[index], name) == pytest.approx(expected(s, index, name, t0, t1))
    busy, light = gpus[0], gpus[1]
    assert busy.sm_active_ratio is not None and busy.sm_active_ratio > 0.8
    # The point of GPM: "12 % utilized" while the SMs are nearly idle.
    assert light.utilization_ratio == 0.12 and light.sm_active_ratio == pytest.approx(0.0137)
    assert busy.pcie_transmit_bytes_per_second == pytest.approx(
        s.sim.state(0).pcie_tx_kb_per_second / 1024 * 2**20, rel=1e-3
    )
    assert busy.tensor_imma_active_ratio == 0.0  # reported 0 is 0 …
    for gpu in gpus[2:]:  # … and a card without GPM has nothing, never 0
        assert all(getattr(gpu, name) is None for name in GPM_METRICS)
        assert ("gpm", False) in gpu.fields_supported
    assert ("gpm", True) in busy.fields_supported
    # In /metrics: series for the H100s, none for the others; "gpm" listed as unsupported.
    assert s.value("gpu_sm_active_ratio", 0) == busy.sm_active_ratio
    assert s.value("gpu_tensor_pipe_active_ratio", 0, pipe="hmma") == busy.tensor_hmma_active_ratio
    assert s.value("gpu_fp_pipe_active_ratio", 0, precision="fp32") == busy.fp32_active_ratio
    assert s.value("gpu_pcie_traffic_bytes_per_second", 0, direction="tx") == (
        busy.pcie_transmit_bytes_per_second
    )
    assert s.value("gpu_nvlink_traffic_bytes_per_second", 0, direction="rx") == (
        busy.nvlink_receive_bytes_per_second
    )
    for index in (2, 3):
        assert s.value("gpu_sm_active_ratio", index) is None
        assert s.value("gpu_exporter_field_supported", index, field="gpm") == 0
    assert s.value("gpu_exporter_field_supported", 0, field="gpm") is None


def test_gpm_is_read_at_its_own_interval_and_its_values_stay_in_between() -> None:
    s = mixed()
    two_gpm_reads(s)
    calls = dict(s.sim.calls)
    value = s.cache.get().gpus[0].sm_active_ratio
    for _ in range(3):  # three 1 s samples within the 5 s GPM interval
        s.clock.advance(1)
        assert s.sample().gpus[0].sm_active_ratio == value
    for fn in ("nvmlGpmSampleGet", "nvmlGpmMetricsGet", "nvmlGpmQueryDeviceSupport"):
        assert s.sim.calls.get(fn, 0) == calls.get(fn, 0), fn
    s.clock.advance(2)  # 5 s since the last GPM read: due again
    s.sample()
    assert s.sim.calls["nvmlGpmSampleGet"] == calls["nvmlGpmSampleGet"] + 2  # both H100s
    assert s.sim.calls["nvmlGpmMetricsGet"] == calls["nvmlGpmMetricsGet"] + 2
    # Support is asked once per GPU (the old driver's missing function means "no GPM").
    assert s.sim.calls["nvmlGpmQueryDeviceSupport"] == 4


def test_a_failing_gpm_call_on_one_gpu_leaves_the_others() -> None:
    s = mixed(Fault("nvmlGpmMetricsGet", "UNKNOWN", gpu=1))
    two_gpm_reads(s)
    gpus = s.cache.get().gpus
    assert gpus[0].sm_active_ratio is not None
    assert gpus[1].up and gpus[1].sm_active_ratio is None  # absent, not 0, and still up
    assert gpus[1].memory_used_bytes is not None
    assert ("gpm", True) in gpus[1].fields_supported  # a failure is not "unsupported"
    assert ("nvmlGpmMetricsGet", "UNKNOWN", 1) in s.cache.get().nvml_errors


def test_a_lost_gpu_frees_its_gpm_buffers_and_shutdown_frees_the_rest() -> None:
    s = mixed(Fault("*", "GPU_IS_LOST", gpu=1, after_seconds=7))
    two_gpm_reads(s)
    assert len(s.sim.gpm_samples) == 4  # two buffers per H100
    s.clock.advance(2)
    gpus = s.sample().gpus
    assert not gpus[1].up and gpus[0].sm_active_ratio is not None
    assert len(s.sim.gpm_samples) == 2 and s.sampler.gpm is not None
    assert s.sampler.gpm.buffers() == 2
    s.sampler.stop()
    assert s.sim.gpm_samples == set()


def test_mig_gpu_instances_have_their_own_gpm() -> None:
    s = host(SimGpu(0, H100, Load("busy"), mig=("3g.40gb", "2g.20gb")))
    two_gpm_reads(s)
    gpu = s.cache.get().gpus[0]
    assert gpu.sm_active_ratio is not None  # the whole card, as GPM samples it in MIG mode
    for device in gpu.mig_devices:
        gi = device.gpu_instance_id
        want = expected(s, 0, "sm_active_ratio", 0.0, GPM_INTERVAL, gi)
        assert device.sm_active_ratio == pytest.approx(want)
        assert device.dram_active_ratio is not None
        assert device.pcie_transmit_bytes_per_second is None  # not reported per instance
        labels = {"gpu": "0", "uuid": device.uuid}
        found = s.registry.get_sample_value("gpu_sm_active_ratio", labels)
        assert found == device.sm_active_ratio
    assert s.sim.calls["nvmlGpmMigSampleGet"] == 4  # two instances, two samples each
    assert len(s.sim.gpm_samples) == 6


def test_a_hung_gpm_call_is_under_the_sampler_watchdog() -> None:
    hang = Fault("nvmlGpmSampleGet", HANG, gpu=0, after_seconds=4, hang_seconds=30)
    s = host(
        SimGpu(0, H100, Load("busy")),
        SimGpu(1, H100, Load("busy")),
        faults=(hang,),
        nvml_timeout_seconds=0.3,
    )
    try:
        two_gpm_reads(s)
        gpus = s.cache.get().gpus
        assert not gpus[0].up and gpus[0].down_reason == "timeout"
        assert gpus[0].error is not None and gpus[0].error.startswith("nvmlGpmSampleGet")
        assert gpus[1].up and gpus[1].sm_active_ratio is not None
    finally:
        s.sim.release_hangs()
        s.sampler.stop(timeout_seconds=2)


def test_no_collect_gpm_makes_no_gpm_call_and_exports_nothing() -> None:
    s = mixed(collect_disabled=("gpm",))
    two_gpm_reads(s)
    assert not [fn for fn in s.sim.calls if fn.startswith("nvmlGpm")]
    assert s.cache.get().gpus[0].sm_active_ratio is None
    text = s.client.get("/metrics").get_data(as_text=True)
    assert "gpu_sm_active_ratio{" not in text and 'field="gpm"' not in text
    assert "gpu_utilization_ratio{" in text


def test_per_process_utilization_and_no_process_busy_means_zero() -> None:
    s = host(
        SimGpu(0, A100, Load("constant", utilization=0.5, memory_used_ratio=0.6, processes=2)),
        SimGpu(1, A100, Load("constant", utilization=0.0, memory_used_ratio=0.6, processes=1)),
        SimGpu(2, A100, Load("busy"), mig=("3g.40gb",)),
    )
    gpus = s.sample().gpus
    procs = gpus[0].processes
    assert procs is not None and len(procs) == 2
    assert [p.sm_utilization_ratio for p in procs] == [0.25, 0.25]
    assert [p.memory_utilization_ratio for p in procs] == [0.15, 0.15]
    # NVML answers NOT_FOUND when no process did anything: each listed one is at 0.
    idle = gpus[1].processes
    assert idle is not None and [p.sm_utilization_ratio for p in idle] == [0.0]
    assert ("process_utilization", True) in gpus[1].fields_supported
    # MIG: NVML has no per-process utilization; absent, and never asked of a MIG-mode GPU.
    mig_procs = gpus[2].mig_devices[0].processes
    assert mig_procs and mig_procs[0].sm_utilization_ratio is None
    pid = str(procs[0].pid)
    labels = {"gpu": "0", "uuid": gpus[0].uuid, "pid": pid}
    assert s.registry.get_sample_value("gpu_process_sm_utilization_ratio", labels) == 0.25
    assert s.registry.get_sample_value("gpu_process_memory_utilization_ratio", labels) == 0.15
    mig = {"gpu": "2", "uuid": gpus[2].mig_devices[0].uuid, "pid": str(mig_procs[0].pid)}
    assert s.registry.get_sample_value("gpu_process_memory_used_bytes", mig) is not None
    assert s.registry.get_sample_value("gpu_process_sm_utilization_ratio", mig) is None


def test_process_utilization_follows_the_process_series_cap() -> None:
    s = host(
        SimGpu(0, A100, Load("constant", utilization=0.8, memory_used_ratio=0.6, processes=5)),
        process_series_limit=2,
    )
    s.sample()
    text = s.client.get("/metrics").get_data(as_text=True)
    assert text.count("gpu_process_memory_used_bytes{") == 2
    assert text.count("gpu_process_sm_utilization_ratio{") == 2
    assert text.count("gpu_process_memory_utilization_ratio{") == 2


# -- choosing by SM activity, through a real socket ---------------------------------------------


def test_sort_sm_active_and_max_sm_active_over_http_and_bad_values_are_400() -> None:
    """The lab scenario: GPU 0 an H100 at work, GPU 1 an H100 whose notebook polls a tiny
    kernel (10 % utilized, SMs at about 1 %), GPU 7 an A100 at 12 % (no GPM)."""
    with exporter("--simulate", "lab", "--interval", "0.1", "--gpm-interval", "0.2") as ex:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            gpus = json.loads(get(ex.base + "/gpus")[1])["gpus"]
            if gpus[1]["sm_active_ratio"] is not None:
                break
            time.sleep(0.05)
        assert gpus[1]["sm_active_ratio"] < 0.05 < gpus[1]["utilization_ratio"]
        assert gpus[7]["sm_active_ratio"] is None  # an A100: no GPM
        anything = "max_util=100%25&max_mem_used=100%25&lease=0&format=json&include=0,1,7"
        status, body = get(f"{ex.base}/choose?n=1&sort=sm_active&max_sm_active=5%25&{anything}")
        assert status == 200, body
        answer = json.loads(body)
        assert [g["index"] for g in answer["chosen"]] == [1]
        assert answer["chosen"][0]["score"] == answer["chosen"][0]["sm_active_ratio"]
        assert answer["filters"]["max_sm_active"]["value"] == 0.05
        reasons = {r["index"]: r["reasons"] for r in answer["rejected"]}
        assert (
            reasons[0][0].startswith("SM activity 0.8") and "> max_sm_active 0.05" in reasons[0][0]
        )
        assert reasons[7] == ["utilization (no GPM) 0.12 > max_sm_active 0.05"]
        # By utilization at the same limit, the notebook's card is busy.
        status, body = get(f"{ex.base}/choose?n=1&lease=0&include=1&max_util=5%25&max_mem_used=1")
        assert status == 503 and "utilization 0.10 > max_util 0.05" in body, body
        # Bad values: a clear 400 naming the parameter, never a traceback.
        for query, param in (("max_sm_active=lots", "max_sm_active"), ("sort=sm", "sort")):
            status, body = get(f"{ex.base}/choose?n=1&lease=0&format=json&{query}")
            assert status == 400, body
            error = json.loads(body)["error"]
            assert error["code"] == "invalid_parameter" and error["param"] == param, body
            assert "Traceback" not in body
        # Described where a client looks: /openapi.json and the CLI.
        spec = json.loads(get(ex.base + "/openapi.json")[1])
        params = {p["name"]: p for p in spec["paths"]["/choose"]["get"]["parameters"]}
        assert "max_sm_active" in params and "sm_active" in params["sort"]["schema"]["enum"]
        cluster = {p["name"] for p in spec["paths"]["/cluster/choose"]["get"]["parameters"]}
        assert "max_sm_active" in cluster  # across the fleet too, from gpu_sm_active_ratio


def test_the_choose_command_has_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from gpu_exporter.cli import main

    with pytest.raises(SystemExit):
        main(["choose", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-sm-active RATIO" in text and "sm_active" in text


def test_process_utilization_is_asked_only_of_a_gpu_with_processes() -> None:
    s = host(
        SimGpu(0, A100, Load("idle")),
        SimGpu(1, A100, Load("constant", utilization=0.5, memory_used_ratio=0.6, processes=1)),
    )
    for _ in range(3):
        s.sample()
        s.clock.advance(1)
    assert s.sim.calls["nvmlDeviceGetProcessUtilization"] == 3  # GPU 1's, every sample
    assert s.cache.get().gpus[0].processes == ()


def test_nvml_going_away_frees_the_gpm_buffers_before_it_is_initialised_again() -> None:
    gone = Fault("nvmlDeviceGetCount", "DRIVER_NOT_LOADED", after_seconds=7, for_seconds=3)
    s = host(SimGpu(0, H100, Load("busy")), faults=(gone,))
    two_gpm_reads(s)
    assert len(s.sim.gpm_samples) == 2
    s.clock.advance(3)
    assert not s.sample().nvml_up
    assert s.sim.gpm_samples == set()  # freed at once, not left for the next initialisation
    s.clock.advance(600)  # past the fault, and past the initialisation backoff
    s.sample()
    s.clock.advance(GPM_INTERVAL)
    gpu = s.sample().gpus[0]
    assert gpu.sm_active_ratio is not None and len(s.sim.gpm_samples) == 2
