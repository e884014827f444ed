"""``/choose`` and ``/cluster/choose`` parameters: each described once, parsed once, without Flask.

:data:`PARAMS` is the one list of them. Each :class:`Param` carries its name, its reader
(:mod:`gpu_exporter.choose.values`), its help text and its JSON schema, and says where it
applies. Everything else is built from it:

* the server's parser, :func:`parse_choose_args` / :func:`parse_cluster_args`, which the
  server (:mod:`gpu_exporter.web.app`), the client's local fallback
  (:mod:`gpu_exporter.client.local`) and the cluster chooser (:mod:`gpu_exporter.client.fleet`)
  all read parameters through, so a value means the same everywhere and is refused with the
  same message;
* the OpenAPI document's parameter lists (:mod:`gpu_exporter.web.openapi`);
* the filter flags of ``gpu-exporter choose`` and ``run`` (:mod:`gpu_exporter.client.cli`),
  the filters choosing locally can apply (:data:`LOCAL_FILTERS`) and those a host checks again
  when a cluster choice claims there (:data:`POINT_FILTERS`).

``args`` is anything with ``in``, ``[]``, ``.get`` and iteration — a plain ``dict`` of strings
or Werkzeug's ``MultiDict`` (whose ``getlist`` also catches repeated parameters). Every refusal
is an :class:`ApiError` carrying the HTTP status, a code and the parameter.

>>> parse_choose_args({"n": "2", "min_free": "8GiB"}).filters.min_free_bytes
8589934592
>>> parse_cluster_args({"n": "2", "spread": "1"}).spread
True

What "free" means unless a request says otherwise is the server's ``--choose-defaults``
(:mod:`gpu_exporter.choose.defaults`): filters applied per parameter when a request does not
give it, each shown in ``format=json`` with where it came from.

>>> defaults = {"max_util": "50%", "max_mem_util": "50%"}
>>> parse_choose_args({"max_util": "100%"}, defaults=defaults).filters_json()["max_util"]
{'value': 1.0, 'from': 'request'}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, TypeAlias

from gpu_exporter.choose.rank import MIG_MODES, SORTS, Filters
from gpu_exporter.choose.values import (
    Reader,
    flag,
    label,
    not_empty,
    one_of,
    pid_list,
    positive,
    process_count,
    selectors,
    units,
    whole_number,
)
from gpu_exporter.units import parse_bytes, parse_duration, parse_ratio

MAX_N = 1024
MAX_WAIT_SECONDS = 3600.0
DEFAULT_LEASE_SECONDS = 60.0
CHOOSE_FORMATS = ("uuid", "index", "env", "json", "list")
# The formats that can name several MIG devices: a CUDA process can use only one MIG device
# (NVIDIA's MIG user guide), so several never go into one CUDA_VISIBLE_DEVICES.
MIG_LIST_FORMATS = ("list", "json")
DEFAULT_FLEET_MAX_AGE_SECONDS = 60.0  # four missed scrapes at Prometheus' usual 15 s
MAX_FLEET_MAX_AGE_SECONDS = 3600.0
MAX_OWNER_CHARS = 64
MAX_PIDS = 64  # per request; leases.MAX_PIDS caps a lease

Args: TypeAlias = Mapping[str, str]
"""What the parsers read: a ``dict[str, str]`` or a Werkzeug ``MultiDict`` (a dict too)."""


@dataclass
class ApiError(Exception):
    status: int
    code: str
    message: str
    param: str | None = None

    def __str__(self) -> str:
        return self.message


def bad(param: str, message: str) -> NoReturn:
    raise ApiError(400, "invalid_parameter", message, param)


# -- the parameters ---------------------------------------------------------------------------

DURATION_SCHEMA: Mapping[str, Any] = {
    "type": "string",
    "pattern": r"^\s*[0-9]+(\.[0-9]+)?\s*(ms|s|m|h)?\s*$",
}
_SIZE = {"type": "string", "examples": ["8GiB", "500MB", "1073741824"]}
_RATIO = {"type": "string", "examples": ["0.3", "30%"]}
_SELECTORS = {"type": "string", "examples": ["0,GPU-5a1e", "00000000:3B:00.0"]}


@dataclass(frozen=True, slots=True)
class Param:
    """One query parameter: what it is called, how it is read, and what to tell people."""

    name: str
    parse: Reader  # (name, text) → value; ValueError with the message
    help: str  # the OpenAPI description
    schema: Mapping[str, Any]  # its JSON schema in the OpenAPI document
    default: Any = None  # the parsed value when it is not given
    filter: bool = False  # narrows or orders the GPUs; the client passes it on by name
    flag: tuple[str, str] | None = None  # (metavar, help) of its `gpu-exporter choose` flag
    local: bool = False  # choosing from this host's NVML (no exporter) can apply it
    recheck: bool = False  # a host checks it again, on its own sample, when a cluster claims
    choose: bool = True  # /choose takes it
    cluster: bool = True  # /cluster/choose takes it
    cluster_help: str | None = None  # its OpenAPI description there, where it differs

    @property
    def option(self) -> str:
        """The command-line flag: ``--min-free`` for ``min_free``."""
        return "--" + self.name.replace("_", "-")


PARAMS: tuple[Param, ...] = (
    Param(
        "n",
        whole_number(1, MAX_N),
        "How many GPUs (1-1024).",
        {"type": "integer", "minimum": 1, "maximum": MAX_N},
        default=1,
    ),
    Param(
        "format",
        one_of(CHOOSE_FORMATS),
        "uuid (default): GPU-a,GPU-b; index: 0,1; env: an export line for eval; json: the "
        "ranking with figures, reasons and the filters applied; list: one UUID per line (for "
        "launchers that start a process per device, as several MIG devices need).",
        {"type": "string", "enum": list(CHOOSE_FORMATS)},
        default="uuid",
        cluster_help="uuid (default): 'HOST GPU-a,GPU-b' per host; index: 'HOST 0,1'; env: an "
        "export line with GPU_HOST and GPU_EXPORTER_URL (one host only); json; list: "
        "'HOST GPU-a' per line.",
    ),
    Param(
        "lease",
        units(parse_duration),
        "Claim the GPUs for this long (default 60s); 0 = advice only.",
        DURATION_SCHEMA,
        default=DEFAULT_LEASE_SECONDS,
    ),
    Param(
        "owner",
        label(MAX_OWNER_CHARS),
        "A label shown in /leases.",
        {"type": "string", "maxLength": MAX_OWNER_CHARS},
    ),
    Param(
        "wait",
        units(parse_duration, MAX_WAIT_SECONDS),
        "Wait up to this long (at most 1h) for enough GPUs, first come first served.",
        DURATION_SCHEMA,
        default=0.0,
        cluster_help="Read the fleet again every 5 s for up to this long (at most 1h) until "
        "enough GPUs qualify; no first-come-first-served order across the fleet.",
    ),
    Param(
        "idle_for",
        units(parse_duration, MAX_WAIT_SECONDS),
        "Every sample of this window must meet the filters.",
        DURATION_SCHEMA,
        filter=True,
        flag=("DURATION", "only GPUs that have been idle at least this long: 5m"),
        cluster_help="Every GPU must have met the filters throughout this window, by "
        "Prometheus' range functions (max_over_time, min_over_time).",
    ),
    Param(
        "sort",
        one_of(SORTS),
        "Ranking order.",
        {"type": "string", "enum": list(SORTS)},
        default="free",
        filter=True,
        flag=("ORDER", "ranking: free (default), free_ratio, util, power or pack"),
        local=True,
    ),
    Param(
        "min_free",
        units(parse_bytes),
        "Free memory at least this.",
        _SIZE,
        filter=True,
        flag=("SIZE", "free memory at least this: 8GiB, 500MB (8G means GiB)"),
        local=True,
        recheck=True,
    ),
    Param(
        "min_total",
        units(parse_bytes),
        "Total memory at least this.",
        _SIZE,
        filter=True,
        flag=("SIZE", "total memory at least this"),
        local=True,
        recheck=True,
    ),
    Param(
        "max_util",
        units(parse_ratio),
        "GPU utilization at most this (unless given: the exporter's --choose-defaults, shipped "
        "50%; 100% turns it off).",
        _RATIO,
        filter=True,
        flag=("RATIO", "utilization at most this: 0.1 or 10% (default 50%; 100% for any)"),
        local=True,
        recheck=True,
    ),
    Param(
        "max_mem_util",
        units(parse_ratio),
        "Memory-controller utilization at most this (unless given: the exporter's "
        "--choose-defaults, shipped 50%; 100% turns it off).",
        _RATIO,
        filter=True,
        flag=("RATIO", "memory-bandwidth utilization at most this (default 50%; 100% for any)"),
        local=True,
        recheck=True,
    ),
    Param(
        "max_procs",
        process_count,
        "At most this many compute processes.",
        {"type": "integer", "minimum": 0},
        filter=True,
        flag=("N", "at most N compute processes already on the GPU"),
        local=True,
        recheck=True,
    ),
    Param(
        "model",
        not_empty,
        "The GPU name contains this (case-insensitive).",
        {"type": "string"},
        filter=True,
        flag=("NAME", "only this GPU model (as /choose's model parameter matches it)"),
        local=True,
        recheck=True,
    ),
    Param(
        "include",
        selectors,
        "Only these GPUs: indices, UUIDs or prefixes, PCI bus ids.",
        _SELECTORS,
        default=(),
        filter=True,
        flag=("GPUS", "only these GPUs: NVML indices, UUIDs or prefixes, PCI bus ids"),
        local=True,
    ),
    Param(
        "exclude",
        selectors,
        "Never these GPUs: indices, UUIDs or prefixes, PCI bus ids.",
        _SELECTORS,
        default=(),
        filter=True,
        flag=("GPUS", "never these GPUs: NVML indices, UUIDs or prefixes, PCI bus ids"),
        local=True,
        recheck=True,
    ),
    Param(
        "mig",
        one_of(MIG_MODES),
        "MIG devices: deny (default, whole cards only), allow (whole cards or MIG devices, "
        "never both in one answer: the best-ranked kind that has n) or only (MIG devices "
        "only). A MIG device is returned as its MIG-… UUID. A CUDA process can use only one "
        "MIG device, so n>1 MIG devices need format=list or json (else 400 mig_single_device).",
        {"type": "string", "enum": list(MIG_MODES)},
        default="deny",
        filter=True,
        cluster=False,  # /cluster/choose hands out whole cards only
    ),
    Param(
        "pid",
        pid_list(MAX_PIDS),
        "The job's process ids (comma-separated), as this host's /proc shows them: the lease "
        "ends early on a GPU only when one of them, a descendant or a process in the same "
        "cgroup (Slurm job, container, pod) shows up there. More can be added with "
        "POST /leases/<id>/pids.",
        {"type": "string", "pattern": r"^\s*[0-9]+(\s*,\s*[0-9]+)*\s*$", "examples": ["4242"]},
        default=(),
        cluster=False,  # a PID means something on one host only
    ),
    # /cluster/choose only: where the GPUs may be, and how old the fleet's figures may be.
    Param(
        "spread",
        flag,
        "0 (default): all n GPUs on one host; 1: several hosts may share them.",
        {"type": "string", "enum": ["0", "1", "true", "false"]},
        default=False,
        choose=False,
    ),
    Param(
        "max_age",
        positive(units(parse_duration, MAX_FLEET_MAX_AGE_SECONDS)),
        "Fleet figures older than this (default 60s) are never used to hand out GPUs.",
        DURATION_SCHEMA,
        default=DEFAULT_FLEET_MAX_AGE_SECONDS,
        choose=False,
    ),
)
BY_NAME: Mapping[str, Param] = {p.name: p for p in PARAMS}
CHOOSE_PARAMS = tuple(p.name for p in PARAMS if p.choose)
CLUSTER_PARAMS = tuple(p.name for p in PARAMS if p.cluster)
LOCAL_FILTERS = tuple(p.name for p in PARAMS if p.local)
POINT_FILTERS = tuple(p.name for p in PARAMS if p.recheck)
# What --choose-defaults may set: the filters /choose takes.
DEFAULTABLE = tuple(p.name for p in PARAMS if p.filter and p.choose)
NO_DEFAULTS: Mapping[str, str] = {}


# -- parsing -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChooseRequest:
    n: int
    format: str
    filters: Filters
    sort: str = "free"
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    owner: str | None = None
    wait_seconds: float = 0.0
    idle_for_seconds: float | None = None
    # The filters given, by name, with their parsed value and where each came from:
    # (name, value, "request" or "default"), in PARAMS order.
    applied: tuple[tuple[str, Any, str], ...] = ()

    def filters_json(self) -> dict[str, dict[str, Any]]:
        """``format=json``'s ``filters``: ``{"max_util": {"value": 0.5, "from": "default"}}``."""
        return {
            name: {"value": list(value) if isinstance(value, tuple) else value, "from": source}
            for name, value, source in sorted(self.applied)
        }

    pids: tuple[int, ...] = ()  # the job's processes, registered with its lease


