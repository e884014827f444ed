"""Issue 27 point 2: inside a job a launcher already gave GPUs (Slurm, a container runtime,
an outer CUDA_VISIBLE_DEVICES), `run`, `choose` and use_gpus() choose only among them.

The rules first (gpu_exporter/client/allocation.py, pure), then the commands and the client
over a real socket against four simulated GPUs, and the local fallback."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

import pytest

from gpu_exporter import client
from gpu_exporter.client import GpuExporterError, NoGpusAvailable, use_gpus
from gpu_exporter.client.allocation import HostGpu, allocation, cuda_indices
from gpu_exporter.client.hostapi import as_indices
from gpu_exporter.nvml import Nvml
from gpu_exporter.simulate import DEFAULT_MODEL, Load, Scenario, SimGpu, SimulatedNvml
from harness import cli, finish, free_port
from served import Served, served

MASKS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "SLURM_JOB_GPUS", "NVIDIA_VISIBLE_DEVICES")
# Four cards whose NVML order is not their PCI bus order, two models.
HOST = [
    HostGpu(0, "GPU-a", "00000000:81:00.0", "NVIDIA A100-SXM4-80GB"),
    HostGpu(1, "GPU-b", "00000000:01:00.0", "NVIDIA A100-SXM4-80GB"),
    HostGpu(2, "GPU-c", "00000000:41:00.0", "NVIDIA H100 80GB HBM3"),
    HostGpu(3, "GPU-d", "00000000:C1:00.0", "NVIDIA H100 80GB HBM3"),
]


def host() -> list[HostGpu]:
    return HOST


def never() -> list[HostGpu]:
    raise AssertionError("the host's GPUs were asked for, though nothing needed mapping")


@pytest.mark.parametrize(
    ("environ", "include"),
    [
        ({}, None),
        ({"CUDA_VISIBLE_DEVICES": ""}, None),  # an emptied variable: unset
        ({"NVIDIA_VISIBLE_DEVICES": "all"}, None),
        ({"CUDA_VISIBLE_DEVICES": "GPU-c,MIG-x"}, ("GPU-c", "MIG-x")),  # UUIDs are exact
        ({"SLURM_JOB_GPUS": "1,3"}, ("1", "3")),
        ({"NVIDIA_VISIBLE_DEVICES": "2,3"}, ("2", "3")),
        ({"NVIDIA_VISIBLE_DEVICES": "GPU-b"}, ("GPU-b",)),
        # Slurm without device cgroups: CUDA_VISIBLE_DEVICES is the host's numbering
        ({"SLURM_JOB_GPUS": "1,3", "CUDA_VISIBLE_DEVICES": "1,3"}, ("1", "3")),
        # ... with them: the job's own 0..k-1
        ({"SLURM_JOB_GPUS": "1,3", "CUDA_VISIBLE_DEVICES": "0,1"}, ("1", "3")),
        # a subset only one reading allows: 3 is past the job's 0..1, so the host's GPU 3
        ({"SLURM_JOB_GPUS": "1,3", "CUDA_VISIBLE_DEVICES": "3"}, ("3",)),
        ({"SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0"}, ("2",)),
        ({"NVIDIA_VISIBLE_DEVICES": "GPU-c,GPU-d", "CUDA_VISIBLE_DEVICES": "1"}, ("GPU-d",)),
    ],
)
def test_where_the_jobs_gpus_are_read_from(
    environ: dict[str, str], include: tuple[str, ...] | None
) -> None:
    found = allocation(environ, never)
    assert (found and found.include) == include


def test_cuda_indices_are_mapped_through_the_pci_bus_order() -> None:
    # PCI order: 01 (GPU-b), 41 (GPU-c), 81 (GPU-a), C1 (GPU-d); NVML's indices differ
    found = allocation({"CUDA_VISIBLE_DEVICES": "0,2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, host)
    assert found is not None and found.include == ("GPU-b", "GPU-a")
    # fastest first is PCI order too where every card is the same model
    same = [HostGpu(g.index, g.uuid, g.pci_bus_id, "NVIDIA A100") for g in HOST]
    assert allocation({"CUDA_VISIBLE_DEVICES": "1"}, lambda: same).include == ("GPU-c",)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"CUDA_VISIBLE_DEVICES": "1"}, "set CUDA_DEVICE_ORDER=PCI_BUS_ID"),  # two models
        ({"CUDA_VISIBLE_DEVICES": "9", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, "no GPU 9"),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, "gives this job no GPU"),
        ({"NVIDIA_VISIBLE_DEVICES": "none"}, "gives this job no GPU"),
        ({"CUDA_VISIBLE_DEVICES": "0,GPU-a", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, "mixes"),
        # 1 is the host's GPU 1 or the job's second card (the host's 3): refuse, don't guess
        ({"SLURM_JOB_GPUS": "1,3", "CUDA_VISIBLE_DEVICES": "1"}, "can name different cards"),
        ({"SLURM_JOB_GPUS": "1,3", "CUDA_VISIBLE_DEVICES": "5"}, "names no allocated card"),
    ],
)
def test_a_mask_that_cannot_be_read_surely_is_refused(
    environ: dict[str, str], message: str
) -> None:
    with pytest.raises(GpuExporterError, match=message) as caught:
        allocation(environ, host)
    assert "--ignore-mask" in str(caught.value) or "no GPU 9" in str(caught.value)


# -- over a real socket ------------------------------------------------------------------


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    idle = [SimGpu(i, DEFAULT_MODEL, Load("idle")) for i in range(4)]
    with served(SimulatedNvml(idle, clock=time.monotonic)) as ex:
        for name in MASKS:
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv(client.URL_ENV, ex.url)
        yield ex


def run_job(*args: str, **env: str) -> tuple[int, str, str]:
    show = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"
    proc = cli("run", *args, "--", sys.executable, "-c", show, env={**os.environ, **env})
    return finish(proc)


def test_run_chooses_inside_slurms_allocation(exporter: Served) -> None:
    uuids = {g.index: g.uuid for g in exporter.daemon.cache.get().gpus}
    # Slurm gave the job cards 1 and 3 (device cgroups: CUDA numbers them 0 and 1)
    for _ in range(3):
        status, out, err = run_job(SLURM_JOB_GPUS="1,3", CUDA_VISIBLE_DEVICES="0,1")
        assert status == 0, err
        assert out.strip() in {uuids[1], uuids[3]}
        assert "replacing" not in err
    status, out, err = run_job("-n", "2", SLURM_JOB_GPUS="1,3", CUDA_VISIBLE_DEVICES="0,1")
    assert status == 0 and set(out.strip().split(",")) == {uuids[1], uuids[3]}
    status, _, err = run_job("-n", "3", SLURM_JOB_GPUS="1,3")
    assert status == 3 and "not included" in err, err
    # --ignore-mask: the whole host, and a warning that the mask is replaced
    status, out, err = run_job("-n", "3", "--ignore-mask", CUDA_VISIBLE_DEVICES="0,1")
    assert status == 0 and len(out.strip().split(",")) == 3
    assert "warning: replacing CUDA_VISIBLE_DEVICES=0,1" in err
    assert exporter.lease_ids() == set()


def test_choose_and_use_gpus_stay_inside_a_uuid_mask(
    exporter: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    uuids = [g.uuid for g in exporter.daemon.cache.get().gpus]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuids[2])
    with use_gpus(1) as gpus:
        assert gpus.uuids == (uuids[2],)
    with pytest.raises(NoGpusAvailable):
        client.choose(2, lease=0)
    assert len(client.choose(2, lease=0, ignore_mask=True).uuids) == 2
    with pytest.raises(GpuExporterError, match="include= and this job's GPUs"):
        client.choose(1, lease=0, include=[0])
    proc = cli("choose", "--lease", "0", env={**os.environ})
    status, out, err = finish(proc)
    assert status == 0 and out.strip() == uuids[2], err


def test_a_choice_across_hosts_is_not_confined_by_this_hosts_mask(
    exporter: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mask names the cards of the host the job runs on; a fleet choice claims on another
    host (here the exporter, named by --hosts), whose cards it does not name."""
    monkeypatch.setenv("SLURM_JOB_GPUS", "1")
    choice = client.choose(2, hosts=[exporter.url], lease=0)
    assert len(choice.uuids) == 2


