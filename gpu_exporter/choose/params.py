"""``/choose`` and ``/cluster/choose`` parameters: each described once, without Flask.

:data:`PARAMS` is the one list of them. Each :class:`Param` carries its name, its reader
(:mod:`gpu_exporter.choose.values`), its help text and its JSON schema, says where it
applies and, for a numeric limit, its predicate on a GPU
(:class:`~gpu_exporter.choose.filters.Limit`). Everything else is built from it:

* the parsers, :func:`~gpu_exporter.choose.request.parse_choose_args` and
  :func:`~gpu_exporter.choose.request.parse_cluster_args` (:mod:`gpu_exporter.choose.request`),
  which the server, the client's local fallback and the cluster chooser all read parameters
  through;
* the OpenAPI document's parameter lists (:mod:`gpu_exporter.web.openapi`);
* the filter flags of ``gpu-exporter choose`` and ``run`` (:mod:`gpu_exporter.client.commands`),
  the filters choosing locally can apply (:data:`LOCAL_FILTERS`) and those a host checks again
  when a cluster choice claims there (:data:`POINT_FILTERS`);
* from a limit's row: the check and its refusal (:mod:`gpu_exporter.choose.filters`), and the
  fleet's PromQL, its reading of the store and its count of reasons (:mod:`gpu_exporter.fleet`).

Every refusal is a :class:`~gpu_exporter.choose.refusal.ApiError` carrying the HTTP status,
a code and the parameter.

>>> BY_NAME["min_free"].option
'--min-free'
>>> "pid" in CLUSTER_PARAMS, "spread" in CHOOSE_PARAMS
(False, False)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from gpu_exporter.choose.filters import (
    BYTES,
    COUNT,
    MIG_MODES,
    RATIO,
    SHARE,
    Fallback,
    Limit,
    usable_memory,
)
from gpu_exporter.choose.memory import CUDA_CONTEXT_BYTES, MEM_ENV_NAMES
from gpu_exporter.choose.rank import SORTS
from gpu_exporter.choose.refusal import ApiError
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
    size_or_share,
    units,
    whole_number,
)
from gpu_exporter.units import format_bytes, parse_bytes, parse_duration, parse_ratio, shown

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


def bad(param: str, message: str) -> NoReturn:
    raise ApiError(400, "invalid_parameter", message, param)


CONTEXT = f"a {CUDA_CONTEXT_BYTES // 2**20} MiB allowance for the CUDA context"


def lease_size(name: str, text: str) -> int:
    """A memory lease's size: more than the CUDA context allowance, which a job spends
    before it allocates anything."""
    value: int = units(parse_bytes)(name, text)
    if value <= CUDA_CONTEXT_BYTES:
        raise ValueError(
            f"{name} must be more than {format_bytes(CUDA_CONTEXT_BYTES)} (a CUDA context alone "
            f"takes about that), got {shown(text)}"
        )
    return value


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
    defaultable: bool = True  # a filter --choose-defaults may set
    # Its --choose-defaults value applies to mem= requests too: load, not memory (a memory
    # lease's memory is the admission rule's, choose/memory.py).
    mem_default: bool = False
    # A numeric limit on one of a GPU's figures: its predicate, from which the check, its
    # refusal and the fleet's PromQL are derived (choose/filters.py's Limit). A size
    # parameter may also take a share of the total (25%): its SHARE limit then applies.
    limits: tuple[Limit, ...] = ()

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
        flag=("ORDER", "ranking: free (default), free_ratio, util, sm_active, power or pack"),
        local=True,
    ),
    Param(
        "min_free",
        size_or_share(parse_bytes),
        "Free memory at least this: a size (8GiB), or a share of the card's total (25%).",
        {"type": "string", "examples": ["8GiB", "500MB", "25%"]},
        filter=True,
        flag=("SIZE", "free memory at least this: 8GiB, 500MB (8G means GiB), or 25% of total"),
        local=True,
        recheck=True,
        limits=(
            Limit(
                "free memory",
                "memory_free_bytes",
                BYTES,
                most=False,
                reports="memory",
                ceiling=("usable memory", usable_memory),
            ),
            Limit("free memory", "memory_free_bytes", SHARE, most=False, of_total=True),
        ),
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
        limits=(Limit("total memory", "memory_total_bytes", BYTES, most=False, fixed=True),),
    ),
    Param(
        "max_util",
        units(parse_ratio),
        "GPU utilization at most this (unless given: the exporter's --choose-defaults, shipped "
        "50%, also for mem= requests; 100% turns it off).",
        _RATIO,
        filter=True,
        flag=("RATIO", "utilization at most this: 0.1 or 10% (default 50%; 100% for any)"),
        local=True,
        recheck=True,
        mem_default=True,
        limits=(Limit("utilization", "utilization_ratio", RATIO, reports="utilization"),),
    ),
    Param(
        "max_mem_used",
        units(parse_ratio),
        "Memory in use (used ÷ total, as nvidia-smi shows it) at most this share of the card "
        "(unless given: the exporter's --choose-defaults, shipped 50%; 100% turns it off). "
        "Not applied by default to mem= requests, which the memory admission rule governs.",
        _RATIO,
        filter=True,
        flag=("RATIO", "memory in use at most this share of the card (default 50%; 100% for any)"),
        local=True,
        recheck=True,
        limits=(Limit("memory used", "memory_used_bytes", RATIO, of_total=True, reports="memory"),),
    ),
    Param(
        "max_mem_util",
        units(parse_ratio),
        "Memory-controller (bandwidth) utilization at most this; not among the shipped "
        "--choose-defaults.",
        _RATIO,
        filter=True,
        flag=("RATIO", "memory-bandwidth utilization at most this"),
        local=True,
        recheck=True,
        mem_default=True,
        limits=(
            Limit("memory utilization", "memory_utilization_ratio", RATIO, reports="utilization"),
        ),
    ),
    Param(
        "max_sm_active",
        units(parse_ratio),
        "SM activity (GPM: the share of SMs busy, Hopper and later) at most this; on a card "
        "without GPM, its utilization, which is never below it. Not among the shipped "
        "--choose-defaults.",
        _RATIO,
        filter=True,
        flag=("RATIO", "SM activity at most this (utilization where a card has no GPM)"),
        local=True,
        recheck=True,
        mem_default=True,
        limits=(
            Limit(
                "SM activity",
                "sm_active_ratio",
                RATIO,
                fallback=Fallback("utilization_ratio", "utilization", "GPM"),
            ),
        ),
        cluster_help="SM activity (gpu_sm_active_ratio, GPM: Hopper and later) at most this; "
        "on a card without that series, its utilization (gpu_utilization_ratio). Checked again "
        "by the chosen host on its own sample.",
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
        limits=(Limit("compute processes", "compute_processes", COUNT, reports="processes"),),
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
        "mem",
        lease_size,
        "A memory lease: this much of each card (8GiB, 8G = GiB, 8192MiB), on cards shared with "
        "other memory leases, never on a card leased whole; admitted while the card's committed "
        "memory (in use by others + each memory lease's max(reserved, used)) + mem + the "
        "exporter's --mem-headroom fits its total less the driver's reservation; best fit "
        "first. Whole cards only (MIG devices refused). Of the --choose-defaults only the load "
        "filters apply (max_util, max_mem_util); memory is the admission rule's. "
        f"format=env adds {', '.join(MEM_ENV_NAMES)} (the share less {CONTEXT}, over the "
        "card's total: TF_FORCE_GPU_ALLOW_GROWTH is growth, not a cap).",
        _SIZE,
        filter=True,
        flag=("SIZE", "a memory lease: this much of each card, shared with other such jobs"),
        recheck=True,  # passed on to the host a cluster choice claims on, which admits it
        defaultable=False,
        cluster_help="A memory lease of this much of each card, passed on to the chosen host's "
        "/choose, which admits it by its own committed memory (the fleet's figures do not know "
        "the hosts' memory leases).",
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
LIMITS: tuple[Limit, ...] = tuple(limit for p in PARAMS for limit in p.limits)
CHOOSE_PARAMS = tuple(p.name for p in PARAMS if p.choose)
CLUSTER_PARAMS = tuple(p.name for p in PARAMS if p.cluster)
LOCAL_FILTERS = tuple(p.name for p in PARAMS if p.local)
POINT_FILTERS = tuple(p.name for p in PARAMS if p.recheck)
# What --choose-defaults may set: the filters /choose takes.
DEFAULTABLE = tuple(p.name for p in PARAMS if p.filter and p.choose and p.defaultable)
# Of those, what applies to a memory lease (mem=) too.
MEM_DEFAULTS = tuple(p.name for p in PARAMS if p.mem_default)
