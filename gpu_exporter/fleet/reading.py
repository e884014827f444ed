"""Reading the fleet from a store that speaks Prometheus' query API, or from the hosts.

Two reads, each's queries asked concurrently and evaluated at one ``time=``:

* **full** (:func:`parse_full`): every series a choice needs, per GPU. No recording rules
  needed, and a refusal names each GPU's reasons. Up to :data:`LARGE_FLEET_HOSTS` exporters,
  and for requests the packing cannot test (``idle_for``, ``include``, ``sort=power`` …).
* **packed** (:func:`parse_packed`): past that size, only the GPUs that pass, from
  ``gpu_fleet:packed`` (:mod:`~gpu_exporter.fleet.packing`); the full read where the store
  has no packed series (the fleet rules are not loaded).
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, fields, replace
from typing import Any, Final

from gpu_exporter.choose.filters import Window
from gpu_exporter.choose.params import LIMITS
from gpu_exporter.choose.request import ClusterRequest
from gpu_exporter.choose.values import digits
from gpu_exporter.fleet.inventory import (
    TARGET_DOWN,
    URL_LABEL,
    Fleet,
    Host,
    exporter_url,
    host_from_snapshot,
    host_problem,
)
from gpu_exporter.fleet.packing import (
    PACKED,
    packable,
    packed_query,
    problems_query,
    sm_active_query,
    unpack,
)
from gpu_exporter.fleet.queries import (
    braces,
    full_queries,
    reasons_query,
    reasons_text,
    scraped_query,
)
from gpu_exporter.model import GpuSample
from gpu_exporter.outbound import AnswerTooLarge, Bounds, base_url, exchange, failure
from gpu_exporter.podallocations import allocated_to

log = logging.getLogger(__name__)

DEFAULT_EXPORTER_PORT: Final = 9400
LARGE_FLEET_HOSTS: Final = 500  # past this many exporters (4,000 GPUs), the packed read
GIB: Final = 2**30
# Per-GPU series → GpuSample field, and how to read the value: every figure a limit reads (its
# row: choose/params.py), and what the ranking orders by.
VALUE_METRICS: Final[Mapping[str, tuple[str, Callable[[float], float]]]] = {
    **{series: (field, limit.unit.kind) for limit in LIMITS for field, series in limit.figures},
    "gpu_memory_free_bytes": ("memory_free_bytes", int),
    "gpu_memory_total_bytes": ("memory_total_bytes", int),
    "gpu_utilization_ratio": ("utilization_ratio", float),
    "gpu_sm_active_ratio": ("sm_active_ratio", float),  # GPM: absent on a card without it
    "gpu_power_draw_watts": ("power_draw_watts", float),
    "gpu_power_limit_watts": ("power_limit_watts", float),
}
Answers = dict[str, list[dict[str, Any]]]
Fetch = Callable[[str, float], Any]
"""GET a URL with a timeout and return its decoded JSON; raises :class:`SourceUnavailable`."""
Check = Callable[[], None]
"""Raises to give a read up (its client left, the exporter stops); asked while it waits."""
# The most one answer of the store may hold. The full read's largest answer, every per-GPU
# series of bench/cluster.py's 100,000 GPUs (920,000 series), is 183 MiB; beyond this the
# store is refused rather than buffered (a 500 MB answer took the exporter to 1.5 GB).
MAX_ANSWER_BYTES: Final = 256 * 2**20
READ_SECONDS: Final = 10.0  # one read of the fleet, in all: connecting and every byte
WATCH_SECONDS: Final = 0.1  # how often a read in progress asks its Check


class SourceUnavailable(Exception):
    """The store (or a host) could not be asked: unreachable, an error, or nonsense."""


def get_json(url: str, timeout: float) -> Any:
    """The default :data:`Fetch`: a GET without credentials (neither the store nor a host's
    ``/gpus`` needs any). Under :class:`~gpu_exporter.outbound.Bounds` (as :func:`query`
    asks), bounded by them."""
    where = urllib.parse.urlsplit(url).netloc
    headers = {"Accept": "application/json", "User-Agent": "gpu-exporter-cluster"}
    try:
        resp = exchange("GET", url, headers=headers, timeout=timeout)
    except AnswerTooLarge as exc:
        raise SourceUnavailable(
            f"{where} answered more than {exc.max_bytes:,} bytes, the most the fleet reader "
            "takes; narrow the fleet with a selector (--prometheus-selector, the client's "
            "--selector)"
        ) from None
    except (OSError, ValueError) as exc:
        raise SourceUnavailable(f"cannot reach {where or url}: {failure(exc, timeout)}") from None
    if resp.status >= 400:
        detail = resp.body[:300].decode("utf-8", "replace")
        raise SourceUnavailable(f"HTTP {resp.status} from {where}: {detail}")
    try:
        return json.loads(resp.body)
    except ValueError:
        raise SourceUnavailable(f"{where} did not answer JSON") from None


def _carry_on() -> None:
    """The default :data:`Check`: nobody gives up."""


def query(
    prometheus: str,
    queries: Mapping[str, str],
    at: float,
    *,
    fetch: Fetch,
    timeout: float,
    bounds: Bounds | None = None,
    check: Check = _carry_on,
) -> Answers:
    """Run the instant queries (concurrently), all evaluated at Unix time ``at``.

    ``bounds`` (by default ``timeout`` seconds and :data:`MAX_ANSWER_BYTES`) bound them all
    together; this thread watches them and ``check`` every :data:`WATCH_SECONDS`, and at the
    deadline, or when ``check`` raises, cuts every exchange still in progress and raises.
    """
    bounds = bounds if bounds is not None else Bounds(timeout, MAX_ANSWER_BYTES)
    where = urllib.parse.urlsplit(base_url(prometheus)).netloc or prometheus

    def one(expr: str) -> list[dict[str, Any]]:
        params = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
        with bounds.applied():
            doc = fetch(f"{base_url(prometheus)}/api/v1/query?{params}", bounds.remaining())
        if not isinstance(doc, dict) or doc.get("status") != "success":
            error = doc.get("error") if isinstance(doc, dict) else None
            raise SourceUnavailable(f"Prometheus refused {expr!r}: {error or doc!r}"[:500])
        if (doc.get("data") or {}).get("resultType") != "vector":
            raise SourceUnavailable(f"Prometheus answered {expr!r} with no instant vector")
        result: list[dict[str, Any]] = doc["data"].get("result") or []
        return result

    if bounds.remaining() <= 0:
        raise SourceUnavailable(f"no answer from {where} within {bounds.seconds:g} s")
    pool = ThreadPoolExecutor(max_workers=len(queries), thread_name_prefix="store")
    futures = {name: pool.submit(one, expr) for name, expr in queries.items()}
    try:
        pending = set(futures.values())
        while pending:
            wait_for = min(WATCH_SECONDS, max(0.0, bounds.remaining()))
            done, pending = wait(pending, wait_for, return_when=FIRST_EXCEPTION)
            for future in done:
                future.result()  # raises the first failure
            if pending and bounds.remaining() <= 0:
                raise SourceUnavailable(
                    f"no answer from {where} within {bounds.seconds:g} s "
                    "(the deadline of the whole fleet read)"
                )
            check()
        return {name: future.result() for name, future in futures.items()}
    finally:
        if not all(future.done() for future in futures.values()):
            bounds.cut("the fleet read was given up")  # its threads end at once
        pool.shutdown(wait=False)


@dataclass(slots=True)
class PrometheusReader:
    """Reads one store's fleet, narrowed by ``selector``. ``packed``: True takes the packed
    read wherever the request fits it, False never, None past :data:`LARGE_FLEET_HOSTS`.
    Whether the fleet was large last time (then the scrape times and the packed series are
    asked at once) is this object's state, so the caller's: a server keeps one reader.

    One read (every query it asks) has ``timeout`` seconds in all, connecting and every byte
    included, and each answer at most ``max_answer_bytes``: a store that trickles or floods
    fails the read (:class:`SourceUnavailable`), it cannot hold the caller."""

    url: str
    selector: str = ""
    fetch: Fetch = get_json
    timeout: float = READ_SECONDS
    packed: bool | None = None
    was_large: bool = False
    max_answer_bytes: int = MAX_ANSWER_BYTES

    def bounds(self) -> Bounds:
        """The bounds of one read."""
        return Bounds(self.timeout, self.max_answer_bytes)

    def ask(
        self,
        queries: Mapping[str, str],
        now: float,
        bounds: Bounds | None = None,
        check: Check = _carry_on,
    ) -> Answers:
        bounds = bounds if bounds is not None else self.bounds()
        return query(
            self.url,
            queries,
            now,
            fetch=self.fetch,
            timeout=self.timeout,
            bounds=bounds,
            check=check,
        )

    def read(self, req: ClusterRequest, now: float, check: Check = _carry_on) -> Fleet:
        """The fleet, read within one :meth:`bounds`; ``check`` may give the read up."""
        bounds = self.bounds()

        def ask(queries: Mapping[str, str]) -> Answers:
            return self.ask(queries, now, bounds, check)

        c, sel, max_age = req.choose, self.selector, req.max_age_seconds
        fits = self.packed is not False and packable(c.filters, c.sort, c.idle_for_seconds, max_age)
        packed = {"packed": packed_query(c.filters, sel), "problems": problems_query(sel, max_age)}
        if c.sort == "sm_active":  # not in the packing: the passing GPUs' own, where they have it
            packed["sm_active"] = sm_active_query(c.filters, sel)
        answers: Answers = {}
        if fits and (self.packed or self.was_large):  # known large: all at once
            answers = ask({"scraped": scraped_query(sel), **packed})
        scraped = answers.get("scraped") or ask({"scraped": scraped_query(sel)})["scraped"]
        self.was_large = len(scraped) > LARGE_FLEET_HOSTS
        if fits and (self.packed or self.was_large) and scraped:
            answers = answers or ask(packed)
            count = f"count({PACKED}{braces(sel)})"  # an empty answer may be none passing
            if answers["packed"] or ask({"n": count})["n"]:
                return parse_packed({**answers, "scraped": scraped}, now, max_age)
            log.info("no %s series at %s: the full read", PACKED, self.url)
        answers = ask(full_queries(c.filters, c.sort, c.idle_for_seconds, sel))
        fleet = parse_full({**answers, "scraped": scraped}, now, max_age, c.idle_for_seconds)
        if not fleet.hosts:
            raise SourceUnavailable(
                f"Prometheus at {base_url(self.url)} has no gpu-exporter series"
                + (f" matching {sel}" if sel else "")
                + " (is it scraping the exporters? VictoriaMetrics shows samples only after its "
                "-search.latencyOffset, 30 s by default)"
            )
        return fleet

    def reasons(self, req: ClusterRequest, now: float, check: Check = _carry_on) -> str:
        """Why no GPU passed a packed read: how many fail each filter (one query)."""
        try:
            answer = self.ask(
                {"r": reasons_query(req.choose.filters, self.selector)}, now, check=check
            )
        except SourceUnavailable as exc:
            return f"the store did not count the reasons: {exc}"
        return reasons_text(answer["r"], req.choose.filters)


def _value(sample: Mapping[str, Any]) -> float | None:
    """An instant vector sample's value; NaN (and anything unreadable) is absent."""
    try:
        value = float(sample["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return None if value != value else value


def _card(labels: Mapping[str, str]) -> tuple[str, int] | None:
    """(UUID, index) of a whole card's series; None for a MIG device or a bad label."""
    uuid, index = labels.get("uuid"), digits(labels.get("gpu", ""))  # not int(): "²"
    return None if not uuid or uuid.startswith("MIG-") or index is None else (uuid, index)


def _scrape_times(samples: Sequence[Mapping[str, Any]]) -> dict[str, tuple[str, float | None]]:
    """url → (instance, last scrape time) from the ``scraped`` answer."""
    labels = [(s.get("metric", {}), _value(s)) for s in samples]
    return {exporter_url(m): (m.get("instance", ""), at) for m, at in labels}


def parse_full(
    results: Mapping[str, Sequence[Mapping[str, Any]]],
    evaluated_at: float,
    max_age_seconds: float,
    idle_for_seconds: float | None = None,
) -> Fleet:
    """Every host's GPUs from the full read's answers; a host whose target or NVML is down,
    or whose figures are older than ``max_age_seconds`` (or undated), is passed over."""
    per_gpu: dict[str, dict[str, dict[str, Any]]] = {}  # url → uuid → fields
    per_host: dict[str, dict[str, Any]] = {}  # url → instance, nvml_up, sampled_at
    for sample in results.get("values", ()):
        labels = sample.get("metric", {})
        url, name, value = exporter_url(labels), labels.get("__name__"), _value(sample)
        host = per_host.setdefault(url, {"instance": labels.get("instance", url)})
        if name == "gpu_exporter_nvml_up":
            host["nvml_up"] = value
        elif name == "gpu_exporter_last_sample_timestamp_seconds":
            host["sampled_at"] = value
        elif (card := _card(labels)) is not None:
            gpu = per_gpu.setdefault(url, {}).setdefault(card[0], {"index": card[1]})
            if name == "gpu_up":
                gpu["up"] = value == 1
            elif name == "gpu_leased":
                gpu["leased"] = value == 1
            elif name == "gpu_info":
                gpu.update(name=labels.get("name"), pci_bus_id=labels.get("pci_bus_id"))
            elif name == "gpu_pod_info":
                pod = f"{labels.get('namespace', '')}/{labels.get('pod', '')}"
                gpu.setdefault("pods", set()).add(pod)
            elif name in VALUE_METRICS and value is not None:
                field_name, kind = VALUE_METRICS[name]
                gpu[field_name] = kind(value)
    scraped = _scrape_times(results.get("scraped", ()))
    window = _parse_window(results.get("window", ())) if idle_for_seconds else {}
    hosts: dict[str, Host] = {}
    for url, info in sorted(per_host.items()):
        mine = per_gpu.get(url, {})
        gpus = tuple(sorted((_sample(u, v) for u, v in mine.items()), key=lambda g: g.index))
        at = scraped.get(url, ("", None))[1]
        age = None if at is None else max(0.0, evaluated_at - at)
        lag = None if info.get("sampled_at") is None or at is None else at - info["sampled_at"]
        problem = host_problem(info.get("nvml_up"), lag, age, max_age_seconds)
        problem = problem or (None if gpus else "no GPUs")
        host_window = None
        if idle_for_seconds and problem is None:
            worst = window.get(url, {})
            host_window = _window(worst, gpus, idle_for_seconds, evaluated_at, max_age_seconds)
        leased = tuple(u for u, v in mine.items() if v.get("leased"))
        pods = tuple((u, allocated_to(v["pods"])) for u, v in mine.items() if "pods" in v)
        instance = str(info["instance"])
        hosts[url] = Host(url, instance, gpus, leased, problem, host_window, age, pods)
    # Targets whose last scrape failed: passed over even if series of theirs are still
    # around (Prometheus stale-marks them, but remote or federated data is not).
    jobs = {s.get("metric", {}).get("job") for s in results.get("values", ())}
    for sample in results.get("down", ()):
        labels = sample.get("metric", {})
        if labels.get("job") in jobs:  # a gpu-exporter target
            url = exporter_url(labels)
            down = hosts.get(url) or Host(url, labels.get("instance", url))
            hosts[url] = replace(down, problem=TARGET_DOWN, window=None)
    fleet = tuple(hosts.values())
    return Fleet(fleet, "prometheus", evaluated_at, window_checked=bool(idle_for_seconds))


def _sample(uuid: str, values: Mapping[str, Any]) -> GpuSample:
    if not values.get("up"):
        error = "gpu_up 0" if values.get("up") is False else "no gpu_up series"
        index, name, bus = values["index"], values.get("name"), values.get("pci_bus_id")
        return GpuSample(index, uuid, False, name=name, pci_bus_id=bus, error=error)
    figures = {k: v for k, v in values.items() if k not in ("up", "leased", "pods")}
    return GpuSample(uuid=uuid, up=True, **figures)


def _parse_window(samples: Sequence[Mapping[str, Any]]) -> dict[str, dict[Any, Any]]:
    """url → {"oldest": t, (uuid, field): worst value}."""
    out: dict[str, dict[Any, Any]] = {}
    for sample in samples:
        labels = sample.get("metric", {})
        kind, value = labels.get("fleet_field"), _value(sample)
        host = out.setdefault(exporter_url(labels), {})
        if kind == "oldest" and value is not None:
            host["oldest"] = min(value, host.get("oldest", value))
        elif kind != "oldest" and (uuid := labels.get("uuid")) and value is not None:
            host[(uuid, kind)] = value
    return out


def _window(
    worst: Mapping[Any, Any],
    gpus: Sequence[GpuSample],
    seconds: float,
    evaluated_at: float,
    max_age_seconds: float,
) -> Window:
    """idle_for as a :class:`~gpu_exporter.choose.filters.Window` of each GPU's worst
    figures. The window's first sample comes at most one scrape after its start, so history
    reaching back to within ``max_age_seconds`` of the start counts as covering it."""
    oldest = worst.get("oldest")
    covered = 0.0 if oldest is None else evaluated_at - oldest + max_age_seconds
    past = []
    for gpu in gpus:
        if (gpu.uuid, "up") not in worst:
            continue  # no figures for this GPU in the window: window_reasons says so
        if worst[(gpu.uuid, "up")] < 1:
            past.append(replace(gpu, up=False, error="down"))
            continue
        changes: dict[str, Any] = {}
        for limit in LIMITS:
            if limit.fixed:  # no worst over a window: window_query asks none
                continue
            for field, series in limit.figures:  # with a fallback's (utilization without GPM)
                if (value := worst.get((gpu.uuid, field))) is not None:
                    changes[field] = VALUE_METRICS[series][1](value)
        past.append(replace(gpu, **changes))
    return Window(seconds, covered, ((seconds, tuple(past)),), worst_case=True)


_DEFAULTS: Final = {f.name: f.default for f in fields(GpuSample)}
_READ_WHILE_RANKING: Final = ("memory_total_bytes", "gpu_instance_id", "compute_instance_id")


class PassingGpu(GpuSample):
    """A GPU the packed read let through: index, UUID, free memory, utilization and SM
    activity (None unless sort=sm_active asked it, or without GPM) set, every other figure
    its default. A plain GpuSample's ``__init__`` sets all its fields (10 µs:
    0.3 s for the 31,000 GPUs that pass among 100,000); this sets the ranking's few."""

    __slots__ = ()

    @classmethod
    def of(
        cls, index: int, uuid: str, free_bytes: int, util: float, sm_active: float | None = None
    ) -> PassingGpu:
        gpu = object.__new__(cls)
        for name, value in (("index", index), ("uuid", uuid), ("up", True)):
            object.__setattr__(gpu, name, value)
        object.__setattr__(gpu, "memory_free_bytes", free_bytes)
        object.__setattr__(gpu, "utilization_ratio", util)
        object.__setattr__(gpu, "sm_active_ratio", sm_active)  # asked only for sort=sm_active
        for name in _READ_WHILE_RANKING:  # set, so that ranking asks no __getattr__
            object.__setattr__(gpu, name, None)
        return gpu

    def __getattr__(self, name: str) -> Any:  # only for the fields left unset
        try:
            return _DEFAULTS[name]
        except KeyError:
            raise AttributeError(name) from None


def parse_packed(answers: Mapping[str, Any], evaluated_at: float, max_age_seconds: float) -> Fleet:
    """The fleet from the ``scraped``, ``packed`` and ``problems`` answers: every exporter,
    with only the GPUs that passed (free memory in whole GiB, utilization and, from the
    ``sm_active`` answer where there is one, SM activity), or its problem as :func:`parse_full`
    says it."""
    scraped = _scrape_times(answers.get("scraped", ()))
    jobs = {s.get("metric", {}).get("job") for s in answers.get("scraped", ())}
    sm_active: dict[tuple[str, str], float] = {}  # (URL label or instance, UUID) → SM activity
    for sample in answers.get("sm_active", ()):
        labels = sample.get("metric", {})
        where = labels.get(URL_LABEL) or labels.get("instance", "")
        if (value := _value(sample)) is not None and (card := _card(labels)) is not None:
            sm_active[(where, card[0])] = value
    gpus: dict[str, list[GpuSample]] = {}
    urls: dict[str, str] = {}  # the URL label (or instance) → the exporter: 8 GPUs share one
    for sample in answers.get("packed", ()):
        labels = sample.get("metric", {})
        value, card = _value(sample), _card(labels)
        if value is None or card is None:
            continue
        where = labels.get(URL_LABEL) or labels.get("instance", "")
        url = urls.get(where) or urls.setdefault(where, exporter_url(labels))
        scraped.setdefault(url, (labels.get("instance", url), None))
        free, util = unpack(value)
        sm = sm_active.get((where, card[0])) if sm_active else None
        gpus.setdefault(url, []).append(PassingGpu.of(card[1], card[0], free * GIB, util, sm))
    flagged: dict[str, dict[str, Any]] = {}
    for sample in answers.get("problems", ()):
        labels = sample.get("metric", {})
        kind = labels.get("fleet_problem")
        if kind != "target_down" or labels.get("job") in jobs:  # a gpu-exporter target
            url = exporter_url(labels)
            scraped.setdefault(url, (labels.get("instance", url), None))
            flagged.setdefault(url, {})[kind] = _value(sample)
    hosts = []
    for url, (instance, at) in sorted(scraped.items()):
        info = flagged.get(url, {})
        age = None if at is None else max(0.0, evaluated_at - at)
        nvml = 0.0 if "nvml_down" in info else None
        problem = host_problem(nvml, info.get("stuck"), age, max_age_seconds)
        problem = TARGET_DOWN if "target_down" in info else problem
        mine = () if problem else tuple(sorted(gpus.get(url, ()), key=lambda g: g.index))
        hosts.append(Host(url, instance or url, mine, (), problem, age_seconds=age))
    return Fleet(tuple(hosts), "prometheus", evaluated_at, filtered=True)


def read_hosts(
    hosts: Sequence[str],
    req: ClusterRequest,
    *,
    fetch: Fetch,
    timeout: float,
    now: float,
    check: Check = _carry_on,
) -> Fleet:
    """The fleet from each named exporter's ``/gpus`` and ``/leases`` (asked concurrently).

    The whole read has ``timeout`` seconds (connecting and every byte, as a store's read)
    and each answer at most :data:`MAX_ANSWER_BYTES`: a host that trickles or floods is
    passed over with why, never waited for past the deadline. ``check`` may give the read up.
    """
    bounds = Bounds(timeout, MAX_ANSWER_BYTES)

    def one(name: str) -> Host:
        url = base_url(name, DEFAULT_EXPORTER_PORT)
        try:
            with bounds.applied():
                snapshot = fetch(url + "/gpus", bounds.remaining())
                held = fetch(url + "/leases", bounds.remaining())
            return host_from_snapshot(url, name, snapshot, held, req.max_age_seconds)
        except SourceUnavailable as exc:
            why = bounds.cut_because
            problem = f"no answer from {urllib.parse.urlsplit(url).netloc}: {why}" if why else ""
            return Host(url=url, instance=name, problem=problem or str(exc))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return Host(url=url, instance=name, problem=f"unexpected /gpus answer: {exc}")

    pool = ThreadPoolExecutor(max_workers=max(1, min(32, len(hosts))), thread_name_prefix="hosts")
    futures = [pool.submit(one, name) for name in hosts]
    try:
        pending = set(futures)
        while pending and bounds.remaining() > 0:
            _, pending = wait(pending, min(WATCH_SECONDS, max(0.0, bounds.remaining())))
            check()
        if pending:  # the deadline: what is still being read ends at once, passed over
            bounds.cut(f"nothing within {timeout:g} s (the deadline of the whole read)")
            wait(pending)
        return Fleet(tuple(future.result() for future in futures), "hosts", now)
    finally:
        if not all(future.done() for future in futures):
            bounds.cut("the read of the hosts was given up")
        pool.shutdown(wait=False)
