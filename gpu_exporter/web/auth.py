"""HTTP basic auth: bcrypt users, who must authenticate (``--auth-scope``), and the middleware.

``basic_auth_users`` maps user names to bcrypt hashes (``gpu-exporter hash-password`` makes
one). Passwords are checked in equal time for known and unknown users; the probes
(``/healthz``, ``/readyz``) never need credentials. The middleware hands the user it
authenticated to the app as ``REMOTE_USER`` (and removes any ``REMOTE_USER`` it did not set),
which is how ``--lease-admins`` are recognised. Credentials a request carries are checked on
an open path too (``--auth-scope writes``), so that a user sees there what it may; a request
that proves no user while users are configured is marked :data:`ANONYMOUS`, and the views
then show counts and GPU states, never who holds what or where files are.

Wrong passwords must not starve right ones (forty threads of them once took every request
slot): a password already proven passes from the success cache at once; any other is checked
only if its client (:func:`~gpu_exporter.web.peers.peer`: its address, or the local user)
is not throttled (:class:`AuthThrottle`: after
``auth_free_failures`` failed or unanswered checks, 429 with ``Retry-After`` until
``auth_base_delay_seconds`` after the last failure, doubling per failure up to
``auth_max_delay_seconds``; forgotten on success or after ``auth_forget_seconds``, at most
``auth_max_addresses`` remembered) and one of ``bcrypt_slots`` comes free within
``bcrypt_wait_seconds`` (else 503 ``auth_busy``): :class:`~gpu_exporter.web.limits.Limits`.
Remote clients are the TCP peer's address: behind a reverse proxy every client shares the
proxy's, and the proxy should do its own limiting.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import collections
import getpass
import hmac
import math
import re
import secrets
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from hashlib import sha256
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import bcrypt
from werkzeug.wrappers import Request, Response

from gpu_exporter.clock import Clock
from gpu_exporter.counters import AUTH_BUSY, AUTH_THROTTLED, RequestCounter
from gpu_exporter.units import parse_duration, plural
from gpu_exporter.web.errors import error_response
from gpu_exporter.web.limits import DEFAULT_LIMITS, EXEMPT_PATHS, Limits, WsgiApp, refusal
from gpu_exporter.web.peers import peer
from gpu_exporter.web.yamlfields import WebConfigError

if TYPE_CHECKING:
    from gpu_exporter.web.webconfig import WebConfigWatcher

REALM = "gpu-exporter"
AUTH_SCOPES = ("all", "writes")
_BCRYPT = re.compile(r"^\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}$")
# Unknown users are checked against this (any well-formed hash will do) at the usual cost.
_DUMMY_SALT_AND_HASH = "QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi"
BCRYPT_MAX_PASSWORD_BYTES = 72
AUTH_CACHE_SIZE = 256


def parse_users(value: Any) -> dict[str, bytes]:
    """``basic_auth_users``: user name → bcrypt hash (checked for form and cost, not read)."""
    where = "basic_auth_users"
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError(f"{where}: expected a mapping of user names to bcrypt hashes")
    users = {}
    for user, hashed in value.items():
        if not isinstance(user, str) or not user or ":" in user:
            raise WebConfigError(
                f"{where}: user name {user!r} must be a non-empty string without ':' "
                "(quote names YAML would read as numbers)"
            )
        if not isinstance(hashed, str) or not _BCRYPT.match(hashed):
            raise WebConfigError(
                f"{where}.{user}: not a bcrypt hash ($2b$10$… or $2y$10$…; "
                "make one with `gpu-exporter hash-password`)"
            )
        cost = int(hashed[4:6])
        if not 4 <= cost <= 31:
            raise WebConfigError(f"{where}.{user}: bcrypt cost {cost} is outside 4-31")
        users[user] = hashed.encode("ascii")
    return users


class BasicAuth:
    """bcrypt verification in equal time for known and unknown users, with a small cache.

    Only successes are cached, keyed on the user and a keyed hash of the password (a process
    secret, so the cache never holds a fast unsalted hash of a password); a new config makes
    a new :class:`BasicAuth`, so a changed or removed user is never served from the cache.
    """

    def __init__(self, users: Mapping[str, bytes], cache_size: int = AUTH_CACHE_SIZE) -> None:
        self._users = dict(users)
        costs = collections.Counter(int(h[4:6]) for h in self._users.values())
        # The most common cost (the highest on a tie): unknown users take as long as most users.
        cost = max(costs, key=lambda c: (costs[c], c)) if costs else 10
        self._dummy = f"$2b${cost:02d}${_DUMMY_SALT_AND_HASH}".encode("ascii")
        self._key = secrets.token_bytes(32)
        self._cache: collections.OrderedDict[tuple[str, bytes], None] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._users)

    def cached(self, user: str, password: bytes) -> bool:
        """Was this password proven for ``user`` lately? No bcrypt: a keyed hash and a look-up."""
        key = (user, hmac.new(self._key, password, sha256).digest())
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return True
        return False

    def verify(self, user: str, password: bytes) -> bool:
        if self.cached(user, password):
            return True
        if len(password) > BCRYPT_MAX_PASSWORD_BYTES:
            return False  # bcrypt would look at 72 bytes only; never accept such a password
        stored = self._users.get(user)
        ok = bcrypt.checkpw(password, stored if stored is not None else self._dummy)
        if not ok or stored is None:
            return False
        with self._lock:
            self._cache[(user, hmac.new(self._key, password, sha256).digest())] = None
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return True


def credentials(header: str | None) -> tuple[str, bytes] | None:
    """(user, password) from an ``Authorization: Basic …`` header; None if it has none."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    raw_user, sep, password = decoded.partition(b":")
    if not sep:
        return None
    try:
        return raw_user.decode("utf-8"), password
    except UnicodeDecodeError:
        return None


