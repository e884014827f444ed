"""The layout of ``gpu_fleet:packed``: one recorded series per GPU that can be handed out,
and the query that filters it in the store (pure).

The fleet rules (``deploy/prometheus/gpu-exporter.fleet.rules.yml``, generated from
:data:`FIELDS` by ``scripts/generate_deploy.py``) record one series per whole card with
``gpu_up`` 1, not leased and not allocated to a Kubernetes pod. Its value packs the figures a
choice filters and ranks on, each a whole number in its own decimal digits (:data:`FIELDS`,
most significant first; utilization twice: tested at the top, kept at the bottom); every value
is below 2^53, so exact in float64. :func:`packed_query` filters it with comparisons (a
comparison tests the field at the top of what is left) and ``%`` (which drops the fields above
the next one tested); what is left, ``free MiB × 1000 + utilization %``, is what the ranking
orders by (:func:`unpack`). Exact where the thresholds fit the packing (:func:`packable`).

Each limit (:class:`~gpu_exporter.choose.filters.Bound`) is tested by the figure it compares
(:func:`packed_test`): in its packed field, where the limit fits it exactly; or, for a limit
with a fallback (SM activity, GPM: a figure most cards lack, utilization where a card has
none), on its raw series joined to the packed one (the comparison is exact on the series, so
any threshold fits); any other limit is not packed, and the request takes the full read.
``sort=sm_active`` asks the SM activity of the GPUs that passed in a query of its own
(:func:`sm_active_query`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from gpu_exporter.choose.filters import RATIO, Bound, Filters
from gpu_exporter.fleet.queries import GPU_KEY, braces, judged, model_regex

MIB: Final = 2**20
PACKED: Final = "gpu_fleet:packed"
PROBLEM: Final = "gpu_fleet:problem"
RECORDED_LAG_ABOVE: Final = 5  # the rule records a sampler's lag past this (seconds)
# The orders free memory and utilization decide, and SM activity (sm_active_query).
SORTS: Final = ("free", "util", "pack", "sm_active")
SM_ACTIVE: Final = "gpu_sm_active_ratio"


@dataclass(frozen=True, slots=True)
class PackedField:
    """One figure in the packed value: its lowest digit, largest value, and its PromQL."""

    name: str
    low: int
    top: int
    source: str

    @property
    def high(self) -> int:  # one past its highest digit
        return self.low + len(str(self.top))


UTIL_PCT: Final = "round(gpu_utilization_ratio * 100)"
# Memory in use, in whole percent rounded up: x <= b ⇔ used ÷ total <= b %, as the filter has it
# (used × 100 is exact in float64, so a card at exactly b % reads b).
USED_PCT: Final = "ceil(gpu_memory_used_bytes * 100 / gpu_memory_total_bytes)"
FIELDS: Final = (
    PackedField("utilization_pct_test", 13, 100, UTIL_PCT),
    PackedField("memory_used_pct", 10, 100, USED_PCT),
    PackedField("compute_processes", 9, 9, "gpu_compute_processes"),
    PackedField("memory_free_mib", 3, 999_999, "floor(gpu_memory_free_bytes / 1048576)"),
    PackedField("utilization_pct", 0, 100, UTIL_PCT),
)
BY_NAME: Final = {f.name: f for f in FIELDS}
assert sum(f.top * 10**f.low for f in FIELDS) < 2**53  # every value is an exact float64
KEPT_DIGITS: Final = BY_NAME["memory_free_mib"].high  # what the ranking orders by


def packable(filters: Filters, sort: str, idle_for_seconds: float | None, max_age: float) -> bool:
    """Whether :func:`packed_query` tests this request exactly (else: the full read)."""
    return (
        not idle_for_seconds
        and filters.mig != "only"  # whole cards only
        and not filters.include
        and not filters.exclude
        and sort in SORTS
        and max_age >= RECORDED_LAG_ABOVE
        and all(packed_test(bound) is not INEXACT for bound in filters.limits)
    )


JOINED: Final = "joined"  # compared on its raw series beside the packed one
NO_LIMIT: Final = "no limit"  # none there: 100 % of a ratio, 0 bytes free
INEXACT: Final = "inexact"  # the packing cannot test it exactly: the full read


def packed_test(bound: Bound) -> tuple[str, str, int] | str:
    """How :func:`packed_query` tests one limit: (packed field, comparison, the limit in the
    field's units), :data:`JOINED`, :data:`NO_LIMIT` or :data:`INEXACT`; by the figure the
    limit compares, so a limit on any other figure is :data:`INEXACT`.

    >>> from gpu_exporter.choose.filters import Limit
    >>> packed_test(Bound("x", Limit("utilization", "utilization_ratio", RATIO), 0.505))
    ('utilization_pct_test', '<=', 50)
    >>> packed_test(Bound("x", Limit("memory utilization", "memory_utilization_ratio", RATIO), 0.5))
    'inexact'
    """
    limit, value = bound.limit, bound.value
    if limit.fallback is not None:  # one series or another per GPU: not in the packing
        return JOINED
    figure = (limit.compared, limit.most)
    if figure == ("utilization_ratio", True):  # whole percent on every card: any limit fits
        return ("utilization_pct_test", "<=", _pct(value)) if _pct(value) < 100 else NO_LIMIT
    if figure == ("memory_used_ratio", True):  # rounded up: only a whole percent is exact
        if not _whole_percent(value):
            return INEXACT
        return ("memory_used_pct", "<=", _pct(value)) if _pct(value) < 100 else NO_LIMIT
    if figure == ("compute_processes", True):  # capped: 9 reads "9 or more"
        top = BY_NAME["compute_processes"].top
        return ("compute_processes", "<=", int(value)) if value < top else INEXACT
    if figure == ("memory_free_bytes", False):  # whole MiB, rounded down: only whole MiB fit
        if value % MIB or value // MIB > BY_NAME["memory_free_mib"].top:
            return INEXACT
        return ("memory_free_mib", ">=", int(value) // MIB) if value else NO_LIMIT
    if limit.unit is RATIO and limit.most and value >= 1:  # 100 % is no limit
        return NO_LIMIT
    return INEXACT


def _whole_percent(ratio: float | None) -> bool:
    """No limit, or a limit in whole percent (``0.505`` would read 50 % in the packing)."""
    return ratio is None or abs(ratio * 100 - round(ratio * 100)) < 1e-9


def _pct(ratio: float) -> int:
    """The largest whole percent at or below ``ratio`` (``x % <= ratio`` ⇔ ``x <= this``)."""
    return math.floor(round(ratio * 100, 6))


def packed_query(filters: Filters, selector: str = "") -> str:
    """The GPUs that pass the request's filters, valued ``free MiB × 1000 + utilization %``.

    >>> from gpu_exporter.choose.request import parse_choose_args
    >>> def packed(**args: str) -> str:
    ...     return packed_query(parse_choose_args(args).filters)
    >>> print(packed(min_free="40GiB", max_util="0.1", max_procs="0"))
    (((gpu_fleet:packed < 110000000000000) % 10000000000) < 1000000000) >= 40960000
    >>> print(packed_query(parse_choose_args({"max_util": "0.5", "max_mem_used": "0.5"}).filters,
    ...                    'pool="a"'))
    (((gpu_fleet:packed{pool="a"} < 510000000000000) % 10000000000000) < 510000000000) % 1000000000
    """
    tests: dict[str, tuple[str, int]] = {}  # field → (op, its bound in the field's units)
    joined: list[Bound] = []
    for given in filters.limits:
        test = packed_test(given)
        if isinstance(test, tuple):
            tests[test[0]] = test[1:]
        elif test == JOINED:
            joined.append(given)
    expr = PACKED + braces(selector)
    above = 16  # the digits left in the value: all of them

    def then(op: str, number: int) -> str:
        return f"{expr if ' ' not in expr else f'({expr})'} {op} {number}"

    for f in FIELDS:
        if f.name not in tests:
            continue
        if f.high < above:  # drop the fields above this one
            expr = then("%", 10**f.high)
        op, bound = tests[f.name]
        if op == "<=":  # x <= b ⇔ value < (b + 1) × 10^low, whatever the digits below
            expr = then("<", (bound + 1) * 10**f.low)
            above = f.low if bound == 0 else f.high  # x <= 0 leaves the field 0
        else:
            expr = then(">=", bound * 10**f.low)
            above = f.high
    if above > KEPT_DIGITS:
        expr = then("%", 10**KEPT_DIGITS)
    if filters.model is not None:
        info = f"gpu_info{braces(selector, f'name=~{model_regex(filters.model)}')}"
        expr = f"({expr}) and {GPU_KEY} {info}"
    for given in joined:  # not packed: the raw series, per GPU
        op = "<=" if given.limit.most else ">="
        expr = (
            f"({expr}) and {GPU_KEY} ({judged(given.limit, braces(selector))} {op} {given.value!r})"
        )
    return expr


def sm_active_query(filters: Filters, selector: str = "") -> str:
    """``sort=sm_active``: the SM activity of the GPUs that pass (:func:`packed_query`); a GPU
    it leaves out has no GPM and ranks by its utilization, as on the host.

    >>> from gpu_exporter.choose.request import parse_choose_args
    >>> print(sm_active_query(parse_choose_args({"max_procs": "0"}).filters))
    gpu_sm_active_ratio and on(instance, job, uuid) ((gpu_fleet:packed % 10000000000) < 1000000000)
    """
    packed = packed_query(filters, selector)
    return f"{SM_ACTIVE}{braces(selector)} and {GPU_KEY} ({packed})"


def problems_query(selector: str, max_age_seconds: float) -> str:
    """The exporters that cannot serve, from ``gpu_fleet:problem`` (told apart by
    ``fleet_problem``: ``nvml_down``, ``stuck`` with its lag as value, ``target_down``).

    >>> print(problems_query("", 60))
    gpu_fleet:problem{fleet_problem!="stuck"} or gpu_fleet:problem{fleet_problem="stuck"} > 60
    """
    other, stuck = (braces(selector, f'fleet_problem{op}"stuck"') for op in ("!=", "="))
    return f"{PROBLEM}{other} or {PROBLEM}{stuck} > {max_age_seconds!r}"


def unpack(value: float) -> tuple[int, float]:
    """Whole free GiB and utilization from :func:`packed_query`'s value.

    >>> unpack(81920007.0), unpack(999999100.0)
    ((80, 0.07), (976, 1.0))
    """
    free_mib, util_pct = divmod(int(value) % 10**KEPT_DIGITS, 1000)
    return free_mib // 1024, util_pct / 100
