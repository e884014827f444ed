"""The fleet in a real store: bench/cluster.py's synthetic fleet loaded into VictoriaMetrics
(its import API) or Prometheus (a TSDB block backfilled with promtool), and the chooser timed
against it at several sizes.

Per size (GPUs), each the median of ``repeat`` runs over loopback HTTP, through the chooser's
own code (what :func:`gpu_exporter.fleet.placing.choose_fleet` runs, but the claim):

* **read**: :meth:`gpu_exporter.fleet.reading.PrometheusReader.read`: the store selecting and
  encoding the series, the transfer, the JSON decoding and the parsing into a fleet;
* **rank**: :func:`~gpu_exporter.fleet.ranking.rank_fleet`;
* **end to end**: the two together, and the chooser's **memory**: the peak of Python
  allocations during one choice (tracemalloc, run apart from the timed runs).

Two paths: **full** (every series, ``packed=False``) and **packed** (``gpu_fleet:packed``,
loaded here as the fleet rules would have written it, read as a chooser that has seen the
fleet past 500 exporters reads it: the scrape times, the packed series and the recorded
problems at once). Both must rank the same best 20 hosts, each with the same GPUs. The
garbage collector stays on, as in any process the chooser runs in.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import servers

from gpu_exporter.choose.request import parse_cluster_args
from gpu_exporter.fleet.ranking import rank_fleet
from gpu_exporter.fleet.reading import PrometheusReader, get_json

sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
from fleets import pack

# Only the GPUs that pass, from the packed series; every series. The packed read first: a
# chooser at 100,000 GPUs reads nothing else, and a VictoriaMetrics that has just served the
# full read's 530,000 series answered it up to 3x slower (docs/cluster.md).
PATHS = ("packed", "full")
SCRAPES = 4  # samples per series, 15 s apart, the last at the host's scrape time
BATCH_HOSTS = 500  # hosts per import request
Answers = Callable[[int, int, float], dict[str, dict[str, Any]]]  # (hosts, first, at) → answers


def _labels(metric: dict[str, str]) -> tuple[str, str]:
    labels = dict(metric)
    name = labels.pop("__name__", "")
    return name, ",".join(f'{k}="{v}"' for k, v in labels.items())


def exposition(answers: dict[str, dict[str, Any]]) -> Iterator[str]:
    """Prometheus text lines (``name{labels} value ms``) for one batch of the fleet's series."""
    result = {name: doc["data"]["result"] for name, doc in answers.items()}
    scraped_at = {s["metric"]["instance"]: float(s["value"][1]) for s in result["scraped"]}

    def lines(name: str, text: str, value: float, last: float, moving: bool) -> Iterator[str]:
        for i in range(SCRAPES):
            back = 15 * (SCRAPES - 1 - i)
            v = value - back if moving else value
            yield f"{name}{{{text}}} {v!r} {int((last - back) * 1000)}"

    for sample in result["values"]:
        name, text = _labels(sample["metric"])
        last = scraped_at[sample["metric"]["instance"]]
        value = float(sample["value"][1])
        yield from lines(name, text, value, last, name.endswith("timestamp_seconds"))
    for instance, last in scraped_at.items():
        _, text = _labels({"instance": instance, "job": "gpu"})
        yield from lines("up", text, 1, last, False)
    for sample in result["down"]:
        _, text = _labels(sample["metric"])
        yield from lines("up", text, 0, float(sample["value"][0]), False)


def packed_exposition(answers: dict[str, dict[str, Any]]) -> Iterator[str]:
    """``gpu_fleet:packed`` as the fleet rules record it from one batch's raw series: one
    series per card that can be handed out (up, not leased), its figures packed; and
    ``gpu_fleet:problem``, the exporters that cannot serve."""
    result = {name: doc["data"]["result"] for name, doc in answers.items()}
    scraped_at = {s["metric"]["instance"]: float(s["value"][1]) for s in result["scraped"]}
    cards: dict[str, dict[str, Any]] = {}
    for sample in result["values"]:
        metric = sample["metric"]
        if "uuid" in metric:
            card = cards.setdefault(metric["uuid"], {"labels": metric})
            card[metric["__name__"]] = float(sample["value"][1])
    for card in cards.values():
        if card.get("gpu_up") != 1 or card.get("gpu_leased") == 1:
            continue
        value = pack(
            memory_free_bytes=int(card["gpu_memory_free_bytes"]),
            utilization_ratio=card["gpu_utilization_ratio"],
            memory_used_bytes=int(card["gpu_memory_used_bytes"]),
            memory_total_bytes=int(card["gpu_memory_total_bytes"]),
            compute_processes=int(card["gpu_compute_processes"]),
        )
        _, text = _labels({k: card["labels"][k] for k in ("instance", "job", "gpu", "uuid")})
        last = scraped_at[card["labels"]["instance"]]
        for i in range(SCRAPES):
            back = 15 * (SCRAPES - 1 - i)
            yield f"gpu_fleet:packed{{{text}}} {float(value)!r} {int((last - back) * 1000)}"
    for sample in result["down"]:  # the rule's gpu_fleet:problem (no sampler is stuck here)
        _, text = _labels(sample["metric"])
        at = int(float(sample["value"][0]) * 1000)
        for i in range(SCRAPES):
            line = f'gpu_fleet:problem{{fleet_problem="target_down",{text}}} 0'
            yield f"{line} {at - 15_000 * (SCRAPES - 1 - i)}"


