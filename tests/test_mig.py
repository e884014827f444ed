"""MIG: devices in the snapshot and in /metrics, /choose?mig=, leases, call counts."""

from __future__ import annotations

import pytest

from conftest import FakeClock, Stack, build_stack, sim_of
from gpu_exporter.nvml import error_code, make_error
from gpu_exporter.simulate import Load, Scenario, SimGpu, SimMig, SimulatedNvml

A100 = "NVIDIA A100-SXM4-80GB"
PROFILES = ("3g.40gb", "2g.20gb", "1g.10gb")


def mig_host() -> Stack:
    s = build_stack(
        sim_of(
            SimGpu(0, A100, Load("constant", utilization=0.2, memory_used_ratio=0.5, processes=1)),
            SimGpu(1, A100, Load("light"), mig=PROFILES),
        )
    )
    s.sample()
    return s


def test_mig_devices_are_samples_with_the_parents_index() -> None:
    s = mig_host()
    parent = s.cache.get().gpus[1]
    assert parent.mig_mode_enabled is True
    assert [d.mig_profile for d in parent.mig_devices] == list(PROFILES)
    for slot, dev in enumerate(parent.mig_devices):
        ms = s.sim.mig_state(1, slot)
        assert dev.index == 1 and dev.up and dev.is_mig_device
        assert dev.uuid == ms.uuid and dev.uuid.startswith("MIG-")
        assert dev.parent_uuid == parent.uuid
        assert (dev.gpu_instance_id, dev.compute_instance_id) == (slot + 1, 0)
        assert dev.name == f"{A100} MIG {PROFILES[slot]}"
        assert dev.memory_total_bytes == ms.memory_total
        assert dev.memory_used_bytes == ms.memory_used
        assert dev.memory_free_bytes == ms.memory_free
        assert dev.utilization_ratio is None  # NVML does not report it for MIG: absent, not 0
        assert dev.compute_processes == len(ms.processes) == 1
        assert dev.processes is not None
        assert [(p.pid, p.used_memory_bytes) for p in dev.processes] == list(ms.processes)
    # The parent: the sum of its devices; no utilization in MIG mode either.
    assert parent.utilization_ratio is None
    assert parent.memory_used_bytes == sum(d.memory_used_bytes or 0 for d in parent.mig_devices)
    assert parent.compute_processes == 3
    assert s.cache.get().gpus[0].mig_mode_enabled is False
    assert s.cache.get().gpus[0].mig_devices == ()


def test_mig_metrics() -> None:
    s = mig_host()
    parent_uuid = s.sim.gpus[1].uuid
    for slot, profile in enumerate(PROFILES):
        ms = s.sim.mig_state(1, slot)
        ids = {"gpu": "1", "uuid": ms.uuid}
        info = {
            **ids,
            "parent_uuid": parent_uuid,
            "gpu_instance_id": str(slot + 1),
            "compute_instance_id": "0",
            "profile": profile,
        }
        r = s.registry
        assert r.get_sample_value("gpu_mig_info", info) == 1
        assert r.get_sample_value("gpu_up", ids) == 1
        assert r.get_sample_value("gpu_memory_used_bytes", ids) == ms.memory_used
        assert r.get_sample_value("gpu_memory_total_bytes", ids) == ms.memory_total
        assert r.get_sample_value("gpu_compute_processes", ids) == 1
        assert r.get_sample_value("gpu_utilization_ratio", ids) is None
        assert r.get_sample_value("gpu_power_draw_watts", ids) is None  # a whole-card value
        pid, used = ms.processes[0]
        proc = {**ids, "pid": str(pid)}
        assert r.get_sample_value("gpu_process_memory_used_bytes", proc) == used
        # Not counted twice under the parent.
        parent = {"gpu": "1", "uuid": parent_uuid, "pid": str(pid)}
        assert r.get_sample_value("gpu_process_memory_used_bytes", parent) is None
        assert r.get_sample_value("gpu_leased", ids) == 0
    assert s.value("gpu_mig_mode_enabled", 1) == 1
    assert s.value("gpu_mig_mode_enabled", 0) == 0
    assert s.value("gpu_utilization_ratio", 1) is None
    assert s.value("gpu_power_draw_watts", 1) is not None


def test_mig_calls_per_sample() -> None:
    s = mig_host()
    s.sample()
    before = dict(s.sim.calls)
    s.sample()
    delta = {k: v - before.get(k, 0) for k, v in s.sim.calls.items() if v != before.get(k, 0)}
    # Slots are walked every sample (MIG devices can be created and destroyed at run time).
    assert delta["nvmlDeviceGetMigDeviceHandleByIndex"] == 7
    # Each MIG device: its uuid, memory and processes; utilization was NOT_SUPPORTED once.
    assert delta["nvmlDeviceGetUUID"] == 3
    assert "nvmlDeviceGetUtilizationRates" in delta and delta["nvmlDeviceGetUtilizationRates"] == 1
    assert delta["nvmlDeviceGetMemoryInfo"] == 2 + 3
    # Processes: per MIG device, not on the parent in MIG mode; GPU 0 once.
    assert delta["nvmlDeviceGetComputeRunningProcesses"] == 1 + 3
    # Names and instance ids are remembered per MIG uuid.
    assert "nvmlDeviceGetGpuInstanceId" not in delta and "nvmlDeviceGetName" not in delta
    assert "nvmlDeviceGetMaxMigDeviceCount" not in delta


