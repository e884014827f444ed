"""What "free" means when a request does not say: the server's ``--choose-defaults``.

By default a GPU is free at most 50 % busy with at most 50 % of its memory in use
(:data:`~gpu_exporter.config.DEFAULT_CHOOSE_DEFAULTS`), as GPUtil's ``getAvailable`` has it
(its ``maxMemory`` is occupancy, used ÷ total, not memory-controller utilization): without it,
a ``/choose`` with no filters hands out the least-busy card even when every card is 97 % busy,
or a card whose memory an idle notebook holds, and ``wait=`` never waits. The same defaults
make the fleet's ``gpu:gpu_free:bool`` rule and the ``GpuNoneFree`` alert
(``scripts/generate_deploy.py`` writes their thresholds from :data:`SHIPPED_DEFAULTS`). The
defaults are filters in the query string's syntax; each applies when a request does not give
that parameter (``max_util=100%`` turns that one off), and a value a GPU cannot report (a MIG
device has no utilization) passes a default, never a filter the request gave
(:attr:`gpu_exporter.choose.filters.Filters.defaulted`).

The server parses its own (``gpu-exporter serve --choose-defaults``); clients that choose
without a server's word — the cluster chooser, choosing from this host's NVML — use
:data:`SHIPPED_DEFAULTS`, and each host re-applies its own when a cluster choice claims there.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping

from gpu_exporter.choose.params import DEFAULTABLE
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.request import parse_choose_args
from gpu_exporter.config import DEFAULT_CHOOSE_DEFAULTS


def parse_defaults(text: str, *, max_idle_for_seconds: float | None = None) -> dict[str, str]:
    """``--choose-defaults``: filters in the query string's syntax → {name: text}.

    Raises ValueError (one line) for anything ``/choose`` would refuse, or a parameter that
    is not a filter (``n``, ``lease``, ``wait`` …). ``""`` means no defaults.

    >>> parse_defaults("max_util=50%&max_mem_used=50%")
    {'max_util': '50%', 'max_mem_used': '50%'}
    >>> parse_defaults("max_util=lots")
    Traceback (most recent call last):
    ValueError: max_util: expected a ratio such as 0.3 or 30%, got 'lots'
    """
    text = text.strip().removeprefix("?")
    found: dict[str, str] = {}
    for part in filter(None, text.split("&")):
        name, sep, value = part.partition("=")
        name = urllib.parse.unquote_plus(name).strip()
        if not sep:
            raise ValueError(f"expected NAME=VALUE such as max_util=50%, got {part!r}")
        if name not in DEFAULTABLE:
            shown = ", ".join(DEFAULTABLE)
            raise ValueError(f"{name} is not a filter; --choose-defaults takes {shown}")
        if name in found:
            raise ValueError(f"{name} given more than once")
        found[name] = urllib.parse.unquote_plus(value)
    try:
        parse_choose_args(found, allowed=DEFAULTABLE, max_idle_for_seconds=max_idle_for_seconds)
    except ApiError as exc:
        raise ValueError(exc.message) from None
    return found


SHIPPED_DEFAULTS: Mapping[str, str] = parse_defaults(DEFAULT_CHOOSE_DEFAULTS)
"""What "free" means to a client that knows no server's ``--choose-defaults``."""