# ------------------------------------------------------------------------ who must authenticate

# The environ key set on a request that proved no user while basic auth has users.
ANONYMOUS = "gpu_exporter.anonymous"


def is_anonymous(environ: Mapping[str, Any]) -> bool:
    """Did this request prove no user where basic auth could have asked for one? Views then
    name no lease holder, requester or file (docs/design.md, "Unauthenticated clients")."""
    return bool(environ.get(ANONYMOUS))


# Read-only endpoints that --auth-scope=writes leaves open (GET and HEAD only).
READ_PATHS = frozenset({"/", "/metrics", "/healthz", "/readyz", "/gpus", "/openapi.json"})


def is_advice_only(query_string: str) -> bool:
    """True for a ``/choose`` query that claims nothing (every ``lease`` value is zero)."""
    values = parse_qs(query_string, keep_blank_values=True).get("lease")
    if not values:
        return False  # the default lease is 60 s
    try:
        return all(parse_duration(v) == 0 for v in values)
    except ValueError:
        return False


def needs_auth(
    scope: str,
    method: str,
    path: str,
    query_string: str,
    excluded: Iterable[str] = (),
    *,
    has_body: bool = False,
    read_paths: frozenset[str] = READ_PATHS,
) -> bool:
    """Whether this request must carry valid credentials (when users are configured)."""
    if path in EXEMPT_PATHS or path in excluded:  # the probes: kubelet has no password
        return False
    if scope == "all":
        return True
    if path == "/choose" and (method in ("GET", "HEAD") or (method == "POST" and not has_body)):
        # Advice only (lease=0) is a read, and so is HEAD, which never claims. A POST with a
        # body might carry its own lease, so only a bodiless POST (what the Python client
        # sends) is judged by its query string.
        return method != "HEAD" and not is_advice_only(query_string)
    if method not in ("GET", "HEAD"):
        return True  # POST /choose with a body, DELETE /leases/…, renewals: writes
    return path not in read_paths  # /leases and anything unknown: protected


# ------------------------------------------------------------------------ WSGI middleware


