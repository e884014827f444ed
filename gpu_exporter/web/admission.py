"""Connection slots: how many connections are held, and which one goes when a new one comes.

A connection is *waiting* while it has not yet delivered a whole request: during the TLS
handshake, while its request head and body arrive, and idle between keep-alive requests. Only
waiting connections are ever let go; one whose request a worker is handling, or whose answer
is being written, is never evicted.

* ``max_connections`` (:class:`~gpu_exporter.web.limits.Limits`) bounds every connection
  held (file descriptors, memory). At the cap, a new connection evicts the oldest waiting
  one anywhere; if none is waiting, the new one is refused (closed at once, or a one-line
  503 on plain HTTP).
* ``max_waiting_per_address`` bounds the waiting connections of one client address. At the
  cap, the new connection evicts that address's oldest waiting one instead of being refused:
  a slowloris attacker from the same address as a good client (every loopback client is
  127.0.0.1; many clients behind one NAT) then only churns its own oldest, stalest
  connections, while the good client's fresh connection delivers its request in
  milliseconds and is no longer waiting.

Single-threaded: used only from the event loop.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar


class Evictable(Protocol):
    @property
    def address(self) -> str: ...

    def evict(self) -> None:
        """Close now; :meth:`ConnectionSlots.release` follows."""


Conn = TypeVar("Conn", bound=Evictable)


class ConnectionSlots(Generic[Conn]):
    """The connections held, and which of them wait (oldest first, in all and per address)."""

    def __init__(self, max_connections: int, max_waiting_per_address: int) -> None:
        self.max_connections = max_connections
        self.max_waiting_per_address = max_waiting_per_address
        self.evicted = 0
        self._held: set[Conn] = set()
        self._waiting: dict[Conn, None] = {}  # oldest first
        self._by_address: dict[str, dict[Conn, None]] = {}

    @property
    def held(self) -> int:
        return len(self._held)

    def connections(self) -> list[Conn]:
        return list(self._held)

    def admit(self, conn: Conn) -> bool:
        """Hold ``conn`` as waiting, evicting another if a cap says so; False: refused."""
        mine = self._by_address.get(conn.address)
        if mine is not None and len(mine) >= self.max_waiting_per_address:
            self._evict(next(iter(mine)))
        if len(self._held) >= self.max_connections:
            if not self._waiting:
                return False
            self._evict(next(iter(self._waiting)))
        self._held.add(conn)
        self._wait(conn)
        return True

    def working(self, conn: Conn) -> None:
        """``conn`` delivered a request: not evictable until it waits again."""
        if self._waiting.pop(conn, False) is None:
            mine = self._by_address[conn.address]
            del mine[conn]
            if not mine:
                del self._by_address[conn.address]

    def waiting(self, conn: Conn) -> None:
        """``conn`` waits again (keep-alive): the newest waiting connection."""
        if conn in self._held:
            self.working(conn)
            self._wait(conn)

    def release(self, conn: Conn) -> None:
        """``conn`` is closed (idempotent)."""
        if conn in self._held:
            self.working(conn)
            self._held.discard(conn)

    def evict_waiting(self) -> None:
        """Let every waiting connection go (shutdown)."""
        for conn in list(self._waiting):
            self._evict(conn)

    def _wait(self, conn: Conn) -> None:
        self._waiting[conn] = None
        self._by_address.setdefault(conn.address, {})[conn] = None

    def _evict(self, conn: Conn) -> None:
        self.release(conn)
        self.evicted += 1
        conn.evict()
