"""The ``gpu-exporter`` command line, argparse only: its subcommands and ``serve``'s flags.

``serve``'s flags become a :class:`~gpu_exporter.config.ServeConfig` for
:func:`gpu_exporter.daemon.serve`, and each can also be set as ``GPU_EXPORTER_<FLAG>``;
``choose``, ``run`` and ``release`` are the client's (:mod:`gpu_exporter.client.commands`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from gpu_exporter import __version__, logs
from gpu_exporter.argparsing import Parser, checked, parse, parser_of
from gpu_exporter.collect.groups import GROUPS, OFF_BY_DEFAULT
from gpu_exporter.config import (
    DEFAULT_CHOOSE_DEFAULTS,
    DEFAULT_KUBELET_SOCKET,
    DEFAULT_LISTEN,
    METRIC_NAMES,
    ServeConfig,
    default_state_dir,
    parse_listen_address,
    parse_process_labels,
    parse_telemetry_path,
    parse_user_list,
)
from gpu_exporter.logs import LOG_FORMATS, LOG_LEVELS, level_name
from gpu_exporter.units import parse_bytes, parse_duration

T = TypeVar("T")
log = logging.getLogger(__name__)


_DEFAULTS = ServeConfig()  # a flag's default is the config's, stated there once


ENV_PREFIX = "GPU_EXPORTER_"


class FlagEnvironment:
    """``GPU_EXPORTER_<FLAG>``: each flag's default from the environment, and the names asked
    for, so that a variable naming no flag is warned about rather than silently ignored."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ
        self.flags: dict[str, str] = {}  # variable → the flag it sets

    def __call__(self, flag: str, default: str | None) -> str | None:
        name = ENV_PREFIX + flag.upper().replace("-", "_").replace(".", "_")
        self.flags.setdefault(name, f"--{flag}")
        return self._environ.get(name, default)

    def flag(self, flag: str) -> bool:
        """A switch: true, 1, yes or on."""
        return (self(flag, "") or "").lower() in ("1", "true", "yes", "on")

    def unknown(self, others: Mapping[str, str] | None = None) -> list[str]:
        """A warning for each ``GPU_EXPORTER_`` variable that is neither a flag's nor one of
        ``others`` (variable → who reads it), naming the closest known one (never the value:
        a misspelt password variable holds a password)."""
        known = {**self.flags, **(others or {})}
        warnings = []
        for name in sorted(n for n in self._environ if n.startswith(ENV_PREFIX)):
            if name in known:
                continue
            closest = difflib.get_close_matches(name, known, n=1, cutoff=0.0)
            hint = f"; did you mean {closest[0]} ({known[closest[0]]})?" if closest else ""
            warnings.append(f"the environment variable {name} names no flag and is ignored{hint}")
        return warnings


def _kubernetes_env(env: FlagEnvironment) -> str | None:
    """``GPU_EXPORTER_KUBERNETES``: a socket path, or true/1/yes/on for the default one."""
    value = env("kubernetes", "") or ""
    if value.lower() in ("1", "true", "yes", "on"):
        return DEFAULT_KUBELET_SOCKET
    return None if value.lower() in ("", "0", "false", "no", "off") else value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0.05 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"expected 0.05 to 3600 seconds, got {text!r}")
    return value


def _bundled_scenarios() -> list[str]:
    """The scenario files shipped in the package, listed without importing the simulator
    (every client command builds this parser too)."""
    return sorted(p.stem for p in (Path(__file__).parent / "simulate" / "scenarios").glob("*.toml"))


