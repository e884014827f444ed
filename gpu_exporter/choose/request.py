"""The parsed ``/choose`` and ``/cluster/choose`` requests, and their parsers, built from PARAMS.

Every parameter is read through its :class:`~gpu_exporter.choose.params.Param` in
:data:`~gpu_exporter.choose.params.PARAMS`: the server (:mod:`gpu_exporter.web.leaseapi`), the
client's local fallback (:mod:`gpu_exporter.client.local`) and the cluster chooser
(:mod:`gpu_exporter.fleet.placing`) all parse through :func:`parse_choose_args` /
:func:`parse_cluster_args`, so a value means the same everywhere and is refused with the same
message.

``args`` is anything with ``in``, ``[]``, ``.get`` and iteration — a plain ``dict`` of strings
or Werkzeug's ``MultiDict`` (whose ``getlist`` also catches repeated parameters). Every refusal
is an :class:`~gpu_exporter.choose.refusal.ApiError` carrying the HTTP status, a code and the
parameter.

>>> parse_choose_args({"n": "2", "min_free": "8GiB"}).filters.get("min_free")
8589934592
>>> parse_cluster_args({"n": "2", "spread": "1"}).spread
True

What "free" means unless a request says otherwise is the server's ``--choose-defaults``
(:mod:`gpu_exporter.choose.defaults`): filters applied per parameter when a request does not
give it, each shown in ``format=json`` with where it came from.

>>> defaults = {"max_util": "50%", "max_mem_used": "50%"}
>>> parse_choose_args({"max_util": "100%"}, defaults=defaults).filters_json()["max_util"]
{'value': 1.0, 'from': 'request'}

A memory lease (``mem=``) takes only the load defaults (``Param.mem_default``: utilization):
its memory is the admission rule's, and a card whose memory others use is where a share goes.

>>> sorted(parse_choose_args({"mem": "8GiB"}, defaults=defaults).filters_json())
['max_util', 'mem']
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeAlias

from gpu_exporter.choose.filters import Bound, Filters
from gpu_exporter.choose.params import (
    BY_NAME,
    CHOOSE_PARAMS,
    CLUSTER_PARAMS,
    DEFAULT_FLEET_MAX_AGE_SECONDS,
    DEFAULT_LEASE_SECONDS,
    MEM_DEFAULTS,
    MIG_LIST_FORMATS,
    PARAMS,
    Param,
    bad,
)
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.values import OfTotal

Args: TypeAlias = Mapping[str, str]
"""What the parsers read: a ``dict[str, str]`` or a Werkzeug ``MultiDict`` (a dict too)."""

NO_DEFAULTS: Mapping[str, str] = {}
# The filters the request carries itself, not in Filters: the order, the window, a memory
# lease. Every other filter is a limit (Param.limits) or the Filters field of its name.
REQUEST_FILTERS = ("sort", "idle_for", "mem")
_FIELDS = frozenset(f.name for f in fields(Filters)) - {"limits"}


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
            name: {"value": _shown(value), "from": source}
            for name, value, source in sorted(self.applied, key=lambda applied: applied[0])
        }

    pids: tuple[int, ...] = ()  # the job's processes, registered with its lease
    mem_bytes: int | None = None  # a memory lease of this much of each card (choose/memory.py)


def _shown(value: Any) -> Any:
    """A parsed value as JSON shows it: a tuple as a list, a share of the total as ``"25%"``."""
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, OfTotal):
        return f"{value.ratio * 100:g}%"
    return value


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
    # A memory lease shares a card with running jobs: of "free", only the load defaults apply.
    if "mem" in args:
        defaults = {k: t for k, t in defaults.items() if k in MEM_DEFAULTS}
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
    if v["mem"] is not None and v["mig"] != "deny":
        bad(
            "mig",
            "mem= leases a share of a whole card; a MIG device's memory is already its own "
            "partition: ask for mig=deny (the default), or a MIG device without mem=",
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
    filters = filters_of(
        **{p.name: v[p.name] for p in PARAMS if p.filter and p.choose},
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
        mem_bytes=v["mem"],
    )


def filters_of(**values: Any) -> Filters:
    """The :class:`Filters` of parsed values by parameter name (None: not given): each limit
    (:attr:`Param.limits <gpu_exporter.choose.params.Param.limits>`) a
    :class:`~gpu_exporter.choose.filters.Bound`, every other the field of its name; the
    request's own (:data:`REQUEST_FILTERS`) are passed over. TypeError for any other name.

    >>> from gpu_exporter.choose.values import OfTotal
    >>> filters_of(min_free=OfTotal(0.25), model="A100").limits[0].key
    'min_free_share'
    """
    bounds = []
    for param in PARAMS:
        value = values.pop(param.name, None) if param.limits else None
        if value is not None:
            share = isinstance(value, OfTotal)
            limit = next(limit for limit in param.limits if limit.unit.share == share)
            bounds.append(Bound(param.name, limit, value.ratio if share else value))
    for name in REQUEST_FILTERS:
        values.pop(name, None)
    if unknown := set(values) - _FIELDS:
        raise TypeError(f"no filter {', '.join(sorted(unknown))}")
    given = {name: value for name, value in values.items() if value is not None}
    return Filters(limits=tuple(bounds), **given)


def parse_cluster_args(args: Args, *, defaults: Mapping[str, str] = NO_DEFAULTS) -> ClusterRequest:
    """Validate ``/cluster/choose``'s query string: ``/choose``'s, plus spread and max_age."""
    req = parse_choose_args(
        args, allowed=CLUSTER_PARAMS, endpoint="/cluster/choose", defaults=defaults
    )
    spread = value_of(args, BY_NAME["spread"])
    if spread and req.format == "env":
        bad("format", "format=env names one host; with spread=1 ask for format=json or uuid")
    return ClusterRequest(req, spread=spread, max_age_seconds=value_of(args, BY_NAME["max_age"]))
