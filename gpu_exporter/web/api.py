"""The lease API: ``/choose`` (GET and POST), ``/cluster/choose`` and ``/leases``.

Parsing is :mod:`gpu_exporter.choose.params`'s, claiming and waiting
:class:`~gpu_exporter.choose.claim.Claimer`'s; the views here only turn their results into
text or JSON. Refusals are raised and answered by :mod:`gpu_exporter.web.errors`.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify, request

from gpu_exporter.choose.lease import Lease
from gpu_exporter.choose.leases import LeaseError
from gpu_exporter.choose.params import (
    BY_NAME,
    DEFAULT_LEASE_SECONDS,
    ApiError,
    bad,
    check_params,
    parse_choose_args,
    parse_cluster_args,
    parsed,
    value_of,
)
from gpu_exporter.choose.rank import Rejected, Selection, score
from gpu_exporter.units import parse_duration
from gpu_exporter.web.pages import gpu_json
from gpu_exporter.web.services import services

api = Blueprint("api", __name__)


def _rejected_json(r: Rejected) -> dict[str, Any]:
    return {"index": r.gpu.index, "uuid": r.gpu.uuid, "reasons": list(r.reasons)}


def choice_text(choice: Selection, lease: Lease | None, fmt: str) -> str:
    """The text formats of a successful ``/choose``, newline-terminated."""
    uuids = ",".join(g.uuid for g in choice.chosen)
    if fmt == "index":
        return ",".join(str(g.index) for g in choice.chosen) + "\n"
    if fmt == "env":
        line = f"export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={uuids}"
        return line + (f" GPU_LEASE={lease.id}" if lease else "") + "\n"
    return uuids + "\n"


@api.route("/choose", methods=["GET", "POST"])
def choose_route() -> Response:
    svc = services()
    try:
        req = parse_choose_args(request.values)
        claimed = svc.claimer.claim(req, request.remote_addr or "unknown")
    except (ApiError, LeaseError) as exc:
        svc.requests.inc(exc.code)
        raise
    svc.requests.inc("ok")
    choice, lease, snapshot = claimed.choice, claimed.lease, claimed.snapshot
    if req.format == "json":
        chosen = [
            {**gpu_json(g), "rank": place, "score": score(g, req.sort)}
            for place, g in enumerate(choice.chosen, start=1)
        ]
        resp = jsonify(
            {
                "n": req.n,
                "sort": req.sort,
                "chosen": chosen,
                "rejected": [_rejected_json(r) for r in choice.not_chosen],
                "lease": lease.to_json() if lease else None,
                "sampled_at": snapshot.taken_at_seconds,
                "snapshot_age_seconds": round(snapshot.age_seconds(claimed.monotonic_now), 3),
            }
        )
    else:
        resp = Response(choice_text(choice, lease, req.format), mimetype="text/plain")
    if lease is not None:
        resp.headers["X-GPU-Lease"] = lease.id
        resp.headers["X-GPU-Lease-Expires"] = f"{lease.expires_at:.3f}"
    resp.headers["Cache-Control"] = "no-store"
    return resp


@api.get("/cluster/choose")
def cluster_choose_route() -> Response:
    req = parse_cluster_args(request.args)
    cluster = services().cluster
    if cluster is None:
        raise ApiError(
            404,
            "not_configured",
            "this exporter has no fleet view: start it with --prometheus-url",
        )
    result = cluster.choose(request.args.to_dict(), services().waiters)
    fmt = req.choose.format
    if fmt == "json":
        resp = jsonify(result.to_json())
    else:
        resp = Response(result.text(fmt), mimetype="text/plain")
    if len(result.placements) == 1:
        placed = result.placements[0]
        resp.headers["X-GPU-Host"] = placed.host or ""
        if placed.lease_id is not None:
            resp.headers["X-GPU-Lease"] = placed.lease_id
    resp.headers["Cache-Control"] = "no-store"
    return resp


@api.get("/leases")
def list_leases() -> Response:
    check_params(request.args, (), "/leases")
    svc = services()
    return jsonify({"leases": [x.to_json() for x in svc.leases.active(svc.cache.get())]})


@api.delete("/leases/<lease_id>")
def release_lease(lease_id: str) -> Response:
    check_params(request.args, (), "DELETE /leases/<id>")
    lease = services().leases.release(lease_id)
    return jsonify({"released": lease.id, "lease": lease.to_json()})


@api.post("/leases/<lease_id>/renew")
def renew_lease(lease_id: str) -> Response:
    check_params(request.values, ("ttl",), "/leases/<id>/renew")
    ttl = parsed(request.values, "ttl", parse_duration)
    if ttl is not None and ttl <= 0:
        bad("ttl", "ttl must be more than 0; DELETE the lease to release it")
    lease = services().leases.renew(lease_id, DEFAULT_LEASE_SECONDS if ttl is None else ttl)
    return jsonify(lease.to_json())


@api.post("/leases/<lease_id>/pids")
def add_lease_pids(lease_id: str) -> Response:
    """Register the job's processes (``pid=4242[,4243]``) with its lease: see
    :func:`gpu_exporter.choose.lease.settle` for what they change."""
    check_params(request.values, ("pid",), "/leases/<id>/pids")
    if "pid" not in request.values:
        bad("pid", "pid is required: the job's process ids, comma-separated")
    lease = services().leases.add_pids(lease_id, value_of(request.values, BY_NAME["pid"]))
    return jsonify(lease.to_json())
