"""Choosing across hosts for real: three exporters, a real store, leases on the hosts.

Every test runs twice: against Prometheus and against VictoriaMetrics (single node, scraping
the exporters itself, the rules evaluated by vmalert), both with the recorded fleet view of
deploy/prometheus/gpu-exporter.fleet.rules.yml loaded; each skips, saying why, where its
package is missing.

Loads (constant, so no lease ends early because a job "arrived"):

* host A: 1 idle GPU, 3 busy;  * host B: 3 idle, 1 busy;  * host C: 2 idle, 2 busy.

The tests run in file order on one fleet: B is stopped by the down-host test.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gpu_exporter import client
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.client import GpuExporterWarning, NoGpusAvailable
from gpu_exporter.client.choosing import http_claimer
from gpu_exporter.fleet.placing import ClusterChoice, choose_fleet
from gpu_exporter.fleet.reading import PrometheusReader, get_json
from harness import (
    ROOT,
    Exporter,
    Prometheus,
    exporter,
    get,
    prometheus,
    stop,
    victoria_metrics,
)

pytestmark = pytest.mark.slow

IDLE = 'load = "constant"\nutilization = 0.0\nmemory_used_ratio = 0.0\nprocesses = 0'
BUSY = 'load = "constant"\nutilization = 0.95\nmemory_used_ratio = 0.9\nprocesses = 1'


def scenario(path: Path, idle: int, busy: int) -> str:
    blocks = [f"[[gpus]]\ncount = {idle}\n{IDLE}\n", f"[[gpus]]\ncount = {busy}\n{BUSY}\n"]
    path.write_text("\n".join(blocks))
    return str(path)


@dataclass
class Fleet:
    a: Exporter
    b: Exporter
    c: Exporter
    prom: Prometheus

    def wait_until_no_leases(self) -> None:
        """The store's view catches up with released leases: every GPU's latest sample
        says not leased, in the raw series and in the packed series (vmalert evaluates a
        few seconds behind; VictoriaMetrics makes each series' new samples searchable a
        second or two apart, so a sum could miss one)."""
        self.prom.wait_for("count(gpu_leased == 0) == 12")
        self.prom.wait_for("count(gpu_fleet:packed) == 12")  # every card can be handed out


T = TypeVar("T")
FLEET_RULES = ROOT / "deploy" / "prometheus" / "gpu-exporter.fleet.rules.yml"
STORES = {
    "prometheus": functools.partial(prometheus, rule_files=[FLEET_RULES]),
    "victoria-metrics": functools.partial(victoria_metrics, rule_files=[FLEET_RULES]),
}


@pytest.fixture(scope="module", params=sorted(STORES))
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    store = STORES[request.param]
    tmp = tmp_path_factory.mktemp("fleet")
    with contextlib.ExitStack() as stack:
        a, b, c = (
            stack.enter_context(
                exporter(
                    "--simulate", scenario(tmp / f"{name}.toml", idle, busy), "--interval", "0.2"
                )
            )
            for name, idle, busy in (("a", 1, 3), ("b", 3, 1), ("c", 2, 2))
        )
        prom = stack.enter_context(store([a.address, b.address, c.address]))
        prom.wait_for_targets_up(3)
        prom.wait_for("count(gpu_up == 1) == 12")
        prom.wait_for("count(gpu_exporter_last_sample_timestamp_seconds) == 3")
        yield Fleet(a, b, c, prom)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpu_exporter", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != client.URL_ENV},
    )


def env_line(text: str) -> dict[str, str]:
    assert text.startswith("export "), text
    return dict(part.split("=", 1) for part in text.split()[1:])


def leases_on(ex: Exporter) -> list[dict[str, object]]:
    status, body = get(ex.base + "/leases")
    assert status == 200, body
    leases: list[dict[str, object]] = json.loads(body)["leases"]
    return leases


def advise(
    store: str, args: dict[str, str], packed: bool
) -> tuple[ClusterChoice | ApiError, list[str]]:
    """A fleet choice without a lease through ``store``, read packed or in full: what it
    chose (or its refusal), and the URLs it asked."""
    asked: list[str] = []

    def fetch(url: str, timeout: float) -> Any:
        asked.append(url)
        return get_json(url, timeout)

    reader = PrometheusReader(store, fetch=fetch, packed=packed)
    try:
        choice = choose_fleet(
            {**args, "lease": "0"}, prometheus=reader, claimer=http_claimer, release=client.release
        )
    except ApiError as exc:
        return exc, asked
    return choice, asked


def test_the_host_with_the_requested_free_gpus_is_chosen(fleet: Fleet) -> None:
    # Only B has three idle GPUs.
    choice = client.choose(3, prometheus=fleet.prom.base, max_util="10%")
    assert choice.url == fleet.b.base and choice.host == "127.0.0.1"
    assert len(choice.uuids) == 3 and choice.lease_id is not None
    assert [lease["id"] for lease in leases_on(fleet.b)] == [choice.lease_id]
    client.release(choice)

    # The command line, as a job script would use it.
    done = cli("choose", "--prometheus", fleet.prom.base, "-n", "2", "--max-util", "10%",
               "--min-free", "70GiB", "--format", "env", "--lease", "0")  # fmt: skip
    assert done.returncode == 0, done.stderr
    env = env_line(done.stdout)
    assert env["GPU_EXPORTER_URL"] in (fleet.b.base, fleet.c.base)  # A has one idle GPU only
    assert env["GPU_HOST"] == "127.0.0.1" and "GPU_LEASE" not in env

    # idle_for through Prometheus' range functions: two seconds of history are there, ten
    # minutes are not (and unproven idleness is not idleness).
    advice = client.choose_cluster(
        3, prometheus=fleet.prom.base, max_util=0.1, idle_for="2s", lease=0
    )
    assert advice.placements[0].url == fleet.b.base
    with pytest.raises(NoGpusAvailable) as info:
        client.choose(1, prometheus=fleet.prom.base, max_util=0.1, idle_for="10m", lease=0)
    for ex in (fleet.a, fleet.b, fleet.c):
        assert ex.base in str(info.value)
    assert "s of history for idle_for 600 s" in str(info.value)

    # A selector narrows the fleet to the targets it matches.
    narrowed = client.choose(1, prometheus=fleet.prom.base, selector='job="gpu"', lease=0)
    assert narrowed.url in (fleet.a.base, fleet.b.base, fleet.c.base)
    with pytest.raises(client.ServerError, match='no gpu-exporter series matching job="other"'):
        client.choose(1, prometheus=fleet.prom.base, selector='job="other"', lease=0)


def test_the_packed_read_gives_the_same_choices(fleet: Fleet) -> None:
    """What a fleet past 500 exporters reads (gpu_exporter.fleet.packing): only the GPUs
    that pass, from the one packed series per GPU the rule records (Prometheus, or vmalert
    over VictoriaMetrics); the same choices as the full read, and its refusals counted."""
    fleet.wait_until_no_leases()
    requests = [
        {"n": "3", "max_util": "10%"},
        {"n": "2", "max_util": "10%", "min_free": "70GiB", "max_procs": "0"},
        {"n": "1", "max_util": "100%", "max_mem_used": "100%", "sort": "util"},
        {"n": "4", "max_util": "100%", "max_mem_used": "100%", "spread": "1"},
        {"n": "1", "model": "no such model"},
    ]
    packed_reads = 0
    for args in requests:
        picks = {}
        for packed in (False, True):
            advice, asked = advise(fleet.prom.base, args, packed)
            if isinstance(advice, ApiError):  # packed, the store counted why
                counted = "counted in the store" in advice.message
                picks[packed] = [("refused", advice.code, counted == packed)]
            else:
                picks[packed] = [(p.url, sorted(p.uuids)) for p in advice.placements]
        assert picks[True] == picks[False], (args, picks)
        packed_reads += sum("gpu_fleet%3Apacked" in url for url in asked)
        assert not any("__name__" in url for url in asked), asked  # no full read
    assert packed_reads >= 5  # every request fits the packing
    with pytest.raises(ApiError, match=r"of 12 GPUs \(counted in the store.*, 12 of a model"):
        choose_fleet(
            {"n": "1", "model": "no such"},
            prometheus=PrometheusReader(fleet.prom.base, packed=True),
            claimer=http_claimer,
            release=client.release,
        )


def test_the_cluster_endpoint_of_an_exporter_with_a_prometheus_url(fleet: Fleet) -> None:
    fleet.wait_until_no_leases()
    with exporter("--simulate", "1", "--prometheus-url", fleet.prom.base) as front:
        status, body = get(front.base + "/cluster/choose?n=3&max_util=10%25&format=json")
        assert status == 200, body
        answer = json.loads(body)
        (placed,) = answer["placements"]
        assert placed["url"] == fleet.b.base and answer["source"] == "prometheus"
        assert [lease["id"] for lease in leases_on(fleet.b)] == [placed["lease"]["id"]]
        assert placed["lease"]["token"].startswith(placed["lease"]["id"] + ".")
        client.release(placed["lease"]["token"], fleet.b.base)
        status, body = get(front.base + "/cluster/choose?n=5")
        assert status == 503 and body.startswith("error: no 5 GPUs qualify on one host")


def test_concurrent_cluster_choices_never_lease_one_gpu_twice(fleet: Fleet) -> None:
    fleet.wait_until_no_leases()
    chosen: list[client.Choice] = []
    refused: list[Exception] = []
    start = threading.Barrier(20)

    def one() -> None:
        start.wait()
        try:
            # Busy cards too (off the default filters): each of the 12 GPUs once.
            any_load = {"max_util": 1, "max_mem_used": 1}
            chosen.append(
                client.choose(1, prometheus=fleet.prom.base, lease="60s", timeout=30, **any_load)
            )
        except NoGpusAvailable as exc:
            refused.append(exc)

    threads = [threading.Thread(target=one) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        held = [(c.url, u) for c in chosen for u in c.uuids]
        assert len(held) == len(set(held))  # never one GPU twice
        assert len(chosen) == 12 and len(refused) == 8  # every GPU once, then no more
        for ex in (fleet.a, fleet.b, fleet.c):  # and each host's table agrees
            on_host = sorted(u for lease in leases_on(ex) for u in lease["gpus"])  # type: ignore[attr-defined]
            assert on_host == sorted(u for url, u in held if url == ex.base)
            assert len(on_host) == 4
    finally:
        for c in chosen:
            client.release(c)


def eventually(
    choose: Callable[[], T], seconds: float = 15.0, caught_up: Callable[[T], bool] | None = None
) -> T:
    """``choose()`` once the store's view has caught up: VictoriaMetrics makes each series'
    new samples searchable a second or two apart, so for a moment after a change (a scrape
    that failed) a choice can read an older sample of another host (a lease, a load, a
    problem not yet recorded); seen in full-suite runs. Refusals, and answers ``caught_up``
    says are stale, are retried until ``seconds`` have passed; then the last one stands."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            choice = choose()
        except (NoGpusAvailable, ApiError):
            if time.monotonic() > deadline:
                raise
        else:
            if caught_up is None or caught_up(choice) or time.monotonic() > deadline:
                return choice
        time.sleep(0.5)


