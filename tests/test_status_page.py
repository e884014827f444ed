"""The status page at ``/``: GPUs with bars, lease holders, the recommendation, links.

Rendered through the Flask client for the content, and loaded in headless Chromium from a
real ``gpu-exporter serve`` process to see that a browser shows the GPUs; the screenshot is
written to pytest's tmp dir and, if set, to ``$TEST_ARTIFACTS_DIR``.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from test_architecture import imports_of

from conftest import Stack, build_stack, sim_of
from gpu_exporter.simulate import Fault, Load, SimGpu
from harness import exporter, get

FLEET = Path(__file__).resolve().parent.parent / "gpu_exporter/simulate/scenarios/fleet.toml"


def test_status_view_is_pure() -> None:
    imported = {i.target for i in imports_of("gpu_exporter.web.status")}
    assert not imported & {"flask", "pynvml", "gpu_exporter.nvml"}


def test_page_shows_every_gpu_with_memory_and_utilization_bars(stack: Stack) -> None:
    page = stack.client.get("/")
    assert page.status_code == 200
    text = page.text
    assert text.count('<tr class="gpu"') == len(stack.sim.gpus) == 4
    for i, gpu in enumerate(stack.sim.gpus):
        state = stack.sim.state(i)
        assert f'data-uuid="{gpu.uuid}"' in text
        used_pct = round(100 * state.memory_used / state.memory_total)
        assert f'aria-valuenow="{used_pct}"' in text
        assert f"<b>{state.utilization_gpu} %</b>" in text
    assert 'http-equiv="refresh" content="5"' in text  # refreshes itself


def test_page_uses_no_external_assets(stack: Stack) -> None:
    text = stack.client.get("/").text
    for attr in re.findall(r'(?:src|href)="([^"]*)"', text):
        assert not re.match(r"^(?:[a-z]+:)?//", attr), attr
    assert "<script" not in text and "@import" not in text


def test_page_recommends_what_choose_would_without_claiming(stack: Stack) -> None:
    advice = stack.client.get("/choose?n=1&format=index&lease=0").text.strip()
    text = stack.client.get("/").text
    assert re.search(rf"would give\s*<strong>GPU {advice}</strong>", text)
    assert stack.leases.active() == ()  # looking did not claim anything
    # The advice link on the page never claims either.
    assert 'href="choose?n=1&amp;format=json&amp;lease=0"' in text
    for link in ("metrics", "openapi.json", "leases", "gpus", "healthz", "readyz"):
        assert f'href="{link}"' in text


def test_page_shows_lease_holders_and_skips_leased_gpus(stack: Stack) -> None:
    first = stack.client.get("/choose?n=1&format=index&lease=5m&owner=<alice>")
    assert first.status_code == 200
    held = int(first.text)
    text = stack.client.get("/").text
    assert "&lt;alice&gt;, 300 s left" in text  # escaped, with the time left
    assert "<alice>" not in text
    row = re.search(
        rf'<tr class="gpu" data-uuid="{stack.sim.gpus[held].uuid}">.*?</tr>', text, re.S
    )
    assert row and "&lt;alice&gt;" in row.group(0)
    assert html.unescape(re.findall(r'<tr class="lease">.*?</tr>', text, re.S)[0]).count("<alice>")
    nxt = stack.client.get("/choose?n=1&format=index&lease=0").text.strip()
    assert int(nxt) != held
    assert re.search(rf"would give\s*<strong>GPU {nxt}</strong>", text)


def test_page_says_why_no_gpu_qualifies() -> None:
    s = build_stack(
        sim_of(
            SimGpu(0, "NVIDIA A100-SXM4-80GB", Load("idle")),
            faults=[Fault("*", "GPU_IS_LOST", gpu=0)],
        )
    )
    s.sample()
    text = s.client.get("/").text
    assert "would find no GPU now" in text
    assert "gpu 0: " in text and "down" in text
    assert '<span class="down">down: ' in text


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(
        "chromium not installed (Debian package 'chromium'; scripts/test.sh installs it as root)"
    )


@pytest.mark.slow
def test_headless_chromium_shows_the_gpus(tmp_path: Path) -> None:
    browser = _chromium()
    profile = tempfile.mkdtemp(prefix="chromium-")
    flags = [
        "--headless",
        "--no-sandbox",  # tests may run as root, where the sandbox refuses to start
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--window-size=1400,1100",
    ]
    screenshot = tmp_path / "status-page.png"
    try:
        with exporter("--simulate", str(FLEET), "--interval", "0.5") as exp:
            status, _ = get(exp.base + "/choose?n=1&lease=10m&owner=chromium-test&exclude=7")
            assert status == 200
            deadline = time.monotonic() + 20  # GPU 7 falls off the bus 2 s after start
            while all(g["up"] for g in json.loads(get(exp.base + "/gpus")[1])["gpus"]):
                assert time.monotonic() < deadline, "GPU 7 never went down"
                time.sleep(0.2)
            dom = subprocess.run(
                [browser, *flags, "--dump-dom", exp.base + "/"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            shot = subprocess.run(
                [browser, *flags, f"--screenshot={screenshot}", exp.base + "/"],
                capture_output=True,
                text=True,
                timeout=120,
            )
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = dom.stdout
    # The DOM the browser built: eight GPU rows, each with its UUID, the lost one marked.
    rows = re.findall(r'<tr class="gpu" data-uuid="(GPU-[^"]+)">(.*?)</tr>', page, re.S)
    assert len(rows) == 8
    assert "NVIDIA GeForce RTX 4090" in page
    assert "GPU is lost" in rows[7][1]
    assert sum("chromium-test" in cells for _, cells in rows) == 1
    assert re.search(r'id="recommendation"', page)
    assert shot.returncode == 0 and screenshot.exists(), shot.stderr[-2000:]
    data = screenshot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a real, non-blank page
    artifacts = os.environ.get("TEST_ARTIFACTS_DIR")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(screenshot, Path(artifacts) / screenshot.name)
