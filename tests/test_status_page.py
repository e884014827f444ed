"""The status page at ``/``: GPUs with bars, lease holders, the recommendation, links.

Rendered through the Flask client for the content, and loaded in headless Chromium from a
real ``gpu-exporter serve`` process to see that a browser shows the GPUs; the screenshot is
written to pytest's tmp dir and, if set, to ``$TEST_ARTIFACTS_DIR``.
"""

from __future__ import annotations

import html
import http.server
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import Stack, build_stack, sim_of
from gpu_exporter.simulate import Fault, Load, Scenario, SimGpu, SimulatedNvml
from harness import exporter, get
from served import served

FLEET = Path(__file__).resolve().parent.parent / "gpu_exporter/simulate/scenarios/fleet.toml"
LAB = FLEET.with_name("lab.toml")


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
    # Without JavaScript it reloads itself; with it, the values update in place from /gpus.
    assert '<noscript><meta http-equiv="refresh" content="5"></noscript>' in text
    assert 'fetch("gpus"' in text


def test_page_uses_no_external_assets(stack: Stack) -> None:
    text = stack.client.get("/").text
    for attr in re.findall(r'(?:src|href)="([^"]*)"', text):
        assert not re.match(r"^(?:[a-z]+:)?//", attr), attr
    assert "<script src" not in text and "@import" not in text  # the one script is inline


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


def test_one_gpu_is_counted_in_the_singular() -> None:
    s = build_stack(sim_of(SimGpu(0, "NVIDIA A100-SXM4-80GB", Load("idle"))))
    s.sample()
    text = s.client.get("/").text
    assert "<title>gpu-exporter · 1 GPU</title>" in text
    assert '<p class="meta">1 GPU · driver' in text


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
            # a memory lease (issue 16): its card shows its committed memory as a bar
            status, _ = get(exp.base + "/choose?mem=8GiB&lease=10m&owner=chromium-mem&exclude=7")
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
    shared = [cells for _, cells in rows if "chromium-mem" in cells]
    assert len(shared) == 1 and 'class="committed"' in shared[0]
    assert re.search(r'role="meter".*?GiB of [0-9.]+ GiB committed', shared[0], re.S)
    assert re.search(r'id="recommendation"', page)
    assert shot.returncode == 0 and screenshot.exists(), shot.stderr[-2000:]
    data = screenshot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a real, non-blank page
    artifacts = os.environ.get("TEST_ARTIFACTS_DIR")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(screenshot, Path(artifacts) / screenshot.name)


def test_values_a_card_cannot_report_are_na_with_the_reason() -> None:
    s = build_stack(
        sim_of(
            SimGpu(0, "NVIDIA GeForce GTX 1080", Load("idle")),  # lists no processes
            SimGpu(
                1, "NVIDIA A100-SXM4-80GB", Load("idle"), frozenset({"nvmlDeviceGetTemperature"})
            ),
        )
    )
    s.sample()
    text = s.client.get("/").text
    rows = re.findall(r'<tr class="gpu" data-uuid="[^"]+">(.*?)</tr>', text, re.S)
    na = '<span class="na" title="this card cannot report {}">n/a</span>'
    assert na.format("its processes (NVML: not supported)") in rows[0]
    assert na.format("temperature (NVML: not supported)") in rows[1]
    # An A100 has no GPM: SM activity (the column beside utilization) says so.
    assert na.format("SM activity (GPM, Hopper and later) (NVML: not supported)") in rows[1]
    assert rows[1].count('class="na"') == 2  # the rest is there


def test_sm_activity_is_beside_utilization_where_the_card_has_gpm() -> None:
    s = build_stack(
        sim_of(SimGpu(0, "NVIDIA H100 80GB HBM3", Load("light"))), gpm_interval_seconds=5.0
    )
    s.sample()
    rows = re.findall(r'<tr class="gpu" data-uuid="[^"]+">(.*?)</tr>', s.client.get("/").text, re.S)
    assert "not measured over a whole --gpm-interval yet" in rows[0]  # one sample so far
    s.clock.advance(5)
    s.sample()
    text = s.client.get("/").text
    assert "<th>Utilization</th><th title=" in text and ">SM active</th>" in text
    row = re.findall(r'<tr class="gpu" data-uuid="[^"]+">(.*?)</tr>', text, re.S)[0]
    cells = re.findall(r'data-label="([^"]+)">(.*?)</td>', row, re.S)
    labels = [label for label, _ in cells]
    assert labels.index("SM active") == labels.index("Utilization") + 1
    by = dict(cells)
    assert "<b>12 %</b>" in by["Utilization"] and "<b>1 %</b>" in by["SM active"]


