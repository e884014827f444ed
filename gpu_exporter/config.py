"""What ``gpu-exporter serve`` runs with: one frozen :class:`ServeConfig`, from flags or tests.

Every value has the default the command line has, so a test states only what it changes:
``ServeConfig(simulate="4", state_dir=str(tmp_path))``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gpu_exporter.model import PROCESS_LABELS

DEFAULT_PORT = 9400
DEFAULT_LISTEN = f":{DEFAULT_PORT}"
# What "free" means when a /choose names no filter: GPUtil's getAvailable (under 50 % load and
# 50 % memory). See gpu_exporter.choose.defaults.
DEFAULT_CHOOSE_DEFAULTS = "max_util=50%&max_mem_used=50%"
DEFAULT_PROCESS_SERIES_LIMIT = 64  # --process-series-limit: per device, largest first
DEFAULT_KUBELET_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"  # --kubernetes
# --metric-names: gpu-exporter's own names, dcgm-exporter's (docs/dcgm-compat.md), or both.
METRIC_NAMES = ("gpu-exporter", "dcgm", "both")
# The app's own paths (tests/test_logs.py checks them against its routes): the metrics can
# be served at neither these nor a prefix of them (the dispatcher takes every path below).
APP_PATHS = (
    *("/", "/choose", "/cluster/choose", "/leases", "/gpus", "/healthz", "/readyz"),
    *("/openapi.json", "/static"),
)


@dataclass(frozen=True, slots=True)
class ServeConfig:
    host: str = ""  # "" means every interface
    port: int = DEFAULT_PORT
    interval_seconds: float = 1.0
    simulate: str | None = None  # a GPU count or a scenario file: simulated GPUs, no driver
    log_level: str = "info"
    max_age_seconds: float = 10.0
    state_dir: str | None = None  # None: leases are not kept across restarts
    discard_leases: bool = False  # start without the leases (and withheld GPUs) in the state dir
    max_lease_seconds: float = 3600.0
    max_gpus_per_requester: int = 0  # 0: no limit
    mem_headroom_bytes: int = 512 * 2**20  # kept free on a card memory leases share
    process_labels: tuple[str, ...] = ()  # opt-in attribution of GPU processes
    process_series_limit: int = DEFAULT_PROCESS_SERIES_LIMIT
    proc_root: str = "/proc"
    pcie_throughput: bool = False
    xid_events: bool = True
    nvml_timeout_seconds: float = 5.0
    max_requests_in_flight: int = 32
    max_waiters: int = 8
    prometheus_url: str | None = None  # serves /cluster/choose from this Prometheus
    prometheus_selector: str = ""  # label matchers narrowing /cluster/choose's fleet
    web_config_file: str | None = None  # TLS, basic auth, headers (exporter-toolkit format)
    auth_scope: str = "all"  # "all", or "writes": only lease-taking requests need credentials
    # What "free" means when a /choose names no filter (query syntax; "" for none).
    choose_defaults: str = DEFAULT_CHOOSE_DEFAULTS
    lease_admins: tuple[str, ...] = ()  # basic-auth users who may renew/release any lease by id
    max_waiters_per_requester: int = 2  # waiting /choose requests per requester; 0: any
    telemetry_path: str = "/metrics"  # where /metrics is served (only there)
    log_format: str = "logfmt"  # or "json" (gpu_exporter.logs)
    # Health fields (collect.groups.SLOW) are read this often; the fast ones every interval.
    slow_interval_seconds: float = 30.0
    # GPM (collect/gpm.py) is read this often per device, its metrics over that interval.
    gpm_interval_seconds: float = 5.0
    # --no-collect.<group>: not read, not exported (collect.groups.OFF_BY_DEFAULT unless asked)
    collect_disabled: tuple[str, ...] = ("nvlink",)
    # --kubernetes: the kubelet's PodResources socket (None: off), asked every poll interval
    kubernetes_socket: str | None = None
    kubernetes_poll_seconds: float = 10.0
    metric_names: str = METRIC_NAMES[0]  # one of METRIC_NAMES


def parse_listen_address(text: str) -> tuple[str, int]:
    """``":9400"``, ``"127.0.0.1:9400"``, ``"[::1]:9400"`` → (host, port); host "" = all.

    >>> parse_listen_address(":9400"), parse_listen_address("[::1]:80")
    (('', 9400), ('::1', 80))
    """
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT such as :9400 or 127.0.0.1:9400, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def parse_telemetry_path(text: str) -> str:
    """``--web.telemetry-path``: an absolute path of its own, e.g. ``/prometheus/metrics``.

    >>> parse_telemetry_path("/gpu/metrics")
    '/gpu/metrics'
    >>> parse_telemetry_path("/leases")
    Traceback (most recent call last):
    ValueError: '/leases' is taken by the exporter's /leases; choose another path
    """
    path = text.strip()
    if not path.startswith("/") or path == "/" or path.endswith("/"):
        raise ValueError(f"expected a path such as /metrics, got {text!r}")
    if not path.isascii() or not path.isprintable() or any(c in path for c in " ?#%"):
        raise ValueError(f"expected a plain ASCII path without spaces, ? # or %, got {text!r}")
    for taken in APP_PATHS[1:]:  # every path is below "/": only "/" itself is refused
        if taken == path or taken.startswith(path + "/") or path.startswith(taken + "/"):
            raise ValueError(f"{path!r} is taken by the exporter's {taken}; choose another path")
    return path


def parse_process_labels(text: str) -> tuple[str, ...]:
    """``--process-labels``' value → the labels, in their fixed order.

    >>> parse_process_labels("command,user")
    ('user', 'command')
    """
    wanted = {part.strip() for part in text.split(",") if part.strip()}
    unknown = wanted - set(PROCESS_LABELS)
    if unknown:
        raise ValueError(
            f"unknown process labels {', '.join(sorted(unknown))}; "
            f"choose from {', '.join(PROCESS_LABELS)}"
        )
    return tuple(label for label in PROCESS_LABELS if label in wanted)


def parse_user_list(text: str) -> tuple[str, ...]:
    """``--lease-admins``' value → the user names, without blanks or repeats.

    >>> parse_user_list("alice, bob,,alice")
    ('alice', 'bob')
    """
    names = [part.strip() for part in text.split(",") if part.strip()]
    return tuple(dict.fromkeys(names))


def default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return os.path.join(base, "gpu-exporter")
