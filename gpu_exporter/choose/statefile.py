"""The lease table's file, ``<state-dir>/leases.json``, and the lock on its directory.

Writes are atomic (temporary file, fsync, rename), so a crash leaves the old table or the
new one, never half of either. A write that fails raises :class:`StateWriteError` and is
counted; :attr:`StateFile.problem` says why until a write succeeds again (``/readyz``).

The file holds the leases, the hashed ``Idempotency-Key`` of each keyed lease that ended
before its expiry (``ended_keys``: a retry stays refused across a restart) and the GPUs
withheld from claims after a file that could not be trusted (``withheld``).

Nothing in the directory is followed or trusted blindly: every file is opened with
``O_NOFOLLOW`` and ``O_CLOEXEC`` and created ``0600``; only a regular file of at most
:data:`MAX_STATE_BYTES`, nested at most :data:`MAX_DEPTH` deep, is parsed. A
``leases.json`` that cannot be read (permissions, I/O error, a link, a FIFO, a directory) is
a :class:`StateDirError`: the exporter does not start rather than forget the leases in it.
One that was read and is not a lease table is moved aside as ``leases.corrupt``; a table
with some entries of the wrong shape or type keeps the good ones, and a copy of the whole
file is left as ``leases.corrupt``. Either way :attr:`Loaded.doubt` says what the unread
part could have held, and :mod:`gpu_exporter.choose.persistence` withholds those GPUs.

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
import pwd
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_exporter.choose.lease import MAX_UNIX_TIME, Lease
from gpu_exporter.units import plural

log = logging.getLogger(__name__)

STATE_VERSION = 1
LOCK_NAME = "lock"
MAX_STATE_BYTES = 16 * 2**20  # a lease table of 500 leases with 64 PIDs each is under 2 MiB
MAX_DEPTH = 16  # a lease table is 5 deep: {"leases": [{"held": [[uuid, …, [pid, …]]]}]}
UUID_PREFIXES = ("GPU-", "MIG-")  # how NVML's UUIDs begin
MAX_NAMES = 4096  # GPU names withheld one by one after malformed entries; more: every GPU
DISCARD_ADVICE = "start once with --discard-leases if no job holds a lease from it"
# Opening a file in the state directory: never through a link, never into a child process.
_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC

Writer = Callable[[Path, str], None]  # write text to a path, atomically; raises OSError


def describe(exc: OSError) -> str:
    """``No space left on device (ENOSPC)``: the OS error for people, without a temp name."""
    name = errno.errorcode.get(exc.errno or 0)
    text = exc.strerror or str(exc)
    return f"{text} ({name})" if name else text


class StateWriteError(Exception):
    """``leases.json`` could not be written; the message names the path and the OS error."""


class StateDirError(Exception):
    """The state directory or ``leases.json`` cannot be used (one line for the log; the
    exporter exits 2)."""


@dataclass(frozen=True, slots=True)
class Withheld:
    """GPUs no claim gets before ``until`` (Unix time): those a file that could not be
    trusted could have named (``uuids``; None: every GPU), and why."""

    uuids: tuple[str, ...] | None
    until: float
    why: str

    def to_state(self) -> dict[str, Any]:
        uuids = None if self.uuids is None else list(self.uuids)
        return {"gpus": uuids, "until": self.until, "why": self.why}

    @classmethod
    def from_state(cls, data: object) -> Withheld:
        """:class:`ValueError` for an entry of the wrong shape."""
        if not isinstance(data, dict):
            raise ValueError("a withheld entry must be an object")
        uuids, until, why = data.get("gpus"), data.get("until"), data.get("why")
        if uuids is not None and not (
            isinstance(uuids, list) and all(isinstance(u, str) for u in uuids)
        ):
            raise ValueError("a withheld entry's 'gpus' must be null or a list of strings")
        if not isinstance(why, str):
            raise ValueError("a withheld entry's 'why' must be a string")
        until = unix_time(until, "a withheld entry's 'until'")
        return cls(None if uuids is None else tuple(uuids), until, why)


@dataclass(frozen=True, slots=True)
class Doubt:
    """A ``leases.json`` that was read and not trusted (entirely, or some entries): when it
    last changed, the GPU names its untrusted part holds (None: any), and what was wrong
    (without the directory: clients see it in refusals)."""

    mtime: float
    uuids: tuple[str, ...] | None
    why: str


@dataclass(frozen=True, slots=True)
class Loaded:
    """What :meth:`StateFile.load` found: the valid leases (expired ones included), how many
    entries it skipped as malformed (the table then writes the good ones back), the ended
    keys (key hash → until when a retry is refused), the GPUs withheld, and the doubt."""

    leases: tuple[Lease, ...] = ()
    skipped: int = 0
    ended: Mapping[str, float] = field(default_factory=dict)
    withheld: tuple[Withheld, ...] = ()
    doubt: Doubt | None = None


class StateFile:
    """Where the leases are kept between runs. Not thread-safe: the lease table's lock
    serialises every call."""

    def __init__(self, path: Path, *, write: Writer | None = None) -> None:
        self.path = path
        self._write = write if write is not None else write_atomically
        self.write_errors = 0  # failed writes since start: gpu_exporter_state_write_errors_total
        self.problem: str | None = None  # why the last write failed; None once one succeeds

    @property
    def aside(self) -> Path:
        """``leases.corrupt``: where a file that is not a lease table goes, for a person."""
        return self.path.with_suffix(".corrupt")

    def save(
        self,
        leases: Iterable[Lease],
        ended: Mapping[str, float] | None = None,
        withheld: Iterable[Withheld] = (),
    ) -> None:
        """Write ``leases``, the ``ended`` keys and the ``withheld`` GPUs; raises
        :class:`StateWriteError` (logged once per run of failures)."""
        data: dict[str, Any] = {"version": STATE_VERSION, "leases": [x.to_state() for x in leases]}
        data["ended_keys"] = [[k, until] for k, until in (ended or {}).items()]
        data["withheld"] = [w.to_state() for w in withheld]
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

    def discard(self) -> None:
        """``--discard-leases``: move the file, unread, to ``leases.discarded``."""
        done = self.path.with_suffix(".discarded")
        try:
            os.replace(self.path, done)  # renames a link or a FIFO itself, never its target
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StateDirError(f"cannot discard {self.path}: {describe(exc)}") from None
        log.warning("--discard-leases: moved %s, unread, to %s", self.path, done)

    def load(self) -> Loaded:
        """The contents of the file; nothing if it is missing. Raises :class:`StateDirError`
        when it cannot be read; sets it aside when it is not a lease table."""
        found = read_regular(self.path, MAX_STATE_BYTES)
        if found is None:
            return Loaded()
        raw, mtime = found
        try:
            data = parse_table(raw)
        except ValueError as exc:
            try:
                os.replace(self.path, self.aside)
                done = f"moved it to {self.aside}"
            except OSError as move:
                done = f"could not move it to {self.aside}: {describe(move)}"
            log.error("%s is not a lease table (%s); %s", self.path, exc, done)
            return Loaded(doubt=Doubt(mtime, None, f"{self.path.name} was not a lease table"))
        leases: list[Lease] = []
        ended: dict[str, float] = {}
        withheld: list[Withheld] = []
        errors: list[str] = []
        names: set[str] = set()
        sections: list[tuple[str, Callable[[Any], None]]] = [
            ("leases", lambda x: leases.append(Lease.from_state(x))),
            ("ended_keys", lambda x: ended.update([_ended_key(x)])),
            ("withheld", lambda x: withheld.append(Withheld.from_state(x))),
        ]
        for key, take in sections:
            section = data.get(key) or []
            for entry in section if isinstance(section, list) else [section]:
                try:
                    if entry is section:
                        raise ValueError(f"{key!r} must be a list")
                    take(entry)
                except ValueError as exc:
                    errors.append(str(exc))
                    names.update(s for s in strings_in(entry) if s.startswith(UUID_PREFIXES))
        if not errors:
            return Loaded(tuple(leases), 0, ended, tuple(withheld))
        with contextlib.suppress(OSError):  # a copy: the good entries are written back
            write_atomically(self.aside, raw.decode())
        log.error(
            "skipped %s in %s (first: %s); a copy of the file is in %s",
            plural(len(errors), "malformed entry", "malformed entries"),
            self.path,
            errors[0],
            self.aside,
        )
        # More names than a host has GPUs is no list of GPUs: then every GPU is in doubt.
        named = tuple(sorted(names)) if len(names) <= MAX_NAMES else None
        doubt = Doubt(mtime, named, f"{self.path.name} had malformed entries")
        return Loaded(tuple(leases), len(errors), ended, tuple(withheld), doubt)


def _ended_key(entry: object) -> tuple[str, float]:
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
        raise ValueError("each of 'ended_keys' must be [key_hash, until]")
    return entry[0], unix_time(entry[1], "an ended key's 'until'")


def unix_time(value: object, what: str) -> float:
    """``value`` as a Unix time; :class:`ValueError` for anything else (a huge integer too,
    before ``float()`` could overflow)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number")
    if not 0 <= value <= MAX_UNIX_TIME:  # also false for NaN
        raise ValueError(f"{what} is not a Unix time: {value!r:.40}")
    return float(value)


