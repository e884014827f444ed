"""The Python client against the real exporter's /choose and /leases.

The server is tests/served.py's: daemon.build() over four simulated GPUs, served on a loopback
thread. Nothing here needs a GPU.
"""

from __future__ import annotations

import contextlib
import doctest
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from gpu_exporter import client
from gpu_exporter.client import (
    Choice,
    GpuExporterError,
    GpuExporterWarning,
    LeaseKeeper,
    LeaseNotFound,
    NoGpusAvailable,
    NotAnExporter,
    ServerError,
    ServerUnreachable,
    choose,
    choose_raw,
    error_from_response,
    hostapi,
    release,
    renew,
    resolve_url,
    transport,
    use_gpus,
)
from gpu_exporter.nvml import Nvml
from gpu_exporter.simulate import Fault, Scenario, SimulatedNvml
from harness import free_port
from served import Served, four_gpus, served

UUID = re.compile(r"^(GPU|MIG)-[0-9a-fA-F-]+$")
ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "GPU_LEASE")


@pytest.fixture
def exporter() -> Iterator[Served]:
    with served() as ex:
        yield ex


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on."""
    return free_port()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts without the variables use_gpus sets; monkeypatch restores them."""
    for key in (*ENV_KEYS, client.URL_ENV):
        monkeypatch.delenv(key, raising=False)


def lease_of(exporter: Served, lease_id: str) -> dict[str, Any] | None:
    return next((lease for lease in exporter.leases() if lease["id"] == lease_id), None)


@contextlib.contextmanager
def back_after(exporter: Served, failures: int) -> Iterator[None]:
    """Serve again once the client has logged ``failures`` failed renewals, and not before.

    The restart happens inside the logging call, on the renewing thread, so the next renewal
    finds the server up however slow the machine is.
    """

    class Restarter(logging.Handler):
        seen = 0

        def emit(self, record: logging.LogRecord) -> None:
            if "could not renew" in record.getMessage():
                self.seen += 1
                if self.seen == failures:
                    exporter.serve_again()

    handler = Restarter()
    logger = logging.getLogger("gpu_exporter.client")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


# -- choose ------------------------------------------------------------------------------


def test_choose_leases_gpus_and_parses_the_json_answer(exporter: Served) -> None:
    before = time.time()
    gpus = choose(2, exporter.url)
    assert len(gpus.uuids) == len(gpus.indices) == 2
    assert all(UUID.match(u) for u in gpus.uuids)
    assert all(isinstance(i, int) for i in gpus.indices)
    assert gpus.url == exporter.url and not gpus.local
    assert gpus.lease is not None and gpus.lease_id == gpus.lease.id
    assert gpus.lease.gpus == gpus.uuids
    assert gpus.expires_at is not None and before + 50 < gpus.expires_at < before + 70
    assert gpus.lease_id in exporter.lease_ids()
    assert [g["uuid"] for g in gpus.details["chosen"]] == list(gpus.uuids)
    release(gpus)
    assert gpus.lease_id not in exporter.lease_ids()


@pytest.mark.parametrize(
    ("fmt", "pattern"),
    [
        ("uuid", r"(?P<gpus>GPU-[0-9a-f-]+,GPU-[0-9a-f-]+)\n"),
        ("index", r"(?P<gpus>\d+,\d+)\n"),
        (
            "env",
            r"export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=(?P<gpus>\S+) "
            r"GPU_LEASE=(?P<lease>\S+)\n",
        ),
    ],
)
def test_text_formats_come_back_as_sent_with_the_lease_header(
    exporter: Served, fmt: str, pattern: str
) -> None:
    answer = choose_raw(2, exporter.url, format=fmt)
    match = re.fullmatch(pattern, answer.body)
    assert match, answer.body
    assert answer.lease_id is not None and answer.lease_id in exporter.lease_ids()
    assert answer.lease_token is not None and answer.lease_token.startswith(answer.lease_id + ".")
    if "lease" in match.groupdict():
        assert match["lease"] == answer.lease_token  # GPU_LEASE is the token
    release(answer.lease_token, exporter.url)


