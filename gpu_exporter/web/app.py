"""The HTTP API: a Flask app factory over a snapshot cache. Requests never call NVML.

* ``/metrics`` — Prometheus exposition of the latest snapshot (private registry).
* ``/choose`` — the best free GPUs for a job script, as text or JSON.
* ``/gpus`` — the snapshot as JSON; ``/healthz`` liveness; ``/readyz`` readiness;
  ``/`` a landing page.

Errors are never tracebacks or HTML debug pages: a JSON body
``{"error": {"code", "message", "param"}}`` when JSON was asked for, otherwise one plain line.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, cast

from flask import Flask, Response, jsonify, render_template, request
from prometheus_client import CollectorRegistry, make_wsgi_app
from werkzeug.exceptions import HTTPException
from werkzeug.middleware.dispatcher import DispatcherMiddleware

from gpu_exporter import __version__
from gpu_exporter.choose.leases import Lease, LeaseError, LeaseTable

# /choose's parameter tuples live in params.py; re-exported here for callers that import them
# from the app.
from gpu_exporter.choose.params import CHOOSE_FORMATS as CHOOSE_FORMATS
from gpu_exporter.choose.params import CHOOSE_PARAMS as CHOOSE_PARAMS
from gpu_exporter.choose.params import (
    DEFAULT_LEASE_SECONDS,
    ApiError,
    ChooseRequest,
    check_params,
    parse_choose_args,
    parse_cluster_args,
)
from gpu_exporter.choose.params import bad as _bad
from gpu_exporter.choose.params import parsed as _parsed
from gpu_exporter.choose.rank import Choice, NotEnoughGpus, Rejected, Window, score
from gpu_exporter.clock import Clock, SystemClock
from gpu_exporter.collect.cache import SnapshotCache
from gpu_exporter.counters import RequestCounter, XidCounter
from gpu_exporter.export.exposition import Exposition
from gpu_exporter.model import GpuSample, Snapshot
from gpu_exporter.units import format_bytes, parse_duration
from gpu_exporter.web.cluster import ClusterService
from gpu_exporter.web.errors import error_response
from gpu_exporter.web.limits import (
    DEFAULT_MAX_IN_FLIGHT,
    RequestLimits,
    Waiters,
)
from gpu_exporter.web.openapi import document as openapi_document
from gpu_exporter.web.status import status_view

log = logging.getLogger(__name__)

WAIT_POLL_SECONDS = 0.1  # waiters also wake at once on lease changes


def _error_response(status: int, code: str, message: str, param: str | None = None) -> Response:
    resp = error_response(request, status, code, message, param, response_class=Response)
    return cast(Response, resp)  # built as Flask's Response class


def snapshot_problem(
    snapshot: Snapshot, monotonic_now: float, max_age_seconds: float
) -> ApiError | None:
    """Why this snapshot must not be used to hand out GPUs, or None if it may."""
    if snapshot.sequence == 0:
        return ApiError(503, "not_ready", "no sample yet: the exporter is starting")
    if not snapshot.nvml_up:
        return ApiError(503, "nvml_unavailable", f"NVML is not available: {snapshot.nvml_error}")
    age = snapshot.age_seconds(monotonic_now)
    if age > max_age_seconds:
        return ApiError(
            503,
            "snapshot_stale",
            f"the last sample is {age:.1f} s old (limit {max_age_seconds:g} s); "
            "the sampler may be stuck in a driver call",
        )
    return None


def history_window(cache: SnapshotCache, seconds: float, monotonic_now: float) -> Window:
    """The samples of the last ``seconds``, for ``idle_for``."""
    history = cache.history()
    covered = history[0].age_seconds(monotonic_now) if history else 0.0
    past = tuple(
        (snap.age_seconds(monotonic_now), snap.gpus)
        for snap in history
        if snap.age_seconds(monotonic_now) <= seconds
    )
    return Window(seconds, covered, past)


def gpu_json(gpu: GpuSample) -> dict[str, Any]:
    return gpu.to_json()


def _rejected_json(r: Rejected) -> dict[str, Any]:
    return {"index": r.gpu.index, "uuid": r.gpu.uuid, "reasons": list(r.reasons)}


def gpus_json(snapshot: Snapshot, xids: XidCounter | None = None) -> list[dict[str, Any]]:
    """``/gpus``' list: every GPU with its MIG devices, processes and (if counted) Xids."""
    counts: dict[str, dict[str, int]] = {}
    for c in xids.counts() if xids is not None else ():
        counts.setdefault(c.uuid, {})[str(c.xid)] = c.count
    out = []
    for gpu in snapshot.gpus:
        data = gpu_json(gpu)
        if xids is not None:
            data["xid_errors"] = counts.get(gpu.uuid, {})
        out.append(data)
    return out


