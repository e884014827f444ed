"""Issue 16: memory-sized leases (``/choose?mem=8GiB``): several small jobs share one card.

The admission rule (:mod:`gpu_exporter.choose.memory`) as pure unit tests, the parameter's
refusals, whole and memory leases never sharing a card, ``leases.json`` (old files load), the
caps of ``format=env``, and 64 concurrent claims over a real socket.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from conftest import FakeClock, Stack, build_stack, sim_of
from gpu_exporter.choose.lease import Held, Lease
from gpu_exporter.choose.memory import (
    CUDA_CONTEXT_BYTES,
    DEFAULT_HEADROOM_BYTES,
    card_memory,
    env_caps,
    fraction,
)
from gpu_exporter.model import GpuSample, ProcessSample
from gpu_exporter.simulate import DEFAULT_MODEL, Load, SimGpu, SimulatedNvml
from served import served

GIB, MIB = 2**30, 2**20
T = 1_800_000_000.0
FIXTURE = Path(__file__).parent / "fixtures" / "leases-before-mem.json"
# The simulator's A100-SXM4-80GB: 80 GiB in all, 534 MiB reserved by the driver (NVML v2).
TOTAL, DRIVER = 80 * GIB, 534 * MIB
USABLE = TOTAL - DRIVER
JSON = {"Accept": "application/json"}  # refusals as {"error": {"code", "message", "param"}}


def idle(n: int) -> Stack:
    s = build_stack(sim_of(*(SimGpu(i, DEFAULT_MODEL, Load("idle")) for i in range(n))))
    s.sample()
    return s


def mem_lease(lease_id: str, mem: int, *, pids: tuple[int, ...] = ()) -> Lease:
    return Lease(lease_id, (Held("GPU-0", 0, 0, 0, ()),), T, T + 60, "x", pids=pids, mem_bytes=mem)


# -- the rule, pure --------------------------------------------------------------------------


def test_committed_counts_each_lease_at_the_larger_of_reserved_and_used() -> None:
    card = GpuSample(
        index=0,
        uuid="GPU-0",
        up=True,
        memory_total_bytes=TOTAL,
        memory_reserved_bytes=DRIVER,
        memory_used_bytes=3 * GIB + 10 * GIB + 2 * GIB,
        processes=(
            ProcessSample(100, 10 * GIB, ancestors=(1,)),  # lease a's: over its 8 GiB
            ProcessSample(200, 2 * GIB, ancestors=(1,)),  # lease b's: under its 8 GiB
            ProcessSample(300, 3 * GIB, ancestors=(1,)),  # nobody's
        ),
    )
    a, b = mem_lease("a", 8 * GIB, pids=(100,)), mem_lease("b", 8 * GIB, pids=(200,))
    m = card_memory(card, [a, b])
    assert m.usable == USABLE
    assert m.foreign == 3 * GIB
    assert m.attributed == {"a": 10 * GIB, "b": 2 * GIB}
    assert m.committed == 3 * GIB + 10 * GIB + 8 * GIB
    assert m.overrun == 2 * GIB
    assert m.leased == 16 * GIB


def test_without_the_drivers_figure_nothing_is_subtracted_for_it() -> None:
    card = GpuSample(index=0, uuid="GPU-0", up=True, memory_total_bytes=TOTAL, memory_used_bytes=0)
    assert card_memory(card, []).usable == TOTAL


def test_the_fraction_leaves_the_cuda_context_out_and_rounds_down() -> None:
    assert CUDA_CONTEXT_BYTES == 500 * MIB
    assert fraction(8 * GIB, TOTAL) == 0.0938  # (8192 - 500) / 81920 = 0.09389…
    # cards of different sizes: the largest decides, so the cap fits on each (7692 / 81920;
    # on the 40 GiB card 0.1877 would let the allocator take 7.5 GiB more than the share)
    assert env_caps(8 * GIB, [40 * GIB, TOTAL])["GPU_MEM_FRACTION"] == "0.0938"


# -- the parameter ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("0", "more than 500.0 MiB"),
        ("-8GiB", "expected a size"),
        ("lots", "expected a size"),
        ("8 furlongs", "expected a size"),
        ("100MiB", "more than 500.0 MiB"),
        ("2EiB", "expected a size"),
        ("9" * 40, "at most 32 digits"),
        ("2000000TiB", "at most 1 EiB"),
    ],
)
def test_junk_sizes_are_400(value: str, says: str) -> None:
    s = idle(1)
    resp = s.client.get("/choose", query_string={"mem": value}, headers=JSON)
    assert resp.status_code == 400, resp.text
    body = resp.get_json()["error"]
    assert body["param"] == "mem" and says in body["message"], body
    assert not s.leases.active()


def test_mig_with_mem_is_refused() -> None:
    s = idle(1)
    for mig in ("allow", "only"):
        resp = s.client.get(f"/choose?mem=8GiB&mig={mig}&format=uuid", headers=JSON)
        assert resp.status_code == 400
        assert "whole card" in resp.get_json()["error"]["message"]


def test_a_size_no_card_could_ever_hold_is_refused_at_once_even_with_wait() -> None:
    s = idle(2)
    resp = s.client.get("/choose?mem=80GiB&wait=10m", headers=JSON)
    assert resp.status_code == 503
    body = resp.get_json()["error"]
    assert body["code"] == "not_enough_gpus" and body["param"] == "mem"
    assert "can never fit" in body["message"]
    assert "headroom is 79.0 GiB" in body["message"]  # 81,386 - 512 MiB


def test_advice_says_which_card_would_take_it_and_claims_nothing() -> None:
    s = idle(2)
    s.client.get("/choose?mem=30GiB&include=0")  # card 0 now has room for ~49 GiB
    resp = s.client.get("/choose?mem=40GiB&lease=0&format=json")
    assert resp.status_code == 200
    body = resp.get_json()
    assert [g["index"] for g in body["chosen"]] == [0]  # best fit: the fuller card that admits
    assert body["lease"] is None and "X-GPU-Lease" not in resp.headers
    assert body["mem"]["bytes"] == 40 * GIB
    assert len(s.leases.active()) == 1


def test_without_mem_nothing_changes() -> None:
    s = idle(1)
    resp = s.client.get("/choose?format=json")
    body = resp.get_json()
    assert "mem" not in body and "mem_bytes" not in body["lease"]
    assert resp.headers["X-GPU-Lease"]
    listed = s.client.get("/leases").get_json()["leases"][0]
    assert "memory" not in listed and "mem_bytes" not in listed


def test_retries_with_an_idempotency_key_get_the_same_memory_lease() -> None:
    s = idle(1)
    headers = {"Idempotency-Key": "job-17-try"}
    first = s.client.get("/choose?mem=8GiB", headers=headers)
    again = s.client.get("/choose?mem=8GiB", headers=headers)
    assert first.status_code == again.status_code == 200
    assert first.headers["X-GPU-Lease"] == again.headers["X-GPU-Lease"]
    assert len(s.leases.active()) == 1
    other = s.client.get("/choose?mem=16GiB", headers={**headers, **JSON})  # other mem
    assert other.status_code == 422
    assert other.get_json()["error"]["code"] == "idempotency_key_reused"


# -- whole and memory leases never share a card ------------------------------------------


def test_a_shared_card_is_never_handed_out_whole_and_a_whole_one_takes_no_share() -> None:
    s = idle(2)
    assert s.client.get("/choose?mem=8GiB&include=1").status_code == 200
    whole = s.client.get("/choose?n=2")
    assert whole.status_code == 503
    assert "shared: 8.0 GiB reserved by memory leases" in whole.text
    assert s.client.get("/choose?include=0").status_code == 200  # card 0, whole
    share = s.client.get("/choose?mem=8GiB&include=0")
    assert share.status_code == 503
    assert "leased until" in share.text
    # card 1 still takes shares
    assert s.client.get("/choose?mem=8GiB").text.strip() == s.sim.gpus[1].uuid


def test_a_refusal_names_the_best_card_the_request_accepts_not_one_it_excludes() -> None:
    s = idle(2)
    for _ in range(9):  # card 0 full: 9 × 8 GiB + 512 MiB headroom of USABLE
        assert s.client.get("/choose?mem=8GiB&include=0").status_code == 200
    refused = s.client.get("/choose?mem=8GiB&include=0")
    assert refused.status_code == 503
    assert f"the best card ({s.sim.gpus[0].uuid})" in refused.text  # not card 1, excluded
    s.client.get("/choose?include=1&lease=60")  # card 1 leased whole
    nothing = s.client.get("/choose?mem=8GiB&include=1")
    assert "no card the other filters accept can take a memory lease" in nothing.text


def test_n_cards_each_with_mem_are_different_cards() -> None:
    s = idle(3)
    resp = s.client.get("/choose?n=2&mem=8GiB&format=json")
    chosen = [g["uuid"] for g in resp.get_json()["chosen"]]
    assert len(set(chosen)) == 2
    assert resp.get_json()["lease"]["mem_bytes"] == 8 * GIB


def test_a_memory_lease_never_ends_on_arrival_only_on_release_or_ttl(tmp_path: Path) -> None:
    clock = FakeClock()
    gpus = [SimGpu(0, DEFAULT_MODEL, Load("idle"))]
    s = build_stack(sim_of(*gpus), clock=clock)
    s.sample()
    resp = s.client.get("/choose?mem=8GiB&lease=60s")
    token = resp.headers["X-GPU-Lease"]
    s.sim.gpus[0].load = Load("constant", utilization=0.9, memory_used_ratio=0.05, processes=1)
    clock.advance(5)
    s.sample()
    assert len(s.leases.active(s.cache.get())) == 1  # a new process: not "arrived"
    clock.advance(60)
    s.sample()
    assert not s.leases.active(s.cache.get())
    assert s.client.delete(f"/leases/{token}").status_code == 404


def test_leases_lists_mem_attributed_bytes_and_pids() -> None:
    s = idle(1)
    s.client.get("/choose?mem=8GiB&pid=4000")
    s.sim.gpus[0].load = Load(
        "constant", utilization=0.5, memory_used_ratio=0.2, processes=1, pids=(4000,)
    )
    s.clock.advance(1)
    s.sample()
    listed = s.client.get("/leases").get_json()["leases"][0]
    assert listed["mem_bytes"] == 8 * GIB
    (row,) = listed["memory"]
    # 0.2 of the usable memory (15.9 GiB), all of it the registered process's
    assert row["attributed_bytes"] == round(USABLE * 0.2)
    assert row["pids"] == [4000]
    assert row["committed_bytes"] == round(USABLE * 0.2)  # over its 8 GiB reservation


# -- leases.json --------------------------------------------------------------------------


def test_memory_leases_persist_and_restore(tmp_path: Path) -> None:
    s = build_stack(sim_of(SimGpu(0, DEFAULT_MODEL, Load("idle"))), state_dir=str(tmp_path))
    s.sample()
    token = s.client.get("/choose?mem=8GiB").headers["X-GPU-Lease"]
    saved = json.loads((tmp_path / "leases.json").read_text())
    assert saved["leases"][0]["mem_bytes"] == 8 * GIB
    again = build_stack(sim_of(SimGpu(0, DEFAULT_MODEL, Load("idle"))), state_dir=str(tmp_path))
    again.sample()
    (restored,) = again.leases.active()
    assert restored.mem_bytes == 8 * GIB and restored.accepts(token)
    assert again.client.get("/choose").status_code == 503  # not whole: it is shared


def test_a_state_file_from_before_memory_leases_still_loads(tmp_path: Path) -> None:
    shutil.copy(FIXTURE, tmp_path / "leases.json")
    gpus = [SimGpu(i, DEFAULT_MODEL, Load("idle")) for i in range(2)]
    s = build_stack(sim_of(*gpus), state_dir=str(tmp_path), clock=FakeClock(T + 10))
    s.sample()
    (lease,) = s.leases.active()
    assert lease.mem_bytes is None and lease.owner == "alice" and lease.pids == (4242,)
    assert s.client.get("/choose?mem=8GiB&include=1").status_code == 503  # held whole
    assert not (tmp_path / "leases.corrupt").exists()


@pytest.mark.parametrize("bad", [0, -1, True, "8GiB", 1.5])
def test_a_malformed_mem_in_the_state_file_skips_that_lease(bad: Any) -> None:
    entry = json.loads(FIXTURE.read_text())["leases"][0]
    with pytest.raises(ValueError, match="mem_bytes"):
        Lease.from_state({**entry, "mem_bytes": bad})


# -- format=env ---------------------------------------------------------------------------


def test_format_env_carries_the_caps() -> None:
    s = idle(1)
    line = s.client.get("/choose?mem=8GiB&format=env").text
    assert line.startswith("export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=GPU-")
    words = dict(w.split("=", 1) for w in line.split()[1:])
    assert words["GPU_MEM_LIMIT_BYTES"] == str(8 * GIB)
    assert words["GPU_MEM_FRACTION"] == "0.0938"
    assert words["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert words["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.0938"
    assert "XLA_CLIENT_MEM_FRACTION" not in words  # JAX 0.11 refuses both: memory.py
    plain = s.client.get("/choose?format=env&lease=0&max_util=100%25").text
    assert "MEM" not in plain and "TF_" not in plain


# -- 64 concurrent claims over a real socket ----------------------------------------------


def _claim(url: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url + "/choose?mem=8GiB&lease=10m&format=json")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _burst(url: str, n: int) -> list[tuple[int, dict[str, Any]]]:
    results: list[tuple[int, dict[str, Any]]] = []
    lock = threading.Lock()
    go = threading.Barrier(n)

    def one() -> None:
        go.wait()
        answer = _claim(url)
        with lock:
            results.append(answer)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_64_concurrent_claims_get_exactly_what_the_rule_admits() -> None:
    """Eight idle A100-80GB cards: total 81,920 MiB, 534 MiB reserved by the driver, 0 used.
    A card admits k leases of 8,192 MiB while 0 + k × 8,192 + 512 (headroom) ≤ 81,920 − 534
    = 81,386 MiB, i.e. k ≤ (81,386 − 512) / 8,192 = 9.87: 9 leases a card, 72 in all.

    So 64 concurrent claims are all granted (at most 9 on any card, best fit filling cards
    one after another); 16 more at once get exactly the 8 left (one per card: best fit
    keeps cards full); and the next gets 503 not_enough_gpus, with 81,386 − 9 × 8,192 =
    7,658 MiB (7.5 GiB) uncommitted on the best card."""
    sim = SimulatedNvml(
        [SimGpu(i, DEFAULT_MODEL, Load("idle")) for i in range(8)], clock=time.monotonic
    )
    per_card = (USABLE - DEFAULT_HEADROOM_BYTES) // (8 * GIB)
    assert per_card == 9
    # every claim in flight at once: no request-slot refusal may stand in for the rule
    with served(sim, max_requests_in_flight=128) as ex:
        first = _burst(ex.url, 64)
        assert [code for code, _ in first].count(200) == 64
        more = _burst(ex.url, 16)
        codes = [code for code, _ in more]
        assert codes.count(200) == 8 * per_card - 64 == 8
        assert codes.count(503) == 8
        assert {b["error"]["code"] for c, b in more if c == 503} == {"not_enough_gpus"}
        leases = ex.leases()
        assert len(leases) == 72
        per_uuid: dict[str, int] = {}
        for lease in leases:
            (uuid,) = lease["gpus"]
            per_uuid[uuid] = per_uuid.get(uuid, 0) + lease["mem_bytes"]
        assert len(per_uuid) == 8
        for committed in per_uuid.values():  # never over-committed
            assert committed + DEFAULT_HEADROOM_BYTES <= USABLE
            assert committed == 9 * 8 * GIB
        code, body = _claim(ex.url)
        assert code == 503 and body["error"]["code"] == "not_enough_gpus"
        assert "has 7.5 GiB uncommitted" in body["error"]["message"]
        assert "needs 8.0 GiB + 512.0 MiB headroom" in body["error"]["message"]


# -- metrics ------------------------------------------------------------------------------


def test_leased_and_overrun_bytes_are_exported_for_cards_with_memory_leases() -> None:
    s = idle(2)
    assert s.value("gpu_memory_leased_bytes", 1) is None  # nothing shared: no series
    s.client.get("/choose?mem=8GiB&pid=4000&include=1")
    s.client.get("/choose?mem=4GiB&pid=4001&include=1")
    assert s.value("gpu_memory_leased_bytes", 1) == 12 * GIB
    assert s.value("gpu_lease_memory_overrun_bytes", 1) == 0
    assert s.value("gpu_memory_leased_bytes", 0) is None
    # pid 4000 now uses 0.2 of the usable memory (15.9 GiB): 7.9 GiB over its 8 GiB
    s.sim.gpus[1].load = Load(
        "constant", utilization=0.5, memory_used_ratio=0.2, processes=1, pids=(4000,)
    )
    s.clock.advance(1)
    s.sample()
    assert s.value("gpu_lease_memory_overrun_bytes", 1) == round(USABLE * 0.2) - 8 * GIB
    assert len(s.leases.active(s.cache.get())) == 2  # nothing is killed or ended


def test_the_answers_match_their_openapi_schemas() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from gpu_exporter.web.openapi import LEASE, MEM

    s = idle(1)
    body = s.client.get("/choose?mem=8GiB&pid=4000&format=json").get_json()
    jsonschema.validate(body["mem"], MEM)
    jsonschema.validate(body["lease"], LEASE)
    listed = s.client.get("/leases").get_json()["leases"]
    for lease in listed:
        jsonschema.validate(lease, LEASE)
    assert listed[0]["memory"][0]["reserved_bytes"] == 8 * GIB
    params = s.client.get("/openapi.json").get_json()["paths"]["/choose"]["get"]["parameters"]
    assert "mem" in {p["name"] for p in params}


def test_the_status_page_shows_committed_memory_as_a_bar() -> None:
    s = idle(2)
    s.client.get("/choose?mem=8GiB&owner=alice&include=1")
    s.client.get("/choose?mem=16GiB&owner=bob&include=1")
    page = s.client.get("/").text
    row = re.search(rf'<tr class="gpu" data-uuid="{s.sim.gpus[1].uuid}">.*?</tr>', page, re.S)
    assert row is not None
    cells = row.group(0)
    assert 'class="committed"' in cells and "24.0 GiB of 79.5 GiB committed" in cells
    assert "2 memory leases: alice, bob" in cells
    assert f'aria-valuenow="{24 * GIB / USABLE * 100:.0f}"' in cells
    other = re.search(rf'<tr class="gpu" data-uuid="{s.sim.gpus[0].uuid}">.*?</tr>', page, re.S)
    assert other is not None and "committed" not in other.group(0)
    assert "1 (8.0 GiB each)" in page  # the lease table


# -- the flag, POST, waiting --------------------------------------------------------------


def test_mem_headroom_flag() -> None:
    from gpu_exporter.cli import _serve_config, build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--mem-headroom", "1GiB"])
    assert _serve_config(args, parser).mem_headroom_bytes == GIB
    default = parser.parse_args(["serve"])
    assert _serve_config(default, parser).mem_headroom_bytes == DEFAULT_HEADROOM_BYTES
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--mem-headroom", "lots"])


def test_a_larger_headroom_admits_fewer() -> None:
    s = build_stack(sim_of(SimGpu(0, DEFAULT_MODEL, Load("idle"))), mem_headroom_bytes=8 * GIB)
    s.sample()
    # (81,386 - 8,192) // 8,192 = 8 leases of 8 GiB, not 9
    codes = [s.client.get("/choose?mem=8GiB").status_code for _ in range(9)]
    assert codes == [200] * 8 + [503]


def test_post_takes_mem_in_the_body() -> None:
    s = idle(1)
    resp = s.client.post("/choose", data={"mem": "8GiB", "format": "json"})
    assert resp.status_code == 200 and resp.get_json()["lease"]["mem_bytes"] == 8 * GIB
    bad = s.client.post("/choose", data={"mem": "nope"}, headers=JSON)
    assert bad.status_code == 400 and bad.get_json()["error"]["param"] == "mem"


def test_a_memory_claim_waits_for_room_and_gets_it_on_release() -> None:
    sim = SimulatedNvml([SimGpu(0, DEFAULT_MODEL, Load("idle"))], clock=time.monotonic)
    with served(sim) as ex:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(ex.url + "/choose?mem=70GiB&lease=10m") as resp:
            token = resp.headers["X-GPU-Lease"]
        answers: list[int] = []

        def waiter() -> None:
            with opener.open(ex.url + "/choose?mem=20GiB&wait=20s&lease=1m") as resp:
                answers.append(resp.status)

        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.5)
        assert answers == []  # 70 + 20 GiB + headroom > 79.5 GiB: waiting
        release = urllib.request.Request(ex.url + f"/leases/{token}", method="DELETE")
        opener.open(release).close()
        thread.join(20)
        assert answers == [200]
        assert [x["mem_bytes"] for x in ex.leases()] == [20 * GIB]


def test_a_card_in_mig_mode_takes_no_share_and_is_not_the_best_card() -> None:
    lab = build_stack(
        sim_of(
            SimGpu(0, DEFAULT_MODEL, Load("idle"), mig=("3g.40gb", "3g.40gb")),
            SimGpu(1, DEFAULT_MODEL, Load("constant", memory_used_ratio=0.9, processes=1)),
        )
    )
    lab.sample()
    resp = lab.client.get("/choose?mem=16GiB", headers=JSON)
    assert resp.status_code == 503
    message = resp.get_json()["error"]["message"]
    assert "gpu 0: MIG mode is on" in message  # the filters' reason comes first
    assert f"the best card ({lab.sim.gpus[1].uuid})" in message
    assert lab.client.get("/choose?mem=4GiB").text.strip() == lab.sim.gpus[1].uuid
