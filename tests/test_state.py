"""The state directory: a lease that cannot be saved is not granted, a malformed
``leases.json`` never breaks a page, one exporter per directory, and restored leases only
for GPUs this host has. Through the real server (a socket) and real processes where the
point is what a user sees."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import resource
import shutil
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harness
from conftest import FakeClock, Stack, build_stack, sim_of
from gpu_exporter.choose.filters import Filters
from gpu_exporter.choose.lease import Lease
from gpu_exporter.choose.leases import LeaseTable
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.statefile import StateFile, write_atomically
from gpu_exporter.simulate import Load, SimGpu
from served import four_gpus, served

A100 = "NVIDIA A100-SXM4-80GB"
FOREIGN = SimGpu(50, A100, Load("idle")).uuid  # a GPU none of these hosts has


def idle_sim(n: int) -> Any:
    return sim_of(*(SimGpu(i, A100, Load("idle")) for i in range(n)))


def http(url: str, method: str = "GET", *, json_body: bool = False) -> tuple[int, str]:
    """Status and body; HTTP errors are answers, not exceptions."""
    headers = {"Accept": "application/json"} if json_body else {}
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_for(url: str, status: int, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        code, body = http(url)
        if code == status:
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} answered {code} {body!r}, not {status}")
        time.sleep(0.05)


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


# -- a lease that cannot be saved is not granted ---------------------------------------------


class Disk:
    """``leases.json``'s writer, which a test can make fail as a full disk does."""

    def __init__(self) -> None:
        self.error: OSError | None = None

    def __call__(self, path: Path, text: str) -> None:
        if self.error is not None:
            raise self.error
        write_atomically(path, text)


def test_a_claim_or_renewal_that_cannot_be_saved_is_rolled_back(tmp_path: Path) -> None:
    s = build_stack(idle_sim(2))
    snapshot = s.sample()
    disk, path = Disk(), tmp_path / "leases.json"
    table = LeaseTable(s.clock, state_file=StateFile(path, write=disk))
    _, kept = table.claim(snapshot, 1, Filters(), ttl_seconds=60, requester="a")
    assert kept is not None

    disk.error = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(ApiError) as refused:
        table.claim(snapshot, 1, Filters(), ttl_seconds=60, requester="b")
    assert (refused.value.status, refused.value.code) == (503, "state_unwritable")
    assert str(path) in refused.value.message
    assert "No space left on device (ENOSPC)" in refused.value.message
    assert [x.id for x in table.active()] == [kept.id]  # nothing granted
    assert table.claim(snapshot, 1, Filters(), ttl_seconds=0, requester="b")[1] is None
    with pytest.raises(ApiError, match="not renewed"):
        table.renew(kept.id, 600)
    assert table.get(kept.id).expires_at == kept.expires_at
    assert table.state_write_errors == 2
    assert table.state_problem is not None and str(path) in table.state_problem

    # Letting a GPU go is never refused: it is in force now, saved when the disk allows.
    table.release(kept.id)
    assert table.active() == ()
    assert json.loads(path.read_text())["leases"][0]["id"] == kept.id  # the stale file

    disk.error = None
    table.prune(snapshot)  # every published sample tries the write again
    assert table.state_problem is None
    assert json.loads(path.read_text())["leases"] == []
    assert table.state_write_errors == 3


