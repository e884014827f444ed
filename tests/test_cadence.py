"""Per-field update intervals (fast / slow / once), --collect.<group> and the one reader thread.

The issue's "Done when": with nobody scraping, NVML calls per minute are
``fast fields × GPUs × 60 / interval + slow fields × GPUs × 60 / slow-interval`` (plus one
device count per sample), asserted with the simulated library's call counts.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from readmegen import costs, readme_region

from conftest import Stack, build_stack, fake_proc, sim_of
from gpu_exporter.collect import fields, groups
from gpu_exporter.export.readme import groups_table
from gpu_exporter.nvml import Unsupported
from gpu_exporter.simulate import HANG, Fault, Health, Load, SimGpu
from harness import exporter, get

A100 = "NVIDIA A100-SXM4-80GB"
ROOT = Path(__file__).resolve().parent.parent
BUSY = Load("constant", utilization=0.3, memory_used_ratio=0.5, processes=2)


def a100s(n: int = 3, *faults: Fault, **config: object) -> Stack:
    return build_stack(
        sim_of(*(SimGpu(i, A100, BUSY) for i in range(n)), faults=list(faults)), **config
    )


def supported(s: Stack, when: str) -> set[str]:
    """The fields GPU 0 answers, of one cadence (each is one NVML call)."""
    gpu = s.cache.get().gpus[0]
    return {f for f, ok in gpu.fields_supported if ok and fields.FIELDS[f].when == when}


def asked(s: Stack, when: str) -> set[str]:
    """The fields GPU 0 was asked, of one cadence, whether it answered or not."""
    gpu = s.cache.get().gpus[0]
    return {f for f, _ in gpu.fields_supported if fields.FIELDS[f].when == when}


def in_the_table(when: str) -> set[str]:
    """The field table's whole-GPU fields of one cadence, in the groups on by default."""
    on = [f for f in fields.GPU_FIELDS if f.group not in groups.OFF_BY_DEFAULT]
    return {f.field for f in on if f.when == when}


def refused_alone(s: Stack, field: str) -> bool:
    """Whether the simulated card refuses ``field`` when its getter alone asks for it (a
    field NVML gives only as a field value has no getter to ask: taken as refused)."""
    read = fields.FIELDS[field].read
    if read is None:
        return True
    try:
        read(s.nvml, None, s.nvml.handle(0))
    except Unsupported:
        return True
    return False


def calls(names: set[str]) -> int:
    """NVML calls to read these fields: one per getter, one for all batched ones (issue 31)."""
    batched = {f for f in names if fields.FIELDS[f].batch is not None}
    return len(names - batched) + (1 if batched else 0)


def test_nvml_calls_per_minute_are_fast_per_interval_plus_slow_per_slow_interval() -> None:
    gpus, interval, slow_interval = 3, 1.0, 30.0
    s = a100s(gpus, interval_seconds=interval, slow_interval_seconds=slow_interval)
    s.sample()  # identity, static values, the first slow read
    fast, slow = supported(s, fields.FAST), supported(s, fields.SLOW)
    for when, answered in ((fields.FAST, fast), (fields.SLOW, slow)):
        # Every field of the table is asked (the process list's utilization too: BUSY cards
        # have processes, issue 25), and those the card did not answer it refuses.
        assert asked(s, when) == in_the_table(when), when
        refused = asked(s, when) - answered
        assert all(refused_alone(s, f) for f in refused), refused
    # The card refuses some (an A100-SXM4 has no fan, no retired pages): asked once, never again.
    assert in_the_table(fields.SLOW) - slow
    before = Counter(s.sim.calls)
    samples = 0
    for _ in range(60):  # one minute, nobody scrapes
        s.clock.advance(interval)
        s.sample()
        samples += 1
    made = Counter(s.sim.calls)
    made.subtract(before)
    per_minute = sum(made.values())
    expected = (
        calls(fast) * gpus * 60 / interval
        + calls(slow) * gpus * 60 / slow_interval
        + samples  # nvmlDeviceGetCount per sample; the handles were asked once
    )
    assert per_minute == expected
    # Per function: the handle, identity and static values not at all; a slow one twice.
    for once in ("nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetMaxClockInfo"):
        assert made[once] == 0, once
    assert made["nvmlDeviceGetPersistenceMode"] == gpus * 2
    # Energy, ECC and power are field values: the fast batch every sample, the slow one
    # (with the energy counter, ~3 ms on an H100) every --slow-interval.
    assert made["nvmlDeviceGetFieldValues"] == gpus * (60 + 2)
    for batched in ("nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetPowerUsage"):
        assert made[batched] == 0, batched


