"""The lease table's file, ``<state-dir>/leases.json``, and the lock on its directory.

Writes are atomic (temporary file, fsync, rename), so a crash leaves the old table or the
new one, never half of either. A write that fails raises :class:`StateWriteError` and is
counted; :attr:`StateFile.problem` says why until a write succeeds again (``/readyz``).

Reading is forgiving, entry by entry: a file that is not a lease table at all is moved aside
as ``leases.corrupt``; a table with some entries of the wrong shape or type keeps the good
ones, and a copy of the whole file is left as ``leases.corrupt`` for a person to look at.

:func:`lock_state_dir` takes ``<state-dir>/lock`` (``flock``) for the life of the process and
writes the holder's PID and listen address into it, so a second exporter on the same
directory refuses to start instead of overwriting the first one's leases.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from gpu_exporter.choose.lease import Lease

log = logging.getLogger(__name__)

STATE_VERSION = 1
LOCK_NAME = "lock"

Writer = Callable[[Path, str], None]  # write text to a path, atomically; raises OSError


def describe(exc: OSError) -> str:
    """``No space left on device (ENOSPC)``: the OS error for people, without a temp name."""
    name = errno.errorcode.get(exc.errno or 0)
    text = exc.strerror or str(exc)
    return f"{text} ({name})" if name else text


class StateWriteError(Exception):
    """``leases.json`` could not be written; the message names the path and the OS error."""


@dataclass(frozen=True, slots=True)
class Loaded:
    """What :meth:`StateFile.load` found: the valid leases (expired ones included) and how
    many entries it skipped as malformed (the table then writes the good ones back)."""

    leases: tuple[Lease, ...]
    skipped: int = 0


class StateFile:
    """Where the leases are kept between runs. Not thread-safe: the lease table's lock
    serialises every call."""

    def __init__(self, path: Path, *, write: Writer | None = None) -> None:
        self.path = path
        self._write = write if write is not None else write_atomically
        self.write_errors = 0  # failed writes since start: gpu_exporter_state_write_errors_total
        self.problem: str | None = None  # why the last write failed; None once one succeeds

    def save(self, leases: Iterable[Lease]) -> None:
        """Write ``leases``; raises :class:`StateWriteError` (logged once per run of failures)."""
        data = {"version": STATE_VERSION, "leases": [x.to_state() for x in leases]}
        try:
            self._write(self.path, json.dumps(data, indent=1))
        except OSError as exc:
            self.write_errors += 1
            message = f"cannot save leases to {self.path}: {describe(exc)}"
            if self.problem is None:
                log.error("%s; /choose claims nothing until a write succeeds", message)
            self.problem = message
            raise StateWriteError(message) from exc
        if self.problem is not None:
            log.warning("leases saved to %s again", self.path)
            self.problem = None

    def load(self) -> Loaded:
        """The leases in the file; none if it is missing or not a lease table at all."""
        path = self.path
        try:
            data = json.loads(path.read_text())
            entries = data["leases"]
            if not isinstance(entries, list):
                raise TypeError(f"'leases' is {type(entries).__name__}, not a list")
        except FileNotFoundError:
            return Loaded(())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            bad = path.with_suffix(".corrupt")
            log.error("cannot read leases from %s (%s); moved it to %s", path, exc, bad)
            with contextlib.suppress(OSError):
                path.replace(bad)
            return Loaded(())
        leases, errors = [], []
        for entry in entries:
            try:
                leases.append(Lease.from_state(entry))
            except ValueError as exc:
                errors.append(str(exc))
        if errors:
            bad = path.with_suffix(".corrupt")
            with contextlib.suppress(OSError):
                shutil.copyfile(path, bad)  # a copy: the good entries are written back
            log.error(
                "skipped %d malformed leases in %s (first: %s); a copy of the file is in %s",
                len(errors),
                path,
                errors[0],
                bad,
            )
        return Loaded(tuple(leases), len(errors))


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync and rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# -- the lock on the state directory --------------------------------------------------------


class StateDirError(Exception):
    """The state directory cannot be used (one line for the log; the exporter exits 2)."""


class StateLock:
    """``<state-dir>/lock``, held (``flock``) until :meth:`close` or the process ends."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def note(self, address: str) -> None:
        """Record this process and where it listens, for the error a second exporter gives."""
        if self._fd is None:
            return
        data = json.dumps({"pid": os.getpid(), "listen": address}) + "\n"
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data.encode(), 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with the descriptor
            self._fd = None


def lock_state_dir(directory: Path, address: str) -> StateLock:
    """Create ``directory`` if needed, lock it and note ``address`` (this exporter's listen
    address) in the lock file. Raises :class:`StateDirError` when the directory cannot be
    created or written, or another process holds the lock."""
    path = directory / LOCK_NAME
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # Opened without O_TRUNC: the holder's note must survive a refused second open.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise StateDirError(f"cannot use --state-dir {directory}: {describe(exc)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _holder(fd)
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise StateDirError(
                f"--state-dir {directory} is in use by another gpu-exporter ({holder}); "
                "give each exporter its own --state-dir"
            ) from None
        raise StateDirError(f"cannot lock --state-dir {directory}: {describe(exc)}") from None
    lock = StateLock(path, fd)
    try:
        lock.note(address)
    except OSError as exc:
        lock.close()
        raise StateDirError(f"cannot write to --state-dir {directory}: {describe(exc)}") from None
    try:
        probe_dir(directory)
    except StateDirError:
        lock.close()
        raise
    return lock


def probe_dir(directory: Path) -> None:
    """Create ``directory`` if needed and write (atomically, as ``leases.json`` is) and remove
    a small file in it; :class:`StateDirError` if that fails (root ignores permission bits,
    so only a real write tells)."""
    probe = directory / f".probe-{os.getpid()}"
    try:
        write_atomically(probe, "{}\n")
        probe.unlink()
    except OSError as exc:
        raise StateDirError(f"cannot write to --state-dir {directory}: {describe(exc)}") from None


def _holder(fd: int) -> str:
    """``pid 1234, listening on 127.0.0.1:9400``, from the lock file (best effort)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {int(data['pid'])}, listening on {data['listen']!s}"
    except (OSError, ValueError, KeyError, TypeError):
        return "it has not said where it listens yet"
