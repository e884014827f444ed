"""Issue 13.1: only the claimant's own work ends a lease early — never a neighbour's.

The rules of :func:`gpu_exporter.choose.settle.settle` as pure unit tests, the ``/proc``
reading behind them (:mod:`gpu_exporter.collect.procinfo`), a state machine of foreign
processes on leased GPUs, and the issue's scenario through a real socket.
"""

from __future__ import annotations

import os
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from conftest import FakeClock, build_stack, fake_proc, sim_of
from gpu_exporter import client
from gpu_exporter.choose.lease import Held, Lease
from gpu_exporter.choose.settle import settle
from gpu_exporter.choose.tokens import lease_id_of
from gpu_exporter.collect.procinfo import ProcInfo, ProcInfoCache, ancestors, cgroup_key
from gpu_exporter.model import GpuSample, ProcessSample, Snapshot
from gpu_exporter.simulate import DEFAULT_MODEL, Load, SimGpu, SimulatedNvml
from harness import run as run_cli
from served import served

T = 1_800_000_000.0
GIB = 2**30
ANY = "max_util=100%&max_mem_used=100%"  # busy cards may be chosen (whatever the defaults)
JOB_CGROUP = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/job-a.scope\n"
OTHER_CGROUP = "0::/system.slice/docker-" + "ab" * 32 + ".scope\n"


# -- settle(): the rules, pure --------------------------------------------------------------


def proc(
    pid: int, *, parents: tuple[int, ...] | None = (), cgroup: str | None = None, mem: int = GIB
) -> ProcessSample:
    return ProcessSample(pid, mem, ancestors=parents, cgroup=cgroup)


def gpu(*procs: ProcessSample, used: int | None = None) -> GpuSample:
    return GpuSample(
        index=0,
        uuid="GPU-0",
        up=True,
        memory_used_bytes=used
        if used is not None
        else sum(p.used_memory_bytes or 0 for p in procs),
        compute_processes=len(procs),
        processes=procs,
    )


def snap(*gpus: GpuSample) -> Snapshot:
    return Snapshot(T + 10, 0.0, 0.0, True, True, gpus=gpus)


def lease(
    lease_id: str = "a",
    *,
    at_claim: tuple[int, ...] | None = (),
    count: int | None = None,
    pids: tuple[int, ...] = (),
    cgroups: tuple[str, ...] = (),
    renewed: bool = False,
    uuid: str = "GPU-0",
) -> Lease:
    procs = count if count is not None else len(at_claim or ())
    held = Held(uuid, 0, procs, 0, at_claim)
    return Lease(lease_id, (held,), T, T + 60, "x", pids=pids, cgroups=cgroups, renewed=renewed)


def kept(snapshot: Snapshot, *leases: Lease) -> set[str]:
    """The ids of the leases that still hold GPU-0 after ``snapshot``."""
    held, _ = settle({x.id: x for x in leases}, snapshot, T + 11)
    return {x.id for x in held.values() if "GPU-0" in x.uuids}


def test_a_plain_lease_ends_when_a_new_visible_process_appears() -> None:
    assert kept(snap(gpu(proc(4000))), lease()) == set()
    _, drops = settle({"a": lease()}, snap(gpu(proc(4000))), T + 11)
    assert [(d.lease_id, d.reason) for d in drops] == [("a", "arrived")]


def test_processes_there_at_claim_never_end_a_plain_lease_however_they_grow() -> None:
    neighbour = lease(at_claim=(4242,))
    for used in (GIB, 20 * GIB, 79 * GIB):
        assert kept(snap(gpu(proc(4242, mem=used))), neighbour) == {"a"}


def test_memory_rises_alone_never_end_a_lease() -> None:
    # no process visible (another container), memory nearly full
    assert kept(snap(gpu(used=70 * GIB)), lease()) == {"a"}


