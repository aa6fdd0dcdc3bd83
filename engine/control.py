"""The control API's shapes, read by ``engine.control_api`` (the routes both the bundled worker and
``loraplex vllm-agent`` serve): the error, the body reader, the ``AdapterRef`` parser.

Torch-free, so the agent runs from the plain install.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from loraplex.digest import is_digest
from loraplex.wire import AdapterRef, error_body


class ControlError(Exception):
    def __init__(self, status: int, message: str, code: str, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.type = status, message, code, type

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, type=self.type, code=self.code), status_code=self.status)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > limit:
        raise ControlError(413, f"request body is larger than {limit} bytes", "body_too_large")
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise ControlError(400, "the body is not valid JSON", "invalid_json") from None
    if not isinstance(body, dict):
        raise ControlError(400, "the body must be a JSON object", "invalid_value")
    return body


def parse_ref(data: Any) -> AdapterRef:
    if not isinstance(data, dict):
        raise ControlError(400, "'adapter' must be an object with id, name and uri", "invalid_value")
    for key in ("id", "uri"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ControlError(400, f"adapter.{key} must be a non-empty string", "invalid_value")
    sha = data.get("sha256")
    if not is_digest(sha):
        raise ControlError(400, "adapter.sha256 must be the adapter version's 64-hex digest", "invalid_value")
    rank = data.get("rank", 0)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ControlError(400, "adapter.rank must be a non-negative integer", "invalid_value")
    given = data.get("name")
    name: str = given if isinstance(given, str) and given else data["id"]
    revision = data.get("base_revision", "")
    if not isinstance(revision, str):
        raise ControlError(400, "adapter.base_revision must be a string", "invalid_value")
    return AdapterRef(id=data["id"], name=name, uri=data["uri"], sha256=sha or None, rank=rank,
                      base_revision=revision)


def ref_of(body: dict[str, Any]) -> AdapterRef:
    return parse_ref(body["adapter"] if "adapter" in body else body)


def id_of(body: dict[str, Any]) -> str:
    aid = body.get("id")
    if aid is None and isinstance(body.get("adapter"), dict):
        aid = body["adapter"].get("id")
    if not isinstance(aid, str) or not aid:
        raise ControlError(400, "'id' must be a non-empty string", "invalid_value")
    return aid


MAX_PROBE_PROMPTS = 128
"""Default gate probes plus up to 64 eval cases fit."""
MAX_PROBE_TOKENS = 512


def parse_probe(body: dict[str, Any]) -> tuple[AdapterRef, list[str], int]:
    """A probe request's adapter, prompts and ``max_tokens`` (bundled worker and vLLM agent alike)."""
    ref = parse_ref(body.get("adapter"))
    prompts = body.get("prompts")
    if (not isinstance(prompts, list) or not prompts or len(prompts) > MAX_PROBE_PROMPTS
            or not all(isinstance(p, str) and p for p in prompts)):
        raise ControlError(400, f"'prompts' must be a list of 1..{MAX_PROBE_PROMPTS} non-empty strings",
                           "invalid_value")
    max_tokens = body.get("max_tokens", 32)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= MAX_PROBE_TOKENS:
        raise ControlError(400, f"'max_tokens' must be an integer in 1..{MAX_PROBE_TOKENS}", "invalid_value")
    return ref, prompts, max_tokens
