"""Per-process memory series: values, opt-in labels, the per-GPU cap, ended processes,
visibility across PID namespaces."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import generate_latest

from conftest import CID, Stack, build_stack, fake_proc, sim_of
from gpu_exporter.simulate import Load, SimGpu

A100 = "NVIDIA A100-SXM4-80GB"


def procs_host(**kwargs: object) -> Stack:
    s = build_stack(
        sim_of(
            SimGpu(0, A100, Load("constant", utilization=0.5, memory_used_ratio=0.6, processes=3)),
            SimGpu(
                1,
                A100,
                Load(
                    "constant",
                    utilization=0.5,
                    memory_used_ratio=0.6,
                    processes=1,
                    hidden_processes=2,
                ),
            ),
            SimGpu(2, A100, Load("hidden", memory_used_ratio=0.4)),
            SimGpu(3, A100, Load("idle")),
            SimGpu(4, "NVIDIA GeForce GTX 1080", Load("busy")),  # cannot list processes
        ),
        **kwargs,  # type: ignore[arg-type]
    )
    s.sample()
    return s


def label_sets(s: Stack) -> list[dict[str, str]]:
    """The label sets of every process series, as exposed."""
    return [dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) for line in process_lines(s)]


def process_lines(s: Stack) -> list[str]:
    text = generate_latest(s.registry).decode()
    return [line for line in text.splitlines() if line.startswith("gpu_process_memory_used_bytes{")]


def test_process_series_match_nvml_with_only_gpu_uuid_pid_by_default() -> None:
    s = procs_host()
    uuid = s.sim.gpus[0].uuid
    expected = {pid: used for pid, used in s.sim.state(0).processes}
    assert len(expected) == 3
    for pid, used in expected.items():
        labels = {"gpu": "0", "uuid": uuid, "pid": str(pid)}
        assert s.registry.get_sample_value("gpu_process_memory_used_bytes", labels) == used
    assert {"gpu": "0", "uuid": uuid, "pid": "4000"} in label_sets(s)  # exactly these labels
    assert len(process_lines(s)) == 3 + 1  # GPU 0's three, GPU 1's one visible process
    assert s.cache.get().process_labels == ()


def test_ended_processes_are_dropped_at_the_next_sample() -> None:
    s = procs_host()
    assert s.value("gpu_process_memory_used_bytes", 0, pid="4000") is not None
    s.sim.gpus[0].load = Load("constant", utilization=0.5, memory_used_ratio=0.6, processes=1)
    s.clock.advance(1)
    s.sample()
    assert s.value("gpu_process_memory_used_bytes", 0, pid="4000") is not None
    assert s.value("gpu_process_memory_used_bytes", 0, pid="4001") is None
    assert s.value("gpu_process_memory_used_bytes", 0, pid="4002") is None


def test_series_are_capped_per_gpu_largest_first() -> None:
    s = procs_host(process_series_limit=2)
    pids = sorted(x.split('pid="')[1].split('"')[0] for x in process_lines(s) if 'gpu="0"' in x)
    assert pids == ["4000", "4001"]  # equal memory: the lowest pids
    # The cap is on series only: the count and /gpus still have all of them.
    assert s.value("gpu_compute_processes", 0) == 3
    assert len(s.client.get("/gpus").get_json()["gpus"][0]["processes"]) == 3
    assert process_lines(procs_host(process_series_limit=0)) == []


def test_a_pid_listed_twice_is_one_series_with_its_memory_summed() -> None:
    s = procs_host()
    sim = s.sim
    real = sim.nvmlDeviceGetComputeRunningProcesses

    def twice(handle: object) -> list[SimpleNamespace]:
        return real(handle) + real(handle)  # type: ignore[arg-type]

    sim.nvmlDeviceGetComputeRunningProcesses = twice  # type: ignore[method-assign]
    s.sample()
    pid, used = sim.state(0).processes[0]
    assert s.value("gpu_process_memory_used_bytes", 0, pid=str(pid)) == 2 * used
    assert s.value("gpu_compute_processes", 0) == 3


def test_process_visibility() -> None:
    s = procs_host()
    gpus = s.client.get("/gpus").get_json()["gpus"]
    assert [g["process_visibility"] for g in gpus] == ["full", "partial", "none", "full", None]
    # Memory of invisible processes still counts as used: /choose never calls it free.
    assert gpus[2]["memory_used_bytes"] == s.sim.state(2).memory_used > 0
    assert gpus[2]["compute_processes"] == 0
    assert gpus[4]["processes"] is None  # NOT_SUPPORTED: unknown, not "no processes"


def test_opt_in_labels_from_proc(tmp_path: Path) -> None:
    fake_proc(
        tmp_path,
        4000,
        uid=0,
        cmdline=b"/opt/conda/bin/python\x00train.py\x00--token=secret\x00",
        cgroup=f"0::/system.slice/docker-{CID}.scope\n",
        start=1,
    )
    fake_proc(
        tmp_path,
        4001,
        uid=0,
        cmdline=b"./a.out\x00",
        cgroup="0::/system.slice/slurmstepd.scope/job_99/step_0/user/task_0\n",
        start=2,
    )
    # 4002 is in another PID namespace: not in this /proc.
    s = procs_host(process_labels=("command", "container", "user"), proc_root=str(tmp_path))
    uuid = s.sim.gpus[0].uuid
    assert s.cache.get().process_labels == ("user", "command", "container")
    sets = {x["pid"]: x for x in label_sets(s) if x["gpu"] == "0"}
    ids = {"gpu": "0", "uuid": uuid}
    assert sets["4000"] == {
        **ids,
        "pid": "4000",
        "user": "root",
        "command": "python",
        "container": CID,
    }
    assert sets["4001"] == {
        **ids,
        "pid": "4001",
        "user": "root",
        "command": "a.out",
        "container": "",
    }
    assert sets["4002"] == {**ids, "pid": "4002", "user": "", "command": "", "container": ""}
    assert "secret" not in generate_latest(s.registry).decode()
    procs = s.client.get("/gpus").get_json()["gpus"][0]["processes"]
    assert procs[0] == {
        "pid": 4000,
        "used_memory_bytes": s.sim.state(0).processes[0][1],
        "user": "root",
        "command": "python",
        "container": CID,
        "slurm_job": None,  # not enabled: not read, not shown
        "pod": None,
        # its share of the card's (the simulator splits utilization among the processes)
        "sm_utilization_ratio": s.sim.state(0).utilization_gpu // 3 / 100,
        "memory_utilization_ratio": s.sim.state(0).utilization_memory // 3 / 100,
    }
    assert s.client.get("/gpus").get_json()["process_labels"] == ["user", "command", "container"]


def test_slurm_and_pod_labels(tmp_path: Path) -> None:
    pod = "8e2a6c1d-5b4f-4a3e-9d7c-1b2a3c4d5e6f"
    fake_proc(
        tmp_path,
        4000,
        uid=0,
        cmdline=b"x\x00",
        cgroup="4:memory:/slurm/uid_0/job_7/step_0\n",
        start=1,
    )
    fake_proc(
        tmp_path,
        4001,
        uid=0,
        cmdline=b"x\x00",
        cgroup=f"0::/kubepods.slice/kubepods-pod{pod.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
        start=1,
    )
    s = procs_host(process_labels=("slurm_job", "pod"), proc_root=str(tmp_path))
    uuid = s.sim.gpus[0].uuid
    base = {"gpu": "0", "uuid": uuid}
    used = s.sim.state(0).processes[0][1]
    r = s.registry
    assert (
        r.get_sample_value(
            "gpu_process_memory_used_bytes", {**base, "pid": "4000", "slurm_job": "7", "pod": ""}
        )
        == used
    )
    assert (
        r.get_sample_value(
            "gpu_process_memory_used_bytes", {**base, "pid": "4001", "slurm_job": "", "pod": pod}
        )
        == used
    )