def test_choose_mig_deny_allow_only() -> None:
    s = mig_host()
    c = s.client
    # deny (default): the card in MIG mode is not a whole card to hand out.
    resp = c.get("/choose?n=1&format=json&lease=0")
    body = resp.get_json()
    assert [g["uuid"] for g in body["chosen"]] == [s.sim.gpus[0].uuid]
    reasons = {r["uuid"]: r["reasons"] for r in body["rejected"]}
    assert reasons[s.sim.gpus[1].uuid] == ["MIG mode is on (use mig=allow or mig=only)"]
    assert c.get("/choose?n=2&lease=0").status_code == 503
    # only: the freest MIG device, by its MIG uuid (what CUDA_VISIBLE_DEVICES takes).
    resp = c.get("/choose?n=1&mig=only&lease=0")
    assert resp.status_code == 200
    assert resp.text == s.sim.mig_state(1, 0).uuid + "\n"  # 3g.40gb has the most free
    # Several MIG devices: one per line, a process each (never one CUDA_VISIBLE_DEVICES).
    resp = c.get("/choose?n=3&mig=only&lease=0&format=list")
    uuids = [s.sim.mig_state(1, k).uuid for k in range(3)]
    assert resp.text == "".join(u + "\n" for u in uuids)
    assert c.get("/choose?n=4&mig=only&lease=0&format=list").status_code == 503
    # allow: whole cards or MIG devices, never both in one answer.
    resp = c.get("/choose?n=4&mig=allow&lease=0&format=json")
    assert resp.status_code == 503
    # Filters apply to MIG devices too; utilization is unknown for them, so max_util rejects.
    resp = c.get("/choose?n=1&mig=only&max_util=50%&lease=0&format=json")
    assert resp.status_code == 503
    assert "utilization unknown" in resp.get_json()["error"]["message"]
    resp = c.get("/choose?n=1&mig=only&exclude=" + uuids[0] + "&lease=0")
    assert resp.text.strip() == uuids[1]


def test_choose_mig_parameter_errors() -> None:
    s = mig_host()
    resp = s.client.get("/choose?n=1&mig=maybe&format=json")
    assert resp.status_code == 400
    assert resp.get_json()["error"]["param"] == "mig"
    resp = s.client.get("/choose?n=1&mig=only&format=index")
    assert resp.status_code == 400
    assert "MIG" in resp.text


def test_a_leased_mig_device_stays_leased_and_is_exported() -> None:
    s = mig_host()
    resp = s.client.get("/choose?n=1&mig=only")
    uuid = resp.text.strip()
    assert uuid.startswith("MIG-")
    s.clock.advance(1)
    s.sample()
    assert s.registry.get_sample_value("gpu_leased", {"gpu": "1", "uuid": uuid}) == 1
    assert [lease.uuids for lease in s.leases.active(s.cache.get())] == [(uuid,)]
    again = s.client.get("/choose?n=1&mig=only&lease=0").text.strip()
    assert again != uuid


def test_gpus_json_nests_mig_devices() -> None:
    s = mig_host()
    body = s.client.get("/gpus").get_json()
    parent = body["gpus"][1]
    assert parent["mig_mode_enabled"] is True
    assert [d["mig_profile"] for d in parent["mig_devices"]] == list(PROFILES)
    assert parent["mig_devices"][0]["utilization_ratio"] is None
    assert parent["mig_devices"][0]["parent_uuid"] == parent["uuid"]


def test_scenario_mig_validation() -> None:
    clock = FakeClock()
    sim = SimulatedNvml.of(
        Scenario.from_table({"gpus": [{"model": A100, "mig": ["7g.80gb"]}]}), clock=clock.monotonic
    )
    assert sim.gpus[0].mig == ("7g.80gb",)
    with pytest.raises(ValueError, match=r"no MIG profile '1g\.5gb'"):
        SimulatedNvml.of(
            Scenario.from_table({"gpus": [{"model": A100, "mig": ["1g.5gb"]}]}),
            clock=clock.monotonic,
        )
    with pytest.raises(ValueError, match="no MIG on this model"):
        SimulatedNvml.of(
            Scenario.from_table({"gpus": [{"model": "NVIDIA L4", "mig": ["1g.10gb"]}]}),
            clock=clock.monotonic,
        )
    with pytest.raises(ValueError, match=r"use 8 of 7 slices"):
        SimulatedNvml.of(
            Scenario.from_table({"gpus": [{"model": A100, "mig": ["4g.40gb", "4g.40gb"]}]}),
            clock=clock.monotonic,
        )


def test_a_mig_device_without_memory_v2_does_not_downgrade_the_whole_cards() -> None:
    s = build_stack(
        sim_of(SimGpu(0, A100, Load("busy")), SimGpu(1, A100, Load("busy"), mig=("7g.80gb",)))
    )
    real = s.sim.nvmlDeviceGetMemoryInfo

    def no_v2_on_mig(handle: object, version: int | None = None) -> object:
        if isinstance(handle, SimMig) and version is not None:
            raise make_error(error_code("NOT_SUPPORTED"))
        return real(handle, version)  # type: ignore[arg-type]

    s.sim.nvmlDeviceGetMemoryInfo = no_v2_on_mig  # type: ignore[method-assign,assignment]
    s.sample()
    s.sample()
    gpus = s.cache.get().gpus
    assert gpus[0].memory_reserved_bytes == s.sim.state(0).memory_reserved  # still v2
    mig = gpus[1].mig_devices[0]
    assert mig.memory_total_bytes == s.sim.mig_state(1, 0).memory_total  # v1 for the MIG device
    assert mig.memory_reserved_bytes is None


def test_status_page_lists_mig_devices() -> None:
    s = mig_host()
    page = s.client.get("/").text
    for slot, profile in enumerate(PROFILES):
        assert s.sim.mig_state(1, slot).uuid in page
        assert f"MIG {profile}" in page