def test_choose_refuses_and_readyz_fails_while_the_state_directory_refuses_writes(
    tmp_path: Path,
) -> None:
    state_dir = tmp_path / "state"
    with served(state_dir=str(state_dir)) as ex:
        held = http(ex.url + "/choose?n=1&format=json")
        assert held[0] == 200
        lease_id, token = (json.loads(held[1])["lease"][k] for k in ("id", "token"))
        # A path component that is a regular file: mkstemp fails with ENOTDIR even for root.
        shutil.rmtree(state_dir)
        state_dir.write_text("not a directory\n")

        status, body = http(ex.url + "/choose?n=1&format=json")
        assert status == 503
        error = json.loads(body)["error"]
        assert error["code"] == "state_unwritable"
        assert str(state_dir / "leases.json") in error["message"]
        assert "no GPU was claimed" in error["message"]
        status, body = http(ex.url + "/choose?n=1")
        assert status == 503 and body.startswith("error: cannot save leases to")
        assert len(body.splitlines()) == 1
        assert ex.lease_ids() == {lease_id}  # nothing granted
        assert http(ex.url + "/choose?n=1&lease=0")[0] == 200  # advice needs no file
        status, body = http(ex.url + "/readyz")
        assert status == 503 and "cannot save leases" in body
        assert metric(http(ex.url + "/metrics")[1], "gpu_exporter_state_write_errors_total") >= 2
        assert http(ex.url + f"/leases/{token}/renew?ttl=10m", "POST")[0] == 503
        assert http(ex.url + f"/leases/{token}", "DELETE")[0] == 200  # released in memory
        assert ex.lease_ids() == set()

        state_dir.unlink()
        state_dir.mkdir()
        wait_for(ex.url + "/readyz", 200)  # the next sample's write succeeded
        status, body = http(ex.url + "/choose?n=1&format=json")
        assert status == 200
        new_id = json.loads(body)["lease"]["id"]
        saved = json.loads((state_dir / "leases.json").read_text())["leases"]
        assert [x["id"] for x in saved] == [new_id]


def set_file_size_limit(pid: int, limit: int) -> None:
    """RLIMIT_FSIZE of a running process: 0 makes every write fail with EFBIG, for root too
    (Python ignores SIGXFSZ, so the write fails instead of killing the process)."""
    try:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    except (OSError, AttributeError) as exc:  # pragma: no cover - not Linux
        pytest.skip(f"cannot set another process's RLIMIT_FSIZE: {exc}")


def test_a_real_exporter_whose_disk_refuses_writes_grants_nothing(tmp_path: Path) -> None:
    args = ("--simulate", "2", "--interval", "0.2", "--state-dir", str(tmp_path))
    with harness.exporter(*args) as ex:
        set_file_size_limit(ex.proc.pid, 0)
        status, body = http(ex.base + "/choose?n=1")
        assert status == 503
        assert "cannot save leases to" in body and "File too large (EFBIG)" in body
        assert "not ready: cannot save leases" in http(ex.base + "/readyz")[1]
        assert http(ex.base + "/readyz")[0] == 503

        set_file_size_limit(ex.proc.pid, resource.RLIM_INFINITY)
        wait_for(ex.base + "/readyz", 200)
        status, granted = http(ex.base + "/choose?n=1")
        assert status == 200
        text = http(ex.base + "/metrics")[1]
        assert metric(text, "gpu_exporter_state_write_errors_total") >= 1
        assert 'gpu_exporter_choose_requests_total{result="state_unwritable"} 1.0' in text
    # After a restart only what was granted is held: the refused claim never existed.
    with harness.exporter(*args) as ex:
        leases = json.loads(http(ex.base + "/leases")[1])["leases"]
        assert [x["gpus"] for x in leases] == [[granted.strip()]]


def serve(
    *args: str, prefix: tuple[str, ...] = (), **popen: Any
) -> subprocess.CompletedProcess[str]:
    """``gpu-exporter serve ARGS`` that is expected to exit (under ``prefix``, a command)."""
    listen = f"127.0.0.1:{harness.free_port()}"
    return subprocess.run(
        [*prefix, sys.executable, "-m", "gpu_exporter", "serve", "--listen-address", listen, *args],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=harness.ROOT,
        **popen,
    )


def test_a_state_dir_that_cannot_be_created_is_a_start_up_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "state"
    done = serve("--simulate", "2", "--state-dir", str(bad))
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert f"--state-dir {bad}" in line and "Not a directory (ENOTDIR)" in line


def test_a_state_dir_that_cannot_be_written_is_a_start_up_error(tmp_path: Path) -> None:
    def no_writes() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))

    done = serve("--simulate", "2", "--state-dir", str(tmp_path), preexec_fn=no_writes)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert f"--state-dir {tmp_path}" in line and "File too large (EFBIG)" in line


# -- two exporters, one state directory ------------------------------------------------------


