"""The kubelet's PodResources v1 ``List`` answer, decoded from protobuf bytes: pure parsing.

The messages are those of ``k8s.io/kubelet/pkg/apis/podresources/v1/api.proto``; only the
fields used here are read, every other field (CPU ids, memory, topology, dynamic resources)
is skipped by its wire type, as protobuf itself does::

    ListPodResourcesResponse { repeated PodResources pod_resources = 1; }
    PodResources            { string name = 1; string namespace = 2;
                              repeated ContainerResources containers = 3; }
    ContainerResources      { string name = 1; repeated ContainerDevices devices = 2; }
    ContainerDevices        { string resource_name = 1; repeated string device_ids = 2; }

The ``List`` request is the empty message: zero bytes. A hand-written decoder of four
messages keeps the ``kubernetes`` extra at grpcio alone (no protobuf runtime, no generated
code whose runtime version must match). The tests' fake kubelet (``tests/fakekubelet.py``)
encodes its answers.

Note what the API does not say: a pod's UID. Pods are named (namespace, name) only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

from gpu_exporter.podallocations import PodDevice

LIST_METHOD = "/v1.PodResourcesLister/List"
T = TypeVar("T")
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class DecodeError(ValueError):
    """Bytes that are not a PodResources message."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise DecodeError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of one message: an int for varints, bytes for length-delimited
    fields; fixed-width fields are skipped.

    >>> list(fields(b"\\x0a\\x02hi\\x10\\x05"))
    [(1, b'hi'), (2, 5)]
    """
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _varint(data, pos)
            yield number, value
        elif wire == _LEN:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise DecodeError("truncated length-delimited field")
            yield number, data[pos : pos + size]
            pos += size
        elif wire in (_I64, _I32):
            pos += 8 if wire == _I64 else 4
            if pos > len(data):
                raise DecodeError("truncated fixed-width field")
        else:
            raise DecodeError(f"unsupported wire type {wire}")


def _text(value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise DecodeError("expected a string, got a number")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise DecodeError("a string that is not UTF-8") from None


def _message(value: int | bytes) -> bytes:
    if not isinstance(value, bytes):
        raise DecodeError("expected a message, got a number")
    return value


def decode_list_response(data: bytes) -> list[PodDevice]:
    """Every device allocated to a container, in the kubelet's order; a container without
    devices (a pod without a GPU limit) contributes nothing."""
    out: list[PodDevice] = []
    for number, pod_bytes in fields(data):
        if number != 1:
            continue
        name = namespace = ""
        containers: list[bytes] = []
        for n, v in fields(_message(pod_bytes)):
            if n == 1:
                name = _text(v)
            elif n == 2:
                namespace = _text(v)
            elif n == 3:
                containers.append(_message(v))
        for container in containers:
            out.extend(_container_devices(container, namespace, name))
    return out


def _named(data: bytes, item: Callable[[int | bytes], T]) -> tuple[str, list[T]]:
    """A message whose field 1 is its name and field 2 a repeated ``item``: a container
    (name, devices) or a device entry (resource name, device IDs)."""
    name, items = "", []
    for n, v in fields(data):
        if n == 1:
            name = _text(v)
        elif n == 2:
            items.append(item(v))
    return name, items


def _container_devices(data: bytes, namespace: str, pod: str) -> Iterator[PodDevice]:
    name, devices = _named(data, _message)
    for device in devices:
        resource, ids = _named(device, _text)
        for device_id in ids:
            yield PodDevice(namespace, pod, name, resource, device_id)
