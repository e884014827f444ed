"""The job-script idioms the docs teach really fail loudly when there is no GPU.

``export CUDA_VISIBLE_DEVICES=$(curl …)`` and ``eval "$(curl …)" || exit 1`` both exit 0
when curl fails (``export`` and ``eval ""`` succeed), and the job then runs with every GPU or
none visible. The README's lines are run here, as written, by bash against a real exporter
whose GPUs are all taken; and every document is checked for the two broken shapes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.served import Served, served

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
JOB = "echo RAN-THE-JOB"
# A captured /choose answer used without checking curl's status first.
BROKEN = re.compile(r"export\s+\w+=\"?\$\(|eval\s+\"\$\((curl|gpu-exporter)")

pytestmark = pytest.mark.skipif(
    shutil.which("curl") is None or shutil.which("bash") is None,
    reason="needs curl and bash (apt-get install curl bash)",
)


def documents() -> Iterator[Path]:
    yield README
    yield from (ROOT / "docs").glob("*.md")
    yield from (p for p in (ROOT / "deploy").rglob("*") if p.is_file())
    yield from (ROOT / "gpu_exporter").rglob("*.html")
    yield from (ROOT / "gpu_exporter" / "client").glob("*.py")


def test_no_document_teaches_an_idiom_that_hides_a_failed_choose() -> None:
    broken = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in documents()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if "choose" in line and BROKEN.search(line)
    ]
    assert broken == []


UNQUOTED_QUERY = re.compile(r"curl\s[^'\"]*?\s[\w.:/-]+\?\w")  # zsh: "no matches found"


def test_every_curl_url_with_a_query_is_quoted() -> None:
    unquoted = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in documents()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if UNQUOTED_QUERY.search(line)
    ]
    assert unquoted == []


def readme_snippet(first_line_start: str, lines: int) -> str:
    """``lines`` lines of the README from the one starting with ``first_line_start``."""
    text = README.read_text().splitlines()
    starts = [i for i, line in enumerate(text) if line.strip().startswith(first_line_start)]
    assert starts, f"the README no longer has a line starting {first_line_start!r}"
    return "\n".join(line.strip() for line in text[starts[0] : starts[0] + lines])


IDIOMS = {
    "headline": ("CUDA_VISIBLE_DEVICES=$(curl", 2),
    "env": ("env=$(curl -fsS 'gpuhost:9400/choose?n=1&format=env')", 2),
    "fail-with-body": ("gpus=$(curl -sS --fail-with-body", 2),
}


def run_script(snippet: str, exporter: Served) -> subprocess.CompletedProcess[str]:
    host = exporter.url.removeprefix("http://")
    script = snippet.replace("gpuhost:9400", host) + f'\n{JOB} "$CUDA_VISIBLE_DEVICES"\n'
    return subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=30, check=False
    )


@pytest.fixture(scope="module")
def exporter() -> Iterator[Served]:
    with served() as ex:
        yield ex


@pytest.mark.parametrize("idiom", sorted(IDIOMS))
def test_the_readme_idiom_stops_the_job_when_no_gpu_is_free(idiom: str, exporter: Served) -> None:
    snippet = readme_snippet(*IDIOMS[idiom])
    leases = exporter.daemon.leases
    try:
        exporter.get_json("/choose?n=4&format=json&lease=1m&max_util=100%&max_mem_used=100%")
        refused = run_script(snippet, exporter)
        assert refused.returncode != 0
        assert "RAN-THE-JOB" not in refused.stdout
        if idiom == "fail-with-body":  # the reason reaches the job's log
            assert "no GPU: error: 0 of 4 GPUs qualify" in refused.stderr
        for lease in leases.active():
            leases.release(lease.id)
        granted = run_script(snippet, exporter)
        assert granted.returncode == 0, granted.stderr
        assert re.fullmatch(r"RAN-THE-JOB GPU-[0-9a-f-]+\n", granted.stdout)
    finally:
        for lease in leases.active():
            leases.release(lease.id)
