"""The README's generated tables: the metrics, and the collector groups with their cost.

The metric table comes from :mod:`gpu_exporter.export.spec`, the groups with what each costs
per GPU from the field table (:mod:`gpu_exporter.collect.fields`). Tests keep the README
equal to both; ``python -m gpu_exporter.export.readme`` prints them.
"""

from __future__ import annotations

from gpu_exporter.collect.fields import CORE, FAST, GPM, ONCE, SLOW
from gpu_exporter.collect.gpm import DEFAULT_GPM_INTERVAL_SECONDS
from gpu_exporter.collect.groups import GROUPS, OFF_BY_DEFAULT, fields_of, getter_fields
from gpu_exporter.export.spec import METRICS, PROCESS_MEMORY
from gpu_exporter.model import CLOCKS_EVENT_REASONS, PROCESS_LABELS

# Series one A100-like GPU has per group (process series: one per process, not counted).
_SERIES: dict[str, int] = {
    "power": 6,  # draw, energy, limit, default, min, max
    # temperature, memory temperature, 4 thresholds, fan (absent on passive cards)
    "temperature": 1 + 1 + 4 + 1,
    "clocks": 4 + 4 + len(CLOCKS_EVENT_REASONS) + 1,  # clocks, max clocks, reasons, P-state
    "health": 3 + 4 + 2 + 2 + 2 + 1,  # modes, ECC, remapped rows (2 + 2), retired pages (2 + 1)
    "pcie": 2 + 2 + 1,
    "media": 2,
    "gpm": 4 + 3 + 3 + 1 + 2 + 2,  # SM x2, graphics, tensor; tensor and FP pipes; DRAM; links
}
_SERIES_TEXT = {
    "": "7",
    "processes": "1, + 3 per process",
    "xid": "1 per Xid code seen, + 1",
    "nvlink": "7 per link (84 on an A100-SXM4)",
    "gpm": f"{_SERIES['gpm']} on Hopper and later (+ each MIG device's), 0 before",
}


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


def groups_table(interval_seconds: float = 1.0, slow_interval_seconds: float = 30.0) -> str:
    """The README's table of collector groups and their cost per GPU, at the default
    intervals (calls a GPU answers with NOT_SUPPORTED are asked once, then never again)."""
    rows = [
        "| Group | Flag to turn it off | What | NVML calls per GPU per sample | "
        "per --slow-interval | once | per minute | Series per GPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    core = (
        "memory, utilization, MIG mode, identity and the handle (once), one field-value "
        "batch per cadence (the fields of the other groups NVML offers as field values)"
    )
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
        series_text = _SERIES_TEXT.get(name) or str(_SERIES[name])
        rows.append(
            f"| {name or 'core'} | {flag} | {what} | {fast} | {slow} | {once} "
            f"| {per_minute:g} | {series_text} |"
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(metrics_table(), groups_table(), sep="\n", end="")