def test_a_second_exporter_on_the_same_state_dir_exits_naming_the_first(tmp_path: Path) -> None:
    with harness.exporter("--simulate", "2", "--state-dir", str(tmp_path)) as first:
        assert http(first.base + "/choose?n=1")[0] == 200
        saved = (tmp_path / "leases.json").read_text()
        done = serve("--simulate", "2", "--state-dir", str(tmp_path))
        assert done.returncode == 2
        (line,) = done.stderr.strip().splitlines()
        assert f"pid {first.proc.pid}, listening on {first.address}" in line
        assert f"--state-dir {tmp_path}" in line
        assert (tmp_path / "leases.json").read_text() == saved  # not touched
        assert http(first.base + "/readyz")[0] == 200
    # The lock ends with its process: the directory can be used again.
    with harness.exporter("--simulate", "2", "--state-dir", str(tmp_path)) as again:
        assert len(json.loads(http(again.base + "/leases")[1])["leases"]) == 1


def lease_entry(uuids: list[str], index: int, *, now: float, lease_id: str) -> dict[str, Any]:
    return {
        "id": lease_id,
        "created_at": now - 10,
        "expires_at": now + 600,
        "requester": "127.0.0.1",
        "owner": None,
        "held": [[u, index + k, None, None] for k, u in enumerate(uuids)],
    }


