"""The fleet at scale, read from one recorded series per GPU: ``<prefix>:packed`` (pure).

The sieve (:mod:`gpu_exporter.choose.fleetsieve`) makes the store read and join five
per-GPU metrics per choice; at 100,000 GPUs that is most of a choice's time
(docs/cluster.md). The fleet rules' ``gpu_fleet:packed``
(``deploy/prometheus/gpu-exporter.fleet.rules.yml``) writes ONE series per whole card that
can be handed out (``gpu_up`` 1, not leased, not allocated to a Kubernetes pod), whose
float64 value packs the figures a choice filters and ranks on, each a whole number in its
own decimal digits (:data:`FIELDS`, most significant first)::

    utilization %          (0-100)       × 10^13   tested, then dropped
    memory utilization %   (0-100)       × 10^10
    compute processes      (capped at 9) × 10^9
    free memory, whole MiB (capped)      × 10^3
    utilization %          (0-100)       × 1       kept for the ranking

The largest value, 1,001,009,999,999,100, is below 2^53, so every value, and every ``%``
and comparison below, is exact. One choice is then one selector read with scalar
arithmetic (:func:`packed_query`): a comparison tests the field at the top of what is left
(comparisons keep the left-hand value), ``%`` drops the fields above the next one tested,
and what is left, ``free MiB × 1000 + utilization %``, is what the ranking orders by
(:func:`unpack`). Utilization is tested first because it leaves out the most cards, so
the later operations see fewer series (each costs VictoriaMetrics about 1 µs a series).

Exact, so the same GPUs pass as with the raw series, where the figures are what NVML
reports (utilization in whole percent) and the thresholds fit the packing
(:func:`packable`): ``min_free`` a whole number of MiB, ``max_procs`` below 9, no
``min_total``. Other requests take the sieve or the full read. A GPU missing one of the
packed figures has no packed series (the sieve would let an unknown figure of a defaulted
filter pass). ``model`` joins ``gpu_info`` (only then).
"""

from __future__ import annotations

import math
from typing import Final

from gpu_exporter.choose.filters import Filters
from gpu_exporter.choose.fleetsieve import GPU_KEY, Names, _model_regex, sievable
from gpu_exporter.choose.fleetview import check_prefix
from gpu_exporter.choose.promql import check_selector

MIB: Final = 2**20
PACKED_NAME: Final = "packed"  # <prefix>:packed
# field → (lowest digit, digits, largest value): the rule's layout, most significant first.
FIELDS: Final = {
    "utilization_pct_test": (13, 3, 100),
    "memory_utilization_pct": (10, 3, 100),
    "compute_processes": (9, 1, 9),
    "memory_free_mib": (3, 6, 999_999),
    "utilization_pct": (0, 3, 100),
}
LARGEST: Final = sum(top * 10**low for low, _, top in FIELDS.values())
assert LARGEST < 2**53  # every packed value is an exact float64 integer
KEPT_DIGITS: Final = 9  # free MiB and utilization: what the ranking orders by


def pack(
    *,
    memory_free_bytes: int,
    utilization_ratio: float,
    memory_utilization_ratio: float,
    compute_processes: int,
) -> int:
    """What the rule records for one card (the bench and the tests write it this way).

    >>> pack(memory_free_bytes=80 * 2**30, utilization_ratio=0.07,
    ...      memory_utilization_ratio=0.35, compute_processes=0)
    70350081920007
    """
    util = _round(utilization_ratio * 100)
    figures = {
        "utilization_pct_test": util,
        "memory_utilization_pct": _round(memory_utilization_ratio * 100),
        "compute_processes": compute_processes,
        "memory_free_mib": memory_free_bytes // MIB,
        "utilization_pct": util,
    }
    return sum(
        min(max(int(figures[name]), 0), top) * 10**low for name, (low, _, top) in FIELDS.items()
    )


def _round(x: float) -> int:
    """PromQL's ``round()``: halves up (Python's rounds them to even)."""
    return math.floor(x + 0.5)


def _pct(ratio: float) -> int:
    """The largest whole percent at or below ``ratio`` (``x % <= ratio`` ⇔ ``x <= this``)."""
    return math.floor(round(ratio * 100, 6))


