"""Generate the README's parts that the code knows: the metric table, the collector groups
with their cost, and what a GPU costs in series and bytes.

    .venv/bin/python scripts/generate_readme.py          # rewrite them in README.md
    .venv/bin/python scripts/generate_readme.py --check  # exit 1 if any is out of date

The text is :mod:`gpu_exporter.export.readme`'s; the series and byte figures are measured
here, on ``/metrics`` of exporters built by :func:`gpu_exporter.daemon.build` over simulated
GPUs (``--simulate a100``'s card, an H100 for GPM and NVLink). Nothing is typed: a value added
to the field table or the metric spec changes the figures the next time this runs, and the
tests (``tests/test_series_budget.py``, ``tests/test_cadence.py``) fail until it has. It
lives outside the package because measuring needs the composition root and the simulator,
which ``export/`` may not import.

Measured on a clock that stands still, so the figures are the same on every run: the values
that change from one rendering or checkout to the next (prometheus_client's ``process_*``,
the build's revision) are counted at a fixed width.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path

from gpu_exporter.collect.groups import GROUPS, OFF_BY_DEFAULT
from gpu_exporter.config import ServeConfig
from gpu_exporter.daemon import Daemon, build
from gpu_exporter.export.exposition import GZIP_LEVEL, GZIP_WBITS
from gpu_exporter.export.readme import Costs, costs_paragraph, groups_table, metrics_table
from gpu_exporter.nvml import Nvml
from gpu_exporter.simulate import Load, Scenario, SimGpu, SimulatedNvml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# What the figures are measured on: --simulate a100's card, and a card with GPM and more links.
A100 = "a100"
H100 = "NVIDIA H100 80GB HBM3"
HOST_GPUS = 8  # the README's example host
NO_PROC = "/dev/null/proc"  # simulated pids must not meet this machine's processes
XID_CODES = (13, 79)  # any two codes


class StillClock:
    """Wall and monotonic time that move only when told (full-width, as real timestamps)."""

    def __init__(self) -> None:
        self.wall, self.mono = 1_764_000_000.123456, 10_000.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono


def a100_card(index: int = 0, load: Load | None = None) -> SimGpu:
    card = Scenario.from_argument(A100).gpus[0]
    return dataclasses.replace(card, index=index, load=load or card.load)


def h100_card() -> SimGpu:
    return SimGpu(0, H100, Load("idle"))


def stack(gpus: Sequence[SimGpu], *, disabled: Sequence[str] = OFF_BY_DEFAULT) -> Daemon:
    """An exporter over ``gpus``, sampled twice a ``--gpm-interval`` apart (GPM's figures
    need two samples), nothing started: what ``serve`` would expose."""
    clock = StillClock()
    config = ServeConfig(state_dir=None, proc_root=NO_PROC, collect_disabled=tuple(disabled))
    sim = SimulatedNvml(list(gpus), clock=clock.monotonic)
    daemon = build(config, nvml=Nvml(sim, simulated=True), clock=clock)
    daemon.sampler.sample_once()
    clock.wall += config.gpm_interval_seconds
    clock.mono += config.gpm_interval_seconds
    daemon.sampler.sample_once()
    return daemon


_VOLATILE = (
    (re.compile(rb"^(process_\w+) .*$", re.MULTILINE), rb"\1 0.0"),
    (re.compile(rb'revision="[^"]*"'), b'revision="000000000000"'),
)


def scrape(daemon: Daemon) -> bytes:
    """``/metrics`` as the app serves it, its volatile values at a fixed width."""
    body = daemon.app.test_client().get("/metrics").get_data()
    for pattern, fixed in _VOLATILE:
        body = pattern.sub(fixed, body)
    return body


def series(body: bytes, gpu: str | None = None) -> list[bytes]:
    """The samples of an exposition (of one GPU's whole-device series, if ``gpu``)."""
    lines = [line for line in body.splitlines() if line and not line.startswith(b"#")]
    if gpu is None:
        return lines
    return [line for line in lines if f'gpu="{gpu}"'.encode() in line]


def gzipped(body: bytes) -> int:
    compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, GZIP_WBITS)
    return len(compressor.compress(body) + compressor.flush())


def gpu_series(gpus: Sequence[SimGpu], disabled: Sequence[str] = OFF_BY_DEFAULT) -> int:
    return len(series(scrape(stack(gpus, disabled=disabled)), gpu="0"))


