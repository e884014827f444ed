"""The OpenAPI 3 document for the HTTP API, served at ``/openapi.json``.

The query parameters of ``/choose`` and ``/cluster/choose`` come from the table the handlers
parse them with (:data:`gpu_exporter.choose.params.PARAMS`: names, help, schemas); the answers'
object schemas (a lease, a GPU, a choice, the cluster's placements, the snapshot, an error) are
the ``components`` the paths refer to by ``#/components/schemas/<Name>``. The document is
checked by tests against the Flask routes and by a schemathesis run against the app.
"""

from __future__ import annotations

from typing import Any

from gpu_exporter import __version__
from gpu_exporter.choose.memory import MEM_ENV_NAMES
from gpu_exporter.choose.params import BY_NAME, DURATION_SCHEMA, PARAMS
from gpu_exporter.config import DEFAULT_CHOOSE_DEFAULTS
from gpu_exporter.model import VISIBILITIES

FREE_BY_DEFAULT = (
    "What 'free' means unless the request says otherwise: the exporter's --choose-defaults "
    f"(shipped: {DEFAULT_CHOOSE_DEFAULTS}, i.e. at most 50% utilization and at most 50% of "
    "the memory in use, as GPUtil's getAvailable). Each default applies only when the request "
    "does not give that parameter: max_util=100% turns that one off. A mem= request takes "
    "only the load defaults (max_util, max_mem_util). A figure a GPU cannot report (a MIG "
    "device has no utilization) passes a default, never a filter the request gave. "
    "format=json lists the filters applied and where each came from."
)


def _type(name: str | list[str], description: str | None = None) -> dict[str, Any]:
    return {"type": name} | ({"description": description} if description else {})


def _object(required: str, description: str = "", /, **properties: Any) -> dict[str, Any]:
    """An object schema: its required properties (space-separated), then every property."""
    schema = {"type": "object", "required": required.split(), "properties": properties}
    return schema | ({"description": description} if description else {})


def _array(items: Any, description: str | None = None) -> dict[str, Any]:
    return _type("array", description) | {"items": items}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


STRING, INTEGER, NUMBER, BOOLEAN = "string", "integer", "number", "boolean"
OPTIONAL_STRING, OPTIONAL_INTEGER = ["string", "null"], ["integer", "null"]
FILTERS: dict[str, Any] = {
    "type": "object",
    "description": "The filters applied: {name: {value, from: request or default}}.",
    "additionalProperties": _object(
        "value from", value={}, **{"from": {"enum": ["request", "default"]}}
    ),
}
ERROR = _object(
    "error",
    error=_object(
        "code message param",
        code=_type(STRING),
        message=_type(STRING),
        param=_type(OPTIONAL_STRING),
    ),
)
LEASE = _object(
    "id gpus indices created_at expires_at requester owner",
    id=_type(STRING, "Public: shown on the status page and /leases."),
    token=_type(
        STRING,
        "Renews and releases the lease (<id>.<secret>); only in the claim's answer, never in "
        "/leases.",
    ),
    gpus=_array(_type(STRING)),
    indices=_array(_type(INTEGER)),
    created_at=_type(NUMBER),
    expires_at=_type(NUMBER),
    requester=_type(STRING),
    owner=_type(OPTIONAL_STRING),
    pids=_array(_type(INTEGER), "The job's processes registered with the lease."),
    renewed=_type(BOOLEAN, "Renewed at least once: it then lasts until released or expired."),
    mem_bytes=_type(
        INTEGER,
        "A memory lease (mem=): the bytes reserved on each of its cards, which it shares with "
        "other memory leases. Absent for whole-card leases.",
    ),
    memory=_array(
        _object(
            "uuid index reserved_bytes attributed_bytes pids",
            uuid=_type(STRING),
            index=_type(INTEGER),
            reserved_bytes=_type(INTEGER),
            attributed_bytes=_type(INTEGER),
            pids=_array(_type(INTEGER)),
            committed_bytes=_type(INTEGER),
            usable_bytes=_type(INTEGER),
        ),
        "GET /leases, memory leases only: per card, what is attributed to the lease now (its "
        "registered PIDs, their descendants, their cgroup) and the card's committed and usable "
        "memory.",
    ),
)
MEM = _object(
    "bytes fraction env",
    "A memory lease's caps (mem= only): the bytes per card, the share less a 500 MiB CUDA "
    "context allowance as a fraction of the largest chosen card's total (so the cap fits on "
    f"each), and the environment format=env adds ({', '.join(MEM_ENV_NAMES)}).",
    bytes=_type(INTEGER),
    fraction={"type": NUMBER, "minimum": 0, "maximum": 1},
    env={
        "type": "object",
        "propertyNames": {"enum": list(MEM_ENV_NAMES)},
        "additionalProperties": _type(STRING),
    },
)
GPU = _object(
    "index uuid up",
    index=_type(INTEGER),
    uuid=_type(STRING),
    up=_type(BOOLEAN),
    name=_type(OPTIONAL_STRING),
    memory_free_bytes=_type(OPTIONAL_INTEGER),
    utilization_ratio=_type(["number", "null"]),
    parent_uuid=_type(OPTIONAL_STRING, "Set on MIG devices."),
    mig_devices=_array(_type("object")),
    processes=_type(["array", "null"])
    | {
        "items": _object(
            "pid used_memory_bytes", pid=_type(INTEGER), used_memory_bytes=_type(OPTIONAL_INTEGER)
        )
    },
    process_visibility={"enum": [*VISIBILITIES, None]},
)


