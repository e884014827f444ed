"""Group 1's ``--kubernetes`` row: ``/metrics`` latency with the kubelet poller on, against the
same exporter without it, both running at once over the same fake GPUs.

The kubelet is tests/fakekubelet.py (a grpcio server on a Unix socket in this process),
answering for 11 pods: one per card by index ID (``deviceIDStrategy=index``), two more on
card 0 as time-slicing replicas, and one without a GPU limit. The exporter asks it every
second, ten times as often as in production, so any cost the poller adds to a scrape shows.
Scrapes alternate A B A B (``rounds``) to spread drift over both; each side's p99 is the mean
of its rounds'. Target: p99 unchanged within noise (≤ 1.25 × without, or + 0.5 ms).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

POLL_SECONDS = 1.0

# (exporter args) → a running exporter with a .port; (port) → sequential()'s summary
Start = Callable[[tuple[str, ...]], AbstractContextManager[Any]]
Scrape = Callable[[int], dict[str, Any]]


def pods(gpus: int) -> list[Any]:
    one_each = [
        (f"team-{i % 3}", f"job-{i}", [("main", [("nvidia.com/gpu", [str(i)])])])
        for i in range(gpus)
    ]
    shared = [
        ("notebooks", f"nb-{r}", [("jupyter", [("nvidia.com/gpu", [f"0::{r}"])])]) for r in (1, 2)
    ]
    return [*one_each, *shared, ("default", "web", [("nginx", [])])]


@contextlib.contextmanager
def _kubelet(gpus: int) -> Iterator[Any]:
    from fakekubelet import fake_kubelet  # tests/, on bench/run.py's path; needs grpcio

    with fake_kubelet(pods(gpus)) as kubelet:
        yield kubelet


def measure(start: Start, scrape: Scrape, gpus: int, rounds: int = 2) -> dict[str, Any]:
    """Both exporters' sequential ``/metrics`` figures and the p99 ratio."""
    try:
        import grpc  # noqa: F401
    except ImportError:
        return {"skipped": "grpcio not installed (pip install -e '.[kubernetes]')"}
    with contextlib.ExitStack() as stack:
        kubelet = stack.enter_context(_kubelet(gpus))
        flags = (f"--kubernetes={kubelet.socket_path}", "--kubernetes.poll-interval", "1")
        plain = stack.enter_context(start(()))
        k8s = stack.enter_context(start(flags))
        runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
        for _ in range(rounds):
            runs["without"].append(scrape(plain.port))
            runs["with"].append(scrape(k8s.port))
        body = _metrics_body(k8s.port)
    out: dict[str, Any] = {"poll_seconds": POLL_SECONDS, "kubelet_calls": kubelet.calls}
    for side, results in runs.items():
        out[side] = {
            "requests": sum(r["requests"] for r in results),
            "errors": sum(r["errors"] for r in results),
            "p50_ms": round(sum(r["p50_ms"] for r in results) / len(results), 3),
            "p99_ms": round(sum(r["p99_ms"] for r in results) / len(results), 3),
        }
    out["pod_info_series"] = body.count("\ngpu_pod_info{")
    out["ratio_p99"] = round(out["with"]["p99_ms"] / out["without"]["p99_ms"], 3)
    return out


def _metrics_body(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text: str = resp.read().decode()
    return text


def met(result: dict[str, Any]) -> bool:
    without, with_ = result["without"]["p99_ms"], result["with"]["p99_ms"]
    return result["with"]["errors"] == 0 and with_ <= max(1.25 * without, without + 0.5)


def rows(result: dict[str, Any] | None) -> list[tuple[str, Any, str, bool | None]]:
    """(measure, value, target, met) for docs/performance.md's table."""
    if not result or "skipped" in result:
        return []
    with_, without = result["with"], result["without"]
    return [
        (
            f"`/metrics` p99 ms with / without `--kubernetes` (kubelet asked every "
            f"{result['poll_seconds']:g} s, {result['pod_info_series']} `gpu_pod_info` series)",
            f"{with_['p99_ms']:.2f} / {without['p99_ms']:.2f}",
            "≤ 1.25 × without, or + 0.5 ms",
            met(result),
        )
    ]
