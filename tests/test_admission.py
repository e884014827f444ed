"""Which connection goes at the cap (:class:`~gpu_exporter.web.admission.ConnectionSlots`),
without sockets: the order the real-socket tests in test_connections.py rely on."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_exporter.web.admission import Admitted, ConnectionSlots


@dataclass(eq=False)
class Conn:
    address: str
    evicted: bool = False

    def evict(self) -> None:
        self.evicted = True


def test_an_unread_answer_goes_before_a_waiting_connection() -> None:
    slots: ConnectionSlots[Conn] = ConnectionSlots(2, 10)
    waiting, stalled = Conn("a"), Conn("a")
    assert slots.admit(waiting) is slots.admit(stalled) is Admitted.HELD
    slots.working(stalled)
    slots.stalled(stalled)
    assert slots.admit(Conn("b")) is Admitted.HELD
    assert stalled.evicted and not waiting.evicted


def test_busy_connections_give_way_only_to_a_peer_holding_fewer() -> None:
    slots: ConnectionSlots[Conn] = ConnectionSlots(3, 10)
    hog = [Conn("hog") for _ in range(3)]
    for conn in hog:
        slots.admit(conn)
        slots.working(conn)
    assert slots.admit(Conn("hog")) is None  # its own share: refused
    other = Conn("other")
    assert slots.admit(other) is Admitted.HELD and hog[0].evicted
    slots.working(other)
    # hog 2, other 1: another newcomer from "other" (holding 1) may not evict the hog's
    assert slots.admit(Conn("other")) is None
    assert slots.held == 3


def test_probes_get_connections_beyond_the_cap() -> None:
    slots: ConnectionSlots[Conn] = ConnectionSlots(1, 10, probe_connections=2)
    busy = Conn("a")
    slots.admit(busy)
    slots.working(busy)
    first, second, third = Conn("a"), Conn("a"), Conn("a")
    assert slots.admit(first) is slots.admit(second) is Admitted.PROBE_ONLY
    assert slots.admit(third) is Admitted.PROBE_ONLY and first.evicted  # the oldest waiting
    slots.working(second)
    slots.working(third)
    assert slots.admit(Conn("a")) is None  # every probe connection at work
    slots.release(second)
    assert slots.admit(Conn("a")) is Admitted.PROBE_ONLY
    assert slots.held == 3 and not busy.evicted
