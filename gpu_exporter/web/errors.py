"""The error contract, in one place: a JSON object or one plain line, never a traceback.

``{"error": {"code", "message", "param"}}`` when the client asked for JSON (``format=json``,
an ``Accept`` header preferring it, or a JSON-only endpoint), otherwise ``error: message``.
:func:`error_response` is used by the WSGI middleware, which runs before Flask;
:func:`register` installs the app's handlers, which answer the same way.
"""

from __future__ import annotations

import json
import logging
from typing import cast

import flask
from flask import Flask, request
from werkzeug.exceptions import HTTPException
from werkzeug.wrappers import Request, Response

from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.web.gateway import without_secrets

log = logging.getLogger(__name__)

JSON_ONLY_PATHS = ("/gpus", "/leases")


def wants_json(req: Request) -> bool:
    if req.args.get("format") == "json" or req.path.startswith(JSON_ONLY_PATHS):
        return True
    best = req.accept_mimetypes.best_match(["text/plain", "application/json"])
    return best == "application/json" and req.accept_mimetypes[best] > 0


def error_response(
    req: Request,
    status: int,
    code: str,
    message: str,
    param: str | None = None,
    *,
    response_class: type[Response] = Response,
) -> Response:
    """The error as ``response_class`` (Flask's own, inside the app)."""
    if wants_json(req):
        body = json.dumps({"error": {"code": code, "message": message, "param": param}})
        resp = response_class(body + "\n", status, mimetype="application/json")
    else:
        resp = response_class(f"error: {message}\n", status, mimetype="text/plain")
    resp.headers["Cache-Control"] = "no-store"
    return resp


def _answer(status: int, code: str, message: str, param: str | None = None) -> flask.Response:
    resp = error_response(request, status, code, message, param, response_class=flask.Response)
    return cast(flask.Response, resp)  # built as Flask's Response class


def _refused(exc: ApiError) -> flask.Response:
    return _answer(exc.status, exc.code, exc.message, exc.param)


def _http_error(exc: HTTPException) -> flask.Response:
    code = (exc.name or "error").lower().replace(" ", "_")
    message = f"{exc.name}: {request.path}" if exc.code == 404 else (exc.description or "")
    if exc.code == 404:
        message += " (see / for the endpoints)"
    return _answer(exc.code or 500, code, message)


def _internal_error(exc: Exception) -> flask.Response:
    log.exception("request failed: %s %s", request.method, without_secrets(request.path))
    return _answer(500, "internal_error", "internal error; see the exporter's log")


def register(app: Flask) -> None:
    """Answer every error of ``app``'s views by the contract: refusals with their own status
    and code, HTTP errors (404, 405 …) by name, anything else as a logged 500."""
    app.register_error_handler(ApiError, _refused)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _internal_error)
