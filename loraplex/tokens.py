"""JWT minting and verification (pyjwt), shared by the gateway, the admin API and the CLI.

Strict: an algorithm allow-list (never ``none``), required ``exp``, issuer and audience; keys
from the settings (HS256 secret, PEM public key, or JWKS by ``kid``), never of the wrong family.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import jwt

from loraplex.settings import Settings

_HMAC = {"HS256", "HS384", "HS512"}
_KEY_TYPES = {"RS": "RSA", "PS": "RSA", "ES": "EC"}
"""JWK ``kty`` for each asymmetric algorithm family (EdDSA: ``OKP``)."""
_ASYM = {"RS256", "RS384", "RS512", "ES256", "ES384", "ES512", "PS256", "PS384", "PS512", "EdDSA"}


INVALID = "invalid token"
"""What a 401 says of a token that does not decode (never the decoder's own words)."""


class TokenError(Exception):
    """A token was refused. ``status`` is 401 (bad credentials) or 403 (not allowed)."""

    def __init__(self, message: str, status: int = 401, code: str = "invalid_token") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant (``tenant`` set) and/or an admin (admin scope)."""

    subject: str
    tenant: str | None
    scopes: frozenset[str] = field(default_factory=frozenset)
    claims: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes


def mint(settings: Settings, subject: str, *, tenant: str | None = None, scopes: tuple[str, ...] = (),
         ttl_s: float = 3600.0, extra: dict[str, Any] | None = None) -> str:
    """An HS256 token signed with ``settings.jwt_secret`` (for the CLI, the demo and tests)."""
    now = int(time.time())
    claims: dict[str, Any] = {
        "sub": subject, "iss": settings.jwt_issuer, "aud": settings.jwt_audience,
        "iat": now, "exp": now + int(ttl_s),
    }
    if tenant is not None:
        claims[settings.jwt_tenant_claim] = tenant
    if scopes:
        claims[settings.jwt_scope_claim] = " ".join(scopes)
    if extra:
        claims.update(extra)
    return jwt.encode(claims, settings.jwt_secret, algorithm="HS256")


def mint_admin(settings: Settings, subject: str = "admin", ttl_s: float = 3600.0) -> str:
    return mint(settings, subject, scopes=(settings.jwt_admin_scope,), ttl_s=ttl_s)


class Verifier:
    """Verifies bearer tokens against the configured keys. Build once per process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.algorithms = [a for a in settings.jwt_algorithms if a and a.lower() != "none"]
        if not self.algorithms:
            raise ValueError("LORAPLEX_JWT_ALGORITHMS allows no algorithm")
        self._pem = _read(settings.jwt_public_key_file) if settings.jwt_public_key_file else None
        self._jwks = jwt.PyJWKSet.from_dict(json.loads(_read(settings.jwt_jwks_file))) \
            if settings.jwt_jwks_file else None

    def _key(self, token: str) -> tuple[Any, str]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:  # its words are a decoder's (padding, segments, JSON): not the caller's business
            raise TokenError(INVALID) from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self.algorithms:
            raise TokenError(f"token algorithm {alg!r} is not allowed")
        if alg in _HMAC:
            if not self.settings.jwt_secret:
                raise TokenError("HMAC tokens are not accepted here")
            return self.settings.jwt_secret, alg
        if alg not in _ASYM:
            raise TokenError(f"token algorithm {alg!r} is not supported")
        if self._jwks is not None:
            kid = header.get("kid")
            family = _KEY_TYPES.get(alg[:2], "OKP")
            for key in self._jwks.keys:
                # Only a public key of the algorithm's own family (never an "oct" secret).
                if (kid is None or key.key_id == kid) and key.key_type == family:
                    return key, alg
            raise TokenError("no key matches the token's kid and algorithm")
        if self._pem is not None:
            return self._pem, alg
        raise TokenError("no public key is configured for asymmetric tokens")

    def verify(self, token: str) -> Principal:
        key, alg = self._key(token)
        s = self.settings
        try:
            claims = jwt.decode(
                token, key, algorithms=[alg], audience=s.jwt_audience, issuer=s.jwt_issuer,
                leeway=s.jwt_leeway_s, options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.ExpiredSignatureError:
            raise TokenError("token has expired") from None
        except jwt.InvalidSignatureError:
            raise TokenError(f"{INVALID}: signature verification failed") from None
        except jwt.DecodeError:  # a payload or signature that does not decode: the decoder's words, again
            raise TokenError(INVALID) from None
        except jwt.PyJWTError as exc:  # a claim's check (audience, issuer, a required claim): PyJWT's own sentence
            raise TokenError(f"invalid token: {exc}") from None
        tenant = claims.get(s.jwt_tenant_claim)
        if tenant is not None and not isinstance(tenant, str):
            raise TokenError(f"claim {s.jwt_tenant_claim!r} must be a string")
        raw_scopes = claims.get(s.jwt_scope_claim, "")
        if isinstance(raw_scopes, str):
            scopes = raw_scopes.split()
        elif isinstance(raw_scopes, list) and all(isinstance(x, str) for x in raw_scopes):
            scopes = raw_scopes  # RFC 8693's "scope" is a string; a list of strings is common too
        else:  # an object's keys, a number: never read as scopes
            raise TokenError(f"claim {s.jwt_scope_claim!r} must be a space-separated string or a list of strings")
        return Principal(subject=str(claims.get("sub", "")), tenant=tenant, scopes=frozenset(scopes), claims=claims)


@lru_cache(maxsize=8)
def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def bearer(authorization: str | None) -> str:
    """The token in an ``Authorization: Bearer ...`` header, or a 401."""
    if not authorization:
        raise TokenError("missing bearer token", code="missing_token")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise TokenError("authorization header must be 'Bearer <token>'", code="missing_token")
    return token.strip()
