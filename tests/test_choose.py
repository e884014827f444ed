"""Ranking: table-driven cases and Hypothesis properties over pure functions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_exporter.choose.filters import Filters, rejection_reasons
from gpu_exporter.choose.rank import GIB, NotEnoughGpus, choose, rank, sort_key
from gpu_exporter.choose.request import filters_of
from gpu_exporter.choose.selectors import selector_matches
from gpu_exporter.model import GpuSample


def gpu(
    index: int,
    free_gib: float | None = 80,
    util: float | None = 0.0,
    up: bool = True,
) -> GpuSample:
    return GpuSample(
        index=index,
        uuid=f"GPU-{index:08x}-0000-0000-0000-000000000000",
        up=up,
        pci_bus_id=f"00000000:{index + 16:02X}:00.0",
        memory_free_bytes=None if free_gib is None else int(free_gib * GIB),
        utilization_ratio=util,
        error=None if up else "nvmlDeviceGetHandleByIndex: GPU is lost (GPU_IS_LOST)",
    )


def test_most_free_memory_first() -> None:
    gpus = [gpu(0, 10), gpu(1, 70), gpu(2, 40)]
    assert [g.index for g in choose(gpus, 3, Filters()).chosen] == [1, 2, 0]


def test_then_lowest_utilization_within_the_same_gib() -> None:
    gpus = [gpu(0, 79.2, 0.9), gpu(1, 79.4, 0.0), gpu(2, 79.9, 0.5)]
    assert [g.index for g in choose(gpus, 3, Filters()).chosen] == [1, 2, 0]


def test_ties_prefer_the_highest_index_to_keep_gpu0_free() -> None:
    gpus = [gpu(0), gpu(1), gpu(2)]
    assert [g.index for g in choose(gpus, 3, Filters()).chosen] == [2, 1, 0]


def test_down_gpus_are_never_chosen() -> None:
    gpus = [gpu(0, 80, up=False), gpu(1, 1)]
    choice = choose(gpus, 1, Filters())
    assert [g.index for g in choice.chosen] == [1]
    assert choice.not_chosen[0].reasons[0].startswith("down: nvmlDeviceGetHandleByIndex")
    with pytest.raises(NotEnoughGpus, match=r"1 of 2 GPUs qualify, 2 requested \(gpu 0: down"):
        choose(gpus, 2, Filters())


def test_filters_and_reasons() -> None:
    f = filters_of(min_free=8 * GIB, max_util=0.3, exclude=("GPU-00000003",))
    assert rejection_reasons(gpu(0, 4, 0.5), f) == (
        "free memory 4.0 GiB < min_free 8.0 GiB",
        "utilization 0.50 > max_util 0.30",
    )
    assert rejection_reasons(gpu(1, None, None), f) == (
        "free memory unknown",
        "utilization unknown",
    )
    assert rejection_reasons(gpu(3), f) == ("excluded",)
    assert rejection_reasons(gpu(2, 8, 0.3), f) == ()  # limits are inclusive


def test_not_chosen_gpus_say_why() -> None:
    choice = choose([gpu(0, 10), gpu(1, 70), gpu(2, 40)], 1, Filters())
    assert [(r.gpu.index, r.reasons) for r in choice.not_chosen] == [
        (0, ("ranked 3 of 3 qualifying; 1 requested",)),
        (2, ("ranked 2 of 3 qualifying; 1 requested",)),
    ]


@pytest.mark.parametrize(
    ("selector", "matches"),
    [
        ("1", True),
        ("01", True),
        ("2", False),
        ("GPU-00000001-0000-0000-0000-000000000000", True),
        ("gpu-00000001", True),
        ("GPU-0000000", True),  # a prefix shared by every GPU here matches them all
        ("GPU-00000002", False),
        ("00000000:11:00.0", True),
        ("0000:11:00.0", True),
        ("11:00.0", True),
        ("12:00.0", False),
    ],
)
def test_selectors(selector: str, matches: bool) -> None:
    assert selector_matches(gpu(1), selector) is matches


def test_n_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        choose([gpu(0)], 0, Filters())


# -- properties -------------------------------------------------------------------------

gpu_lists = st.lists(
    st.builds(
        lambda free, util, up: (free, util, up),
        st.one_of(st.none(), st.floats(0, 80)),
        st.one_of(st.none(), st.floats(0, 1)),
        st.booleans(),
    ),
    max_size=12,
).map(lambda specs: [gpu(i, f, u, up) for i, (f, u, up) in enumerate(specs)])
filters = st.builds(
    filters_of,
    min_free=st.one_of(st.none(), st.integers(0, 80 * GIB)),
    max_util=st.one_of(st.none(), st.floats(0, 1)),
    exclude=st.lists(st.integers(0, 12).map(str), max_size=3).map(tuple),
)


@settings(max_examples=300)
@given(gpus=gpu_lists, f=filters, n=st.integers(1, 14), data=st.data())
def test_choose_properties(gpus: list[GpuSample], f: Filters, n: int, data: st.DataObject) -> None:
    qualified = [g for g in gpus if not rejection_reasons(g, f)]
    if len(qualified) < n:
        with pytest.raises(NotEnoughGpus) as info:
            choose(gpus, n, f)
        assert len(info.value.ranking.qualified) == len(qualified)
        return
    choice = choose(gpus, n, f)
    chosen = choice.chosen
    assert len(chosen) == n  # exactly n when it succeeds
    assert len({g.index for g in chosen}) == n  # no GPU twice
    assert all(g.up for g in chosen)  # lost GPUs never chosen
    assert all(rejection_reasons(g, f) == () for g in chosen)  # respects filters
    # Every GPU is accounted for exactly once.
    assert sorted([g.index for g in chosen] + [r.gpu.index for r in choice.not_chosen]) == list(
        range(len(gpus))
    )
    # Nothing passed over ranks better than something chosen.
    worst_chosen = max(sort_key(g) for g in chosen)
    for r in choice.not_chosen:
        if not rejection_reasons(r.gpu, f):
            assert sort_key(r.gpu) >= worst_chosen
    # Deterministic whatever the input order.
    shuffled = data.draw(st.permutations(gpus))
    assert choose(shuffled, n, f).chosen == chosen


@given(gpus=gpu_lists, f=filters)
def test_rank_partitions_all_gpus(gpus: list[GpuSample], f: Filters) -> None:
    ranking = rank(gpus, f)
    assert len(ranking.qualified) + len(ranking.rejected) == len(gpus)
    assert list(ranking.qualified) == sorted(ranking.qualified, key=sort_key)
    assert all(r.reasons for r in ranking.rejected)
