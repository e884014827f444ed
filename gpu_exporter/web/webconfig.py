"""``--web-config-file``: TLS, basic auth and extra headers, in the exporter-toolkit format.

The file is the YAML that Prometheus' own exporters read with ``--web.config.file``
(https://github.com/prometheus/exporter-toolkit, docs/web-configuration.md)::

    tls_server_config:
      cert_file: server.crt          # relative paths are relative to this file
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert
      client_ca_file: clients-ca.pem
      min_version: TLS12             # the default; TLS10 … TLS13
    http_server_config:
      headers:
        Strict-Transport-Security: max-age=31536000
    basic_auth_users:
      prometheus: $2b$10$…           # bcrypt; `gpu-exporter hash-password` makes one
    auth_excluded_paths: [/gpus]    # /healthz and /readyz are always open

What Python's :mod:`ssl` cannot do is refused or warned about, never silently dropped:

* ``client_auth_type: RequireAnyClientCert`` (a certificate from anyone, unverified) and
  ``client_allowed_sans`` are **errors**: honouring them less strictly would let in clients
  the file means to keep out. ``rate_limit`` is an error too: it is not implemented here.
* ``client_auth_type: RequestClientCert`` asks for a certificate and ignores it; Python can
  only ask for one it then verifies, so it is served as ``NoClientCert`` (same access) with a
  warning.
* ``curve_preferences`` is ignored with a warning (OpenSSL's defaults X25519, P-256, P-384…
  are used); ``http2`` is accepted and ignored (the server speaks HTTP/1.1).

Everything else is honoured: ``cipher_suites`` (Go's names, mapped to OpenSSL's, for TLS ≤ 1.2
as in Go), ``prefer_server_cipher_suites``, inline ``cert``/``key``/``client_ca``.

The file is re-read when it or a file it names changes (checked once a second); a broken new
version is logged and counted, and the previous one stays in force.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import collections
import getpass
import hmac
import logging
import re
import secrets
import ssl
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import bcrypt
import yaml

from gpu_exporter.client.transport import is_loopback

log = logging.getLogger(__name__)

REALM = "gpu-exporter"
AUTH_SCOPES = ("all", "writes")
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
CLIENT_AUTH_TYPES = (
    "NoClientCert",
    "RequestClientCert",
    "RequireAnyClientCert",
    "VerifyClientCertIfGiven",
    "RequireAndVerifyClientCert",
)
# Go's names (crypto/tls CipherSuites()) → OpenSSL's. The TLS 1.3 suites are accepted and,
# as in Go, not configurable.
CIPHER_SUITES = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_AES_128_GCM_SHA256": "",
    "TLS_AES_256_GCM_SHA384": "",
    "TLS_CHACHA20_POLY1305_SHA256": "",
}
CURVES = ("CurveP256", "CurveP384", "CurveP521", "X25519")
# The headers exporter-toolkit lets a file set, with the values it accepts (None: any).
HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
_BCRYPT = re.compile(r"^\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}$")
# Unknown users are checked against this (any well-formed hash will do) at the usual cost.
_DUMMY_SALT_AND_HASH = "QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi"
BCRYPT_MAX_PASSWORD_BYTES = 72
AUTH_CACHE_SIZE = 256
RELOAD_CHECK_SECONDS = 1.0


class WebConfigError(ValueError):
    """The web config is unusable; the message is one line and names the key."""


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert_file: Path | None
    key_file: Path | None
    cert: str | None  # inline PEM
    key: str | None
    client_ca_file: Path | None
    client_ca: str | None
    client_auth_type: str
    min_version: ssl.TLSVersion
    max_version: ssl.TLSVersion
    cipher_suites: tuple[str, ...]  # OpenSSL names
    prefer_server_cipher_suites: bool

    @property
    def requires_client_cert(self) -> bool:
        return self.client_auth_type == "RequireAndVerifyClientCert"

    def files(self) -> tuple[Path, ...]:
        return tuple(p for p in (self.cert_file, self.key_file, self.client_ca_file) if p)


@dataclass(frozen=True, slots=True)
class WebConfig:
    tls: TlsConfig | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)  # user → bcrypt hash
    headers: tuple[tuple[str, str], ...] = ()
    auth_excluded_paths: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


# ---------------------------------------------------------------------------- parsing


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (a second user entry must not win silently)."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise WebConfigError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r}")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def _section(value: Any, where: str, keys: Iterable[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError(f"{where}: expected a mapping, got {_kind(value)}")
    allowed = tuple(keys)
    for key in value:
        if key not in allowed:
            raise WebConfigError(
                f"{_join(where, key)}: unknown key; expected one of {', '.join(allowed)}"
            )
    return value


def _join(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def _string(section: dict[str, Any], key: str, where: str) -> str | None:
    value = section.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise WebConfigError(f"{_join(where, key)}: expected a string, got {_kind(value)}")
    return value


def _strings(section: dict[str, Any], key: str, where: str) -> list[str]:
    value = section.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise WebConfigError(f"{_join(where, key)}: expected a list of strings")
    return value


def _bool(section: dict[str, Any], key: str, where: str, default: bool) -> bool:
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise WebConfigError(f"{_join(where, key)}: expected true or false, got {value!r}")
    return value


def _choice(value: str | None, where: str, choices: Iterable[str], default: str) -> str:
    options = tuple(choices)
    if value is None:
        return default
    if value not in options:
        raise WebConfigError(f"{where}: expected one of {', '.join(options)}, got {value!r}")
    return value


def parse(text: str, base_dir: Path) -> WebConfig:
    """Validate a web config's text; relative file names are taken from ``base_dir``.

    Files are not read here; :func:`load` also builds the TLS context, which reads them.
    """
    try:
        raw = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise WebConfigError(f"not valid YAML: {at}{exc.problem}") from None
    except yaml.YAMLError as exc:
        raise WebConfigError(f"not valid YAML: {exc}") from None
    top = _section(
        raw,
        "",
        (
            "tls_server_config",
            "http_server_config",
            "basic_auth_users",
            "auth_excluded_paths",
            "rate_limit",
        ),
    )
    if "rate_limit" in top:
        raise WebConfigError(
            "rate_limit: not supported by gpu-exporter (it has its own request limits); remove it"
        )
    warnings: list[str] = []
    tls = _parse_tls(top.get("tls_server_config"), base_dir, warnings)
    http = _section(top.get("http_server_config"), "http_server_config", ("http2", "headers"))
    _bool(http, "http2", "http_server_config", True)  # accepted; the server speaks HTTP/1.1
    headers = _parse_headers(http.get("headers"))
    users = _parse_users(top.get("basic_auth_users"))
    excluded = _strings(top, "auth_excluded_paths", "")
    for path in excluded:
        if not path.startswith("/"):
            raise WebConfigError(f"auth_excluded_paths: {path!r} must start with /")
    return WebConfig(tls, users, headers, tuple(excluded), tuple(warnings))


def _parse_tls(value: Any, base_dir: Path, warnings: list[str]) -> TlsConfig | None:
    where = "tls_server_config"
    section = _section(
        value,
        where,
        (
            "cert",
            "key",
            "client_ca",
            "cert_file",
            "key_file",
            "client_auth_type",
            "client_ca_file",
            "client_allowed_sans",
            "min_version",
            "max_version",
            "cipher_suites",
            "prefer_server_cipher_suites",
            "curve_preferences",
        ),
    )
    if not section:
        return None

    def path(key: str) -> Path | None:
        text = _string(section, key, where)
        return None if text is None else base_dir / text

    cert_file, key_file, ca_file = path("cert_file"), path("key_file"), path("client_ca_file")
    cert, key = _string(section, "cert", where), _string(section, "key", where)
    client_ca = _string(section, "client_ca", where)
    for name, inline, named in (
        ("cert", cert, cert_file),
        ("key", key, key_file),
        ("client_ca", client_ca, ca_file),
    ):
        if inline is not None and named is not None:
            raise WebConfigError(f"{where}: give {name} or {name}_file, not both")
    if cert is None and cert_file is None:
        raise WebConfigError(f"{where}: missing one of cert or cert_file")
    if key is None and key_file is None:
        raise WebConfigError(f"{where}: missing one of key or key_file")

    auth = _choice(
        _string(section, "client_auth_type", where),
        f"{where}.client_auth_type",
        CLIENT_AUTH_TYPES,
        "NoClientCert",
    )
    has_ca = client_ca is not None or ca_file is not None
    if auth == "RequireAnyClientCert":
        raise WebConfigError(
            f"{where}.client_auth_type: RequireAnyClientCert (any certificate, unverified) "
            "cannot be served with Python's ssl module, which verifies every certificate it "
            "asks for; use RequireAndVerifyClientCert with client_ca_file"
        )
    if auth == "RequestClientCert":
        warnings.append(
            f"{where}.client_auth_type: RequestClientCert is served as NoClientCert (Python's "
            "ssl module cannot ask for a certificate without verifying it; access is the same)"
        )
        auth = "NoClientCert"
    if auth in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert") and not has_ca:
        raise WebConfigError(f"{where}: client_auth_type {auth} needs client_ca_file or client_ca")
    if has_ca and auth == "NoClientCert":
        raise WebConfigError(
            f"{where}: client CAs are configured without a client_auth_type that uses them"
        )
    if section.get("client_allowed_sans") is not None:
        raise WebConfigError(
            f"{where}.client_allowed_sans: not supported by gpu-exporter; issue the allowed "
            "clients' certificates from their own CA (client_ca_file) instead"
        )

    versions = {}
    for key_name, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        name = _choice(
            _string(section, key_name, where), f"{where}.{key_name}", TLS_VERSIONS, default
        )
        versions[key_name] = TLS_VERSIONS[name]
    if versions["min_version"] > versions["max_version"]:
        raise WebConfigError(f"{where}: min_version is above max_version")
    if versions["min_version"] < ssl.TLSVersion.TLSv1_2:
        warnings.append(
            f"{where}.min_version: TLS 1.0 and 1.1 are deprecated (RFC 8996); OpenSSL's "
            "security level may refuse them anyway"
        )

    ciphers = []
    for name in _strings(section, "cipher_suites", where):
        if name not in CIPHER_SUITES:
            raise WebConfigError(f"{where}.cipher_suites: unknown cipher suite {name!r}")
        if CIPHER_SUITES[name]:
            ciphers.append(CIPHER_SUITES[name])
    curves = _strings(section, "curve_preferences", where)
    for curve in curves:
        if curve not in CURVES:
            raise WebConfigError(f"{where}.curve_preferences: unknown curve {curve!r}")
    if curves:
        warnings.append(
            f"{where}.curve_preferences is ignored: Python's ssl module cannot set a curve "
            "list; OpenSSL's defaults (X25519, P-256, P-384, …) are used"
        )
    return TlsConfig(
        cert_file=cert_file,
        key_file=key_file,
        cert=cert,
        key=key,
        client_ca_file=ca_file,
        client_ca=client_ca,
        client_auth_type=auth,
        min_version=versions["min_version"],
        max_version=versions["max_version"],
        cipher_suites=tuple(ciphers),
        prefer_server_cipher_suites=_bool(section, "prefer_server_cipher_suites", where, True),
    )


def _parse_headers(value: Any) -> tuple[tuple[str, str], ...]:
    where = "http_server_config.headers"
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise WebConfigError(f"{where}: expected a mapping, got {_kind(value)}")
    headers = []
    for name, text in value.items():
        if name not in HEADERS:
            raise WebConfigError(
                f"{where}: header {name!r} can not be configured; allowed: {', '.join(HEADERS)}"
            )
        if text is None or text == "":
            continue  # blank: unset, as in exporter-toolkit
        if not isinstance(text, str) or not text.isprintable():
            raise WebConfigError(f"{where}.{name}: expected a one-line string")
        allowed = HEADERS[name]
        if allowed is not None and text not in allowed:
            raise WebConfigError(
                f"{where}.{name}: expected one of {', '.join(allowed)}, got {text!r}"
            )
        headers.append((name, text))
    return tuple(headers)


def _parse_users(value: Any) -> dict[str, bytes]:
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


# ------------------------------------------------------------------------ TLS context


def ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """The server-side context; reads the certificate, key and CA files now."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = tls.min_version
    ctx.maximum_version = tls.max_version
    where = "tls_server_config"
    for path in tls.files():
        try:
            path.open("rb").close()
        except OSError as exc:
            raise WebConfigError(f"{where}: cannot read {path}: {exc.strerror or exc}") from None
    with tempfile.TemporaryDirectory(prefix="gpu-exporter-tls-") as tmp:
        cert, key = tls.cert_file, tls.key_file
        if tls.cert is not None:
            cert = Path(tmp, "cert.pem")
            cert.write_text(tls.cert)
        if tls.key is not None:
            key = Path(tmp, "key.pem")
            key.touch(mode=0o600)
            key.write_text(tls.key)
        assert cert is not None and key is not None
        try:
            ctx.load_cert_chain(cert, key)
        except OSError as exc:  # ssl.SSLError is an OSError
            name = "cert/key" if tls.cert or tls.key else f"{cert} / {key}"
            raise WebConfigError(
                f"{where}: cannot load the certificate and key ({name}): {_reason(exc)}"
            ) from None
    if tls.client_ca_file is not None or tls.client_ca is not None:
        try:
            if tls.client_ca_file is not None:
                ctx.load_verify_locations(cafile=tls.client_ca_file)
            else:
                ctx.load_verify_locations(cadata=tls.client_ca)
        except OSError as exc:
            source = tls.client_ca_file or "client_ca"
            raise WebConfigError(
                f"{where}: cannot load the client CAs from {source}: {_reason(exc)}"
            ) from None
        if ctx.cert_store_stats()["x509_ca"] == 0:
            raise WebConfigError(f"{where}: no CA certificate in the client CAs")
        ctx.verify_mode = (
            ssl.CERT_REQUIRED
            if tls.client_auth_type == "RequireAndVerifyClientCert"
            else ssl.CERT_OPTIONAL
        )
    if tls.cipher_suites:
        try:
            ctx.set_ciphers(":".join(tls.cipher_suites))
        except ssl.SSLError:
            raise WebConfigError(
                f"{where}.cipher_suites: none of these is available in this OpenSSL"
            ) from None
    if tls.prefer_server_cipher_suites:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    return ctx