def test_a_slow_field_is_read_every_slow_interval_and_stays_exported_in_between() -> None:
    s = a100s(1, slow_interval_seconds=30.0)
    s.sample()
    assert s.value("gpu_ecc_errors_total", 0, error="corrected", counter="volatile") == 0
    s.sim.gpus[0].health = Health(ecc_corrected_volatile=7, pcie_replays=3)
    reads = s.sim.calls["nvmlDeviceGetPersistenceMode"]
    for _ in range(29):
        s.clock.advance(1)
        s.sample()
        # Still exported (the last value read), not absent, and not read again.
        assert s.value("gpu_ecc_errors_total", 0, error="corrected", counter="volatile") == 0
        assert s.value("gpu_pcie_replay_errors_total", 0) == 0
        assert s.cache.get().gpus[0].ecc_mode_enabled is True
    assert s.sim.calls["nvmlDeviceGetPersistenceMode"] == reads
    s.clock.advance(1)  # 30 s after the first read
    s.sample()
    assert s.value("gpu_ecc_errors_total", 0, error="corrected", counter="volatile") == 7
    assert s.value("gpu_pcie_replay_errors_total", 0) == 3
    assert s.sim.calls["nvmlDeviceGetPersistenceMode"] == reads + 1


def test_a_slow_field_that_failed_is_absent_until_it_reads_again() -> None:
    # The replay counter fails during the second slow read (t = 30 s) only.
    fault = Fault("nvmlDeviceGetPcieReplayCounter", "UNKNOWN", after_seconds=29.5, for_seconds=1)
    s = a100s(1, fault, slow_interval_seconds=30.0)
    s.sample()
    assert s.value("gpu_pcie_replay_errors_total", 0) == 0
    s.clock.advance(30)
    s.sample()
    assert s.value("gpu_pcie_replay_errors_total", 0) is None  # missing means absent
    for _ in range(29):
        s.clock.advance(1)
        s.sample()
        assert s.value("gpu_pcie_replay_errors_total", 0) is None
    s.clock.advance(1)
    s.sample()
    assert s.value("gpu_pcie_replay_errors_total", 0) == 0


def test_a_gpu_that_answers_again_reads_its_slow_and_static_values_again() -> None:
    lost = Fault("*", "GPU_IS_LOST", gpu=0, after_seconds=5, for_seconds=2)
    s = a100s(1, lost)
    s.sample()
    max_clocks = s.sim.calls["nvmlDeviceGetMaxClockInfo"]
    s.clock.advance(5)
    assert not s.sample().gpus[0].up
    s.clock.advance(2)
    gpu = s.sample().gpus[0]
    assert gpu.up and gpu.ecc_mode_enabled is True and gpu.clock_max_sm_hz is not None
    assert s.sim.calls["nvmlDeviceGetMaxClockInfo"] == 2 * max_clocks


# (xid: below; nvlink: off by default; gpm: an A100 has none, test_gpm.py turns it off on H100s)
@pytest.mark.parametrize("group", [g for g in groups.GROUPS if g not in ("xid", "nvlink", "gpm")])
def test_a_disabled_group_makes_no_nvml_call_and_exports_no_series(group: str) -> None:
    s = a100s(2, collect_disabled=(group,))
    for _ in range(3):
        s.sample()
        s.clock.advance(30)
    functions = {
        "power": "nvmlDeviceGetPowerManagementDefaultLimit",
        "temperature": "nvmlDeviceGetTemperatureThreshold",
        "clocks": "nvmlDeviceGetClockInfo",
        "health": "nvmlDeviceGetPersistenceMode",
        "pcie": "nvmlDeviceGetCurrPcieLinkWidth",
        "media": "nvmlDeviceGetEncoderUtilization",
        "processes": "nvmlDeviceGetComputeRunningProcesses",
    }
    assert s.sim.calls.get(functions[group], 0) == 0
    text = s.client.get("/metrics").get_data(as_text=True)
    for field in groups.fields_of(group):
        assert f'field="{field}"' not in text, field
    series = {
        "power": "gpu_power_draw_watts{",
        "temperature": "gpu_temperature_celsius{",
        "clocks": "gpu_clock_hz{",
        "health": "gpu_ecc_errors_total{",
        "pcie": "gpu_pcie_link_width{",
        "media": "gpu_encoder_utilization_ratio{",
        "processes": "gpu_process_memory_used_bytes{",
    }
    assert series[group] not in text
    assert "gpu_memory_used_bytes{" in text  # the rest is still there
    others = {g: name for g, name in series.items() if g != group}
    assert all(name in text for name in others.values())


def test_collect_xid_off_starts_no_listener() -> None:
    s = a100s(1, collect_disabled=("xid",))
    assert s.daemon.xids is None and s.daemon.background == []


