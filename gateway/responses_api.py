"""``/v1/responses``: one turn through the chat path (``gateway.request_path.Gateway.responses``), and the
stored responses' routes (retrieve, delete, input items).

A turn reads the previous response (``previous_response_id``, the tenant's only) before anything
is reserved, answers the chat completion as a Response (whole, or as the Responses events), and
keeps it (``store``) before the client sees it complete, so a continuation on any replica finds it.
Nothing is stored for a refused or failed request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import GatewayError
from gateway.proxy import Opened, StreamResult, relay_sse
from gateway.responses import ResponsesRequest, StreamTranslator, answer, new_id, read_request, usage_of
from loraplex import json_body

if TYPE_CHECKING:
    from registry.responses import ResponseStore, Stored

log = logging.getLogger("loraplex.gateway.responses")
NOT_STORED = "The response could not be stored; retry, or send it with store: false."
"""Why a turn failed when the database did not take its response (503 ``store_unavailable``)."""

@dataclass
class Turn:
    """One ``POST /v1/responses`` on its way through the chat path."""

    req: ResponsesRequest
    previous: Stored | None
    context: list[dict[str, Any]]
    """The items before this turn's input."""
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: float = field(default_factory=time.time)
    final: dict[str, Any] | None = None


async def begin(raw: bytes, tenant: str, store: ResponseStore | None, max_chain: int,
                max_body_bytes: int) -> tuple[Turn, dict[str, Any]]:
    """The turn and the chat body to send (400/404 for what cannot go)."""
    try:
        data = json_body.loads(raw)
    except json_body.BodyError as exc:
        raise GatewayError(400, exc.message, code=exc.code, param=exc.param) from None
    req = read_request(data)
    previous = None
    if req.previous_response_id is not None:
        previous = await store.get(tenant, req.previous_response_id) if store is not None else None
        if previous is None:
            raise GatewayError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                               code="previous_response_not_found", param="previous_response_id")
        if previous.depth >= max_chain:
            raise GatewayError(400, f"the conversation already holds {previous.depth} responses, the most one "
                                    f"chain may hold ({max_chain}); start a new one", code="chain_too_long",
                               param="previous_response_id")
    context = previous.conversation() if previous is not None else []
    chat = dict(req.chat, messages=req.messages_for([*context, *req.input_items]))
    if len(orjson.dumps(chat["messages"])) > max_body_bytes:
        raise GatewayError(400, f"the conversation with this input is larger than {max_body_bytes} bytes; start "
                                f"a new one", code="input_too_large", param="input")
    return Turn(req, previous, context), chat


async def keep(turn: Turn, store: ResponseStore | None, tenant: str, adapter: str) -> None:
    """Store the turn's final response (``store`` asked, and a database to keep it)."""
    final = turn.final
    if final is None or not turn.req.store or store is None or final["status"] == "failed":
        return
    await store.put(tenant=tenant, response=final, input_items=turn.req.input_items, context=turn.context,
                    previous=turn.previous, adapter=adapter)


def whole(turn: Turn, alias: str, content: bytes) -> bytes:
    """A whole chat answer as the Response object's bytes (``turn.final`` set)."""
    turn.final = answer(turn.req, turn.id, turn.created_at, alias, orjson.loads(content))
    return orjson.dumps(turn.final)


async def relay(turn: Turn, alias: str, opened: Opened, send: Any, result: StreamResult,
                on_final: Callable[[], Awaitable[str | None]]) -> None:
    """The chat stream as Responses events; ``on_final()`` runs (the response kept) before the last
    event goes out, and what it returns (why the response could not be kept) fails it."""
    tr = StreamTranslator(turn.req, turn.id, alias)
    tr.created_at = turn.created_at
    await send({"type": "http.response.body", "body": tr.start(), "more_body": True})

    async def translated(message: dict[str, Any]) -> None:
        out = tr.feed(message["body"])
        if out:
            await send({"type": "http.response.body", "body": out, "more_body": True})

    await relay_sse(opened, translated, keep_usage=True, result=result)
    if tr.usage is None:
        tr.usage = usage_of(result.usage)
    turn.final = tr.result()
    problem = await on_final()
    if problem is not None:
        tr.error = {"code": "store_unavailable", "message": problem}
    await send({"type": "http.response.body", "body": tr.finish(), "more_body": True})


# --- stored responses: retrieve, delete, input items ------------------------------------------------------

def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _missing(response_id: str) -> GatewayError:
    return GatewayError(404, f"Response with id '{response_id}' not found.", code="response_not_found",
                        param="response_id")


def routes(gw: Any, store: ResponseStore | None) -> list[Any]:
    """Starlette routes for the stored responses (the tenant's only; any other id is the same 404).
    A refusal raises ``GatewayError``, and a database failure ``registry.errors.Unavailable``
    (503 ``store_unavailable`` with ``retry-after``): the app's handlers answer both
    (``gateway.route_errors``)."""
    from starlette.routing import Route

    async def stored(request: Request) -> tuple[str, Stored]:
        """The caller's tenant and its stored response named in the path."""
        tenant = gw.auth.tenant(request.headers.get("authorization"), gw._snapshot())
        response_id = request.path_params["response_id"]
        row = await store.get(tenant.slug, response_id) if store is not None else None
        if row is None:
            raise _missing(response_id)
        return tenant.slug, row

    async def retrieve(request: Request) -> Response:
        _, row = await stored(request)
        return _json(row.response)

    async def delete(request: Request) -> Response:
        tenant, _ = await stored(request)
        response_id = request.path_params["response_id"]
        if store is None or not await store.delete(tenant, response_id):
            raise _missing(response_id)
        return _json({"id": response_id, "object": "response.deleted", "deleted": True})

    async def input_items(request: Request) -> Response:
        _, row = await stored(request)
        q = request.query_params
        try:
            limit = int(q.get("limit", "20"))
        except ValueError:
            limit = -1
        if not 1 <= limit <= 100:
            raise GatewayError(400, "'limit' must be an integer from 1 to 100", param="limit", code="invalid_value")
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise GatewayError(400, "'order' must be 'asc' or 'desc'", param="order", code="invalid_value")
        items = [*row.context, *row.input_items]
        if order == "desc":
            items.reverse()
        after = q.get("after")
        if after:
            ids = [it.get("id") for it in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        return _json({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                      "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    return [Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"])]