def test_restored_leases_are_kept_only_for_this_hosts_gpus(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    sim = idle_sim(4)
    local = [SimGpu(i, A100, Load("idle")).uuid for i in range(4)]
    entries = [
        lease_entry([local[0]], 0, now=clock.time(), lease_id="mine"),
        lease_entry([FOREIGN, FOREIGN + "x"], 0, now=clock.time(), lease_id="theirs"),
        lease_entry([local[1], FOREIGN], 1, now=clock.time(), lease_id="mixed"),
    ]
    (tmp_path / "leases.json").write_text(json.dumps({"version": 1, "leases": entries}))
    s = build_stack(sim, clock=clock, state_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="gpu_exporter"):
        s.sample()
        s.sample()
    active = {x.id: x.uuids for x in s.leases.active(s.cache.get())}
    assert active == {"mine": (local[0],), "mixed": (local[1],)}
    assert dict(s.leases.dropped) == {"not_on_this_host": 3}
    assert s.value("gpu_exporter_lease_gpus_released_total", reason="not_on_this_host") == 3
    (record,) = [r for r in caplog.records if "does not have" in r.getMessage()]
    assert "dropped 3 GPUs" in record.getMessage()
    saved = json.loads((tmp_path / "leases.json").read_text())["leases"]
    assert sorted(x["id"] for x in saved) == ["mine", "mixed"]


# -- a malformed leases.json -----------------------------------------------------------------


def malformed(good: dict[str, Any]) -> list[Any]:
    """Well-formed JSON, wrong types: what a hand edit, another tool or a bug leaves."""
    return [
        {**good, "id": "far", "expires_at": 1e300},
        {**good, "id": "soon", "expires_at": "soon"},
        {**good, "id": "nan", "expires_at": math.nan},
        {**good, "id": "null", "created_at": None},
        {**good, "id": "bool", "expires_at": True},
        {**good, "id": "flat", "held": "GPU-0"},
        {**good, "id": "ints", "held": [[1, 2, 3, 4]]},
        {**good, "id": "short", "held": [[good["held"][0][0]]]},
        {**good, "id": "str-procs", "held": [[good["held"][0][0], 1, "lots", None]]},
        {**good, "id": "huge", "held": [[good["held"][0][0], 10**400, None, None]]},
        {**good, "id": "owner", "owner": {"nested": [1, {"x": None}]}},
        {**good, "id": ["not", "a", "string"]},
        {**good, "id": "noreq", "requester": 7},
        None,
        3,
        "lease",
        [good],
    ]


def test_malformed_entries_are_skipped_and_every_page_still_answers(tmp_path: Path) -> None:
    sim = four_gpus()
    kept = sim.gpus[1].uuid
    good = lease_entry([kept], 1, now=time.time(), lease_id="good")
    text = json.dumps({"version": 1, "leases": [*malformed(good), good]})
    (tmp_path / "leases.json").write_text(text)
    with served(sim, state_dir=str(tmp_path)) as ex:
        for path in ("/", "/metrics", "/leases", "/gpus", "/readyz"):
            assert http(ex.url + path)[0] == 200, path
        assert ex.lease_ids() == {"good"}
        status, body = http(ex.url + "/choose?n=3&lease=0&max_util=100%25&max_mem_used=100%25")
        assert status == 200 and kept not in body
        assert http(ex.url + "/choose?n=1")[0] == 200
    assert (tmp_path / "leases.corrupt").read_text() == text  # a copy for a person
    saved = json.loads((tmp_path / "leases.json").read_text())["leases"]
    assert "good" in {x["id"] for x in saved}
    assert all(Lease.from_state(x) for x in saved)


@pytest.mark.parametrize(
    "index", range(len(malformed(lease_entry(["GPU-x"], 0, now=1e9, lease_id="x"))))
)
def test_no_malformed_entry_alone_makes_a_page_fail(tmp_path: Path, index: int) -> None:
    clock = FakeClock()
    uuid = SimGpu(0, A100, Load("idle")).uuid
    good = lease_entry([uuid], 0, now=clock.time(), lease_id="good")
    entry = malformed(good)[index]
    (tmp_path / "leases.json").write_text(json.dumps({"version": 1, "leases": [entry]}))
    s = build_stack(idle_sim(2), clock=clock, state_dir=str(tmp_path))
    s.sample()
    for path in ("/", "/metrics", "/leases", "/gpus", "/choose?n=2&lease=0"):
        assert s.client.get(path).status_code == 200, path
    assert s.client.get("/leases").json == {"leases": []}  # skipped, not half-loaded
    assert s.client.get("/choose?n=2").status_code == 200


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from([1e300, -1.0, 2**63, "GPU-5a1e0000", 1_800_000_000.0]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
GOOD = lease_entry([SimGpu(0, A100, Load("idle")).uuid], 0, now=1_800_000_000.0, lease_id="g")


@st.composite
def junk_entries(draw: st.DrawFn) -> Any:
    """A lease entry with some fields replaced by random JSON, or random JSON outright."""
    if draw(st.booleans()):
        return draw(JSON)
    entry = dict(GOOD)
    for key in draw(st.sets(st.sampled_from([*GOOD, "held0", "extra"]), min_size=1)):
        if key == "held0":
            row = list(GOOD["held"][0])
            row[draw(st.integers(0, 3))] = draw(JSON)
            entry["held"] = [row]
        else:
            entry[key] = draw(JSON)
    return entry


@given(junk_entries())
def test_from_state_accepts_a_valid_lease_or_raises_value_error(entry: Any) -> None:
    try:
        lease = Lease.from_state(entry)
    except ValueError:
        return
    assert math.isfinite(lease.created_at) and math.isfinite(lease.expires_at)
    assert lease.created_at <= lease.expires_at
    assert Lease.from_state(lease.to_state()) == lease


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(junk_entries(), max_size=4))
def test_no_junk_in_leases_json_makes_a_page_fail(tmp_path: Path, entries: list[Any]) -> None:
    state = tmp_path / "leases.json"
    state.write_text(json.dumps({"version": 1, "leases": [*entries, GOOD]}))
    clock = FakeClock()
    s = build_stack(idle_sim(2), clock=clock, state_dir=str(tmp_path))
    for path in ("/", "/metrics", "/leases", "/choose?n=1&lease=0", "/choose?n=1"):
        assert s.client.get(path).status_code in (200, 503), path
    s.sample()
    for path in ("/", "/metrics", "/leases", "/choose?n=1&lease=0", "/choose?n=1"):
        assert s.client.get(path).status_code in (200, 503), path
    os.remove(state)


def test_one_restored_lease_is_logged_in_the_singular(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    local = SimGpu(0, A100, Load("idle")).uuid
    entry = lease_entry([local], 0, now=clock.time(), lease_id="mine")
    (tmp_path / "leases.json").write_text(json.dumps({"version": 1, "leases": [entry]}))
    with caplog.at_level(logging.INFO, logger="gpu_exporter"):
        build_stack(idle_sim(2), clock=clock, state_dir=str(tmp_path))
    assert f"restored 1 active lease from {tmp_path / 'leases.json'}" in caplog.messages


# -- what the exporter trusts in its state directory (issue 28) ------------------------------


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused start writes, having exited 2 (no traceback)."""
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    return line


def without_root_file_access() -> tuple[str, ...]:
    """A command prefix under which file permissions apply to this user (root included)."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root reads any file, and setpriv (util-linux) is not there to stop it")
    return (setpriv, "--bounding-set=-dac_override,-dac_read_search")


def test_a_leases_json_that_cannot_be_read_is_a_start_up_error(tmp_path: Path) -> None:
    """Issue 28.1: not "moved to leases.corrupt, starting empty", which hands its GPUs out."""
    state = tmp_path / "leases.json"
    state.write_text(json.dumps({"version": 1, "leases": []}))
    state.chmod(0)
    done = serve("--simulate", "2", "--state-dir", str(tmp_path), prefix=without_root_file_access())
    line = one_line(done)
    assert f"cannot read leases from {state}: Permission denied (EACCES)" in line
    assert "--discard-leases" in line
    assert state.exists() and not (tmp_path / "leases.corrupt").exists()  # left as it was


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: p.mkdir(), "it is a directory, not a regular file"),
        (lambda p: os.mkfifo(p), "it is a FIFO, not a regular file"),  # opening it hung
        (lambda p: p.symlink_to("/dev/zero"), "it is a symbolic link"),  # read until OOM
    ],
    ids=["directory", "fifo", "link-to-dev-zero"],
)
def test_a_leases_json_that_is_not_a_regular_file_is_a_start_up_error(
    tmp_path: Path, make: Any, says: str
) -> None:
    """Issue 28.1 and 28.5: one line and exit 2, never a hang, a runaway read or a rename."""
    state = tmp_path / "leases.json"
    make(state)

    def capped() -> None:  # what reading /dev/zero would meet first
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, resource.RLIM_INFINITY))

    line = one_line(serve("--simulate", "2", "--state-dir", str(tmp_path), preexec_fn=capped))
    assert f"cannot read leases from {state}: {says}" in line
    assert os.path.lexists(state) and not (tmp_path / "leases.corrupt").exists()
    # The operator's way out: the file is moved aside unread, and the exporter starts.
    with harness.exporter("--simulate", "2", "--state-dir", str(tmp_path), "--discard-leases"):
        assert not os.path.lexists(state)
        assert os.path.lexists(tmp_path / "leases.discarded")


