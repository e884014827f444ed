"""The OpenAPI 3 document for the HTTP API, served at ``/openapi.json``.

Built from the same tuples the handlers validate against (``CHOOSE_PARAMS``,
``CHOOSE_FORMATS``, ``SORTS``), and checked by tests against the Flask routes and by a
schemathesis run against the app.
"""

from __future__ import annotations

from typing import Any

from gpu_exporter import __version__
from gpu_exporter.choose.rank import MIG_MODES, SORTS

_DURATION = {"type": "string", "pattern": r"^\s*[0-9]+(\.[0-9]+)?\s*(ms|s|m|h)?\s*$"}
_SIZE = {"type": "string", "examples": ["8GiB", "500MB", "1073741824"]}
_RATIO = {"type": "string", "examples": ["0.3", "30%"]}
_SELECTORS = {"type": "string", "examples": ["0,GPU-5a1e", "00000000:3B:00.0"]}

_CHOOSE_PARAMETERS: dict[str, tuple[str, dict[str, Any]]] = {
    "n": ("How many GPUs (1-1024).", {"type": "integer", "minimum": 1, "maximum": 1024}),
    "format": (
        "uuid (default), index, env or json.",
        {"type": "string", "enum": ["uuid", "index", "env", "json"]},
    ),
    "lease": ("Claim the GPUs for this long (default 60s); 0 = advice only.", _DURATION),
    "owner": ("A label shown in /leases.", {"type": "string", "maxLength": 64}),
    "wait": (
        "Wait up to this long (at most 1h) for enough GPUs, first come first served.",
        _DURATION,
    ),
    "idle_for": ("Every sample of this window must meet the filters.", _DURATION),
    "sort": ("Ranking order.", {"type": "string", "enum": list(SORTS)}),
    "min_free": ("Free memory at least this.", _SIZE),
    "min_total": ("Total memory at least this.", _SIZE),
    "max_util": ("GPU utilization at most this.", _RATIO),
    "max_mem_util": ("Memory-controller utilization at most this.", _RATIO),
    "max_procs": ("At most this many compute processes.", {"type": "integer", "minimum": 0}),
    "model": ("The GPU name contains this (case-insensitive).", {"type": "string"}),
    "include": ("Only these GPUs: indices, UUIDs or prefixes, PCI bus ids.", _SELECTORS),
    "exclude": ("Never these GPUs: indices, UUIDs or prefixes, PCI bus ids.", _SELECTORS),
    "mig": (
        "MIG devices: deny (default, whole cards only), allow (whole cards and MIG devices) or "
        "only (MIG devices only). A MIG device is returned as its MIG-… UUID.",
        {"type": "string", "enum": list(MIG_MODES)},
    ),
}

_CLUSTER_PARAMETERS: dict[str, tuple[str, dict[str, Any]]] = {
    **{k: v for k, v in _CHOOSE_PARAMETERS.items() if k != "mig"},  # whole cards only
    "format": (
        "uuid (default): 'HOST GPU-a,GPU-b' per host; index: 'HOST 0,1'; env: an export line "
        "with GPU_HOST and GPU_EXPORTER_URL (one host only); json.",
        {"type": "string", "enum": ["uuid", "index", "env", "json"]},
    ),
    "wait": (
        "Read the fleet again every 5 s for up to this long (at most 1h) until enough GPUs "
        "qualify; no first-come-first-served order across the fleet.",
        _DURATION,
    ),
    "idle_for": (
        "Every GPU must have met the filters throughout this window, by Prometheus' range "
        "functions (max_over_time, min_over_time).",
        _DURATION,
    ),
    "spread": (
        "0 (default): all n GPUs on one host; 1: several hosts may share them.",
        {"type": "string", "enum": ["0", "1", "true", "false"]},
    ),
    "max_age": (
        "Fleet figures older than this (default 60s) are never used to hand out GPUs.",
        _DURATION,
    ),
}

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message", "param"],
            "properties": {
                "code": {"type": "string"},
                "message": {"type": "string"},
                "param": {"type": ["string", "null"]},
            },
        }
    },
}
_LEASE = {
    "type": "object",
    "required": ["id", "gpus", "indices", "created_at", "expires_at", "requester", "owner"],
    "properties": {
        "id": {"type": "string"},
        "gpus": {"type": "array", "items": {"type": "string"}},
        "indices": {"type": "array", "items": {"type": "integer"}},
        "created_at": {"type": "number"},
        "expires_at": {"type": "number"},
        "requester": {"type": "string"},
        "owner": {"type": ["string", "null"]},
    },
}
_GPU = {
    "type": "object",
    "required": ["index", "uuid", "up"],
    "properties": {
        "index": {"type": "integer"},
        "uuid": {"type": "string"},
        "up": {"type": "boolean"},
        "name": {"type": ["string", "null"]},
        "memory_free_bytes": {"type": ["integer", "null"]},
        "utilization_ratio": {"type": ["number", "null"]},
        "parent_uuid": {"type": ["string", "null"], "description": "Set on MIG devices."},
        "mig_devices": {"type": "array", "items": {"type": "object"}},
        "processes": {
            "type": ["array", "null"],
            "items": {
                "type": "object",
                "required": ["pid", "used_memory_bytes"],
                "properties": {
                    "pid": {"type": "integer"},
                    "used_memory_bytes": {"type": ["integer", "null"]},
                },
            },
        },
        "process_visibility": {"enum": ["full", "partial", "none", None]},
    },
}