def build_parser(env: FlagEnvironment | None = None) -> argparse.ArgumentParser:
    """The command line; ``env`` (default: this process's environment) gives the flags'
    defaults and notes which variables it read."""
    env = env if env is not None else FlagEnvironment(os.environ)
    parser = Parser(
        prog="gpu-exporter",
        description="NVIDIA GPU metrics for Prometheus, and a free-GPU picker for job scripts.",
        epilog="Every flag can also be set in the environment as GPU_EXPORTER_<FLAG>, "
        "e.g. GPU_EXPORTER_LISTEN_ADDRESS=127.0.0.1:9400.",
    )
    parser.add_argument("--version", action="version", version=f"gpu-exporter {__version__}")
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=Parser
    )

    serve = sub.add_parser(
        "serve",
        help="serve /metrics and /choose",
        description="Sample NVML in the background and serve /metrics, /choose, /gpus.",
        epilog="Every flag can also be set as GPU_EXPORTER_<FLAG> (GPU_EXPORTER_INTERVAL=2).",
    )
    serve.add_argument(
        "--listen-address",
        "--web.listen-address",
        dest="listen_address",
        default=env("listen-address", DEFAULT_LISTEN),
        metavar="HOST:PORT",
        help="address to listen on; ':9400' is every interface (default %(default)s; "
        "note dcgm-exporter also defaults to 9400)",
    )
    serve.add_argument(
        "--interval",
        dest="interval_seconds",
        type=_positive_seconds,
        default=env("interval", "1"),
        metavar="SECONDS",
        help="how often to sample NVML (default %(default)s)",
    )
    serve.add_argument(
        "--simulate",
        default=env("simulate", None),
        metavar="N|SCENARIO",
        help="use N simulated GPUs, a scenario file, or a bundled scenario by name "
        f"({', '.join(_bundled_scenarios())}) instead of the NVIDIA driver",
    )
    serve.add_argument(
        "--nvml-timeout",
        dest="nvml_timeout_seconds",
        type=_positive_seconds,
        default=env("nvml-timeout", "5"),
        metavar="SECONDS",
        help="deadline for one GPU's NVML calls in a sample; a GPU whose call does not return "
        "in time is reported down (gpu_down_reason timeout) until it does (default %(default)s)",
    )
    serve.add_argument(
        "--max-age",
        dest="max_age_seconds",
        type=_positive_seconds,
        default=env("max-age", None),
        metavar="SECONDS",
        help="refuse /choose and fail /readyz when the last sample is older than this "
        "(default: 5 intervals, at least 10 s)",
    )
    serve.add_argument(
        "--state-dir",
        default=env("state-dir", None),
        metavar="DIR",
        help="keep leases in DIR/leases.json so a restart never re-issues claimed GPUs; DIR "
        "must be writable by this user alone and is locked: one exporter per DIR "
        "(default: $STATE_DIRECTORY as systemd sets it, else ~/.local/state/gpu-exporter)",
    )
    serve.add_argument(
        "--discard-leases",
        action="store_true",
        default=env.flag("discard-leases"),
        help="start without the leases in DIR/leases.json (moved, unread, to "
        "leases.discarded): for once, when no job holds one and the file cannot be read or "
        "was set aside",
    )
    serve.add_argument(
        "--max-lease",
        dest="max_lease_seconds",
        type=checked(parse_duration),
        default=env("max-lease", "1h"),
        metavar="DURATION",
        help="longest lease /choose grants, e.g. 10m or 2h (default %(default)s)",
    )
    serve.add_argument(
        "--max-gpus-per-requester",
        type=int,
        default=env("max-gpus-per-requester", str(_DEFAULTS.max_gpus_per_requester)),
        metavar="N",
        help="GPUs one requester (a user: basic auth's, or the local user of a client on "
        "this host; else a remote address) may hold in leases at once; 0 = no limit (default)",
    )
    serve.add_argument(
        "--mem-headroom",
        dest="mem_headroom_bytes",
        type=checked(parse_bytes),
        default=env("mem-headroom", "512MiB"),
        metavar="SIZE",
        help="memory kept free on a card that memory leases (/choose?mem=) share "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--process-labels",
        default=env("process-labels", ""),
        metavar="LABELS",
        help="extra labels on gpu_process_memory_used_bytes and in /gpus, comma-separated: "
        "user, command (argv[0] only), container, slurm_job, pod. Off by default: they "
        "show who runs what on a shared host",
    )
    serve.add_argument(
        "--process-series-limit",
        type=int,
        default=env("process-series-limit", str(_DEFAULTS.process_series_limit)),
        metavar="N",
        help="at most N process series per GPU or MIG device, largest first; 0 = none "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--proc-root",
        default=env("proc-root", _DEFAULTS.proc_root),
        metavar="DIR",
        help="where to read processes for --process-labels, e.g. /host/proc in a container "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--collect.pcie-throughput",
        dest="pcie_throughput",
        action="store_true",
        default=env.flag("collect.pcie-throughput"),
        help="export gpu_pcie_throughput_bytes_per_second (NVML measures 20 ms per direction "
        "per GPU; done on its own thread)",
    )
    serve.add_argument(
        "--no-xid-events",
        dest="xid_events",
        action="store_false",
        default=not env.flag("no-xid-events"),
        help="do not listen for Xid errors (gpu_xid_errors_total)",
    )
    # Per-field update intervals and node_exporter-style collector groups (collect/groups.py).
    serve.add_argument(
        "--slow-interval",
        dest="slow_interval_seconds",  # never below --interval: build() sees to it
        type=_positive_seconds,
        default=env("slow-interval", "30"),
        metavar="SECONDS",
        help="how often to read the slow health fields (ECC, remapped rows, PCIe link, "
        "P-state, modes, power limit); their last values stay exported in between "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--gpm-interval",
        dest="gpm_interval_seconds",  # never below --interval: the sampler sees to it
        type=_positive_seconds,
        default=env("gpm-interval", "5"),
        metavar="SECONDS",
        help="how often to read GPM on cards that have it (Hopper and later): two samples "
        "this far apart give SM, tensor, DRAM, PCIe and NVLink activity over the interval "
        "(about 6 ms of driver time per GPU per read; default %(default)s)",
    )
    for group, what in GROUPS.items():
        off = group in OFF_BY_DEFAULT
        serve.add_argument(
            f"--collect.{group}",
            dest=f"collect_{group}",
            action=argparse.BooleanOptionalAction,
            default=env.flag(f"collect.{group}") if off else not env.flag(f"no-collect.{group}"),
            help=f"read and export {what} (default: {'off' if off else 'on'}; "
            f"--no-collect.{group}: no NVML call, no series)",
        )
    serve.add_argument(
        "--max-requests-in-flight",
        type=int,
        default=env("max-requests-in-flight", str(_DEFAULTS.max_requests_in_flight)),
        metavar="N",
        help="requests handled at once; more are answered 503 with Retry-After at once "
        "(/healthz and /readyz are exempt and always get a thread) (default %(default)s)",
    )
    serve.add_argument(
        "--max-waiters",
        type=int,
        default=env("max-waiters", str(_DEFAULTS.max_waiters)),
        metavar="N",
        help="/choose?wait= requests that may wait for GPUs at once; more are answered 503 "
        "too_many_waiters; 0 disables waiting (default %(default)s)",
    )
    serve.add_argument(
        "--max-waiters-per-requester",
        type=int,
        default=env("max-waiters-per-requester", str(_DEFAULTS.max_waiters_per_requester)),
        metavar="N",
        help="of those, how many one requester (as for --max-gpus-per-requester) may have "
        "waiting at once; more are answered 429 too_many_waiters; 0: no limit per requester "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--choose-defaults",
        default=env("choose-defaults", DEFAULT_CHOOSE_DEFAULTS),
        metavar="QUERY",
        help="what 'free' means: the filters /choose (and /cluster/choose) apply when a "
        "request does not give them, in the query string's syntax. Default "
        "'%(default)s': at most 50%% utilization and 50%% of the memory in use, as "
        "GPUtil's getAvailable; '' for none. A request overrides each one: max_util=100%% "
        "turns that one off. mem= requests take only the load filters (max_util, "
        "max_mem_util)",
    )
    serve.add_argument(
        "--prometheus-url",
        default=env("prometheus-url", None),
        metavar="URL",
        help="a Prometheus that scrapes the fleet's exporters: serves GET /cluster/choose, "
        "which picks GPUs across hosts and leases them on the chosen host (default: off)",
    )
    serve.add_argument(
        "--prometheus-selector",
        default=env("prometheus-selector", ""),
        metavar="MATCHERS",
        help="/cluster/choose considers only the targets these label matchers select, "
        "e.g. 'job=\"gpu-shared\"' (default: every gpu-exporter Prometheus scrapes)",
    )
    serve.add_argument(
        "--web-config-file",
        "--web.config.file",
        dest="web_config_file",
        default=env("web-config-file", None),
        metavar="FILE",
        help="TLS, basic auth and response headers, in the Prometheus exporter-toolkit "
        "format (the --web.config.file of node_exporter); re-read when it changes",
    )
    serve.add_argument(
        "--auth-scope",
        choices=("all", "writes"),
        default=env("auth-scope", _DEFAULTS.auth_scope),
        help="which requests need basic auth when the web config has users: all (default; "
        "/healthz and /readyz stay open), or writes: only /choose that takes a lease, /leases and "
        "anything but GET/HEAD, so /metrics, /gpus, /readyz and / stay open",
    )
    serve.add_argument(
        "--lease-admins",
        default=env("lease-admins", ""),
        metavar="USER,...",
        help="basic-auth users (from the web config) who may renew or release any lease by its "
        "id; everyone else needs the lease's token (default: nobody; without basic auth "
        "there are no admins)",
    )
    serve.add_argument(
        "--web.telemetry-path",
        dest="telemetry_path",
        default=env("web.telemetry-path", _DEFAULTS.telemetry_path),
        metavar="PATH",
        help="serve the Prometheus metrics at PATH, and only there (default %(default)s)",
    )
    serve.add_argument(
        "--kubernetes",
        dest="kubernetes_socket",
        nargs="?",
        const=DEFAULT_KUBELET_SOCKET,
        default=_kubernetes_env(env),
        metavar="SOCKET",
        help="on a Kubernetes node: ask the kubelet's PodResources API at SOCKET (default "
        f"{DEFAULT_KUBELET_SOCKET}) every 10 s which pod holds which GPU: gpu_pod_info, and "
        "/choose never hands out a GPU a pod was given. Needs "
        "pip install 'gpu-exporter[kubernetes]'",
    )
    serve.add_argument(
        "--metric-names",
        choices=METRIC_NAMES,
        default=env("metric-names", _DEFAULTS.metric_names),
        help="which names /metrics serves: gpu-exporter's own (default), dcgm: dcgm-exporter's "
        "(DCGM_FI_DEV_GPU_UTIL …, its units and labels) in place of ours for the same values, "
        "so its dashboards work unchanged, or both, for a migration (docs/dcgm-compat.md)",
    )
    serve.add_argument(  # for tests and benchmarks: the kubelet asked more often
        "--kubernetes.poll-interval",
        dest="kubernetes_poll_seconds",
        type=_positive_seconds,
        default=10.0,
        help=argparse.SUPPRESS,
    )
    logs.add_flags(serve, env("log-level", None) or env("log.level", "info"), env)

    from gpu_exporter.client.commands import add_choose_parser, add_release_parser, add_run_parser

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


