"""The source revision this exporter was built from, for ``gpu_exporter_build_info``.

Read once at start-up, never per scrape, and without running ``git``:

1. ``gpu_exporter/_revision.txt``, written at build time (the Dockerfile writes its
   ``REVISION`` build argument there; a packager may do the same);
2. the git metadata of the checkout the package is imported from (an editable install or
   ``python -m gpu_exporter`` in a clone): ``.git/HEAD`` and the ref it names, read as files;
3. otherwise ``"unknown"``.
"""

from __future__ import annotations

import re
from pathlib import Path

UNKNOWN = "unknown"
_PACKAGE = Path(__file__).resolve().parent
_SHA = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")  # SHA-1 or SHA-256 object names


def revision(package: Path = _PACKAGE) -> str:
    """A commit id (12 hex digits), or ``"unknown"``."""
    stamped = _read(package / "_revision.txt")
    if stamped and stamped != UNKNOWN:
        return stamped[:12] if _SHA.fullmatch(stamped) else stamped
    sha = _git_head(package.parent / ".git")
    return sha[:12] if sha else UNKNOWN


def _git_head(git: Path) -> str | None:
    if git.is_file():  # a worktree or submodule: "gitdir: <path>"
        pointer = _read(git) or ""
        if not pointer.startswith("gitdir:"):
            return None
        git = (git.parent / pointer.removeprefix("gitdir:").strip()).resolve()
    head = _read(git / "HEAD")
    if head is None:
        return None
    if _SHA.fullmatch(head):  # detached
        return head
    if not head.startswith("ref:"):
        return None
    ref = head.removeprefix("ref:").strip()
    # A worktree keeps its HEAD but shares refs with the main repository ("commondir").
    common = _read(git / "commondir")
    roots = [git] + ([(git / common).resolve()] if common else [])
    for root in roots:
        sha = _read(root / ref)
        if sha and _SHA.fullmatch(sha):
            return sha
        for line in (_read(root / "packed-refs") or "").splitlines():
            sha, _, name = line.partition(" ")
            if name == ref and _SHA.fullmatch(sha):
                return sha
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