def test_a_host_whose_exporter_is_down_is_skipped(fleet: Fleet) -> None:
    fleet.wait_until_no_leases()
    stop(fleet.b.proc)
    # Whether Prometheus has noticed yet or not, B cannot serve: C (two idle GPUs) does.
    # (eventually: the store can still serve C's lease samples from the previous test for a
    # moment after the wait above saw them released; seen once in a fresh-clone run.)
    first = eventually(
        lambda: client.choose_cluster(2, prometheus=fleet.prom.base, max_util=0.1, lease=0)
    )
    assert first.placements[0].url == fleet.c.base
    assert fleet.b.base in {url for _, url, _ in first.passed_over}
    fleet.prom.wait_for(f'up{{instance="{fleet.b.address}"}} == 0')
    later = eventually(
        lambda: client.choose_cluster(2, prometheus=fleet.prom.base, max_util=0.1, lease=0)
    )
    assert later.placements[0].url == fleet.c.base
    reasons = {url: why for _, url, why in later.passed_over}
    assert "target down" in reasons[fleet.b.base]
    # Past 500 exporters (forced here): the packed series, and the problem the rules record.
    down = f'gpu_fleet:problem{{fleet_problem="target_down",instance="{fleet.b.address}"}}'
    fleet.prom.wait_for(f"{down} == 0")

    def packed_choice() -> Any:
        return choose_fleet(
            {"n": "2", "max_util": "10%", "lease": "0"},
            prometheus=PrometheusReader(fleet.prom.base, packed=True),
            claimer=http_claimer,
            release=client.release,
        )

    # VictoriaMetrics answered the packed read with older samples right after the query above
    # had seen the new ones: once without B's problem record (B read as "no GPU passes the
    # filters there"), once with C's GPUs still busy (a refusal). The same store lag as
    # eventually()'s, so the read is repeated for a while before judging it.
    packed = eventually(packed_choice, caught_up=lambda c: "target down" in _why(c, fleet.b.base))
    assert packed.placements[0].url == fleet.c.base
    assert "target down" in _why(packed, fleet.b.base)