def test_json_format_lease_matches_the_header(exporter: Served) -> None:
    answer = choose_raw(1, exporter.url, format="json", owner="test-suite")
    data = json.loads(answer.body)
    assert data["n"] == 1 and len(data["chosen"]) == 1
    assert {"index", "uuid", "reasons"} <= set(data["rejected"][0])
    assert data["lease"]["id"] == answer.lease_id
    assert data["lease"]["owner"] == "test-suite"
    assert data["lease"]["gpus"] == [data["chosen"][0]["uuid"]]
    assert "snapshot_age_seconds" in data


def test_lease_zero_is_advice_only(exporter: Served) -> None:
    gpus = choose(1, exporter.url, lease=0)
    assert gpus.lease_id is None and gpus.expires_at is None and gpus.lease is None
    assert choose_raw(1, exporter.url, lease=0).lease_id is None
    assert exporter.lease_ids() == set()
    release(gpus)  # nothing to release: a no-op


def test_leased_gpus_are_not_handed_out_twice(exporter: Served) -> None:
    first = choose(2, exporter.url)
    second = choose(2, exporter.url)
    assert not set(first.uuids) & set(second.uuids)
    with pytest.raises(NoGpusAvailable):
        choose(1, exporter.url)
    release(first)
    third = choose(2, exporter.url)
    assert set(third.uuids) == set(first.uuids)


def test_filters_are_passed_through(exporter: Served) -> None:
    gpus = choose(2, exporter.url, exclude=[0, 1], lease=0)
    assert set(gpus.indices) == {2, 3}
    with pytest.raises(NoGpusAvailable):
        choose(1, exporter.url, include="0", exclude="0", lease=0)


def test_filter_names_and_values_reach_the_query_string(exporter: Served) -> None:
    gpu2 = next(g for g in exporter.get_json("/gpus")["gpus"] if g["index"] == 2)
    prefix = gpu2["uuid"][:12]  # a name this host has (one it has not is a 400)
    choose(
        1,
        exporter.url,
        lease="90s",
        wait=2.5,
        owner="me",
        min_free="20GiB",
        max_util=0.5,
        exclude=[0, prefix],
        max_procs=0,
        model="A100",
        sort=None,
    )
    method, path, params = exporter.requests[-1]
    assert (method, path) == ("POST", "/choose")
    assert params == {
        "n": "1",
        "format": "json",
        "lease": "90s",
        "wait": "2.5",
        "owner": "me",
        "min_free": "20GiB",
        "max_util": "0.5",
        "exclude": f"0,{prefix}",
        "max_procs": "0",
        "model": "A100",
    }


def test_wait_holds_the_request_until_gpus_are_released(exporter: Served) -> None:
    held = choose(4, exporter.url)
    timer = threading.Timer(0.2, release, (held,))
    started = time.monotonic()
    timer.start()
    try:
        gpus = choose(4, exporter.url, wait="5s")
    finally:
        timer.join()
    assert 0.15 < time.monotonic() - started < 4
    assert set(gpus.uuids) == set(held.uuids)


# -- renew, release, leases ---------------------------------------------------------------


def test_renew_extends_the_lease(exporter: Served) -> None:
    gpus = choose(1, exporter.url, lease="30s")
    assert gpus.expires_at is not None
    renewed = renew(gpus, "120s")
    assert renewed.id == gpus.lease_id and renewed.gpus == gpus.uuids
    assert renewed.expires_at > gpus.expires_at + 60
    assert [lease.id for lease in client.leases(exporter.url)] == [gpus.lease_id]


def test_unknown_leases_raise_lease_not_found(exporter: Served) -> None:
    gpus = choose(1, exporter.url)
    release(gpus)
    with pytest.raises(LeaseNotFound) as caught:
        release(gpus)
    assert caught.value.status == 404 and str(caught.value)
    with pytest.raises(LeaseNotFound):
        renew(gpus, "60s")
    with pytest.raises(LeaseNotFound):
        renew("no-such-lease/../x", url=exporter.url)


def test_an_expired_lease_frees_its_gpus(exporter: Served) -> None:
    gpus = choose(4, exporter.url, lease="200ms")
    deadline = time.monotonic() + 3
    while gpus.lease_id in exporter.lease_ids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert choose(4, exporter.url, lease=0).uuids
    with pytest.raises(LeaseNotFound):
        renew(gpus)


# -- errors ------------------------------------------------------------------------------


