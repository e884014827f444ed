"""The real exporter for client tests: :func:`gpu_exporter.daemon.build` over simulated GPUs,
served by the real server (gpu_exporter.web.server) on 127.0.0.1 from a thread of the test
process.

The client, ``gpu-exporter choose/run`` subprocesses and the test all speak HTTP to the same
server ``gpu-exporter serve`` runs, so the client is tested against the API as it is (there is
no stand-in to drift). What a test needs comes from the real stack: simulator faults and loads
(``sim=``), lease limits and ages (:class:`~gpu_exporter.config.ServeConfig` fields), a sampler
that is not running (``sampling=False``: one sample, which then goes stale), the server stopped
and started again (:meth:`Served.stop_serving`, :meth:`Served.serve_again`). Every request is
noted (:attr:`Served.requests`) by a WSGI layer around the app, so a test can check what the
client sent.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gpu_exporter.config import ServeConfig
from gpu_exporter.daemon import Daemon, build
from gpu_exporter.nvml import Nvml
from gpu_exporter.simulate import DEFAULT_MODEL, Fault, Load, SimGpu, SimulatedNvml

NO_PROC = "/dev/null/proc"  # a proc_root where every read fails: no process is visible
Noted = tuple[str, str, dict[str, str]]  # method, path, query (the last value of each name)


def four_gpus(*, faults: Iterable[Fault] = ()) -> SimulatedNvml:
    """Four A100s whose load never changes, as a shared box a job script lands on:
    0 busy-ish (30 %, 1 process), 1 idle, 2 half busy (50 %, 2 processes), 3 idle."""
    loads = [
        Load("constant", utilization=0.3, memory_used_ratio=0.25, processes=1),
        Load("idle"),
        Load("constant", utilization=0.5, memory_used_ratio=0.5, processes=2),
        Load("idle"),
    ]
    gpus = [SimGpu(i, DEFAULT_MODEL, load) for i, load in enumerate(loads)]
    return SimulatedNvml(gpus, faults=list(faults), clock=time.monotonic)


class RequestLog:
    """WSGI middleware noting each request's method, path and query string."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app
        self.requests: list[Noted] = []

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        self.requests.append(
            (
                environ["REQUEST_METHOD"],
                environ.get("PATH_INFO", ""),
                {name: values[-1] for name, values in query.items()},
            )
        )
        return self.app(environ, start_response)


@dataclass
class Served:
    """A running exporter: its parts (``daemon``, ``sim``) and where it listens."""

    daemon: Daemon
    sim: SimulatedNvml
    log: RequestLog
    port: int = 0
    _thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def requests(self) -> list[Noted]:
        """Every request so far, oldest first."""
        return self.log.requests

    def get_json(self, path: str) -> Any:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        req = urllib.request.Request(self.url + path, headers={"Accept": "application/json"})
        with opener.open(req, timeout=5) as resp:
            return json.loads(resp.read())

    def leases(self) -> list[dict[str, Any]]:
        """``GET /leases``' list (asked over HTTP, as a client would)."""
        leases: list[dict[str, Any]] = self.get_json("/leases")["leases"]
        return leases

    def lease_ids(self) -> set[str]:
        return {lease["id"] for lease in self.leases()}

    def serve_again(self) -> None:
        """Bind (the same port, once it has one) and serve from a new thread."""
        server = self.daemon.make_server("127.0.0.1", self.port)
        self.port = server.port
        self._thread = threading.Thread(target=server.serve, name="served", daemon=True)
        self._thread.start()

    def stop_serving(self) -> None:
        """Stop answering (connections are refused) while the exporter itself runs on."""
        if self.daemon.server is not None:
            self.daemon.server.stop()
        if self._thread is not None:
            self._thread.join(10)


def _wait_for_a_sample(daemon: Daemon, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while daemon.cache.get().sequence == 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"no sample within {timeout:.0f} s")
        daemon.cache.wait_for_newer(0, 0.1)


@contextlib.contextmanager
def served(
    sim: SimulatedNvml | None = None, *, sampling: bool = True, port: int = 0, **config: Any
) -> Iterator[Served]:
    """The exporter over ``sim`` (default :func:`four_gpus`), serving once it has a sample.

    ``config``: :class:`~gpu_exporter.config.ServeConfig` fields; by default leases are kept in
    memory only, the GPUs are sampled every 0.2 s, no Xid listener runs (stopping it takes
    a while, and no client test needs it) and ``/proc`` shows no process (``proc_root``: the
    simulated pids must not meet this machine's real ones). ``sampling=False`` takes one sample and
    starts no threads but the server's. ``port`` 0 is any free one; a test that stops and
    restarts the server names one (``harness.free_port()``) to get the same port back.
    """
    sim = sim if sim is not None else four_gpus()
    settings = {
        "state_dir": None,
        "interval_seconds": 0.2,
        "xid_events": False,
        "proc_root": NO_PROC,
        **config,
    }
    daemon = build(ServeConfig(**settings), nvml=Nvml(sim, simulated=True), version="test")
    log = RequestLog(daemon.app.wsgi_app)
    daemon.app.wsgi_app = log  # type: ignore[method-assign]  # outside all the middleware
    exporter = Served(daemon, sim, log, port)
    if sampling:
        daemon.start()
        _wait_for_a_sample(daemon)
    else:
        daemon.sampler.sample_once()
    exporter.serve_again()
    try:
        yield exporter
    finally:
        daemon.shutdown()
        exporter.stop_serving()
        daemon.stop()