def _why(choice: Any, url: str) -> str:
    """Why the fleet choice passed over the host at ``url`` ("" if it did not)."""
    return {u: why for _, u, why in choice.passed_over}.get(url, "")


def test_with_prometheus_down_the_named_hosts_still_serve(fleet: Fleet) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
    hosts = ",".join(ex.address for ex in (fleet.a, fleet.b, fleet.c))  # B is down by now
    with pytest.warns(GpuExporterWarning, match="asked the hosts named instead"):
        choice = client.choose(2, prometheus=dead, hosts=hosts, max_util=0.1)
    try:
        assert choice.url == fleet.c.base and choice.lease_id is not None
        assert [lease["id"] for lease in leases_on(fleet.c)] == [choice.lease_id]
    finally:
        client.release(choice)

    done = cli("run", "--prometheus", dead, "--hosts", hosts, "-n", "1", "--max-util", "10%",
               "--", sys.executable, "-c",
               "import os; print(os.environ['GPU_HOST'], os.environ['GPU_EXPORTER_URL'],"
               " os.environ['CUDA_VISIBLE_DEVICES'], os.environ['GPU_LEASE'])")  # fmt: skip
    assert done.returncode == 0, done.stderr
    host, url, uuid, lease = done.stdout.split()
    assert host == "127.0.0.1" and url in (fleet.a.base, fleet.c.base)
    assert uuid.startswith("GPU-") and lease
    assert "asked the hosts named instead" in done.stderr
    assert not any(lease_["id"] == lease for lease_ in leases_on(fleet.c))  # released after

    done = cli("choose", "--prometheus", dead, "-n", "1")
    assert done.returncode == 1 and "cannot reach" in done.stderr