def _errors(*statuses: int, **override: str) -> dict[str, Any]:
    described = {
        400: "Invalid or unknown parameter.",
        404: "No such lease.",
        429: "Over a lease limit.",
        414: "The query string is longer than 4096 bytes (uri_too_long).",
        503: "Not enough GPUs qualify (not_enough_gpus), NVML is unavailable "
        "(nvml_unavailable), the sample is stale (snapshot_stale), the server is at its "
        "request or waiter limit (too_many_requests with Retry-After, too_many_waiters), or "
        "it is shutting down (shutting_down).",
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
    choose_params = [
        {"name": name, "in": "query", "required": False, "description": d, "schema": schema}
        for name, (d, schema) in _CHOOSE_PARAMETERS.items()
    ]
    choose_ok = {
        "description": "The chosen GPUs (and the lease, unless lease=0).",
        "headers": {"X-GPU-Lease": {"schema": {"type": "string"}, "description": "Lease id."}},
        "content": {
            "text/plain": {"schema": {"type": "string"}},
            "application/json": {"schema": {"$ref": "#/components/schemas/Choice"}},
        },
    }
    choose_op = {
        "summary": "Choose the freest GPUs and claim them with a lease",
        "parameters": choose_params,
        "responses": {"200": choose_ok, **_errors(400, 414, 429, 503)},
    }
    cluster_op = {
        "summary": "Choose GPUs across the hosts Prometheus scrapes; the host's exporter leases "
        "them",
        "parameters": [
            {"name": name, "in": "query", "required": False, "description": d, "schema": schema}
            for name, (d, schema) in _CLUSTER_PARAMETERS.items()
        ],
        "responses": {
            "200": {
                "description": "Where the GPUs are, and the lease each host granted.",
                "headers": {
                    "X-GPU-Host": {"schema": {"type": "string"}, "description": "The host."},
                    "X-GPU-Lease": {"schema": {"type": "string"}, "description": "Lease id."},
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
    lease_id = {"name": "lease_id", "in": "path", "required": True, "schema": {"type": "string"}}
    lease_ref = {"$ref": "#/components/schemas/Lease"}
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
                                "properties": {"leases": {"type": "array", "items": lease_ref}},
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
                                "properties": {"released": {"type": "string"}, "lease": lease_ref},
                            },
                            "Released.",
                        ),
                        **_errors(400, 404),
                    },
                }
            },
            "/leases/{lease_id}/renew": {
                "post": {
                    "summary": "Extend a lease",
                    "parameters": [
                        lease_id,
                        {"name": "ttl", "in": "query", "required": False, "schema": _DURATION},
                    ],
                    "responses": {
                        "200": _json(lease_ref, "The renewed lease."),
                        **_errors(400, 404, 429),
                    },
                }
            },
            "/gpus": {
                "get": {
                    "summary": "The current snapshot",
                    "responses": {"200": _json({"$ref": "#/components/schemas/Snapshot"}, "")},
                }
            },
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": _text("")}}},
            "/healthz": {"get": {"summary": "Liveness", "responses": {"200": _text("ok")}}},
            "/readyz": {
                "get": {
                    "summary": "Readiness: NVML up and the sample fresh",
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
            "schemas": {
                "Error": _ERROR,
                "Lease": _LEASE,
                "Gpu": _GPU,
                "Choice": {
                    "type": "object",
                    "required": ["n", "chosen", "rejected", "lease", "snapshot_age_seconds"],
                    "properties": {
                        "n": {"type": "integer"},
                        "sort": {"type": "string"},
                        "chosen": {"type": "array", "items": {"$ref": "#/components/schemas/Gpu"}},
                        "rejected": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["index", "uuid", "reasons"],
                                "properties": {
                                    "index": {"type": "integer"},
                                    "uuid": {"type": "string"},
                                    "reasons": {"type": "array", "items": {"type": "string"}},
                                },
                            },
                        },
                        "lease": {"oneOf": [lease_ref, {"type": "null"}]},
                        "snapshot_age_seconds": {"type": "number"},
                    },
                },
                "Placements": {
                    "type": "object",
                    "required": ["n", "spread", "source", "placements", "passed_over"],
                    "properties": {
                        "n": {"type": "integer"},
                        "spread": {"type": "boolean"},
                        "source": {"type": "string", "enum": ["prometheus", "hosts"]},
                        "evaluated_at": {"type": ["number", "null"]},
                        "placements": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["host", "url", "uuids", "indices", "lease"],
                                "properties": {
                                    "host": {"type": "string"},
                                    "url": {"type": "string"},
                                    "uuids": {"type": "array", "items": {"type": "string"}},
                                    "indices": {"type": "array", "items": {"type": "integer"}},
                                    "lease": {"type": ["object", "null"]},
                                    "chosen": {"type": "array", "items": _GPU},
                                },
                            },
                        },
                        "passed_over": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["host", "url", "reason"],
                                "properties": {
                                    "host": {"type": "string"},
                                    "url": {"type": "string"},
                                    "reason": {"type": "string"},
                                },
                            },
                        },
                        "notes": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "Snapshot": {
                    "type": "object",
                    "required": ["simulated", "nvml_up", "gpus"],
                    "properties": {
                        "simulated": {"type": "boolean"},
                        "nvml_up": {"type": "boolean"},
                        "nvml_error": {"type": ["string", "null"]},
                        "gpus": {"type": "array", "items": {"$ref": "#/components/schemas/Gpu"}},
                    },
                },
            },
        },
    }
