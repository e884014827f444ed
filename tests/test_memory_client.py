"""Issue 16 from the job's side: ``use_gpus(mem=…, framework=…)``, ``Choice.apply_torch()`` /
``apply_tensorflow()``, ``gpu-exporter run --mem``, and every name of the memory caps agreeing
between ``format=env``, the client, the OpenAPI document and the README.

The framework calls are checked against recording stand-ins put in ``sys.modules`` for one
test (the docs/frameworks.md snippets run the fuller stand-ins of tests/standins).
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from gpu_exporter import client, use_gpus
from gpu_exporter.choose.memory import CUDA_CONTEXT_BYTES, MEM_ENV_NAMES
from gpu_exporter.client.choosing import http_claimer
from gpu_exporter.client.transport import GpuExporterError, GpuExporterWarning
from gpu_exporter.fleet.placing import choose_fleet
from gpu_exporter.simulate import DEFAULT_MODEL, Load, SimGpu, SimulatedNvml
from harness import ROOT
from harness import run as gpu_exporter_cli
from served import Served, served

GIB, MIB = 2**30, 2**20
BASE_ENV = {"CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES", "GPU_LEASE"}


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    idle = [SimGpu(i, DEFAULT_MODEL, Load("idle")) for i in range(3)]
    with served(SimulatedNvml(idle, clock=time.monotonic)) as ex:
        monkeypatch.setenv(client.URL_ENV, ex.url)
        for name in MEM_ENV_NAMES:
            monkeypatch.delenv(name, raising=False)
        yield ex


def fake_torch(calls: list[tuple[Any, ...]]) -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        set_per_process_memory_fraction=lambda f, d=None: calls.append(("fraction", f, d)),
        is_initialized=lambda: False,
    )
    return torch


def fake_tensorflow(calls: list[tuple[Any, ...]], gpus: int) -> types.ModuleType:
    tf = types.ModuleType("tensorflow")
    tf.config = types.SimpleNamespace(  # type: ignore[attr-defined]
        list_physical_devices=lambda kind=None: [f"/physical_device:GPU:{i}" for i in range(gpus)],
        set_logical_device_configuration=lambda d, c: calls.append(("logical", d, c)),
        LogicalDeviceConfiguration=lambda memory_limit=None: ("limit", memory_limit),
        experimental=types.SimpleNamespace(
            set_memory_growth=lambda d, on: calls.append(("growth", d, on))
        ),
    )
    return tf


def test_use_gpus_torch_caps_every_visible_card(
    exporter: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setitem(sys.modules, "torch", fake_torch(calls))
    with use_gpus(2, mem="8GiB", framework="torch") as gpus:
        assert gpus.mem_bytes == 8 * GIB and gpus.mem_fraction == 0.0938
        assert os.environ["GPU_MEM_LIMIT_BYTES"] == str(8 * GIB)
        assert len(set(gpus.uuids)) == 2
    assert calls == [("fraction", 0.0938, 0), ("fraction", 0.0938, 1)]
    assert not any(name in os.environ for name in MEM_ENV_NAMES)  # put back as they were
    assert exporter.leases() == []


def test_use_gpus_tensorflow_sets_logical_devices_and_no_growth(
    exporter: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setitem(sys.modules, "tensorflow", fake_tensorflow(calls, 1))
    with use_gpus(1, mem="8GiB", framework="tensorflow"):
        pass
    limit = (8 * GIB - CUDA_CONTEXT_BYTES) // MIB
    assert calls == [("logical", "/physical_device:GPU:0", [("limit", limit)])]
    assert limit == 7692


def test_use_gpus_jax_warns_when_jax_was_imported_first(
    exporter: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "jax", types.ModuleType("jax"))
    warned = pytest.warns(GpuExporterWarning, match="jax was imported before use_gpus")
    with warned, use_gpus(1, mem="8GiB", framework="jax"):
        assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.0938"


def test_framework_needs_mem_and_a_known_name() -> None:
    with pytest.raises(ValueError, match="give mem= too"):
        use_gpus(1, framework="torch")
    with pytest.raises(ValueError, match="framework must be one of"):
        use_gpus(1, mem="8GiB", framework="mxnet")


def test_apply_on_a_whole_card_choice_says_there_is_no_cap(exporter: Served) -> None:
    choice = client.choose(1, lease=0, max_util="100%")
    assert choice.mem_bytes is None
    with pytest.raises(GpuExporterError, match="not a memory lease"):
        choice.apply_torch()
    assert not set(choice.env()) & set(MEM_ENV_NAMES)


def test_every_emitted_name_agrees_across_env_client_openapi_and_readme(exporter: Served) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(exporter.url + "/choose?mem=8GiB&format=env&lease=0") as resp:
        line = resp.read().decode()
    served_env = dict(word.split("=", 1) for word in line.split()[1:])
    assert set(served_env) - {"GPU_LEASE"} == BASE_ENV - {"GPU_LEASE"} | set(MEM_ENV_NAMES)
    choice = client.choose(1, mem="8GiB", lease=0)
    client_env = choice.env()
    assert {k: v for k, v in client_env.items() if k in MEM_ENV_NAMES} == {
        k: v for k, v in served_env.items() if k in MEM_ENV_NAMES
    }
    with opener.open(exporter.url + "/openapi.json") as resp:
        openapi = json.dumps(json.loads(resp.read()))
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Memory-sized leases") :]
    section = section[: section.index("\n## ")]
    for name in MEM_ENV_NAMES:
        assert name in openapi, name
        assert f"`{name}" in section, name


def test_run_with_mem_gives_the_command_the_caps(exporter: Served) -> None:
    script = 'echo "$GPU_MEM_LIMIT_BYTES $GPU_MEM_FRACTION $XLA_PYTHON_CLIENT_MEM_FRACTION"'
    status, out, err = gpu_exporter_cli("run", "--mem", "8GiB", "--", "sh", "-c", script)
    assert status == 0, err
    assert out.split() == [str(8 * GIB), "0.0938", "0.0938"]
    assert exporter.leases() == []


def test_jax_is_given_one_name_for_its_fraction_never_both(
    exporter: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JAX 0.11 refuses XLA_PYTHON_CLIENT_MEM_FRACTION beside XLA_CLIENT_MEM_FRACTION: its
    CUDA plugin does not start and the job runs on the CPU (seen on an H100, docs/real-gpu.md).
    A memory lease sets the first; a job that inherited the second loses it, under `run` and
    use_gpus() alike; a whole-card lease leaves the job's own setting alone under `run`."""
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")
    script = 'echo "${XLA_PYTHON_CLIENT_MEM_FRACTION:-unset} ${XLA_CLIENT_MEM_FRACTION:-unset}"'
    status, out, err = gpu_exporter_cli("run", "--mem", "8GiB", "--", "sh", "-c", script)
    assert status == 0, err
    assert out.split() == ["0.0938", "unset"]
    with use_gpus(1, mem="8GiB", framework="jax"):
        assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.0938"
        assert "XLA_CLIENT_MEM_FRACTION" not in os.environ
    assert os.environ["XLA_CLIENT_MEM_FRACTION"] == "0.5"  # put back as it was
    status, out, err = gpu_exporter_cli("run", "--max-util", "100%", "--", "sh", "-c", script)
    assert status == 0, err
    assert out.split() == ["unset", "0.5"]
    assert exporter.leases() == []


