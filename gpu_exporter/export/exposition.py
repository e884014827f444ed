"""``/metrics`` rendered once per snapshot, not once per scrape.

The GPU part of the exposition (every ``gpu_*`` series and the sample's own
``gpu_exporter_*`` figures: :meth:`GpuCollector.snapshot_families`) only changes when a new
snapshot is published, so it is rendered once per snapshot sequence and content type, and the
bytes are served to every scrape of that sample. What can change between two samples — the
lease table (``gpu_leased``), the request counters, the ``process_*`` figures of the exporter
itself — is small and rendered on every scrape, after the cached part.

Rendering happens on the first scrape after a sample, or — while anyone has scraped in the
last :data:`PRERENDER_WINDOW_SECONDS` — on a background thread as soon as the sample is
published (:meth:`Exposition.start`), so that a Prometheus scraping less often than the
sampler samples still gets cached bytes; an exporter nobody scrapes renders nothing, and
its render-ahead thread sleeps until the next scrape instead of waking for every sample.

The body is byte for byte what ``prometheus_client.make_wsgi_app`` over the same collectors
would serve (a test compares them), because each family is rendered on its own and the
parts are simply concatenated (OpenMetrics: with one ``# EOF`` at the end); dcgm-exporter's
names (``--metric-names``) are the exception, written by :mod:`gpu_exporter.export.dcgm`
itself because prometheus_client would give their counters' ``# TYPE`` a ``_total``. For gzip, the
compressor's state after the cached part is kept too: a scrape copies it and compresses only
the live tail.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import Collector

from gpu_exporter.collect.cache import SnapshotCache
from gpu_exporter.export.collectors import GpuCollector
from gpu_exporter.export.dcgm import DcgmCollector
from gpu_exporter.model import Snapshot

OPENMETRICS_EOF = b"# EOF\n"
PRERENDER_WINDOW_SECONDS = 300.0  # render new samples ahead while scraped this recently
GZIP_LEVEL = 6
GZIP_WBITS = 31  # a gzip header and trailer, as Content-Encoding: gzip needs

Encoder = Callable[[Collector], bytes]
StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class _Families(Collector):
    """A fixed list of families, for rendering part of the exposition."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def _render(encoder: Encoder, families: Iterable[Metric], openmetrics: bool) -> bytes:
    text = encoder(_Families(families))
    if openmetrics and text.endswith(OPENMETRICS_EOF):
        text = text[: -len(OPENMETRICS_EOF)]
    return text


@dataclass(frozen=True, slots=True)
class _Part:
    """The snapshot part of one content type, rendered and half-compressed."""

    key: tuple[int, int]  # the snapshot's sequence, and the DCGM labels' version
    text: bytes
    gzip_head: bytes  # what the compressor emitted for ``text`` so far (not flushed)
    gzip_state: Any  # zlib compressor after ``text``; copied per scrape, never used directly


