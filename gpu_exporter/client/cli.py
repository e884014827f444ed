"""``gpu-exporter choose`` and ``gpu-exporter run``: the client on the command line.

``choose`` prints exactly what the server's ``/choose`` prints, so it drops into scripts::

    eval "$(gpu-exporter choose -n 2 --format env)"   # CUDA_VISIBLE_DEVICES, GPU_LEASE, …

``run`` leases GPUs for as long as a command runs, and no longer::

    gpu-exporter run -n 2 --min-free 20GiB --wait 10m -- python train.py

It sets ``CUDA_VISIBLE_DEVICES`` (UUIDs), ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and ``GPU_LEASE`` in
the command's environment, renews the lease while the command runs, releases it when the
command ends, forwards SIGINT and SIGTERM to it, and exits with its exit status (128 + N when
it was killed by signal N). If ``run`` itself is killed (SIGKILL), renewals stop and the
lease expires by itself after its TTL.

With ``--prometheus URL`` (and/or ``--hosts a,b,c``) both choose across hosts instead
(:mod:`gpu_exporter.client.fleet`, docs/cluster.md): all N GPUs on one host, leased by that host's
exporter. ``choose`` then prints ``HOST GPU-a,GPU-b`` (``--format env`` adds ``GPU_HOST`` and
``GPU_EXPORTER_URL``); ``run`` sets those two as well and holds the lease from here, while
COMMAND is expected to go to ``$GPU_HOST`` (ssh, srun -w) to use the GPUs.

Exit status of both, before any command runs: 3 when not enough GPUs qualify, 2 for bad
arguments (ours or the server's 400), 1 for anything else (no server, 429, NVML down …).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import warnings
from types import FrameType
from typing import TYPE_CHECKING, Any

from gpu_exporter import client
from gpu_exporter.client import (
    DEFAULT_LEASE,
    URL_ENV,
    Choice,
    GpuExporterError,
    LeaseKeeper,
    LeaseNotFound,
    NoGpusAvailable,
    ServerError,
)

if TYPE_CHECKING:
    from gpu_exporter.client.fleet import ClusterChoice

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_NO_GPUS = 3
EXIT_NO_LEASE = 4
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# Flag, metavar, help; the query parameter is the flag without dashes, "-" as "_".
FILTER_FLAGS = (
    ("--min-free", "SIZE", "free memory at least this: 8GiB, 500MB (8G means GiB)"),
    ("--min-total", "SIZE", "total memory at least this"),
    ("--max-util", "RATIO", "utilization at most this: 0.1 or 10%%"),
    ("--max-mem-util", "RATIO", "memory-bandwidth utilization at most this"),
    ("--max-procs", "N", "at most N compute processes already on the GPU"),
    ("--model", "NAME", "only this GPU model (as /choose's model parameter matches it)"),
    ("--include", "GPUS", "only these GPUs: NVML indices, UUIDs or prefixes, PCI bus ids"),
    ("--exclude", "GPUS", "never these GPUs: NVML indices, UUIDs or prefixes, PCI bus ids"),
    ("--idle-for", "DURATION", "only GPUs that have been idle at least this long: 5m"),
    ("--sort", "ORDER", "ranking: free (default), free_ratio, util, power or pack"),
)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of 1 or more, got {text!r}")
    return int(text)


def _duration_text(text: str) -> str:
    """Checked like the server will, but passed on as typed."""
    from gpu_exporter.units import parse_duration

    try:
        parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_choice_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n", type=_positive_int, default=1, metavar="N", help="how many GPUs (default 1)"
    )
    parser.add_argument(
        "--url",
        default=None,
        help=f"the gpu-exporter to ask (default ${URL_ENV}, else {client.DEFAULT_URL})",
    )
    parser.add_argument(
        "--lease",
        type=_duration_text,
        default=DEFAULT_LEASE,
        metavar="DURATION",
        help="reserve the GPUs this long, so that nobody else is handed them "
        "(default %(default)s; 0: advice only, nothing reserved)",
    )
    parser.add_argument(
        "--wait",
        type=_duration_text,
        default=None,
        metavar="DURATION",
        help="wait up to this long for enough GPUs to qualify, e.g. 10m (default: fail at once)",
    )
    parser.add_argument("--owner", default=None, metavar="LABEL", help="a label for the lease")
    fleet = parser.add_argument_group(
        "across hosts (instead of --url): all N GPUs on one host, leased by its exporter"
    )
    fleet.add_argument(
        "--prometheus",
        default=None,
        metavar="URL",
        help="read the fleet from this Prometheus (which scrapes every host's exporter)",
    )
    fleet.add_argument(
        "--hosts",
        default=None,
        metavar="HOST[:PORT],...",
        help="ask these exporters directly (port 9400 unless given); with --prometheus, only "
        "when Prometheus cannot be asked",
    )
    fleet.add_argument(
        "--selector",
        default=None,
        metavar="MATCHERS",
        help="with --prometheus: only the targets these label matchers select, "
        "e.g. 'job=\"gpu-shared\"'",
    )
    fleet.add_argument(
        "--max-age",
        type=_duration_text,
        default=None,
        metavar="DURATION",
        help="never use fleet figures older than this (default 60s)",
    )
    filters = parser.add_argument_group("filters (passed to /choose as they are)")
    for flag, metavar, help_text in FILTER_FLAGS:
        filters.add_argument(flag, default=None, metavar=metavar, help=help_text)


def add_choose_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "choose",
        help="print the freest GPUs, as /choose does",
        description="Ask a gpu-exporter for the freest GPUs and print its answer as it is. "
        "The GPUs are leased (--lease, default 60s) so that a concurrent chooser gets others: "
        "start the job within that time (or use `run`, which holds the lease while a command "
        "runs); DELETE /leases/$GPU_LEASE gives them back early.",
        epilog="Exit status: 0 chosen, 3 not enough GPUs qualify, 2 bad arguments, 1 otherwise.",
    )
    _add_choice_arguments(parser)
    parser.add_argument(
        "--format",
        choices=("uuid", "index", "env", "json"),
        default="uuid",
        help="uuid: GPU-a,GPU-b (default); index: NVML indices; "
        "env: an `export …` line for eval; json: the ranking with figures and reasons. "
        "Across hosts: 'HOST GPU-a,GPU-b' per host, and env adds GPU_HOST and GPU_EXPORTER_URL",
    )
    parser.add_argument(
        "--spread",
        action="store_true",
        help="with --prometheus/--hosts: the GPUs may come from several hosts "
        "(one line per host; not with --format env)",
    )


def add_run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "run",
        help="run a command on leased GPUs",
        description="Choose and lease GPUs, run COMMAND with CUDA_VISIBLE_DEVICES (UUIDs), "
        "CUDA_DEVICE_ORDER=PCI_BUS_ID and GPU_LEASE set, renew the lease while it runs and "
        "release it when it ends. SIGINT and SIGTERM are forwarded to COMMAND. "
        "With --prometheus/--hosts the GPUs may be on another host: GPU_HOST names it and "
        "GPU_EXPORTER_URL its exporter, and COMMAND is expected to go there "
        '(ssh "$GPU_HOST" …, srun -w "$GPU_HOST" …) while the lease is held from here.',
        epilog="Exit status: COMMAND's (128+N if signal N killed it); before it runs: "
        "3 not enough GPUs qualify, 2 bad arguments, 1 otherwise, 127 COMMAND not found.",
        usage="%(prog)s [-n N] [--wait DURATION] [options] [filters] -- COMMAND [ARG ...]",
    )
    _add_choice_arguments(parser)
    parser.add_argument(
        "--no-local-fallback",
        dest="local_fallback",
        action="store_false",
        help="fail when no server answers, instead of choosing from this host's NVML "
        "without a lease (with a warning)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="say nothing on success")
    # Not "command": cli.py's subparsers keep the subcommand's name there.
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="COMMAND", help="to run")


def _filters(args: argparse.Namespace) -> dict[str, Any]:
    names = (flag.removeprefix("--").replace("-", "_") for flag, _, _ in FILTER_FLAGS)
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _fail(exc: GpuExporterError, prefix: str = "") -> int:
    print(f"{prefix}error: {exc}", file=sys.stderr)
    if isinstance(exc, NoGpusAvailable):
        return EXIT_NO_GPUS
    if isinstance(exc, ServerError) and exc.status == 400:
        return EXIT_USAGE
    return EXIT_FAILURE


def _fleet(args: argparse.Namespace) -> bool:
    """Across hosts? Then --url makes no sense."""
    if not (args.prometheus or args.hosts):
        if args.max_age is not None or args.selector or getattr(args, "spread", False):
            raise client.ServerError(
                400, "--max-age, --selector and --spread need --prometheus or --hosts"
            )
        return False
    if args.url is not None:
        raise client.ServerError(400, "give --url (one host) or --prometheus/--hosts, not both")
    return True


def _choose_fleet(args: argparse.Namespace, *, spread: bool) -> ClusterChoice:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = client.choose_cluster(
            args.n,
            prometheus=args.prometheus,
            hosts=args.hosts,
            spread=spread,
            lease=args.lease,
            wait=args.wait,
            owner=args.owner,
            max_age=args.max_age,
            selector=args.selector,
            **_filters(args),
        )
    for warning in caught:
        print(f"gpu-exporter: warning: {warning.message}", file=sys.stderr)
    return result


def choose_main(args: argparse.Namespace) -> int:
    """``gpu-exporter choose``: print ``/choose``'s answer, or its error on stderr."""
    try:
        if _fleet(args):
            if args.spread and args.format == "env":
                raise client.ServerError(400, "--format env names one host; not with --spread")
            sys.stdout.write(_choose_fleet(args, spread=args.spread).text(args.format))
            sys.stdout.flush()
            return 0
    except GpuExporterError as exc:
        return _fail(exc)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    try:
        answer = client.choose_raw(
            args.n,
            args.url,
            format=args.format,
            lease=args.lease,
            wait=args.wait,
            owner=args.owner,
            **_filters(args),
        )
    except GpuExporterError as exc:
        return _fail(exc)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    sys.stdout.write(answer.body)
    sys.stdout.flush()
    return 0


