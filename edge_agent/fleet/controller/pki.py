"""The fleet's own certificate authority: one CA that the central team keeps, and the
certificates it issues, so that no step of a production fleet needs openssl recipes.

    pki/ca.pem, ca.key              the fleet CA (ca.key: 0600, keep it offline once issued)
    pki/<name>.pem, <name>.key      a certificate and its key (0600)
    pki/index.json                  what was issued: kind, names, serial, expiry; `renew`
                                    reissues from it

Kinds, each with the usage the TLS peer checks:

    broker       server: the Mosquitto TLS listener (its DNS names / addresses)
    controller   server: the controller's HTTPS (API, console, /releases/)
    releases     server: a release server of its own in front of `releases/`
    bridge       client: a regional broker's bridge to the central broker (mutual TLS)
    box          client: a box's broker connection with a certificate (mutual TLS); its
                 common name is the device id

Keys are ECDSA P-256 (what every TLS stack and browser takes; an Ed25519 certificate is
refused by browsers), signatures SHA-256. Every certificate carries what strict
verification (Python 3.13's `VERIFY_X509_STRICT`, browsers) asks: key identifiers, a key
usage, an extended key usage, and names in the subject alternative name. The CA lives ten
years by default, a certificate 397 days (what browsers accept of a public one); `renew`
reissues, with a new key, every certificate within its window of the end.

Nothing here reaches a network or a service: the files are written, and the roles and
settings name them (`broker-config --tls-cert`, `[http] tls_cert_file`, `[fleet]
ca_file`, `artifacts_ca_file`).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from edge_agent.errors import Conflict, InvalidRequest, NotFound
from edge_agent.files import atomic_write
from edge_agent.fleet.protocol.ids import check_id

CA_DAYS = 3650
LEAF_DAYS = 397
RENEW_WITHIN_DAYS = 30
SERVER_KINDS = ("broker", "controller", "releases")
CLIENT_KINDS = ("bridge", "box")
KINDS = SERVER_KINDS + CLIENT_KINDS
_INDEX = "index.json"


@dataclass(frozen=True)
class Issued:
    """One certificate the CA issued, as `index.json` keeps it."""

    name: str
    kind: str
    dns: tuple[str, ...]
    ips: tuple[str, ...]
    serial: str  # hex
    not_after: float  # Unix time
    days: int

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["dns"], out["ips"] = list(self.dns), list(self.ips)
        return out

    def left_days(self, now: float) -> float:
        return (self.not_after - now) / 86400


class FleetCA:
    """The CA in `folder`: made once by `init`, then issuing and renewing from its key."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.cert_file = folder / "ca.pem"
        self.key_file = folder / "ca.key"

    @classmethod
    def init(cls, folder: Path, *, name: str = "edge-agent fleet CA",
             days: int = CA_DAYS) -> FleetCA:
        """A new CA in `folder`; Conflict if one is there (a second CA would orphan every
        certificate the first issued)."""
        ca = cls(folder)
        if ca.cert_file.exists() or ca.key_file.exists():
            raise Conflict(f"{folder} holds a CA already (ca.pem, ca.key): one CA a fleet")
        folder.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(_usage(cert_sign=True), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                               critical=False)
                .sign(key, hashes.SHA256()))
        _write_key(ca.key_file, key)
        atomic_write(ca.cert_file, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
        return ca

    def issue(self, name: str, kind: str, *, dns: Sequence[str] = (),
              ips: Sequence[str] = (), days: int = LEAF_DAYS) -> Issued:
        """A certificate and a new key for `name`, written as `<name>.pem`/`<name>.key`
        (replacing any before: that is a renewal) and kept in the index."""
        if kind not in KINDS:
            raise InvalidRequest(f"kind {kind!r}: one of {', '.join(KINDS)}", param="kind")
        check_id("device" if kind == "box" else "fleet", name)  # also a safe file name
        addresses = [_address(ip) for ip in ips]
        names = [_dns(d) for d in dns]
        if kind in SERVER_KINDS and not names and not addresses:
            raise InvalidRequest(f"a {kind} certificate needs the names clients reach it "
                                 "by: --dns HOST or --ip ADDRESS", param="dns")
        if not 1 <= days <= CA_DAYS:
            raise InvalidRequest(f"days: 1 to {CA_DAYS}", param="days")
        ca_cert, ca_key = self._load()
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        end = min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc)
        serial = x509.random_serial_number()
        usage = (ExtendedKeyUsageOID.SERVER_AUTH if kind in SERVER_KINDS
                 else ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                   .issuer_name(ca_cert.subject).public_key(key.public_key())
                   .serial_number(serial)
                   .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(end)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                  critical=True)
                   .add_extension(_usage(cert_sign=False), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                                  critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                       ca_key.public_key()), critical=False))
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in names]
        sans += [x509.IPAddress(a) for a in addresses]
        if not sans:  # a client: its name, so that strict verifiers find one
            sans = [x509.DNSName(name)]
        cert = (builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write_key(self.folder / f"{name}.key", key)
        atomic_write(self.folder / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM),
                    mode=0o644)
        issued = Issued(name, kind, tuple(names), tuple(str(a) for a in addresses),
                        f"{serial:x}", end.timestamp(), days)
        self._index_put(issued)
        return issued

    def issued(self) -> list[Issued]:
        """Every certificate in the index, by name."""
        path = self.folder / _INDEX
        if not path.exists():
            return []
        rows = json.loads(path.read_text())
        return sorted((Issued(r["name"], r["kind"], tuple(r["dns"]), tuple(r["ips"]),
                              r["serial"], float(r["not_after"]), int(r["days"]))
                       for r in rows), key=lambda i: i.name)

    def renew(self, *, within_days: float = RENEW_WITHIN_DAYS,
              now: float | None = None) -> list[Issued]:
        """Reissues, with a new key and the same names and lifetime, every certificate
        ending within `within_days`; the renewed ones."""
        at = _now().timestamp() if now is None else now
        return [self.issue(i.name, i.kind, dns=i.dns, ips=i.ips, days=i.days)
                for i in self.issued() if i.left_days(at) <= within_days]

    def ca_not_after(self) -> float:
        return self._load()[0].not_valid_after_utc.timestamp()

    def _load(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        if not self.cert_file.exists() or not self.key_file.exists():
            raise NotFound(f"no fleet CA in {self.folder} (edge-agent fleet pki init)")
        cert = x509.load_pem_x509_certificate(self.cert_file.read_bytes())
        key = serialization.load_pem_private_key(self.key_file.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise InvalidRequest(f"{self.key_file} is not this CA's kind of key")
        return cert, key

    def _index_put(self, issued: Issued) -> None:
        rows = [i.to_json() for i in self.issued() if i.name != issued.name]
        rows.append(issued.to_json())
        atomic_write(self.folder / _INDEX,
                    (json.dumps(sorted(rows, key=lambda r: r["name"]), indent=1) + "\n")
                    .encode(), mode=0o644)


def _usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=not cert_sign, content_commitment=False,
                         key_encipherment=False, data_encipherment=False,
                         key_agreement=False, key_cert_sign=cert_sign, crl_sign=cert_sign,
                         encipher_only=False, decipher_only=False)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    atomic_write(path, key.private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()), mode=0o600)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        raise InvalidRequest(f"{text!r} is not an IP address", param="ip") from None


def _dns(text: str) -> str:
    name = text.strip().lower().rstrip(".")
    labels = name.split(".")
    if not name or len(name) > 253 or not all(
            label and len(label) <= 63 and all(c.isalnum() or c in "-*" for c in label)
            for label in labels) or "*" in name.lstrip("*."):
        raise InvalidRequest(f"{text!r} is not a DNS name", param="dns")
    return name


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)
