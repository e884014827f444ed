"""The HTTP API through Flask's test client: answers, exact error bodies, no NVML in requests."""

from __future__ import annotations

import pytest

from conftest import Stack, build_stack, sim_of
from gpu_exporter.simulate import Fault, Load, SimGpu, SimulatedNvml

A100 = "NVIDIA A100-SXM4-80GB"
# Busy cards qualify too: off the exporter's default filters (max_util=50%&max_mem_used=50%).
ANY_LOAD = "max_util=100%&max_mem_used=100%"


def uuids(s: Stack, *indices: int) -> str:
    return ",".join(s.sim.gpus[i].uuid for i in indices) + "\n"


def test_choose_returns_uuids_of_the_freest_gpus(stack: Stack) -> None:
    # 0 busy (86 % memory), 1 idle, 2 sine, 3 light (18 %)
    resp = stack.client.get("/choose?n=2")
    assert resp.status_code == 200
    assert resp.mimetype == "text/plain"
    assert resp.text == uuids(stack, 1, 3)
    assert resp.headers["Cache-Control"] == "no-store"


def test_choose_defaults_to_one(stack: Stack) -> None:
    assert stack.client.get("/choose").text == uuids(stack, 1)


def test_choose_index_format(stack: Stack) -> None:
    assert stack.client.get(f"/choose?n=3&format=index&{ANY_LOAD}").text == "1,3,2\n"


def test_choose_json(stack: Stack) -> None:
    body = stack.client.get("/choose?n=1&format=json&max_util=30%&max_mem_used=100%").get_json()
    assert body["n"] == 1
    assert [g["index"] for g in body["chosen"]] == [1]
    assert body["chosen"][0]["uuid"] == stack.sim.gpus[1].uuid
    assert body["chosen"][0]["memory_free_bytes"] == stack.sim.state(1).memory_free
    reasons = {r["index"]: r["reasons"] for r in body["rejected"]}
    assert reasons[0] == ["utilization 0.97 > max_util 0.30"]
    assert reasons[3] == ["ranked 2 of 2 qualifying; 1 requested"]
    assert body["snapshot_age_seconds"] == 0.0
    assert body["filters"] == {
        "max_util": {"value": 0.3, "from": "request"},
        "max_mem_used": {"value": 1.0, "from": "request"},
    }


def test_choose_filters(stack: Stack) -> None:
    assert stack.client.get("/choose?min_free=65GiB&exclude=1").text == uuids(stack, 3)
    excluded = f"exclude={stack.sim.gpus[1].uuid[:12]},3"
    assert stack.client.get(f"/choose?{excluded}&format=index&{ANY_LOAD}").text == "2\n"


@pytest.mark.parametrize(
    ("query", "param", "message"),
    [
        ("n=abc", "n", "n must be a whole number from 1 to 1024, got 'abc'"),
        ("n=0", "n", "n must be a whole number from 1 to 1024, got '0'"),
        ("n=-1", "n", "n must be a whole number from 1 to 1024, got '-1'"),
        ("n=1e9", "n", "n must be a whole number from 1 to 1024, got '1e9'"),
        ("n=1&n=2", "n", "n given more than once"),
        ("format=xml", "format", "format must be one of uuid, index, env, json, list, got 'xml'"),
        (
            "min_free=lots",
            "min_free",
            "min_free: expected a size such as 8GiB, 500MB or a byte count, got 'lots'",
        ),
        (
            "max_util=150%",
            "max_util",
            "max_util: expected a ratio between 0 and 1 (or 0% and 100%), got '150%'",
        ),
        (
            "exclude=foo",
            "exclude",
            "exclude: 'foo' is not an NVML index, a UUID (GPU-…) or a PCI bus id",
        ),
    ],
)
def test_choose_rejects_bad_parameters(stack: Stack, query: str, param: str, message: str) -> None:
    plain = stack.client.get(f"/choose?{query}")
    assert plain.status_code == 400
    assert plain.mimetype == "text/plain"
    assert plain.text == f"error: {message}\n"
    as_json = stack.client.get(f"/choose?{query}", headers={"Accept": "application/json"})
    assert as_json.status_code == 400
    assert as_json.get_json() == {
        "error": {"code": "invalid_parameter", "message": message, "param": param}
    }


def test_unknown_parameters_are_rejected(stack: Stack) -> None:
    resp = stack.client.get("/choose?n=1&gpus=2&format=json")
    assert resp.status_code == 400
    assert resp.get_json() == {
        "error": {
            "code": "unknown_parameter",
            "message": "unknown parameter 'gpus'; /choose takes n, format, lease, owner, wait, "
            "idle_for, sort, min_free, min_total, max_util, max_mem_used, max_mem_util, "
            "max_sm_active, max_procs, model, "
            "include, exclude, mig, mem, pid",
            "param": "gpus",
        }
    }


