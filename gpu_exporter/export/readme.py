"""The README's generated parts: the metric table, the collector groups, and what a GPU costs.

The metric table comes from :mod:`gpu_exporter.export.spec`; the groups' NVML calls from the
field table (:mod:`gpu_exporter.collect.fields`); every series and byte figure from
:class:`Costs`, measured on ``/metrics`` of simulated exporters by
``scripts/generate_readme.py``, which writes all three into the README (``export/`` builds no
exporter). Tests keep the README equal to them.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from dataclasses import dataclass

from gpu_exporter.collect.gpm import DEFAULT_GPM_INTERVAL_SECONDS
from gpu_exporter.collect.groups import GROUPS, OFF_BY_DEFAULT, fields_of, getter_fields
from gpu_exporter.config import ServeConfig
from gpu_exporter.export.spec import METRICS, PROCESS_MEMORY
from gpu_exporter.model import PROCESS_LABELS
from gpu_exporter.valuerow import CORE, FAST, GPM, ONCE, SLOW

WIDTH = 92  # the README's prose lines


@dataclass(frozen=True)
class Costs:
    """What ``/metrics`` costs, as measured: series and bytes (``bytes`` of the exposition
    as served, uncompressed)."""

    card: str  # the model measured: --simulate a100's
    groups: Mapping[str, int]  # series of one such GPU per group ("": the core); off by
    # default: what --collect.<group> adds
    series_per_gpu: int
    bytes_per_gpu: int
    host_series: int  # the exporter's own, whatever the GPUs
    host_bytes: int
    gpus: int  # the example host: this many such GPUs
    series: int
    bytes: int
    gzipped_bytes: int
    per_process: int  # series per compute process
    xid_first: int  # series for a GPU that has had an Xid error
    xid_more: int  # series for each further Xid code of that GPU
    gpm_card: str  # a model with GPM
    gpm_series: int  # its GPM series
    per_link: int  # NVLink series per link (--collect.nvlink)
    links: Mapping[str, int]  # NVLink links by model


def _kb(n: float) -> str:
    return f"{n / 1000:.1f}"


def _short(model: str) -> str:
    return model.removeprefix("NVIDIA ")


_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def _words(n: int) -> str:
    return _WORDS[n] if 0 <= n < len(_WORDS) else str(n)


def metrics_table() -> str:
    """The README's metric table."""
    rows = [
        "| Metric | Type | Unit | Labels | Source | Default | Updated | Group | Description |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for spec in METRICS:
        help_text = " ".join(filter(None, (spec.exposed_help, spec.details))).replace("|", "\\|")
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "—"
        if spec.labels == PROCESS_MEMORY.labels:
            labels = (
                "`gpu`, `uuid`, `pid` (+ opt-in "
                + ", ".join(f"`{label}`" for label in PROCESS_LABELS)
                + ")"
            )
        if spec.label_values:
            values = ", ".join(spec.label_values)
            help_text += f" Exported at 0 from the start: {values}."
        rows.append(
            f"| `{spec.name}` | {spec.type} | {spec.unit} | {labels} | {spec.source} "
            f"| {spec.default} | {spec.updated} | {spec.group or '—'} | {help_text} |"
        )
    return "\n".join(rows) + "\n"


_DEFAULTS = ServeConfig()


def _series_text(name: str, costs: Costs) -> str:
    """The groups table's "Series per GPU" cell of group ``name``."""
    n = costs.groups[name]
    links = {_short(model): costs.per_link * k for model, k in costs.links.items()}
    card = _short(costs.card)
    return {
        "processes": f"{n}, + {costs.per_process} per process",
        "xid": f"{costs.xid_more} per Xid code seen, + {costs.xid_first - costs.xid_more}",
        "nvlink": f"{costs.per_link} per link ({links[card]} on an {card})",
        "gpm": f"{costs.gpm_series} on Hopper and later (+ each MIG device's), {n} before",
    }.get(name, str(n))


def groups_table(
    costs: Costs,
    interval_seconds: float = _DEFAULTS.interval_seconds,
    slow_interval_seconds: float = _DEFAULTS.slow_interval_seconds,
) -> str:
    """The README's table of collector groups and their cost per GPU, at the default
    intervals: NVML calls on a card that supports every field (calls a GPU answers with
    NOT_SUPPORTED are asked once, then never again), series as ``costs`` measured them."""
    rows = [
        "| Group | Flag to turn it off | What | NVML calls per GPU per sample | "
        "per --slow-interval | once | per minute | Series per GPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    core = (
        "memory, utilization, MIG mode, identity and the handle (once), one field-value "
        "batch per cadence (the fields of the other groups NVML offers as field values)"
    )
    total = [0.0] * 4  # the groups on by default: calls per sample, slow, once, per minute
    for name, what in {CORE: core, **GROUPS}.items():
        # One call per field read by its own getter; batched fields are in the core row's
        # batch calls (one per cadence that has any).
        fast, slow, once = (len(getter_fields(name, when)) for when in (FAST, SLOW, ONCE))
        if not name:  # the batches, and the identity (UUID, name, bus id) and handle once
            fast, slow, once = fast + 1, slow + 1, once + 4
        per_minute = fast * 60 / interval_seconds + slow * 60 / slow_interval_seconds
        # GPM: asked once whether the card has it (two buffers allocated), then a sample and
        # the metrics per device every --gpm-interval; nothing more on a card without it.
        gpm = len(fields_of(name, GPM))
        once += 3 * gpm
        per_minute += 2 * gpm * 60 / DEFAULT_GPM_INTERVAL_SECONDS
        flag = f"`--no-collect.{name}`" if name else "— (always)"
        if name in OFF_BY_DEFAULT:
            flag = f"`--collect.{name}` (off by default)"
        rows.append(
            f"| {name or 'core'} | {flag} | {what} | {fast} | {slow} | {once} "
            f"| {per_minute:g} | {_series_text(name, costs)} |"
        )
        if name not in OFF_BY_DEFAULT:
            total = [t + n for t, n in zip(total, (fast, slow, once, per_minute), strict=True)]
    series = sum(n for name, n in costs.groups.items() if name not in OFF_BY_DEFAULT)
    calls = " | ".join(f"{n:g}" for n in total)
    rows.append(f"| **total** | | the groups on by default | {calls} | {series} |")
    return "\n".join(rows) + "\n"


def costs_paragraph(costs: Costs) -> str:
    """The README's paragraph "What a GPU costs", wrapped as the README's prose is."""
    card, gpm_card = _short(costs.card), _short(costs.gpm_card)
    model = card.split("-")[0]  # A100
    links = {_short(m): costs.per_link * k for m, k in costs.links.items()}
    marker = costs.groups["gpm"]  # on a card without GPM: the series that says so
    text = (
        f"**What a GPU costs.** A GPU costs **{costs.series_per_gpu} series and "
        f"{_kb(costs.bytes_per_gpu)} KB** of `/metrics` (an {card} that reports every health "
        f"field: `--simulate a100`), plus {_words(costs.per_process)} series per compute "
        f"process (its memory, SM and memory-controller utilization), "
        f"{_words(costs.xid_first)} for a GPU that has had an Xid error "
        f"({_words(costs.xid_more)} more for each further Xid code), and "
        f"{costs.gpm_series - marker} more for a card with GPM (Hopper and later: "
        f"{costs.gpm_series} GPM series instead of the {_words(marker)} saying it has none); "
        f"the exporter's own series add {costs.host_series} series and "
        f"{_kb(costs.host_bytes)} KB per host. {costs.gpus} {model}s: **{costs.series} series, "
        f"{_kb(costs.bytes)} KB** (about {costs.gzipped_bytes / 1000:.0f} KB gzipped). "
        f"NVLink is off by default (`--collect.nvlink`): {costs.per_link} series per link, "
        f"{links[card]} more on an {card} and {links[gpm_card]} on an {gpm_card}. "
        "These figures are measured on simulated exporters and written here by "
        "`scripts/generate_readme.py`; `tests/test_series_budget.py` keeps them equal and "
        "checks them against a real socket."
    )
    wrapped = textwrap.fill(text, WIDTH, break_on_hyphens=False, break_long_words=False)
    return wrapped + "\n"
