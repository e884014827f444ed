"""The read-only pages: ``/`` (status), ``/gpus`` (the snapshot as JSON), ``/healthz``,
``/readyz`` and ``/openapi.json``.

Nothing here claims a GPU or changes a lease. To a client that proved no user while basic
auth has users (:func:`~gpu_exporter.web.auth.is_anonymous`), ``/`` names no lease holder
and ``/readyz`` no file.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify, render_template, request

from gpu_exporter import __version__
from gpu_exporter.choose.claim import snapshot_problem
from gpu_exporter.choose.request import check_params, parse_choose_args
from gpu_exporter.counters import XidCounter
from gpu_exporter.model import Snapshot
from gpu_exporter.units import format_bytes
from gpu_exporter.web.auth import is_anonymous
from gpu_exporter.web.openapi import document as openapi_document
from gpu_exporter.web.services import services
from gpu_exporter.web.status import status_view

pages = Blueprint("pages", __name__)


def gpus_json(snapshot: Snapshot, xids: XidCounter | None = None) -> list[dict[str, Any]]:
    """``/gpus``' list: every GPU with its MIG devices, processes and (if counted) Xids."""
    counts: dict[str, dict[str, int]] = {}
    for c in xids.counts() if xids is not None else ():
        counts.setdefault(c.uuid, {})[str(c.xid)] = c.count
    out = []
    for gpu in snapshot.gpus:
        data = gpu.to_json()
        if xids is not None:
            data["xid_errors"] = counts.get(gpu.uuid, {})
        out.append(data)
    return out


@pages.get("/")
def index() -> str:
    svc = services()
    snapshot, now = svc.cache.get(), svc.clock.monotonic()
    problem = snapshot_problem(snapshot, now, svc.max_age_seconds)
    view = status_view(
        snapshot,
        svc.leases.active(snapshot),
        wall_now=svc.clock.time(),
        age_seconds=snapshot.age_seconds(now),
        problem=problem.message if problem else None,
        filters=parse_choose_args({}, defaults=svc.choose_defaults).filters,
        waiting=svc.claimer.waiting(),
        monotonic_now=now,
        holders=not is_anonymous(request.environ),
        withheld=svc.leases.withheld(snapshot),
    )
    return render_template(
        "index.html",
        view=view,
        version=__version__,
        fmt=format_bytes,
        metrics_path=svc.telemetry_path,
        free="&".join(f"{name}={value}" for name, value in svc.choose_defaults.items()),
    )


@pages.get("/openapi.json")
def openapi() -> Response:
    doc, path = openapi_document(), services().telemetry_path
    if path != "/metrics":  # --web.telemetry-path: document where the metrics really are
        doc = {
            **doc,
            "paths": {(path if p == "/metrics" else p): v for p, v in doc["paths"].items()},
        }
    return jsonify(doc)


@pages.get("/healthz")
def healthz() -> Response:
    return Response("ok\n", mimetype="text/plain")


@pages.get("/readyz")
def readyz() -> Response:
    svc = services()
    problem = snapshot_problem(svc.cache.get(), svc.clock.monotonic(), svc.max_age_seconds)
    message = problem.message if problem is not None else svc.leases.state_problem
    if problem is None and message is not None and is_anonymous(request.environ):
        message = "leases cannot be saved (the log says where and why)"  # names no path
    if message is not None:  # no sample to choose from, or leases cannot be saved
        return Response(f"not ready: {message}\n", 503, mimetype="text/plain")
    return Response("ready\n", mimetype="text/plain")


@pages.get("/gpus")
def gpus() -> Response:
    check_params(request.args, (), "/gpus")
    svc = services()
    snapshot, now = svc.cache.get(), svc.clock.monotonic()
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
            "fields_updated": dict(snapshot.fields_updated),
            "gpus": gpus_json(snapshot, svc.xids),
        }
    )