class BasicAuthMiddleware:
    """Answers 401 unless the request is open in this scope or carries valid credentials.

    Credentials not in the success cache are checked only if the client address is not
    throttled (429 ``auth_throttled``) and a bcrypt slot comes free promptly (503
    ``auth_busy``), sized by ``limits``. Both are counted in
    ``rejections`` by that code.
    """

    def __init__(
        self,
        app: WsgiApp,
        watcher: WebConfigWatcher,
        scope: str = "all",
        *,
        limits: Limits,
        clock: Clock,
        rejections: RequestCounter | None = None,
        telemetry_path: str = "/metrics",
    ) -> None:
        if scope not in AUTH_SCOPES:
            raise ValueError(f"auth scope must be one of {', '.join(AUTH_SCOPES)}")
        self.app = app
        self._watcher = watcher
        self._scope = scope
        self._throttle = AuthThrottle(clock, limits)
        self._bcrypt = threading.BoundedSemaphore(limits.bcrypt_slots)
        self._bcrypt_wait = limits.bcrypt_wait_seconds
        self._rejections = rejections if rejections is not None else RequestCounter()
        self._read_paths = (READ_PATHS - {"/metrics"}) | {telemetry_path}

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        active = self._watcher.active  # one config for the whole request
        environ.pop("REMOTE_USER", None)  # only a user proven here may act as one (admins)
        environ.pop(ANONYMOUS, None)
        if not active.auth:
            return self.app(environ, start_response)
        path = environ.get("PATH_INFO", "") or "/"
        header = environ.get("HTTP_AUTHORIZATION")
        excluded = active.config.auth_excluded_paths
        required = needs_auth(
            self._scope,
            environ.get("REQUEST_METHOD", "GET"),
            path,
            environ.get("QUERY_STRING", ""),
            excluded,
            has_body=environ.get("CONTENT_LENGTH", "") not in ("", "0")
            or "HTTP_TRANSFER_ENCODING" in environ,
            read_paths=self._read_paths,
        )
        found = credentials(header)
        # Basic credentials are checked on an open path too, but never on the probes or an
        # excluded path, which stay open whatever a client sends.
        if required or (found and path not in EXEMPT_PATHS and path not in excluded):
            refusal = None if found is None else self._check(active.auth, *found, environ)
            if found is None or refusal is not None:
                message = (
                    "wrong user name or password"
                    if header
                    else "authentication required (HTTP basic auth)"
                )
                resp = refusal or error_response(Request(environ), 401, "unauthorized", message)
                if resp.status_code == 401:
                    resp.headers["WWW-Authenticate"] = f'Basic realm="{REALM}", charset="UTF-8"'
                return resp(environ, start_response)
            environ["REMOTE_USER"] = found[0]
        else:
            environ[ANONYMOUS] = True
        return self.app(environ, start_response)

    def _check(
        self, auth: BasicAuth, user: str, password: bytes, environ: dict[str, Any]
    ) -> Response | None:
        """None if ``user``/``password`` are right; else the answer: 401, 429 or 503."""
        if auth.cached(user, password):  # a good client never waits for anyone's failures
            return None
        address = peer(environ)  # a local client is its user: one throttle, any source address
        wait = self._throttle.begin(address)
        if wait > 0:
            seconds = max(1, math.ceil(wait))
            message = f"too many failed logins from {address}; retry in {plural(seconds, 'second')}"
            return refusal(environ, 429, AUTH_THROTTLED, message, seconds, self._rejections)
        if not self._bcrypt.acquire(timeout=self._bcrypt_wait):
            self._throttle.cancel(address)
            message = "too many logins being checked; retry in a second"
            return refusal(environ, 503, AUTH_BUSY, message, 1, self._rejections)
        ok = False
        try:
            ok = auth.verify(user, password)
        finally:
            self._bcrypt.release()
            self._throttle.end(address, ok=ok)
        if ok:
            return None
        return error_response(Request(environ), 401, "unauthorized", "wrong user name or password")


@dataclass(slots=True)
class _Address:
    failures: int = 0
    pending: int = 0  # checks begun and not yet ended: they count as failures until they end
    last_failure: float = 0.0  # monotonic seconds


class AuthThrottle:
    """Failed checks per peer (web.peers: a remote address, or a local user), and how long
    each must wait: thread-safe."""

    def __init__(self, clock: Clock, limits: Limits = DEFAULT_LIMITS) -> None:
        self._clock, self._limits = clock, limits
        self._addresses: collections.OrderedDict[str, _Address] = collections.OrderedDict()
        self._lock = threading.Lock()

    def begin(self, address: str) -> float:
        """0.0: ``address`` may have its credentials checked now (end it with :meth:`end`);
        otherwise the seconds it must wait first (it was not counted)."""
        now = self._clock.monotonic()
        with self._lock:
            record = self._addresses.get(address)
            forgotten = (
                record is not None and now - record.last_failure > self._limits.auth_forget_seconds
            )
            if record is not None and record.pending == 0 and forgotten:
                del self._addresses[address]
                record = None
            if record is None:
                record = self._addresses[address] = _Address()
                while len(self._addresses) > self._limits.auth_max_addresses:
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
        free, limits = self._limits.auth_free_failures, self._limits
        if record.failures + record.pending < free:
            return 0.0
        if record.failures < free or record.pending:
            return 1.0  # its checks still running may succeed: ask again in a second
        delay = limits.auth_base_delay_seconds * 2.0 ** min(record.failures - free, 32)
        return max(0.0, record.last_failure + min(limits.auth_max_delay_seconds, delay) - now)


# ------------------------------------------------------------------------ hash-password


def hash_password_main(args: argparse.Namespace) -> int:
    """``gpu-exporter hash-password``: a bcrypt hash of a password read from the terminal or
    stdin, for ``basic_auth_users``; the exit status."""
    if not 4 <= args.cost <= 31:
        print("gpu-exporter hash-password: --cost must be 4 to 31", file=sys.stderr)
        return 2
    if sys.stdin.isatty():
        password = getpass.getpass("Password: ")
        if getpass.getpass("Again: ") != password:
            print("gpu-exporter hash-password: the passwords differ", file=sys.stderr)
            return 1
    else:
        password = sys.stdin.readline().removesuffix("\n").removesuffix("\r")
    data = password.encode("utf-8")
    if not data:
        print("gpu-exporter hash-password: empty password", file=sys.stderr)
        return 1
    if len(data) > BCRYPT_MAX_PASSWORD_BYTES:
        print(
            f"gpu-exporter hash-password: bcrypt uses at most {BCRYPT_MAX_PASSWORD_BYTES} "
            "bytes of a password; choose a shorter one",
            file=sys.stderr,
        )
        return 1
    print(bcrypt.hashpw(data, bcrypt.gensalt(rounds=args.cost)).decode("ascii"))
    return 0
