"""How often each NVML field is read, and the ``--collect.<group>`` group it belongs to.

Three cadences, as DCGM has them:

* :data:`FAST` — every ``--interval``: what changes from second to second (memory,
  utilization, power, energy, temperature, clocks, processes);
* :data:`SLOW` — every ``--slow-interval``: health counters and settings an administrator
  changes (ECC and retired pages, remapped rows, PCIe link, P-state, modes, power limit).
  Between two slow reads the last value stays in the snapshot; a slow field whose read
  failed is absent until it reads again;
* :data:`ONCE` — once per GPU and NVML initialisation (again after a driver restart or once a
  lost GPU answers again): identity and values that cannot change while the driver runs.

A disabled group (``--no-collect.health``) makes no NVML call and so exports no series.
Fields of no group (memory, utilization, MIG mode: what ``/choose`` ranks on) are always read.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpu_exporter.model import CLOCKS, ECC_COUNTERS, ECC_ERRORS, RETIREMENT_CAUSES
from gpu_exporter.model import TEMPERATURE_THRESHOLDS as THRESHOLDS

FAST = "every sample"
SLOW = "every --slow-interval"
ONCE = "once"
CORE = ""  # no group: always read

# node_exporter-style collector groups, in the order the flags and the README list them.
GROUPS: dict[str, str] = {
    "power": "power draw, energy, power limits",
    "temperature": "temperature, thresholds, fan speed",
    "clocks": "clocks, max clocks, clocks event reasons, P-state",
    "health": "ECC mode and errors, remapped rows, retired pages, persistence and compute mode",
    "pcie": "PCIe link generation and width, replay errors",
    "media": "encoder and decoder utilization",
    "processes": "compute processes (process series, lease attribution by arrival)",
    "xid": "the Xid event listener (one thread, not per sample)",
}

# FieldReader field → (cadence, group); one NVML call per field and read.
FIELDS: dict[str, tuple[str, str]] = {
    "memory": (FAST, CORE),
    "utilization": (FAST, CORE),
    "mig_mode": (SLOW, CORE),
    "mig_device_count": (ONCE, CORE),
    "power_draw": (FAST, "power"),
    "energy": (FAST, "power"),
    "power_limit": (SLOW, "power"),
    "power_limit_default": (ONCE, "power"),
    "power_limit_constraints": (ONCE, "power"),
    "temperature": (FAST, "temperature"),
    "fan_speed": (FAST, "temperature"),
    **{f"temperature_threshold_{t}": (ONCE, "temperature") for t in THRESHOLDS},
    **{f"clock_{c}": (FAST, "clocks") for c in CLOCKS},
    **{f"clock_max_{c}": (ONCE, "clocks") for c in CLOCKS},
    "clocks_event_reasons": (FAST, "clocks"),
    "performance_state": (SLOW, "clocks"),
    "processes": (FAST, "processes"),
    "persistence_mode": (SLOW, "health"),
    "compute_mode": (SLOW, "health"),
    "ecc_mode": (SLOW, "health"),
    **{f"ecc_errors_{e}_{c}": (SLOW, "health") for e in ECC_ERRORS for c in ECC_COUNTERS},
    "remapped_rows": (SLOW, "health"),
    **{f"retired_pages_{cause}": (SLOW, "health") for cause in RETIREMENT_CAUSES},
    "retired_pages_pending": (SLOW, "health"),
    "pcie_link_generation_current": (SLOW, "pcie"),
    "pcie_link_width_current": (SLOW, "pcie"),
    "pcie_replay_errors": (SLOW, "pcie"),
    "pcie_link_generation_max": (ONCE, "pcie"),
    "pcie_link_width_max": (ONCE, "pcie"),
    "encoder_utilization": (FAST, "media"),
    "decoder_utilization": (FAST, "media"),
}


def cadence(field: str) -> str:
    """When ``field`` is read: :data:`FAST`, :data:`SLOW` or :data:`ONCE`."""
    return FIELDS[field][0]


def group(field: str) -> str:
    """The ``--collect.<group>`` ``field`` belongs to; :data:`CORE` ("") for none."""
    return FIELDS[field][1]


def fields_of(group_name: str, when: str | None = None) -> tuple[str, ...]:
    """The fields of one group (optionally of one cadence), for the cost table and tests."""
    return tuple(
        f for f, (c, g) in FIELDS.items() if g == group_name and (when is None or c == when)
    )


def parse_disabled(names: Iterable[str]) -> frozenset[str]:
    """Validated group names; raises ValueError naming an unknown one."""
    wanted = frozenset(names)
    unknown = wanted - set(GROUPS)
    if unknown:
        raise ValueError(
            f"unknown collector group {', '.join(sorted(unknown))}; choose from {', '.join(GROUPS)}"
        )
    return wanted