def test_processes_the_exporter_cannot_see_never_end_a_lease() -> None:
    hidden = proc(4000, parents=None)  # listed by NVML, absent from our /proc
    assert kept(snap(gpu(hidden)), lease()) == {"a"}
    assert kept(snap(gpu(hidden)), lease(pids=(4000,))) == {"a"}  # even a registered pid
    unlisted = GpuSample(index=0, uuid="GPU-0", up=True, memory_used_bytes=GIB, processes=None)
    assert kept(snap(unlisted), lease()) == {"a"}


def test_a_new_process_of_another_lease_does_not_end_a_plain_lease() -> None:
    other = lease("b", pids=(500,), cgroups=("slurm_job:7",), uuid="GPU-9")
    assert kept(snap(gpu(proc(4000, parents=(600, 500)))), lease(), other) == {"a"}
    assert kept(snap(gpu(proc(4000, cgroup="slurm_job:7"))), lease(), other) == {"a"}
    assert kept(snap(gpu(proc(4000, parents=(600,)))), lease(), other) == set()


def test_kin_of_the_processes_there_at_claim_does_not_end_a_plain_lease() -> None:
    """The incumbent job restarting or forking a CUDA worker is not the claimant arriving."""
    incumbent = proc(4242, parents=(4000, 300), cgroup="slurm_job:5")
    busy = Held.of(gpu(incumbent))
    assert (busy.pids_at_claim, busy.kin_at_claim, busy.cgroups_at_claim) == (
        (4242,),
        (4000, 300),
        ("slurm_job:5",),
    )
    plain = Lease("a", (busy,), T, T + 60, "x")
    for newcomer in (
        proc(4243, parents=(4242, 4000, 300)),  # its child
        proc(4244, parents=(4000, 300)),  # its sibling: the launcher restarted it
        proc(4245, parents=(77,), cgroup="slurm_job:5"),  # an srun task of the same job
    ):
        assert kept(snap(gpu(incumbent, newcomer)), plain) == {"a"}
    stranger = proc(5000, parents=(4999,), cgroup="slurm_job:6")
    assert kept(snap(gpu(incumbent, stranger)), plain) == set()


def test_a_lease_with_pids_ends_only_on_its_own_work() -> None:
    mine = lease(pids=(500,), cgroups=("slurm_job:7",))
    assert kept(snap(gpu(proc(4000, parents=(600, 1)))), mine) == {"a"}  # a neighbour's
    assert kept(snap(gpu(proc(4000, cgroup="slurm_job:8"))), mine) == {"a"}
    assert kept(snap(gpu(proc(500))), mine) == set()  # the registered process itself
    assert kept(snap(gpu(proc(4000, parents=(600, 500)))), mine) == set()  # a descendant
    assert kept(snap(gpu(proc(4000, cgroup="slurm_job:7"))), mine) == set()  # same job


def test_a_renewed_lease_never_ends_on_arrival_but_still_on_a_lost_gpu() -> None:
    renewed = lease(pids=(500,), renewed=True)
    assert kept(snap(gpu(proc(500), proc(4000))), renewed) == {"a"}
    down = GpuSample(index=0, uuid="GPU-0", up=False)
    _, drops = settle({"a": renewed}, snap(down), T + 11)
    assert [d.reason for d in drops] == ["down"]
    assert settle({"a": renewed}, snap(), T + 11)[1][0].reason == "gone"
    assert settle({"a": renewed}, snap(), T + 61)[0] == {}  # and it expires


def test_a_lease_from_an_old_state_file_compares_the_count_of_unattributed_processes() -> None:
    old = lease(at_claim=None, count=1)
    other = lease("b", pids=(500,), uuid="GPU-9")
    assert kept(snap(gpu(proc(4001))), old) == {"a"}  # one then, one now
    assert kept(snap(gpu(proc(4001), proc(4002))), old) == set()
    assert kept(snap(gpu(proc(4001), proc(4002, parents=(500,)))), old, other) == {"a"}


