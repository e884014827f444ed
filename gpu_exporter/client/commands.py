"""``gpu-exporter choose``, ``run`` and ``release``: the client on the command line.

``choose`` prints exactly what the server's ``/choose`` prints, so it drops into scripts::

    env=$(gpu-exporter choose -n 2 --format env) || exit 1
    eval "$env"   # CUDA_VISIBLE_DEVICES, GPU_LEASE, …

``run`` leases GPUs for as long as a command runs, and no longer (:mod:`gpu_exporter.client.run`)::

    gpu-exporter run -n 2 --min-free 20GiB --wait 10m -- python train.py

This module holds the flags of all three (the filter flags come from
:data:`gpu_exporter.choose.params.PARAMS`), ``choose`` and ``release``.

With ``--prometheus URL`` (and/or ``--hosts a,b,c``) both choose across hosts instead
(:mod:`gpu_exporter.fleet`, docs/cluster.md): all N GPUs on one host, leased by that host's
exporter. ``choose`` then prints ``HOST GPU-a,GPU-b`` (``--format env`` adds ``GPU_HOST`` and
``GPU_EXPORTER_URL``); ``run`` sets those two as well and holds the lease from here, while
COMMAND is expected to go to ``$GPU_HOST`` (ssh, srun -w) to use the GPUs.

Exit status of both, before any command runs: 3 when not enough GPUs qualify, 2 for bad
arguments (ours or the server's 400), 1 for anything else (no server, 429, NVML down …).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from gpu_exporter.argparsing import EXIT_USAGE, Parser, checked
from gpu_exporter.choose.defaults import SHIPPED_DEFAULTS
from gpu_exporter.choose.params import BY_NAME, CHOOSE_FORMATS, PARAMS
from gpu_exporter.client.choosing import choose_cluster
from gpu_exporter.client.hostapi import (
    DEFAULT_LEASE,
    Choice,
    ChooseAnswer,
    as_indices,
    choose_raw,
    register_pids,
    release,
)
from gpu_exporter.client.transport import (
    DEFAULT_URL,
    URL_ENV,
    GpuExporterError,
    LeaseNotFound,
    NoGpusAvailable,
    ServerError,
)
from gpu_exporter.fleet.placing import ClusterChoice
from gpu_exporter.units import parse_duration

EXIT_FAILURE = 1
EXIT_NO_GPUS = 3
EXIT_NO_LEASE = 4
# The filters that have a flag: --min-free SIZE for /choose's min_free, and so on.
FILTER_PARAMS = tuple(p for p in PARAMS if p.flag is not None)
# The shipped "free" as flags: --max-util 50% --max-mem-used 50%.
SHIPPED_FLAGS = " ".join(f"{BY_NAME[k].option} {v}" for k, v in SHIPPED_DEFAULTS.items())


def _positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of 1 or more, got {text!r}")
    return int(text)


@checked
def _duration_text(text: str) -> str:
    """Checked like the server will, but passed on as typed."""
    parse_duration(text)
    return text


def _add_choice_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n", type=_positive_int, default=1, metavar="N", help="how many GPUs (default 1)"
    )
    parser.add_argument(
        "--url",
        help=f"the gpu-exporter to ask (default ${URL_ENV}, else {DEFAULT_URL})",
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
        metavar="DURATION",
        help="wait up to this long for enough GPUs to qualify, e.g. 10m (default: fail at once)",
    )
    parser.add_argument(
        "--owner",
        metavar="LABEL",
        help="who holds the lease, shown on the status page and in /leases "
        "(default: your login name; '' for none)",
    )
    parser.add_argument(
        "--indices",
        action="store_true",
        help="set CUDA_VISIBLE_DEVICES to indices (with CUDA_DEVICE_ORDER=PCI_BUS_ID) that name "
        "the leased cards, for tools that cannot take UUIDs (with choose: --format env)",
    )
    parser.add_argument(
        "--ignore-mask",
        action="store_true",
        help="choose among every GPU of this host, not only those a launcher gave this job "
        "(CUDA_VISIBLE_DEVICES, SLURM_JOB_GPUS, NVIDIA_VISIBLE_DEVICES)",
    )
    fleet = parser.add_argument_group(
        "across hosts (instead of --url): all N GPUs on one host, leased by its exporter"
    )
    fleet.add_argument(
        "--prometheus",
        metavar="URL",
        help="read the fleet from this Prometheus (which scrapes every host's exporter)",
    )
    fleet.add_argument(
        "--hosts",
        metavar="HOST[:PORT],...",
        help="ask these exporters directly (port 9400 unless given); with --prometheus, only "
        "when Prometheus cannot be asked",
    )
    fleet.add_argument(
        "--selector",
        metavar="MATCHERS",
        help="with --prometheus: only the targets these label matchers select, "
        "e.g. 'job=\"gpu-shared\"'",
    )
    fleet.add_argument(
        "--max-age",
        type=_duration_text,
        metavar="DURATION",
        help="never use fleet figures older than this (default 60s)",
    )
    filters = parser.add_argument_group(
        "filters (passed to /choose as they are; those not given are the exporter's "
        f"--choose-defaults, by default {SHIPPED_FLAGS})"
    )
    for param in FILTER_PARAMS:
        assert param.flag is not None
        metavar, help_text = param.flag
        filters.add_argument(param.option, metavar=metavar, help=help_text.replace("%", "%%"))


def add_choose_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    parser = sub.add_parser(
        "choose",
        help="print the freest GPUs, as /choose does",
        description="Ask a gpu-exporter for the freest GPUs and print its answer as it is. "
        "The GPUs are leased (--lease, default 60s) so that a concurrent chooser gets others: "
        "start the job within that time (or use `run`, which holds the lease while a command "
        "runs); DELETE /leases/$GPU_LEASE gives them back early. The lease is registered to "
        "the calling shell (our parent process): only its work ends the lease early.",
        epilog="Exit status: 0 chosen, 3 not enough GPUs qualify, 2 bad arguments, 1 otherwise.",
    )
    _add_choice_arguments(parser)
    parser.add_argument(
        "--format",
        choices=CHOOSE_FORMATS,
        default="uuid",
        help="uuid: GPU-a,GPU-b (default); index: NVML indices; "
        "env: an `export …` line for eval; json: the ranking with figures and reasons; "
        "list: one UUID per line (needed for several MIG devices: one process each). "
        "Across hosts: 'HOST GPU-a,GPU-b' per host, and env adds GPU_HOST and GPU_EXPORTER_URL",
    )
    parser.add_argument(
        "--spread",
        action="store_true",
        help="with --prometheus/--hosts: the GPUs may come from several hosts "
        "(one line per host; not with --format env)",
    )


def add_run_parser(sub: argparse._SubParsersAction[Parser]) -> None:
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


def filters_of(args: argparse.Namespace) -> dict[str, Any]:
    """The filter flags given, by their /choose names."""
    given = {p.name: getattr(args, p.name) for p in FILTER_PARAMS}
    return {name: value for name, value in given.items() if value is not None}


def fail(exc: GpuExporterError, prefix: str = "") -> int:
    print(f"{prefix}error: {exc}", file=sys.stderr)
    if isinstance(exc, NoGpusAvailable):
        return EXIT_NO_GPUS
    if isinstance(exc, ServerError) and exc.status == 400:
        return EXIT_USAGE
    return EXIT_FAILURE


def across_hosts(args: argparse.Namespace) -> bool:
    """Across hosts? Then --url makes no sense."""
    if not (args.prometheus or args.hosts):
        if args.max_age is not None or args.selector or getattr(args, "spread", False):
            raise ServerError(
                400, "--max-age, --selector and --spread need --prometheus or --hosts"
            )
        return False
    if args.url is not None:
        raise ServerError(400, "give --url (one host) or --prometheus/--hosts, not both")
    return True


@contextlib.contextmanager
def warnings_printed(prefix: str = "gpu-exporter: ") -> Iterator[None]:
    """The warnings raised in the block, each printed as one ``<prefix>warning: …`` line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for warning in caught:
        print(f"{prefix}warning: {warning.message}", file=sys.stderr)


