"""The lease table's file, ``<state-dir>/leases.json``: read at start, written on each change.

Writes are atomic (temporary file, fsync, rename), so a crash leaves the old table or the
new one, never half of either. An unreadable file is moved aside as ``leases.corrupt``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from gpu_exporter.choose.lease import Lease

log = logging.getLogger(__name__)

STATE_VERSION = 1


class StateFile:
    """Where the leases are kept between runs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def save(self, leases: Iterable[Lease]) -> None:
        data = {"version": STATE_VERSION, "leases": [x.to_state() for x in leases]}
        try:
            _write_atomically(self.path, json.dumps(data, indent=1))
        except OSError as exc:
            log.error("cannot save leases to %s: %s", self.path, exc)

    def load(self) -> list[Lease]:
        """The leases in the file (expired ones included); none if it is missing or corrupt."""
        path = self.path
        try:
            data = json.loads(path.read_text())
            leases = [Lease.from_state(x) for x in data["leases"]]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            bad = path.with_suffix(".corrupt")
            log.error("cannot read leases from %s (%s); moved it to %s", path, exc, bad)
            with contextlib.suppress(OSError):
                path.replace(bad)
            return []
        return leases


def _write_atomically(path: Path, text: str) -> None:
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