def choose_json(base: str, query: str = "n=1") -> tuple[int, Any]:
    status, body = http(f"{base}/choose?{query}&format=json", json_body=True)
    return status, json.loads(body)


@pytest.mark.parametrize(
    "text",
    ["{not json", "[" * 3000 + "]" * 3000, '{"leases": ' * 3000 + "[]" + "}" * 3000],
    ids=["not-json", "nested-3000-deep", "objects-3000-deep"],
)
def test_a_leases_json_set_aside_withholds_every_gpu_for_max_lease(
    tmp_path: Path, text: str
) -> None:
    """Issue 28.1 and 28.5: a file that is not a lease table is set aside (no traceback), and
    no GPU it could have named is handed out until --max-lease after it last changed."""
    state = tmp_path / "leases.json"
    state.write_text(text)
    args = (
        "--simulate",
        "2",
        "--interval",
        "0.2",
        "--state-dir",
        str(tmp_path),
        "--max-lease",
        "1h",
    )
    with harness.exporter(*args) as ex:
        assert (tmp_path / "leases.corrupt").read_text() == text
        status, body = choose_json(ex.base)
        assert status == 503, body
        assert "withheld for" in body["error"]["message"]
        assert "leases.json was not a lease table" in body["error"]["message"]
        assert choose_json(ex.base, "n=1&lease=0")[0] == 503  # advice says the same
        err = harness.stop(ex.proc)
    assert "Traceback" not in err and "every GPU" in err
    # A restart keeps them withheld: they are in leases.json now.
    with harness.exporter(*args) as ex:
        status, body = choose_json(ex.base)
        assert status == 503 and "withheld for" in body["error"]["message"]
    # Once --max-lease has passed since the file changed, they are free.
    state.unlink()
    (tmp_path / "leases.corrupt").rename(state)
    os.utime(state, (time.time() - 3700, time.time() - 3700))
    with harness.exporter(*args) as ex:
        assert choose_json(ex.base)[0] == 200
    # And --discard-leases frees them at once.
    state.write_text(text)
    with harness.exporter(*args, "--discard-leases") as ex:
        assert choose_json(ex.base)[0] == 200


