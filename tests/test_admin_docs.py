"""What a Prometheus or Grafana admin copies from the docs agrees with the shipped files:
one scrape job name (the one ``GpuExporterTargetDown`` selects), state kept on a volume, a
datasource that leaves the admin's default alone, one install command."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy/prometheus/gpu-exporter.rules.yml"


def _texts() -> dict[str, str]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += [p for p in sorted((ROOT / "deploy").rglob("*")) if p.is_file()]
    files += [ROOT / "docker-compose.yml", ROOT / "Dockerfile"]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def _alert_job() -> str:
    rules = yaml.safe_load(RULES.read_text())
    (expr,) = [
        r["expr"]
        for g in rules["groups"]
        for r in g["rules"]
        if r.get("alert") == "GpuExporterTargetDown"
    ]
    match = re.search(r'job="([^"]+)"', expr)
    assert match, expr
    return match.group(1)


def test_every_scrape_job_is_the_one_the_alert_expects() -> None:
    job = _alert_job()
    seen = 0
    for name, text in _texts().items():
        for found in re.findall(r"job_name:\s*\"?([\w.-]+)", text):
            seen += 1
            assert found == job, (
                f"{name}: job_name {found!r}, but GpuExporterTargetDown wants {job!r}"
            )
        if name.endswith(".rules.test.yml"):
            continue  # the rule tests' own series
        for found in re.findall(r'\bjob="([^"]+)"', text):
            assert found == job, f"{name}: job={found!r}, but GpuExporterTargetDown wants {job!r}"
    assert seen >= 4  # README (3), docs/cluster.md, deploy/prometheus


def test_docker_run_examples_keep_state_on_a_volume() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "GPU_EXPORTER_STATE_DIR=/var/lib/gpu-exporter" in dockerfile
    assert 'VOLUME ["/var/lib/gpu-exporter"]' in dockerfile
    runs = [
        line
        for text in _texts().values()
        for line in text.splitlines()
        if re.search(r"\bdocker run\b.*\bgpu-exporter\b", line) and "-p 9400" in line
    ]
    assert len(runs) >= 3
    for line in runs:
        assert ":/var/lib/gpu-exporter" in line, line
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    volumes = compose["services"]["gpu-exporter"]["volumes"]
    assert any(v.endswith(":/var/lib/gpu-exporter") for v in volumes)


def test_grafana_provisioning_leaves_the_admins_default_alone() -> None:
    provisioned = yaml.safe_load(
        (ROOT / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    for source in provisioned["datasources"]:
        assert not source.get("isDefault", False)
        assert source["name"] != "Prometheus"  # the usual name of the admin's own one
        assert source["uid"] != "prometheus"


def test_systemd_unit_installs_as_the_readme_does() -> None:
    readme = (ROOT / "README.md").read_text()
    unit = (ROOT / "deploy/systemd/gpu-exporter.service").read_text()
    install = re.search(r"/opt/gpu-exporter/bin/pip install (\S+)", readme)
    assert install
    assert f"/opt/gpu-exporter/bin/pip install {install.group(1)} " in unit
