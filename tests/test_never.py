"""Issue 27 point 3: a request that can never be met is refused at once; one that could be
met may wait. ``never_enough`` decides from what no job changes (count, model, total memory,
MIG layout, what a card can report, include/exclude); the chooser itself is the judge of
"could be met": the same request on the same host at its best (every card up and idle, no
memory used, no process, no lease) must succeed exactly when ``never_enough`` says it might.
"""

from __future__ import annotations

import dataclasses
import time
import urllib.error
import urllib.request

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_exporter.choose.filters import Filters, never_enough
from gpu_exporter.choose.memory import memory_fit
from gpu_exporter.choose.rank import NotEnoughGpus, choose
from gpu_exporter.choose.request import filters_of
from gpu_exporter.model import GpuSample, ProcessSample
from gpu_exporter.simulate import DEFAULT_MODEL as A100
from gpu_exporter.simulate import Load, SimGpu, SimulatedNvml
from served import served

GIB = 2**30
HEADROOM = 512 * 2**20
GTX = "NVIDIA GeForce GTX 1080"  # 8 GiB
MODELS = ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 4090")


@st.composite
def hosts(draw: st.DrawFn) -> list[GpuSample]:
    gpus = []
    for index in range(draw(st.integers(1, 6))):
        total = draw(st.sampled_from((8, 24, 40, 80))) * GIB
        reserved = draw(st.sampled_from((0, GIB // 2)))
        used = draw(st.integers(0, 2)) * (total - reserved) // 2
        procs_ok, util_ok = draw(st.booleans()), draw(st.booleans())
        uuid, name = f"GPU-{index:04d}", draw(st.sampled_from(MODELS))
        mig = draw(st.integers(0, 3)) if draw(st.integers(0, 3)) == 0 else 0
        devices = tuple(
            GpuSample(
                index=index, uuid=f"MIG-{index}-{m}", up=True, parent_uuid=uuid,
                name=f"{name} MIG 1g.10gb",
                memory_total_bytes=total // 4, memory_used_bytes=0, memory_free_bytes=total // 4,
                processes=(), compute_processes=0, gpu_instance_id=m, compute_instance_id=0,
                fields_supported=(("memory", True), ("processes", True)),
            )
            for m in range(mig)
        )  # fmt: skip
        gpus.append(
            GpuSample(
                index=index,
                uuid=uuid,
                up=draw(st.booleans()),
                name=name,
                pci_bus_id=f"00000000:{index + 1:02x}:00.0",
                memory_total_bytes=total,
                memory_reserved_bytes=reserved,
                memory_used_bytes=used,
                memory_free_bytes=total - reserved - used,
                utilization_ratio=None if mig or not util_ok else draw(st.sampled_from((0, 0.9))),
                memory_utilization_ratio=None if mig or not util_ok else 0.0,
                processes=(ProcessSample(pid=100 + index, used_memory_bytes=used),)
                if procs_ok and used
                else (() if procs_ok else None),
                compute_processes=(1 if used else 0) if procs_ok else None,
                mig_mode_enabled=bool(mig),
                mig_devices=devices,
                fields_supported=(
                    ("memory", True),
                    ("utilization", util_ok),
                    ("processes", procs_ok),
                ),
            )
        )
    return gpus


@st.composite
def requests(draw: st.DrawFn) -> tuple[int, Filters, int | None]:
    selectors = st.lists(st.sampled_from(("0", "1", "3", "GPU-0002", "5")), max_size=3)
    mig = draw(st.sampled_from(("deny", "deny", "allow", "only")))
    filters = filters_of(
        min_free=draw(st.sampled_from((None, 20 * GIB, 79 * GIB, 90 * GIB))),
        min_total=draw(st.sampled_from((None, 40 * GIB))),
        max_util=draw(st.sampled_from((None, 0.5))),
        max_mem_used=draw(st.sampled_from((None, 0.5))),
        max_procs=draw(st.sampled_from((None, 0))),
        model=draw(st.sampled_from((None, "h100"))),
        include=tuple(draw(selectors)),
        exclude=tuple(draw(selectors)),
        mig=mig,
        max_mig_devices=draw(st.sampled_from((None, 1))) if mig != "deny" else None,
    )
    mem = draw(st.sampled_from((None, None, 8 * GIB, 20 * GIB, 79 * GIB)))
    if mem is not None:
        filters = dataclasses.replace(filters, mig="deny", max_mig_devices=None)
    return draw(st.integers(1, 7)), filters, mem


def at_best(gpu: GpuSample) -> GpuSample:
    """``gpu`` as waiting could make it: up, idle, its memory free, no process."""
    supported = dict(gpu.fields_supported)
    total = gpu.memory_total_bytes or 0
    return dataclasses.replace(
        gpu,
        up=True,
        utilization_ratio=0.0 if supported.get("utilization") and not gpu.mig_devices else None,
        memory_utilization_ratio=0.0
        if supported.get("utilization") and not gpu.mig_devices
        else None,
        memory_used_bytes=0,
        memory_free_bytes=total - (gpu.memory_reserved_bytes or 0),
        processes=() if supported.get("processes", True) else None,
        compute_processes=0 if supported.get("processes", True) else None,
        mig_devices=tuple(at_best(d) for d in gpu.mig_devices),
    )


def could_be_met(gpus: list[GpuSample], n: int, filters: Filters, mem: int | None) -> bool:
    best = [at_best(g) for g in gpus]
    leased, fit = None, None
    if mem is not None:  # as the lease table admits a share: no leases held
        fits = memory_fit(best, [], mem, HEADROOM, {})
        leased, fit = fits.refused, fits.fit
    try:
        choose(best, n, filters, leased=leased, fit=fit)
    except NotEnoughGpus:
        return False
    return True


@settings(max_examples=400, deadline=None)
@given(hosts(), requests())
def test_refused_at_once_exactly_when_no_state_of_the_host_could_meet_it(
    gpus: list[GpuSample], request: tuple[int, Filters, int | None]
) -> None:
    n, filters, mem = request
    never = never_enough(gpus, n, filters, mem, HEADROOM)
    assert (never is None) == could_be_met(gpus, n, filters, mem), never


def test_the_chooser_keeps_max_mig_devices_under_mig_only_too() -> None:
    """Found by the property above: under mig=only the chooser named 2 MIG devices where
    max_mig_devices allows 1, while never_enough (rightly) said it never could."""
    devices = tuple(
        GpuSample(
            index=0, uuid=f"MIG-{m}", up=True, parent_uuid="GPU-m", memory_total_bytes=20 * GIB,
            memory_used_bytes=0, memory_free_bytes=20 * GIB, gpu_instance_id=m,
        )
        for m in range(2)
    )  # fmt: skip
    card = GpuSample(index=0, uuid="GPU-m", up=True, mig_mode_enabled=True, mig_devices=devices)
    only = Filters(mig="only", max_mig_devices=1)
    assert "one answer names at most 1 MIG device" in (never_enough([card], 2, only) or "")
    assert not could_be_met([card], 2, only, None)
    assert could_be_met([card], 1, only, None)


def test_the_issues_cases_are_refused_at_once() -> None:
    def card(index: int, total_gib: int, **extra: object) -> GpuSample:
        return GpuSample(
            index=index, uuid=f"GPU-{index}", up=True, memory_total_bytes=total_gib * GIB,
            memory_used_bytes=0, memory_free_bytes=total_gib * GIB, processes=(),
            fields_supported=(("processes", True),), **extra,  # type: ignore[arg-type]
        )  # fmt: skip

    # n=7&mem=20GiB: only 6 of 8 cards have 20 GiB in total
    eight = [card(i, 24 if i < 6 else 8) for i in range(8)]
    assert "at most 6 of the 8 GPUs" in (
        never_enough(eight, 7, Filters(), 20 * GIB, HEADROOM) or ""
    )
    # n=2&include=6,2&mem=20GiB: card 6 has 8 GB
    said = never_enough(eight, 2, Filters(include=("6", "2")), 20 * GIB, HEADROOM) or ""
    assert "gpu 6: mem=20.0 GiB can never fit" in said
    # n=7&max_procs=0: one card cannot list its processes
    blind = [*eight[:7], dataclasses.replace(eight[7], fields_supported=(("processes", False),))]
    said = never_enough(blind, 8, filters_of(max_procs=0)) or ""
    assert "gpu 7: cannot report its processes (max_procs)" in said
    # n=8&mig=allow where one answer holds at most one MIG device
    mig = GpuSample(
        index=0, uuid="GPU-m", up=True, mig_mode_enabled=True, memory_total_bytes=80 * GIB
    )
    devices = tuple(
        GpuSample(index=0, uuid=f"MIG-{m}", up=True, parent_uuid="GPU-m") for m in range(7)
    )
    mig = dataclasses.replace(mig, mig_devices=devices)
    said = never_enough([mig, card(1, 80)], 2, Filters(mig="allow", max_mig_devices=1)) or ""
    assert "one answer names at most 1 MIG device" in said


def test_over_a_socket_a_request_no_state_could_meet_answers_at_once() -> None:
    """Two 80 GiB cards and an 8 GiB one that cannot list its processes: three shares of
    20 GiB, or three cards with no process, can never be had, so each is refused at once
    instead of waiting its 20 s (and blocking every /choose behind it)."""
    gpus = [SimGpu(i, model, Load("idle")) for i, model in enumerate((A100, A100, GTX))]
    with served(SimulatedNvml(gpus, clock=time.monotonic)) as ex:
        started = time.monotonic()
        status, body = get(ex.url + "/choose?n=3&mem=20GiB&wait=20s")
        assert status == 503 and time.monotonic() - started < 5
        assert "gpu 2: mem=20.0 GiB can never fit" in body, body
        assert get(ex.url + "/choose?n=2&mem=20GiB&wait=20s")[0] == 200
        # the GTX 1080 cannot list its processes: max_procs=0 can never pass there
        started = time.monotonic()
        status, body = get(ex.url + "/choose?n=3&max_procs=0&lease=0&wait=20s")
        assert status == 503 and time.monotonic() - started < 5
        assert "gpu 2: cannot report its processes (max_procs)" in body, body


def get(url: str) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
