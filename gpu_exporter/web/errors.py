"""The error contract, in one place: a JSON object or one plain line, never a traceback.

``{"error": {"code", "message", "param"}}`` when the client asked for JSON (``format=json``,
an ``Accept`` header preferring it, or a JSON-only endpoint), otherwise ``error: message``.
Used by the Flask app and by the WSGI middleware in front of it, which runs before Flask.
"""

from __future__ import annotations

import json

from werkzeug.wrappers import Request, Response

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
