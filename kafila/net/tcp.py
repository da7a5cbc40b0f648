"""A TCP listening address taken before its server starts (uvicorn serves the socket handed to it)."""

from __future__ import annotations

import socket

# How long an HTTP server's stop lets responses in progress finish before cancelling them (uvicorn's
# timeout_graceful_shutdown): without a bound uvicorn waits for every open response, and a stream
# whose generation never ends (its ring gone) would hold a member's exit for good.
STOP_GRACE_S = 10


def bind_tcp(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (IPv6 when the host has a colon) and listening, with
    SO_REUSEADDR as uvicorn binds (a port in TIME_WAIT is no obstacle); the OSError of bind, the
    socket closed. It listens at once: on Linux two sockets with SO_REUSEADDR may both bind one
    port while neither listens, so two members on one machine that had both reserved the default
    API port were told nothing until the later one's server failed to start, after the session had
    formed. Connections that arrive before the server starts wait in the backlog."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock
