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
from dataclasses import dataclass
from typing import Any, NoReturn

from flask import Flask, Response, jsonify, render_template, request
from prometheus_client import CollectorRegistry, make_wsgi_app
from werkzeug.exceptions import HTTPException
from werkzeug.middleware.dispatcher import DispatcherMiddleware

from gpu_exporter import __version__
from gpu_exporter.choose import Filters, NotEnoughGpus, Rejected, choose
from gpu_exporter.model import GpuSample, Snapshot
from gpu_exporter.sampler import Clock, SnapshotCache, SystemClock
from gpu_exporter.units import format_bytes, parse_bytes, parse_ratio

log = logging.getLogger(__name__)

MAX_N = 1024
CHOOSE_PARAMS = ("n", "format", "min_free", "max_util", "exclude")
CHOOSE_FORMATS = ("uuid", "index", "json")


@dataclass
class ApiError(Exception):
    status: int
    code: str
    message: str
    param: str | None = None


def _bad(param: str, message: str) -> NoReturn:
    raise ApiError(400, "invalid_parameter", message, param)


def _wants_json() -> bool:
    if request.args.get("format") == "json" or request.path == "/gpus":
        return True
    best = request.accept_mimetypes.best_match(["text/plain", "application/json"])
    return best == "application/json" and request.accept_mimetypes[best] > 0


def _error_response(status: int, code: str, message: str, param: str | None = None) -> Response:
    if _wants_json():
        resp = jsonify({"error": {"code": code, "message": message, "param": param}})
    else:
        resp = Response(f"error: {message}\n", mimetype="text/plain")
    resp.status_code = status
    resp.headers["Cache-Control"] = "no-store"
    return resp


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


@dataclass(frozen=True, slots=True)
class ChooseRequest:
    n: int
    format: str
    filters: Filters


def parse_choose_args(args: Any) -> ChooseRequest:
    """Validate ``/choose``'s query string strictly: unknown or repeated parameters are errors."""
    for name in args:
        if name not in CHOOSE_PARAMS:
            raise ApiError(
                400,
                "unknown_parameter",
                f"unknown parameter {name!r}; /choose takes {', '.join(CHOOSE_PARAMS)}",
                name,
            )
        if len(args.getlist(name)) > 1:
            _bad(name, f"{name} given more than once")

    raw_n = args.get("n", "1")
    if not raw_n.isdigit() or not 1 <= int(raw_n) <= MAX_N:
        _bad("n", f"n must be a whole number from 1 to {MAX_N}, got {raw_n!r}")
    fmt = args.get("format", "uuid")
    if fmt not in CHOOSE_FORMATS:
        _bad("format", f"format must be one of {', '.join(CHOOSE_FORMATS)}, got {fmt!r}")

    min_free = max_util = None
    try:
        if "min_free" in args:
            min_free = parse_bytes(args["min_free"])
    except ValueError as exc:
        _bad("min_free", f"min_free: {exc}")
    try:
        if "max_util" in args:
            max_util = parse_ratio(args["max_util"])
    except ValueError as exc:
        _bad("max_util", f"max_util: {exc}")
    exclude = tuple(s.strip() for s in args.get("exclude", "").split(",") if s.strip())
    for selector in exclude:
        if not (
            selector.isdigit() or selector.upper().startswith(("GPU-", "MIG-")) or ":" in selector
        ):
            _bad(
                "exclude",
                f"exclude: {selector!r} is not an NVML index, a UUID (GPU-…) or a PCI bus id",
            )
    return ChooseRequest(int(raw_n), fmt, Filters(min_free, max_util, exclude))


def gpu_json(gpu: GpuSample) -> dict[str, Any]:
    return gpu.to_json()


def _rejected_json(r: Rejected) -> dict[str, Any]:
    return {"index": r.gpu.index, "uuid": r.gpu.uuid, "reasons": list(r.reasons)}


def create_app(
    cache: SnapshotCache,
    registry: CollectorRegistry,
    *,
    clock: Clock | None = None,
    max_age_seconds: float = 10.0,
) -> Flask:
    """Build the app. Everything it reads comes in through the arguments."""
    app = Flask(__name__)
    app.config["JSON_SORT_KEYS"] = False
    clock = clock or SystemClock()

    def current() -> tuple[Snapshot, float]:
        return cache.get(), clock.monotonic()

    @app.errorhandler(ApiError)
    def api_error(exc: ApiError) -> Response:
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
        snapshot, _ = current()
        return render_template(
            "index.html", snapshot=snapshot, version=__version__, fmt=format_bytes
        )

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
                "gpus": [gpu_json(g) for g in snapshot.gpus],
            }
        )

    @app.get("/choose")
    def choose_route() -> Response:
        req = parse_choose_args(request.args)
        snapshot, now = current()
        problem = snapshot_problem(snapshot, now, max_age_seconds)
        if problem is not None:
            raise problem
        try:
            choice = choose(snapshot.gpus, req.n, req.filters)
        except NotEnoughGpus as exc:
            raise ApiError(503, "not_enough_gpus", str(exc)) from None
        if req.format == "json":
            resp = jsonify(
                {
                    "n": req.n,
                    "chosen": [gpu_json(g) for g in choice.chosen],
                    "rejected": [_rejected_json(r) for r in choice.not_chosen],
                    "sampled_at": snapshot.taken_at_seconds,
                    "snapshot_age_seconds": round(snapshot.age_seconds(now), 3),
                }
            )
        else:
            ids = (g.uuid if req.format == "uuid" else str(g.index) for g in choice.chosen)
            resp = Response(",".join(ids) + "\n", mimetype="text/plain")
        resp.headers["Cache-Control"] = "no-store"
        return resp

    metrics_app = make_wsgi_app(registry)
    app.wsgi_app = DispatcherMiddleware(app.wsgi_app, {"/metrics": metrics_app})  # type: ignore[method-assign]
    return app
