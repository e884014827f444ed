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

The file is re-read when it or a file it names changes (checked once a second). A new version
that is broken, missing, empty, or would protect less than the one in force (:func:`weaker`:
TLS or client certificates off, every user gone, a path opened) is logged as an error and
counted, and the previous one stays in force: only a restart may lower protection.

This module holds the file as a whole (:class:`WebConfig`, :func:`load`, the
:class:`WebConfigWatcher`), the headers middleware and the start-up warnings; the TLS section
and the SSL context are in :mod:`gpu_exporter.web.tls`, basic auth and its middleware in
:mod:`gpu_exporter.web.auth`, the YAML readers in :mod:`gpu_exporter.web.yamlfields`. The
middleware order is decided in :func:`gpu_exporter.web.middleware.install`.
"""

from __future__ import annotations

import collections
import logging
import ssl
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_exporter.outbound import is_loopback
from gpu_exporter.web.auth import BasicAuth, parse_users
from gpu_exporter.web.limits import WsgiApp
from gpu_exporter.web.tls import TLS_VERSIONS, TlsConfig, parse_tls, ssl_context
from gpu_exporter.web.yamlfields import WebConfigError as WebConfigError
from gpu_exporter.web.yamlfields import flag, kind, load_yaml, section, strings

log = logging.getLogger(__name__)

# The headers exporter-toolkit lets a file set, with the values it accepts (None: any).
HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
RELOAD_CHECK_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class WebConfig:
    tls: TlsConfig | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)  # user → bcrypt hash
    headers: tuple[tuple[str, str], ...] = ()
    auth_excluded_paths: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def parse(text: str, base_dir: Path) -> WebConfig:
    """Validate a web config's text; relative file names are taken from ``base_dir``.

    Files are not read here; :func:`load` also builds the TLS context, which reads them.
    """
    top = section(
        load_yaml(text),
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
    tls = parse_tls(top.get("tls_server_config"), base_dir, warnings)
    http = section(top.get("http_server_config"), "http_server_config", ("http2", "headers"))
    flag(http, "http2", "http_server_config", True)  # accepted; the server speaks HTTP/1.1
    headers = _parse_headers(http.get("headers"))
    users = parse_users(top.get("basic_auth_users"))
    excluded = strings(top, "auth_excluded_paths", "")
    for path in excluded:
        if not path.startswith("/"):
            raise WebConfigError(f"auth_excluded_paths: {path!r} must start with /")
    return WebConfig(tls, users, headers, tuple(excluded), tuple(warnings))


def _parse_headers(value: Any) -> tuple[tuple[str, str], ...]:
    where = "http_server_config.headers"
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise WebConfigError(f"{where}: expected a mapping, got {kind(value)}")
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


def weaker(old: WebConfig, new: WebConfig) -> str | None:
    """Why ``new`` protects less than ``old`` (None if it does not), which a reload may not
    do: an emptied file is more likely a half-written one than a decision.

    >>> alice = WebConfig(users={"alice": b"$2b$10$..."})
    >>> weaker(alice, WebConfig())
    'the file is empty'
    >>> weaker(alice, WebConfig(headers=(("X-Frame-Options", "deny"),)))
    'it removes every user of basic_auth_users, turning authentication off'
    >>> weaker(WebConfig(), alice) is None  # more protection: reloaded like any change
    True
    """
    if new == WebConfig() and old != new:
        return "the file is empty"
    if old.tls is not None and new.tls is None:
        return "it turns TLS off"
    if old.tls is not None and new.tls is not None:
        if old.tls.requires_client_cert and not new.tls.requires_client_cert:
            return "it stops requiring client certificates"
        if new.tls.min_version < old.tls.min_version:
            name = next(k for k, v in TLS_VERSIONS.items() if v == new.tls.min_version)
            return f"it lowers min_version to {name}"
    if old.users and not new.users:
        return "it removes every user of basic_auth_users, turning authentication off"
    opened = set(new.auth_excluded_paths) - set(old.auth_excluded_paths)
    if old.users and opened:
        return f"auth_excluded_paths opens {', '.join(sorted(opened))} to everyone"
    return None


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
                if new.context is not None and self.active.context is None:
                    raise WebConfigError("turning TLS on needs a restart of gpu-exporter")
                why = weaker(self.active.config, new.config)
                if why is not None:
                    raise WebConfigError(
                        f"{why}; that would lower protection, which only a restart of "
                        "gpu-exporter may do"
                    )
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