def read_regular(path: Path, limit: int) -> tuple[bytes, float] | None:
    """The first ``limit`` + 1 bytes of the regular file ``path`` and its mtime; None if it
    does not exist. :class:`StateDirError` if it cannot be read or is not a regular file:
    a link is not followed, a FIFO not waited on, a device not read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _OPEN)
    except FileNotFoundError:
        return None
    except OSError as exc:
        reason = "it is a symbolic link" if exc.errno == errno.ELOOP else describe(exc)
        raise StateDirError(f"cannot read leases from {path}: {reason}; {DISCARD_ADVICE}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StateDirError(
                f"cannot read leases from {path}: it is {_kind(info.st_mode)}, not a regular "
                f"file; {DISCARD_ADVICE}"
            )
        chunks, left = [], limit + 1
        while left > 0 and (chunk := os.read(fd, min(left, 2**20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), info.st_mtime
    except OSError as exc:
        raise StateDirError(
            f"cannot read leases from {path}: {describe(exc)}; {DISCARD_ADVICE}"
        ) from None
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket"}
    kinds |= {stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    return next((name for test, name in kinds.items() if test(mode)), "not a file")


def parse_table(raw: bytes) -> dict[str, Any]:
    """``raw`` as a lease table: an object with a ``leases`` list. :class:`ValueError` (saying
    why) for anything else, nesting deeper than :data:`MAX_DEPTH` included, before parsing.

    >>> parse_table(b'{"leases": []}')
    {'leases': []}
    >>> parse_table(b'[' * 3000 + b']' * 3000)
    Traceback (most recent call last):
    ...
    ValueError: nested more than 16 deep
    """
    if len(raw) > MAX_STATE_BYTES:
        raise ValueError(f"larger than {MAX_STATE_BYTES} bytes")
    text = raw.decode()  # UnicodeDecodeError is a ValueError
    if nesting(text) > MAX_DEPTH:
        raise ValueError(f"nested more than {MAX_DEPTH} deep")
    data = json.loads(text)
    if not isinstance(data, dict) or not isinstance(data.get("leases"), list):
        raise ValueError("no 'leases' list")
    return data


_TOKENS = re.compile(r'["\\[\]{}]')


def nesting(text: str, limit: int = MAX_DEPTH) -> int:
    """How deep the arrays and objects of the JSON ``text`` nest, counting no further than
    ``limit`` + 1; linear in ``len(text)``, whatever the text.

    >>> nesting('{"a": [1, {"b": "[[[\\"]"}]}'), nesting("[" * 100)
    (3, 17)
    """
    depth = deepest = 0
    in_string = False
    skip = -1  # an escaped character's position
    for match in _TOKENS.finditer(text):
        char, at = match.group(), match.start()
        if at == skip:
            continue
        if in_string:
            if char == "\\":
                skip = at + 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                break
        elif char in "]}":
            depth -= 1
    return deepest


def strings_in(value: object) -> set[str]:
    """Every string in a parsed JSON ``value`` (its depth is bounded by :func:`parse_table`):
    the GPU names a malformed entry could hold."""
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict):
        value = [*value, *value.values()]
    if isinstance(value, list):
        return {s for item in value for s in strings_in(item)}
    return set()


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a new temporary file (``0600``, never through a
    link), fsync and rename (which replaces a link at ``path``, never its target)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN, 0o600)
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
    """Create ``directory`` if needed (:func:`check_dir`), lock it and note ``address`` (this
    exporter's listen address) in the lock file. Raises :class:`StateDirError` when the
    directory cannot be created, trusted or written, or another process holds the lock."""
    check_dir(directory)
    path = directory / LOCK_NAME
    try:
        # Opened without O_TRUNC: the holder's note must survive a refused second open.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _OPEN, 0o600)
    except OSError as exc:
        reason = f"{path} is a symbolic link" if exc.errno == errno.ELOOP else describe(exc)
        raise StateDirError(f"cannot use --state-dir {directory}: {reason}") from None
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


def check_dir(directory: Path) -> None:
    """Create ``directory`` (``0700``) if needed; :class:`StateDirError` if it is not a
    directory, other users may write to it, or it belongs to another user than the one
    running the exporter (root's is fine): such a user could plant links or files in it."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        pass  # not a directory: said below
    except OSError as exc:
        raise StateDirError(f"cannot use --state-dir {directory}: {describe(exc)}") from None
    try:
        info = os.stat(directory)  # a link to it is fine (systemd's DynamicUser makes one)
    except OSError as exc:
        raise StateDirError(f"cannot use --state-dir {directory}: {describe(exc)}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise StateDirError(f"--state-dir {directory} is not a directory")
    me = os.geteuid()
    if info.st_uid not in (0, me):
        raise StateDirError(
            f"--state-dir {directory} belongs to {_user(info.st_uid)}, not to {_user(me)} who "
            "runs the exporter; give it a directory of its own"
        )
    if info.st_mode & 0o022:
        raise StateDirError(
            f"--state-dir {directory} may be written by other users "
            f"(mode {stat.S_IMODE(info.st_mode):04o}); chmod go-w it or use a directory of "
            "the exporter's own"
        )


def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def probe_dir(directory: Path) -> None:
    """Check ``directory`` (:func:`check_dir`) and write (atomically, as ``leases.json`` is)
    and remove a small file in it; :class:`StateDirError` if that fails (root ignores
    permission bits, so only a real write tells)."""
    check_dir(directory)
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