def test_old_state_entries_load_and_new_ones_round_trip() -> None:
    old = {
        "id": "x",
        "gpus": ["GPU-0"],
        "held": [["GPU-0", 0, 1, 1024]],
        "created_at": T,
        "expires_at": T + 60,
        "requester": "h",
    }
    loaded = Lease.from_state(old)
    assert (loaded.pids, loaded.renewed, loaded.gpus[0].pids_at_claim) == ((), False, None)
    new = lease(at_claim=(4, 5), pids=(9,), cgroups=("slurm_job:1",), renewed=True)
    assert Lease.from_state(new.to_state()) == new
    assert new.to_json()["pids"] == [9] and "cgroups" not in new.to_json()


# -- /proc: ancestors and cgroup keys ---------------------------------------------------------


def test_ancestors_walk_ppid_up_to_init(tmp_path: Path) -> None:
    fake_proc(tmp_path, 10, ppid=1)
    fake_proc(tmp_path, 20, ppid=10)
    fake_proc(tmp_path, 30, ppid=20)
    fake_proc(tmp_path, 40, ppid=35)  # its parent has exited (or is in another namespace)
    assert ancestors(30, str(tmp_path)) == (20, 10)
    assert ancestors(10, str(tmp_path)) == ()
    assert ancestors(40, str(tmp_path)) == (35,)
    assert ancestors(99, str(tmp_path)) is None  # not visible: attributes nothing


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("0::/slurm/uid_1000/job_42/step_0/task_0\n", "slurm_job:42"),
        ("0::/system.slice/slurmstepd.scope/job_42/step_batch/user/task_0\n", "slurm_job:42"),
        ("0::/system.slice/docker-" + "ab" * 32 + ".scope\n", "container:" + "ab" * 32),
        (
            "0::/kubepods.slice/kubepods-pod0a1b2c3d_1111_2222_3333_444455556666.slice/x\n",
            "pod:0a1b2c3d-1111-2222-3333-444455556666",
        ),
        (JOB_CGROUP, "cgroup:" + JOB_CGROUP[3:].strip()),
        (
            "12:pids:/x\n1:name=systemd:/system.slice/train.service\n",
            "cgroup:/system.slice/train.service",
        ),
        ("0::/\n", None),  # a cgroup namespace: everyone is in "/"
        ("0::/init.scope\n", None),
        ("0::/user.slice/user-1000.slice/session-3.scope\n", None),  # a whole login session
        ("0::/user.slice\n", None),
        ("", None),
    ],
)
def test_cgroup_key(text: str, key: str | None) -> None:
    assert cgroup_key(text) == key


def test_lineage_is_cached_per_pid_and_start_time(tmp_path: Path) -> None:
    fake_proc(tmp_path, 500, ppid=1, cgroup=JOB_CGROUP)
    fake_proc(tmp_path, 501, ppid=500, cgroup=JOB_CGROUP, start=7)
    cache = ProcInfoCache([], str(tmp_path), lineage=True)
    first = cache.get(501)
    assert first == ProcInfo(ancestors=(500,), cgroup=cgroup_key(JOB_CGROUP))
    (tmp_path / "500" / "stat").unlink()  # the parent exits: the child stays its descendant
    assert cache.get(501) == first
    cache.next_pass()
    cache.next_pass()  # a sample without pid 501: it ended
    (tmp_path / "501" / "stat").write_text("501 (x) S 1 " + "0 " * 17 + "8 0\n")  # pid reused
    assert cache.get(501).ancestors == ()
    assert ProcInfoCache([], str(tmp_path)).get(501) == ProcInfo()  # lineage off: reads nothing