class Exposition:
    """Renders ``/metrics`` for ``gpu`` (cached per snapshot) and ``live`` collectors.

    ``live`` are collectors rendered on every scrape after the GPU collector's families,
    such as ``ProcessCollector``; register the same objects, in the same order, in the
    registry given to :func:`gpu_exporter.web.app.create_app` so that both agree.
    ``dcgm`` (``--metric-names=dcgm|both``) adds dcgm-exporter's names, written by
    :class:`~gpu_exporter.export.dcgm.DcgmCollector` itself: its sampled families in the
    cached part (rendered again when its pod labels change), its last Xid in the tail.
    """

    def __init__(
        self,
        cache: SnapshotCache,
        gpu: GpuCollector,
        live: Sequence[Collector] = (),
        *,
        dcgm: DcgmCollector | None = None,
        gzip_level: int = GZIP_LEVEL,
        monotonic: Callable[[], float] = time.monotonic,
        prerender_window_seconds: float = PRERENDER_WINDOW_SECONDS,
    ) -> None:
        self._cache = cache
        self._monotonic = monotonic
        self._window = prerender_window_seconds
        # content type → (encoder, OpenMetrics?, when last scraped): what to render ahead
        self._recent: dict[str, tuple[Encoder, bool, float]] = {}
        self._stop = threading.Event()
        self._scraped = threading.Event()  # wakes the render-ahead thread from idle
        self._thread: threading.Thread | None = None
        self._gpu = gpu
        self._live = tuple(live)
        self._dcgm = dcgm
        self._gzip_level = gzip_level
        self._parts: dict[str, _Part] = {}
        self._lock = threading.Lock()
        # Snapshot parts rendered since start: the cache's cost. Against snapshot.sequence it
        # says how well the cache works (at most one render per sample and content type).
        self.renders = 0

    def render(
        self, accept: str | None = None, accept_encoding: str | None = None
    ) -> tuple[bytes, list[tuple[str, str]]]:
        """The body and headers for a scrape with these ``Accept``/``Accept-Encoding``."""
        encoder, content_type = choose_encoder(accept or "")
        openmetrics = content_type.startswith("application/openmetrics-text")
        self._recent[content_type] = (encoder, openmetrics, self._monotonic())
        if not self._scraped.is_set():
            self._scraped.set()
        snapshot = self._cache.get()
        part = self._part(snapshot, encoder, content_type, openmetrics)
        live = chain(
            self._gpu.live_families(snapshot), *(collector.collect() for collector in self._live)
        )
        tail = _render(encoder, live, openmetrics)
        if self._dcgm is not None:
            tail += self._dcgm.render_live(snapshot)
        if openmetrics:
            tail += OPENMETRICS_EOF
        headers = [("Content-Type", content_type)]
        if gzip_accepted(accept_encoding or ""):
            compressor = part.gzip_state.copy()
            body = part.gzip_head + compressor.compress(tail) + compressor.flush()
            headers.append(("Content-Encoding", "gzip"))
        else:
            body = part.text + tail
        return body, headers

    def _part(
        self, snapshot: Snapshot, encoder: Encoder, content_type: str, openmetrics: bool
    ) -> _Part:
        key = (snapshot.sequence, self._dcgm.version if self._dcgm is not None else 0)
        part = self._parts.get(content_type)
        if part is not None and part.key == key:
            return part
        with self._lock:  # concurrent scrapes of a new sample render it once
            part = self._parts.get(content_type)
            if part is not None and part.key == key:
                return part
            text = _render(encoder, self._gpu.snapshot_families(snapshot), openmetrics)
            if self._dcgm is not None:
                text += self._dcgm.render_snapshot(snapshot)
            compressor = zlib.compressobj(self._gzip_level, zlib.DEFLATED, GZIP_WBITS)
            fresh = _Part(key, text, compressor.compress(text), compressor)
            self.renders += 1
            if part is None or key > part.key:
                if any(p.key != key for p in self._parts.values()):
                    self._parts = {}  # keep only the newest sample's parts
                self._parts[content_type] = fresh
            return fresh

    def _scraped_lately(self) -> bool:
        now = self._monotonic()
        return any(now - t <= self._window for _, _, t in list(self._recent.values()))

    def prerender(self, snapshot: Snapshot) -> int:
        """Render ``snapshot`` for every content type scraped within the window; how many."""
        now = self._monotonic()
        recent = [
            (ct, e, om) for ct, (e, om, t) in list(self._recent.items()) if now - t <= self._window
        ]
        for content_type, encoder, openmetrics in recent:
            self._part(snapshot, encoder, content_type, openmetrics)
        return len(recent)

    def start(self) -> None:
        """Render each new sample ahead, on a thread of its own, while someone scrapes."""
        self._thread = threading.Thread(target=self._run, name="exposition", daemon=True)
        self._thread.start()

    def stop(self, timeout_seconds: float = 5.0) -> None:
        self._stop.set()
        self._scraped.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)

    def _run(self) -> None:
        sequence = self._cache.get().sequence
        while not self._stop.is_set():
            self._scraped.clear()
            if not self._scraped_lately():
                # Nobody scrapes: sleep until someone does (no wake-up per sample).
                self._scraped.wait()
                continue
            snapshot = self._cache.wait_for_newer(sequence, timeout_seconds=0.5)
            if snapshot.sequence != sequence:
                sequence = snapshot.sequence
                self.prerender(snapshot)

    def wsgi_app(
        self, registry: CollectorRegistry
    ) -> Callable[[dict[str, Any], StartResponse], list[bytes]]:
        """A WSGI app for ``/metrics``; ``registry`` serves what the cache does not cover.

        ``?name[]=`` filtering and anything but GET go to ``make_wsgi_app(registry)``, which
        must hold the same collectors.
        """
        fallback = make_wsgi_app(registry)

        def app(environ: dict[str, Any], start_response: StartResponse) -> list[bytes]:
            if (
                environ["REQUEST_METHOD"] != "GET"
                or environ.get("PATH_INFO", "") not in ("", "/")
                or "name[]" in parse_qs(environ.get("QUERY_STRING", ""))
            ):
                result: list[bytes] = fallback(environ, start_response)
                return result
            body, headers = self.render(
                environ.get("HTTP_ACCEPT"), environ.get("HTTP_ACCEPT_ENCODING")
            )
            start_response("200 OK", [*headers, ("Content-Length", str(len(body)))])
            return [body]

        return app