def _post(url: str, body: bytes) -> None:
    req = urllib.request.Request(url, data=body, method="POST")
    with urllib.request.urlopen(req, timeout=600) as resp:
        resp.read()


@contextlib.contextmanager
def victoria_metrics() -> Iterator[str]:
    """A single-node VictoriaMetrics on 127.0.0.1 with an empty store; yields its URL."""
    binary = shutil.which("victoria-metrics")
    if binary is None:
        raise SystemExit("--store victoria-metrics needs the victoria-metrics binary (Debian)")
    with tempfile.TemporaryDirectory(prefix="bench-vm-") as tmp:
        port = servers.free_port()
        proc = subprocess.Popen(
            [
                binary,
                f"-storageDataPath={tmp}",
                f"-httpListenAddr=127.0.0.1:{port}",
                # 100,000 GPUs are ~520,000 series in one answer; the default is 300,000.
                "-search.maxUniqueTimeseries=10000000",
                "-search.disableCache",  # every query evaluated, as a new choice's would be
                "-loggerLevel=ERROR",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            servers.wait_until_ok(base + "/health", proc, 60, "victoria-metrics")
            yield base
        finally:
            servers.stop_process(proc)


def load_victoria_metrics(base: str, answers: Answers, hosts: int, at: float) -> dict[str, float]:
    """Import the fleet (raw and packed) in batches; returns seconds and samples imported."""
    start, samples = time.perf_counter(), 0
    for first in range(0, hosts, BATCH_HOSTS):
        batch = answers(min(BATCH_HOSTS, hosts - first), first, at)
        for lines in (exposition(batch), packed_exposition(batch)):
            body = "\n".join(lines) + "\n"
            samples += body.count("\n")
            _post(base + "/api/v1/import/prometheus", body.encode())
    return {"import_seconds": round(time.perf_counter() - start, 1), "samples": samples}


def wait_visible(base: str, at: float, gpus: int, timeout: float = 300) -> None:
    """Until the store answers with every GPU (imports become searchable within seconds)."""
    deadline = time.monotonic() + timeout
    wanted = {"count(gpu_up)": gpus}
    wanted["count(gpu_fleet:packed)"] = int(gpus * 0.9)  # less the leased ones (5 %)
    for expr, least in wanted.items():
        while True:
            doc = get_json(
                f"{base}/api/v1/query?"
                + urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"}),
                60,
            )
            found = doc["data"]["result"]
            if found and float(found[0]["value"][1]) >= least:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"{expr}: {found} after {timeout:.0f} s, {gpus} expected")
            time.sleep(1)


def choice(reader: PrometheusReader, at: float, args: dict[str, str]) -> dict[str, Any]:
    """One choice's reading and ranking, each step timed (ms)."""
    req = parse_cluster_args(args)
    t0 = time.perf_counter()
    fleet = reader.read(req, at)
    t1 = time.perf_counter()
    c = req.choose
    ranking = rank_fleet(fleet, c.n, c.filters, sort=c.sort, spread=req.spread)
    t2 = time.perf_counter()
    return {
        "read": (t1 - t0) * 1000,
        "rank": (t2 - t1) * 1000,
        "end_to_end": (t2 - t0) * 1000,
        "gpus_read": sum(len(h.gpus) for h in fleet.hosts),
        "candidates": len(ranking.candidates),
        "chosen": ranking.candidates[0].host.url if ranking.candidates else None,
        "top": [(c.host.url, [g.uuid for g in c.qualified]) for c in ranking.candidates[:20]],
    }


def measure(base: str, at: float, args: dict[str, str], repeat: int, path: str) -> dict[str, Any]:
    reader = PrometheusReader(base, timeout=600, packed=path == "packed")
    reader.was_large = True  # a chooser that has seen the fleet: no first read of its size
    runs = [choice(reader, at, args) for _ in range(repeat)]
    out: dict[str, Any] = {
        step: {
            "median_ms": round(statistics.median(r[step] for r in runs), 1),
            "fastest_ms": round(min(r[step] for r in runs), 1),
        }
        for step in ("read", "rank", "end_to_end")
    }
    for key in ("gpus_read", "candidates", "chosen", "top"):
        out[key] = runs[0][key]
    tracemalloc.start()
    choice(reader, at, args)
    out["peak_python_mib"] = round(tracemalloc.get_traced_memory()[1] / 2**20, 1)
    tracemalloc.stop()
    return out


def measure_victoria_metrics(
    answers: Answers, sizes: list[int], per_host: int, args: dict[str, str], repeat: int
) -> dict[str, Any]:
    """Each size in a fresh VictoriaMetrics: import, then the full and the packed read."""
    at = float(int(time.time()) - 600)  # well past -search.latencyOffset
    by_size: dict[str, Any] = {}
    for gpus in sizes:
        hosts = gpus // per_host
        with victoria_metrics() as base:
            load_before = round(os.getloadavg()[0], 2)  # a shared machine: judge the noise
            loaded = load_victoria_metrics(base, answers, hosts, at)
            # GPUs that are up (1 % are down) on hosts scraped recently enough to be seen
            wait_visible(base, at, int(gpus * 0.97))
            paths = {path: measure(base, at, args, repeat, path) for path in PATHS}
            tops = {path: p.pop("top") for path, p in paths.items()}
            # Both paths rank the same best 20 hosts, each with the same GPUs in order.
            assert tops["full"] == tops["packed"], {p: t[:2] for p, t in tops.items()}
            load = {"load_average_1m": [load_before, round(os.getloadavg()[0], 2)]}
            by_size[str(gpus)] = {"hosts": hosts, **loaded, **load, **paths}
    return by_size


def table(by_size: dict[str, Any]) -> str:
    rows = [
        "| GPUs (hosts) | path | GPUs read | read ms | rank ms | end to end ms | peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for gpus, r in by_size.items():
        for path in PATHS:
            p = r[path]
            cells = [
                f"{int(gpus):,} ({r['hosts']:,})",
                path,
                f"{p['gpus_read']:,}",
                *(
                    f"{p[s]['median_ms']} / {p[s]['fastest_ms']}"
                    for s in ("read", "rank", "end_to_end")
                ),
                str(p["peak_python_mib"]),
            ]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# -- Prometheus: a backfilled TSDB block (bench/cluster.py --prometheus) ------------------


def openmetrics(answers: dict[str, dict[str, Any]], at: float, scrapes: int = 4) -> str:
    """The fleet's series as an OpenMetrics file: ``scrapes`` samples 15 s apart, up to ``at``."""
    families: dict[str, list[str]] = {}
    series = answers["values"]["data"]["result"] + answers["down"]["data"]["result"]
    targets = {s["metric"]["instance"] for s in answers["scraped"]["data"]["result"]}
    series += [
        {"metric": {"__name__": "up", "instance": t, "job": "gpu"}, "value": [at, "1"]}
        for t in sorted(targets)
    ]
    for sample in series:
        labels = dict(sample["metric"])
        name = labels.pop("__name__")
        text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        value = float(sample["value"][1])
        if name == "gpu_exporter_last_sample_timestamp_seconds":
            value = at - 1
        lines = families.setdefault(name, [])
        for i in range(scrapes):
            t = at - 15 * (scrapes - 1 - i)
            v = value - 15 * (scrapes - 1 - i) if name.endswith("timestamp_seconds") else value
            lines.append(f"{name}{{{text}}} {v!r} {t:.3f}")
    out = []
    for name, lines in families.items():
        out.append(f"# TYPE {name} gauge")
        out += lines
    out.append("# EOF")
    return "\n".join(out) + "\n"


@contextlib.contextmanager
def real_prometheus(answers: dict[str, dict[str, Any]], at: float) -> Iterator[str]:
    """A Prometheus on 127.0.0.1 over a backfilled block of the fleet; yields its URL."""
    binary, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if binary is None or promtool is None:
        raise SystemExit("--prometheus needs the prometheus and promtool binaries")
    with tempfile.TemporaryDirectory(prefix="bench-prometheus-") as tmp:
        source = Path(tmp, "fleet.om")
        source.write_text(openmetrics(answers, at))
        data = Path(tmp, "data")
        subprocess.run(
            [promtool, "tsdb", "create-blocks-from", "openmetrics", "-q", str(source), str(data)],
            check=True,
            capture_output=True,
        )
        source.unlink()
        port = servers.free_port()
        config = Path(tmp, "prometheus.yml")
        config.write_text("global:\n  scrape_interval: 15s\n")
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={data}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            try:
                servers.wait_until_ok(base + "/-/ready", proc, 120, "prometheus")
            except RuntimeError as exc:
                raise SystemExit(str(exc)) from None
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