def test_not_enough_gpus_is_no_gpus_available(exporter: Served) -> None:
    with pytest.raises(NoGpusAvailable) as caught:
        choose(99, exporter.url)
    exc = caught.value
    assert isinstance(exc, ServerError) and isinstance(exc, GpuExporterError)
    assert (exc.status, exc.code) == (503, "not_enough_gpus")
    assert "99 requested" in str(exc) and str(exc) == exc.message


def test_unknown_parameter_is_a_server_error_naming_it(exporter: Served) -> None:
    with pytest.raises(ServerError) as caught:
        choose(1, exporter.url, bogus="1")
    exc = caught.value
    assert not isinstance(exc, NoGpusAvailable)
    assert (exc.status, exc.code, exc.param) == (400, "unknown_parameter", "bogus")
    assert "bogus" in exc.message


def test_bad_value_is_a_server_error_naming_the_parameter(exporter: Served) -> None:
    with pytest.raises(ServerError) as caught:
        choose(1, exporter.url, min_free="lots")
    assert (caught.value.status, caught.value.code) == (400, "invalid_parameter")
    assert caught.value.param == "min_free"


@contextlib.contextmanager
def lease_too_long() -> Iterator[str]:
    with served(max_lease_seconds=30) as ex:  # choose() asks for 60 s
        yield ex.url


@contextlib.contextmanager
def nvml_down() -> Iterator[str]:
    with served(four_gpus(faults=[Fault("nvmlInit", "DRIVER_NOT_LOADED")])) as ex:
        yield ex.url


@contextlib.contextmanager
def sampler_stuck() -> Iterator[str]:
    with served(sampling=False, max_age_seconds=0.05) as ex:  # one sample, never another
        time.sleep(0.1)
        yield ex.url


@contextlib.contextmanager
def all_leased() -> Iterator[str]:
    with served() as ex:
        choose(4, ex.url)
        yield ex.url


@pytest.mark.parametrize(
    ("condition", "status", "code", "param", "message", "expected"),
    [
        (lease_too_long, 429, "lease_too_long", "lease", r"lease 60 s is longer", ServerError),
        (nvml_down, 503, "nvml_unavailable", None, r"NVML is not available: ", ServerError),
        (sampler_stuck, 503, "snapshot_stale", None, r"the last sample is .* old", ServerError),
        (all_leased, 503, "not_enough_gpus", None, r"0 of 4 GPUs qualify", NoGpusAvailable),
    ],
)
def test_error_statuses_map_to_exceptions(
    condition: Any,
    status: int,
    code: str,
    param: str | None,
    message: str,
    expected: type[ServerError],
) -> None:
    with condition() as url, pytest.raises(ServerError) as caught:
        choose(1, url)
    assert type(caught.value) is expected
    assert (caught.value.status, caught.value.code, caught.value.param) == (status, code, param)
    assert re.match(message, str(caught.value)) and str(caught.value) == caught.value.message


def test_plain_text_and_odd_error_bodies() -> None:
    exc = error_from_response(503, b"error: 1 of 4 GPUs qualify, 2 requested\n")
    assert type(exc) is ServerError and exc.code is None
    assert exc.message == "1 of 4 GPUs qualify, 2 requested"
    proxy = error_from_response(502, b"<html>Bad Gateway</html>", url="http://h")
    assert type(proxy) is NotAnExporter and proxy.status == 502
    assert proxy.message == (
        "http://h does not look like a gpu-exporter (HTTP 502 Bad Gateway from http://h)"
    )
    assert error_from_response(500, b"").message == "HTTP 500 Internal Server Error"
    assert type(error_from_response(404, b"{}", lease_endpoint=True)) is LeaseNotFound
    assert type(error_from_response(404, b"{}")) is ServerError


def test_nothing_listening_is_server_unreachable(closed_port: int) -> None:
    url = f"http://127.0.0.1:{closed_port}"
    with pytest.raises(ServerUnreachable) as caught:
        choose(1, url)
    assert caught.value.url == url
    assert f"cannot reach gpu-exporter at {url}: connection refused" in str(caught.value)
    assert client.URL_ENV in str(caught.value)


