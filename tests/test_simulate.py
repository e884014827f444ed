"""The simulator itself: scenarios, faults, determinism."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from conftest import FakeClock, build_stack
from gpu_exporter import nvml
from gpu_exporter.simulate import MODELS, Fault, Scenario, SimulatedNvml

LAB = (
    Path(__file__).resolve().parent.parent / "gpu_exporter" / "simulate" / "scenarios" / "lab.toml"
)


def test_bundled_lab_scenario_runs_through_the_real_path() -> None:
    s = build_stack(
        lambda clock: SimulatedNvml.of(Scenario.from_argument(str(LAB)), clock=clock.monotonic)
    )
    s.sample()
    gpus = s.cache.get().gpus
    assert len(gpus) == 8 and all(g.up for g in gpus)
    assert gpus[6].name == "NVIDIA GeForce GTX 1080"
    assert gpus[6].energy_joules is None  # unsupported on that card
    assert gpus[5].compute_processes == 0 and (gpus[5].memory_used_bytes or 0) > 0  # hidden owner
    s.clock.advance(301)
    s.sample()
    assert not s.cache.get().gpus[7].up  # falls off the bus at 300 s
    assert s.client.get("/choose?n=8").status_code == 503


def test_scenario_errors_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    clock = FakeClock()
    bad.write_text('[[gpus]]\nmodel = "Voodoo 2"\n')
    with pytest.raises(ValueError, match="unknown GPU model 'Voodoo 2'"):
        SimulatedNvml.of(Scenario.from_argument(str(bad)), clock=clock.monotonic)
    bad.write_text('[[gpus]]\nload = "party"\n')
    with pytest.raises(ValueError, match="unknown load 'party'"):
        SimulatedNvml.of(Scenario.from_argument(str(bad)), clock=clock.monotonic)
    bad.write_text('[[faults]]\nerror = "OOPS"\n')
    with pytest.raises(ValueError, match="unknown NVML error 'OOPS'"):
        SimulatedNvml.of(Scenario.from_argument(str(bad)), clock=clock.monotonic)
    bad.write_text("gpus = [")
    with pytest.raises(ValueError, match=r"bad\.toml"):
        SimulatedNvml.of(Scenario.from_argument(str(bad)), clock=clock.monotonic)


@pytest.mark.parametrize("name", ["lab", "lab.toml"])
def test_bundled_scenarios_by_name_from_any_directory(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wheel install has no checkout to point a path at: the name alone must do."""
    monkeypatch.chdir(tmp_path)  # no gpu_exporter/ here: the name is not a relative path
    by_name = SimulatedNvml.of(Scenario.from_argument(name), clock=FakeClock().monotonic)
    by_path = SimulatedNvml.of(Scenario.from_argument(str(LAB)), clock=FakeClock().monotonic)
    assert [g.model for g in by_name.gpus] == [g.model for g in by_path.gpus]


def test_unknown_scenario_name_lists_the_bundled_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"bundled scenario \(a100, fleet, lab\)"):
        SimulatedNvml.of(Scenario.from_argument("labb"), clock=FakeClock().monotonic)


def test_serve_help_lists_the_bundled_scenarios(capsys: pytest.CaptureFixture[str]) -> None:
    from gpu_exporter.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "bundled scenario by name (a100, fleet, lab)" in help_text


def test_load_changes_over_time_and_is_deterministic() -> None:
    clock = FakeClock()
    a = SimulatedNvml.of(Scenario.with_gpus(3), clock=clock.monotonic)
    b = SimulatedNvml.of(Scenario.with_gpus(3), clock=clock.monotonic)
    seen = set()
    for _ in range(12):
        assert a.state(2) == b.state(2)
        seen.add(a.state(2).utilization_gpu)
        clock.advance(10)
    assert len(seen) > 5  # the "sine" GPU moves


def test_memory_adds_up_for_every_model() -> None:
    clock = FakeClock()
    for name in MODELS:
        sim = SimulatedNvml.of(
            Scenario.from_table({"gpus": [{"model": name, "load": "busy"}]}), clock=clock.monotonic
        )
        st = sim.state(0)
        assert st.memory_used + st.memory_free + st.memory_reserved == st.memory_total
        assert 0 <= st.utilization_gpu <= 100


def test_faults_are_windows_in_time() -> None:
    f = Fault("nvmlDeviceGetPowerUsage", "UNKNOWN", gpu=1, after_seconds=10, for_seconds=5)
    assert [f.active(t) for t in (9.9, 10, 14.9, 15)] == [False, True, True, False]
    assert f.matches("nvmlDeviceGetPowerUsage", 1) and not f.matches("nvmlDeviceGetPowerUsage", 0)
    assert Fault("*", "UNKNOWN").matches("nvmlInit", None)
    assert Fault("x", "UNKNOWN").for_seconds == math.inf


def test_uninitialised_calls_fail_like_the_real_library() -> None:
    sim = SimulatedNvml.of(Scenario.with_gpus(1), clock=FakeClock().monotonic)
    with pytest.raises(Exception, match="Uninitialized") as info:
        sim.nvmlDeviceGetCount()
    assert info.value.value == nvml.error_code("UNINITIALIZED")  # type: ignore[attr-defined]


def test_clock_constants_match_pynvml() -> None:
    assert nvml.CLOCK_TYPES == {"graphics": 0, "sm": 1, "memory": 2, "video": 3}