def after_a_malformed_entry(tmp_path: Path, gpu: int) -> tuple[Stack, FakeClock, list[str]]:
    """Three idle GPUs restored from a leases.json (changed 60 s ago, --max-lease 600 s)
    whose one entry, malformed, names GPU ``gpu``: (the stack sampled once, its clock, the
    UUIDs)."""
    clock = FakeClock()
    uuids = [SimGpu(i, A100, Load("idle")).uuid for i in range(3)]
    bad = {**lease_entry([uuids[gpu]], 1, now=clock.time(), lease_id="bad"), "expires_at": "soon"}
    state = tmp_path / "leases.json"
    state.write_text(json.dumps({"version": 1, "leases": [bad]}))
    os.utime(state, (clock.time() - 60, clock.time() - 60))
    s = build_stack(idle_sim(3), clock=clock, state_dir=str(tmp_path), max_lease_seconds=600)
    s.sample()
    return s, clock, uuids


def test_malformed_entries_withhold_the_gpus_they_name(tmp_path: Path) -> None:
    """Issue 28.1: a skipped entry may have been a lease; its GPUs wait out --max-lease."""
    s, clock, uuids = after_a_malformed_entry(tmp_path, 1)
    got = {s.client.get("/choose?n=1").text.strip() for _ in range(2)}
    assert got == {uuids[0], uuids[2]}
    refused = s.client.get("/choose?n=1", headers={"Accept": "application/json"})
    assert refused.status_code == 503
    assert "withheld for 540 s more" in refused.get_json()["error"]["message"]
    clock.advance(541)
    s.sample()
    assert s.client.get("/choose?n=3&lease=0").status_code == 200  # the leases ended too


def test_withheld_gpus_show_on_the_status_page_and_in_the_metrics(tmp_path: Path) -> None:
    """The page recommended a withheld GPU that /choose refuses, and nothing said so to
    Prometheus; now the row says why and a gauge counts them until they are free."""
    s, clock, uuids = after_a_malformed_entry(tmp_path, 0)
    page = s.client.get("/").text
    assert f"<code>{uuids[0]}</code>" not in page.split('id="recommendation"')[1].split("</p>")[0]
    assert "withheld for 540 s more: leases.json had malformed entries" in page
    assert "gpu_exporter_gpus_withheld 1.0" in s.client.get("/metrics").text
    clock.advance(541)
    s.sample()
    assert "gpu_exporter_gpus_withheld 0.0" in s.client.get("/metrics").text
    assert "withheld for" not in s.client.get("/").text


def test_malformed_entries_naming_more_gpus_than_a_host_has_withhold_every_gpu(
    tmp_path: Path,
) -> None:
    """Names are withheld one by one up to 4096; past that, the entry is no list of GPUs."""
    clock = FakeClock()
    junk = {"id": "x", "held": [f"GPU-{i}" for i in range(5000)]}
    state = tmp_path / "leases.json"
    state.write_text(json.dumps({"version": 1, "leases": [junk]}))
    os.utime(state, (clock.time(), clock.time()))
    s = build_stack(idle_sim(2), clock=clock, state_dir=str(tmp_path))
    s.sample()
    assert s.client.get("/choose?n=1").status_code == 503
    assert json.loads(state.read_text())["withheld"][0]["gpus"] is None