def choice_text(choice: Choice, lease: Lease | None, fmt: str) -> str:
    """The text formats of a successful ``/choose``, newline-terminated."""
    uuids = ",".join(g.uuid for g in choice.chosen)
    if fmt == "index":
        return ",".join(str(g.index) for g in choice.chosen) + "\n"
    if fmt == "env":
        line = f"export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={uuids}"
        return line + (f" GPU_LEASE={lease.id}" if lease else "") + "\n"
    return uuids + "\n"


@dataclass
class Services:
    """Everything the app reads, built by :func:`gpu_exporter.daemon.build`.

    Pass the same ``leases``, ``requests`` and ``rejections`` to the metrics collector to
    export them. ``stopping``, once set, makes waiting ``/choose`` requests give up at once.
    ``cluster`` (from ``--prometheus-url``) serves ``/cluster/choose``.
    With ``exposition``, ``/metrics`` serves its per-snapshot cached rendering (which must
    cover the same collectors as ``registry``); without, ``registry`` is rendered per scrape.
    """

    cache: SnapshotCache
    registry: CollectorRegistry
    clock: Clock = field(default_factory=SystemClock)
    max_age_seconds: float = 10.0
    leases: LeaseTable | None = None
    requests: RequestCounter = field(default_factory=RequestCounter)
    rejections: RequestCounter | None = None
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    waiters: Waiters = field(default_factory=Waiters)
    stopping: threading.Event = field(default_factory=threading.Event)
    cluster: ClusterService | None = None
    exposition: Exposition | None = None
    xids: XidCounter | None = None


