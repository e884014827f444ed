"""The JSON schemas of the HTTP API's answers, for the OpenAPI document's ``components``.

Kept apart from :mod:`gpu_exporter.web.openapi` (which assembles the paths and operations) so
each stays short: these are the shapes of the objects the handlers return (a lease, a GPU, a
choice, the cluster's placements, the snapshot, an error), referenced from the paths by
``#/components/schemas/<Name>``.
"""

from __future__ import annotations

from typing import Any

from gpu_exporter.choose.memory import MEM_ENV_NAMES

LEASE_REF = {"$ref": "#/components/schemas/Lease"}

FILTERS: dict[str, Any] = {
    "type": "object",
    "description": "The filters applied: {name: {value, from: request or default}}.",
    "additionalProperties": {
        "type": "object",
        "required": ["value", "from"],
        "properties": {"value": {}, "from": {"enum": ["request", "default"]}},
    },
}
ERROR: dict[str, Any] = {
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
LEASE: dict[str, Any] = {
    "type": "object",
    "required": ["id", "gpus", "indices", "created_at", "expires_at", "requester", "owner"],
    "properties": {
        "id": {"type": "string", "description": "Public: shown on the status page and /leases."},
        "token": {
            "type": "string",
            "description": "Renews and releases the lease (<id>.<secret>); only in the claim's "
            "answer, never in /leases.",
        },
        "gpus": {"type": "array", "items": {"type": "string"}},
        "indices": {"type": "array", "items": {"type": "integer"}},
        "created_at": {"type": "number"},
        "expires_at": {"type": "number"},
        "requester": {"type": "string"},
        "owner": {"type": ["string", "null"]},
        "pids": {
            "type": "array",
            "items": {"type": "integer"},
            "description": "The job's processes registered with the lease.",
        },
        "renewed": {
            "type": "boolean",
            "description": "Renewed at least once: it then lasts until released or expired.",
        },
        "mem_bytes": {
            "type": "integer",
            "description": "A memory lease (mem=): the bytes reserved on each of its cards, "
            "which it shares with other memory leases. Absent for whole-card leases.",
        },
        "memory": {
            "type": "array",
            "description": "GET /leases, memory leases only: per card, what is attributed to "
            "the lease now (its registered PIDs, their descendants, their cgroup) and the "
            "card's committed and usable memory.",
            "items": {
                "type": "object",
                "required": ["uuid", "index", "reserved_bytes", "attributed_bytes", "pids"],
                "properties": {
                    "uuid": {"type": "string"},
                    "index": {"type": "integer"},
                    "reserved_bytes": {"type": "integer"},
                    "attributed_bytes": {"type": "integer"},
                    "pids": {"type": "array", "items": {"type": "integer"}},
                    "committed_bytes": {"type": "integer"},
                    "usable_bytes": {"type": "integer"},
                },
            },
        },
    },
}
MEM: dict[str, Any] = {
    "type": "object",
    "description": "A memory lease's caps (mem= only): the bytes per card, the share less a "
    "500 MiB CUDA context allowance as a fraction of the largest chosen card's total (so the "
    f"cap fits on each), and the environment format=env adds ({', '.join(MEM_ENV_NAMES)}).",
    "required": ["bytes", "fraction", "env"],
    "properties": {
        "bytes": {"type": "integer"},
        "fraction": {"type": "number", "minimum": 0, "maximum": 1},
        "env": {
            "type": "object",
            "propertyNames": {"enum": list(MEM_ENV_NAMES)},
            "additionalProperties": {"type": "string"},
        },
    },
}
GPU: dict[str, Any] = {
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


def schemas() -> dict[str, Any]:
    """Every object schema, by the name the paths refer to (a new mapping on each call)."""
    return {
        "Error": ERROR,
        "Lease": LEASE,
        "Gpu": GPU,
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
                "lease": {"oneOf": [LEASE_REF, {"type": "null"}]},
                "snapshot_age_seconds": {"type": "number"},
                "filters": FILTERS,
                "mem": MEM,
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
                "filters": FILTERS,
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
                            "chosen": {"type": "array", "items": GPU},
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
                "fields_updated": {
                    "type": "object",
                    "description": "When each field (as in gpu_exporter_field_supported) is "
                    "read: every sample, every --slow-interval, once, or off (--no-collect).",
                    "additionalProperties": {"type": "string"},
                },
                "gpus": {"type": "array", "items": {"$ref": "#/components/schemas/Gpu"}},
            },
        },
    }
