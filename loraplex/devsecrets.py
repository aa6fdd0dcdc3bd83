"""Refuse to listen beyond loopback while a secret (``jwt_secret``, ``worker_secret``) is still
its built-in development value, unless ``LORAPLEX_ALLOW_DEV_SECRETS=true``.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping

from loraplex.settings import PREFIX, Settings, is_development_secret


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback address (unresolvable: False)."""
    name = host.strip().strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    if not name:
        return False  # uvicorn and most servers read an empty host as every interface
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(name, None)}
    except OSError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addrs)


def development_secrets(settings: Settings, names: Iterable[str]) -> list[str]:
    """Those of the secret settings ``names`` that still hold their development value and are used.

    ``jwt_secret`` counts only while an HS* algorithm is accepted (RS/ES deployments verify
    with public keys and never read it).
    """
    hmac_jwt = any(a.upper().startswith("HS") for a in settings.jwt_algorithms)
    return [n for n in names if is_development_secret(n, getattr(settings, n)) and (n != "jwt_secret" or hmac_jwt)]


def refusal(settings: Settings, binds: Mapping[str, str], secrets: Iterable[str]) -> str | None:
    """Why this process must not start (``binds``: what names the address -> the address), or None."""
    if settings.allow_dev_secrets:
        return None
    public = [f"{host or '(all interfaces)'} ({label})" for label, host in binds.items() if not is_loopback(host)]
    found = development_secrets(settings, secrets)
    if not public or not found:
        return None
    names = ", ".join(PREFIX + n.upper() for n in found)
    return (f"refusing to listen on {', '.join(public)} with the development {names} built into loraplex "
            f"(anyone can read it in the source). Set {names} to long random values (e.g. openssl rand -hex 32; "
            f"the same LORAPLEX_WORKER_SECRET on gateways and workers), listen on 127.0.0.1, or set "
            f"{PREFIX}ALLOW_DEV_SECRETS=true to run anyway (never in production).")
