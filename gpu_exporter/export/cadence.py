"""When each metric's value is read, which ``--collect.<group>`` it belongs to, and what each
group costs: the "Updated" and "Group" columns of the README's metric table and its group
table (``python -m gpu_exporter.export.cadence``). The cadences themselves are the fields' in
:mod:`gpu_exporter.collect.groups`; this maps metrics onto them.
"""

from __future__ import annotations

from gpu_exporter.collect import groups
from gpu_exporter.collect.groups import CORE, FAST, GROUPS, ONCE, SLOW
from gpu_exporter.model import CLOCKS_EVENT_REASONS

AT_SCRAPE = "at scrape"
ON_EVENT = "on event"
SLOW_AND_ONCE = "current: every --slow-interval; max: once"
KUBELET = "every 10 s, own thread"  # --kubernetes: collect/kubelet.py

# Metric → (updated, group) for every metric that is not simply "every sample, no group".
METRICS: dict[str, tuple[str, str]] = {
    "gpu_info": (ONCE, CORE),
    "gpu_power_draw_watts": (FAST, "power"),
    "gpu_energy_joules_total": (FAST, "power"),
    "gpu_power_limit_watts": (SLOW, "power"),
    "gpu_power_limit_default_watts": (ONCE, "power"),
    "gpu_temperature_celsius": (FAST, "temperature"),
    "gpu_temperature_threshold_celsius": (ONCE, "temperature"),
    "gpu_fan_speed_ratio": (FAST, "temperature"),
    "gpu_clock_hz": (FAST, "clocks"),
    "gpu_clock_max_hz": (ONCE, "clocks"),
    "gpu_clocks_event_reasons": (FAST, "clocks"),
    "gpu_performance_state": (SLOW, "clocks"),
    "gpu_persistence_mode_enabled": (SLOW, "health"),
    "gpu_compute_mode": (SLOW, "health"),
    "gpu_ecc_mode_enabled": (SLOW, "health"),
    "gpu_ecc_errors_total": (SLOW, "health"),
    "gpu_remapped_rows_total": (SLOW, "health"),
    "gpu_remapped_rows_pending": (SLOW, "health"),
    "gpu_remapped_rows_failed": (SLOW, "health"),
    "gpu_retired_pages_total": (SLOW, "health"),
    "gpu_retired_pages_pending": (SLOW, "health"),
    "gpu_pcie_link_generation": (SLOW_AND_ONCE, "pcie"),
    "gpu_pcie_link_width": (SLOW_AND_ONCE, "pcie"),
    "gpu_pcie_replay_errors_total": (SLOW, "pcie"),
    "gpu_encoder_utilization_ratio": (FAST, "media"),
    "gpu_decoder_utilization_ratio": (FAST, "media"),
    "gpu_compute_processes": (FAST, "processes"),
    "gpu_process_memory_used_bytes": (FAST, "processes"),
    "gpu_mig_mode_enabled": (SLOW, CORE),
    "gpu_xid_errors_total": (ON_EVENT, "xid"),
    "gpu_last_xid_timestamp_seconds": (ON_EVENT, "xid"),
    "gpu_pcie_throughput_bytes_per_second": ("every --interval, own thread", CORE),
    "gpu_leased": (AT_SCRAPE, CORE),
    "gpu_exporter_build_info": (ONCE, CORE),
    "gpu_exporter_choose_requests_total": (AT_SCRAPE, CORE),
    "gpu_exporter_lease_gpus_released_total": (AT_SCRAPE, CORE),
    "gpu_exporter_state_write_errors_total": (AT_SCRAPE, CORE),
    "gpu_exporter_requests_rejected_total": (AT_SCRAPE, CORE),
    "gpu_exporter_choose_waiters": (AT_SCRAPE, CORE),
    "gpu_exporter_web_config_reloads_total": (AT_SCRAPE, CORE),
    "gpu_exporter_web_config_last_reload_successful": (AT_SCRAPE, CORE),
    "gpu_pod_info": (KUBELET, CORE),
    "gpu_exporter_kubernetes_up": (KUBELET, CORE),
    "gpu_process_pod_info": (KUBELET + "; processes every sample", "processes"),
}

# Series one A100-like GPU has per group (process series: one per process, not counted).
_SERIES: dict[str, int] = {
    "power": 6,  # draw, energy, limit, default, min, max
    "temperature": 1 + 4 + 1,  # temperature, 4 thresholds, fan (absent on passive cards)
    "clocks": 4 + 4 + len(CLOCKS_EVENT_REASONS) + 1,  # clocks, max clocks, reasons, P-state
    "health": 3 + 4 + 2 + 2 + 2 + 1,  # modes, ECC, remapped rows (2 + 2), retired pages (2 + 1)
    "pcie": 2 + 2 + 1,
    "media": 2,
    "processes": 1,
    "xid": 0,
}


def updated(metric: str) -> str:
    """When ``metric``'s value is read: every sample, every --slow-interval, once …"""
    return METRICS.get(metric, (FAST, CORE))[0]


def group(metric: str) -> str:
    """The ``--collect.<group>`` of ``metric``; "" when it has none (always exported)."""
    return METRICS.get(metric, (FAST, CORE))[1]


def calls_per_gpu(group_name: str, when: str) -> int:
    """NVML calls one GPU costs for one group at one cadence (each field is one call)."""
    return len(groups.fields_of(group_name, when))


def groups_table(interval_seconds: float = 1.0, slow_interval_seconds: float = 30.0) -> str:
    """The README's table of collector groups and their cost per GPU, at the default
    intervals (calls a GPU answers with NOT_SUPPORTED are asked once, then never again)."""
    rows = [
        "| Group | Flag to turn it off | What | NVML calls per GPU per sample | "
        "per --slow-interval | once | per minute | Series per GPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    core = "the handle, memory, utilization, MIG mode, identity"
    for name, what in {"": core, **GROUPS}.items():
        fast, slow, once = (calls_per_gpu(name, when) for when in (FAST, SLOW, ONCE))
        if not name:  # and the handle every sample, the identity (UUID, name, bus id) once
            fast, once = fast + 1, once + 3
        per_minute = fast * 60 / interval_seconds + slow * 60 / slow_interval_seconds
        flag = f"`--no-collect.{name}`" if name else "— (always)"
        series = _SERIES.get(name, 0) if name else 4 + 2 + 1
        if name == "processes":
            series_text = "1, + 1 per process"
        elif name == "xid":
            series_text = "1 per Xid code seen, + 1"
        else:
            series_text = str(series)
        rows.append(
            f"| {name or 'core'} | {flag} | {what} | {fast} | {slow} | {once} "
            f"| {per_minute:g} | {series_text} |"
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(groups_table(), end="")
