"""The lease API: ``/choose`` (GET and POST), ``/cluster/choose`` and ``/leases``.

Parsing is :mod:`gpu_exporter.choose.request`'s, claiming and waiting
:class:`~gpu_exporter.choose.claim.Claimer`'s; the views here only turn their results into
text or JSON. Refusals are raised and answered by :mod:`gpu_exporter.web.errors`.

A claim's answer carries the lease's token (``X-GPU-Lease``, ``GPU_LEASE``, ``lease.token``);
nothing else ever shows it. Every route that changes a lease goes through :func:`authorized`.
A HEAD never claims: every route that claims reads its parameters through
:func:`claim_params`, which makes a HEAD advice (``lease=0``).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify, request
from werkzeug.datastructures import MultiDict

from gpu_exporter.choose.lease import Lease
from gpu_exporter.choose.memory import MEM_FRACTION_ENV, env_caps, usage_json
from gpu_exporter.choose.params import BY_NAME, DEFAULT_LEASE_SECONDS, bad
from gpu_exporter.choose.rank import Rejected, Selection, score
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.request import (
    check_params,
    parse_choose_args,
    parse_cluster_args,
    parsed,
    value_of,
)
from gpu_exporter.choose.tokens import (
    IDEMPOTENCY_HEADER,
    ClaimKey,
    parse_idempotency_key,
    request_hash,
)
from gpu_exporter.model import all_devices
from gpu_exporter.units import parse_duration
from gpu_exporter.web import peers
from gpu_exporter.web.auth import is_anonymous
from gpu_exporter.web.gateway import CONNECTED
from gpu_exporter.web.services import services

api = Blueprint("api", __name__)


def _rejected_json(r: Rejected) -> dict[str, Any]:
    return {"index": r.gpu.index, "uuid": r.gpu.uuid, "reasons": list(r.reasons)}


def mem_caps(choice: Selection, mem: int | None) -> dict[str, str]:
    """The framework caps of a memory lease (``{}`` for whole cards)."""
    if mem is None:
        return {}
    return env_caps(mem, (g.memory_total_bytes or 0 for g in choice.chosen))


def choice_text(choice: Selection, lease: Lease | None, fmt: str, mem: int | None = None) -> str:
    """The text formats of a successful ``/choose``, newline-terminated."""
    uuids = ",".join(g.uuid for g in choice.chosen)
    if fmt == "index":
        return ",".join(str(g.index) for g in choice.chosen) + "\n"
    if fmt == "list":  # one device per line: a process each (several MIG devices need it)
        return "".join(g.uuid + "\n" for g in choice.chosen)
    if fmt == "env":
        line = f"export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={uuids}"
        line += f" GPU_LEASE={lease.token or lease.id}" if lease else ""
        line += "".join(f" {k}={v}" for k, v in mem_caps(choice, mem).items())
        return line + "\n"
    return uuids + "\n"


def is_lease_admin() -> bool:
    """Is the caller one of ``--lease-admins``? Only a user the web config's basic auth
    proved counts (the auth middleware sets ``REMOTE_USER`` and removes any other)."""
    svc = services()
    user = request.environ.get("REMOTE_USER")
    return svc.watcher is not None and isinstance(user, str) and user in svc.lease_admins


def authorized(ref: str) -> str:
    """The id of the lease ``ref`` names, if this request may change it: ``ref`` is the
    lease's token, or the caller is a lease admin. 404 ``unknown_lease``, 403 ``forbidden``.
    Every route that changes a lease (renew, release, …) asks this first."""
    return services().leases.authorize(ref, admin=is_lease_admin())


def choose_params() -> MultiDict[str, str]:
    """``/choose``'s parameters: the query string, and a form or a JSON object body under the
    same names (a list is a comma-separated value), validated alike; a name given twice is
    the validator's 400 as in a query string. Any other body is 415: never ignored."""
    params: MultiDict[str, str] = MultiDict(request.args)
    if not request.content_length and not request.headers.get("Transfer-Encoding"):
        return params
    if request.mimetype == "application/x-www-form-urlencoded":
        params.update(request.form)
        return params
    if request.mimetype != "application/json" and not request.mimetype.endswith("+json"):
        raise ApiError(
            415,
            "unsupported_media_type",
            f"a body of type {request.mimetype or 'unknown'!r} is not read: give the "
            "parameters in the query string, a form, or a JSON object",
        )
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_parameter", "the JSON body must be an object of parameters")
    for name, value in body.items():
        if isinstance(value, list) and all(isinstance(v, (str, int)) for v in value):
            value = ",".join(str(v) for v in value)
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ApiError(400, "invalid_parameter", f"{name}: expected text or a number", name)
        params.add(str(name), str(value))
    return params


def claim_key(lease_seconds: float, requester: str, given: MultiDict[str, str]) -> ClaimKey | None:
    """The request's ``Idempotency-Key``, to match retries by; 400 if malformed."""
    header = request.headers.get(IDEMPOTENCY_HEADER)  # a repeated header: joined by commas
    if header is None:
        return None
    try:
        key = parse_idempotency_key(header)
    except ValueError as exc:
        raise ApiError(400, "invalid_idempotency_key", str(exc)) from None
    if lease_seconds <= 0:
        return None  # advice claims nothing, so there is nothing to repeat
    params = [(name, v) for name, values in given.lists() for v in values]
    return ClaimKey(key, requester, request_hash(params))


def claim_params(params: MultiDict[str, str]) -> MultiDict[str, str]:
    """``params`` as a route that claims reads them. Flask answers HEAD wherever it answers
    GET, and a HEAD (a link checker, a monitor) must never take a GPU: it gets ``lease=0``,
    so it is answered as the advice its GET would give."""
    if request.method != "HEAD":
        return params
    advice = MultiDict(params)
    advice.setlist("lease", ["0"])
    return advice