@dataclass(frozen=True, slots=True)
class ClusterRequest:
    choose: ChooseRequest
    spread: bool = False  # False: all n GPUs on one host
    max_age_seconds: float = DEFAULT_FLEET_MAX_AGE_SECONDS


def check_params(args: Args, allowed: tuple[str, ...], endpoint: str) -> None:
    """Unknown or repeated query parameters are errors, never silently ignored."""
    getlist = getattr(args, "getlist", None)
    for name in args:
        if name not in allowed:
            takes = ", ".join(allowed) if allowed else "no parameters"
            raise ApiError(
                400,
                "unknown_parameter",
                f"unknown parameter {name!r}; {endpoint} takes {takes}",
                name,
            )
        if getlist is not None and len(getlist(name)) > 1:
            bad(name, f"{name} given more than once")


def parsed(args: Args, name: str, parse: Any) -> Any:
    """``parse(args[name])``, None when absent; a ValueError becomes a 400 naming ``name``."""
    if name not in args:
        return None
    try:
        return parse(args[name])
    except ValueError as exc:
        bad(name, f"{name}: {exc}")


def value_of(args: Args, param: Param) -> Any:
    """``param`` read from ``args``: parsed when given, its default when not."""
    if param.name not in args:
        return param.default
    try:
        return param.parse(param.name, args[param.name])
    except ValueError as exc:
        bad(param.name, str(exc))


