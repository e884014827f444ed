"""The ``--collect.<group>`` groups, by name, with what each holds.

Which field belongs to which group, and how often it is read, is a column of the field table
(:mod:`gpu_exporter.collect.fields`); what each group costs is the README's group table
(:mod:`gpu_exporter.export.readme`).
"""

from __future__ import annotations

from collections.abc import Iterable

from gpu_exporter.collect.fields import FIELDS

# node_exporter-style collector groups, in the order the flags and the README list them.
GROUPS: dict[str, str] = {
    "power": "power draw, energy, power limits",
    "temperature": "temperature, memory temperature, thresholds, fan speed",
    "clocks": "clocks, max clocks, clocks event reasons, P-state",
    "health": "ECC mode and errors, remapped rows, retired pages, persistence and compute mode",
    "pcie": "PCIe link generation and width, replay errors",
    "media": "encoder and decoder utilization",
    "nvlink": "NVLink state, data and error counters per link",
    "processes": "compute processes and their SM and memory utilization (process series, "
    "lease attribution by arrival)",
    "xid": "the Xid event listener (one thread, not per sample)",
    "gpm": "GPM activity (Hopper and later): SM, tensor and FP pipes, DRAM, PCIe and NVLink "
    "traffic, every --gpm-interval",
}

# Groups off unless asked for with --collect.<group>: NVLink's series per link outnumber the
# rest of a GPU's together (the README's "What a GPU costs", measured).
OFF_BY_DEFAULT: tuple[str, ...] = ("nvlink",)


def parse_disabled(names: Iterable[str]) -> frozenset[str]:
    """Validated group names; raises ValueError naming an unknown one."""
    wanted = frozenset(names)
    unknown = wanted - set(GROUPS)
    if unknown:
        raise ValueError(
            f"unknown collector group {', '.join(sorted(unknown))}; choose from {', '.join(GROUPS)}"
        )
    return wanted


def fields_of(group: str, when: str | None = None) -> tuple[str, ...]:
    """The fields of one group (optionally of one cadence): one NVML call each per read."""
    return tuple(name for name, f in FIELDS.items() if f.group == group and when in (None, f.when))


def calls_per_gpu(when: str, disabled: Iterable[str] = OFF_BY_DEFAULT) -> int:
    """NVML calls per GPU to read the fields of cadence ``when`` (MIG off): one per getter,
    one for all the field values (issue 31); not the fields read only when another is
    non-empty (the processes' utilization, with none), nor the MIG device count."""
    off = set(disabled)
    read = [f for f in FIELDS.values() if f.when == when and f.group not in off and not f.needs]
    getters = sum(1 for f in read if f.batch is None and f.field != "mig_device_count")
    return getters + any(f.batch is not None for f in read)


def getter_fields(group: str, when: str | None = None) -> tuple[str, ...]:
    """The fields of one group (and cadence) read by a getter of their own, one NVML call
    each; the others are entries of their cadence's field-value batch."""
    return tuple(f for f in fields_of(group, when) if FIELDS[f].batch is None)