def choose_across_hosts(args: argparse.Namespace, *, spread: bool) -> ClusterChoice:
    with warnings_printed():
        return choose_cluster(
            args.n,
            prometheus=args.prometheus,
            hosts=args.hosts,
            spread=spread,
            lease=args.lease,
            wait=args.wait,
            owner=args.owner,
            max_age=args.max_age,
            selector=args.selector,
            **filters_of(args),
        )


def choose_main(args: argparse.Namespace) -> int:
    """``gpu-exporter choose``: print ``/choose``'s answer, or its error on stderr."""
    try:
        if across_hosts(args):
            if args.spread and args.format == "env":
                raise ServerError(400, "--format env names one host; not with --spread")
            sys.stdout.write(choose_across_hosts(args, spread=args.spread).text(args.format))
            sys.stdout.flush()
            return 0
        if args.indices and args.format != "env":
            raise ServerError(400, "--indices names the cards in an env line: add --format env")
        answer = choose_raw(
            args.n,
            args.url,
            format="json" if args.indices else args.format,
            lease=args.lease,
            wait=args.wait,
            owner=args.owner,
            ignore_mask=args.ignore_mask,
            **filters_of(args),
        )
        if answer.lease_token is not None:
            # Our parent is the job script's shell: what it starts is the lease's work.
            note = register_pids(answer.lease_token, [os.getppid()], answer.url)
            if note is not None:
                print(f"gpu-exporter: note: {note}", file=sys.stderr)
        body = env_line_with_indices(answer) if args.indices else answer.body
    except GpuExporterError as exc:
        return fail(exc)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    try:
        sys.stdout.write(body)
        sys.stdout.flush()
    except OSError as exc:  # nobody will read the token (a closed pipe): give the lease back
        if answer.lease_token is not None:
            with contextlib.suppress(GpuExporterError):
                release(answer.lease_token, answer.url)
        print(f"error: cannot print the answer ({exc}); released its lease", file=sys.stderr)
        return EXIT_FAILURE
    return 0