def _checked(parser: argparse.ArgumentParser, flag: str, parse: Callable[[str], T], text: str) -> T:
    """``parse(text)``; its ValueError is the usage error ``<flag>: <why>``."""
    try:
        return parse(text)
    except ValueError as exc:
        parser.error(f"{flag}: {exc}")


def _serve_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServeConfig:
    from gpu_exporter.outbound import is_http

    prometheus = args.prometheus_url or ""
    if "://" in prometheus and not is_http(prometheus):
        parser.error(f"--prometheus-url: not an http:// or https:// URL: {prometheus}")
    host, port = _checked(parser, "--listen-address", parse_listen_address, args.listen_address)
    if level_name(args.log_level) not in LOG_LEVELS:  # from the environment: not checked yet
        parser.error("--log.level must be one of debug, info, warn, error")
    if args.log_format not in LOG_FORMATS:  # from the environment
        parser.error(f"--log.format must be one of {', '.join(LOG_FORMATS)}")
    telemetry_path = _checked(
        parser, "--web.telemetry-path", parse_telemetry_path, args.telemetry_path
    )
    if args.max_gpus_per_requester < 0:
        parser.error("--max-gpus-per-requester must be 0 (no limit) or more")
    process_labels = _checked(parser, "--process-labels", parse_process_labels, args.process_labels)
    if args.process_series_limit < 0:
        parser.error("--process-series-limit must be 0 or more")
    if not 1 <= args.max_requests_in_flight <= 1024:
        parser.error("--max-requests-in-flight must be from 1 to 1024")
    if not 0 <= args.max_waiters < args.max_requests_in_flight:
        parser.error("--max-waiters must be from 0 to less than --max-requests-in-flight")
    if args.max_waiters_per_requester < 0:
        parser.error("--max-waiters-per-requester must be 0 (no limit) or more")
    if args.auth_scope not in ("all", "writes"):  # from the environment
        parser.error("--auth-scope must be all or writes")
    if args.metric_names not in METRIC_NAMES:  # from the environment
        parser.error(f"--metric-names must be one of {', '.join(METRIC_NAMES)}")
    from gpu_exporter.choose.defaults import parse_defaults
    from gpu_exporter.fleet.queries import check_selector

    # idle_for's limit is checked by build()
    _checked(parser, "--choose-defaults", parse_defaults, args.choose_defaults)
    if args.web_config_file is not None:
        from gpu_exporter.web.webconfig import WebConfigError, load

        try:
            load(args.web_config_file)  # refuse to start on a bad file, with one line
        except WebConfigError as exc:
            parser.error(f"--web-config-file {args.web_config_file}: {exc}")
    if args.kubernetes_socket is not None and importlib.util.find_spec("grpc") is None:
        parser.error("--kubernetes needs grpcio: pip install 'gpu-exporter[kubernetes]'")
    selector = args.prometheus_selector
    selector = selector and _checked(parser, "--prometheus-selector", check_selector, selector)
    # Each flag's dest is the field it sets; these are checked or worked out from others.
    fields = {f.name for f in dataclasses.fields(ServeConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields}
    return ServeConfig(
        **given
        | dict(
            host=host,
            port=port,
            log_level=level_name(args.log_level),
            max_age_seconds=args.max_age_seconds or max(10.0, 5 * args.interval_seconds),
            state_dir=args.state_dir or os.environ.get("STATE_DIRECTORY") or default_state_dir(),
            process_labels=process_labels,
            prometheus_url=args.prometheus_url or None,
            prometheus_selector=selector,
            lease_admins=parse_user_list(args.lease_admins),
            telemetry_path=telemetry_path,
            collect_disabled=tuple(g for g in GROUPS if not getattr(args, f"collect_{g}")),
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    env = FlagEnvironment(os.environ)
    parser = build_parser(env)
    args = parse(parser, argv)
    if args.command == "serve":
        # Its checks name `gpu-exporter serve` and point to its --help.
        config = _serve_config(args, parser_of(parser, args))
        logs.setup(config.log_level, config.log_format)
        from gpu_exporter.client.transport import PASSWORD_ENV, URL_ENV, USER_ENV

        client = "the client's, not serve's"
        for warning in env.unknown(dict.fromkeys((URL_ENV, USER_ENV, PASSWORD_ENV), client)):
            log.warning("%s", warning)
        # Imported here so that `gpu-exporter --help` and the client commands need no Flask.
        from gpu_exporter.daemon import serve

        return serve(config)
    if args.command == "choose":
        from gpu_exporter.client.commands import choose_main

        return choose_main(args)
    if args.command == "run":
        from gpu_exporter.client.run import run_main

        return run_main(args)
    if args.command == "release":
        from gpu_exporter.client.commands import release_main

        return release_main(args)
    if args.command == "hash-password":
        from gpu_exporter.web.auth import hash_password_main

        return hash_password_main(args)
    parser.error(f"unknown command {args.command!r}")
