"""``gpu-exporter run``: lease GPUs for exactly as long as a command runs.

What the command gets and how ``run`` exits are in ``gpu-exporter run --help``
(:mod:`gpu_exporter.client.commands` holds the flags). The lease is renewed while the command
runs (:class:`LeaseKeeper`); a Ctrl-C the terminal already delivered to it is not forwarded
again. If ``run`` itself is killed (SIGKILL), renewals stop and the lease expires after its TTL.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
from types import FrameType

from gpu_exporter.argparsing import EXIT_USAGE
from gpu_exporter.choose.memory import JAX_FRACTION_CONFLICT, JAX_FRACTION_ENV
from gpu_exporter.client.commands import (
    across_hosts,
    choose_across_hosts,
    fail,
    filters_of,
    warnings_printed,
)
from gpu_exporter.client.hostapi import Choice, as_indices
from gpu_exporter.client.local import OpenNvml, choose_or_fallback
from gpu_exporter.client.session import LeaseKeeper, keep, let_go, replaced_visible_devices
from gpu_exporter.client.transport import DEFAULT_TIMEOUT_SECONDS, GpuExporterError

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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


def run_main(args: argparse.Namespace, *, open_nvml: OpenNvml | None = None) -> int:
    """``gpu-exporter run``: lease, run, renew meanwhile, release; exit as the command did.

    ``open_nvml``: the NVML to choose from when no server answers (default: this host's).
    """
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
            if across_hosts(args):
                choice = choose_across_hosts(args, spread=False).placements[0]
            else:
                with warnings_printed(prefix):
                    choice = choose_or_fallback(
                        args.n,
                        args.url,
                        lease=args.lease,
                        wait=args.wait,
                        owner=args.owner,
                        timeout=DEFAULT_TIMEOUT_SECONDS,
                        local_fallback=args.local_fallback,
                        filters=filters_of(args),
                        ignore_mask=args.ignore_mask,
                        open_nvml=open_nvml,
                    )
            keeper, note = keep(choice)  # COMMAND, our child, is this process's work
            if note is not None and not args.quiet:
                print(f"{prefix}note: {note}", file=sys.stderr)
            if not args.quiet:
                print(f"{prefix}{_describe(choice, keeper)}", file=sys.stderr)
            replacing = replaced_visible_devices(choice) if args.ignore_mask else None
            if replacing is not None:
                print(f"{prefix}warning: {replacing}", file=sys.stderr)
            env = {**os.environ, **(as_indices(choice) if args.indices else choice.env())}
            if choice.lease_id is None:
                env.pop("GPU_LEASE", None)
            if JAX_FRACTION_ENV in choice.env():  # beside it, JAX refuses the GPU (memory.py)
                env.pop(JAX_FRACTION_CONFLICT, None)
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
            return fail(exc, prefix)
        finally:
            signals.holding = True  # a signal now must not interrupt the clean-up
            warning = let_go(choice, keeper)
            if warning is not None:
                print(f"{prefix}warning: {warning}", file=sys.stderr)