def env_line_with_indices(answer: ChooseAnswer) -> str:
    """``format=env``'s line from a JSON answer, naming the cards by index (``--indices``);
    the lease is given back if they cannot be named so."""
    try:
        choice = Choice.from_json(
            json.loads(answer.body), url=answer.url, lease_header=answer.lease_token
        )
        env = as_indices(choice)
    except (ValueError, GpuExporterError):
        if answer.lease_token is not None:
            with contextlib.suppress(GpuExporterError):
                release(answer.lease_token, answer.url)
        raise
    return "export " + " ".join(f"{k}={v}" for k, v in env.items()) + "\n"


def add_release_parser(sub: argparse._SubParsersAction[Parser]) -> None:
    parser = sub.add_parser(
        "release",
        help="give leased GPUs back now",
        description="Release a lease before it expires, e.g. at the end of a job script that "
        "took its GPUs with gpu-exporter choose --format env.",
        epilog="Exit status: 0 released, or already ended (expired, released, or let go once "
        "the job's work showed on its GPUs: a note on stderr); 4 already ended, with --strict; "
        "1 otherwise (e.g. 403: a lease id instead of its token).",
    )
    parser.add_argument(
        "lease",
        nargs="?",
        default=os.environ.get("GPU_LEASE"),
        metavar="LEASE",
        help="the lease's token, as /choose gave it (default $GPU_LEASE); a lease id alone "
        "works only for the exporter's --lease-admins",
    )
    parser.add_argument(
        "--url",
        help=f"the gpu-exporter that granted it (default ${URL_ENV}, else {DEFAULT_URL})",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 4 if the lease had already ended (default: 0, with a note)",
    )


def release_main(args: argparse.Namespace) -> int:
    """``gpu-exporter release``: DELETE /leases/<token>."""
    if not args.lease:
        print("error: no lease given and GPU_LEASE is not set", file=sys.stderr)
        return EXIT_USAGE
    try:
        release(args.lease, args.url)
    except LeaseNotFound as exc:
        # The job is over either way; a script ending with `gpu-exporter release` must not
        # fail because the lease ran out or was let go a moment earlier.
        if args.strict:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_NO_LEASE
        print(f"gpu-exporter: note: nothing to release: {exc}", file=sys.stderr)
    except GpuExporterError as exc:
        return fail(exc)
    return 0
