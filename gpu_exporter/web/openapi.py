"""The OpenAPI 3 document for the HTTP API, served at ``/openapi.json``.

The query parameters of ``/choose`` and ``/cluster/choose`` come from the table the handlers
parse them with (:data:`gpu_exporter.choose.params.PARAMS`: names, help, schemas); the
document is checked by tests against the Flask routes and by a schemathesis run against the app.
"""

from __future__ import annotations

from typing import Any

from gpu_exporter import __version__
from gpu_exporter.choose.params import BY_NAME, DURATION_SCHEMA, PARAMS
from gpu_exporter.config import DEFAULT_CHOOSE_DEFAULTS
from gpu_exporter.web.openapi_schemas import LEASE_REF, schemas

FREE_BY_DEFAULT = (
    "What 'free' means unless the request says otherwise: the exporter's --choose-defaults "
    f"(shipped: {DEFAULT_CHOOSE_DEFAULTS}, i.e. under 50% utilization and 50% "
    "memory-bandwidth utilization, as GPUtil's getAvailable). Each default applies only when "
    "the request does not give that parameter: max_util=100% turns that one off. A figure a "
    "GPU cannot report (a MIG device has no utilization) passes a default, never a filter the "
    "request gave. format=json lists the filters applied and where each came from."
)


def _query_parameters(cluster: bool) -> list[dict[str, Any]]:
    """``/choose``'s (or ``/cluster/choose``'s) parameters, from :data:`PARAMS`."""
    return [
        {
            "name": p.name,
            "in": "query",
            "required": False,
            "description": (p.cluster_help or p.help) if cluster else p.help,
            "schema": dict(p.schema),
        }
        for p in PARAMS
        if (p.cluster if cluster else p.choose)
    ]


def _errors(*statuses: int, **override: str) -> dict[str, Any]:
    described = {
        400: "Invalid or unknown parameter; mig_single_device: n>1 MIG devices asked for in "
        "a format that puts them in one CUDA_VISIBLE_DEVICES (a CUDA process can use only one "
        "MIG device: ask for format=list or json).",
        403: "The lease's token is needed, not its id (forbidden); only --lease-admins may "
        "name a lease by its id.",
        404: "No such lease.",
        409: "The lease claimed with this Idempotency-Key has ended (lease_ended).",
        422: "This Idempotency-Key was used with other parameters (idempotency_key_reused).",
        429: "Over a lease limit, or this client already has --max-waiters-per-requester "
        "requests waiting (too_many_waiters).",
        414: "The query string is longer than 4096 bytes (uri_too_long).",
        503: "Not enough GPUs qualify (not_enough_gpus), NVML is unavailable "
        "(nvml_unavailable), the sample is stale (snapshot_stale), the server is at its "
        "request or waiter limit (too_many_requests with Retry-After, too_many_waiters), "
        "the lease could not be saved to --state-dir (state_unwritable: nothing was claimed "
        "or renewed), or it is shutting down (shutting_down).",
    }
    described.update({int(k.removeprefix("s")): v for k, v in override.items()})
    return {
        str(s): {
            "description": described[s],
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/Error"}},
                "text/plain": {"schema": {"type": "string"}},
            },
        }
        for s in statuses
    }


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _text(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"text/plain": {"schema": {"type": "string"}}}}


