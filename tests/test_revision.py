"""gpu_exporter_build_info's ``revision`` label: where it comes from, read as files once."""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import build_stack
from gpu_exporter.revision import UNKNOWN, revision
from gpu_exporter.simulate import Scenario, SimulatedNvml

SHA = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"
ROOT = Path(__file__).resolve().parent.parent


def _package(tmp_path: Path) -> Path:
    package = tmp_path / "gpu_exporter"
    package.mkdir()
    return package


def test_stamped_at_build_time_wins(tmp_path: Path) -> None:
    package = _package(tmp_path)
    (package / "_revision.txt").write_text(SHA + "\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text(OTHER + "\n")
    assert revision(package) == SHA[:12]


def test_a_branch_of_the_checkout_loose_or_packed(tmp_path: Path) -> None:
    package = _package(tmp_path)
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "packed-refs").write_text(f"# pack-refs with: peeled\n{SHA} refs/heads/main\n")
    assert revision(package) == SHA[:12]
    (git / "refs" / "heads" / "main").write_text(OTHER + "\n")
    assert revision(package) == OTHER[:12]


def test_a_worktree_reads_refs_of_the_main_repository(tmp_path: Path) -> None:
    main_git = tmp_path / "main" / ".git"
    wt_git = main_git / "worktrees" / "wt"
    wt_git.mkdir(parents=True)
    (wt_git / "HEAD").write_text("ref: refs/heads/topic\n")
    (wt_git / "commondir").write_text("../..\n")
    (main_git / "refs" / "heads").mkdir(parents=True)
    (main_git / "refs" / "heads" / "topic").write_text(SHA + "\n")
    checkout = tmp_path / "wt-dir"
    checkout.mkdir()
    package = _package(checkout)
    (checkout / ".git").write_text(f"gitdir: {wt_git}\n")
    assert revision(package) == SHA[:12]


def test_unknown_without_either(tmp_path: Path) -> None:
    assert revision(_package(tmp_path)) == UNKNOWN
    (tmp_path / "gpu_exporter" / "_revision.txt").write_text("unknown\n")  # docker default
    assert revision(tmp_path / "gpu_exporter") == UNKNOWN


def test_build_info_carries_this_checkouts_revision() -> None:
    s = build_stack(lambda clock: SimulatedNvml.of(Scenario.with_gpus(1), clock=clock.monotonic))
    s.sample()
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    expected = head.stdout.strip()[:12] if head.returncode == 0 else UNKNOWN
    labels = {"version": "test", "backend": "simulated", "revision": expected}
    assert s.registry.get_sample_value("gpu_exporter_build_info", labels) == 1
