"""Refuse to listen beyond loopback while a secret (``jwt_secret``, ``worker_secret``) is still
its built-in development value, unless ``LORAPLEX_ALLOW_DEV_SECRETS=true``, or is shorter than
``MIN_SECRET_BYTES`` (no flag lets a guessable secret through).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping

from loraplex.settings import PREFIX, Settings, is_development_secret

MIN_SECRET_BYTES = 32
"""Shortest secret accepted off loopback: 256 bits, what ``openssl rand -hex 32`` gives and
RFC 7518 asks of an HS256 key."""


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


def _in_use(settings: Settings, names: Iterable[str]) -> list[str]:
    """The secret settings of ``names`` this configuration reads: ``jwt_secret`` only while an
    HS* algorithm is accepted (RS/ES deployments verify with public keys)."""
    hmac_jwt = any(a.upper().startswith("HS") for a in settings.jwt_algorithms)
    return [n for n in names if n != "jwt_secret" or hmac_jwt]


def development_secrets(settings: Settings, names: Iterable[str]) -> list[str]:
    """Those of the secret settings ``names`` in use that still hold their development value."""
    return [n for n in _in_use(settings, names) if is_development_secret(n, getattr(settings, n))]


def short_secrets(settings: Settings, names: Iterable[str]) -> list[str]:
    """Those of the secret settings ``names`` in use that are shorter than ``MIN_SECRET_BYTES``."""
    return [n for n in _in_use(settings, names) if len(getattr(settings, n).encode()) < MIN_SECRET_BYTES]


def refusal(settings: Settings, binds: Mapping[str, str], secrets: Iterable[str]) -> str | None:
    """Why this process must not start (``binds``: what names the address -> the address), or None."""
    public = [f"{host or '(all interfaces)'} ({label})" for label, host in binds.items() if not is_loopback(host)]
    if not public:
        return None
    secrets = list(secrets)
    short = short_secrets(settings, secrets)
    if short:
        names = ", ".join(PREFIX + n.upper() for n in short)
        return (f"refusing to listen on {', '.join(public)}: {names} is shorter than {MIN_SECRET_BYTES} bytes, "
                f"short enough to guess. Set it to a long random value (e.g. openssl rand -hex 32) or listen on "
                f"127.0.0.1.")
    found = [] if settings.allow_dev_secrets else development_secrets(settings, secrets)
    if not found:
        return None
    names = ", ".join(PREFIX + n.upper() for n in found)
    return (f"refusing to listen on {', '.join(public)} with the development {names} built into loraplex "
            f"(anyone can read it in the source). Set {names} to long random values (e.g. openssl rand -hex 32; "
            f"the same LORAPLEX_WORKER_SECRET on gateways and workers), listen on 127.0.0.1, or set "
            f"{PREFIX}ALLOW_DEV_SECRETS=true to run anyway (never in production).")
