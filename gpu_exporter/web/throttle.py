"""Failed basic-auth attempts: slow down the address that makes them, and bound bcrypt work.

Every wrong password costs one bcrypt check (about 70 ms of a core at cost 10). Forty
threads sending wrong passwords once took every request slot, and a scraper with the right
password got 503. Now (see :class:`~gpu_exporter.web.auth.BasicAuthMiddleware`):

* a password already proven is recognised from the success cache before anything here, so a
  good client is never slowed by anyone's failures, its own address's included;
* :class:`AuthThrottle`: a client address may have :data:`FREE_FAILURES` failed (or still
  unanswered) checks; after that it must wait :data:`BASE_DELAY_SECONDS` after its last
  failure, doubling with each further failure up to :data:`MAX_DELAY_SECONDS`. Meanwhile it
  is answered 429 with ``Retry-After`` at once, without a bcrypt check. An address is
  forgotten after :data:`FORGET_SECONDS` without a failure, or at its first success; at most
  :data:`MAX_ADDRESSES` are remembered (the least recently failing go first);
* :class:`BcryptGate`: at most :data:`BCRYPT_SLOTS` checks run at once, whoever asks; a
  request that finds none free within :data:`BCRYPT_WAIT_SECONDS` is answered 503
  ``auth_busy`` with ``Retry-After: 1`` rather than queued.

Both run before the request limits (:mod:`gpu_exporter.web.middleware`), so a refused or
failing client never holds a request slot. Addresses are the TCP peer's: behind a reverse
proxy every client shares the proxy's, and the proxy should do its own limiting.

>>> class Frozen:
...     def time(self) -> float: return 0.0
...     def monotonic(self) -> float: return 100.0
>>> throttle = AuthThrottle(Frozen())
>>> for _ in range(FREE_FAILURES):
...     assert throttle.begin("10.0.0.9") == 0.0
...     throttle.end("10.0.0.9", ok=False)
>>> throttle.begin("10.0.0.9"), throttle.begin("10.0.0.1")
(1.0, 0.0)
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

from gpu_exporter.clock import Clock

FREE_FAILURES = 5  # a typo or two, a stale secret retried a few times: never throttled
BASE_DELAY_SECONDS = 1.0  # the wait after the FREE_FAILURES-th failure
MAX_DELAY_SECONDS = 60.0  # each further failure doubles the wait, up to this
FORGET_SECONDS = 600.0  # no failure for this long: the address starts afresh
MAX_ADDRESSES = 4096  # remembered at once; the least recently failing are forgotten first
BCRYPT_SLOTS = 4  # bcrypt checks at once, from every client together
BCRYPT_WAIT_SECONDS = 0.25  # how long a request may wait for one before 503 auth_busy


@dataclass(slots=True)
class _Address:
    failures: int = 0
    pending: int = 0  # checks begun and not yet ended: they count as failures until they end
    last_failure: float = 0.0  # monotonic seconds


class AuthThrottle:
    """Failed checks per client address, and how long each must wait: thread-safe."""

    def __init__(
        self,
        clock: Clock,
        *,
        free_failures: int = FREE_FAILURES,
        base_delay_seconds: float = BASE_DELAY_SECONDS,
        max_delay_seconds: float = MAX_DELAY_SECONDS,
        max_addresses: int = MAX_ADDRESSES,
    ) -> None:
        self._clock = clock
        self._free = free_failures
        self._base = base_delay_seconds
        self._max = max_delay_seconds
        self._max_addresses = max_addresses
        self._addresses: collections.OrderedDict[str, _Address] = collections.OrderedDict()
        self._lock = threading.Lock()

    def begin(self, address: str) -> float:
        """0.0: ``address`` may have its credentials checked now (end it with :meth:`end`);
        otherwise the seconds it must wait first (it was not counted)."""
        now = self._clock.monotonic()
        with self._lock:
            record = self._addresses.get(address)
            forgotten = record is not None and now - record.last_failure > FORGET_SECONDS
            if record is not None and record.pending == 0 and forgotten:
                del self._addresses[address]
                record = None
            if record is None:
                record = self._addresses[address] = _Address()
                while len(self._addresses) > self._max_addresses:
                    self._addresses.popitem(last=False)
            wait = self._wait(record, now)
            if wait > 0:
                return wait
            record.pending += 1
            return 0.0

    def end(self, address: str, *, ok: bool) -> None:
        """The check :meth:`begin` allowed is over: ``ok`` forgets the address's failures."""
        now = self._clock.monotonic()
        with self._lock:
            record = self._addresses.get(address)
            if record is None:  # forgotten meanwhile (too many addresses)
                if ok:
                    return
                record = self._addresses[address] = _Address()
            record.pending = max(0, record.pending - 1)
            if ok:
                if record.pending == 0:
                    del self._addresses[address]
                else:
                    record.failures = 0
                return
            record.failures += 1
            record.last_failure = now
            self._addresses.move_to_end(address)

    def cancel(self, address: str) -> None:
        """The check :meth:`begin` allowed did not happen (no bcrypt slot): nothing counts."""
        with self._lock:
            record = self._addresses.get(address)
            if record is not None:
                record.pending = max(0, record.pending - 1)

    def _wait(self, record: _Address, now: float) -> float:
        if record.failures + record.pending < self._free:
            return 0.0
        if record.failures < self._free or record.pending:
            return 1.0  # its checks still running may succeed: ask again in a second
        delay = min(self._max, self._base * 2.0 ** min(record.failures - self._free, 32))
        return max(0.0, record.last_failure + delay - now)


class BcryptGate:
    """At most ``slots`` bcrypt checks at once; :meth:`enter` waits briefly for a slot."""

    def __init__(
        self, slots: int = BCRYPT_SLOTS, wait_seconds: float = BCRYPT_WAIT_SECONDS
    ) -> None:
        self._slots = threading.BoundedSemaphore(slots)
        self._wait = wait_seconds

    def enter(self) -> bool:
        """True with a slot (give it back with :meth:`leave`); False if none came in time."""
        return self._slots.acquire(timeout=self._wait)

    def leave(self) -> None:
        self._slots.release()
