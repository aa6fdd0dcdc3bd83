"""Bearer-token authentication for the data plane, with a short verification cache.

Verified principals are cached per token until its ``exp`` (+ leeway) and at most ``ttl_s``;
failures are never cached; the tenant is checked against the snapshot on every request.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from gateway.errors import GatewayError
from loraplex.settings import Settings
from loraplex.tokens import Principal, TokenError, Verifier, bearer
from registry.snapshot import RegistrySnapshot, TenantView


class Authenticator:
    def __init__(self, settings: Settings, *, max_entries: int = 10_000, ttl_s: float = 60.0) -> None:
        self.verifier = Verifier(settings)
        self.leeway = settings.jwt_leeway_s
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._cache: OrderedDict[str, tuple[float, Principal]] = OrderedDict()

    def principal(self, authorization: str | None) -> Principal:
        """The verified caller, or ``GatewayError(401)``."""
        try:
            token = bearer(authorization)
        except TokenError as exc:
            raise GatewayError(exc.status, exc.message, code=exc.code) from None
        now = time.time()
        hit = self._cache.get(token)
        if hit is not None:
            if hit[0] > now:
                self._cache.move_to_end(token)
                return hit[1]
            del self._cache[token]
        try:
            principal = self.verifier.verify(token)
        except TokenError as exc:
            raise GatewayError(exc.status, exc.message, code=exc.code) from None
        exp = principal.claims.get("exp")
        until = now + self.ttl_s
        if isinstance(exp, int | float):
            until = min(until, float(exp) + self.leeway)
        self._cache[token] = (until, principal)
        if len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return principal

    def tenant(self, authorization: str | None, snapshot: RegistrySnapshot) -> TenantView:
        """The caller's tenant, refused when unknown (401), disabled (403) or absent (403)."""
        principal = self.principal(authorization)
        if principal.tenant is None:
            raise GatewayError(403, "this token does not belong to a tenant", code="no_tenant")
        tenant = snapshot.tenants.get(principal.tenant)
        if tenant is None:
            raise GatewayError(401, "unknown tenant", code="unknown_tenant")
        if not tenant.active:
            raise GatewayError(403, "tenant is disabled", code="tenant_disabled")
        return tenant