def test_a_server_that_never_answers_times_out() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # the kernel accepts the connection; nobody ever answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(ServerUnreachable, match=r"no answer within 0\.2 s"):
            choose(1, url, timeout=0.2)
    assert time.monotonic() - started < 2


def test_the_url_comes_from_the_argument_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert resolve_url() == "http://localhost:9400"
    monkeypatch.setenv(client.URL_ENV, "http://gpuhost:9401/")
    assert resolve_url() == "http://gpuhost:9401"
    assert resolve_url("other:9400") == "http://other:9400"


def test_bad_arguments_fail_before_any_request() -> None:
    with pytest.raises(ValueError, match="n must be"):
        choose(0, "http://127.0.0.1:1")
    with pytest.raises(ValueError, match="duration"):
        choose(1, "http://127.0.0.1:1", lease=-1)
    with pytest.raises(TypeError, match="format is not a filter"):
        choose(1, "http://127.0.0.1:1", format="uuid")


def test_choice_env_and_device_list() -> None:
    leased = Choice(("GPU-a", "GPU-b"), (3, 1), "l-1", 1.0, "http://h:9400")
    assert leased.cuda_visible_devices == "GPU-a,GPU-b"
    assert leased.env() == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b",
        "GPU_LEASE": "l-1",
    }
    assert "GPU_LEASE" not in Choice(("GPU-a",), (0,), None, None, "http://h:9400").env()


# -- use_gpus ----------------------------------------------------------------------------


