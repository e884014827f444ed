"""60 seconds of mixed load on a real server: zero errors, bounded memory (bench/load.py)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import load

pytestmark = pytest.mark.slow


def test_sixty_seconds_of_scrapes_and_choose_calls() -> None:
    if shutil.which("wrk") is None:
        pytest.skip("wrk not installed (Debian package 'wrk'; scripts/test.sh installs it as root)")
    result = load.run(seconds=60, min_requests=100_000, gpus=8)
    assert result.requests >= 100_000
    assert result.non_200 == 0
    assert result.socket_errors == 0
    assert result.rss_growth_bytes < 5 * 1024 * 1024, result