def test_mig_devices_are_grouped_under_their_card() -> None:
    s = build_stack(
        sim_of(
            SimGpu(0, "NVIDIA A100-SXM4-80GB", Load("idle")),
            SimGpu(1, "NVIDIA A100-SXM4-80GB", Load("idle"), mig=("3g.40gb", "1g.10gb")),
        )
    )
    s.sample()
    text = s.client.get("/").text
    cards = re.findall(r'<tbody data-card="([^"]+)">(.*?)</tbody>', text, re.S)
    assert [uuid for uuid, _ in cards] == [g.uuid for g in s.sim.gpus]
    assert "MIG" not in cards[0][1]
    migs = re.findall(
        r'<tr class="mig" data-uuid="(MIG-[^"]+)" data-parent="([^"]+)">', cards[1][1]
    )
    assert len(migs) == 2 and {parent for _, parent in migs} == {s.sim.gpus[1].uuid}
    assert "MIG 3g.40gb" in cards[1][1] and "MIG 1g.10gb" in cards[1][1]
    # n/a where NVML has nothing per MIG device, saying why.
    assert "this MIG device cannot report utilization" in cards[1][1]
    assert "NVML reports temperature for the whole card, not per MIG device" in cards[1][1]


PROBE = """<!doctype html><meta charset="utf-8">
<style>html,body{margin:0}iframe{border:0;height:800px;display:block}</style>
<iframe id="f"></iframe><pre id="out">pending</pre>
<script>
// Headless Chromium's window is at least 500 px wide: the width under test is the iframe's.
var frame = document.getElementById("f");
frame.style.width = location.hash.slice(1) + "px";
frame.src = "/";
frame.onload = function () {
  var w = this.contentWindow, d = this.contentDocument, root = d.documentElement;
  var migs = d.querySelectorAll("tbody[data-card] tr.mig"), grouped = 0;
  for (var i = 0; i < migs.length; i++)
    if (migs[i].parentNode.getAttribute("data-card") === migs[i].getAttribute("data-parent")) grouped++;
  document.getElementById("out").textContent = JSON.stringify({
    scrollWidth: root.scrollWidth, innerWidth: w.innerWidth,
    dark: w.matchMedia("(prefers-color-scheme: dark)").matches,
    background: w.getComputedStyle(d.body).backgroundColor,
    cards: d.querySelectorAll("tbody[data-card]").length, migs: migs.length, grouped: grouped,
    na: d.querySelectorAll(".na[title]").length
  });
  // Spoil one value; the page's script must put it back from /gpus, without a reload.
  var temp = d.querySelector('tr.gpu td[data-label="Temp."]');
  temp.textContent = "stale";
  w.notReloaded = true;
  setTimeout(function () {
    var r = JSON.parse(document.getElementById("out").textContent);
    r.updated = temp.isConnected && temp.textContent !== "stale";
    r.reloaded = !w.notReloaded;
    document.getElementById("out").textContent = JSON.stringify(r);
  }, 6500);
};
</script>"""


class _Probe(http.server.BaseHTTPRequestHandler):
    """The probe page, and everything else fetched from the exporter: one origin, so the
    probe can measure the status page inside its iframe."""

    upstream = ""

    def do_GET(self) -> None:
        if self.path == "/probe.html":
            body, ctype = PROBE.encode(), "text/html; charset=utf-8"
        else:
            try:
                with urllib.request.urlopen(self.upstream + self.path, timeout=10) as resp:
                    body, ctype = resp.read(), resp.headers["Content-Type"]
            except urllib.error.HTTPError as err:  # /favicon.ico
                self.send_error(err.code)
                return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.slow
def test_phone_widths_and_dark_mode_in_headless_chromium() -> None:
    """No sideways scrolling at 360 and 420 px, MIG devices inside their card, the dark
    palette when the system asks for it, and values updated in place without a reload."""
    browser = _chromium()
    sim = SimulatedNvml.of(Scenario.from_argument(str(LAB)), clock=time.monotonic)
    with served(sim) as ex:
        handler = type("Probe", (_Probe,), {"upstream": ex.url})
        proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=proxy.serve_forever, daemon=True)
        thread.start()
        try:
            url = f"http://127.0.0.1:{proxy.server_address[1]}/probe.html"
            results = {
                (width, dark): _measure(browser, url, width, dark)
                for width, dark in ((360, False), (420, False), (420, True), (1400, True))
            }
        finally:
            proxy.shutdown()
            proxy.server_close()
    for (width, dark), r in results.items():
        assert r["innerWidth"] == width, r
        assert r["scrollWidth"] <= r["innerWidth"], (width, r)  # no horizontal page scroll
        assert r["cards"] == 8 and r["migs"] == 4 and r["grouped"] == 4, r
        assert r["na"] > 0, r  # the consumer card's values, with tooltips
        assert r["dark"] == dark, r
        assert (r["background"] == "rgb(18, 18, 18)") == dark, r
        assert r["updated"] and not r["reloaded"], r  # values updated in place from /gpus


def _measure(browser: str, url: str, width: int, dark: bool) -> dict[str, object]:
    profile = tempfile.mkdtemp(prefix="chromium-")
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--window-size={max(width, 500)},900",
        "--virtual-time-budget=10000",  # past the page's 5 s update
    ]
    if dark:
        flags.append("--force-dark-mode")  # prefers-color-scheme: dark
    try:
        dom = subprocess.run(
            [browser, *flags, "--dump-dom", f"{url}#{width}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert dom.returncode == 0, dom.stderr[-2000:]
    found = re.search(r'<pre id="out">(.*?)</pre>', dom.stdout, re.S)
    assert found and found.group(1) != "pending", dom.stdout[-2000:]
    result: dict[str, object] = json.loads(html.unescape(found.group(1)))
    return result