def test_not_enough_gpus_is_503_never_an_empty_200(stack: Stack) -> None:
    resp = stack.client.get("/choose?n=4&max_util=0.5&max_mem_used=1")
    assert resp.status_code == 503
    assert resp.text == (
        "error: 2 of 4 GPUs qualify, 4 requested (gpu 0: utilization 0.97 > max_util 0.50; "
        "gpu 2: utilization 1.00 > max_util 0.50)\n"
    )
    body = stack.client.get(f"/choose?n=9&format=json&{ANY_LOAD}").get_json()
    assert body["error"]["code"] == "not_enough_gpus"
    assert body["error"]["param"] is None
    assert body["error"]["message"] == (
        "4 of 4 GPUs qualify, 9 requested; at most 4 of the 4 GPUs here could ever qualify"
    )


def test_lost_gpu_is_never_chosen() -> None:
    s = build_stack(
        sim_of(
            SimGpu(0, A100, Load("busy")),
            SimGpu(1, A100, Load("idle")),
            faults=[Fault("*", "GPU_IS_LOST", gpu=1)],
        )
    )
    s.sample()
    assert s.client.get(f"/choose?n=1&format=index&{ANY_LOAD}").text == "0\n"
    resp = s.client.get(f"/choose?n=2&{ANY_LOAD}")
    assert resp.status_code == 503
    assert "gpu 1: down: nvmlDeviceGetHandleByIndex: GPU is lost (GPU_IS_LOST)" in resp.text


def test_nvml_down_gives_503_with_the_reason() -> None:
    s = build_stack(
        lambda clock: SimulatedNvml(
            [], faults=[Fault("nvmlInit", "DRIVER_NOT_LOADED")], clock=clock.monotonic
        )
    )
    s.sample()
    resp = s.client.get("/choose", headers={"Accept": "application/json"})
    assert resp.status_code == 503
    assert resp.get_json()["error"] == {
        "code": "nvml_unavailable",
        "message": "NVML is not available: nvmlInit: Driver Not Loaded (DRIVER_NOT_LOADED)",
        "param": None,
    }
    ready = s.client.get("/readyz")
    assert ready.status_code == 503
    assert (
        ready.text
        == "not ready: NVML is not available: nvmlInit: Driver Not Loaded (DRIVER_NOT_LOADED)\n"
    )
    assert s.client.get("/healthz").status_code == 200  # liveness does not depend on NVML


def test_before_the_first_sample() -> None:
    s = build_stack(sim_of(SimGpu(0, A100, Load("idle"))))
    resp = s.client.get("/choose")
    assert (resp.status_code, resp.text) == (
        503,
        "error: no sample yet: the exporter is starting\n",
    )


def test_stale_snapshot_is_refused(stack: Stack) -> None:
    stack.clock.advance(11)
    resp = stack.client.get("/choose?format=json")
    assert resp.status_code == 503
    assert resp.get_json()["error"]["code"] == "snapshot_stale"
    assert "11.0 s old (limit 10 s)" in resp.get_json()["error"]["message"]
    assert stack.client.get("/readyz").status_code == 503


def test_bad_parameters_win_over_a_broken_state() -> None:
    s = build_stack(sim_of(SimGpu(0, A100, Load("idle"))))
    assert s.client.get("/choose?n=x").status_code == 400


def test_readyz_and_healthz(stack: Stack) -> None:
    assert (stack.client.get("/readyz").status_code, stack.client.get("/readyz").text) == (
        200,
        "ready\n",
    )
    assert stack.client.get("/healthz").text == "ok\n"


def test_gpus_json(stack: Stack) -> None:
    body = stack.client.get("/gpus").get_json()
    assert body["simulated"] is True
    assert body["nvml_up"] is True
    assert body["driver_version"] == "550.54.15"
    assert [g["uuid"] for g in body["gpus"]] == [g.uuid for g in stack.sim.gpus]
    assert body["gpus"][0]["fan_speed_ratio"] is None
    assert body["gpus"][0]["memory_used_bytes"] == stack.sim.state(0).memory_used


def test_landing_page_links_and_labels_simulation(stack: Stack) -> None:
    html = stack.client.get("/").text
    for link in (
        'href="metrics"',
        'href="choose?n=1',
        'href="gpus"',
        'href="healthz"',
        'href="readyz"',
    ):
        assert link in html
    assert "Simulated GPUs" in html
    assert html.count('<tr class="gpu"') == 4


def test_metrics_endpoint(stack: Stack) -> None:
    resp = stack.client.get("/metrics")
    assert resp.status_code == 200
    assert resp.mimetype == "text/plain"
    assert f'gpu_up{{gpu="0",uuid="{stack.sim.gpus[0].uuid}"}} 1.0' in resp.text


def test_unknown_paths_and_methods_are_one_plain_line(stack: Stack) -> None:
    resp = stack.client.get("/nope")
    assert (resp.status_code, resp.text) == (
        404,
        "error: Not Found: /nope (see / for the endpoints)\n",
    )
    resp = stack.client.put("/choose")
    assert resp.status_code == 405
    assert resp.text.startswith("error: ") and resp.text.count("\n") == 1


def test_requests_never_call_nvml(stack: Stack) -> None:
    before = dict(stack.sim.calls)
    paths = ("/metrics", "/choose?n=2", f"/choose?format=json&{ANY_LOAD}", "/gpus", "/readyz", "/")
    for path in paths:
        assert stack.client.get(path).status_code == 200
    assert stack.sim.calls == before