def test_indices_of_a_choice_across_hosts_follow_the_chosen_hosts_order(
    exporter: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This host's Slurm mask says nothing of how CUDA on the chosen host numbers its cards
    (before, it was applied there: refused here, or wrong indices)."""
    by_uuid = {g.uuid: g.index for g in exporter.daemon.cache.get().gpus}  # PCI order here
    monkeypatch.setenv("SLURM_JOB_GPUS", "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    choice = client.choose(1, hosts=[exporter.url], lease=0)
    assert choice.host is not None
    env = as_indices(choice)
    assert env["CUDA_VISIBLE_DEVICES"] == str(by_uuid[choice.uuids[0]])


def test_without_a_server_the_local_choice_stays_inside_the_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in MASKS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_GPUS", "3")

    def four() -> Nvml:
        return Nvml(SimulatedNvml.of(Scenario.with_gpus(4), clock=time.monotonic), simulated=True)

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    block = use_gpus(1, url, max_util=1, max_mem_util=1, open_nvml=four)
    with pytest.warns(client.GpuExporterWarning, match="No lease protects this choice"), block:
        assert block.choice is not None and block.choice.indices == (3,)


# -- the index mode: for tools that cannot take UUIDs ------------------------------------


@pytest.mark.parametrize(
    ("environ", "chosen", "places"),
    [
        ({}, ("GPU-a", "GPU-d"), (2, 3)),  # the whole host in PCI order: b, c, a, d
        ({"NVIDIA_VISIBLE_DEVICES": "0,3"}, ("GPU-d",), (1,)),  # the container sees a, d
        # Slurm with device cgroups: CUDA sees only the job's cards (here c and d)
        ({"SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0,1"}, ("GPU-d",), (1,)),
        # ... without them: the whole host
        ({"SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "2,3"}, ("GPU-d",), (3,)),
    ],
)
def test_indices_name_the_leased_cards_as_the_jobs_cuda_counts_them(
    environ: dict[str, str], chosen: tuple[str, ...], places: tuple[int, ...]
) -> None:
    assert cuda_indices(chosen, environ, host) == places


def test_indices_that_could_name_other_cards_are_refused() -> None:
    with pytest.raises(GpuExporterError, match="cannot tell whether CUDA here numbers"):
        cuda_indices(("GPU-d",), {"SLURM_JOB_GPUS": "2,3"}, host)
    with pytest.raises(GpuExporterError, match="MIG device"):
        cuda_indices(("MIG-x",), {}, host)


def test_run_choose_and_use_gpus_export_indices_when_asked(
    exporter: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    by_uuid = {g.uuid: g.index for g in exporter.daemon.cache.get().gpus}  # PCI order here
    status, out, err = run_job("--indices", SLURM_JOB_GPUS="1,3", CUDA_VISIBLE_DEVICES="0,1")
    assert status == 0 and out.strip() in {"0", "1"}, err  # the job's own 0..1
    status, out, err = finish(cli("choose", "--indices", "--format", "env", env={**os.environ}))
    assert status == 0, err
    words = dict(w.split("=", 1) for w in out.split()[1:])
    assert words["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and words["GPU_LEASE"]
    assert words["CUDA_VISIBLE_DEVICES"].isdigit()
    client.release(words["GPU_LEASE"])
    status, _, err = finish(cli("choose", "--indices", env={**os.environ}))
    assert status != 0 and "--format env" in err
    with use_gpus(1, indices=True) as gpus:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == str(by_uuid[gpus.uuids[0]])
    # inside Slurm's device cgroup: the job's own 0..1, read from the mask before it is replaced
    monkeypatch.setenv("SLURM_JOB_GPUS", "1,3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with use_gpus(1, indices=True) as gpus:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == str([1, 3].index(by_uuid[gpus.uuids[0]]))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert exporter.lease_ids() == set()