def schemas() -> dict[str, Any]:
    """Every object schema, by the name the paths refer to (a new mapping on each call)."""
    host_url = {"host": _type(STRING), "url": _type(STRING)}
    return {
        "Error": ERROR,
        "Lease": LEASE,
        "Gpu": GPU,
        "Choice": _object(
            "n chosen rejected lease snapshot_age_seconds",
            n=_type(INTEGER),
            sort=_type(STRING),
            chosen=_array(_ref("Gpu")),
            rejected=_array(
                _object(
                    "index uuid reasons",
                    index=_type(INTEGER),
                    uuid=_type(STRING),
                    reasons=_array(_type(STRING)),
                )
            ),
            lease={"oneOf": [_ref("Lease"), _type("null")]},
            snapshot_age_seconds=_type(NUMBER),
            filters=FILTERS,
            mem=MEM,
        ),
        "Placements": _object(
            "n spread source placements passed_over",
            n=_type(INTEGER),
            spread=_type(BOOLEAN),
            source={"type": STRING, "enum": ["prometheus", "hosts"]},
            evaluated_at=_type(["number", "null"]),
            filters=FILTERS,
            placements=_array(
                _object(
                    "host url uuids indices lease",
                    **host_url,
                    uuids=_array(_type(STRING)),
                    indices=_array(_type(INTEGER)),
                    lease=_type(["object", "null"]),
                    chosen=_array(GPU),
                )
            ),
            passed_over=_array(_object("host url reason", **host_url, reason=_type(STRING))),
            notes=_array(_type(STRING)),
        ),
        "Snapshot": _object(
            "simulated nvml_up gpus",
            simulated=_type(BOOLEAN),
            nvml_up=_type(BOOLEAN),
            nvml_error=_type(OPTIONAL_STRING),
            fields_updated=_type(
                "object",
                "When each field (as in gpu_exporter_field_supported) is read: every sample, "
                "every --slow-interval, once, or off (--no-collect).",
            )
            | {"additionalProperties": _type(STRING)},
            gpus=_array(_ref("Gpu")),
        ),
    }


def _query_parameters(cluster: bool) -> list[dict[str, Any]]:
    """``/choose``'s (or ``/cluster/choose``'s) parameters, from :data:`PARAMS`."""
    return [
        _parameter(
            p.name, "query", dict(p.schema), (p.cluster_help or p.help) if cluster else p.help
        )
        for p in PARAMS
        if (p.cluster if cluster else p.choose)
    ]


def _parameter(
    name: str, where: str, schema: Any, description: str = "", required: bool = False
) -> dict[str, Any]:
    described = {"description": description} if description else {}
    return {"name": name, "in": where, "required": required, **described, "schema": schema}


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
        415: "A body that is neither a form nor a JSON object (unsupported_media_type): it is "
        "never ignored.",
        503: "Not enough GPUs qualify (not_enough_gpus), NVML is unavailable "
        "(nvml_unavailable), the sample is stale (snapshot_stale), the server is at its "
        "request or waiter limit (too_many_requests with Retry-After, too_many_waiters), "
        "the lease could not be saved to --state-dir (state_unwritable: nothing was claimed "
        "or renewed), or it is shutting down (shutting_down).",
    }
    described.update({int(k.removeprefix("s")): v for k, v in override.items()})
    return {str(s): _answer(described[s], json=_ref("Error"), text=_type(STRING)) for s in statuses}


def _with_body(choose_op: dict[str, Any]) -> dict[str, Any]:
    """``POST /choose``: the same parameters in the query string, a form or a JSON object
    (a list for include/exclude), validated alike."""
    properties = {
        p["name"]: {"anyOf": [p["schema"], {"type": "number"}, _array(_type(STRING))]}
        for p in choose_op["parameters"]
    }
    body = {"type": "object", "properties": properties, "additionalProperties": False}
    return {
        **choose_op,
        "operationId": "choosePost",
        "requestBody": {
            "required": False,
            "content": {
                "application/json": {"schema": body},
                "application/x-www-form-urlencoded": {"schema": body},
            },
        },
        "responses": {**choose_op["responses"], **_errors(415)},
    }


