"""What the fleet rule records for one card: ``gpu_fleet:packed``'s value, written the way the
rule computes it (for the tests and bench/fleet_store.py; the chooser only reads it)."""

from __future__ import annotations

import math

from gpu_exporter.fleet.packing import FIELDS, MIB


def pack(
    *,
    memory_free_bytes: int,
    utilization_ratio: float,
    memory_utilization_ratio: float,
    compute_processes: int,
) -> int:
    """What the rule records for one card (the bench writes it this way too)."""
    util = math.floor(utilization_ratio * 100 + 0.5)  # PromQL's round(): halves up
    figures = {
        "utilization_pct_test": util,
        "memory_utilization_pct": math.floor(memory_utilization_ratio * 100 + 0.5),
        "compute_processes": compute_processes,
        "memory_free_mib": memory_free_bytes // MIB,
        "utilization_pct": util,
    }
    return sum(min(max(int(figures[f.name]), 0), f.top) * 10**f.low for f in FIELDS)
