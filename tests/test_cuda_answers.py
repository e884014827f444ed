"""Issue 13, point 7: answers CUDA can use.

NVIDIA's MIG user guide: a CUDA process can use only one MIG device, and no whole GPU once a
MIG device is visible. So one answer never mixes ``GPU-…`` and ``MIG-…``, and several MIG
devices come only one per line (``format=list``) or as JSON. ``idle_for`` longer than the
history the exporter keeps could never be met, so it is refused. Each test fails on the code
before the change (which put four MIG devices in one ``CUDA_VISIBLE_DEVICES``, mixed kinds
under ``mig=allow`` and accepted ``idle_for=30m``).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest

from conftest import Stack, build_stack, sim_of
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.request import parse_choose_args
from gpu_exporter.simulate import Load, Scenario, SimGpu, SimulatedNvml
from served import served

A100 = "NVIDIA A100-SXM4-80GB"


def host(whole: int = 1) -> Stack:
    """``whole`` idle whole A100s (indices 0…), then one A100 in MIG mode with three devices."""
    gpus = [SimGpu(i, A100, Load("idle")) for i in range(whole)]
    gpus.append(SimGpu(whole, A100, Load("light"), mig=("3g.40gb", "2g.20gb", "1g.10gb")))
    s = build_stack(sim_of(*gpus))
    s.sample()
    return s


def kinds(text: str) -> set[str]:
    return {u.split("-")[0] for u in text.replace("\n", ",").split(",") if u}


@pytest.mark.parametrize("fmt", ["uuid", "env"])
def test_several_mig_devices_never_go_into_one_cuda_visible_devices(fmt: str) -> None:
    s = host()
    resp = s.client.get(f"/choose?n=3&mig=only&format={fmt}")
    assert resp.status_code == 400
    assert resp.text.startswith("error: a CUDA process can use only one MIG device")
    body = s.client.get(
        f"/choose?n=2&mig=only&format={fmt}", headers={"Accept": "application/json"}
    )
    assert body.get_json()["error"]["code"] == "mig_single_device"
    assert s.leases.active(s.cache.get()) == ()  # refused before anything was claimed
    assert s.client.get(f"/choose?n=1&mig=only&format={fmt}&lease=0").status_code == 200


def test_format_list_gives_one_device_per_line() -> None:
    s = host()
    resp = s.client.get("/choose?n=3&mig=only&format=list&lease=0")
    assert resp.status_code == 200
    lines = resp.text.splitlines()
    assert len(lines) == 3 and all(line.startswith("MIG-") for line in lines)
    assert resp.text.endswith("\n")
    whole = s.client.get("/choose?n=1&format=list&lease=0")
    assert whole.text == s.sim.gpus[0].uuid + "\n"
    body = s.client.get("/choose?n=2&mig=only&format=json&lease=0").get_json()
    assert len(body["chosen"]) == 2


def test_mig_allow_never_mixes_whole_gpus_and_mig_devices() -> None:
    s = host(whole=2)
    c = s.client
    # Two whole cards qualify: n=2 is whole cards (an idle A100 ranks above a MIG slice).
    two = c.get("/choose?n=2&mig=allow&lease=0")
    assert kinds(two.text) == {"GPU"}
    # n=3: only the MIG devices can give three, and only one per line.
    three = c.get("/choose?n=3&mig=allow&lease=0&format=list")
    assert three.status_code == 200 and kinds(three.text) == {"MIG"}
    body = c.get("/choose?n=3&mig=allow&lease=0&format=json").get_json()
    assert {g["uuid"][:4] for g in body["chosen"]} == {"MIG-"}
    reasons = {r["uuid"]: r["reasons"] for r in body["rejected"]}
    assert reasons[s.sim.gpus[0].uuid][0].startswith("a whole GPU: this answer is MIG devices")
    # The same n=3 in one CUDA_VISIBLE_DEVICES: MIG devices cannot, whole cards are too few.
    uuid = c.get("/choose?n=3&mig=allow&lease=0")
    assert uuid.status_code == 503
    assert "n=3 MIG devices need format=list or json" in uuid.text
    # n=4: neither kind has four; never 2 whole + 2 MIG.
    assert c.get("/choose?n=4&mig=allow&lease=0&format=list").status_code == 503


def test_a_mig_allow_lease_holds_one_kind() -> None:
    s = host(whole=1)
    resp = s.client.get("/choose?n=2&mig=allow&format=list")
    assert resp.status_code == 200
    (lease,) = s.leases.active(s.cache.get())
    assert {u[:4] for u in lease.uuids} == {"MIG-"}


def test_idle_for_longer_than_the_history_is_refused() -> None:
    # The history is 600 samples back: 10 minutes at a 1 s interval, 20 at 2 s.
    s = build_stack(lambda c: SimulatedNvml.of(Scenario.with_gpus(1), clock=c.monotonic))
    s.sample()
    resp = s.client.get("/choose?idle_for=30m&format=json")
    assert resp.status_code == 400
    error = resp.get_json()["error"]
    assert error["param"] == "idle_for"
    assert "longer than the 600 s of history" in error["message"]
    assert "idle_for=600s or less" in error["message"]
    assert s.client.get("/choose?idle_for=10m&lease=0").status_code == 503  # allowed, not met yet
    slow = build_stack(
        lambda c: SimulatedNvml.of(Scenario.with_gpus(1), clock=c.monotonic), interval_seconds=2
    )
    slow.sample()
    assert slow.client.get("/choose?idle_for=20m&lease=0").status_code == 503
    assert slow.client.get("/choose?idle_for=21m&lease=0").status_code == 400
    with pytest.raises(ApiError, match="1200 s of history"):
        parse_choose_args({"idle_for": "1h"}, max_idle_for_seconds=1200)


def test_idle_for_limit_through_a_real_socket() -> None:
    with served(SimulatedNvml.of(Scenario.with_gpus(1), clock=time.monotonic)) as srv:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(srv.url + "/choose?idle_for=1h", timeout=10)
        assert info.value.code == 400
        # served() samples every 0.2 s: 600 samples reach back 120 s.
        assert "120 s of history" in info.value.read().decode()
