"""The fleet in a real store: bench/cluster.py's synthetic fleet loaded into VictoriaMetrics
(its import API) or Prometheus (a TSDB block backfilled with promtool), and the chooser timed
against it at several sizes.

Per size (GPUs), each the median of ``repeat`` runs over loopback HTTP, through the chooser's
own functions (those :func:`gpu_exporter.client.fleet.choose_fleet` calls, in its order):

* **query**: :func:`~gpu_exporter.client.fleetread.query_prometheus`: the store selecting and
  encoding the series, the transfer, the JSON decoding;
* **parse**: :func:`~gpu_exporter.choose.promql.parse_fleet` (after
  :func:`~gpu_exporter.choose.fleetview.from_view` for the recorded view);
* **rank**: :func:`~gpu_exporter.choose.fleet.rank_fleet` (query, parse and rank with the
  cyclic garbage collector paused, as the chooser reads and ranks);
* **end to end**: the three together (the claim, one HTTP round trip to one host, is not in
  it), and the chooser's **memory**: the peak of Python allocations during one choice
  (tracemalloc, run apart from the timed runs).

Five paths: **raw** (the three queries of :func:`~gpu_exporter.choose.promql.fleet_queries`),
**view** (the one query of :func:`~gpu_exporter.choose.fleetview.view_query`, over the
series deploy/prometheus/gpu-exporter.fleet.rules.yml records, loaded here as the rules would
have written them), and both **sieved** (:mod:`gpu_exporter.choose.fleetsieve`: the
exporters' scrape times, then only the GPUs that pass the filters and the exporters with a
problem), as the chooser reads a fleet past 500 exporters, and **packed**
(:mod:`gpu_exporter.choose.fleetpacked`: the view's scrape times, then one read of
``gpu_fleet:packed``, the one series per GPU the fleet rules record, filtered with
comparisons and ``%``, and the exporters' problems the rules record, all three at once, as
a chooser reads a fleet it has seen past 500 exporters). All five must rank the same best 20 hosts,
each with the same GPUs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import tracemalloc
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import servers

from gpu_exporter.choose.filters import Filters
from gpu_exporter.choose.fleet import rank_fleet
from gpu_exporter.choose.fleetpacked import pack, packed_query, recorded_problems_query
from gpu_exporter.choose.fleetpacked import unpack as unpack_packed
from gpu_exporter.choose.fleetsieve import (
    Names,
    hosts_query,
    parse_sieve,
    problems_query,
    sieve_query,
)
from gpu_exporter.choose.fleetview import FIELDS, from_view, view_query
from gpu_exporter.choose.promql import fleet_queries, parse_fleet
from gpu_exporter.client.fleetread import gc_paused, http_get_json, query_prometheus

# every series; or only those that pass, joined in the store or from the packed series
PATHS = ("raw", "view", "raw sieve", "view sieve", "packed")
SCRAPES = 4  # samples per series, 15 s apart, the last at the host's scrape time
BATCH_HOSTS = 500  # hosts per import request
Answers = Callable[[int, int, float], dict[str, dict[str, Any]]]  # (hosts, first, at) → answers


def _labels(metric: dict[str, str]) -> tuple[str, str]:
    labels = dict(metric)
    name = labels.pop("__name__", "")
    return name, ",".join(f'{k}="{v}"' for k, v in labels.items())


def exposition(answers: dict[str, dict[str, Any]], *, view: bool) -> Iterator[str]:
    """Prometheus text lines (``name{labels} value ms``) for one batch of the fleet: the raw
    series as scraped, or (``view``) what the fleet rules record from them."""
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
        moving = name.endswith("timestamp_seconds")
        if view:
            kind = "gpu" if "uuid" in sample["metric"] else "host"
            name, text = f"gpu_fleet:{kind}", f'field="{FIELDS[name]}",{text}'
        yield from lines(name, text, value, last, moving)
    for instance, last in scraped_at.items():
        _, text = _labels({"instance": instance, "job": "gpu"})
        if view:
            yield from lines("gpu_fleet:host", f'field="scraped_at",{text}', last, last, True)
            yield from lines("gpu_fleet:host", f'field="target_up",{text}', 1, last, False)
        else:
            yield from lines("up", text, 1, last, False)
    for sample in result["down"]:
        _, text = _labels(sample["metric"])
        at = float(sample["value"][0])
        name = "gpu_fleet:host" if view else "up"
        yield from lines(name, ('field="target_up",' if view else "") + text, 0, at, False)


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
            memory_utilization_ratio=card["gpu_memory_utilization_ratio"],
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
    """Import the fleet (raw, view and packed) in batches; returns seconds and samples
    imported."""
    start, samples = time.perf_counter(), 0
    for first in range(0, hosts, BATCH_HOSTS):
        batch = answers(min(BATCH_HOSTS, hosts - first), first, at)
        for lines in (
            exposition(batch, view=False),
            exposition(batch, view=True),
            packed_exposition(batch),
        ):
            body = "\n".join(lines) + "\n"
            samples += body.count("\n")
            _post(base + "/api/v1/import/prometheus", body.encode())
    return {"import_seconds": round(time.perf_counter() - start, 1), "samples": samples}


def wait_visible(base: str, at: float, gpus: int, timeout: float = 300) -> None:
    """Until the store answers with every GPU (imports become searchable within seconds)."""
    deadline = time.monotonic() + timeout
    wanted = {"count(gpu_up)": gpus, 'count(gpu_fleet:gpu{field="up"})': gpus}
    wanted["count(gpu_fleet:packed)"] = int(gpus * 0.9)  # less the leased ones (5 %)
    for expr, least in wanted.items():
        while True:
            doc = http_get_json(
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


def _read(
    base: str, at: float, filters: Filters, *, view: bool, sieve: bool, packed: bool = False
) -> Any:
    """The fleet's answers as read_prometheus() asks for them (every series, the sieve, or
    the packed series)."""

    def ask(queries: dict[str, str]) -> dict[str, list[dict[str, Any]]]:
        return query_prometheus(base, queries, at, fetch=http_get_json, timeout=600)

    if packed:  # as read_prometheus() reads a fleet it knows is large: all three at once
        names = Names("gpu_fleet")
        return ask(
            {
                "hosts": hosts_query(names),
                "sieve": packed_query("gpu_fleet", filters, names),
                "problems": recorded_problems_query("gpu_fleet", "", 60),
            }
        )
    if sieve:
        names = Names("gpu_fleet" if view else "")
        hosts = ask({"hosts": hosts_query(names)})
        return {
            **hosts,
            **ask({"sieve": sieve_query(names, filters), "problems": problems_query(names, 60)}),
        }
    if view:
        return ask({"view": view_query("gpu_fleet", filters, "free")})
    return ask(fleet_queries(filters, "free", None))


def choice(
    base: str,
    at: float,
    filters: Filters,
    n: int,
    *,
    view: bool,
    sieve: bool = False,
    packed: bool = False,
) -> dict[str, Any]:
    """One choice's reading and ranking, each step timed (ms)."""
    t0 = time.perf_counter()
    with gc_paused():  # as choose_fleet() reads and ranks
        got = _read(base, at, filters, view=view, sieve=sieve, packed=packed)
        t1 = time.perf_counter()
        if packed:
            fleet = parse_sieve(got, evaluated_at=at, max_age_seconds=60, unpack=unpack_packed)
        elif sieve:
            fleet = parse_sieve(got, evaluated_at=at, max_age_seconds=60)
        else:
            results = from_view(got["view"]) if view else got
            fleet = parse_fleet(results, evaluated_at=at, max_age_seconds=60)
        series = sum(len(r) for r in got.values())
        del got  # as read_prometheus() returns only the fleet
        t2 = time.perf_counter()
        ranking = rank_fleet(fleet, n, filters)
        t3 = time.perf_counter()
    return {
        "query": (t1 - t0) * 1000,
        "parse": (t2 - t1) * 1000,
        "rank": (t3 - t2) * 1000,
        "end_to_end": (t3 - t0) * 1000,
        "series": series,
        "candidates": len(ranking.candidates),
        "chosen": ranking.candidates[0].host.url if ranking.candidates else None,
        "top": [(c.host.url, [g.uuid for g in c.qualified]) for c in ranking.candidates[:20]],
    }


