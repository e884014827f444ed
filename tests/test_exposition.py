"""/metrics rendered once per snapshot: the same bytes as prometheus_client, fewer renders."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from conftest import Stack, build_stack, sim_of
from conftest import without_process_metrics as bare
from gpu_exporter.choose.filters import Filters
from gpu_exporter.counters import RequestCounter
from gpu_exporter.export.collectors import GpuCollector
from gpu_exporter.export.exposition import Exposition
from gpu_exporter.simulate import Fault, Load, SimGpu

A100 = "NVIDIA A100-SXM4-80GB"
OPENMETRICS = "application/openmetrics-text; version=1.0.0"


class Ticker(Collector):
    """A live collector whose value the test moves, like ProcessCollector's CPU seconds."""

    def __init__(self) -> None:
        self.value = 0.0

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("ticker_seconds", "A value that changes per scrape.")
        family.add_metric([], self.value)
        yield family


class Setup:
    def __init__(self) -> None:
        self.stack: Stack = build_stack(
            sim_of(
                SimGpu(0, A100, Load("constant", utilization=0.4, processes=2)),
                SimGpu(1, "NVIDIA GeForce GTX 1080", Load("busy")),  # unsupported fields
                SimGpu(2, A100, Load("idle")),
                faults=[Fault("*", "GPU_IS_LOST", gpu=2, after_seconds=5)],
            )
        )
        self.requests = RequestCounter()
        self.ticker = Ticker()
        self.registry = CollectorRegistry()
        gpu = GpuCollector(
            self.stack.cache, version="test", leases=self.stack.leases, requests=self.requests
        )
        self.registry.register(gpu)
        self.registry.register(self.ticker)
        self.exposition = Exposition(
            self.stack.cache, gpu, (self.ticker,), monotonic=self.stack.clock.monotonic
        )

    def sample(self, seconds: float = 10) -> None:
        self.stack.clock.advance(seconds)
        self.stack.sample()


@pytest.fixture
def setup() -> Setup:
    s = Setup()
    s.stack.sample()
    s.sample()  # GPU 2 is lost by now
    return s


def test_the_text_is_exactly_prometheus_clients(setup: Setup) -> None:
    body, headers = setup.exposition.render()
    assert body == generate_latest(setup.registry)
    assert dict(headers)["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b'gpu_up{gpu="2"' in body and b"ticker_seconds_total 0.0" in body


def test_openmetrics_is_exactly_prometheus_clients(setup: Setup) -> None:
    body, headers = setup.exposition.render(OPENMETRICS)
    assert body == openmetrics.generate_latest(setup.registry)
    assert body.count(b"# EOF\n") == 1 and body.endswith(b"# EOF\n")
    assert dict(headers)["Content-Type"].startswith("application/openmetrics-text")


@pytest.mark.parametrize("accept", [None, OPENMETRICS])
def test_gzip_decompresses_to_the_same_bytes(setup: Setup, accept: str | None) -> None:
    plain, _ = setup.exposition.render(accept)
    for _ in range(2):  # the second one from the cached compressor state
        setup.ticker.value += 1.5
        zipped, headers = setup.exposition.render(accept, "deflate, gzip;q=1.0")
        assert dict(headers)["Content-Encoding"] == "gzip"
        expected = plain.replace(
            b"ticker_seconds_total 0.0", f"ticker_seconds_total {setup.ticker.value}".encode()
        )
        assert gzip.decompress(zipped) == expected
        assert len(zipped) < len(expected) / 3


def test_rendered_once_per_snapshot_while_live_series_stay_current(setup: Setup) -> None:
    exp = setup.exposition
    for _ in range(5):
        exp.render()
        exp.render(None, "gzip")
    assert exp.renders == 1
    # leases, request counters and live collectors change between samples: still exact
    setup.stack.leases.claim(setup.stack.cache.get(), 1, Filters(), ttl_seconds=60, requester="t")
    setup.requests.inc("ok")
    setup.ticker.value = 7.0
    body, _ = exp.render()
    assert exp.renders == 1
    assert body == generate_latest(setup.registry)
    assert b'gpu_exporter_choose_requests_total{result="ok"} 1.0' in body
    assert b"ticker_seconds_total 7.0" in body
    assert body.count(b"gpu_leased{") == 3 and b"} 1.0\ngpu_leased" in body + b"gpu_leased"
    # the next sample is rendered once more, and shows its own figures
    setup.sample()
    body, _ = exp.render()
    assert exp.renders == 2
    assert body == generate_latest(setup.registry)
    exp.render(OPENMETRICS)
    assert exp.renders == 3  # each content type once per sample


def test_new_samples_are_rendered_ahead_only_while_someone_scrapes(setup: Setup) -> None:
    exp = setup.exposition
    assert exp.prerender(setup.stack.cache.get()) == 0  # nobody has scraped: nothing to do
    assert exp.renders == 0
    exp.render(None, "gzip")
    exp.render(OPENMETRICS)
    assert exp.renders == 2
    setup.sample()
    assert exp.prerender(setup.stack.cache.get()) == 2  # both content types scraped lately
    assert exp.renders == 4
    body, _ = exp.render()
    assert exp.renders == 4 and body == generate_latest(setup.registry)  # served from cache
    setup.sample(301)  # nobody scraped for longer than the window
    assert exp.prerender(setup.stack.cache.get()) == 0
    assert exp.renders == 4


def test_the_prerender_thread_follows_published_samples(setup: Setup) -> None:
    exp = setup.exposition
    exp.start()
    try:
        exp.render()
        assert exp.renders == 1
        setup.sample(1)
        deadline = time.monotonic() + 10
        while exp.renders < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert exp.renders == 2
        exp.render()
        assert exp.renders == 2
    finally:
        exp.stop()


def test_the_app_serves_the_cached_rendering(stack: Stack) -> None:
    client = stack.client
    plain = client.get("/metrics")
    assert plain.status_code == 200
    # process_* (CPU seconds, RSS) may change between two renderings; the rest may not.
    assert bare(plain.data) == bare(generate_latest(stack.registry))
    zipped = client.get("/metrics", headers={"Accept-Encoding": "gzip"})
    assert zipped.headers["Content-Encoding"] == "gzip"
    assert bare(gzip.decompress(zipped.data)) == bare(plain.data)
    assert stack.exposition.renders == 1
    # other methods are still prometheus_client's own answers
    assert client.post("/metrics").status_code == 405
    assert client.options("/metrics").headers["Allow"] == "OPTIONS,GET"


def test_promtool_accepts_the_cached_rendering(setup: Setup) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(
            "promtool not installed (Debian package 'prometheus'; scripts/test installs it as root)"
        )
    setup.stack.leases.claim(setup.stack.cache.get(), 1, Filters(), ttl_seconds=60, requester="t")
    setup.exposition.render()
    body, _ = setup.exposition.render()  # from the cache
    result = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, timeout=60
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
