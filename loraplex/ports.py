"""Busy ports, found before a server starts: one clear line naming the port and what moves it.

``busy(binds)`` tries to bind each (host, port) the way uvicorn will (``SO_REUSEADDR``) and
returns the refusal for the first one another process holds, or None. The check runs before
the model loads, so a second ``loraplex demo`` on a host stops at once instead of after the load
with a traceback; a port taken between the check and the server's own bind is still reported by
the server.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping


def busy(binds: Mapping[str, tuple[str, int]]) -> str | None:
    """``binds``: what moves the port (``LORAPLEX_GATEWAY_PORT / --port``) -> (host, port)."""
    for what, (host, port) in binds.items():
        if not port:
            continue
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host.strip("[]") or "0.0.0.0", port))
            except OSError as exc:
                why = "is in use" if exc.errno == 98 else f"cannot be bound ({exc.strerror})"
                return (f"port {port} on {host or 'every interface'} {why} (another loraplex, or another server); "
                        f"set {what} to a free port")
    return None