def test_the_sample_carries_lineage_but_never_shows_it(tmp_path: Path) -> None:
    fake_proc(tmp_path, 4000, ppid=500, cgroup=JOB_CGROUP)
    s = build_stack(
        sim_of(SimGpu(0, DEFAULT_MODEL, Load("constant", processes=1))), proc_root=str(tmp_path)
    )
    (p,) = s.sample().gpus[0].processes or ()
    assert (p.pid, p.ancestors, p.cgroup) == (4000, (500,), cgroup_key(JOB_CGROUP))
    shown = s.client.get("/gpus").get_json()["gpus"][0]["processes"][0]
    assert "ancestors" not in shown and "cgroup" not in shown


# -- the HTTP surface ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", ["0", "-1", "abc", "1,,2", "99999999", "²", " ", ",".join(["7"] * 65), "4242.0"]
)
def test_bad_pids_are_400(value: str) -> None:
    s = build_stack(sim_of(SimGpu(0, DEFAULT_MODEL, Load("idle"))))
    s.sample()
    resp = s.client.get("/choose", query_string={"pid": value})
    assert resp.status_code == 400 and resp.text.startswith("error: pid"), resp.text
    lease = s.client.get("/choose").headers["X-GPU-Lease"]
    added = s.client.post(f"/leases/{lease}/pids", data={"pid": value})
    assert added.status_code == 400 and '"param": "pid"' in added.text, added.text
    missing = s.client.post(f"/leases/{lease}/pids", headers={"Accept": "application/json"})
    assert missing.status_code == 400 and missing.get_json()["error"]["param"] == "pid"
    assert s.client.post("/leases/nope/pids?pid=5").status_code == 404
    assert s.client.post(f"/leases/{lease}/pids?pid=5&ttl=1").status_code == 400


def test_pids_given_on_the_claim_and_later_show_in_leases(tmp_path: Path) -> None:
    fake_proc(tmp_path, 500, cgroup="0::/slurm/uid_1/job_7/step_batch/task_0\n")
    s = build_stack(sim_of(SimGpu(0, DEFAULT_MODEL, Load("idle"))), proc_root=str(tmp_path))
    s.sample()
    lease = s.client.get("/choose?pid=500,501").headers["X-GPU-Lease"]
    body = s.client.post(f"/leases/{lease}/pids?pid=502,500").get_json()
    assert body["pids"] == [500, 501, 502] and body["renewed"] is False
    assert s.leases.get(lease_id_of(lease)).cgroups == (
        "slurm_job:7",
    )  # read once, when registered
    assert s.client.get("/leases").get_json()["leases"][0]["pids"] == [500, 501, 502]
    assert s.client.post(f"/leases/{lease}/renew").get_json()["renewed"] is True


# -- the state machine: foreign processes never free a leased GPU --------------------------------


