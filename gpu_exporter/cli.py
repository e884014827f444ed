"""Command line: ``gpu-exporter serve``. Every flag can also be set as ``GPU_EXPORTER_<FLAG>``."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from gpu_exporter import __version__

log = logging.getLogger("gpu_exporter")

DEFAULT_LISTEN = ":9400"
M_ARENA_MAX = -8  # glibc mallopt() parameter
MALLOC_ARENAS = 2
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True)
class ServeConfig:
    host: str  # "" means every interface
    port: int
    interval_seconds: float
    simulate: str | None
    log_level: str
    max_age_seconds: float
    state_dir: str | None = None  # None: leases are not kept across restarts
    max_lease_seconds: float = 3600.0
    max_gpus_per_requester: int = 0  # 0: no limit
    process_labels: tuple[str, ...] = ()  # opt-in attribution of GPU processes
    process_series_limit: int = 64
    proc_root: str = "/proc"
    pcie_throughput: bool = False
    xid_events: bool = True
    nvml_timeout_seconds: float = 5.0
    max_requests_in_flight: int = 32
    max_waiters: int = 8
    prometheus_url: str | None = None  # serves /cluster/choose from this Prometheus
    prometheus_selector: str = ""  # label matchers narrowing /cluster/choose's fleet
    web_config_file: str | None = None  # TLS, basic auth, headers (exporter-toolkit format)
    auth_scope: str = "all"  # "all", or "writes": only lease-taking requests need credentials


def parse_listen_address(text: str) -> tuple[str, int]:
    """``":9400"``, ``"127.0.0.1:9400"``, ``"[::1]:9400"`` → (host, port); host "" = all.

    >>> parse_listen_address(":9400"), parse_listen_address("[::1]:80")
    (('', 9400), ('::1', 80))
    """
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT such as :9400 or 127.0.0.1:9400, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _env(flag: str, default: str | None) -> str | None:
    return os.environ.get(
        "GPU_EXPORTER_" + flag.upper().replace("-", "_").replace(".", "_"), default
    )


def _env_bool(flag: str) -> bool:
    return (_env(flag, "") or "").lower() in ("1", "true", "yes", "on")


def parse_process_labels(text: str) -> tuple[str, ...]:
    """``--process-labels``' value → the labels, in their fixed order.

    >>> parse_process_labels("command,user")
    ('user', 'command')
    """
    from gpu_exporter.model import PROCESS_LABELS

    wanted = {part.strip() for part in text.split(",") if part.strip()}
    unknown = wanted - set(PROCESS_LABELS)
    if unknown:
        raise ValueError(
            f"unknown process labels {', '.join(sorted(unknown))}; "
            f"choose from {', '.join(PROCESS_LABELS)}"
        )
    return tuple(label for label in PROCESS_LABELS if label in wanted)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0.05 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"expected 0.05 to 3600 seconds, got {text!r}")
    return value


def _duration(text: str) -> float:
    from gpu_exporter.units import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpu-exporter",
        description="NVIDIA GPU metrics for Prometheus, and a free-GPU picker for job scripts.",
        epilog="Every flag can also be set in the environment as GPU_EXPORTER_<FLAG>, "
        "e.g. GPU_EXPORTER_LISTEN_ADDRESS=127.0.0.1:9400.",
    )
    parser.add_argument("--version", action="version", version=f"gpu-exporter {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser(
        "serve",
        help="serve /metrics and /choose",
        description="Sample NVML in the background and serve /metrics, /choose, /gpus.",
        epilog="Every flag can also be set as GPU_EXPORTER_<FLAG> (GPU_EXPORTER_INTERVAL=2).",
    )
    serve.add_argument(
        "--listen-address",
        default=_env("listen-address", DEFAULT_LISTEN),
        metavar="HOST:PORT",
        help="address to listen on; ':9400' is every interface (default %(default)s; "
        "note dcgm-exporter also defaults to 9400)",
    )
    serve.add_argument(
        "--interval",
        type=_positive_seconds,
        default=_env("interval", "1"),
        metavar="SECONDS",
        help="how often to sample NVML (default %(default)s)",
    )
    serve.add_argument(
        "--simulate",
        default=_env("simulate", None),
        metavar="N|SCENARIO.toml",
        help="use N simulated GPUs, or a scenario file, instead of the NVIDIA driver",
    )
    serve.add_argument(
        "--nvml-timeout",
        type=_positive_seconds,
        default=_env("nvml-timeout", "5"),
        metavar="SECONDS",
        help="deadline for one GPU's NVML calls in a sample; a GPU whose call does not return "
        "in time is reported down (gpu_down_reason timeout) until it does (default %(default)s)",
    )
    serve.add_argument(
        "--max-age",
        type=_positive_seconds,
        default=_env("max-age", None),
        metavar="SECONDS",
        help="refuse /choose and fail /readyz when the last sample is older than this "
        "(default: 5 intervals, at least 10 s)",
    )
    serve.add_argument(
        "--state-dir",
        default=_env("state-dir", None),
        metavar="DIR",
        help="keep leases in DIR/leases.json so a restart never re-issues claimed GPUs "
        "(default: $STATE_DIRECTORY as systemd sets it, else ~/.local/state/gpu-exporter)",
    )
    serve.add_argument(
        "--max-lease",
        type=_duration,
        default=_env("max-lease", "1h"),
        metavar="DURATION",
        help="longest lease /choose grants, e.g. 10m or 2h (default %(default)s)",
    )
    serve.add_argument(
        "--max-gpus-per-requester",
        type=int,
        default=_env("max-gpus-per-requester", "0"),
        metavar="N",
        help="GPUs one client address may hold in leases at once; 0 = no limit (default)",
    )
    serve.add_argument(
        "--process-labels",
        default=_env("process-labels", ""),
        metavar="LABELS",
        help="extra labels on gpu_process_memory_used_bytes and in /gpus, comma-separated: "
        "user, command (argv[0] only), container, slurm_job, pod. Off by default: they "
        "show who runs what on a shared host",
    )
    serve.add_argument(
        "--process-series-limit",
        type=int,
        default=_env("process-series-limit", "64"),
        metavar="N",
        help="at most N process series per GPU or MIG device, largest first; 0 = none "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--proc-root",
        default=_env("proc-root", "/proc"),
        metavar="DIR",
        help="where to read processes for --process-labels, e.g. /host/proc in a container "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--collect.pcie-throughput",
        dest="pcie_throughput",
        action="store_true",
        default=_env_bool("collect.pcie-throughput"),
        help="export gpu_pcie_throughput_bytes_per_second (NVML measures 20 ms per direction "
        "per GPU; done on its own thread)",
    )
    serve.add_argument(
        "--no-xid-events",
        dest="xid_events",
        action="store_false",
        default=not _env_bool("no-xid-events"),
        help="do not listen for Xid errors (gpu_xid_errors_total)",
    )
    serve.add_argument(
        "--max-requests-in-flight",
        type=int,
        default=_env("max-requests-in-flight", "32"),
        metavar="N",
        help="requests handled at once; more are answered 503 with Retry-After at once "
        "(/healthz and /readyz are exempt and always get a thread) (default %(default)s)",
    )
    serve.add_argument(
        "--max-waiters",
        type=int,
        default=_env("max-waiters", "8"),
        metavar="N",
        help="/choose?wait= requests that may wait for GPUs at once; more are answered 503 "
        "too_many_waiters; 0 disables waiting (default %(default)s)",
    )
    serve.add_argument(
        "--prometheus-url",
        default=_env("prometheus-url", None),
        metavar="URL",
        help="a Prometheus that scrapes the fleet's exporters: serves GET /cluster/choose, "
        "which picks GPUs across hosts and leases them on the chosen host (default: off)",
    )
    serve.add_argument(
        "--prometheus-selector",
        default=_env("prometheus-selector", ""),
        metavar="MATCHERS",
        help="/cluster/choose considers only the targets these label matchers select, "
        "e.g. 'job=\"gpu-shared\"' (default: every gpu-exporter Prometheus scrapes)",
    )
    serve.add_argument(
        "--web-config-file",
        default=_env("web-config-file", None),
        metavar="FILE",
        help="TLS, basic auth and response headers, in the Prometheus exporter-toolkit "
        "format (the --web.config.file of node_exporter); re-read when it changes",
    )
    serve.add_argument(
        "--auth-scope",
        choices=("all", "writes"),
        default=_env("auth-scope", "all"),
        help="which requests need basic auth when the web config has users: all (default; "
        "/healthz and /readyz stay open), or writes: only /choose that takes a lease, /leases and "
        "anything but GET/HEAD, so /metrics, /gpus, /readyz and / stay open",
    )
    serve.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=_env("log-level", "info"),
        help="default %(default)s",
    )

    from gpu_exporter.run import add_choose_parser, add_release_parser, add_run_parser

    add_choose_parser(sub)
    add_run_parser(sub)
    add_release_parser(sub)
    hash_password = sub.add_parser(
        "hash-password",
        help="print a bcrypt hash for basic_auth_users",
        description="Read a password (asked twice on a terminal, else the first line of "
        "standard input) and print its bcrypt hash for basic_auth_users in --web-config-file. "
        "The password is never taken from the command line, where `ps` would show it.",
    )
    hash_password.add_argument(
        "--cost",
        type=int,
        default=10,
        metavar="N",
        help="bcrypt cost, 4-31; each step doubles the time (default %(default)s, about "
        "70 ms per check; successful checks are cached)",
    )
    return parser


def _selector(text: str, parser: argparse.ArgumentParser) -> str:
    from gpu_exporter.cluster import check_selector

    try:
        return check_selector(text)
    except ValueError as exc:
        parser.error(f"--prometheus-selector: {exc}")


def _default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return os.path.join(base, "gpu-exporter")


def _serve_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServeConfig:
    try:
        host, port = parse_listen_address(args.listen_address)
    except ValueError as exc:
        parser.error(f"--listen-address: {exc}")
    if args.log_level not in LOG_LEVELS:  # from the environment, which argparse does not check
        parser.error(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
    interval = float(args.interval)
    max_age = float(args.max_age) if args.max_age is not None else max(10.0, 5 * interval)
    if args.max_gpus_per_requester < 0:
        parser.error("--max-gpus-per-requester must be 0 (no limit) or more")
    try:
        process_labels = parse_process_labels(args.process_labels)
    except ValueError as exc:
        parser.error(f"--process-labels: {exc}")
    if args.process_series_limit < 0:
        parser.error("--process-series-limit must be 0 or more")
    if not 1 <= args.max_requests_in_flight <= 1024:
        parser.error("--max-requests-in-flight must be from 1 to 1024")
    if not 0 <= args.max_waiters < args.max_requests_in_flight:
        parser.error("--max-waiters must be from 0 to less than --max-requests-in-flight")
    if args.auth_scope not in ("all", "writes"):  # from the environment
        parser.error("--auth-scope must be all or writes")
    if args.web_config_file is not None:
        from gpu_exporter.webconfig import WebConfigError, load

        try:
            load(args.web_config_file)  # refuse to start on a bad file, with one line
        except WebConfigError as exc:
            parser.error(f"--web-config-file {args.web_config_file}: {exc}")
    return ServeConfig(
        host,
        port,
        interval,
        args.simulate,
        args.log_level,
        max_age,
        state_dir=args.state_dir or os.environ.get("STATE_DIRECTORY") or _default_state_dir(),
        max_lease_seconds=float(args.max_lease),
        max_gpus_per_requester=int(args.max_gpus_per_requester),
        process_labels=process_labels,
        process_series_limit=int(args.process_series_limit),
        proc_root=args.proc_root,
        pcie_throughput=bool(args.pcie_throughput),
        xid_events=bool(args.xid_events),
        nvml_timeout_seconds=float(args.nvml_timeout),
        max_requests_in_flight=int(args.max_requests_in_flight),
        max_waiters=int(args.max_waiters),
        prometheus_url=args.prometheus_url or None,
        prometheus_selector=_selector(args.prometheus_selector, parser),
        web_config_file=args.web_config_file,
        auth_scope=args.auth_scope,
    )


def _state_file(state_dir: str | None) -> Path | None:
    """``<state-dir>/leases.json``, or None (with a warning) when the directory is unusable."""
    if state_dir is None:
        return None
    path = Path(state_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as exc:
        log.warning("leases will not survive a restart: cannot use --state-dir %s (%s)", path, exc)
        return None
    return path / "leases.json"


def _limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> None:
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
    _limit_malloc_arenas()
    # Imported here so that `gpu-exporter --help` stays fast and needs no Flask.
    from prometheus_client import CollectorRegistry, ProcessCollector
    from prometheus_client.registry import Collector

    from gpu_exporter.app import create_app
    from gpu_exporter.background import NvmlThread
    from gpu_exporter.counters import PcieRates, XidCounter
    from gpu_exporter.events import XidListener
    from gpu_exporter.exposition import Exposition
    from gpu_exporter.leases import LeaseTable
    from gpu_exporter.limits import PROBE_THREADS, Waiters
    from gpu_exporter.metrics import GpuCollector, RequestCounter, WebConfigCollector
    from gpu_exporter.nvml import Nvml
    from gpu_exporter.pcie import PcieThroughputSampler
    from gpu_exporter.procinfo import ProcInfoCache
    from gpu_exporter.sampler import Sampler, SystemClock, new_cache
    from gpu_exporter.server import ListenError, Server
    from gpu_exporter.webconfig import WebConfigError, WebConfigWatcher, exposure_warnings, secure

    watcher = None
    if config.web_config_file is not None:
        try:
            watcher = WebConfigWatcher(config.web_config_file)
        except WebConfigError as exc:
            log.error("--web-config-file %s: %s", config.web_config_file, exc)
            return 2

    clock = SystemClock()
    if config.simulate is not None:
        from gpu_exporter.simulate import SimulatedNvml

        try:
            lib = SimulatedNvml.from_argument(config.simulate, clock=clock.monotonic)
        except ValueError as exc:
            log.error("%s", exc)
            return 2
        nvml = Nvml(lib, simulated=True)
        log.warning(
            "simulating %d GPUs (--simulate %s): no real device is read",
            len(lib.gpus),
            config.simulate,
        )
    else:
        nvml = Nvml()

    cache = new_cache(nvml, clock)
    leases = LeaseTable(
        clock,
        state_file=_state_file(config.state_dir),
        max_ttl_seconds=config.max_lease_seconds,
        max_gpus_per_requester=config.max_gpus_per_requester,
    )
    requests, rejections = RequestCounter(), RequestCounter()
    xids = XidCounter() if config.xid_events else None
    pcie = PcieRates() if config.pcie_throughput else None
    registry = CollectorRegistry()
    gpu_collector = GpuCollector(
        cache,
        leases=leases,
        requests=requests,
        rejections=rejections,
        xids=xids,
        pcie=pcie,
        process_series_limit=config.process_series_limit,
    )
    registry.register(gpu_collector)
    # Collectors rendered on every scrape, after the cached GPU part; same order as registered.
    live: list[Collector] = [ProcessCollector(registry=registry)]
    if watcher is not None:
        live.append(WebConfigCollector(watcher))
        registry.register(live[-1])
    exposition = Exposition(cache, gpu_collector, live)
    stopping = threading.Event()
    cluster = None
    if config.prometheus_url:
        from gpu_exporter.cluster import ClusterService

        cluster = ClusterService(config.prometheus_url, config.prometheus_selector)
    app = create_app(
        cache,
        registry,
        clock=clock,
        max_age_seconds=config.max_age_seconds,
        leases=leases,
        requests=requests,
        rejections=rejections,
        max_in_flight=config.max_requests_in_flight,
        waiters=Waiters(config.max_waiters),
        stopping=stopping,
        xids=xids,
        cluster=cluster,
        exposition=exposition,
    )

    # A few threads beyond the request limit, so that probes always find one free.
    threads = config.max_requests_in_flight + PROBE_THREADS
    if watcher is not None:
        tls = watcher.tls_context if watcher.active.context is not None else None
        server = Server(
            secure(app, watcher, config.auth_scope),
            config.host,
            config.port,
            threads=threads,
            tls=tls,
        )
    else:
        server = Server(app, config.host, config.port, threads=threads)
    try:
        server.bind()  # before NVML: a busy port fails fast, without touching the driver
    except ListenError as exc:
        log.error("%s", exc)
        return 1

    # NVML is initialised on the sampler thread of this (serving) process — never before a fork.
    procinfo = (
        ProcInfoCache(config.process_labels, config.proc_root) if config.process_labels else None
    )
    sampler = Sampler(
        nvml,
        cache,
        interval_seconds=config.interval_seconds,
        nvml_timeout_seconds=config.nvml_timeout_seconds,
        clock=clock,
        procinfo=procinfo,
    )
    sampler.start()
    # Off the main sampling path: each on its own thread, holding its own NVML reference.
    background: list[NvmlThread] = []
    if xids is not None:
        background.append(XidListener(nvml, xids, clock=clock))
    if pcie is not None:
        background.append(
            PcieThroughputSampler(nvml, pcie, interval_seconds=config.interval_seconds)
        )
    for thread in background:
        thread.start()
    if watcher is not None:
        watcher.start()
    for warning in exposure_warnings(
        config.host, watcher.active.config if watcher else None, os.geteuid()
    ):
        log.warning("%s", warning)
    exposition.start()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if not stopping.is_set():
            stopping.set()
            log.info("received %s, shutting down", signal.Signals(signum).name)
            threading.Thread(target=server.stop, name="shutdown", daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info(
        "listening on %s (%s), sampling every %g s",
        server.address,
        server.scheme,
        config.interval_seconds,
    )
    try:
        server.serve()
    finally:
        exposition.stop()
        for thread in background:
            thread.stop()
        sampler.stop()
        if watcher is not None:
            watcher.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        config = _serve_config(args, parser)
        logging.basicConfig(
            level=config.log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
        return serve(config)
    if args.command == "choose":
        from gpu_exporter.run import choose_main

        return choose_main(args)
    if args.command == "run":
        from gpu_exporter.run import run_main

        return run_main(args)
    if args.command == "release":
        from gpu_exporter.run import release_main

        return release_main(args)
    if args.command == "hash-password":
        from gpu_exporter.webconfig import hash_password_main

        return hash_password_main(args)
    parser.error(f"unknown command {args.command!r}")
