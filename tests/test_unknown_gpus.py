"""Issue 27, point 4: names that do not exist are errors.

``exclude=GPU-zzz`` and ``exclude=7`` on a 4-GPU host were accepted silently (a typo excluded
nothing) and ``include=7`` answered 503 with "not included" for every GPU. An index, UUID
(prefix) or PCI bus id in ``include``/``exclude`` that matches no GPU on the host is now a 400
naming it, at once, for claims and advice, from the server and when choosing locally. Each
test fails on the code before.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from gpu_exporter import client
from gpu_exporter.client import GpuExporterError, ServerError
from gpu_exporter.nvml import Nvml
from gpu_exporter.simulate import Scenario, SimulatedNvml
from harness import get
from served import served


def error_json(url: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    return info.value.code, json.loads(info.value.read())["error"]


@pytest.mark.parametrize(
    ("query", "param", "named"),
    [
        ("exclude=GPU-zzz", "exclude", "'GPU-zzz'"),
        ("exclude=7", "exclude", "'7'"),
        ("include=7", "include", "'7'"),
        ("include=6,2", "include", "'6' names"),
        ("include=00000000:99:00.0", "include", "'00000000:99:00.0'"),
        ("exclude=0,GPU-zzz,9&lease=0", "exclude", "'GPU-zzz', '9' name"),
        ("include=7&wait=20s", "include", "'7'"),  # refused at once, never waited for
    ],
)
def test_a_gpu_this_host_does_not_have_is_a_400_naming_it(
    query: str, param: str, named: str
) -> None:
    with served() as srv:  # four GPUs: 0-3
        started = time.monotonic()
        status, error = error_json(f"{srv.url}/choose?n=1&{query}")
        assert time.monotonic() - started < 5
        assert status == 400
        assert error["code"] == "invalid_parameter" and error["param"] == param
        assert f"{param}: {named}" in error["message"]
        assert "no GPU on this host (its GPUs: 0, 1, 2, 3;" in error["message"]
        assert srv.leases() == []


def test_names_that_exist_still_choose() -> None:
    with served() as srv:
        gpus = srv.get_json("/gpus")["gpus"]
        three = next(g for g in gpus if g["index"] == 3)
        bus = three["pci_bus_id"].lower().removeprefix("0000")  # 0000:xx:00.0, any case
        for query in (f"include={bus}", f"include={three['uuid'][:12]}", "exclude=1,0,2"):
            status, body = get(f"{srv.url}/choose?n=1&lease=0&format=index&{query}")
            assert (status, body) == (200, "3\n"), query


def test_the_client_sees_the_refusal_and_choosing_locally_refuses_too() -> None:
    with served() as srv, pytest.raises(ServerError) as info:
        client.choose(1, srv.url, lease=0, exclude=[7])
    assert info.value.status == 400 and "'7' names no GPU" in str(info.value)

    def two() -> Nvml:
        return Nvml(SimulatedNvml.of(Scenario.with_gpus(2), clock=time.monotonic), simulated=True)

    with pytest.raises(GpuExporterError, match=r"exclude: 'GPU-zzz' names no GPU"):
        client.choose_locally(1, {"exclude": "GPU-zzz", "max_util": 1}, open_nvml=two)