class ForeignProcesses(RuleBasedStateMachine):
    """Leases (plain, with a pid, renewed) on GPUs 0-3; other people's processes appear,
    grow, churn and hide there. No leased GPU may become choosable before release or expiry.

    Foreign processes: invisible ones (another container); a leased neighbour's (its
    launcher, pid 7000, holds GPU 4 with a lease); kin of a process already on the card; and
    strangers, on cards no plain lease holds (for a plain ``curl`` lease a stranger's new
    process is indistinguishable from the claimant's: that is rule (c))."""

    NEIGHBOUR = 7000

    def __init__(self) -> None:
        super().__init__()
        self.proc = Path(tempfile.mkdtemp())
        fake_proc(self.proc, self.NEIGHBOUR, ppid=1, cgroup=OTHER_CGROUP)
        fake_proc(self.proc, 900, ppid=1, cgroup=JOB_CGROUP)  # our jobs' registered process
        self.clock = FakeClock()
        gpus = [SimGpu(i, DEFAULT_MODEL, Load("idle")) for i in range(5)]
        self.s = build_stack(
            lambda clock: SimulatedNvml(gpus, clock=clock.monotonic),
            clock=self.clock,
            proc_root=str(self.proc),
        )
        self.s.sample()
        neighbour = self.s.client.get(f"/choose?include=4&lease=1h&pid={self.NEIGHBOUR}")
        self.s.client.post(f"/leases/{neighbour.headers['X-GPU-Lease']}/renew?ttl=1h")
        self.next_pid = 10_000
        self.on: dict[int, list[int]] = {i: [] for i in range(4)}  # gpu → foreign pids
        self.visible: set[int] = set()
        self.memory: dict[int, float] = dict.fromkeys(range(4), 0.0)
        # lease id → (expiry, gpu index, plain?)
        self.expected: dict[str, tuple[float, int, bool]] = {}

    def _set(self, gpu: int) -> None:
        self.s.sim.gpus[gpu].load = Load(
            "constant",
            utilization=0.5,
            memory_used_ratio=self.memory[gpu],
            processes=len(self.on[gpu]),
            pids=tuple(self.on[gpu]),
        )
        self._tick(1)

    def _tick(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.s.sample()
        now = self.clock.time()
        self.expected = {k: v for k, v in self.expected.items() if v[0] > now}

    def _plain_lease_on(self, gpu: int) -> bool:
        return any(g == gpu and plain for _, g, plain in self.expected.values())

    @rule(how=st.sampled_from(["plain", "pid", "renewed"]), ttl=st.sampled_from([5, 30, 120]))
    def claim(self, how: str, ttl: int) -> None:
        pid = "" if how == "plain" else "&pid=900"
        resp = self.s.client.get(f"/choose?{ANY}&exclude=4&lease={ttl}s{pid}")
        if resp.status_code != 200:
            return
        lease = resp.headers["X-GPU-Lease"]
        if how == "renewed":
            self.s.client.post(f"/leases/{lease}/renew?ttl={ttl}s")
        gpu = next(g.index for g in self.s.sim.gpus if g.uuid == resp.text.strip())
        self.expected[lease] = (self.clock.time() + ttl, gpu, how == "plain")

    @rule(
        gpu=st.integers(0, 3),
        whose=st.sampled_from(["hidden", "neighbour", "kin", "stranger"]),
        data=st.data(),
    )
    def foreign_process_appears(self, gpu: int, whose: str, data: st.DataObject) -> None:
        pid, self.next_pid = self.next_pid, self.next_pid + 1
        if whose == "neighbour":
            fake_proc(self.proc, pid, ppid=self.NEIGHBOUR, cgroup=OTHER_CGROUP)
        elif whose == "kin":
            parents = [p for p in self.on[gpu] if p in self.visible]
            if not parents:
                return
            fake_proc(self.proc, pid, ppid=data.draw(st.sampled_from(parents)))
        elif whose == "stranger":
            if self._plain_lease_on(gpu):
                return
            fake_proc(self.proc, pid, ppid=1, cgroup=f"0::/system.slice/job-{pid}.scope\n")
        if whose != "hidden":
            self.visible.add(pid)
        self.on[gpu].append(pid)
        self.memory[gpu] = min(0.95, self.memory[gpu] + 0.1)
        self._set(gpu)

    @rule(gpu=st.integers(0, 3), by=st.sampled_from([0.01, 0.2, 0.5]))
    def foreign_process_grows(self, gpu: int, by: float) -> None:
        self.memory[gpu] = min(0.95, self.memory[gpu] + by)
        self._set(gpu)

    @rule(gpu=st.integers(0, 3))
    def a_foreign_process_exits(self, gpu: int) -> None:
        if self.on[gpu]:
            self.on[gpu].pop(0)
            self.memory[gpu] = max(0.0, self.memory[gpu] - 0.1)
        self._set(gpu)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.expected:
            # Claim order: lease ids are random, so their sorted order would differ when
            # Hypothesis replays a case, and a replay must draw the same lease.
            lease = data.draw(st.sampled_from(list(self.expected)))
            assert self.s.client.delete(f"/leases/{lease}").status_code == 200
            del self.expected[lease]

    @rule(seconds=st.sampled_from([1, 10, 40]))
    def time_passes(self, seconds: int) -> None:
        self._tick(seconds)

    @invariant()
    def leased_gpus_stay_leased(self) -> None:
        active = self.s.leases.active(self.s.cache.get())
        live = {x.id: x.uuids for x in active if self.s.sim.gpus[4].uuid not in x.uuids}
        want = {
            lease_id_of(k): (self.s.sim.gpus[g].uuid,) for k, (_, g, _) in self.expected.items()
        }
        assert live == want
        assert self.s.leases.dropped["arrived"] == 0
        free = self.s.client.get(f"/choose?{ANY}&lease=0&n=1&format=json").get_json()
        held = {u for uuids in want.values() for u in uuids} | {self.s.sim.gpus[4].uuid}
        assert not {g["uuid"] for g in free.get("chosen", [])} & held


ForeignProcesses.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None
)
test_foreign_processes_never_free_a_leased_gpu = ForeignProcesses.TestCase