def add_release_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "release",
        help="give leased GPUs back now",
        description="Release a lease before it expires, e.g. at the end of a job script that "
        'ran eval "$(gpu-exporter choose --format env)".',
        epilog="Exit status: 0 released, 4 no such lease (expired, released, or let go once "
        "the job's work showed on its GPUs), 1 otherwise.",
    )
    parser.add_argument(
        "lease",
        nargs="?",
        default=os.environ.get("GPU_LEASE"),
        metavar="LEASE",
        help="the lease id (default $GPU_LEASE)",
    )
    parser.add_argument(
        "--url",
        default=None,
        help=f"the gpu-exporter that granted it (default ${URL_ENV}, else {client.DEFAULT_URL})",
    )


def release_main(args: argparse.Namespace) -> int:
    """``gpu-exporter release``: DELETE /leases/<id>."""
    if not args.lease:
        print("error: no lease given and GPU_LEASE is not set", file=sys.stderr)
        return EXIT_USAGE
    try:
        client.release(args.lease, args.url)
    except LeaseNotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NO_LEASE
    except GpuExporterError as exc:
        return _fail(exc)
    return 0


# -- run ---------------------------------------------------------------------------------


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminal_sent_sigint_to(pid: int) -> bool:
    """Did Ctrl-C on our terminal already send SIGINT to ``pid``?

    It did when ``pid`` is in our process group and that group is the terminal's foreground
    group; forwarding it again would deliver it twice. A ``kill -INT`` aimed at us alone
    while we are in the foreground is then not forwarded: the cost of not seeing the sender.
    """
    try:
        if os.getpgid(pid) != os.getpgrp():
            return False
        tty = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:  # the child is gone, or we have no controlling terminal
        return False
    try:
        return os.tcgetpgrp(tty) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(tty)