def _answer(description: str, **schemas: Any) -> dict[str, Any]:
    """A response: its description, and its schema by media type (``text``, ``json``, ``html``)."""
    types = {"text": "text/plain", "json": "application/json", "html": "text/html"}
    content = {types[t]: {"schema": s} for t, s in schemas.items()}
    return {"description": description, "content": content}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return _answer(description, json=schema)


def _text(description: str) -> dict[str, Any]:
    return _answer(description, text=_type(STRING))


def _header(description: str) -> dict[str, Any]:
    return {"schema": _type(STRING), "description": description}


def document() -> dict[str, Any]:
    # Here, not at the top: the fleet reader is loaded only where /cluster/choose is served.
    from gpu_exporter.fleet.reading import MAX_ANSWER_BYTES, READ_SECONDS

    choose_ok = _answer(
        "The chosen GPUs (and the lease, unless lease=0).", text=_type(STRING), json=_ref("Choice")
    ) | {
        "headers": {
            "X-GPU-Lease": _header(
                "The lease's token (<id>.<secret>): DELETE /leases/<token> releases it. Not sent "
                "for lease=0 or HEAD."
            )
        }
    }
    choose_op = {
        "summary": "Choose the freest GPUs and claim them with a lease",
        "description": FREE_BY_DEFAULT
        + " HEAD never claims: it answers as lease=0. With an Idempotency-Key, a "
        "retry from the same client address with the same parameters gets the lease the "
        "first try made (same GPUs, same token) while it is active.",
        "parameters": [
            *_query_parameters(cluster=False),
            _parameter(
                "Idempotency-Key",
                "header",
                {"type": STRING, "maxLength": 257},
                'Up to 255 visible ASCII characters, e.g. a quoted UUID ("8e03978e-…"); the IETF '
                "httpapi draft. Malformed: 400 invalid_idempotency_key.",
            ),
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
            "200": _answer(
                "Where the GPUs are, and the lease each host granted.",
                text=_type(STRING),
                json=_ref("Placements"),
            )
            | {
                "headers": {
                    "X-GPU-Host": _header("The host."),
                    "X-GPU-Lease": _header("The lease's token, as from /choose."),
                }
            },
            **_errors(
                400,
                404,
                503,
                s404="This exporter was started without --prometheus-url.",
                s503="Not enough GPUs qualify on any host (not_enough_gpus), Prometheus cannot "
                f"be asked, answers nothing within {READ_SECONDS:g} s or more than "
                f"{MAX_ANSWER_BYTES >> 20} MiB (prometheus_unavailable), every fleet read slot "
                "is busy (store_busy), or the exporter is "
                "shutting down (shutting_down).",
            ),
        },
    }
    lease_id = _parameter(
        "lease_id",
        "path",
        _type(STRING),
        "The lease's token (X-GPU-Lease, $GPU_LEASE); its id alone only for --lease-admins (or "
        "a lease from before tokens).",
        required=True,
    )
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
            "/choose": {"get": choose_op, "post": _with_body(choose_op)},
            "/cluster/choose": {"get": cluster_op},
            "/leases": {
                "get": {
                    "summary": "Active leases",
                    "responses": {
                        "200": _json(
                            _object("leases", leases=_array(_ref("Lease"))),
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
                            _object("released lease", released=_type(STRING), lease=_ref("Lease")),
                            "Released.",
                        ),
                        **_errors(400, 403, 404),
                    },
                }
            },
            "/leases/{lease_id}/renew": {
                "post": {
                    "summary": "Extend a lease",
                    "parameters": [lease_id, _parameter("ttl", "query", DURATION_SCHEMA)],
                    "responses": {
                        "200": _json(_ref("Lease"), "The renewed lease."),
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
                        _parameter("pid", "query", BY_NAME["pid"].schema, required=True),
                    ],
                    "responses": {
                        "200": _json(_ref("Lease"), "The lease, with its registered pids."),
                        **_errors(400, 404),
                    },
                }
            },
            "/gpus": {
                "get": {
                    "summary": "The current snapshot",
                    "responses": {"200": _json(_ref("Snapshot"), "")},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "parameters": [
                        _parameter(
                            "name[]",
                            "query",
                            _array(_type(STRING)),
                            "Serve only these metric (sample) names; repeatable.",
                        )
                        | {"style": "form", "explode": True}
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
                    "responses": {"200": _answer("HTML", html=_type(STRING))},
                }
            },
        },
        "components": {
            "securitySchemes": {"basicAuth": {"type": "http", "scheme": "basic"}},
            "schemas": schemas(),
        },
    }
