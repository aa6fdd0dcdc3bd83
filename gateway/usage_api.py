"""``GET /v1/usage``: a tenant's own usage ledger, in the shape of OpenAI's usage API, with its own
token (as ``/v1/chat/completions``), so a product backend can show its customers their usage.

The query is ``GET /admin/usage``'s (``registry.usage_query``) restricted to the caller's tenant
whatever it asks: ``group_by=tenant`` shows the caller alone, and a ``tenants`` filter naming any
other tenant is a 404 ``tenant_not_found``, the same for a tenant that exists and one that does not
(as another tenant's model or stored response reads as missing). A bad parameter is a 400 naming
it; the registry database unreachable is the 503 the stored Responses give (``from_registry``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

if TYPE_CHECKING:
    from registry.usage_query import UsageReader


def routes(gw: Any, reader: UsageReader) -> list[Route]:
    """The route, reading through ``reader`` (the registry database). A refusal raises
    ``GatewayError`` or ``RegistryError``: the app's handlers answer (``gateway.route_errors``)."""

    async def usage(request: Request) -> Response:
        tenant = gw.auth.tenant(request.headers.get("authorization"), gw._snapshot())
        params: dict[str, list[str]] = {}
        for name, value in request.query_params.multi_items():
            params.setdefault(name, []).append(value)
        page = await reader.page(reader.parse(params, tenant.slug))
        return Response(orjson.dumps(page), media_type="application/json")

    return [Route("/v1/usage", usage, methods=["GET"])]
