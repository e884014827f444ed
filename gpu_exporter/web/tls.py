"""``tls_server_config``: the TLS section of the web config, and the server's SSL context.

Go's ``crypto/tls`` names (versions, client-auth types, cipher suites) are mapped to Python's
:mod:`ssl`; what it cannot do is refused or warned about, never silently dropped (see
:mod:`gpu_exporter.web.webconfig`).
"""

from __future__ import annotations

import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_exporter.web.yamlfields import (
    WebConfigError,
    choice,
    flag,
    section,
    string,
    strings,
)

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


def parse_tls(value: Any, base_dir: Path, warnings: list[str]) -> TlsConfig | None:
    """``tls_server_config`` (None when absent or empty); what is served less strictly than
    written is added to ``warnings``. Files are read by :func:`ssl_context`, not here."""
    where = "tls_server_config"
    fields = section(
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
    if not fields:
        return None

    def path(key: str) -> Path | None:
        text = string(fields, key, where)
        return None if text is None else base_dir / text

    cert_file, key_file, ca_file = path("cert_file"), path("key_file"), path("client_ca_file")
    cert, key = string(fields, "cert", where), string(fields, "key", where)
    client_ca = string(fields, "client_ca", where)
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

    auth = choice(
        string(fields, "client_auth_type", where),
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
    if fields.get("client_allowed_sans") is not None:
        raise WebConfigError(
            f"{where}.client_allowed_sans: not supported by gpu-exporter; issue the allowed "
            "clients' certificates from their own CA (client_ca_file) instead"
        )

    versions = {}
    for key_name, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        name = choice(string(fields, key_name, where), f"{where}.{key_name}", TLS_VERSIONS, default)
        versions[key_name] = TLS_VERSIONS[name]
    if versions["min_version"] > versions["max_version"]:
        raise WebConfigError(f"{where}: min_version is above max_version")
    if versions["min_version"] < ssl.TLSVersion.TLSv1_2:
        warnings.append(
            f"{where}.min_version: TLS 1.0 and 1.1 are deprecated (RFC 8996); OpenSSL's "
            "security level may refuse them anyway"
        )

    ciphers = []
    for name in strings(fields, "cipher_suites", where):
        if name not in CIPHER_SUITES:
            raise WebConfigError(f"{where}.cipher_suites: unknown cipher suite {name!r}")
        if CIPHER_SUITES[name]:
            ciphers.append(CIPHER_SUITES[name])
    curves = strings(fields, "curve_preferences", where)
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
        prefer_server_cipher_suites=flag(fields, "prefer_server_cipher_suites", where, True),
    )


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
