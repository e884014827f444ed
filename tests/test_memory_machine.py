"""Issue 16: a Hypothesis state machine over memory-sized and whole-card leases.

The lease table (:class:`~gpu_exporter.choose.leases.LeaseTable`) is driven with snapshots
built from a model of three 80 GiB cards: claims of a share (``mem``) or of whole cards,
releases, expiry, a lease's own processes growing, foreign processes growing, and restarts
from ``leases.json``. The invariants, precisely:

* **At grant time** a card that takes a memory lease has, counted from the model (not from
  :mod:`gpu_exporter.choose.memory`), foreign use + Σ over its memory leases (the new one
  included, at 0 attributed) of max(reserved, attributed) + headroom ≤ total − the driver's
  reservation. Growth *after* the grant (the lease's own processes past their reservation,
  or a foreign job) may push that sum over usable: the exporter never kills a process, and
  it then admits nothing more there until it falls back.
* **At every step**, on every card, Σ reserved of its memory leases + headroom ≤ usable: what
  was reserved never over-commits a card, whatever grew since.
* **A refusal is the rule's**: a memory claim of ``n`` cards is refused only when fewer than
  ``n`` cards admit it by the model's figures.
* **Never shared**: a card holds one whole-card lease and nothing else, or memory leases
  only.
* **Restarts keep everything**: the table read back from ``leases.json`` holds the same
  leases (memory sizes included).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from conftest import FakeClock
from gpu_exporter.choose.filters import Filters
from gpu_exporter.choose.leases import LeaseTable
from gpu_exporter.choose.memory import DEFAULT_HEADROOM_BYTES
from gpu_exporter.choose.rank import NotEnoughGpus
from gpu_exporter.choose.refusal import ApiError
from gpu_exporter.choose.statefile import StateFile
from gpu_exporter.model import GpuSample, ProcessSample, Snapshot

GIB, MIB = 2**30, 2**20
TOTAL, DRIVER = 80 * GIB, 534 * MIB
USABLE = TOTAL - DRIVER
HEADROOM = DEFAULT_HEADROOM_BYTES
CARDS = ("GPU-a", "GPU-b", "GPU-c")
FOREIGN_PID = 1  # every card's foreign job


class MemoryLeases(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.state = Path(tempfile.mkdtemp()) / "leases.json"
        self.table = self._open()
        self.sequence = 0
        self.foreign = dict.fromkeys(CARDS, 0)
        self.next_pid = 100
        # lease id → (token, pid, mem or None, cards, expiry); and pid → bytes used per card
        self.leases: dict[str, tuple[str, int, int | None, tuple[str, ...], float]] = {}
        self.used: dict[int, dict[str, int]] = {}

    def _open(self) -> LeaseTable:
        return LeaseTable(self.clock, state_file=self.state, max_ttl_seconds=3600)

    def _snapshot(self) -> Snapshot:
        self.sequence += 1
        gpus = []
        for index, uuid in enumerate(CARDS):
            procs = [ProcessSample(FOREIGN_PID, self.foreign[uuid])] if self.foreign[uuid] else []
            procs += [
                ProcessSample(pid, cards[uuid])
                for pid, cards in self.used.items()
                if cards.get(uuid)
            ]
            gpus.append(
                GpuSample(
                    index=index,
                    uuid=uuid,
                    up=True,
                    memory_total_bytes=TOTAL,
                    memory_reserved_bytes=DRIVER,
                    memory_used_bytes=sum(p.used_memory_bytes or 0 for p in procs),
                    memory_free_bytes=USABLE - sum(p.used_memory_bytes or 0 for p in procs),
                    compute_processes=len(procs),
                    processes=tuple(procs),
                )
            )
        now = self.clock.time()
        return Snapshot(
            now, self.clock.monotonic(), 0.0, True, True, tuple(gpus), sequence=self.sequence
        )

    def _forget_expired(self) -> None:
        now = self.clock.time()
        for lease_id in [k for k, v in self.leases.items() if v[4] <= now]:
            self._forget(lease_id)

    def _forget(self, lease_id: str) -> None:
        _, pid, *_ = self.leases.pop(lease_id)
        self.used.pop(pid, None)

    def _on(self, uuid: str) -> list[tuple[int, int | None]]:
        """(pid, mem) of the leases on ``uuid``."""
        return [(pid, mem) for _, pid, mem, cards, _ in self.leases.values() if uuid in cards]

    def _committed(self, uuid: str) -> int:
        shares = [
            max(mem, self.used.get(pid, {}).get(uuid, 0))
            for pid, mem in self._on(uuid)
            if mem is not None
        ]
        return self.foreign[uuid] + sum(shares)

    def _admits(self, uuid: str, mem: int) -> bool:
        if any(m is None for _, m in self._on(uuid)):
            return False
        return self._committed(uuid) + mem + HEADROOM <= USABLE

    # -- rules --------------------------------------------------------------------------
    @rule(
        size=st.sampled_from([1, 4, 8, 20, 40, 70]),
        n=st.integers(1, 2),
        ttl=st.sampled_from([30, 300]),
    )
    def claim_memory(self, size: int, n: int, ttl: int) -> None:
        mem = size * GIB
        snapshot = self._snapshot()
        self._forget_expired()
        admitting = [u for u in CARDS if self._admits(u, mem)]
        pid, self.next_pid = self.next_pid, self.next_pid + 1
        try:
            choice, lease = self.table.claim(
                snapshot, n, Filters(), ttl_seconds=ttl, requester="x", pids=[pid], mem=mem
            )
        except NotEnoughGpus:
            assert len(admitting) < n, (admitting, n)
            return
        assert lease is not None and lease.mem_bytes == mem
        cards = tuple(g.uuid for g in choice.chosen)
        assert len(set(cards)) == n
        for uuid in cards:
            assert uuid in admitting
            # at grant time, counted from the model: committed with the new share ≤ usable
            assert self._committed(uuid) + mem + HEADROOM <= USABLE
        # best fit: no admitting card left out has less room than one chosen
        if n == 1:
            room = {u: USABLE - self._committed(u) for u in admitting}
            assert room[cards[0]] == min(room.values())
        assert lease.token is not None
        self.leases[lease.id] = (lease.token, pid, mem, cards, self.clock.time() + ttl)
        self.used[pid] = {}

    @rule(ttl=st.sampled_from([30, 300]))
    def claim_whole(self, ttl: int) -> None:
        snapshot = self._snapshot()
        self._forget_expired()
        free = [u for u in CARDS if not self._on(u)]
        try:
            choice, lease = self.table.claim(snapshot, 1, Filters(), ttl_seconds=ttl, requester="x")
        except NotEnoughGpus:
            assert not free
            return
        assert lease is not None and lease.mem_bytes is None
        (uuid,) = (g.uuid for g in choice.chosen)
        assert uuid in free
        assert lease.token is not None
        self.leases[lease.id] = (lease.token, 0, None, (uuid,), self.clock.time() + ttl)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self._forget_expired()
        if not self.leases:
            return
        lease_id = data.draw(st.sampled_from(list(self.leases)))  # claim order
        self.table.release(self.table.authorize(self.leases[lease_id][0]))
        self._forget(lease_id)

    @rule(seconds=st.sampled_from([5, 40, 400]))
    def time_passes(self, seconds: int) -> None:
        self.clock.advance(seconds)
        self.table.prune(self._snapshot())
        self._forget_expired()

    @rule(data=st.data(), by=st.sampled_from([1, 6, 30]))
    def attributed_use_grows(self, data: st.DataObject, by: int) -> None:
        held = [(k, v) for k, v in self.leases.items() if v[2] is not None]
        if not held:
            return
        _, (_, pid, _, cards, _) = data.draw(st.sampled_from(held))
        uuid = data.draw(st.sampled_from(cards))
        self.used[pid][uuid] = self.used[pid].get(uuid, 0) + by * GIB
        self.table.prune(self._snapshot())

    @rule(uuid=st.sampled_from(CARDS), by=st.sampled_from([-20, 2, 15]))
    def foreign_use_changes(self, uuid: str, by: int) -> None:
        self.foreign[uuid] = min(USABLE // 2, max(0, self.foreign[uuid] + by * GIB))
        self.table.prune(self._snapshot())

    @rule()
    def restart(self) -> None:
        before = {x.id: (x.mem_bytes, x.uuids, x.expires_at) for x in self.table.active()}
        self.table = self._open()
        after = {x.id: (x.mem_bytes, x.uuids, x.expires_at) for x in self.table.active()}
        assert after == before

    # -- invariants ---------------------------------------------------------------------
    @invariant()
    def the_table_holds_what_the_model_holds(self) -> None:
        self._forget_expired()
        active = {x.id: (x.mem_bytes, x.uuids) for x in self.table.active()}
        assert active == {k: (v[2], v[3]) for k, v in self.leases.items()}

    @invariant()
    def whole_and_memory_leases_never_share_a_card(self) -> None:
        for uuid in CARDS:
            on = [mem for _, mem in self._on(uuid)]
            assert on.count(None) == 0 or on == [None], (uuid, on)

    @invariant()
    def reservations_alone_never_over_commit_a_card(self) -> None:
        for uuid in CARDS:
            reserved = sum(mem for _, mem in self._on(uuid) if mem is not None)
            assert reserved + HEADROOM <= USABLE


TestMemoryLeases = MemoryLeases.TestCase
TestMemoryLeases.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_refused_claim_saves_nothing_and_a_failed_write_grants_nothing(tmp_path: Path) -> None:
    """A memory claim is held only once leases.json is written (as for whole cards)."""
    clock = FakeClock()

    def refuse(path: Path, text: str) -> None:
        raise OSError(28, "No space left on device")

    table = LeaseTable(clock, state_file=StateFile(tmp_path / "leases.json", write=refuse))
    machine = MemoryLeases()
    machine.clock = clock
    snapshot = machine._snapshot()
    with pytest.raises(ApiError, match="No space left") as refused:
        table.claim(snapshot, 1, Filters(), ttl_seconds=60, requester="x", mem=8 * GIB)
    assert refused.value.code == "state_unwritable"
    assert not table.active()