def test_use_gpus_sets_and_restores_the_environment_and_releases(
    exporter: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    monkeypatch.setenv(client.URL_ENV, exporter.url)
    block = use_gpus(2, ignore_mask=True)  # test_allocation.py: choosing inside the mask
    with pytest.warns(GpuExporterWarning, match="replacing CUDA_VISIBLE_DEVICES=7 with the"):
        gpus = block.__enter__()
    try:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(gpus.uuids)
        assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert os.environ["GPU_LEASE"] == gpus.lease_token
        assert gpus.lease_id in exporter.lease_ids()
    finally:
        block.__exit__(None, None, None)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7"
    assert "CUDA_DEVICE_ORDER" not in os.environ and "GPU_LEASE" not in os.environ
    assert gpus.lease_id not in exporter.lease_ids()


def test_use_gpus_releases_and_restores_on_an_exception(exporter: Served) -> None:
    held: list[str | None] = []

    def job() -> None:
        with use_gpus(1, exporter.url) as gpus:
            assert os.environ["GPU_LEASE"] == gpus.lease_token
            held.append(gpus.lease_id)
            raise RuntimeError("training diverged")

    with pytest.raises(RuntimeError, match="training diverged"):
        job()
    assert held[0] is not None and held[0] not in exporter.lease_ids()
    assert not any(key in os.environ for key in ENV_KEYS)


def test_use_gpus_renews_the_lease_in_the_background(exporter: Served) -> None:
    session = use_gpus(1, exporter.url, lease="300ms")
    with session as gpus:
        assert session.keeper is not None and session.keeper.running
        assert gpus.expires_at is not None and gpus.lease_id is not None
        started = time.monotonic()
        while time.monotonic() - started < 0.6:  # twice the TTL: only renewals keep it
            time.sleep(0.05)
        lease = lease_of(exporter, gpus.lease_id)
        assert lease is not None, "the lease expired: not renewed"
        assert lease["expires_at"] > gpus.expires_at + 0.2
        assert session.keeper.renewals >= 2
    assert not session.keeper.running
    assert lease_of(exporter, gpus.lease_id) is None
    assert not [t for t in threading.enumerate() if t.name.startswith("gpu-lease-")]


def wait_until_stopped(keeper: LeaseKeeper, seconds: float = 2) -> None:
    deadline = time.monotonic() + seconds
    while keeper.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not keeper.running


def test_keeper_stops_quietly_when_the_server_ends_the_lease_early(
    exporter: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpu_exporter.client")
    gpus = choose(1, exporter.url, lease="30s")
    keeper = LeaseKeeper(gpus)
    keeper.interval_seconds = 0.05  # renew soon, long before the lease could expire
    keeper.start()
    release(gpus)  # as the server does once the job's work shows on the GPU
    wait_until_stopped(keeper)
    assert keeper.ended == "dropped" and not keeper.lost
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert f"lease {gpus.lease_id} ended before it expired" in caplog.text


@pytest.fixture
def restartable() -> Iterator[Served]:
    """An exporter that can stop serving and serve again on the same port."""
    with served(port=free_port()) as ex:
        yield ex


def test_keeper_reports_a_lease_that_expired_for_want_of_renewal(
    restartable: Served, caplog: pytest.LogCaptureFixture
) -> None:
    exporter = restartable
    gpus = choose(1, exporter.url, lease="300ms")
    exporter.stop_serving()  # renewals every 0.1 s fail until the server is back
    with back_after(exporter, failures=4):  # 0.4 s of failed renewals: longer than the TTL
        keeper = LeaseKeeper(gpus).start()
        wait_until_stopped(keeper)
    assert keeper.ended == "expired" and keeper.lost
    assert caplog.text.count("could not renew") == 4
    assert f"lease {gpus.lease_id} expired before it could be renewed" in caplog.text
    assert caplog.records[-1].levelno == logging.ERROR


def test_advisory_use_gpus_runs_no_keeper(exporter: Served) -> None:
    session = use_gpus(1, exporter.url, lease=0)
    with session as gpus:
        assert gpus.lease_id is None and session.keeper is None
        assert "GPU_LEASE" not in os.environ
        assert os.environ["CUDA_VISIBLE_DEVICES"] == gpus.uuids[0]


def test_use_gpus_fails_cleanly_when_no_gpus_qualify(exporter: Served) -> None:
    with pytest.raises(NoGpusAvailable), use_gpus(99, exporter.url):
        pytest.fail("the block must not run")
    assert not any(key in os.environ for key in ENV_KEYS)


def test_use_gpus_warns_when_cuda_is_already_initialised(
    exporter: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", torch)
    with (
        pytest.warns(GpuExporterWarning, match="torch already initialised CUDA"),
        use_gpus(1, exporter.url),
    ):
        pass
    monkeypatch.setitem(
        sys.modules, "torch", SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: False))
    )
    with use_gpus(1, exporter.url):  # imported but not initialised: fine, no warning
        pass


def test_tensorflow_with_a_live_context_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    eager = SimpleNamespace(_context=SimpleNamespace(_context_handle=object()))
    monkeypatch.setitem(sys.modules, "tensorflow.python.eager.context", eager)
    assert client.cuda_initialised_by() == ["tensorflow"]
    eager._context._context_handle = None
    assert client.cuda_initialised_by() == []


# -- no server: the local fallback ----------------------------------------------------------


def simulated(*faults: Fault, gpus: int = 2) -> Nvml:
    sim = SimulatedNvml.of(Scenario.with_gpus(gpus), clock=time.monotonic)
    sim.faults.extend(faults)
    return Nvml(sim, simulated=True)


def test_without_a_server_use_gpus_chooses_locally_with_a_warning(closed_port: int) -> None:
    two = lambda: simulated(gpus=2)  # noqa: E731
    url = f"http://127.0.0.1:{closed_port}"
    with contextlib.ExitStack() as stack:
        with pytest.warns(GpuExporterWarning, match="No lease protects this choice"):
            gpus = stack.enter_context(
                use_gpus(1, url, exclude=[1], max_util=1, max_mem_used=1, open_nvml=two)
            )
        assert gpus.local and gpus.lease_id is None and gpus.indices == (0,)
        assert os.environ["CUDA_VISIBLE_DEVICES"] == gpus.uuids[0]
        assert "GPU_LEASE" not in os.environ
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    with pytest.raises(NoGpusAvailable, match="0 of 2 GPUs qualify"):
        client.choose_locally(1, {"exclude": "0,1"}, open_nvml=two)


def test_choosing_locally_applies_the_servers_filters() -> None:
    def choose_locally(n: int, filters: dict[str, Any]) -> Choice:
        return client.choose_locally(n, filters, open_nvml=lambda: simulated(gpus=4))

    # The simulated loads: 0 busy (1 process), 1 idle, 2 sine, 3 light (1 process).
    assert choose_locally(1, {"max_procs": 0, "model": "a100", "include": [0, 1]}).indices == (1,)
    loaded = {"max_util": 0.99, "max_mem_used": 1}  # off the default 50 %: 0 and 2 are busy
    assert choose_locally(2, {"min_total": "40GiB", "exclude": "1", **loaded}).local
    assert choose_locally(1, {"sort": "pack", "max_mem_used": "100%"}).indices
    with pytest.raises(GpuExporterError, match="sort must be one of"):
        choose_locally(1, {"sort": "fastest"})
    with pytest.raises(GpuExporterError, match="min_free"):
        choose_locally(1, {"min_free": "lots"})


@pytest.mark.parametrize(
    ("nvml", "message"),
    [
        (lambda: simulated(Fault("nvmlInit", "DRIVER_NOT_LOADED")), "no NVIDIA driver"),
        (lambda: simulated(gpus=0), "NVML sees no GPU"),
    ],
)
def test_without_a_server_or_a_gpu_use_gpus_refuses(
    closed_port: int, nvml: Any, message: str
) -> None:
    url = f"http://127.0.0.1:{closed_port}"
    with (
        pytest.raises(GpuExporterError, match=message) as caught,
        use_gpus(1, url, open_nvml=nvml),
    ):
        pytest.fail("the block must not run")
    assert "cannot reach gpu-exporter" in str(caught.value)
    assert not any(key in os.environ for key in ENV_KEYS)


def test_the_local_fallback_can_be_turned_off_and_refuses_idle_for(closed_port: int) -> None:
    url = f"http://127.0.0.1:{closed_port}"
    with (
        pytest.raises(ServerUnreachable),
        use_gpus(1, url, local_fallback=False, open_nvml=simulated),
    ):
        pass
    with (
        pytest.raises(GpuExporterError, match="cannot apply idle_for"),
        use_gpus(1, url, idle_for="5m", open_nvml=simulated),
    ):
        pass


def test_an_exporter_that_answers_too_late_is_no_reason_to_choose_locally() -> None:
    # The kernel accepts the connection and nobody answers: the exporter may be alive, busy,
    # and holding leases on this host's cards (perhaps one for this very claim).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with (
            pytest.raises(GpuExporterError, match="not choosing from this host's NVML") as caught,
            use_gpus(1, url, timeout=0.3, open_nvml=simulated),
        ):
            pytest.fail("the block must not run")
    assert not isinstance(caught.value, NoGpusAvailable)
    assert not any(key in os.environ for key in ENV_KEYS)


