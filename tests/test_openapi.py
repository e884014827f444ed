"""/openapi.json is valid, covers every route and parameter, and the app keeps to it."""

from __future__ import annotations

import pytest
import schemathesis
from flask import Flask
from hypothesis import HealthCheck, settings
from openapi_spec_validator import validate
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from conftest import FakeClock, Stack, build_stack
from gpu_exporter.choose.params import CHOOSE_FORMATS, CHOOSE_PARAMS, CLUSTER_PARAMS
from gpu_exporter.simulate import Scenario, SimulatedNvml
from gpu_exporter.web.openapi import document


def test_document_is_valid_openapi() -> None:
    validate(document())  # type: ignore[arg-type]


def test_served_document_equals_the_module(stack: Stack) -> None:
    assert stack.client.get("/openapi.json").get_json() == document()


def test_every_route_is_documented_and_nothing_else(stack: Stack) -> None:
    routes = set()
    for rule in stack.app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = rule.rule.replace("<lease_id>", "{lease_id}")
        routes |= {(path, m.lower()) for m in rule.methods or () if m not in ("HEAD", "OPTIONS")}
    routes.add(("/metrics", "get"))  # mounted WSGI app, not a Flask rule
    documented = {(p, m) for p, ops in document()["paths"].items() for m in ops}
    assert routes == documented


def test_choose_parameters_match_the_handler() -> None:
    params = document()["paths"]["/choose"]["get"]["parameters"]
    assert tuple(p["name"] for p in params if p["in"] == "query") == CHOOSE_PARAMS
    assert [p["name"] for p in params if p["in"] == "header"] == ["Idempotency-Key"]
    fmt = next(p for p in params if p["name"] == "format")
    assert tuple(fmt["schema"]["enum"]) == CHOOSE_FORMATS


def test_cluster_choose_parameters_match_the_handler() -> None:
    params = document()["paths"]["/cluster/choose"]["get"]["parameters"]
    assert tuple(p["name"] for p in params) == CLUSTER_PARAMS


def test_cluster_choose_describes_sm_activity_across_the_fleet() -> None:
    params = {p["name"]: p for p in document()["paths"]["/cluster/choose"]["get"]["parameters"]}
    described = params["max_sm_active"]["description"]
    assert "gpu_sm_active_ratio" in described and "gpu_utilization_ratio" in described
    assert "sm_active" in params["sort"]["schema"]["enum"]


def test_cluster_choose_without_prometheus_is_a_documented_404(stack: Stack) -> None:
    resp = stack.client.get("/cluster/choose?n=1&format=json")
    assert resp.status_code == 404
    assert resp.get_json()["error"]["code"] == "not_configured"
    assert "--prometheus-url" in resp.get_json()["error"]["message"]
    # Parameters are checked first, as everywhere.
    resp = stack.client.get("/cluster/choose?n=1&spread=2")
    assert resp.status_code == 400 and resp.text.startswith("error: spread must be 0 or 1")


class _FastClock(FakeClock):
    """Every read moves time on 10 minutes: waits end at once, leases expire between calls."""

    def time(self) -> float:
        self.advance(600)
        return super().time()

    def monotonic(self) -> float:
        self.advance(600)
        return super().monotonic()


def _fuzz_app() -> Flask:
    clock = _FastClock()
    s = build_stack(
        lambda c: SimulatedNvml.of(Scenario.with_gpus(4), clock=c.monotonic),
        clock=clock,
        max_age_seconds=1e12,
    )
    s.sample()
    return s.app


@schemathesis.check
def no_crash(ctx: object, response: schemathesis.Response, case: schemathesis.Case) -> bool:
    """5xx only as the documented 503 (not enough GPUs, NVML down, stale) — never a 500."""
    assert response.status_code < 500 or response.status_code == 503, response.content[:300]
    assert b"Traceback" not in response.content
    return True


schema = schemathesis.openapi.from_wsgi("/openapi.json", _fuzz_app())


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_schemathesis_finds_no_5xx_and_no_schema_violation(case: schemathesis.Case) -> None:
    case.call_and_validate(
        checks=[
            no_crash,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ]
    )