# -- SM activity (GPM) across the fleet: its own two hosts, so the loads above stay as they are

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"


def loaded(model: str, utilization: float) -> str:
    return (
        f'[[gpus]]\nmodel = "{model}"\nload = "constant"\nutilization = {utilization}\n'
        "memory_used_ratio = 0.0\nprocesses = 0\n"
    )


@dataclass
class GpmFleet:
    g: Exporter  # GPU 0: an H100 30 % utilized, its SMs 8.55 % active; GPU 1: an A100 at 20 %
    u: Exporter  # GPU 0: an A100 at 15 % (no GPM: judged by its utilization)
    prom: Prometheus


@pytest.fixture(scope="module", params=sorted(STORES))
def gpm_fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GpmFleet]:
    tmp = tmp_path_factory.mktemp("gpm")
    (tmp / "g.toml").write_text(loaded(H100, 0.3) + loaded(A100, 0.2))
    (tmp / "u.toml").write_text(loaded(A100, 0.15))
    with contextlib.ExitStack() as stack:
        flags = ("--interval", "0.2", "--gpm-interval", "0.5")
        g, u = (
            stack.enter_context(exporter("--simulate", str(tmp / f"{name}.toml"), *flags))
            for name in ("g", "u")
        )
        prom = stack.enter_context(STORES[request.param]([g.address, u.address]))
        prom.wait_for_targets_up(2)
        prom.wait_for("count(gpu_sm_active_ratio) == 1")  # the H100's only
        prom.wait_for("count(gpu_fleet:packed) == 3")
        prom.wait_for("count(gpu_exporter_last_sample_timestamp_seconds) == 2")
        yield GpmFleet(g, u, prom)


