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

For lease attribution (:mod:`gpu_exporter.choose.settle`), always read and never exported:

* ``/proc/<pid>/stat`` → the parent pid; walked up, the process's :func:`ancestors`;
* ``/proc/<pid>/cgroup`` → a :func:`cgroup_key`: the Slurm job, pod or container, else the
  cgroup path — ``None`` for cgroups that hold unrelated processes (the root, ``init.scope``,
  a login session's ``session-N.scope``).
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
    ancestors: tuple[int, ...] | None = None  # with lineage: None when /proc does not show it
    cgroup: str | None = None  # with lineage: cgroup_key()


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


def _stat_field(pid: int, proc_root: str, field: int) -> int | None:
    """Numeric field ``field`` (1-based, as proc(5) counts) of ``/proc/<pid>/stat``."""
    raw = _read(f"{proc_root}/{pid}/stat", 4096)
    if raw is None:
        return None
    # The command in field 2 may contain spaces and parentheses: split after the last ")".
    rest = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(rest[field - 3])
    except (IndexError, ValueError):
        return None


def start_time(pid: int, proc_root: str = "/proc") -> int | None:
    """The process's start time in clock ticks (``stat`` field 22): with the pid, a
    process identity that survives pid reuse."""
    return _stat_field(pid, proc_root, 22)


def parent_pid(pid: int, proc_root: str = "/proc") -> int | None:
    """The parent's pid (``stat`` field 4); 0 for init, None when /proc does not show it."""
    return _stat_field(pid, proc_root, 4)


# init and kthreadd are everyone's ancestors: they attribute nothing.
_EVERYONES = frozenset({0, 1, 2})
MAX_ANCESTORS = 64


def ancestors(pid: int, proc_root: str = "/proc") -> tuple[int, ...] | None:
    """Parent, grandparent … of ``pid``, without init; None when /proc does not show it."""
    parent = parent_pid(pid, proc_root)
    if parent is None:
        return None
    chain: list[int] = []
    while parent is not None and parent not in _EVERYONES and len(chain) < MAX_ANCESTORS:
        chain.append(parent)
        parent = parent_pid(parent, proc_root)
    return tuple(chain)


_SHARED_CGROUP = re.compile(
    r"(?:^/?$|/init\.scope$|/session-[^/]+\.scope$|^/user\.slice(?:/[^/]+)?$)"
)


def cgroup_key(text: str) -> str | None:
    """What makes processes one job, from the text of ``/proc/<pid>/cgroup``: the Slurm job,
    pod or container, else the cgroup path; None when that cgroup holds unrelated processes.

    >>> cgroup_key("0::/slurm/uid_1000/job_42/step_0/task_0\\n")
    'slurm_job:42'
    >>> cgroup_key("0::/user.slice/user-1000.slice/session-3.scope\\n") is None
    True
    """
    info = parse_cgroup(text)
    if info.slurm_job is not None:  # every step of a job: srun's tasks are not descendants
        return f"slurm_job:{info.slurm_job}"
    if info.pod is not None:
        return f"pod:{info.pod}"
    if info.container is not None:
        return f"container:{info.container}"
    paths = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            paths[parts[1]] = parts[2].strip()
    # cgroup v2's single hierarchy, else v1's systemd one (where services and scopes live)
    path = paths.get("", paths.get("name=systemd"))
    if path is None or _SHARED_CGROUP.search(path):
        return None
    return f"cgroup:{path}"


def read_cgroup_key(pid: int, proc_root: str = "/proc") -> str | None:
    """:func:`cgroup_key` of a running process; None when /proc does not show it."""
    raw = _read(f"{proc_root}/{pid}/cgroup")
    return cgroup_key(raw.decode("utf-8", "replace")) if raw is not None else None


def read_procinfo(
    pid: int,
    proc_root: str = "/proc",
    *,
    fields: Iterable[str] = FIELDS,
    users: Callable[[int], str] = user_name,
    lineage: bool = False,
) -> ProcInfo:
    """What ``/proc`` says about ``pid``: only the requested ``fields`` are read, and
    ``ancestors`` and ``cgroup`` with ``lineage``."""
    wanted = set(fields)
    base = f"{proc_root}/{pid}"
    info = ProcInfo()
    if lineage:
        info = ProcInfo(ancestors=ancestors(pid, proc_root), cgroup=read_cgroup_key(pid, proc_root))
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
    """:func:`read_procinfo` remembered per (pid, start time): user, command, cgroup and
    ancestors are read once per process lifetime. ``lineage`` adds what lease attribution
    needs; ancestors are kept as first seen (a process whose parent exits stays its
    grandparent's descendant).

    The sampler calls :meth:`next_pass` once per sample. A pid asked for in this pass or the
    previous one is the same process, and costs no read at all; a pid that (re)appears after
    a pass without it has its start time (``stat``) read, so a reused pid is never mistaken for
    the old process. (A pid that ends and is reused by another GPU process within one interval
    would need the kernel's pid counter to wrap around in that time.) A pid ``/proc`` does not
    show (another PID namespace) is remembered as such the same way.

    Thread-safe: a GPU stuck in a driver call may still be read on another thread.
    """

    def __init__(
        self,
        fields: Iterable[str],
        proc_root: str = "/proc",
        *,
        users: Callable[[int], str] = user_name,
        max_entries: int = 4096,
        lineage: bool = False,
    ) -> None:
        self.fields = tuple(f for f in FIELDS if f in set(fields))
        self.lineage = lineage
        self.proc_root = proc_root
        self._users = users
        self._max = max_entries
        self._cache: OrderedDict[tuple[int, int], ProcInfo] = OrderedDict()
        # pid → (the pass it was last asked for in, its cache key; None: not visible here)
        self._seen: dict[int, tuple[int, tuple[int, int] | None]] = {}
        self._pass = 0
        self._lock = threading.Lock()

    def next_pass(self) -> None:
        """A new sample begins: pids not asked for in the last one are forgotten."""
        with self._lock:
            self._pass += 1
            self._seen = {p: v for p, v in self._seen.items() if v[0] >= self._pass - 1}

    def get(self, pid: int) -> ProcInfo:
        if not self.fields and not self.lineage:
            return ProcInfo()
        with self._lock:
            seen = self._seen.get(pid)
            if seen is not None and seen[0] >= self._pass - 1:
                key = seen[1]
                cached = self._cache.get(key) if key is not None else ProcInfo()
                if cached is not None:
                    self._seen[pid] = (self._pass, key)
                    if key is not None:
                        self._cache.move_to_end(key)
                    return cached
        started = start_time(pid, self.proc_root)
        if started is None:  # not visible from here
            with self._lock:
                self._seen[pid] = (self._pass, None)
            return ProcInfo()
        key = (pid, started)
        with self._lock:
            self._seen[pid] = (self._pass, key)
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        info = read_procinfo(
            pid, self.proc_root, fields=self.fields, users=self._users, lineage=self.lineage
        )
        with self._lock:
            self._cache[key] = info
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
        return info
