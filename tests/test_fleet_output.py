"""Across hosts on the command line: each exporter named so that it can be told apart, and a
refusal that says what each host had.

Two real exporters (tests/served.py) on 127.0.0.1, as two exporters on one machine
(``--hosts a:9400,a:9401``) would be: the same host name, different ports.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpu_exporter.cli import main
from gpu_exporter.client import Choice
from gpu_exporter.fleet.placing import ClusterChoice
from served import Served, served

EVERY_GPU = ["--max-util", "100%", "--max-mem-util", "100%"]


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Served, Served]]:
    with served() as a, served() as b:
        yield a, b


def hosts_flag(pair: tuple[Served, Served]) -> str:
    return ",".join(ex.url.removeprefix("http://") for ex in pair)


def test_two_exporters_on_one_host_are_named_with_their_ports(
    pair: tuple[Served, Served], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["choose", "--hosts", hosts_flag(pair), "--spread", "-n", "6", "--lease", "0"]
    assert main([*argv, *EVERY_GPU]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in lines) == sorted(
        f"127.0.0.1:{ex.port}" for ex in pair
    )
    assert sum(len(line.split()[1].split(",")) for line in lines) == 6


def test_spread_refusal_says_what_each_host_had(
    pair: tuple[Served, Served], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["choose", "--hosts", hosts_flag(pair), "--spread", "-n", "16", "--lease", "0"]
    assert main([*argv, "--max-util", "40%"]) == 3
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: no 16 GPUs qualify in the fleet (2 hosts; ")
    for ex in pair:  # four_gpus(): GPU 2 is 50 % busy
        assert f"{ex.url}: 3 of 4 GPUs qualify (gpu 2: " in line
    assert all(ex.leases() == [] for ex in pair)  # what was claimed on the way is given back


def test_the_port_is_shown_only_where_it_is_not_the_default() -> None:
    a = Choice(("GPU-a",), (0,), None, None, "http://a:9400", host="a")
    b = Choice(("GPU-b",), (1,), None, None, "http://b:9401", host="b")
    assert ClusterChoice((a, b), "hosts", spread=True).text("uuid") == "a GPU-a\nb:9401 GPU-b\n"
    assert ClusterChoice((b,), "hosts").text("list") == "b:9401 GPU-b\n"
    assert ClusterChoice((b,), "hosts").placements[0].env()["GPU_HOST"] == "b"  # ssh "$GPU_HOST"