def test_sm_activity_chooses_across_the_fleet_with_utilization_where_a_card_has_no_gpm(
    gpm_fleet: GpmFleet,
) -> None:
    f = gpm_fleet
    sm = {s["metric"]["gpu"]: float(s["value"][1]) for s in f.prom.query("gpu_sm_active_ratio")}
    assert sm == {"0": pytest.approx(0.0855)}  # busy by utilization, its SMs mostly idle
    uuids = {
        (s["metric"]["instance"], s["metric"]["gpu"]): s["metric"]["uuid"]
        for s in f.prom.query("gpu_up")
    }
    h100, g_a100, u_a100 = (
        (f.g.base, uuids[(f.g.address, "0")]),
        (f.g.base, uuids[(f.g.address, "1")]),
        (f.u.base, uuids[(f.u.address, "0")]),
    )

    def picks(args: dict[str, str], packed: bool) -> Any:
        advice, asked = advise(f.prom.base, args, packed)
        if isinstance(advice, ApiError):
            got: Any = ("refused", advice.code, advice.message)
        else:
            got = sorted((p.url, u) for p in advice.placements for u in p.uuids)
        # The packed read where asked (no full read), the full read otherwise.
        assert any("__name__" in url for url in asked) != packed, (args, asked)
        return got

    for packed in (False, True):
        refused = picks({"n": "1", "max_util": "10%"}, packed)
        assert refused[:2] == ("refused", "not_enough_gpus")
        assert picks({"n": "1", "max_sm_active": "10%"}, packed) == [h100]
        assert picks({"n": "1", "sort": "util"}, packed) == [u_a100]
        assert picks({"n": "1", "sort": "sm_active"}, packed) == [h100]
        # g's A100 (20 %, no GPM) fails 18 % by its utilization; u's (15 %) passes.
        both = {"n": "2", "spread": "1", "max_sm_active": "18%"}
        assert picks(both, packed) == sorted([h100, u_a100])
        assert picks({**both, "max_sm_active": "25%", "n": "3"}, packed) == sorted(
            [h100, g_a100, u_a100]
        )
        refused = picks({**both, "n": "3"}, packed)
        assert refused[:2] == ("refused", "not_enough_gpus")
        if packed:  # the store counts the reasons
            assert "1 with SM activity (utilization without GPM) > max_sm_active 0.18" in refused[2]
        else:
            assert "utilization (no GPM) 0.20 > max_sm_active 0.18" in refused[2]

    # idle_for: each card's worst over the window, SM activity or, without GPM, utilization.
    assert picks({"n": "1", "max_sm_active": "10%", "idle_for": "2s"}, False) == [h100]
    assert picks({"n": "2", "spread": "1", "max_sm_active": "18%", "idle_for": "2s"}, False) == (
        sorted([h100, u_a100])
    )

    # A claim through /cluster/choose: the chosen host checks max_sm_active again and leases.
    with exporter("--simulate", "1", "--prometheus-url", f.prom.base) as front:
        status, body = get(front.base + "/cluster/choose?n=1&max_sm_active=10%25&format=json")
        assert status == 200, body
        (placed,) = json.loads(body)["placements"]
        assert (placed["url"], placed["uuids"]) == (f.g.base, [h100[1]])
        assert [lease["id"] for lease in leases_on(f.g)] == [placed["lease"]["id"]]
        client.release(placed["lease"]["token"], f.g.base)

    # --hosts: each exporter's /gpus carries its SM activity.
    hosts = [f.g.address, f.u.address]
    advice = client.choose_cluster(1, hosts=hosts, max_sm_active=0.1, lease=0)
    assert [(p.url, p.uuids) for p in advice.placements] == [(f.g.base, (h100[1],))]
    advice = client.choose_cluster(1, hosts=hosts, sort="sm_active", lease=0)
    assert [(p.url, p.uuids) for p in advice.placements] == [(f.g.base, (h100[1],))]