class _SignalForwarder:
    """SIGINT/SIGTERM: before the command starts, stop; while it runs, pass them on."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.holding = False  # set while starting the command, and while cleaning up
        self.pending: list[int] = []
        self._previous: dict[int, signal._HANDLER] = {}

    def __enter__(self) -> _SignalForwarder:
        for signum in FORWARDED_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def started(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.holding = False
        while self.pending:
            self._forward(self.pending.pop(0))

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.proc is not None:
            self._forward(signum)
        elif self.holding:
            self.pending.append(signum)
        else:
            raise _Interrupted(signum)

    def _forward(self, signum: int) -> None:
        assert self.proc is not None
        if signum == signal.SIGINT and _terminal_sent_sigint_to(self.proc.pid):
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signum)


def _describe(choice: Choice, keeper: LeaseKeeper | None) -> str:
    gpus = ", ".join(f"{i} ({u})" for i, u in zip(choice.indices, choice.uuids, strict=True))
    plural = "s" if len(choice.uuids) > 1 else ""
    if choice.host is not None:
        gpus += f" on host {choice.host} ({choice.url})"
    if keeper is not None:
        return (
            f"GPU{plural} {gpus}, lease {keeper.lease_id} "
            f"(renewed every {keeper.interval_seconds:.3g} s)"
        )
    return f"GPU{plural} {gpus}, without a lease"


def run_main(args: argparse.Namespace) -> int:
    """``gpu-exporter run``: lease, run, renew meanwhile, release; exit as the command did."""
    prefix = "gpu-exporter run: "
    logging.basicConfig(level=logging.WARNING, format=prefix + "%(message)s")
    command = list(args.program)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print(
            f"{prefix}error: no command given: gpu-exporter run [options] -- COMMAND",
            file=sys.stderr,
        )
        return EXIT_USAGE

    choice: Choice | None = None
    keeper: LeaseKeeper | None = None
    with _SignalForwarder() as signals:
        try:
            if _fleet(args):
                choice = _choose_fleet(args, spread=False).placements[0]
            else:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    choice = client.choose_or_fallback(
                        args.n,
                        args.url,
                        lease=args.lease,
                        wait=args.wait,
                        owner=args.owner,
                        timeout=client.DEFAULT_TIMEOUT_SECONDS,
                        local_fallback=args.local_fallback,
                        filters=_filters(args),
                    )
                for warning in caught:
                    print(f"{prefix}warning: {warning.message}", file=sys.stderr)
            if choice.lease_id is not None:
                keeper = LeaseKeeper(choice).start()
            if not args.quiet:
                print(f"{prefix}{_describe(choice, keeper)}", file=sys.stderr)
            replacing = client.replaced_visible_devices(choice)
            if replacing is not None:
                print(f"{prefix}warning: {replacing}", file=sys.stderr)
            env = {**os.environ, **choice.env()}
            if choice.lease_id is None:
                env.pop("GPU_LEASE", None)
            signals.holding = True
            try:
                proc = subprocess.Popen(command, env=env)
            except OSError as exc:
                print(f"{prefix}error: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
                return 127 if isinstance(exc, FileNotFoundError) else 126
            signals.started(proc)
            status = proc.wait()
            return 128 - status if status < 0 else status
        except _Interrupted as exc:
            print(f"{prefix}interrupted ({exc}) before the command started", file=sys.stderr)
            return 128 + exc.signum
        except GpuExporterError as exc:
            return _fail(exc, prefix)
        finally:
            signals.holding = True  # a signal now must not interrupt the clean-up
            if keeper is not None:
                keeper.stop()
            if choice is not None and choice.lease_id is not None:
                try:
                    client.release(choice)
                except LeaseNotFound:
                    pass  # ended already; if it expired, the keeper has said so
                except GpuExporterError as exc:
                    print(
                        f"{prefix}warning: could not release lease {choice.lease_id} "
                        f"(it expires by itself): {exc}",
                        file=sys.stderr,
                    )