@api.route("/choose", methods=["GET", "POST"])  # Flask adds HEAD: see claim_params
def choose_route() -> Response:
    svc = services()
    requester = peers.requester(request.environ)
    holders = not is_anonymous(request.environ)  # who holds what: not to the unauthenticated
    try:
        given = claim_params(choose_params())
        req = parse_choose_args(
            given,
            defaults=svc.choose_defaults,
            max_idle_for_seconds=svc.max_idle_for_seconds,
        )
        key = claim_key(req.lease_seconds, requester, given)
        connected = request.environ.get(CONNECTED)
        claimed = svc.claimer.claim(req, requester, key, connected=connected, holders=holders)
    except ApiError as exc:
        svc.requests.inc(exc.code)
        raise
    svc.requests.inc("ok")
    choice, lease, snapshot = claimed.choice, claimed.lease, claimed.snapshot
    if req.format == "json":
        chosen = [
            {**g.to_json(), "rank": place, "score": score(g, req.sort)}
            for place, g in enumerate(choice.chosen, start=1)
        ]
        resp = jsonify(
            {
                "n": req.n,
                "sort": req.sort,
                "chosen": chosen,
                "rejected": [_rejected_json(r) for r in choice.not_chosen],
                "filters": req.filters_json(),
                "lease": {**lease.to_json(), "token": lease.token} if lease else None,
                "sampled_at": snapshot.taken_at_seconds,
                "snapshot_age_seconds": round(snapshot.age_seconds(claimed.monotonic_now), 3),
                "waiting": [
                    w.to_json(claimed.monotonic_now, holders=holders) for w in svc.claimer.waiting()
                ],
                **_mem_json(choice, req.mem_bytes),
            }
        )
    else:
        text = choice_text(choice, lease, req.format, req.mem_bytes)
        resp = Response(text, mimetype="text/plain")
    if lease is not None:
        resp.headers["X-GPU-Lease"] = lease.token or lease.id
        resp.headers["X-GPU-Lease-Expires"] = f"{lease.expires_at:.3f}"
    resp.headers["Cache-Control"] = "no-store"
    return resp


def _mem_json(choice: Selection, mem: int | None) -> dict[str, Any]:
    """``format=json``'s ``mem`` for a memory lease: its bytes, fraction and environment."""
    if mem is None:
        return {}
    caps = mem_caps(choice, mem)
    return {"mem": {"bytes": mem, "fraction": float(caps[MEM_FRACTION_ENV]), "env": caps}}


@api.get("/cluster/choose")  # Flask adds HEAD: see claim_params
def cluster_choose_route() -> Response:
    args = claim_params(request.args)
    req = parse_cluster_args(args)
    cluster = services().cluster
    if cluster is None:
        raise ApiError(
            404, "not_configured", "this exporter has no fleet view: start it with --prometheus-url"
        )
    connected = request.environ.get(CONNECTED)
    result = cluster.choose(args.to_dict(), services().waiters, connected)
    fmt = req.choose.format
    if fmt == "json":
        resp = jsonify(result.to_json())
    else:
        resp = Response(result.text(fmt), mimetype="text/plain")
    if len(result.placements) == 1:
        placed = result.placements[0]
        resp.headers["X-GPU-Host"] = placed.host or ""
        if placed.lease_ref is not None:
            resp.headers["X-GPU-Lease"] = placed.lease_ref
    resp.headers["Cache-Control"] = "no-store"
    return resp


@api.get("/leases")
def list_leases() -> Response:
    check_params(request.args, (), "/leases")
    svc = services()
    snapshot = svc.cache.get()
    active = svc.leases.active(snapshot)
    devices = all_devices(snapshot.gpus)
    return jsonify(
        {
            "leases": [
                {**x.to_json(), "memory": usage_json(x, devices, active)}
                if x.mem_bytes is not None
                else x.to_json()
                for x in active
            ]
        }
    )


@api.delete("/leases/<lease_id>")  # the lease's token; its id alone only for admins
def release_lease(lease_id: str) -> Response:
    check_params(request.args, (), "DELETE /leases/<token>")
    lease = services().leases.release(authorized(lease_id))
    return jsonify({"released": lease.id, "lease": lease.to_json()})


@api.post("/leases/<lease_id>/renew")  # the lease's token, as for DELETE
def renew_lease(lease_id: str) -> Response:
    check_params(request.values, ("ttl",), "/leases/<token>/renew")
    ttl = parsed(request.values, "ttl", parse_duration)
    if ttl is not None and ttl <= 0:
        bad("ttl", "ttl must be more than 0; DELETE the lease to release it")
    lease_seconds = DEFAULT_LEASE_SECONDS if ttl is None else ttl
    svc = services()
    requester = peers.requester(request.environ)
    leases = svc.leases
    lease = leases.renew(
        leases.authorize(lease_id, admin=is_lease_admin(), renewing_for=requester), lease_seconds
    )
    return jsonify(lease.to_json())


@api.post("/leases/<lease_id>/pids")  # the lease's token, as for DELETE
def add_lease_pids(lease_id: str) -> Response:
    """Register the job's processes (``pid=4242[,4243]``) with its lease: see
    :func:`gpu_exporter.choose.settle.settle` for what they change."""
    check_params(request.values, ("pid",), "/leases/<token>/pids")
    if "pid" not in request.values:
        bad("pid", "pid is required: the job's process ids, comma-separated")
    pids = value_of(request.values, BY_NAME["pid"])
    lease = services().leases.add_pids(authorized(lease_id), pids)
    return jsonify(lease.to_json())
