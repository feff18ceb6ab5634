"""The front door's listening sockets, bound before anything slow happens."""

from __future__ import annotations

import errno
import socket
import sys


def bind_http(host: str, port: int) -> list[socket.socket]:
    """The front door's sockets, bound now and later handed to uvicorn: a port that is taken
    fails here, before any model is generated or worker started. Like asyncio's own
    ``create_server``: one socket per address ``host`` resolves to."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, type_, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, type_, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no conflict
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def bind_http_or_exit(host: str, port: int) -> list[socket.socket]:
    try:
        return bind_http(host, port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            sys.exit(f"launch.py: error: port {port} on {host} is already in use; pick another with --port N")
        sys.exit(f"launch.py: error: cannot listen on {host}:{port} ({e.strerror or e}); "
                 "choose another --host or --port")
