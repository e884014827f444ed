"""Failed basic-auth attempts per client address: how long each must wait before its next check.

Every wrong password costs one bcrypt check (about 70 ms of a core at cost 10). Forty
threads sending wrong passwords once took every request slot, and a scraper with the right
password got 503. Now (see :class:`~gpu_exporter.web.auth.BasicAuthMiddleware`):

* a password already proven is recognised from the success cache before anything here, so a
  good client is never slowed by anyone's failures, its own address's included;
* :class:`AuthThrottle`: a client address may have ``auth_free_failures`` failed (or still
  unanswered) checks; after that it must wait ``auth_base_delay_seconds`` after its last
  failure, doubling with each further failure up to ``auth_max_delay_seconds``
  (:class:`~gpu_exporter.web.limits.Limits`). Meanwhile it is answered 429 with
  ``Retry-After`` at once, without a bcrypt check. An address is forgotten after
  ``auth_forget_seconds`` without a failure, or at its first success; at most
  ``auth_max_addresses`` are remembered (the least recently failing go first);
* ``bcrypt_slots`` checks run at once, whoever asks (the middleware's semaphore).

Both run before the request limits (:mod:`gpu_exporter.web.middleware`), so a refused or
failing client never holds a request slot. Addresses are the TCP peer's: behind a reverse
proxy every client shares the proxy's, and the proxy should do its own limiting.

>>> class Frozen:
...     def time(self) -> float: return 0.0
...     def monotonic(self) -> float: return 100.0
>>> throttle = AuthThrottle(Frozen())
>>> for _ in range(Limits().auth_free_failures):
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
from gpu_exporter.web.limits import DEFAULT_LIMITS, Limits


@dataclass(slots=True)
class _Address:
    failures: int = 0
    pending: int = 0  # checks begun and not yet ended: they count as failures until they end
    last_failure: float = 0.0  # monotonic seconds


class AuthThrottle:
    """Failed checks per client address, and how long each must wait: thread-safe."""

    def __init__(self, clock: Clock, limits: Limits = DEFAULT_LIMITS) -> None:
        self._clock = clock
        self._free = limits.auth_free_failures
        self._base = limits.auth_base_delay_seconds
        self._max = limits.auth_max_delay_seconds
        self._forget = limits.auth_forget_seconds
        self._max_addresses = limits.auth_max_addresses
        self._addresses: collections.OrderedDict[str, _Address] = collections.OrderedDict()
        self._lock = threading.Lock()

    def begin(self, address: str) -> float:
        """0.0: ``address`` may have its credentials checked now (end it with :meth:`end`);
        otherwise the seconds it must wait first (it was not counted)."""
        now = self._clock.monotonic()
        with self._lock:
            record = self._addresses.get(address)
            forgotten = record is not None and now - record.last_failure > self._forget
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