def parse_choose_args(
    args: Args,
    *,
    allowed: tuple[str, ...] = CHOOSE_PARAMS,
    endpoint: str = "/choose",
    defaults: Mapping[str, str] = NO_DEFAULTS,
    max_idle_for_seconds: float | None = None,
) -> ChooseRequest:
    """Validate ``/choose``'s query string strictly, parameter by parameter in table order.

    ``defaults`` (:func:`gpu_exporter.choose.defaults.parse_defaults`) fill in the filters
    ``args`` does not give.
    ``max_idle_for_seconds`` is how far back the server's history reaches: a longer
    ``idle_for`` could never be met, so it is refused.
    """
    check_params(args, allowed, endpoint)
    merged: dict[str, str] = {k: t for k, t in defaults.items() if k in allowed and k not in args}
    merged.update((k, args[k]) for k in args)
    v = {p.name: value_of(merged, p) for p in PARAMS if p.choose}
    if v["mig"] != "deny" and v["format"] == "index":
        bad(
            "format",
            "format=index cannot name MIG devices (CUDA takes their MIG-… UUID); "
            "use format=uuid, env or list",
        )
    if v["mig"] == "only" and v["n"] > 1 and v["format"] not in MIG_LIST_FORMATS:
        raise ApiError(
            400,
            "mig_single_device",
            f"a CUDA process can use only one MIG device (NVIDIA's MIG user guide), so "
            f"n={v['n']} MIG devices cannot share one CUDA_VISIBLE_DEVICES; ask for "
            "format=list (one MIG-… UUID per line, to start a process on each) or "
            "format=json, or n=1",
            "n",
        )
    idle_for, most = v["idle_for"], max_idle_for_seconds
    if idle_for is not None and most is not None and idle_for > most:
        bad(
            "idle_for",
            f"idle_for {idle_for:g} s is longer than the {most:g} s of history this exporter "
            "keeps (its samples × --interval), so it could never be met; ask for "
            f"idle_for={most:g}s or less",
        )
    defaulted = tuple(k for k in merged if k not in args)
    filters = Filters(
        min_free_bytes=v["min_free"],
        max_util_ratio=v["max_util"],
        exclude=v["exclude"],
        min_total_bytes=v["min_total"],
        max_mem_util_ratio=v["max_mem_util"],
        max_procs=v["max_procs"],
        model=v["model"],
        include=v["include"],
        mig=v["mig"],
        # mig=allow: several MIG devices only where the format gives each its own line.
        max_mig_devices=1 if v["mig"] == "allow" and v["format"] not in MIG_LIST_FORMATS else None,
        defaulted=defaulted,
    )
    applied = tuple(
        (p.name, v[p.name], "default" if p.name in defaulted else "request")
        for p in PARAMS
        if p.filter and p.name in merged
    )
    return ChooseRequest(
        n=v["n"],
        format=v["format"],
        filters=filters,
        sort=v["sort"],
        lease_seconds=v["lease"],
        owner=v["owner"],
        wait_seconds=v["wait"],
        idle_for_seconds=v["idle_for"],
        applied=applied,
        pids=v["pid"],
    )


def parse_cluster_args(args: Args, *, defaults: Mapping[str, str] = NO_DEFAULTS) -> ClusterRequest:
    """Validate ``/cluster/choose``'s query string: ``/choose``'s, plus spread and max_age."""
    req = parse_choose_args(
        args, allowed=CLUSTER_PARAMS, endpoint="/cluster/choose", defaults=defaults
    )
    spread = value_of(args, BY_NAME["spread"])
    if spread and req.format == "env":
        bad("format", "format=env names one host; with spread=1 ask for format=json or uuid")
    return ClusterRequest(req, spread=spread, max_age_seconds=value_of(args, BY_NAME["max_age"]))