def test_choose_with_mem_prints_the_env_line(exporter: Served) -> None:
    status, out, err = gpu_exporter_cli("choose", "--mem", "8G", "--format", "env")
    assert status == 0, err
    assert "GPU_MEM_LIMIT_BYTES=8589934592" in out
    assert "TF_FORCE_GPU_ALLOW_GROWTH=true" in out
    (listed,) = exporter.leases()
    assert listed["mem_bytes"] == 8 * GIB


def test_a_cluster_choice_passes_mem_to_the_hosts_claim(exporter: Served) -> None:
    """/cluster/choose?mem= (here through the client's fleet chooser, which the server's
    endpoint runs too): the fleet picks the host, the host admits the share."""
    args = {"n": "1", "mem": "8GiB", "lease": "60s"}
    result = choose_fleet(args, hosts=[exporter.url], claimer=http_claimer, release=client.release)
    (placed,) = result.placements
    assert placed.mem_bytes == 8 * GIB and placed.mem_fraction == 0.0938
    assert placed.env()["GPU_MEM_LIMIT_BYTES"] == str(8 * GIB)
    (listed,) = exporter.leases()
    assert listed["mem_bytes"] == 8 * GIB and listed["gpus"] == list(placed.uuids)
    client.release(placed)


def test_without_a_server_a_memory_lease_is_refused_not_chosen_locally(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(client.URL_ENV, "http://127.0.0.1:9")  # nothing listens there
    session = use_gpus(1, mem="8GiB")
    with pytest.raises(GpuExporterError, match="cannot lease a share of a card"):
        session.__enter__()
    for name in MEM_ENV_NAMES:
        assert name not in os.environ


def test_cluster_choose_takes_mem_and_hands_it_to_the_claim() -> None:
    from gpu_exporter.choose.request import parse_cluster_args
    from gpu_exporter.fleet.inventory import Fleet, Host

    args = {"n": "1", "mem": "8GiB", "lease": "10m"}
    req = parse_cluster_args(args, defaults={"max_util": "50%", "max_mem_used": "50%"})
    assert req.choose.mem_bytes == 8 * GIB
    # mem= takes the load default, not the memory one (issue 27: the admission rule's).
    assert req.choose.filters.get("max_util") == 0.5
    assert req.choose.filters.get("max_mem_used") is None
    seen: dict[str, Any] = {}

    def fake_choose(n: int, url: str, **kwargs: Any) -> client.Choice:
        seen.update(kwargs)
        return client.Choice(kwargs["include"][:n], (0,), "l1", 0.0, url)

    claim = http_claimer(args, req, Fleet((), "prometheus", 0.0), 5.0, choose_on_host=fake_choose)
    claim(Host("http://h:9400", "h"), 1, ("GPU-a",))
    assert seen["mem"] == "8GiB"
