"""A throwaway certificate authority for the HTTPS tests: a store's CA made in the test, and
server or client certificates it signs (valid, expired, soon to expire), as PEM files.

Clients verify strictly (`VERIFY_X509_STRICT`, Python 3.13's default), so the certificates
carry what strict verification asks: key identifiers, and a key usage on the CA."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path
    serial: int


class StoreCA:
    """A CA whose certificate is `self.cert` (the file clients trust), issuing into `folder`."""

    def __init__(self, folder: Path, name: str = "store test CA") -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        ca = (x509.CertificateBuilder().subject_name(self._name).issuer_name(self._name)
              .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(days=1))
              .not_valid_after(now + datetime.timedelta(days=365))
              .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
              .add_extension(x509.KeyUsage(
                  digital_signature=False, content_commitment=False, key_encipherment=False,
                  data_encipherment=False, key_agreement=False, key_cert_sign=True,
                  crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
              .add_extension(x509.SubjectKeyIdentifier.from_public_key(
                  self._key.public_key()), critical=False)
              .sign(self._key, hashes.SHA256()))
        self.cert = folder / f"{name.replace(' ', '-')}.pem"
        self.cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def issue(self, stem: str, *, days: float = 30, start_days: float = -1,
              client: bool = False) -> Issued:
        """A certificate for localhost and 127.0.0.1 (a server's) or a client's, valid from
        `start_days` to `days` from now (negative `days`: expired), key mode 0600."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        serial = x509.random_serial_number()
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, stem)]))
                .issuer_name(self._name).public_key(key.public_key()).serial_number(serial)
                .not_valid_before(now + datetime.timedelta(days=start_days))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.SubjectAlternativeName([
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                    self._key.public_key()), critical=False)
                .sign(self._key, hashes.SHA256()))
        out = Issued(self.folder / f"{stem}.pem", self.folder / f"{stem}.key", serial)
        out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out.key.touch(mode=0o600)
        out.key.write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        out.key.chmod(0o600)
        return out

    def client_context(self, client: Issued | None = None) -> ssl.SSLContext:
        """What a store's app verifies the box with (and presents, for mutual TLS)."""
        ctx = ssl.create_default_context(cafile=str(self.cert))
        ctx.verify_flags |= ssl.VERIFY_X509_STRICT
        if client is not None:
            ctx.load_cert_chain(client.cert, client.key)
        return ctx


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)