@pytest.mark.parametrize("module", [transport, hostapi])
def test_doctests(module: ModuleType) -> None:
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_import_stays_cheap_and_use_gpus_is_exported_lazily() -> None:
    code = (
        "import sys, gpu_exporter\n"
        "assert 'gpu_exporter.client' not in sys.modules\n"
        "assert 'urllib.request' not in sys.modules\n"
        "from gpu_exporter import use_gpus, __version__\n"
        "import gpu_exporter.client as c\n"
        "assert use_gpus is c.use_gpus and __version__\n"
        "try:\n"
        "    gpu_exporter.nope\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    assert "has no attribute 'nope'" in out


def test_the_client_loads_nothing_of_the_server() -> None:
    """Jobs import the client before (and without) any framework: no Flask, no NVML."""
    code = (
        "import sys\n"
        "import gpu_exporter.client, gpu_exporter.client.commands, gpu_exporter.client.run\n"
        "server = ('flask', 'werkzeug', 'prometheus_client', 'pynvml')\n"
        "ours = ('gpu_exporter.nvml', 'gpu_exporter.collect', 'gpu_exporter.web')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in server or m.startswith(ours)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    assert out == "[]\n"


def test_keeper_logs_and_retries_when_the_server_is_briefly_away(
    restartable: Served, caplog: pytest.LogCaptureFixture
) -> None:
    exporter = restartable
    gpus = choose(1, exporter.url, lease="5s")
    exporter.stop_serving()
    with back_after(exporter, failures=1):
        keeper = LeaseKeeper(gpus)
        keeper.interval_seconds = 0.05  # quick turns; the lease itself cannot run out meanwhile
        keeper.start()
        try:
            deadline = time.monotonic() + 2
            while keeper.renewals < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            keeper.stop()
    assert keeper.renewals >= 2 and not keeper.lost
    assert caplog.record_tuples[0][1] == logging.WARNING
    assert "could not renew" in caplog.text and "connection refused" in caplog.text