def create_app(services: Services) -> Flask:
    """Build the app. Everything it reads comes in through ``services``."""
    cache, registry, clock = services.cache, services.registry, services.clock
    max_age_seconds, rejections = services.max_age_seconds, services.rejections
    max_in_flight, waiters, stopping = services.max_in_flight, services.waiters, services.stopping
    cluster, exposition, xids = services.cluster, services.exposition, services.xids
    app = Flask(__name__)
    app.json.sort_keys = False  # type: ignore[attr-defined]
    table = services.leases if services.leases is not None else LeaseTable(clock)
    counter = services.requests

    def current() -> tuple[Snapshot, float]:
        return cache.get(), clock.monotonic()

    @app.errorhandler(ApiError)
    def api_error(exc: ApiError) -> Response:
        return _error_response(exc.status, exc.code, exc.message, exc.param)

    @app.errorhandler(LeaseError)
    def lease_error(exc: LeaseError) -> Response:
        return _error_response(exc.status, exc.code, exc.message, exc.param)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        code = (exc.name or "error").lower().replace(" ", "_")
        message = f"{exc.name}: {request.path}" if exc.code == 404 else (exc.description or "")
        if exc.code == 404:
            message += " (see / for the endpoints)"
        return _error_response(exc.code or 500, code, message)

    @app.errorhandler(Exception)
    def internal_error(exc: Exception) -> Response:
        log.exception("request failed: %s %s", request.method, request.path)
        return _error_response(500, "internal_error", "internal error; see the exporter's log")

    @app.get("/")
    def index() -> str:
        snapshot, now = current()
        problem = snapshot_problem(snapshot, now, max_age_seconds)
        view = status_view(
            snapshot,
            table.active(snapshot),
            wall_now=clock.time(),
            age_seconds=snapshot.age_seconds(now),
            problem=problem.message if problem else None,
        )
        return render_template("index.html", view=view, version=__version__, fmt=format_bytes)

    @app.get("/openapi.json")
    def openapi() -> Response:
        return jsonify(openapi_document())

    @app.get("/healthz")
    def healthz() -> Response:
        return Response("ok\n", mimetype="text/plain")

    @app.get("/readyz")
    def readyz() -> Response:
        snapshot, now = current()
        problem = snapshot_problem(snapshot, now, max_age_seconds)
        if problem is not None:
            return Response(f"not ready: {problem.message}\n", 503, mimetype="text/plain")
        return Response("ready\n", mimetype="text/plain")

    @app.get("/gpus")
    def gpus() -> Response:
        check_params(request.args, (), "/gpus")
        snapshot, now = current()
        return jsonify(
            {
                "simulated": snapshot.simulated,
                "nvml_up": snapshot.nvml_up,
                "nvml_error": snapshot.nvml_error,
                "driver_version": snapshot.driver_version,
                "cuda_driver_version": snapshot.cuda_driver_version,
                "sampled_at": snapshot.taken_at_seconds if snapshot.sequence else None,
                "snapshot_age_seconds": round(snapshot.age_seconds(now), 3),
                "process_labels": list(snapshot.process_labels),
                "gpus": gpus_json(snapshot, xids),
            }
        )

    def claim(req: ChooseRequest) -> tuple[Choice, Lease | None, Snapshot, float]:
        """Select and claim under the lease table's lock, waiting first come first served."""
        deadline = clock.monotonic() + req.wait_seconds
        requester = request.remote_addr or "unknown"
        ticket = table.enqueue()
        waiting = False  # holds one of the --max-waiters slots
        try:
            while True:
                snapshot, now = current()
                problem = snapshot_problem(snapshot, now, max_age_seconds)
                ahead, waiting_ahead = table.ahead_of(ticket)
                failure: ApiError | None = problem
                if problem is None and ahead == 0:
                    window = None
                    if req.idle_for_seconds is not None:
                        window = history_window(cache, req.idle_for_seconds, now)
                    try:
                        choice, lease = table.claim(
                            snapshot,
                            req.n,
                            req.filters,
                            ttl_seconds=req.lease_seconds,
                            requester=requester,
                            owner=req.owner,
                            sort=req.sort,
                            window=window,
                        )
                        return choice, lease, snapshot, now
                    except NotEnoughGpus as exc:
                        failure = ApiError(503, "not_enough_gpus", str(exc))
                        if clock.monotonic() < deadline:
                            table.mark_waiting(ticket)  # later claimers now queue behind us
                elif problem is None and waiting_ahead == 0:
                    failure = None  # only requests being served are ahead: our turn is next
                elif problem is None:
                    failure = ApiError(
                        503,
                        "not_enough_gpus",
                        f"{waiting_ahead} earlier requests are waiting for GPUs and are "
                        "served first",
                    )
                if failure is not None and clock.monotonic() >= deadline:
                    raise failure
                if stopping.is_set():
                    raise ApiError(503, "shutting_down", "the exporter is shutting down")
                if failure is not None and not waiting:  # waiting for GPUs, not our turn
                    if not waiters.try_enter():
                        if rejections is not None:
                            rejections.inc("too_many_waiters")
                        raise ApiError(
                            503,
                            "too_many_waiters",
                            f"{waiters.limit} requests are already waiting for GPUs "
                            "(--max-waiters); retry later",
                            "wait",
                        )
                    waiting = True
                with table.changed:
                    table.changed.wait(WAIT_POLL_SECONDS)
        finally:
            if waiting:
                waiters.leave()
            table.dequeue(ticket)

    @app.route("/choose", methods=["GET", "POST"])
    def choose_route() -> Response:
        try:
            req = parse_choose_args(request.values)
            choice, lease, snapshot, now = claim(req)
        except (ApiError, LeaseError) as exc:
            counter.inc(exc.code)
            raise
        counter.inc("ok")
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
                    "snapshot_age_seconds": round(snapshot.age_seconds(now), 3),
                }
            )
        else:
            resp = Response(choice_text(choice, lease, req.format), mimetype="text/plain")
        if lease is not None:
            resp.headers["X-GPU-Lease"] = lease.id
            resp.headers["X-GPU-Lease-Expires"] = f"{lease.expires_at:.3f}"
        resp.headers["Cache-Control"] = "no-store"
        return resp

    @app.get("/cluster/choose")
    def cluster_choose_route() -> Response:
        req = parse_cluster_args(request.args)
        if cluster is None:
            raise ApiError(
                404,
                "not_configured",
                "this exporter has no fleet view: start it with --prometheus-url",
            )
        result = cluster.choose(request.args.to_dict())
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

    @app.get("/leases")
    def list_leases() -> Response:
        check_params(request.args, (), "/leases")
        return jsonify({"leases": [x.to_json() for x in table.active(cache.get())]})

    @app.delete("/leases/<lease_id>")
    def release_lease(lease_id: str) -> Response:
        check_params(request.args, (), "DELETE /leases/<id>")
        lease = table.release(lease_id)
        return jsonify({"released": lease.id, "lease": lease.to_json()})

    @app.post("/leases/<lease_id>/renew")
    def renew_lease(lease_id: str) -> Response:
        check_params(request.values, ("ttl",), "/leases/<id>/renew")
        ttl = _parsed(request.values, "ttl", parse_duration)
        if ttl is not None and ttl <= 0:
            _bad("ttl", "ttl must be more than 0; DELETE the lease to release it")
        lease = table.renew(lease_id, DEFAULT_LEASE_SECONDS if ttl is None else ttl)
        return jsonify(lease.to_json())

    metrics_app = make_wsgi_app(registry) if exposition is None else exposition.wsgi_app(registry)
    app.wsgi_app = RequestLimits(  # type: ignore[method-assign]
        DispatcherMiddleware(app.wsgi_app, {"/metrics": metrics_app}),
        max_in_flight=max_in_flight,
        rejections=rejections,
    )
    return app