# -- the scenario, through a real socket -----------------------------------------------


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize("register", ["", "&pid=9000"])
def test_a_neighbours_growing_job_never_gets_my_gpu_granted_again(
    tmp_path: Path, register: str
) -> None:
    """GPUs 0-6 leased; GPU 7 runs a neighbour's job whose memory keeps growing, and one job
    leases it: every further /choose is refused until that lease is released."""
    fake_proc(tmp_path, 4000, ppid=1)  # the neighbour's shell …
    fake_proc(tmp_path, 4242, ppid=4000, cgroup=OTHER_CGROUP)  # … and its job, on GPU 7
    fake_proc(tmp_path, 9000, ppid=1, cgroup=JOB_CGROUP)  # our job
    growing = Load(
        "grow", period_seconds=2.0, utilization=0.6, memory_used_ratio=0.05, pids=(4242,)
    )
    gpus = [SimGpu(i, DEFAULT_MODEL, Load("idle")) for i in range(7)]
    sim = SimulatedNvml([*gpus, SimGpu(7, DEFAULT_MODEL, growing)], clock=time.monotonic)
    with served(sim, proc_root=str(tmp_path), interval_seconds=0.1) as ex:
        for _ in range(7):
            assert _get(f"{ex.url}/choose?n=1")[0] == 200
        status, body = _get(f"{ex.url}/choose?n=1&{ANY}{register}")
        assert (status, body.strip()) == (200, sim.gpus[7].uuid)
        deadline = time.monotonic() + 3.0  # the neighbour grows from 4 GiB to 76 GiB
        while time.monotonic() < deadline:
            status, body = _get(f"{ex.url}/choose?n=1&{ANY}")
            assert status == 503, f"GPU 7 granted twice: {body}"
            time.sleep(0.1)
        assert ex.daemon.cache.get().gpus[7].memory_used_bytes > 60 * GIB
        assert ex.daemon.leases.dropped["arrived"] == 0


def test_gpu_exporter_choose_registers_the_job_scripts_shell() -> None:
    """The command's parent (the job script's shell; here this test) is registered with the
    lease by its token: registering by the public id was refused, so every `choose` printed
    "could not register" and the lease had no PIDs."""
    with served() as ex:
        status, out, err = run_cli("choose", "--url", ex.url, "--max-util", "100%")
        assert status == 0 and out.strip().startswith("GPU-"), err
        assert "could not register" not in err
        (held,) = client.leases(ex.url)
        assert held.pids == (os.getpid(),)


def test_the_client_registers_its_process_and_survives_an_older_server(tmp_path: Path) -> None:
    with served() as ex:
        with client.use_gpus(1, ex.url) as choice:
            (held,) = client.leases(ex.url)
            assert held.id == choice.lease_id and held.pids == (os.getpid(),)
        # an exporter without POST /leases/<id>/pids answers 404: a note, never a failure
        note = client.register_pids("no-such-lease", [os.getpid()], ex.url)
        assert note is not None and "could not register" in note
