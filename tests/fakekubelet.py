"""A fake kubelet: the PodResources v1 ``List`` served by a real grpcio server on a Unix
socket, from the test process (also used by bench/run.py's ``--kubernetes`` row).

``pods`` is what ``List`` answers, in :func:`encode_list_response`'s shape: the protobuf
that :mod:`gpu_exporter.collect.podresources` decodes. A test changes it at any time.
:meth:`FakeKubelet.stop` takes the server (and its socket) away, :meth:`FakeKubelet.start`
brings it back on the same path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent import futures
from typing import Any

import grpc

LEN = 2  # protobuf's wire type of a length-delimited field


def _key(number: int, wire: int) -> bytes:
    return _encode_varint(number << 3 | wire)


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _key(number, LEN) + _encode_varint(len(payload)) + payload


def _str_field(number: int, text: str) -> bytes:
    return _len_field(number, text.encode("utf-8"))


Pod = tuple[str, str, Iterable[tuple[str, Iterable[tuple[str, Iterable[str]]]]]]


def encode_list_response(pods: Iterable[Pod], *, cpu_ids: Iterable[int] = ()) -> bytes:
    """The ``List`` answer for ``(namespace, name, [(container, [(resource, [ids])])])``;
    ``cpu_ids`` adds a field the decoder must skip, as a real kubelet sends."""
    out = b""
    for namespace, name, containers in pods:
        body = _str_field(1, name) + _str_field(2, namespace)
        for container, devices in containers:
            cbody = _str_field(1, container)
            for resource, ids in devices:
                dbody = _str_field(1, resource) + b"".join(_str_field(2, i) for i in ids)
                cbody += _len_field(2, dbody)
            packed = b"".join(_encode_varint(c) for c in cpu_ids)
            if packed:
                cbody += _len_field(3, packed)
            body += _len_field(3, cbody)
        out += _len_field(1, body)
    return out


class FakeKubelet:
    def __init__(self, socket_path: str, pods: list[Pod] | None = None) -> None:
        self.socket_path = socket_path
        self.pods: list[Pod] = list(pods or [])
        self.calls = 0
        self.delay_seconds = 0.0  # a kubelet that answers this late (past the deadline?)
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    def _list(self, request: bytes, context: Any) -> bytes:
        with self._lock:
            self.calls += 1
        time.sleep(self.delay_seconds)
        return encode_list_response(self.pods, cpu_ids=(0, 1))  # fields the decoder skips

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.method_handlers_generic_handler(
            "v1.PodResourcesLister",
            {"List": grpc.unary_unary_rpc_method_handler(self._list)},  # bytes in, bytes out
        )
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"unix:{self.socket_path}")
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait(5)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)


@contextlib.contextmanager
def fake_kubelet(pods: list[Pod] | None = None) -> Iterator[FakeKubelet]:
    """A running fake kubelet on a short socket path (Unix socket paths are short: 107 bytes)."""
    directory = tempfile.mkdtemp(prefix="kubelet-", dir="/tmp")
    kubelet = FakeKubelet(os.path.join(directory, "kubelet.sock"), pods)
    kubelet.start()
    try:
        yield kubelet
    finally:
        kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)
