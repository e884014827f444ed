"""``--metric-names=dcgm|both``: dcgm-exporter's names, types, help, units and labels, read the
way its users read them (tests/dcgmusage.py), from the same snapshot as gpu-exporter's names.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import dcgmusage
from conftest import Stack, build_stack, sim_of
from gpu_exporter import cli
from gpu_exporter.podallocations import PodAllocations, PodDevice
from gpu_exporter.simulate import Fault, Load, SimGpu

A100 = "NVIDIA A100-SXM4-80GB"
PROFILES = ("3g.40gb", "2g.20gb", "1g.10gb")
RULES = Path(__file__).parent.parent / "deploy" / "prometheus" / "gpu-exporter.rules.yml"
SERIES = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Series = tuple[str, dict[str, str], float]


def host(names: str, **config: object) -> Stack:
    stack = build_stack(
        sim_of(
            SimGpu(0, A100, Load("constant", utilization=0.57, memory_used_ratio=0.3)),
            SimGpu(1, A100, Load("light"), mig=PROFILES),
            SimGpu(2, "NVIDIA GeForce GTX 1080", Load("busy")),  # no remapped rows, no reserved
            SimGpu(3, A100, Load("idle")),
            SimGpu(4, "NVIDIA H100 80GB HBM3", Load("busy")),  # GPM: the DCGM_FI_PROF_* names
            faults=[Fault("*", "GPU_IS_LOST", gpu=3, after_seconds=5)],
        ),
        metric_names=names,
        gpm_interval_seconds=1.0,
        **config,
    )
    stack.sample()
    stack.clock.advance(1)  # GPM's figures are between two of its samples, 1 s apart here
    stack.sample()
    return stack


@pytest.fixture(autouse=True)
def node_name(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("NODE_NAME", "node-7")  # what dcgm-exporter labels as the host
    return "node-7"


def scrape(stack: Stack, accept: str = "text/plain") -> tuple[str, list[Series]]:
    body = stack.exposition.render(accept)[0].decode()
    series = []
    for line in body.splitlines():
        match = SERIES.match(line)
        if match and not line.startswith("#"):
            labels = dict(LABEL.findall(match.group(2) or ""))
            series.append((match.group(1), labels, float(match.group(3))))
    return body, series


def names_of(series: list[Series]) -> set[str]:
    return {name for name, _, _ in series}


def test_every_default_counter_is_served_with_its_type_and_help_or_said_why_not() -> None:
    body, series = scrape(host("dcgm"))
    served = {n for n in names_of(series) if n.startswith("DCGM_")}
    assert served - set(dcgmusage.OTHER_SERVED) | set(dcgmusage.NOT_SERVED) == set(
        dcgmusage.DEFAULT_COUNTERS
    )
    assert not served & set(dcgmusage.NOT_SERVED)
    assert set(dcgmusage.OTHER_SERVED) <= served
    for name in served:
        kind, help = {**dcgmusage.DEFAULT_COUNTERS, **dcgmusage.OTHER_SERVED}[name]
        assert f"# HELP {name} {help}\n# TYPE {name} {kind}\n" in body
    doc = (Path(__file__).parent.parent / "docs" / "dcgm-compat.md").read_text()
    for name in dcgmusage.DEFAULT_COUNTERS:
        assert f"`{name}`" in doc, name
    # The doc's table row of each served name gives the series the code converts.
    from gpu_exporter.export.dcgm import DCGM_METRICS

    rows = {line.split(" | ")[0].strip("| `"): line for line in doc.splitlines()}
    for metric in DCGM_METRICS:
        assert f"| {metric.type} |" in rows[metric.name], metric.name
        if "(in " in metric.help:  # the conversion ends in the unit its help states
            assert f"(in {metric.conversion.unit})" in metric.help, metric.name
        spec = metric.spec
        if spec is not None:
            label = {field: value for value, field in spec.per_label}.get(metric.field or "")
            series = spec.name if label is None else f'{spec.name}{{{spec.labels[-1]}="{label}"}}'
            assert f"`{series}`" in rows[metric.name], metric.name


def test_labels_are_dcgm_exporters_on_every_series(node_name: str) -> None:
    stack = host("dcgm")
    _, series = scrape(stack)
    snapshot = stack.cache.get()
    by_uuid = {g.uuid: g for g in snapshot.gpus}
    dcgm = [(n, labels) for n, labels, _ in series if n.startswith("DCGM_")]
    assert dcgm
    for name, labels in dcgm:
        card = by_uuid[labels["UUID"]]  # a MIG device's series name its parent's UUID
        assert labels["gpu"] == str(card.index)
        assert labels["device"] == f"nvidia{card.index}"
        assert labels["modelName"] == card.name
        assert labels["pci_bus_id"] == card.pci_bus_id
        assert labels["Hostname"] == labels["hostname"] == node_name
        assert labels[dcgmusage.DRIVER_LABEL] == snapshot.driver_version
        expected = {*dcgmusage.GPU_LABELS, *dcgmusage.HOSTNAME_LABELS, dcgmusage.DRIVER_LABEL}
        if "GPU_I_ID" in labels:
            expected |= set(dcgmusage.MIG_LABELS)
        if name == "DCGM_FI_DEV_XID_ERRORS":
            expected |= set(dcgmusage.XID_LABELS)
        assert set(labels) == expected, (name, labels)
        assert list(labels)[:5] == list(dcgmusage.GPU_LABELS)  # its order, for the eye


def test_mig_devices_have_the_instance_labels_and_their_own_memory() -> None:
    stack = host("dcgm")
    _, series = scrape(stack)
    parent = stack.cache.get().gpus[1]
    used = {
        labels.get("GPU_I_PROFILE"): value
        for name, labels, value in series
        if name == "DCGM_FI_DEV_FB_USED" and labels["UUID"] == parent.uuid
    }
    expected = {d.mig_profile: (d.memory_used_bytes or 0) / 2**20 for d in parent.mig_devices}
    assert {k: v for k, v in used.items() if k is not None} == expected
    assert used[None] == (parent.memory_used_bytes or 0) / 2**20  # the whole card
    ids = {
        labels["GPU_I_PROFILE"]: labels["GPU_I_ID"]
        for name, labels, _ in series
        if name == "DCGM_FI_DEV_FB_USED" and "GPU_I_ID" in labels
    }
    assert ids == {d.mig_profile: str(d.gpu_instance_id) for d in parent.mig_devices}
    # Values NVML has no MIG figure for stay on the card (dcgm-exporter: blank, skipped).
    temps = [labels for name, labels, _ in series if name == "DCGM_FI_DEV_GPU_TEMP"]
    assert not any("GPU_I_ID" in labels for labels in temps)


def test_values_are_gpu_exporters_converted() -> None:
    _, series = scrape(host("both"))
    ours = {
        (name, labels.get("uuid"), labels.get("clock"), labels.get("cause")): value
        for name, labels, value in series
    }
    converted = {
        "DCGM_FI_DEV_SM_CLOCK": lambda u: ours[("gpu_clock_hz", u, "sm", None)] / 1e6,
        "DCGM_FI_DEV_MEM_CLOCK": lambda u: ours[("gpu_clock_hz", u, "memory", None)] / 1e6,
        "DCGM_FI_DEV_GPU_TEMP": lambda u: ours[("gpu_temperature_celsius", u, None, None)],
        "DCGM_FI_DEV_POWER_USAGE": lambda u: ours[("gpu_power_draw_watts", u, None, None)],
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": lambda u: (
            1000 * ours[("gpu_energy_joules_total", u, None, None)]
        ),
        "DCGM_FI_DEV_GPU_UTIL": lambda u: 100 * ours[("gpu_utilization_ratio", u, None, None)],
        "DCGM_FI_DEV_MEM_COPY_UTIL": lambda u: (
            100 * ours[("gpu_memory_utilization_ratio", u, None, None)]
        ),
        "DCGM_FI_DEV_FB_USED": lambda u: ours[("gpu_memory_used_bytes", u, None, None)] / 2**20,
        "DCGM_FI_DEV_FB_FREE": lambda u: ours[("gpu_memory_free_bytes", u, None, None)] / 2**20,
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": lambda u: ours[
            ("gpu_remapped_rows_total", u, None, "correctable")
        ],
        "DCGM_FI_DEV_ROW_REMAP_FAILURE": lambda u: ours[
            ("gpu_remapped_rows_failed", u, None, None)
        ],
    }
    checked = set()
    for name, labels, value in series:
        if name in converted and "GPU_I_ID" not in labels:
            assert value == pytest.approx(converted[name](labels["UUID"]), rel=1e-9), name
            checked.add(name)
    assert checked == set(converted)
    util = [v for n, labels, v in series if n == "DCGM_FI_DEV_GPU_UTIL" and labels["gpu"] == "0"]
    assert util == [57.0]  # a whole percent, as NVML reports it (not 56.99999999999999)


def test_a_lost_gpu_has_no_dcgm_values_and_hides_no_other() -> None:
    stack = host("dcgm")
    stack.clock.advance(5)
    stack.sample()
    _, series = scrape(stack)
    lost = stack.cache.get().gpus[3]
    assert not lost.up
    assert not [labels for n, labels, _ in series if n.startswith("DCGM_") and labels["gpu"] == "3"]
    temps = {labels["gpu"] for n, labels, _ in series if n == "DCGM_FI_DEV_GPU_TEMP"}
    assert temps == {"0", "1", "2", "4"}
    assert ("gpu_up", {"gpu": "3", "uuid": lost.uuid}, 0.0) in series  # ours says why


def test_dcgm_mode_replaces_the_converted_families_and_keeps_the_rest() -> None:
    _, dcgm = scrape(host("dcgm"))
    _, both = scrape(host("both"))
    _, own = scrape(host("gpu-exporter"))
    converted = {re.findall(r"^\w+", q)[0] for q in dcgmusage.CONVERSIONS.values()}
    assert not names_of(dcgm) & converted
    assert names_of(dcgm) | converted == names_of(both)
    assert names_of(both) - names_of(own) == {n for n in names_of(both) if n.startswith("DCGM_")}
    assert not any(n.startswith("DCGM_") for n in names_of(own))


def test_the_last_xid_with_its_code_and_zero_before_any() -> None:
    stack = host("dcgm")
    gpu = stack.cache.get().gpus[0]
    _, before = scrape(stack)
    xids = {labels["gpu"]: (labels, v) for n, labels, v in before if n == "DCGM_FI_DEV_XID_ERRORS"}
    assert set(xids) == {"0", "1", "2", "3", "4"}  # whole cards, not MIG devices
    assert xids["0"][0]["err_code"] == "0" and xids["0"][0]["err_msg"] == "No Error"
    stack.xids.record(gpu.index, gpu.uuid, 79, 1.0)
    _, after = scrape(stack)  # between two samples: the Xid part is rendered per scrape
    labels, value = next((lb, v) for n, lb, v in after if n == "DCGM_FI_DEV_XID_ERRORS")
    assert value == 79.0 and labels["err_code"] == "79"


def test_pod_labels_on_the_devices_the_kubelet_gave_to_containers() -> None:
    stack = host("dcgm")
    snapshot = stack.cache.get()
    pods = PodAllocations()
    card, mig = snapshot.gpus[0], snapshot.gpus[1].mig_devices[0]
    pods.publish(
        [
            PodDevice("ml", "train", "trainer", "nvidia.com/gpu", card.uuid),
            PodDevice("ml", "infer", "server", "nvidia.com/mig-3g.40gb", mig.uuid),
        ]
    )
    from gpu_exporter.export.dcgm import DcgmCollector

    collector = DcgmCollector(stack.cache, "node-7", pods=pods)
    text = collector.render_snapshot(snapshot).decode()
    used = [line for line in text.splitlines() if line.startswith("DCGM_FI_DEV_FB_USED{")]
    held = [line for line in used if 'pod="' in line]
    assert len(held) == 2
    assert any(
        'gpu="0"' in line and 'container="trainer",namespace="ml",pod="train"' in line
        for line in held
    )
    assert any('GPU_I_PROFILE="3g.40gb"' in line and 'pod="infer"' in line for line in held)
    before = collector.version
    pods.publish([])
    assert collector.version != before  # the exposition renders its part again
    assert 'pod="' not in collector.render_snapshot(snapshot).decode()


def test_promtool_finds_nothing_in_our_names_and_only_dcgms_own_lint_in_theirs(
    tmp_path: Path,
) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus')")
    complaints: dict[str, set[str]] = {}
    for names in ("gpu-exporter", "dcgm", "both"):
        body, _ = scrape(host(names))
        out = subprocess.run(
            [promtool, "check", "metrics"], input=body.encode(), capture_output=True, timeout=60
        )
        for line in (out.stdout + out.stderr).decode().splitlines():
            name, _, problem = line.partition(" ")
            complaints.setdefault(name, set()).add(problem)
    assert not {n for n in complaints if not n.startswith("DCGM_")}, complaints
    assert complaints  # DCGM names do carry dcgm-exporter's own complaints
    assert set().union(*complaints.values()) <= set(dcgmusage.DCGM_LINT)


# The shipped alerts on a GPU's health, its Xids and the exporter's own: they read no value
# dcgm-exporter names, so they work in every mode (docs/dcgm-compat.md lists the others).
HEALTH_ALERTS = (
    "GpuDown",
    "GpuXidCritical",
    "GpuThermalThrottling",
    "GpuPowerThrottling",
    "GpuEccUncorrectable",
    "GpuRowRemapPending",
    "GpuExporterNvmlDown",
    "GpuExporterStale",
)


def _alert_names() -> dict[str, set[str]]:
    rules = yaml.safe_load(RULES.read_text())
    read = {}
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                read[rule["alert"]] = set(re.findall(r"\b(gpu_\w+)", rule["expr"]))
    return read


def test_status_page_choose_gpus_and_health_alerts_do_not_depend_on_the_names() -> None:
    answers = {}
    for names in ("gpu-exporter", "dcgm", "both"):
        stack = host(names)
        stack.clock.advance(6)  # GPU 3 is lost: gpu_down_reason
        stack.sample()
        gpu = stack.cache.get().gpus[0]
        stack.xids.record(gpu.index, gpu.uuid, 48, stack.clock.time())
        client = stack.client
        answers[names] = [
            client.get(path).get_data(as_text=True)
            for path in ("/", "/gpus", "/choose?n=2&lease=0&format=json", "/readyz")
        ]
        served = names_of(scrape(stack)[1])
        alerts = _alert_names()
        for alert in HEALTH_ALERTS:
            assert alerts[alert] and alerts[alert] <= served, (names, alert)
    assert answers["dcgm"] == answers["gpu-exporter"] == answers["both"]
    assert json.loads(answers["dcgm"][1])  # /gpus answered, with base units


def test_the_docs_name_every_shipped_alert_that_needs_both() -> None:
    _, dcgm = scrape(host("dcgm"))
    _, own = scrape(host("gpu-exporter"))
    gone = names_of(own) - names_of(dcgm)
    needing = {alert for alert, read in _alert_names().items() if read & gone}
    assert needing and not needing & set(HEALTH_ALERTS)
    doc = (Path(__file__).parent.parent / "docs" / "dcgm-compat.md").read_text()
    section = doc.split("### Alerts and rules")[1]
    need, every = (
        section.split(marker)[1].split("\n- ")[0].split("\n\n")[0] for marker in ("Need", "Work in")
    )
    assert {a for a in _alert_names() if f"`{a}`" in need} == needing
    on_rules = {"GpuNoneFree", "GpuMemoryHeldIdle"}  # read recording rules, which read
    assert {a for a in _alert_names() if f"`{a}`" in every} == (  # left-out families
        set(_alert_names()) - needing - on_rules
    )


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--metric-names=foo"], {}, "argument --metric-names: invalid choice: 'foo'"),
        ([], {"GPU_EXPORTER_METRIC_NAMES": "dgcm"}, "--metric-names must be one of"),
    ],
)
def test_a_bad_metric_names_is_one_line(
    argv: list[str],
    env: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit:
        cli.main(["serve", "--simulate", "1", *argv])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 2  # the error and "try … --help"


def test_the_environment_sets_the_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_EXPORTER_METRIC_NAMES", "both")
    parser = cli.build_parser()
    args = parser.parse_args(["serve"])
    assert args.metric_names == "both"


def test_the_daemonset_gives_the_node_name_for_the_host_label() -> None:
    """In a pod, the host name is the pod's; dcgm-exporter's label names the node."""
    path = Path(__file__).parent.parent / "deploy" / "kubernetes" / "daemonset.yaml"
    container = yaml.safe_load(path.read_text())["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