def measure(
    base: str,
    at: float,
    filters: Filters,
    n: int,
    repeat: int,
    *,
    view: bool,
    sieve: bool,
    packed: bool = False,
) -> dict[str, Any]:
    how = {"view": view, "sieve": sieve, "packed": packed}
    runs = [choice(base, at, filters, n, **how) for _ in range(repeat)]
    out: dict[str, Any] = {
        step: {
            "median_ms": round(statistics.median(r[step] for r in runs), 1),
            "fastest_ms": round(min(r[step] for r in runs), 1),
        }
        for step in ("query", "parse", "rank", "end_to_end")
    }
    out["series"] = runs[0]["series"]
    out["candidate_hosts"] = runs[0]["candidates"]
    out["chosen"] = runs[0]["chosen"]
    out["top"] = runs[0]["top"]
    tracemalloc.start()
    choice(base, at, filters, n, **how)
    out["peak_python_mib"] = round(tracemalloc.get_traced_memory()[1] / 2**20, 1)
    tracemalloc.stop()
    return out


def measure_victoria_metrics(
    answers: Answers, sizes: list[int], per_host: int, filters: Filters, n: int, repeat: int
) -> dict[str, Any]:
    """Each size in a fresh VictoriaMetrics: import, then the raw and the view path."""
    at = float(int(time.time()) - 600)  # well past -search.latencyOffset
    by_size: dict[str, Any] = {}
    for gpus in sizes:
        hosts = gpus // per_host
        with victoria_metrics() as base:
            load_before = round(os.getloadavg()[0], 2)  # a shared machine: judge the noise
            loaded = load_victoria_metrics(base, answers, hosts, at)
            # GPUs that are up (1 % are down) on hosts scraped recently enough to be seen
            wait_visible(base, at, int(gpus * 0.97))
            paths = {
                path: measure(
                    base,
                    at,
                    filters,
                    n,
                    repeat,
                    view="view" in path,
                    sieve="sieve" in path,
                    packed=path == "packed",
                )
                for path in PATHS
            }
            tops = {path: p.pop("top") for path, p in paths.items()}
            # Every path ranks the same best 20 hosts, each with the same GPUs in order.
            assert all(t == tops["raw"] for t in tops.values()), {p: t[:2] for p, t in tops.items()}
            load = {"load_average_1m": [load_before, round(os.getloadavg()[0], 2)]}
            by_size[str(gpus)] = {"hosts": hosts, **loaded, **load, **paths}
    return by_size


def table(by_size: dict[str, Any]) -> str:
    rows = [
        "| GPUs (hosts) | path | series | query ms | parse ms | rank ms | end to end ms "
        "| peak MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for gpus, r in by_size.items():
        for path in PATHS:
            p = r[path]
            cells = [
                f"{int(gpus):,} ({r['hosts']:,})",
                path,
                f"{p['series']:,}",
                *(
                    f"{p[s]['median_ms']} / {p[s]['fastest_ms']}"
                    for s in ("query", "parse", "rank", "end_to_end")
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
