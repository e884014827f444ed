"""Near misses of ``CUDA_VISIBLE_DEVICES`` in the environment.

CUDA reads exactly ``CUDA_VISIBLE_DEVICES``; ``CUDA_VISIBLE_DIVICES=1`` or
``cuda_visible_devices=1`` is silently ignored and the job sees every card. The client warns
about such names when it sets the real one (:func:`gpu_exporter.client.use_gpus`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

WATCHED = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
MAX_EDITS = 2  # one or two typos; the other *_VISIBLE_DEVICES variables are further away


def near_misses(environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """``(name set, name meant)`` for every variable that looks like a typo of a watched one.

    >>> near_misses({"CUDA_VISIBLE_DIVICES": "1", "HIP_VISIBLE_DEVICES": "0"})
    [('CUDA_VISIBLE_DIVICES', 'CUDA_VISIBLE_DEVICES')]
    >>> near_misses({"cuda_visible_devices": "1", "CUDA_VISIBLE_DEVICES": "0"})
    [('cuda_visible_devices', 'CUDA_VISIBLE_DEVICES')]
    """
    env = os.environ if environ is None else environ
    found = []
    for name in sorted(env):
        if name in WATCHED:
            continue
        for meant in WATCHED:
            if (
                abs(len(name) - len(meant)) <= MAX_EDITS
                and _edits(name.upper(), meant) <= MAX_EDITS
            ):
                found.append((name, meant))
                break
    return found


def near_miss_warning(environ: Mapping[str, str] | None = None) -> str | None:
    """One sentence naming the near misses, or None."""
    misses = near_misses(environ)
    if not misses:
        return None
    listed = "; ".join(f"{name} (did you mean {meant}?)" for name, meant in misses)
    return f"CUDA ignores these environment variables: {listed}"


def _edits(a: str, b: str) -> int:
    """Levenshtein distance (both strings are short)."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]