@pytest.mark.parametrize(
    "junk", [5, "GPU-a", {"GPU-b": 1}, [["k", 10**400]], [["k", True]], [{"until": 1e400}]]
)
def test_junk_beside_the_leases_is_skipped(tmp_path: Path, junk: Any) -> None:
    """``ended_keys`` and ``withheld`` are read as carefully as the leases (no overflow)."""
    clock = FakeClock()
    state = tmp_path / "leases.json"
    text = json.dumps({"leases": [], "ended_keys": junk, "withheld": junk})
    state.write_text(text)
    os.utime(state, (clock.time(), clock.time()))
    s = build_stack(idle_sim(2), clock=clock, state_dir=str(tmp_path))
    s.sample()
    assert s.client.get("/choose?n=1").status_code == 200  # it names no GPU of this host
    assert (tmp_path / "leases.corrupt").read_text() == text
    assert json.loads(state.read_text())["ended_keys"] == []


def test_a_leases_json_over_the_size_limit_is_set_aside(tmp_path: Path) -> None:
    """Issue 28.5: read no further than 16 MiB; what is larger is no lease table we wrote."""
    clock = FakeClock()
    state = tmp_path / "leases.json"
    with state.open("wb") as f:
        f.truncate(17 * 2**20)  # zero bytes, sparse
    os.utime(state, (clock.time(), clock.time()))
    s = build_stack(idle_sim(2), clock=clock, state_dir=str(tmp_path))
    s.sample()
    assert s.client.get("/choose?n=1").status_code == 503
    assert (tmp_path / "leases.corrupt").stat().st_size == 17 * 2**20


def test_a_state_dir_that_names_a_file_says_so(tmp_path: Path) -> None:
    """Issue 28.6: not "File exists (EEXIST)"."""
    (tmp_path / "file").write_text("")
    line = one_line(serve("--simulate", "2", "--state-dir", str(tmp_path / "file")))
    assert f'msg="--state-dir {tmp_path / "file"} is not a directory"' in line
    assert "EEXIST" not in line


def test_a_state_dir_other_users_may_write_to_is_refused(tmp_path: Path) -> None:
    """Issue 28.4: there another user could plant a link where the exporter writes."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    line = one_line(serve("--simulate", "2", "--state-dir", str(shared)))
    assert f"--state-dir {shared} may be written by other users (mode 1777)" in line
    assert list(shared.iterdir()) == []


def test_a_state_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    """Issue 28.4: owned by another (non-root) user, it is theirs to fill with links."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    if os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user")
    os.chown(theirs, 65534, 65534)
    line = one_line(serve("--simulate", "2", "--state-dir", str(theirs)))
    assert f"--state-dir {theirs} belongs to " in line and "uid 65534" in line
    assert list(theirs.iterdir()) == []


def test_a_lock_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    """Issue 28.4: a root exporter overwrote the target of a planted ``lock`` link."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "lock").symlink_to(victim)
    line = one_line(serve("--simulate", "2", "--state-dir", str(state)))
    assert f"{state / 'lock'} is a symbolic link" in line
    assert victim.read_text() == "precious\n"


def test_state_files_are_private_and_a_corrupt_link_is_replaced_not_followed(
    tmp_path: Path,
) -> None:
    """Issue 28.4: ``leases.corrupt`` planted as a link: the copy replaces the link; every
    file the exporter makes is 0600."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "leases.corrupt").symlink_to(victim)
    entry = {**lease_entry(["GPU-x"], 0, now=time.time(), lease_id="bad"), "expires_at": "?"}
    text = json.dumps({"version": 1, "leases": [entry]})
    (state / "leases.json").write_text(text)
    with harness.exporter("--simulate", "2", "--state-dir", str(state)) as ex:
        assert http(ex.base + "/choose?n=1")[0] == 200
        modes = {p.name: stat.S_IMODE(p.lstat().st_mode) for p in state.iterdir()}
    assert victim.read_text() == "precious\n"
    assert (state / "leases.corrupt").read_text() == text  # a regular file now
    assert modes == {"lock": 0o600, "leases.json": 0o600, "leases.corrupt": 0o600}
