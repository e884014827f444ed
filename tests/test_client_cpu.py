"""use_gpus(on_unavailable="cpu") and the warning about near misses of
CUDA_VISIBLE_DEVICES, against the real app on a loopback socket (tests/served.py)."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator

import pytest

from gpu_exporter import client
from gpu_exporter.client import GpuExporterWarning, NoGpusAvailable, ServerError, use_gpus
from gpu_exporter.client.envcheck import near_misses
from harness import free_port
from served import Served, served

ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "GPU_LEASE")


@pytest.fixture(scope="module")
def exporter() -> Iterator[Served]:
    with served() as ex:
        yield ex


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in (*ENV_KEYS, client.URL_ENV):
        monkeypatch.delenv(key, raising=False)
    for name, _ in near_misses():
        monkeypatch.delenv(name)


def test_default_stays_a_clear_error(exporter: Served) -> None:
    with pytest.raises(NoGpusAvailable), use_gpus(99, exporter.url):
        pytest.fail("the block must not run")


def test_cpu_fallback_hides_every_gpu_and_says_so(
    exporter: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpu_exporter.client")
    session = use_gpus(99, exporter.url, on_unavailable="cpu")
    with pytest.warns(GpuExporterWarning, match="no GPU available .*running on the CPU"):
        gpus = session.__enter__()
    try:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
        assert "GPU_LEASE" not in os.environ
        assert gpus.uuids == () and gpus.lease_id is None
    finally:
        session.__exit__(None, None, None)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # put back as it was
    assert "running on the CPU" in caplog.text


def test_cpu_fallback_without_any_server_or_driver() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    session = use_gpus(1, url, local_fallback=False, on_unavailable="cpu")
    with pytest.warns(GpuExporterWarning, match="running on the CPU"):
        gpus = session.__enter__()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and gpus.uuids == ()
    session.__exit__(None, None, None)


def test_cpu_fallback_does_not_hide_a_bad_request(exporter: Served) -> None:
    with (
        pytest.raises(ServerError, match="unknown parameter"),
        use_gpus(1, exporter.url, on_unavailable="cpu", colour="red"),
    ):
        pytest.fail("the block must not run")
    with pytest.raises(ValueError, match="on_unavailable"):
        use_gpus(1, exporter.url, on_unavailable="gpu")  # type: ignore[arg-type]


def test_gpus_are_used_when_there_are_some(exporter: Served) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with use_gpus(1, exporter.url, on_unavailable="cpu") as gpus:
            assert len(gpus.uuids) == 1
            assert os.environ["CUDA_VISIBLE_DEVICES"] == gpus.uuids[0]


@pytest.mark.parametrize(
    "typo",
    ["CUDA_VISIBLE_DIVICES", "CUDA_VISIBLE_DEVICE", "cuda_visible_devices", "CUDA_DEVICE_ORDR"],
)
def test_near_misses_of_the_cuda_variables_are_warned_about(
    exporter: Served, monkeypatch: pytest.MonkeyPatch, typo: str
) -> None:
    monkeypatch.setenv(typo, "1")
    with (
        pytest.warns(GpuExporterWarning, match=f"CUDA ignores .*{typo} \\(did you mean CUDA_"),
        use_gpus(1, exporter.url),
    ):
        pass


def test_other_vendors_variables_are_not_near_misses() -> None:
    env = {
        "HIP_VISIBLE_DEVICES": "0",
        "ROCR_VISIBLE_DEVICES": "0",
        "NVIDIA_VISIBLE_DEVICES": "all",
        "CUDA_VISIBLE_DEVICES": "0",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_CACHE_PATH": "/tmp",
    }
    assert near_misses(env) == []
