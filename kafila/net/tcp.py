"""A TCP listening address taken before its server starts (uvicorn serves the socket handed to it)."""

from __future__ import annotations

import socket


def bind_tcp(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (IPv6 when the host has a colon), with SO_REUSEADDR as
    uvicorn binds (a port in TIME_WAIT is no obstacle); the OSError of bind, the socket closed."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
