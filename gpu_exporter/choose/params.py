"""``/choose`` and ``/cluster/choose`` parameters: parsed and validated once, without Flask.

The server (:mod:`gpu_exporter.web.app`), the client's local fallback (:mod:`gpu_exporter.client`)
and the cluster chooser (:mod:`gpu_exporter.client.fleet`) all read parameters through
:func:`parse_choose_args`, so a value means the same everywhere and is refused with the same
message. ``args`` is anything with ``in``, ``[]``, ``.get`` and iteration — a plain ``dict``
of strings or Werkzeug's ``MultiDict`` (whose ``getlist`` also catches repeated parameters).

Every refusal is an :class:`ApiError` carrying the HTTP status, a code and the parameter.

>>> parse_choose_args({"n": "2", "min_free": "8GiB"}).filters.min_free_bytes
8589934592
>>> parse_cluster_args({"n": "2", "spread": "1"}).spread
True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, TypeAlias

from gpu_exporter.choose.rank import MIG_MODES, SORTS, Filters
from gpu_exporter.units import parse_bytes, parse_duration, parse_ratio

MAX_N = 1024
MAX_WAIT_SECONDS = 3600.0
DEFAULT_LEASE_SECONDS = 60.0
CHOOSE_PARAMS = (
    "n", "format", "lease", "owner", "wait", "idle_for", "sort",
    "min_free", "min_total", "max_util", "max_mem_util", "max_procs", "model", "include", "exclude",
    "mig",
)  # fmt: skip
CHOOSE_FORMATS = ("uuid", "index", "env", "json")
# /cluster/choose: every /choose parameter but mig (it hands out whole cards only), plus where
# the GPUs may be and how old the fleet's figures may be.
CLUSTER_PARAMS = (*(p for p in CHOOSE_PARAMS if p != "mig"), "spread", "max_age")
DEFAULT_FLEET_MAX_AGE_SECONDS = 60.0  # four missed scrapes at Prometheus' usual 15 s
MAX_FLEET_MAX_AGE_SECONDS = 3600.0
# Filters a host's /choose checks again, on its own fresh sample, when a cluster choice claims.
POINT_FILTERS = (
    "min_free", "min_total", "max_util", "max_mem_util", "max_procs", "model", "exclude",
)  # fmt: skip


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


def _duration(args: Args, name: str, maximum: float) -> float | None:
    value: float | None = parsed(args, name, parse_duration)
    if value is not None and value > maximum:
        bad(name, f"{name}: at most {maximum:g} s, got {args[name]!r}")
    return value


def _selectors(args: Args, name: str) -> tuple[str, ...]:
    selectors = tuple(s.strip() for s in args.get(name, "").split(",") if s.strip())
    for selector in selectors:
        if not (
            selector.isdigit() or selector.upper().startswith(("GPU-", "MIG-")) or ":" in selector
        ):
            bad(
                name,
                f"{name}: {selector!r} is not an NVML index, a UUID (GPU-…) or a PCI bus id",
            )
    return selectors


def parse_choose_args(
    args: Args, *, allowed: tuple[str, ...] = CHOOSE_PARAMS, endpoint: str = "/choose"
) -> ChooseRequest:
    """Validate ``/choose``'s query string strictly."""
    check_params(args, allowed, endpoint)
    raw_n = args.get("n", "1")
    if not raw_n.isdigit() or not 1 <= int(raw_n) <= MAX_N:
        bad("n", f"n must be a whole number from 1 to {MAX_N}, got {raw_n!r}")
    fmt = args.get("format", "uuid")
    if fmt not in CHOOSE_FORMATS:
        bad("format", f"format must be one of {', '.join(CHOOSE_FORMATS)}, got {fmt!r}")
    sort = args.get("sort", "free")
    if sort not in SORTS:
        bad("sort", f"sort must be one of {', '.join(SORTS)}, got {sort!r}")
    raw_procs = args.get("max_procs")
    if raw_procs is not None and not raw_procs.isdigit():
        bad("max_procs", f"max_procs must be a whole number (0 = no processes), got {raw_procs!r}")
    owner = args.get("owner")
    if owner is not None and (len(owner) > 64 or not owner.isprintable()):
        bad("owner", "owner must be at most 64 printable characters")
    model = args.get("model")
    if model is not None and not model.strip():
        bad("model", "model must not be empty")
    mig = args.get("mig", "deny")
    if mig not in MIG_MODES:
        bad("mig", f"mig must be one of {', '.join(MIG_MODES)}, got {mig!r}")
    if mig != "deny" and fmt == "index":
        bad(
            "format",
            "format=index cannot name MIG devices (CUDA takes their MIG-… UUID); "
            "use format=uuid or env",
        )
    lease = parsed(args, "lease", parse_duration)
    filters = Filters(
        min_free_bytes=parsed(args, "min_free", parse_bytes),
        max_util_ratio=parsed(args, "max_util", parse_ratio),
        exclude=_selectors(args, "exclude"),
        min_total_bytes=parsed(args, "min_total", parse_bytes),
        max_mem_util_ratio=parsed(args, "max_mem_util", parse_ratio),
        max_procs=None if raw_procs is None else int(raw_procs),
        model=model,
        include=_selectors(args, "include"),
        mig=mig,
    )
    return ChooseRequest(
        n=int(raw_n),
        format=fmt,
        filters=filters,
        sort=sort,
        lease_seconds=DEFAULT_LEASE_SECONDS if lease is None else lease,
        owner=owner,
        wait_seconds=_duration(args, "wait", MAX_WAIT_SECONDS) or 0.0,
        idle_for_seconds=_duration(args, "idle_for", MAX_WAIT_SECONDS),
    )


def parse_cluster_args(args: Args) -> ClusterRequest:
    """Validate ``/cluster/choose``'s query string: ``/choose``'s, plus spread and max_age."""
    req = parse_choose_args(args, allowed=CLUSTER_PARAMS, endpoint="/cluster/choose")
    raw_spread = args.get("spread", "0").strip().lower()
    if raw_spread not in ("0", "1", "false", "true"):
        bad("spread", f"spread must be 0 or 1, got {raw_spread!r}")
    spread = raw_spread in ("1", "true")
    if spread and req.format == "env":
        bad("format", "format=env names one host; with spread=1 ask for format=json or uuid")
    max_age = _duration(args, "max_age", MAX_FLEET_MAX_AGE_SECONDS)
    if max_age is not None and max_age <= 0:
        bad("max_age", "max_age must be more than 0")
    return ClusterRequest(
        req,
        spread=spread,
        max_age_seconds=DEFAULT_FLEET_MAX_AGE_SECONDS if max_age is None else max_age,
    )
