"""/proc attribution: cgroup v1 and v2 lines as real hosts write them, uid, argv[0], caching."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import CID, fake_proc
from gpu_exporter.collect.procinfo import (
    CgroupInfo,
    ProcInfo,
    ProcInfoCache,
    parse_cgroup,
    parse_command,
    parse_uid,
    read_procinfo,
    start_time,
)

POD = "8e2a6c1d-5b4f-4a3e-9d7c-1b2a3c4d5e6f"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Docker, cgroup v1 (cgroupfs driver): one line per controller.
        (
            f"12:memory:/docker/{CID}\n11:devices:/docker/{CID}\n1:name=systemd:/docker/{CID}\n",
            CgroupInfo(container=CID),
        ),
        # Docker, cgroup v2 with the systemd driver.
        (f"0::/system.slice/docker-{CID}.scope\n", CgroupInfo(container=CID)),
        # Kubernetes + containerd, cgroup v2, systemd driver: pod UID written with "_".
        (
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
            f"{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
            CgroupInfo(container=CID, pod=POD),
        ),
        # Kubernetes, cgroup v1, cgroupfs driver (dashes kept).
        (
            f"11:devices:/kubepods/besteffort/pod{POD}/{CID}\n"
            f"4:memory:/kubepods/besteffort/pod{POD}/{CID}\n",
            CgroupInfo(container=CID, pod=POD),
        ),
        # Guaranteed QoS pods sit directly under kubepods.slice; CRI-O names scopes crio-….
        (
            f"0::/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/crio-{CID}.scope\n",
            CgroupInfo(container=CID, pod=POD),
        ),
        # Podman, rootless, cgroup v2.
        (
            "0::/user.slice/user-1000.slice/user@1000.service/user.slice/"
            f"libpod-{CID}.scope/container\n",
            CgroupInfo(container=CID),
        ),
        # Slurm, cgroup v1 (proctrack/cgroup): uid and job directories.
        (
            "12:devices:/slurm/uid_1000/job_4242/step_0/task_0\n"
            "5:memory:/slurm/uid_1000/job_4242/step_0/task_0\n"
            "1:name=systemd:/system.slice/slurmd.service\n",
            CgroupInfo(slurm_job="4242"),
        ),
        # Slurm, cgroup v2 (cgroup/v2 plugin): under slurmstepd.scope.
        (
            "0::/system.slice/slurmstepd.scope/job_31337/step_batch/user/task_0\n",
            CgroupInfo(slurm_job="31337"),
        ),
        # Slurm with multiple slurmd per node: slurm_<nodename>.
        (
            "7:devices:/slurm_node17/uid_501/job_77/step_extern\n",
            CgroupInfo(slurm_job="77"),
        ),
        # An ordinary login session: nothing to attribute.
        ("0::/user.slice/user-1000.slice/session-3.scope\n", CgroupInfo()),
        # The slurmd daemon itself is not a job.
        ("0::/system.slice/slurmd.service\n", CgroupInfo()),
        # Not a container id: too short, and hex-looking words inside other names.
        ("0::/system.slice/docker-abc123.scope\n", CgroupInfo()),
        ("", CgroupInfo()),
        ("garbage without colons\n", CgroupInfo()),
    ],
)
def test_parse_cgroup(text: str, expected: CgroupInfo) -> None:
    assert parse_cgroup(text) == expected


def test_parse_uid_and_command() -> None:
    status = "Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\nUid:\t1001\t0\t0\t0\nGid:\t100\n"
    assert parse_uid(status) == 1001  # the real uid, not the effective one
    assert parse_uid("Name:\tx\n") is None
    assert parse_command(b"/usr/bin/python3.11\x00-m\x00torch.distributed.run\x00") == "python3.11"
    assert parse_command(b"python\x00secret-token\x00") == "python"  # never the arguments
    assert parse_command(b"nginx: worker process\x00") == "nginx"
    assert parse_command(b"") is None
    assert parse_command(b"\x00") is None


def test_read_procinfo_from_a_fake_proc(tmp_path: Path) -> None:
    fake_proc(
        tmp_path,
        4321,
        uid=1000,
        cmdline=b"/opt/conda/bin/python\x00train.py\x00",
        cgroup=f"0::/system.slice/docker-{CID}.scope\n",
        start=987654,
    )
    users = {1000: "alice"}.get
    info = read_procinfo(4321, str(tmp_path), users=lambda uid: users(uid) or str(uid))
    assert info == ProcInfo(user="alice", command="python", container=CID)
    assert start_time(4321, str(tmp_path)) == 987654
    # Only what was asked for is read.
    only = read_procinfo(4321, str(tmp_path), fields=("command",))
    assert only == ProcInfo(command="python")
    # A process of another PID namespace is simply not there.
    assert read_procinfo(999, str(tmp_path)) == ProcInfo()
    assert start_time(999, str(tmp_path)) is None


def test_empty_cmdline_falls_back_to_comm(tmp_path: Path) -> None:
    fake_proc(tmp_path, 7, uid=0, cmdline=b"", cgroup="0::/\n", start=1)
    assert read_procinfo(7, str(tmp_path), fields=("command",)).command == "kworker"


def test_unknown_uid_is_the_number(tmp_path: Path) -> None:
    fake_proc(tmp_path, 8, uid=4294967294, cmdline=b"x\x00", cgroup="0::/\n", start=1)
    assert read_procinfo(8, str(tmp_path), fields=("user",)).user == "4294967294"


def test_cache_reads_once_and_notices_pid_reuse(tmp_path: Path) -> None:
    looked_up: list[int] = []

    def users(uid: int) -> str:
        looked_up.append(uid)
        return f"user{uid}"

    cache = ProcInfoCache(["user", "slurm_job"], str(tmp_path), users=users)
    fake_proc(
        tmp_path, 50, uid=1, cmdline=b"a\x00", cgroup="0::/slurm/uid_1/job_9/step_0\n", start=100
    )
    assert cache.get(50) == ProcInfo(user="user1", slurm_job="9")
    assert cache.get(50) == ProcInfo(user="user1", slurm_job="9")
    assert looked_up == [1]  # the second answer came from the cache
    # The pid ends (a sample without it) and is reused by another user's process: a new
    # start time, a new answer.
    cache.next_pass()
    cache.next_pass()
    for f in (tmp_path / "50").iterdir():
        f.unlink()
    (tmp_path / "50").rmdir()
    fake_proc(tmp_path, 50, uid=2, cmdline=b"b\x00", cgroup="0::/\n", start=200)
    assert cache.get(50) == ProcInfo(user="user2")
    assert cache.fields == ("user", "slurm_job")


def test_a_running_process_costs_no_proc_read_after_the_first(tmp_path: Path) -> None:
    """Once per pid lifetime: while the pid is listed sample after sample, /proc is not read
    again at all (not even stat); a pid that reappears after a sample without it is checked."""
    cache = ProcInfoCache(["command"], str(tmp_path), lineage=True)
    fake_proc(tmp_path, 60, cmdline=b"train\x00", ppid=1, start=100)
    first = cache.get(60)
    assert first.command == "train" and first.ancestors == ()
    for f in (tmp_path / "60").iterdir():  # unreadable from now on: any read would show it
        f.chmod(0)
        f.write_text("")
    for _ in range(5):
        cache.next_pass()
        assert cache.get(60) is first
    cache.next_pass()
    cache.next_pass()  # a sample in which the pid was not listed: it is checked again
    assert cache.get(60) == ProcInfo()


def test_cache_with_no_fields_reads_nothing(tmp_path: Path) -> None:
    cache = ProcInfoCache([], str(tmp_path / "does-not-exist"))
    assert cache.get(1) == ProcInfo()
