"""Address checks shared by the CLI (which address `serve` may bind without a key, and who
holds a port it is about to listen on) and the API (which clients may read /metrics without
the metrics key)."""

from __future__ import annotations

import errno
import ipaddress
import socket


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


def port_holder(host: str, port: int) -> str | None:
    """Who holds `host:port` already, said so that a person can act on it ("pid 812
    (mosquitto: /usr/sbin/mosquitto -c /etc/mosquitto/mosquitto.conf)"), or None when the
    port is free to listen on. Checked by binding it, as the server is about to; the holder
    is looked up among the listening sockets (psutil), and named as hidden where this user
    may not see other users' processes. Port 0 is always free (the kernel picks one)."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return None  # an address the server itself will refuse, with its own words
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return None
        else:
            return None
    return _listener(port) or "another process (this user cannot see which: try `sudo ss -ltnp`)"


def _listener(port: int) -> str | None:
    import psutil

    try:
        connections = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, OSError):
        return None
    for conn in connections:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if conn.pid is None:
                return None
            try:
                proc = psutil.Process(conn.pid)
                command = " ".join(" ".join(proc.cmdline()).split())[:120] or proc.name()
                return f"pid {conn.pid} ({proc.name()}: {command})"
            except psutil.Error:
                return f"pid {conn.pid}"
    return None
