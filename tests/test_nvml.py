"""The NVML wrapper: error mapping, units, fallbacks — against real pynvml exceptions."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gpu_exporter import nvml
from gpu_exporter.nvml import GpuLost, Nvml, NvmlError, NvmlUnavailable, Unsupported
from gpu_exporter.readings import BY_ATTRIBUTE


class FakeLib:
    """Just enough of pynvml for one call at a time."""

    def __init__(self, **functions: Any) -> None:
        for name, fn in functions.items():
            setattr(self, name, fn)


def raising(name: str) -> Any:
    def fn(*args: Any, **kwargs: Any) -> Any:
        raise nvml.make_error(nvml.error_code(name))

    return fn


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        ("NOT_SUPPORTED", Unsupported),
        ("FUNCTION_NOT_FOUND", Unsupported),
        ("GPU_IS_LOST", GpuLost),
        ("RESET_REQUIRED", GpuLost),
        ("DRIVER_NOT_LOADED", NvmlUnavailable),
        ("LIB_RM_VERSION_MISMATCH", NvmlUnavailable),
        ("UNKNOWN", NvmlError),
        ("TIMEOUT", NvmlError),
    ],
)
def test_errors_are_classified(error: str, expected: type[Exception]) -> None:
    wrapper = Nvml(FakeLib(nvmlDeviceGetPowerUsage=raising(error)))
    with pytest.raises(expected) as info:
        wrapper.get("nvmlDeviceGetPowerUsage", object())
    assert type(info.value) is expected
    assert info.value.error == error  # type: ignore[attr-defined]
    assert info.value.function == "nvmlDeviceGetPowerUsage"  # type: ignore[attr-defined]


def test_failures_are_counted_but_unsupported_is_not() -> None:
    wrapper = Nvml(
        FakeLib(
            nvmlDeviceGetPowerUsage=raising("UNKNOWN"),
            nvmlDeviceGetFanSpeed=raising("NOT_SUPPORTED"),
        )
    )
    for _ in range(3):
        with pytest.raises(NvmlError):
            wrapper.get("nvmlDeviceGetPowerUsage", None)
        with pytest.raises(Unsupported):
            wrapper.get("nvmlDeviceGetFanSpeed", None)
    assert wrapper.error_counts() == {("nvmlDeviceGetPowerUsage", "UNKNOWN"): 3}


def test_init_failure_is_unavailable_whatever_the_code() -> None:
    wrapper = Nvml(FakeLib(nvmlInit=raising("UNKNOWN")))  # containers after daemon-reload
    with pytest.raises(NvmlUnavailable, match="Unknown Error"):
        wrapper.init()


def test_non_nvml_exceptions_are_not_swallowed() -> None:
    def broken(handle: object) -> int:
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        Nvml(FakeLib(nvmlDeviceGetPowerUsage=broken)).get("nvmlDeviceGetPowerUsage", None)


def value(w: Nvml, attribute: str) -> Any:
    """A value as its row of gpu_exporter.readings reads it: its getter, in the base unit."""
    row = BY_ATTRIBUTE[attribute]
    assert row.getter is not None and row.convert is not None
    return row.convert(w.get(row.getter, None, *row.args))


def test_units_are_converted_to_base_units() -> None:
    lib = FakeLib(
        nvmlDeviceGetPowerUsage=lambda h: 123_456,  # mW
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 400_000,
        nvmlDeviceGetTotalEnergyConsumption=lambda h: 9_876_543,  # mJ
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=87, memory=5),
        nvmlDeviceGetFanSpeed=lambda h: 45,
        nvmlDeviceGetClockInfo=lambda h, t: {nvml.CLOCK_TYPES["sm"]: 1410}.get(t, 0),
        nvmlSystemGetCudaDriverVersion=lambda: 12040,
        nvmlDeviceGetName=lambda h: b"NVIDIA A100-SXM4-80GB",
        nvmlDeviceGetUUID=lambda h: "GPU-abc",
        nvmlDeviceGetPciInfo=lambda h: SimpleNamespace(busId=b"00000000:3B:00.0"),
    )
    w = Nvml(lib)
    assert value(w, "power_draw_watts") == pytest.approx(123.456)
    assert value(w, "power_limit_watts") == 400.0
    assert value(w, "energy_joules") == pytest.approx(9876.543)
    assert (value(w, "utilization_ratio"), value(w, "memory_utilization_ratio")) == (0.87, 0.05)
    assert value(w, "fan_speed_ratio") == 0.45
    assert value(w, "clock_sm_hz") == 1.41e9
    assert value(w, "clock_graphics_hz") == 0.0
    assert w.cuda_driver_version() == "12.4"
    assert w.name(None) == "NVIDIA A100-SXM4-80GB"  # bytes from older pynvml
    assert w.uuid(None) == "GPU-abc"  # str from newer pynvml
    assert w.pci_bus_id(None) == "00000000:3B:00.0"


def test_memory_v2_excludes_reserved() -> None:
    def memory(handle: object, version: int | None = None) -> SimpleNamespace:
        assert version == nvml.MEMORY_V2
        return SimpleNamespace(total=100, reserved=5, used=20, free=75)

    info = Nvml(FakeLib(nvmlDeviceGetMemoryInfo=memory)).memory(None)
    assert (info.total_bytes, info.used_bytes, info.free_bytes, info.reserved_bytes) == (
        100,
        20,
        75,
        5,
    )


def test_memory_falls_back_to_v1_on_old_drivers_and_remembers() -> None:
    calls: list[int | None] = []

    def memory(handle: object, version: int | None = None) -> SimpleNamespace:
        calls.append(version)
        if version is not None:  # a driver older than 510 has no nvmlDeviceGetMemoryInfo_v2
            raise nvml.make_error(nvml.error_code("FUNCTION_NOT_FOUND"))
        return SimpleNamespace(total=100, used=25, free=75)

    w = Nvml(FakeLib(nvmlDeviceGetMemoryInfo=memory))
    first = w.memory(None)
    second = w.memory(None)
    assert first == second
    assert first.reserved_bytes is None  # absent, not 0
    assert first.used_bytes == 25
    assert calls == [nvml.MEMORY_V2, None, None]


def test_processes_keep_unknown_memory_absent() -> None:
    procs = [
        SimpleNamespace(pid=10, usedGpuMemory=1024),
        SimpleNamespace(pid=11, usedGpuMemory=None),
    ]
    w = Nvml(FakeLib(nvmlDeviceGetComputeRunningProcesses=lambda h: procs))
    assert [(p.pid, p.used_memory_bytes) for p in w.compute_processes(None)] == [
        (10, 1024),
        (11, None),
    ]


def test_error_names_round_trip() -> None:
    assert nvml.error_code("GPU_IS_LOST") == 15
    assert nvml.error_code("nvml_error_gpu_is_lost") == 15
    assert nvml.ERROR_NAMES[999] == "UNKNOWN"
    with pytest.raises(ValueError, match="unknown NVML error"):
        nvml.error_code("NOPE")
