"""The README quickstart's console session, replayed: every ``$ curl`` line it shows is
asked of `--simulate 4` (the same wiring, sampled once) and must print what the README says.

Only ``curl -s 'localhost:9400…'`` lines, optionally piped to ``grep '^prefix'``, are
understood; a ``...`` line in the README stands for "more lines follow" and ends the
comparison for that command.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from conftest import build_stack
from gpu_exporter.simulate import Scenario, SimulatedNvml

README = Path(__file__).resolve().parent.parent / "README.md"


def _session() -> list[tuple[str, list[str]]]:
    """(command, expected output lines) for each ``$`` line of the quickstart block."""
    text = README.read_text()
    start = text.index("## Quickstart")
    block = re.search(r"```console\n(.*?)```", text[start:], re.DOTALL)
    assert block, "the quickstart has no console block"
    steps: list[tuple[str, list[str]]] = []
    for line in block.group(1).splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            steps[-1][1].append(line)
    return steps


def _run(command: str, get: object) -> list[str]:
    stages = [shlex.split(part, comments=True) for part in command.split("|")]
    curl = stages[0]
    assert curl[:2] == ["curl", "-s"], command
    url = curl[2]
    assert url.startswith("localhost:9400/"), command
    lines = get(url.removeprefix("localhost:9400"))  # type: ignore[operator]
    for stage in stages[1:]:
        assert stage[0] == "grep" and stage[1].startswith("^"), command
        lines = [line for line in lines if line.startswith(stage[1][1:])]
    return list(lines)


def test_quickstart_prints_what_the_readme_shows() -> None:
    stack = build_stack(
        lambda clock: SimulatedNvml.of(Scenario.with_gpus(4), clock=clock.monotonic)
    )
    stack.sample()
    client = stack.client

    def get(path: str) -> list[str]:
        return client.get(path).get_data(as_text=True).splitlines()

    steps = _session()
    assert len(steps) >= 3
    for command, expected in steps:
        actual = _run(command, get)
        if expected and expected[-1] == "...":
            expected = expected[:-1]
            actual = actual[: len(expected)]
        # A line ending in "…" shows only the start of a long one.
        shown = [
            a[: len(e) - 1] + "…" if e.endswith("…") else a
            for a, e in zip(actual, expected, strict=False)
        ]
        assert shown == expected and len(actual) == len(expected), command
