"""The one composition root: :func:`build` wires every part of a running exporter.

``gpu-exporter serve``, the tests and the benchmarks all build the exporter here, so what they
measure is what production runs::

    nvml ─► Sampler ─► SnapshotCache ─┬─► GpuCollector / Exposition ─► /metrics
                                      ├─► LeaseTable.prune, once per published sample
                                      └─► Claimer (LeaseTable, Waiters) ─► /choose, /leases
                  web.app.create_app(Services) inside web.middleware.install ─► Server

:func:`build` starts nothing: :meth:`Daemon.start` starts the threads (sampler, Xid listener,
PCIe sampler, web-config watcher, exposition), :meth:`Daemon.serve` binds and serves until
:meth:`Daemon.shutdown`. Tests drive the same objects with a fake clock and
``daemon.sampler.sample_once()`` instead of the threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from flask import Flask
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.registry import Collector

from gpu_exporter import __version__
from gpu_exporter.choose.claim import Claimer, Waiters
from gpu_exporter.choose.defaults import parse_defaults
from gpu_exporter.choose.leases import LeaseTable
from gpu_exporter.choose.statefile import (
    StateDirError,
    StateFile,
    StateLock,
    lock_state_dir,
    probe_dir,
)
from gpu_exporter.clock import Clock, SystemClock
from gpu_exporter.collect.background import BackgroundThread
from gpu_exporter.collect.cache import HISTORY_LENGTH, SnapshotCache, new_cache
from gpu_exporter.collect.groups import parse_disabled
from gpu_exporter.collect.kubelet import kubelet_poller
from gpu_exporter.collect.pcie import PcieThroughputSampler
from gpu_exporter.collect.procinfo import ProcInfoCache, read_cgroup_key
from gpu_exporter.collect.sampler import Sampler
from gpu_exporter.collect.xid import XidListener
from gpu_exporter.config import ServeConfig
from gpu_exporter.counters import PcieRates, RequestCounter, XidCounter
from gpu_exporter.export.collectors import GpuCollector, PodCollector, WebConfigCollector
from gpu_exporter.export.dcgm import REPLACED, DcgmCollector
from gpu_exporter.export.exposition import Exposition
from gpu_exporter.nvml import Nvml
from gpu_exporter.revision import revision
from gpu_exporter.units import plural
from gpu_exporter.web.app import create_app
from gpu_exporter.web.limits import Limits
from gpu_exporter.web.server import ListenError, Server
from gpu_exporter.web.services import Services
from gpu_exporter.web.webconfig import WebConfigError, WebConfigWatcher, exposure_warnings

log = logging.getLogger("gpu_exporter")

M_ARENA_MAX = -8  # glibc mallopt() parameter
MALLOC_ARENAS = 2


class BuildError(Exception):
    """A configuration the exporter cannot start with (one line for the log, exit 2)."""


@dataclass
class Daemon:
    """Every running part of one exporter, built by :func:`build`."""

    config: ServeConfig
    clock: Clock
    nvml: Nvml
    cache: SnapshotCache
    sampler: Sampler
    leases: LeaseTable
    requests: RequestCounter
    rejections: RequestCounter
    xids: XidCounter | None
    pcie: PcieRates | None
    registry: CollectorRegistry
    exposition: Exposition
    services: Services
    app: Flask  # inside its middleware (web.middleware.install): what the server serves
    watcher: WebConfigWatcher | None = None
    background: list[BackgroundThread] = field(default_factory=list)
    server: Server | None = None

    @property
    def stopping(self) -> threading.Event:
        """Set on shutdown: waiting requests give up at once."""
        return self.services.stopping

    def make_server(self, host: str | None = None, port: int | None = None) -> Server:
        """A server for :attr:`app` (the config's address unless given), bound now.

        Raises :class:`~gpu_exporter.web.server.ListenError` when the address is unusable.
        """
        host = self.config.host if host is None else host
        port = self.config.port if port is None else port
        tls = None
        if self.watcher is not None and self.watcher.active.context is not None:
            tls = self.watcher.tls_context
        limits, rejections = self.services.limits, self.rejections
        self.server = Server(self.app, host, port, limits=limits, tls=tls, rejections=rejections)
        self.server.bind()
        return self.server

    def start(self) -> None:
        """Start sampling and the background threads (NVML is initialised on them)."""
        self.sampler.start()
        for thread in self.background:
            thread.start()
        if self.watcher is not None:
            self.watcher.start()
        self.exposition.start()

    def shutdown(self) -> None:
        """Make waiters give up and stop the server; :meth:`serve` then returns. The
        background threads are told now, so their last wait ends while the server stops."""
        self.services.stopping.set()
        for thread in self.background:
            thread.request_stop()
        if self.server is not None:
            self.server.stop()

    def stop(self) -> None:
        """Stop every thread :meth:`start` started (bounded: a stuck driver call is left)."""
        self.services.stopping.set()
        self.exposition.stop()
        for thread in self.background:
            thread.stop()
        self.sampler.stop()
        if self.watcher is not None:
            self.watcher.stop()


def open_nvml(config: ServeConfig, clock: Clock) -> Nvml:
    """The real driver, or simulated GPUs with ``--simulate``."""
    if config.simulate is None:
        return Nvml()
    from gpu_exporter.simulate import Scenario, SimulatedNvml

    try:
        lib = SimulatedNvml.of(Scenario.from_argument(config.simulate), clock=clock.monotonic)
    except ValueError as exc:
        raise BuildError(str(exc)) from None
    log.warning(
        "simulating %s (--simulate %s): no real device is read",
        plural(len(lib.gpus), "GPU"),
        config.simulate,
    )
    return Nvml(lib, simulated=True)


def state_file(state_dir: str | None, *, discard: bool = False) -> StateFile | None:
    """``<state-dir>/leases.json`` (None: leases in memory only), once the directory is made,
    checked and a file in it was written; with ``discard`` (``--discard-leases``) the old
    file is moved aside unread. Raises :class:`BuildError` when it cannot be: an exporter
    that cannot save its leases must not hand them out."""
    if state_dir is None:
        return None
    state = StateFile(Path(state_dir) / "leases.json")
    try:
        probe_dir(Path(state_dir))
        if discard:
            state.discard()
    except StateDirError as exc:
        raise BuildError(str(exc)) from None
    return state


def dcgm_hostname() -> str:
    """The ``Hostname``/``hostname`` label of dcgm-exporter's names: ``$NODE_NAME`` (set from
    the node's name in a Kubernetes pod, whose own host name is the pod's), else this host's
    name, as dcgm-exporter chooses it."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