def _reason(exc: OSError) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason).lower().replace("_", " ")
    return exc.strerror or str(exc)


# ------------------------------------------------------------------------ basic auth


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

    def verify(self, user: str, password: bytes) -> bool:
        key = (user, hmac.new(self._key, password, sha256).digest())
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return True
        if len(password) > BCRYPT_MAX_PASSWORD_BYTES:
            return False  # bcrypt would look at 72 bytes only; never accept such a password
        stored = self._users.get(user)
        ok = bcrypt.checkpw(password, stored if stored is not None else self._dummy)
        if not ok or stored is None:
            return False
        with self._lock:
            self._cache[key] = None
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return True

    def check_header(self, header: str | None) -> str | None:
        """The user an ``Authorization: Basic …`` header proves, or None."""
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
            user = raw_user.decode("utf-8")
        except UnicodeDecodeError:
            return None
        return user if self.verify(user, password) else None


# ------------------------------------------------------------------------ live config


@dataclass(frozen=True, slots=True)
class Active:
    """One loaded config and what was built from it; replaced whole on reload."""

    config: WebConfig
    context: ssl.SSLContext | None
    auth: BasicAuth


def load(path: str | Path) -> Active:
    """Read, validate and build a web config; raises :class:`WebConfigError`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise WebConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise WebConfigError(f"{path} is not UTF-8 text") from None
    config = parse(text, path.parent)
    context = ssl_context(config.tls) if config.tls is not None else None
    return Active(config, context, BasicAuth(config.users))


def _signature(paths: Iterable[Path]) -> tuple[tuple[int, int, int, int] | None, ...]:
    result: list[tuple[int, int, int, int] | None] = []
    for p in paths:
        try:
            st = p.stat()
            result.append((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        except OSError:
            result.append(None)
    return tuple(result)


class WebConfigWatcher:
    """Holds the active web config and re-reads it when its file (or a file it names) changes."""

    def __init__(self, path: str | Path, *, check_seconds: float = RELOAD_CHECK_SECONDS) -> None:
        self.path = Path(path)
        self._check_seconds = check_seconds
        self.active = load(self.path)  # raises WebConfigError: refuse to start
        self._signature = self._current_signature()
        self.reloads: collections.Counter[str] = collections.Counter()
        self.last_reload_ok = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        for warning in self.active.config.warnings:
            log.warning("--web-config-file %s: %s", self.path, warning)

    def _current_signature(self) -> tuple[tuple[int, int, int, int] | None, ...]:
        tls = self.active.config.tls
        return _signature((self.path, *(tls.files() if tls else ())))

    def tls_context(self) -> ssl.SSLContext:
        context = self.active.context
        assert context is not None
        return context

    def check(self) -> bool | None:
        """Reload if anything changed: True reloaded, False kept the old config, None same."""
        with self._lock:
            signature = self._current_signature()
            if signature == self._signature:
                return None
            self._signature = signature
            try:
                new = load(self.path)
                if (new.context is None) != (self.active.context is None):
                    raise WebConfigError("turning TLS on or off needs a restart of gpu-exporter")
            except WebConfigError as exc:
                self.reloads["error"] += 1
                self.last_reload_ok = False
                log.error(
                    "--web-config-file %s: not reloaded, the previous configuration stays in "
                    "force: %s",
                    self.path,
                    exc,
                )
                return False
            self.active = new
            self._signature = self._current_signature()
            self.reloads["success"] += 1
            self.last_reload_ok = True
            for warning in new.config.warnings:
                log.warning("--web-config-file %s: %s", self.path, warning)
            log.info("--web-config-file %s: reloaded", self.path)
            return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="web-config", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._check_seconds):
            try:
                self.check()
            except Exception:  # never let the watcher die; the old config stays
                log.exception("--web-config-file %s: checking for changes failed", self.path)


# ------------------------------------------------------------------------ WSGI middleware

# Read-only endpoints that --auth-scope=writes leaves open (GET and HEAD only).
READ_PATHS = frozenset({"/", "/metrics", "/healthz", "/readyz", "/gpus", "/openapi.json"})
# The probes never need credentials: kubelet and load balancers rarely have them, the
# answers say only "ok"/"ready" or why not, and the request limits exempt them, so they
# must not cost a bcrypt either.
ALWAYS_OPEN = frozenset({"/healthz", "/readyz"})


def is_advice_only(query_string: str) -> bool:
    """True for a ``/choose`` query that claims nothing (every ``lease`` value is zero)."""
    from gpu_exporter.units import parse_duration

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
) -> bool:
    """Whether this request must carry valid credentials (when users are configured)."""
    if path in ALWAYS_OPEN or path in excluded:
        return False
    if scope == "all":
        return True
    if path == "/choose" and (method in ("GET", "HEAD") or (method == "POST" and not has_body)):
        # Advice only (lease=0) is a read. A POST with a body might carry its own lease, so
        # only a bodiless POST (what the Python client sends) is judged by its query string.
        return not is_advice_only(query_string)
    if method not in ("GET", "HEAD"):
        return True  # POST /choose with a body, DELETE /leases/…, renewals: writes
    return path not in READ_PATHS  # /leases and anything unknown: protected


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class BasicAuthMiddleware:
    """Answers 401 unless the request is open in this scope or carries valid credentials."""

    def __init__(self, app: WsgiApp, watcher: WebConfigWatcher, scope: str = "all") -> None:
        if scope not in AUTH_SCOPES:
            raise ValueError(f"auth scope must be one of {', '.join(AUTH_SCOPES)}")
        self.app = app
        self._watcher = watcher
        self._scope = scope

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        active = self._watcher.active  # one config for the whole request
        if active.auth and needs_auth(
            self._scope,
            environ.get("REQUEST_METHOD", "GET"),
            environ.get("PATH_INFO", "") or "/",
            environ.get("QUERY_STRING", ""),
            active.config.auth_excluded_paths,
            has_body=environ.get("CONTENT_LENGTH", "") not in ("", "0")
            or "HTTP_TRANSFER_ENCODING" in environ,
        ):
            header = environ.get("HTTP_AUTHORIZATION")
            user = active.auth.check_header(header)
            if user is None:
                from werkzeug.wrappers import Request

                from gpu_exporter.web.errors import error_response

                message = (
                    "wrong user name or password"
                    if header
                    else "authentication required (HTTP basic auth)"
                )
                resp = error_response(Request(environ), 401, "unauthorized", message)
                resp.headers["WWW-Authenticate"] = f'Basic realm="{REALM}", charset="UTF-8"'
                return resp(environ, start_response)
            environ["REMOTE_USER"] = user
        return self.app(environ, start_response)


class SecurityHeaders:
    """Adds ``http_server_config.headers`` to every response the app has not set them on."""

    def __init__(self, app: WsgiApp, watcher: WebConfigWatcher) -> None:
        self.app = app
        self._watcher = watcher

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        extra = self._watcher.active.config.headers
        if not extra:
            return self.app(environ, start_response)

        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            present = {name.lower() for name, _ in headers}
            headers = [*headers, *((n, v) for n, v in extra if n.lower() not in present)]
            return start_response(status, headers, exc_info)

        return self.app(environ, start)


def secure(app: Any, watcher: WebConfigWatcher, scope: str = "all") -> WsgiApp:
    """The Flask app with basic auth and the configured headers; returns what to serve.

    Credentials are checked inside the request limits (a flood of wrong passwords, one
    bcrypt each, takes request slots, never the probes' threads); the headers go on every
    response, the limits' own 503/414 included.
    """
    from gpu_exporter.web.limits import RequestLimits

    limits = app.wsgi_app
    if isinstance(limits, RequestLimits):
        limits.app = BasicAuthMiddleware(limits.app, watcher, scope)
    else:
        app.wsgi_app = BasicAuthMiddleware(limits, watcher, scope)
    return SecurityHeaders(app, watcher)


# ------------------------------------------------------------------------ start-up checks


def exposure_warnings(host: str, config: WebConfig | None, euid: int) -> list[str]:
    """What to warn about at start: an open network listener, and running as root."""
    warnings = []
    if not is_loopback(host):
        where = host or "every interface"
        if config is None or config.tls is None:
            warnings.append(
                f"serving plain HTTP on {where}: traffic (and any password) can be read on the "
                "network; set tls_server_config in --web-config-file"
            )
        authenticated = config is not None and (
            bool(config.users) or (config.tls is not None and config.tls.requires_client_cert)
        )
        if not authenticated:
            warnings.append(
                f"no authentication on {where}: anyone who can reach this port can take and "
                "release GPU leases; set basic_auth_users in --web-config-file "
                "(--auth-scope writes keeps /metrics open)"
            )
    if euid == 0:
        warnings.append(
            "running as root: gpu-exporter needs only read access to /dev/nvidiactl and "
            "/dev/nvidia*; run it as an unprivileged user"
        )
    return warnings


# ------------------------------------------------------------------------ hash-password


def hash_password_main(args: argparse.Namespace) -> int:
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
