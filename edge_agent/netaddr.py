"""Address checks shared by the CLI (which address `serve` may bind without a key) and the
API (which clients may read /metrics without the metrics key)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """`localhost`, or a loopback address: 127.0.0.0/8, ::1, or 127.x mapped into IPv6."""
    if host.lower() == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)
