"""Connection slots: how many connections are held, and which one goes when a new one comes.

Connections are counted by *peer* (:mod:`gpu_exporter.web.peers`: a remote address, or the
local user of a client on this host, whatever loopback address it binds). A connection is
*waiting* while it has not yet delivered a whole request: during the TLS handshake, while its
request head and body arrive, and idle between keep-alive requests; it is *stalled* while an
answer it was sent sits unread (over the write buffer). Only those are let go before their
time; one whose request a worker is handling is evicted only to give a peer its fair share.

* ``max_connections`` (:class:`~gpu_exporter.web.limits.Limits`) bounds every connection
  held (file descriptors, memory). At the cap a new connection evicts, in this order: the
  oldest stalled connection anywhere (its client is not reading), the oldest waiting one,
  or, when every connection is at work, the oldest of the peer that holds the most, if
  that peer holds more than one more than the newcomer's (the cap is shared fairly: one
  peer cannot take all of it). Otherwise the new connection is refused (closed at once, or
  a one-line 503 on plain HTTP).
* ``probe_connections``: beyond the cap, a few connections more are held for the probes
  (``/healthz``, ``/readyz``), so a probe always gets a connection; any other request on
  one is answered 503 ``too many connections``. When they are all taken the oldest one
  still waiting for its request goes.
* ``max_waiting_per_peer`` bounds the waiting connections of one peer. At the cap, the new
  connection evicts that peer's oldest waiting one instead of being refused: a slowloris
  attacker from the same peer as a good client (many clients behind one NAT) then only
  churns its own oldest, stalest connections, while the good client's fresh connection
  delivers its request in milliseconds and is no longer waiting.

Single-threaded: used only from the event loop.
"""

from __future__ import annotations

import enum
from typing import Generic, Protocol, TypeVar


class Evictable(Protocol):
    @property
    def address(self) -> str:
        """The peer (:meth:`gpu_exporter.web.peers.PeerIdentities.identify`)."""

    def evict(self) -> None:
        """Close now; :meth:`ConnectionSlots.release` follows."""


class Admitted(enum.Enum):
    """How :meth:`ConnectionSlots.admit` held a connection."""

    HELD = "within the cap"
    PROBE_ONLY = "beyond the cap, for a probe only"


Conn = TypeVar("Conn", bound=Evictable)


class ConnectionSlots(Generic[Conn]):
    """The connections held, and which of them wait or stall (oldest first)."""

    def __init__(
        self, max_connections: int, max_waiting_per_peer: int, probe_connections: int = 0
    ) -> None:
        self.max_connections = max_connections
        self.max_waiting_per_peer = max_waiting_per_peer
        self.probe_connections = probe_connections
        self.evicted = 0
        self._held: dict[Conn, None] = {}  # within the cap, oldest first
        self._by_peer: dict[str, dict[Conn, None]] = {}  # the same, by peer
        self._waiting: dict[Conn, None] = {}  # oldest first
        self._waiting_by_peer: dict[str, dict[Conn, None]] = {}
        self._stalled: dict[Conn, None] = {}  # answers unread, oldest first
        self._probes: dict[Conn, bool] = {}  # beyond the cap: conn → still waiting

    @property
    def held(self) -> int:
        return len(self._held) + len(self._probes)

    def connections(self) -> list[Conn]:
        return [*self._held, *self._probes]

    def admit(self, conn: Conn) -> Admitted | None:
        """Hold ``conn`` as waiting, evicting another if a cap says so; None: refused."""
        mine = self._waiting_by_peer.get(conn.address)
        if mine is not None and len(mine) >= self.max_waiting_per_peer:
            self._evict(next(iter(mine)))
        if len(self._held) >= self.max_connections:
            victim = self._victim(conn.address)
            if victim is None:
                return self._admit_probe(conn)
            self._evict(victim)
        self._held[conn] = None
        self._by_peer.setdefault(conn.address, {})[conn] = None
        self._wait(conn)
        return Admitted.HELD

    def working(self, conn: Conn) -> None:
        """``conn`` delivered a request: not evictable until it waits or stalls again."""
        if conn in self._probes:
            self._probes[conn] = False
            return
        self._stalled.pop(conn, None)
        if self._waiting.pop(conn, False) is None:
            mine = self._waiting_by_peer[conn.address]
            del mine[conn]
            if not mine:
                del self._waiting_by_peer[conn.address]

    def waiting(self, conn: Conn) -> None:
        """``conn`` waits again (keep-alive): the newest waiting connection."""
        if conn in self._held:
            self.working(conn)
            self._wait(conn)
        elif conn in self._probes:
            self._probes[conn] = True

    def stalled(self, conn: Conn) -> None:
        """``conn``'s answer is not being read: the first to go at the cap."""
        if conn in self._held:
            self.working(conn)
            self._stalled[conn] = None

    def release(self, conn: Conn) -> None:
        """``conn`` is closed (idempotent)."""
        if self._probes.pop(conn, None) is not None:
            return
        if conn in self._held:
            self.working(conn)
            del self._held[conn]
            mine = self._by_peer[conn.address]
            del mine[conn]
            if not mine:
                del self._by_peer[conn.address]

    def evict_waiting(self) -> None:
        """Let every waiting connection go (shutdown)."""
        for conn in [*self._waiting, *self._stalled, *(c for c, w in self._probes.items() if w)]:
            self._evict(conn)

    def _victim(self, peer: str) -> Conn | None:
        """Whom a newcomer from ``peer`` may evict at the cap (see the module docstring)."""
        for oldest in (self._stalled, self._waiting):
            if oldest:
                return next(iter(oldest))
        if not self._by_peer:
            return None
        most = max(self._by_peer.values(), key=len)
        if len(most) > len(self._by_peer.get(peer, ())) + 1:
            return next(iter(most))
        return None

    def _admit_probe(self, conn: Conn) -> Admitted | None:
        if len(self._probes) >= self.probe_connections:
            waiting = next((c for c, w in self._probes.items() if w), None)
            if waiting is None:
                return None
            self._evict(waiting)
        self._probes[conn] = True
        return Admitted.PROBE_ONLY

    def _wait(self, conn: Conn) -> None:
        self._waiting[conn] = None
        self._waiting_by_peer.setdefault(conn.address, {})[conn] = None

    def _evict(self, conn: Conn) -> None:
        self.release(conn)
        self.evicted += 1
        conn.evict()