def test_one_reader_thread_reads_every_gpu() -> None:
    """Not a thread per GPU: 16 GPUs are read (and published) by one reader thread."""
    s = a100s(16)
    readers: set[str] = set()
    s.cache.subscribe(lambda _: readers.add(threading.current_thread().name))
    s.sample()
    (reader,) = readers
    assert reader.startswith("nvml-reader")
    assert not any(t.name.startswith("nvml-gpu") for t in threading.enumerate())
    s.sampler.stop(timeout_seconds=1)


def test_readme_groups_table_is_generated() -> None:
    """Its calls from the field table, its series measured (scripts/generate_readme.py)."""
    readme = (ROOT / "README.md").read_text()
    assert readme_region(readme, "groups-table") == groups_table(costs()), (
        "README groups table is out of date: run `python scripts/generate_readme.py`"
    )


def test_the_flags_through_the_command_line() -> None:
    """--no-collect.health, the environment's GPU_EXPORTER_NO_COLLECT_MEDIA and
    --slow-interval, on a real exporter process and socket."""
    env = {"GPU_EXPORTER_NO_COLLECT_MEDIA": "1"}
    args = ("--simulate", "2", "--interval", "0.2", "--no-collect.health", "--slow-interval", "5")
    with exporter(*args, env=env) as ex:
        status, text = get(f"{ex.base}/metrics")
        gpus = get(f"{ex.base}/gpus")[1]
    assert status == 200
    assert "gpu_ecc_errors_total{" not in text and 'field="ecc_mode"' not in text
    assert "gpu_encoder_utilization_ratio{" not in text
    assert "gpu_pcie_link_width{" in text and "gpu_power_draw_watts{" in text
    assert '"ecc_mode":"off"' in gpus.replace(" ", "")


def test_bad_group_from_the_environment_is_refused(tmp_path: Path) -> None:
    from gpu_exporter.config import ServeConfig
    from gpu_exporter.daemon import BuildError, build

    with pytest.raises(BuildError, match="unknown collector group nope"):
        build(dataclasses.replace(ServeConfig(simulate="1"), collect_disabled=("nope",)))


def test_process_details_are_read_once_per_pid_lifetime(tmp_path: Path) -> None:
    """Lease attribution's ancestors and cgroup (and no labels: --process-labels is off) are
    read when a process first appears; while it runs, samples read nothing from /proc."""
    for pid in (4000, 4001):  # SimGpu 0's two processes
        fake_proc(tmp_path, pid, ppid=900, cgroup="0::/slurm/uid_1/job_7/step_0\n")
    fake_proc(tmp_path, 900, ppid=1)
    s = a100s(1, proc_root=str(tmp_path))
    s.sample()
    first = s.cache.get().gpus[0].processes
    assert first is not None and [p.ancestors for p in first] == [(900,), (900,)]
    assert [p.cgroup for p in first] == ["slurm_job:7", "slurm_job:7"]
    assert all(p.user is None and p.command is None for p in first)  # no labels asked for
    for f in tmp_path.glob("*/*"):  # any read from now on would see nothing
        f.write_text("")
    for _ in range(3):
        s.clock.advance(1)
        assert s.sample().gpus[0].processes == first


def test_gpus_says_when_each_field_is_read() -> None:
    s = a100s(1, collect_disabled=("media",))
    s.sample()
    updated = s.client.get("/gpus").get_json()["fields_updated"]
    assert updated["memory"] == "every sample"
    assert updated["ecc_errors_corrected_volatile"] == "every --slow-interval"
    assert updated["clock_max_sm"] == "once"
    assert updated["encoder_utilization"] == "off"
    assert set(updated) == set(fields.FIELDS)


def _reader_threads() -> int:
    return sum(t.name.startswith(("nvml-reader", "nvml-gpu")) for t in threading.enumerate())


def test_a_hung_gpu_takes_a_new_reader_and_its_thread_ends() -> None:
    """Two hangs on a 4-GPU host: the GPUs after the hung one are read in the same sample by
    a new reader, and the stuck thread ends once its call returns: no thread is left per
    GPU or per hang."""
    hangs = [
        Fault(
            "nvmlDeviceGetPowerUsage", HANG, gpu=1, after_seconds=at, for_seconds=1, hang_seconds=1
        )
        for at in (5, 20)
    ]
    before = _reader_threads()
    s = a100s(4, *hangs, nvml_timeout_seconds=0.3)
    try:
        s.sample()
        for at in (5, 14):  # to t = 5 and t = 20
            s.clock.advance(at)
            snap = s.sample()
            assert [g.up for g in snap.gpus] == [True, False, True, True]
            assert s.sampler.stuck() == ("gpu1",)
            deadline = time.monotonic() + 10
            while s.sampler.stuck() and time.monotonic() < deadline:
                time.sleep(0.01)
            s.clock.advance(1)
            assert all(g.up for g in s.sample().gpus)
        _until(lambda: _reader_threads() == before)
    finally:
        s.sim.release_hangs()
        s.sampler.stop(timeout_seconds=2)