def document() -> dict[str, Any]:
    choose_ok = {
        "description": "The chosen GPUs (and the lease, unless lease=0).",
        "headers": {
            "X-GPU-Lease": {
                "schema": {"type": "string"},
                "description": "The lease's token (<id>.<secret>): DELETE /leases/<token> "
                "releases it. Not sent for lease=0 or HEAD.",
            }
        },
        "content": {
            "text/plain": {"schema": {"type": "string"}},
            "application/json": {"schema": {"$ref": "#/components/schemas/Choice"}},
        },
    }
    choose_op = {
        "summary": "Choose the freest GPUs and claim them with a lease",
        "description": FREE_BY_DEFAULT
        + " HEAD never claims: it answers as lease=0. With an Idempotency-Key, a "
        "retry from the same client address with the same parameters gets the lease the "
        "first try made (same GPUs, same token) while it is active.",
        "parameters": [
            *_query_parameters(cluster=False),
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "description": "Up to 255 visible ASCII characters, e.g. a quoted UUID "
                '("8e03978e-…"); the IETF httpapi draft. Malformed: 400 '
                "invalid_idempotency_key.",
                "schema": {"type": "string", "maxLength": 257},
            },
        ],
        "responses": {"200": choose_ok, **_errors(400, 409, 414, 422, 429, 503)},
    }
    cluster_op = {
        "summary": "Choose GPUs across the hosts Prometheus scrapes; the host's exporter leases "
        "them",
        "description": FREE_BY_DEFAULT + " The chosen host applies its own defaults again "
        "when it claims.",
        "parameters": _query_parameters(cluster=True),
        "responses": {
            "200": {
                "description": "Where the GPUs are, and the lease each host granted.",
                "headers": {
                    "X-GPU-Host": {"schema": {"type": "string"}, "description": "The host."},
                    "X-GPU-Lease": {
                        "schema": {"type": "string"},
                        "description": "The lease's token, as from /choose.",
                    },
                },
                "content": {
                    "text/plain": {"schema": {"type": "string"}},
                    "application/json": {"schema": {"$ref": "#/components/schemas/Placements"}},
                },
            },
            **_errors(
                400,
                404,
                503,
                s404="This exporter was started without --prometheus-url.",
                s503="Not enough GPUs qualify on any host, or Prometheus cannot be asked.",
            ),
        },
    }
    lease_id = {
        "name": "lease_id",
        "in": "path",
        "required": True,
        "description": "The lease's token (X-GPU-Lease, $GPU_LEASE); its id alone only for "
        "--lease-admins (or a lease from before tokens).",
        "schema": {"type": "string"},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "gpu-exporter",
            "version": __version__,
            "description": "NVML metrics for Prometheus and a race-free free-GPU picker. "
            "With basic_auth_users in --web-config-file, requests without valid credentials "
            "get 401 and WWW-Authenticate (all of them, or with --auth-scope writes only those "
            "that take leases; /healthz and /readyz never need credentials).",
        },
        # No credentials, or HTTP basic auth when the exporter is configured for it.
        "security": [{}, {"basicAuth": []}],
        "paths": {
            "/choose": {"get": choose_op, "post": {**choose_op, "operationId": "choosePost"}},
            "/cluster/choose": {"get": cluster_op},
            "/leases": {
                "get": {
                    "summary": "Active leases",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["leases"],
                                "properties": {"leases": {"type": "array", "items": LEASE_REF}},
                            },
                            "Active leases, oldest first.",
                        ),
                        **_errors(400),
                    },
                }
            },
            "/leases/{lease_id}": {
                "delete": {
                    "summary": "Release a lease",
                    "parameters": [lease_id],
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["released", "lease"],
                                "properties": {"released": {"type": "string"}, "lease": LEASE_REF},
                            },
                            "Released.",
                        ),
                        **_errors(400, 403, 404),
                    },
                }
            },
            "/leases/{lease_id}/renew": {
                "post": {
                    "summary": "Extend a lease",
                    "parameters": [
                        lease_id,
                        {
                            "name": "ttl",
                            "in": "query",
                            "required": False,
                            "schema": DURATION_SCHEMA,
                        },
                    ],
                    "responses": {
                        "200": _json(LEASE_REF, "The renewed lease."),
                        **_errors(400, 403, 404, 429, 503),
                    },
                }
            },
            "/leases/{lease_id}/pids": {
                "post": {
                    "summary": "Register the job's processes with its lease",
                    "description": BY_NAME["pid"].help,
                    "parameters": [
                        lease_id,
                        {
                            "name": "pid",
                            "in": "query",
                            "required": True,
                            "schema": BY_NAME["pid"].schema,
                        },
                    ],
                    "responses": {
                        "200": _json(LEASE_REF, "The lease, with its registered pids."),
                        **_errors(400, 404),
                    },
                }
            },
            "/gpus": {
                "get": {
                    "summary": "The current snapshot",
                    "responses": {"200": _json({"$ref": "#/components/schemas/Snapshot"}, "")},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "parameters": [
                        {
                            "name": "name[]",
                            "in": "query",
                            "required": False,
                            "description": "Serve only these metric (sample) names; repeatable.",
                            "schema": {"type": "array", "items": {"type": "string"}},
                            "style": "form",
                            "explode": True,
                        }
                    ],
                    "responses": {"200": _text(""), **_errors(400)},
                }
            },
            "/healthz": {"get": {"summary": "Liveness", "responses": {"200": _text("ok")}}},
            "/readyz": {
                "get": {
                    "summary": "Readiness: NVML up, the sample fresh, leases can be saved",
                    "responses": {"200": _text("ready"), "503": _text("not ready: <reason>")},
                }
            },
            "/openapi.json": {
                "get": {"summary": "This document", "responses": {"200": _json({}, "")}}
            },
            "/": {
                "get": {
                    "summary": "Status page",
                    "responses": {
                        "200": {
                            "description": "HTML",
                            "content": {"text/html": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "securitySchemes": {"basicAuth": {"type": "http", "scheme": "basic"}},
            "schemas": schemas(),
        },
    }