def group_series(card: SimGpu) -> dict[str, int]:
    """Series of one GPU per group: what ``--no-collect.<group>`` takes away (the core: the
    rest); each group off by default counted as what ``--collect.<group>`` adds."""
    every = gpu_series([card])
    counted = {}
    for name in GROUPS:
        if name in OFF_BY_DEFAULT:
            on = tuple(g for g in OFF_BY_DEFAULT if g != name)
            counted[name] = gpu_series([card], on) - every
        else:
            counted[name] = every - gpu_series([card], (*OFF_BY_DEFAULT, name))
    defaults = {name: n for name, n in counted.items() if name not in OFF_BY_DEFAULT}
    return {"": every - sum(defaults.values()), **counted}


def nvlink_per_link(card: SimGpu) -> tuple[int, int]:
    """(series per link, links) of ``card`` with ``--collect.nvlink``."""
    off = set(series(scrape(stack([card]))))
    on = set(series(scrape(stack([card], disabled=()))))
    added = on - off
    links = {m[1] for line in added if (m := re.search(rb'link="([^"]+)"', line))}
    assert links and len(added) % len(links) == 0, added
    return len(added) // len(links), len(links)


def xid_series(card: SimGpu) -> tuple[int, int]:
    """(series for a GPU that has had one Xid error, more for each further Xid code)."""
    daemon = stack([card])
    counts = [len(series(scrape(daemon)))]
    uuid = daemon.nvml.uuid(daemon.nvml.handle(0))
    assert daemon.xids is not None
    for xid in XID_CODES:
        daemon.xids.record(0, uuid, xid, StillClock().time())
        counts.append(len(series(scrape(daemon))))
    return counts[1] - counts[0], counts[2] - counts[1]


@functools.cache
def measure() -> Costs:
    """Every figure the README gives of what ``/metrics`` costs, measured."""
    one, host = scrape(stack([a100_card()])), scrape(stack([a100_card(i) for i in range(8)]))
    # A GPU: what the host's second to eighth GPUs add, each; the host: what is left.
    per_gpu_series = (len(series(host)) - len(series(one))) / (HOST_GPUS - 1)
    per_gpu_bytes = (len(host) - len(one)) / (HOST_GPUS - 1)
    busy = a100_card(load=Load("constant", 0.6, processes=2))
    idle_series = gpu_series([a100_card()])
    a100_link, a100_links = nvlink_per_link(a100_card())
    h100_link, h100_links = nvlink_per_link(h100_card())
    xid_first, xid_more = xid_series(a100_card())
    costs = Costs(
        card=a100_card().model_name,
        groups=group_series(a100_card()),
        series_per_gpu=round(per_gpu_series),
        bytes_per_gpu=round(per_gpu_bytes),
        host_series=len(series(one)) - round(per_gpu_series),
        host_bytes=round(len(one) - per_gpu_bytes),
        gpus=HOST_GPUS,
        series=len(series(host)),
        bytes=len(host),
        gzipped_bytes=gzipped(host),
        per_process=(gpu_series([busy]) - idle_series) // 2,
        xid_first=xid_first,
        xid_more=xid_more,
        gpm_card=H100,
        gpm_series=group_series(h100_card())["gpm"],
        per_link=a100_link,
        links={a100_card().model_name: a100_links, H100: h100_links},
    )
    assert (
        per_gpu_series
        == costs.series_per_gpu
        == sum(costs.groups.values()) - sum(costs.groups[g] for g in OFF_BY_DEFAULT)
    ), costs
    assert h100_link == a100_link, (h100_link, a100_link)
    return costs


# The README's generated regions: marker name → its text.
def regions() -> dict[str, str]:
    costs = measure()
    return {
        "metrics-table": metrics_table(),
        "groups-table": groups_table(costs),
        "costs": costs_paragraph(costs),
    }


def region(text: str, name: str) -> tuple[int, int]:
    """Where region ``name``'s text starts and ends in ``text``."""
    start = text.index(f"<!-- {name}:start -->\n") + len(f"<!-- {name}:start -->\n")
    return start, text.index(f"<!-- {name}:end -->", start)


def generated(text: str) -> str:
    """``text`` (the README) with every generated region rewritten."""
    for name, body in regions().items():
        start, end = region(text, name)
        text = text[:start] + body + text[end:]
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md is stale")
    args = parser.parse_args(argv)
    old = README.read_text()
    new = generated(old)
    if args.check:
        if new != old:
            print("README.md is out of date: run scripts/generate_readme.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        README.write_text(new)
        print("rewrote README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
