"""The box's HTTPS: the server's SSLContext from its certificate files, reloaded in place,
and what `doctor` reads of those files.

Why on the box: the store's apps reach it over the LAN with bearer keys, and nobody on site
runs a reverse proxy, so the box terminates TLS itself (TLS 1.2 at least, HTTP/1.1 by ALPN).
With a client CA it is mutual TLS: a client without a certificate that CA signed gets no
connection at all.

Reload: `ServerTLS.reload` loads the files again into the context the listening socket
already uses (`load_cert_chain` on the live context), so new handshakes get the new
certificate and connections already open, streams included, go on with theirs. The files are
first loaded into a scratch context: a half-copied or mismatched pair is refused and the
live context keeps serving the old one (OpenSSL drops the key from a context whose new
certificate does not match it, which would break every new handshake). A client CA file is
read again too, but a context only ever adds CAs: removing one takes a restart.

The private key must be owner-only (no group or other bits): the box refuses one open to
others, at start and at a reload, as ssh refuses such a key. This module never raises
anything but `TLSFileError` for a bad file, with one line an operator can act on.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import ssl
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

log = logging.getLogger(__name__)

MIN_VERSION = ssl.TLSVersion.TLSv1_2
ALPN = ["http/1.1"]  # uvicorn's h11 protocol: no HTTP/2 to offer


class TLSFileError(Exception):
    """A certificate, key or CA file the box cannot serve with, said in one line."""


@dataclass(frozen=True)
class TLSFiles:
    """Where the box's certificate (chain, leaf first), its key and, for mutual TLS, the CA
    of its clients' certificates are."""

    cert: Path
    key: Path
    client_ca: Path | None = None


class ServerTLS:
    """The listening socket's SSLContext, and its reload (see the module's docstring)."""

    def __init__(self, files: TLSFiles) -> None:
        self.files = files
        self.context = _new_context(files)
        self._load(self.context)
        self.fingerprint = fingerprint(self.files.cert)
        self._lock = threading.Lock()

    def reload(self) -> str:
        """The files loaded again into the live context; the new leaf's SHA-256
        fingerprint. TLSFileError, and the context unchanged, if they do not load."""
        with self._lock:
            self._load(_new_context(self.files))  # the whole pair checked first
            self._load(self.context)
            self.fingerprint = fingerprint(self.files.cert)
            return self.fingerprint

    def _load(self, ctx: ssl.SSLContext) -> None:
        files = self.files
        problem = key_mode_problem(files.key)
        if problem:
            raise TLSFileError(problem)
        try:
            ctx.load_cert_chain(files.cert, files.key)
        except OSError as exc:  # ssl.SSLError included: a wrong PEM, a key that does not fit
            raise TLSFileError(_why(exc, f"{files.cert} and {files.key}")) from None
        if files.client_ca is not None:
            try:
                ctx.load_verify_locations(cafile=files.client_ca)
            except OSError as exc:
                raise TLSFileError(_why(exc, str(files.client_ca))) from None


def reload_logged(tls: ServerTLS | None) -> bool:
    """A server's SIGHUP: the files read again, said in the log; False, and the certificate
    served so far kept, when there is no TLS or the files cannot be served with."""
    if tls is None:
        log.info("SIGHUP: no TLS configured, nothing to reload")
        return False
    try:
        fingerprint = tls.reload()
    except TLSFileError as exc:
        log.error("TLS reload refused, the previous certificate is still served: %s", exc)
        return False
    log.info("TLS certificate reloaded from %s (sha256 %s); open connections keep theirs",
             tls.files.cert, fingerprint[:16])
    return True


def _new_context(files: TLSFiles) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = MIN_VERSION
    ctx.set_alpn_protocols(ALPN)
    if files.client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _why(exc: OSError, what: str) -> str:
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason or str(exc)
        if reason == "KEY_VALUES_MISMATCH":
            return f"the key does not belong to the certificate ({what})"
        return f"{what}: not a usable PEM certificate/key ({reason})"
    return f"{exc.filename or what}: {exc.strerror or exc}"


def key_mode_problem(path: Path) -> str | None:
    """Why the key at `path` may not be used as it is (group or other bits), or None; a
    file that cannot be looked at is left to the load, which says why."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None
    if mode & 0o077:
        return (f"{path} is {mode:04o}, open to other users: the private key must be "
                f"owner-only (chmod 600 {path})")
    return None


def certificates(path: Path) -> list[x509.Certificate]:
    """The PEM certificates in `path`, the first one the leaf; TLSFileError if none."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TLSFileError(f"{path}: {exc.strerror or exc}") from None
    try:
        found = x509.load_pem_x509_certificates(data)
    except ValueError:
        found = []
    if not found:
        raise TLSFileError(f"{path} holds no PEM certificate")
    return found


def key_matches(cert: x509.Certificate, key_path: Path) -> bool:
    """Whether the private key in `key_path` is the certificate's (same public key);
    TLSFileError when it is no readable unencrypted PEM key."""
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except OSError as exc:
        raise TLSFileError(f"{key_path}: {exc.strerror or exc}") from None
    except (ValueError, TypeError) as exc:  # TypeError: encrypted, and no password
        raise TLSFileError(f"{key_path} is no unencrypted PEM private key ({exc})") from None
    der = serialization.Encoding.DER
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    return bool(key.public_key().public_bytes(der, spki)
                == cert.public_key().public_bytes(der, spki))


def fingerprint(path_or_der: Path | bytes) -> str:
    """SHA-256 of a certificate (its DER), hex: the leaf of a PEM file, or DER bytes as a
    peer sent them."""
    if isinstance(path_or_der, Path):
        path_or_der = certificates(path_or_der)[0].public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(path_or_der).hexdigest()


def served_certificate(host: str, port: int, timeout_s: float = 2.0) -> bytes | None:
    """The certificate a TLS server on host:port presents (DER), unverified: what is
    served, not whether to trust it. None when nothing there speaks TLS. A box asking for
    client certificates still shows its own (TLS 1.3 ends the client's handshake first)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, \
                ctx.wrap_socket(raw) as conn:
            return conn.getpeercert(binary_form=True)
    except (OSError, ValueError):
        return None