def _runs(thread: threading.Thread | None) -> int:
    """How many times the kernel has put ``thread`` on a CPU (Linux ``schedstat``)."""
    assert thread is not None and thread.native_id is not None
    return int(Path(f"/proc/self/task/{thread.native_id}/schedstat").read_text().split()[2])


def _until(predicate: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_while_no_call_hangs_one_thread_wakes_per_sample() -> None:
    """The reader samples and publishes on its own; the sampling thread, which only watches
    its deadlines, wakes about once per deadline, not twice per sample as a hand-over would
    make it."""
    s = a100s(2, interval_seconds=0.02, nvml_timeout_seconds=5)
    publishers: set[str] = set()
    s.cache.subscribe(lambda _: publishers.add(threading.current_thread().name))
    s.sampler.start()
    try:
        _until(lambda: s.cache.get().sequence >= 3)
        watcher = s.sampler._thread
        runs, sequence = _runs(watcher), s.cache.get().sequence
        time.sleep(1.0)
        assert s.cache.get().sequence - sequence >= 20  # 50 a second, less a busy machine's
        assert _runs(watcher) - runs <= 2
        assert publishers == {s.sampler._reader.name}  # type: ignore[union-attr]
    finally:
        s.sampler.stop(timeout_seconds=2)


def test_a_hang_while_running_is_taken_over_and_sampling_handed_back() -> None:
    """GPU 1's call hangs under the running threads: within the deadline a new reader
    publishes it as down and keeps sampling the others; once the call returns, GPU 1 is
    back."""
    hang = Fault(
        "nvmlDeviceGetUtilizationRates",
        HANG,
        gpu=1,
        after_seconds=5,
        for_seconds=1,
        hang_seconds=60,
    )
    s = a100s(3, hang, interval_seconds=0.05, nvml_timeout_seconds=0.3)
    publishers: list[str] = []
    s.cache.subscribe(lambda _: publishers.append(threading.current_thread().name))
    s.clock.advance(5)  # the hang's window: the first sample's call hangs
    started = time.monotonic()
    s.sampler.start()
    try:
        _until(lambda: s.cache.get().gpus and not s.cache.get().gpus[1].up)
        assert time.monotonic() - started < 0.3 + 1.5  # the deadline, and slack
        snap = s.cache.get()
        assert [g.down_reason for g in snap.gpus] == [None, "timeout", None]
        assert snap.gpus[1].error == "nvmlDeviceGetUtilizationRates has not returned for 0 s"
        assert s.sampler.stuck() == ("gpu1",)
        _until(lambda: s.cache.get().sequence >= snap.sequence + 5)  # the others go on
        assert all(g.up for g in s.cache.get().gpus[::2])
        assert "nvml-reader0" not in publishers  # stuck in its first sample: a new one took over
        made = s.sim.calls["nvmlDeviceGetUtilizationRates"]

        s.clock.advance(2)  # past the window: the call, once released, is not hung again
        s.sim.release_hangs()
        _until(lambda: all(g.up for g in s.cache.get().gpus))
        assert s.sampler.stuck() == ()
        publishers.clear()
        _until(lambda: len(publishers) >= 5)
        assert set(publishers[1:]) == {s.sampler._reader.name}  # type: ignore[union-attr]
        assert s.sim.calls["nvmlDeviceGetUtilizationRates"] > made
    finally:
        s.sim.release_hangs()
        s.sampler.stop(timeout_seconds=2)


def test_stop_while_the_reader_sleeps_is_prompt_and_shuts_nvml_down() -> None:
    s = a100s(2, interval_seconds=10)
    s.sampler.start()
    _until(lambda: s.cache.get().sequence >= 1)
    started = time.monotonic()
    s.sampler.stop(timeout_seconds=5)
    assert time.monotonic() - started < 0.5
    assert s.sim.calls["nvmlShutdown"] == 1
    assert not s.sampler.session.initialised


def test_the_fast_batch_holds_no_slow_field() -> None:
    """A field-value batch costs what its slowest entry costs (on an H100: 1 field 4.8 µs, 8
    with the energy counter 3,256 µs; docs/real-gpu.md): energy and the PCIe replay counter
    (151 µs as a getter) stay in the slow batch, read every --slow-interval."""
    fast = {f.field for f in fields.BATCHED if f.when == fields.FAST}
    assert "power_draw" in fast
    for slow in ("energy", "pcie_replay_errors", "ecc_errors_corrected_volatile", "nvlink"):
        assert fields.FIELDS[slow].when == fields.SLOW, slow
