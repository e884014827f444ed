"""Who a GPU process belongs to, from ``/proc``: user, command, container, Slurm job, pod.

Pure reading and parsing; the ``/proc`` root is an argument (``/host/proc`` in a container
that mounts the host's), and nothing here talks to NVML. The parsers are plain functions
of the file's text so they can be tested on real-world lines:

* ``/proc/<pid>/status`` → the real uid → a user name (or the number when unknown);
* ``/proc/<pid>/cmdline`` → argv[0], base name only (never the arguments: they may hold
  paths, tokens and data set names);
* ``/proc/<pid>/cgroup`` (cgroup v1 and v2) → a container id (Docker, containerd, CRI-O,
  Podman: 64 hex digits), a Slurm job id (``/slurm/uid_*/job_*`` or ``slurmstepd.scope/job_*``)
  and a Kubernetes pod UID (``kubepods…pod<uid>``).

A process outside this PID namespace (another container) has no ``/proc`` entry here: every
field is None, and the GPU's ``process_visibility`` says so.
"""

from __future__ import annotations

import os
import pwd
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

FIELDS = ("user", "command", "container", "slurm_job", "pod")

_CONTAINER = re.compile(
    r"(?:^|/)(?:docker-|cri-containerd-|containerd-|crio-|libpod-)?([0-9a-f]{64})(?:\.scope)?(?:/|$)"
)
_SLURM_JOB = re.compile(r"/(?:slurm(?:_[^/]*)?/uid_\d+|slurmstepd\.scope)/job_(\d+)(?:/|$)")
_POD = re.compile(
    r"kubepods[^\n]*?pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
)


@dataclass(frozen=True, slots=True)
class CgroupInfo:
    container: str | None = None
    slurm_job: str | None = None
    pod: str | None = None


@dataclass(frozen=True, slots=True)
class ProcInfo:
    user: str | None = None
    command: str | None = None
    container: str | None = None
    slurm_job: str | None = None
    pod: str | None = None


def parse_cgroup(text: str) -> CgroupInfo:
    """Container id, Slurm job id and pod UID from the text of ``/proc/<pid>/cgroup``.

    >>> parse_cgroup("0::/system.slice/docker-" + "ab" * 32 + ".scope\\n").container == "ab" * 32
    True
    >>> parse_cgroup("4:memory:/slurm/uid_1000/job_4242/step_0/task_0\\n").slurm_job
    '4242'
    """
    container = slurm_job = pod = None
    for line in text.splitlines():
        # "hierarchy-id:controllers:path"; the path may itself contain colons.
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        path = parts[2]
        if container is None and (m := _CONTAINER.search(path)):
            container = m.group(1)
        if slurm_job is None and (m := _SLURM_JOB.search(path)):
            slurm_job = m.group(1)
        if pod is None and (m := _POD.search(path)):
            pod = m.group(1).replace("_", "-")  # the systemd driver writes dashes as "_"
    return CgroupInfo(container, slurm_job, pod)


def parse_uid(status_text: str) -> int | None:
    """The real uid from the text of ``/proc/<pid>/status``.

    >>> parse_uid("Name:\\tpython\\nUid:\\t1000\\t1000\\t1000\\t1000\\n")
    1000
    """
    for line in status_text.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
    return None


def parse_command(cmdline: bytes) -> str | None:
    """argv[0]'s base name from ``/proc/<pid>/cmdline`` (NUL-separated); never the arguments.

    >>> parse_command(b"/opt/conda/bin/python\\x00train.py\\x00--lr=3e-4\\x00")
    'python'
    """
    argv0 = cmdline.split(b"\0", 1)[0].decode("utf-8", "replace").strip()
    if not argv0:
        return None
    # Some programs set their title as "name: detail" in argv[0]; keep the program part.
    return os.path.basename(argv0.split(": ", 1)[0].rstrip(":")) or None


def user_name(uid: int) -> str:
    """The passwd name for ``uid``, or the number as text when there is none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _read(path: str, limit: int = 65536) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:  # gone, another namespace, or not ours to read
        return None


def start_time(pid: int, proc_root: str = "/proc") -> int | None:
    """The process's start time in clock ticks (``stat`` field 22): with the pid, a
    process identity that survives pid reuse."""
    raw = _read(f"{proc_root}/{pid}/stat", 4096)
    if raw is None:
        return None
    # The command in field 2 may contain spaces and parentheses: split after the last ")".
    rest = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


def read_procinfo(
    pid: int,
    proc_root: str = "/proc",
    *,
    fields: Iterable[str] = FIELDS,
    users: Callable[[int], str] = user_name,
) -> ProcInfo:
    """What ``/proc`` says about ``pid``: only the requested ``fields`` are read."""
    wanted = set(fields)
    base = f"{proc_root}/{pid}"
    info = ProcInfo()
    if "user" in wanted:
        status = _read(f"{base}/status")
        uid = parse_uid(status.decode("utf-8", "replace")) if status is not None else None
        info = replace(info, user=None if uid is None else users(uid))
    if "command" in wanted:
        cmdline = _read(f"{base}/cmdline")
        command = parse_command(cmdline) if cmdline is not None else None
        if command is None and cmdline is not None:  # kernel threads, zombies: the comm name
            comm = _read(f"{base}/comm")
            command = comm.decode("utf-8", "replace").strip() or None if comm else None
        info = replace(info, command=command)
    if wanted & {"container", "slurm_job", "pod"}:
        cgroup = _read(f"{base}/cgroup")
        if cgroup is not None:
            cg = parse_cgroup(cgroup.decode("utf-8", "replace"))
            info = replace(
                info,
                container=cg.container if "container" in wanted else None,
                slurm_job=cg.slurm_job if "slurm_job" in wanted else None,
                pod=cg.pod if "pod" in wanted else None,
            )
    return info


class ProcInfoCache:
    """:func:`read_procinfo` remembered per (pid, start time), so a long-running job costs
    one ``stat`` read per sample, and a reused pid is never mistaken for the old process.

    Thread-safe: GPUs may be read on several threads.
    """

    def __init__(
        self,
        fields: Iterable[str],
        proc_root: str = "/proc",
        *,
        users: Callable[[int], str] = user_name,
        max_entries: int = 4096,
    ) -> None:
        self.fields = tuple(f for f in FIELDS if f in set(fields))
        self.proc_root = proc_root
        self._users = users
        self._max = max_entries
        self._cache: OrderedDict[tuple[int, int], ProcInfo] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, pid: int) -> ProcInfo:
        if not self.fields:
            return ProcInfo()
        started = start_time(pid, self.proc_root)
        if started is None:  # not visible from here
            return ProcInfo()
        key = (pid, started)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        info = read_procinfo(pid, self.proc_root, fields=self.fields, users=self._users)
        with self._lock:
            self._cache[key] = info
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
        return info