def packable(filters: Filters, sort: str, idle_for_seconds: float | None) -> bool:
    """Whether :func:`packed_query` tests this request's filters exactly."""
    free = filters.min_free_bytes
    return (
        sievable(filters, sort, idle_for_seconds)
        and filters.min_total_bytes is None
        and (filters.max_procs is None or filters.max_procs < FIELDS["compute_processes"][2])
        and (free is None or (free % MIB == 0 and free // MIB <= FIELDS["memory_free_mib"][2]))
    )


def _selector(prefix: str, selector: str) -> str:
    sel = check_selector(selector)
    return f"{check_prefix(prefix)}:{PACKED_NAME}" + (f"{{{sel}}}" if sel else "")


def packed_query(prefix: str, filters: Filters, names: Names | None = None) -> str:
    """The GPUs that pass the request's filters, valued ``free MiB × 1000 + utilization %``:
    ``<prefix>:packed``, narrowed by ``names.selector`` (``names`` also spells ``gpu_info``,
    raw or recorded, for ``model``).

    >>> print(packed_query("gpu_fleet", Filters(min_free_bytes=40 * 2**30,
    ...                    max_util_ratio=0.1, max_procs=0)))
    (((gpu_fleet:packed < 110000000000000) % 10000000000) < 1000000000) >= 40960000
    >>> print(packed_query("gpu_fleet", Filters(max_util_ratio=0.5, max_mem_util_ratio=0.5),
    ...                    Names("", 'pool="a"')))
    (((gpu_fleet:packed{pool="a"} < 510000000000000) % 10000000000000) < 510000000000) % 1000000000
    """
    tests: dict[str, tuple[str, int]] = {}  # field → (op, its bound in the field's units)
    if filters.max_util_ratio is not None and _pct(filters.max_util_ratio) < 100:
        tests["utilization_pct_test"] = ("<=", _pct(filters.max_util_ratio))
    if filters.max_mem_util_ratio is not None and _pct(filters.max_mem_util_ratio) < 100:
        tests["memory_utilization_pct"] = ("<=", _pct(filters.max_mem_util_ratio))
    if filters.max_procs is not None:
        tests["compute_processes"] = ("<=", filters.max_procs)
    if filters.min_free_bytes:
        tests["memory_free_mib"] = (">=", -(-filters.min_free_bytes // MIB))
    names = names or Names()
    expr = _selector(prefix, names.selector)
    above = 16  # the digits left in the value: all of them

    def then(op: str, number: int) -> str:
        return f"{expr if ' ' not in expr else f'({expr})'} {op} {number}"

    for name, (low, width, _) in FIELDS.items():
        if name not in tests:
            continue
        if low + width < above:  # drop the fields above this one
            expr = then("%", 10 ** (low + width))
        op, bound = tests[name]
        if op == "<=":  # x <= b ⇔ value < (b + 1) × 10^low, whatever the digits below
            expr = then("<", (bound + 1) * 10**low)
            # x <= 0 leaves the field 0: the next test needs no % to drop it
            above = low if bound == 0 else low + width
        else:
            expr = then(">=", bound * 10**low)
            above = low + width
    if above > KEPT_DIGITS:
        expr = then("%", 10**KEPT_DIGITS)
    if filters.model is not None:
        info = names.gpu("info", f"name=~{_model_regex(filters.model)}")
        expr = f"({expr}) and {GPU_KEY} {info}"
    return expr


RECORDED_LAG_ABOVE: Final = 5.0  # the rules record a stuck sampler past this lag (seconds)


def recorded_problems_query(prefix: str, selector: str, max_age_seconds: float) -> str:
    """The exporters that cannot serve, from ``<prefix>:problem`` (the packed rules' group):
    what :func:`~gpu_exporter.choose.fleetsieve.problems_query` answers, reading only them.
    The rule records a sampler's lag past :data:`RECORDED_LAG_ABOVE`, so ``max_age`` must
    not be below it.

    >>> print(recorded_problems_query("gpu_fleet", "", 60))
    gpu_fleet:problem{fleet_problem!="stuck"} or gpu_fleet:problem{fleet_problem="stuck"} > 60
    """
    if max_age_seconds < RECORDED_LAG_ABOVE:
        raise ValueError(f"the rules record lags past {RECORDED_LAG_ABOVE:g} s only")
    sel = check_selector(selector)
    name = f"{check_prefix(prefix)}:problem"
    rest = f", {sel}" if sel else ""
    return (
        f'{name}{{fleet_problem!="stuck"{rest}}} '
        f'or {name}{{fleet_problem="stuck"{rest}}} > {max_age_seconds!r}'
    )


def presence_query(prefix: str, selector: str = "") -> str:
    """Whether the store has the packed series at all (an empty answer may just be a
    fleet where no GPU passes)."""
    return f"count({_selector(prefix, selector)})"


def unpack(value: float) -> tuple[int, float]:
    """Whole free GiB and utilization from :func:`packed_query`'s value.

    >>> unpack(81920007.0), unpack(999999100.0)
    ((80, 0.07), (976, 1.0))
    """
    free_mib, util_pct = divmod(int(value) % 10**KEPT_DIGITS, 1000)
    return free_mib // 1024, util_pct / 100
