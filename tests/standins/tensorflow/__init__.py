"""A stand-in for the parts of ``tensorflow`` that docs/frameworks.md uses, with TF's rules:
physical devices are the CUDA-visible ones; set_visible_devices, set_memory_growth and
set_logical_device_configuration take effect only before the logical devices are initialised
(RuntimeError after); memory growth cannot be set on a device with logical devices configured
(ValueError); the visible list must be a subset of the physical one; ConfigProto refuses
unknown fields."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import _fakecuda


@dataclass(frozen=True)
class PhysicalDevice:
    name: str
    device_type: str


@dataclass(frozen=True)
class LogicalDevice:
    name: str
    device_type: str


@dataclass(frozen=True)
class LogicalDeviceConfiguration:
    memory_limit: int | None = None  # MB, as TF's


_state: dict[str, Any] = {"visible": None, "growth": {}, "logical": None, "configs": {}}


def _physical() -> list[PhysicalDevice]:
    return [PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(_fakecuda.count())]


def _not_initialised(what: str) -> None:
    if _state["logical"] is not None:
        raise RuntimeError(f"{what} cannot be modified after being initialized")


def list_physical_devices(device_type: str | None = None) -> list[PhysicalDevice]:
    return _physical() if device_type in (None, "GPU") else []


def set_visible_devices(devices: Any, device_type: str | None = None) -> None:
    _not_initialised("Visible devices")
    chosen = list(devices) if isinstance(devices, list | tuple) else [devices]
    for d in chosen:
        if d not in _physical():
            raise ValueError(f"Unrecognized device: {d}")
    _state["visible"] = chosen


def list_logical_devices(device_type: str | None = None) -> list[LogicalDevice]:
    if _state["logical"] is None:
        visible = _state["visible"] if _state["visible"] is not None else _physical()
        _state["logical"] = [LogicalDevice(f"/device:GPU:{i}", "GPU") for i in range(len(visible))]
    return list(_state["logical"]) if device_type in (None, "GPU") else []


def set_memory_growth(device: PhysicalDevice, enable: bool) -> None:
    _not_initialised("Physical devices")
    if device not in _physical():
        raise ValueError(f"Unrecognized device: {device}")
    if device.name in _state["configs"]:
        raise ValueError("Cannot set memory growth on device when virtual devices configured")
    _state["growth"][device.name] = enable


def set_logical_device_configuration(
    device: PhysicalDevice, logical_devices: list[LogicalDeviceConfiguration] | None
) -> None:
    _not_initialised("Virtual devices")
    if device not in _physical():
        raise ValueError(f"Unrecognized device: {device}")
    _state["configs"][device.name] = list(logical_devices or [])


def get_logical_device_configuration(
    device: PhysicalDevice,
) -> list[LogicalDeviceConfiguration] | None:
    return _state["configs"].get(device.name)


class MirroredStrategy:
    def __init__(self, devices: list[str] | None = None) -> None:
        gpus = list_logical_devices("GPU")
        self.num_replicas_in_sync = len(devices) if devices else max(1, len(gpus))

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        yield


class _GpuOptions:
    __slots__ = ("allow_growth", "per_process_gpu_memory_fraction", "visible_device_list")

    def __init__(self) -> None:
        self.visible_device_list = ""
        self.allow_growth = False
        self.per_process_gpu_memory_fraction = 0.0


class ConfigProto:
    __slots__ = ("allow_soft_placement", "gpu_options", "log_device_placement")

    def __init__(self) -> None:
        self.gpu_options = _GpuOptions()
        self.allow_soft_placement = False
        self.log_device_placement = False


config = SimpleNamespace(
    list_physical_devices=list_physical_devices,
    list_logical_devices=list_logical_devices,
    set_visible_devices=set_visible_devices,
    set_logical_device_configuration=set_logical_device_configuration,
    get_logical_device_configuration=get_logical_device_configuration,
    LogicalDeviceConfiguration=LogicalDeviceConfiguration,
    experimental=SimpleNamespace(set_memory_growth=set_memory_growth),
)
distribute = SimpleNamespace(MirroredStrategy=MirroredStrategy)
compat = SimpleNamespace(v1=SimpleNamespace(ConfigProto=ConfigProto))
