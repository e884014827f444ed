"""Issue 36: a GPU value is one row of gpu_exporter/readings.py, and every place that needs
it is derived from the row or fails here when it does not handle it.

The places: the reader (collect/fields.py), the snapshot (GpuSample), the exposition and the
README's metric table (export/spec.py), dcgm-exporter's names (export/dcgm.py) and the
simulator (simulate/library.py). tests/fakenvml stays independent: the end-to-end tests read
the same values through the real pynvml from it.
"""

from __future__ import annotations

import dataclasses

import pytest

from conftest import build_stack, sim_of
from gpu_exporter import nvml
from gpu_exporter.collect import fields
from gpu_exporter.export.dcgm import DCGM_METRICS
from gpu_exporter.export.spec import GPU_VALUES
from gpu_exporter.model import READING_NAMES, GpuSample
from gpu_exporter.readings import READINGS
from gpu_exporter.simulate import Load, SimGpu, SimulatedNvml
from gpu_exporter.valuerow import Reading

BY_FIELD: dict[str, list[Reading]] = {}
for _r in READINGS:
    BY_FIELD.setdefault(_r.name, []).append(_r)


def test_rows_of_one_call_agree_on_how_and_when_it_is_made() -> None:
    for name, rows in BY_FIELD.items():
        first = rows[0]
        for r in rows[1:]:
            assert (r.getter, r.args, r.method, r.when, r.group) == (
                first.getter,
                first.args,
                first.method,
                first.when,
                first.group,
            ), name


def test_every_row_is_read() -> None:
    """By a field of the reader (GPM's module reads the GPM rows), under its cadence and
    group; a row no getter, field value or code reads would be exported as nothing."""
    read = {a: f for f in (*fields.GPU_FIELDS, fields.GPM_FIELD) for a in f.names}
    read["compute_processes"] = fields.FIELDS["processes"]  # the length of the process list
    for r in READINGS:
        f = read.get(r.attribute)
        assert f is not None, f"{r.attribute}: no field of collect/fields.py reads it"
        assert (f.field, f.when, f.group) == (r.name, r.when, r.group), r.attribute
        if not r.code:
            assert r.getter is not None or r.fields, f"{r.attribute}: nothing to read it with"
            assert r.convert or r.method or r.getter is None, f"{r.attribute}: no conversion"
            assert (r.from_fields is not None) or len(r.fields) <= 1, r.attribute


def test_every_field_id_and_constant_is_one_pynvml_knows() -> None:
    for r in READINGS:
        for name in r.fields:
            assert name in nvml.FIELD_IDS, f"{r.attribute}: {name}"
        for name in r.args:
            assert isinstance(nvml.constant(name), int), f"{r.attribute}: {name}"


def test_every_row_has_a_place_in_the_snapshot() -> None:
    """A typed field of GpuSample where code reads it by name, else kept by name in
    GpuSample.readings; and every typed value field of GpuSample is a row."""
    typed = {f.name for f in dataclasses.fields(GpuSample)}
    for r in READINGS:
        assert r.attribute in typed or r.attribute in READING_NAMES, r.attribute
    gpu = GpuSample.from_values(index=0, uuid="GPU-0", up=True, **dict.fromkeys(READING_NAMES, 7))
    assert all(getattr(gpu, name) == 7 for name in READING_NAMES)
    assert gpu.to_json()["fan_speed_ratio"] == 7
    with pytest.raises(AttributeError):
        gpu.fan_speed  # noqa: B018 (a name that is no reading)
    values = typed - {r.attribute for r in READINGS}
    not_values = {
        *("index", "uuid", "up", "name", "pci_bus_id", "error", "down_reason"),
        *("last_seen_seconds", "readings", "mig_devices", "parent_uuid", "gpu_instance_id"),
        *("compute_instance_id", "mig_profile", "processes", "process_visibility"),
        "fields_supported",
    }
    assert values == not_values


def test_every_family_is_exported_with_its_rows() -> None:
    specs = {spec.name: spec for spec in GPU_VALUES}
    for r in READINGS:
        if r.family is None:
            continue
        spec = specs.get(r.family.name)
        assert spec is not None, f"{r.attribute}: {r.family.name} is not exported"
        exported = {spec.field, *(a for _, a in spec.per_label)}
        assert r.attribute in exported or spec.values is not None, r.attribute
        assert spec.labels[2:] == tuple(label for label, _ in r.labels), r.attribute


def test_every_dcgm_name_is_served_from_its_row() -> None:
    served = {m.name: m.field for m in DCGM_METRICS}
    for r in READINGS:
        if r.dcgm is not None:
            assert served[r.dcgm.name] == r.attribute


def test_the_simulator_answers_every_getter_and_field_value_of_the_table() -> None:
    """Each row's getter is a function of the simulated library (a row's ``simulate``, or
    code of the simulator's own), and each field id a field value of a card that has it."""
    for r in READINGS:
        if r.getter is not None:
            assert callable(getattr(SimulatedNvml, r.getter, None)), r.getter
    busy = Load("constant", utilization=0.3, memory_used_ratio=0.5, processes=2)
    s = build_stack(sim_of(SimGpu(0, "NVIDIA H100 80GB HBM3", busy)), collect_disabled=())
    s.sample()
    gpu = s.cache.get().gpus[0]
    unsupported = {f for f, ok in gpu.fields_supported if not ok}
    for r in READINGS:
        if r.code or r.name in unsupported:
            continue
        assert getattr(gpu, r.attribute) is not None, f"{r.attribute}: the simulator has none"