def listen_address(config: ServeConfig) -> str:
    """``127.0.0.1:9400``, ``[::1]:9400`` or ``:9400`` (every interface), as configured."""
    host = f"[{config.host}]" if ":" in config.host else config.host
    return f"{host}:{config.port}"


def build(
    config: ServeConfig,
    *,
    nvml: Nvml | None = None,
    clock: Clock | None = None,
    version: str | None = None,
) -> Daemon:
    """Wire an exporter from ``config``; ``nvml`` and ``clock`` replace the real ones.

    Raises :class:`BuildError` for a configuration it cannot start with.
    """
    clock = clock or SystemClock()
    watcher = None
    if config.web_config_file is not None:
        try:
            watcher = WebConfigWatcher(config.web_config_file)
        except WebConfigError as exc:
            raise BuildError(f"--web-config-file {config.web_config_file}: {exc}") from None
    # idle_for can reach back no further than the history the cache keeps.
    max_idle_for_seconds = (HISTORY_LENGTH - 1) * config.interval_seconds
    try:
        choose_defaults = parse_defaults(
            config.choose_defaults, max_idle_for_seconds=max_idle_for_seconds
        )
    except ValueError as exc:
        raise BuildError(f"--choose-defaults {config.choose_defaults!r}: {exc}") from None
    try:  # reads leases.json: one it cannot read is a start-up error, not an empty table
        leases = LeaseTable(
            clock,
            state_file=state_file(config.state_dir, discard=config.discard_leases),
            max_ttl_seconds=config.max_lease_seconds,
            max_gpus_per_requester=config.max_gpus_per_requester,
            mem_headroom_bytes=config.mem_headroom_bytes,
            cgroup_of=functools.partial(read_cgroup_key, proc_root=config.proc_root),
        )
    except StateDirError as exc:
        raise BuildError(str(exc)) from None
    nvml = nvml if nvml is not None else open_nvml(config, clock)
    kubelet = kubelet_poller(config)  # --kubernetes: which pod holds which GPU

    cache = new_cache(nvml, clock)
    # Leases are pruned once per sample (expired, GPU gone or down, the job arrived), never
    # by a read: a scrape must not fsync leases.json.
    cache.subscribe(leases.prune)
    requests, rejections = RequestCounter(), RequestCounter()
    xids = XidCounter() if config.xid_events and "xid" not in config.collect_disabled else None
    pcie = PcieRates() if config.pcie_throughput else None

    limits = Limits(  # every limit of the request path, for whatever enforces it
        max_in_flight=config.max_requests_in_flight,
        max_waiters=config.max_waiters,
        max_waiters_per_requester=config.max_waiters_per_requester,
    )
    per_requester = limits.max_waiters_per_requester
    waiters = Waiters(limits.max_waiters, per_requester=per_requester, rejections=rejections)
    registry = CollectorRegistry()
    gpu_collector = GpuCollector(
        cache,
        leases=leases,
        requests=requests,
        rejections=rejections,
        waiters=waiters,
        xids=xids,
        pcie=pcie,
        process_series_limit=config.process_series_limit,
        version=version if version is not None else __version__,
        revision=revision(),
        replaced=REPLACED if config.metric_names == "dcgm" else frozenset(),
    )
    registry.register(gpu_collector)
    dcgm = None
    if config.metric_names != "gpu-exporter":
        pods = kubelet.allocations if kubelet is not None else None
        dcgm = DcgmCollector(cache, dcgm_hostname(), xids=xids, pods=pods)
        registry.register(dcgm)
    if config.metric_names == "dcgm":
        log.info(
            "--metric-names=dcgm: %s are served under dcgm-exporter's names only; the shipped "
            "recording rules, some alerts and /cluster/choose read them: --metric-names=both "
            "keeps them (docs/dcgm-compat.md)",
            ", ".join(sorted(REPLACED)),
        )
    # Collectors rendered on every scrape, after the cached GPU part; same order as registered.
    live: list[Collector] = [ProcessCollector(registry=registry)]
    if watcher is not None:
        live.append(WebConfigCollector(watcher))
        registry.register(live[-1])
    if kubelet is not None:
        live.append(PodCollector(kubelet.allocations, cache, config.process_series_limit))
        registry.register(live[-1])
    exposition = Exposition(cache, gpu_collector, live, dcgm=dcgm)

    cluster = None
    if config.prometheus_url:
        from gpu_exporter.client.choosing import http_claimer
        from gpu_exporter.client.hostapi import release
        from gpu_exporter.fleet.reading import PrometheusReader
        from gpu_exporter.web.cluster import ClusterService

        reader = PrometheusReader(config.prometheus_url, config.prometheus_selector)
        cluster = ClusterService(
            reader, http_claimer, release, choose_defaults, limits=limits, rejections=rejections
        )
    taken = kubelet.allocations.taken if kubelet is not None else None  # pods hold these GPUs
    claimer = Claimer(
        cache, leases, waiters, clock=clock, max_age_seconds=config.max_age_seconds, taken=taken
    )
    services = Services(
        cache=cache,
        registry=registry,
        leases=leases,
        claimer=claimer,
        waiters=waiters,
        clock=clock,
        max_age_seconds=config.max_age_seconds,
        requests=requests,
        rejections=rejections,
        limits=limits,
        cluster=cluster,
        exposition=exposition,
        xids=xids,
        watcher=watcher,
        auth_scope=config.auth_scope,
        choose_defaults=choose_defaults,
        max_idle_for_seconds=max_idle_for_seconds,
        lease_admins=frozenset(config.lease_admins),
        telemetry_path=config.telemetry_path,
    )
    app = create_app(services)

    # Always: lease attribution needs every GPU process's ancestors and cgroup.
    procinfo = ProcInfoCache(config.process_labels, config.proc_root, lineage=True)
    try:
        disabled = parse_disabled(config.collect_disabled)
    except ValueError as exc:
        raise BuildError(f"--no-collect: {exc}") from None
    sampler = Sampler(
        nvml,
        cache,
        interval_seconds=config.interval_seconds,
        nvml_timeout_seconds=config.nvml_timeout_seconds,
        clock=clock,
        procinfo=procinfo,
        slow_interval_seconds=max(config.slow_interval_seconds, config.interval_seconds),
        disabled=disabled,
        gpm_interval_seconds=config.gpm_interval_seconds,
    )
    # Off the main sampling path: each on its own thread, holding its own NVML reference.
    background: list[BackgroundThread] = [kubelet] if kubelet else []
    if xids is not None:
        background.append(XidListener(nvml, xids, clock=clock))
    if pcie is not None:
        background.append(
            PcieThroughputSampler(nvml, pcie, interval_seconds=config.interval_seconds)
        )
    return Daemon(
        config=config,
        clock=clock,
        nvml=nvml,
        cache=cache,
        sampler=sampler,
        leases=leases,
        requests=requests,
        rejections=rejections,
        xids=xids,
        pcie=pcie,
        registry=registry,
        exposition=exposition,
        services=services,
        app=app,
        watcher=watcher,
        background=background,
    )


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> None:
    """Cap glibc's per-thread malloc arenas (``MALLOC_ARENA_MAX``) unless the user set it.

    Each of the server's ~36 threads would otherwise get an arena of its own on first use,
    and RSS grows by several MB under a burst of concurrent requests and stays there. The
    request threads allocate little and briefly, so two arenas cost no measurable speed.
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_ARENA_MAX, arenas)
    except (OSError, AttributeError):  # not glibc: nothing to cap
        pass


def serve(config: ServeConfig) -> int:
    """``gpu-exporter serve``: build, bind, start, serve until SIGTERM/SIGINT; exit status."""
    limit_malloc_arenas()
    lock: StateLock | None = None
    try:
        # Held until the process ends: a second exporter on this directory refuses to start.
        if config.state_dir is not None:
            lock = lock_state_dir(Path(config.state_dir), listen_address(config))
        daemon = build(config)
    except (BuildError, StateDirError) as exc:
        log.error("%s", exc)
        return 2
    try:
        server = daemon.make_server()  # before NVML: a busy port fails fast, without the driver
    except ListenError as exc:
        log.error("%s", exc)
        return 1
    if lock is not None:
        with contextlib.suppress(OSError):  # only the note for a second exporter's error
            lock.note(server.address)

    # NVML is initialised on the sampler thread of this (serving) process — never before a fork.
    daemon.start()
    watcher = daemon.watcher
    for warning in exposure_warnings(
        config.host, watcher.active.config if watcher else None, os.geteuid()
    ):
        log.warning("%s", warning)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if not daemon.stopping.is_set():
            log.info("received %s, shutting down", signal.Signals(signum).name)
            daemon.services.stopping.set()
            threading.Thread(target=daemon.shutdown, name="shutdown", daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info(
        "listening on %s over %s; sampling every %g s",
        server.address,
        server.scheme,
        config.interval_seconds,
    )
    try:
        server.serve()
    finally:
        daemon.stop()
    return 0
