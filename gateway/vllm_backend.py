"""The body a vLLM worker gets, and the adapter loaded through its agent first.

vLLM names an adapter by ``model``: the gateway's worker body (the fields it checked) without the
``loraplex`` extension,
with ``model`` = the adapter version id (the name ``loraplex vllm-agent`` registered it under)
or vLLM's name of the base model. When the worker's last report does not list the version,
the agent loads it first (``POST {control}/internal/adapters/load``, the bundled worker's
control call). Called only for workers whose report says ``backend: vllm``.

``cache_salt`` is always the gateway's: ``loraplex.prefix.cache_salt`` of the request's namespace
(base revision, adapter version digest or base, the tenant's cache scope). vLLM shares its prefix
cache between every request of one LoRA name unless they carry different salts, so without it
one tenant's prompts would answer faster for another's; with it a vLLM fleet isolates tenants
(and adapter versions, by digest) as the bundled worker's cache does. A client's own
``cache_salt`` is never forwarded: it could only join or probe another scope.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import GatewayError
from gateway.router import Worker
from gateway.worker_client import WorkerBroke, WorkerClient
from loraplex.wire import AdapterRef

LOAD_TIMEOUT_S = 120.0
FORWARDED = frozenset({
    "model", "messages", "prompt", "max_tokens", "stream", "stream_options", "n", "temperature", "top_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "top_k", "seed", "logprobs", "top_logprobs",
    "stop", "stop_token_ids", "ignore_eos", "logit_bias", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "user"})
"""The fields the gateway's request checks know (``loraplex.openai_request``) that vLLM gets as the
client sent them: vLLM's own extensions (``priority``, ``cache_salt``, ``kv_transfer_params``,
``vllm_xargs``, ...) are not a tenant's to set."""
WITHHELD = {
    "max_completion_tokens": "the gateway's plan replaces it with max_tokens before any worker sees the body",
    "metadata": "the client's labels, read by the gateway (canary judging); nothing is generated from them",
}
"""The fields the request checks know that vLLM never gets, and why. Every field the checks read
is in ``FORWARDED`` or here (``tests/test_vllm_fields.py``): a field added to the checks must be
placed, never dropped unseen."""


def _message(raw: bytes) -> str:
    try:
        return str(orjson.loads(raw)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return raw[:200].decode("utf-8", "replace") or "no reason given"


async def ensure_loaded(client: WorkerClient, worker: Worker, ref: AdapterRef, *, force: bool = False) -> None:
    """Have ``worker``'s agent register ``ref`` with vLLM unless its report lists it (``force``: ask
    anyway, and have the agent register it again even if its table lists it: vLLM answered 404). A refused adapter is the client's 503 ``adapter_load_failed`` (no other worker is
    tried, as for a bundled worker); an agent that cannot load now raises ``WorkerUnreachable``
    or ``WorkerBroke`` (the next worker may try)."""
    if not force and (ref.id in worker.device or ref.id in worker.host):
        return
    status, raw = await client.call("POST", worker.control + "/internal/adapters/load",
                                    body=orjson.dumps({"adapter": ref, "reload": force}), timeout_s=LOAD_TIMEOUT_S)
    if status == 200:
        worker.device = worker.device | {ref.id}  # until its next report says so
        return
    if status == 422:
        raise GatewayError(503, f"The adapter could not be loaded: {_message(raw)}", code="adapter_load_failed")
    raise WorkerBroke(f"the agent answered the load with HTTP {status}: {_message(raw)}")


async def vllm_body(client: WorkerClient, body: dict[str, Any], adapter: AdapterRef | None, worker: Worker,
                    *, cache_salt: str, force: bool = False) -> bytes:
    """The worker body for a vLLM ``worker`` (the adapter loaded there first), its prefix cache
    salted with ``cache_salt`` (``loraplex.prefix.cache_salt`` of the request's namespace)."""
    if adapter is not None:
        await ensure_loaded(client, worker, adapter, force=force)
    out = {k: v for k, v in body.items() if k in FORWARDED}
    out["model"] = adapter.id if adapter is not None else (worker.served_model or out.get("model"))
    out["cache_salt"] = cache_salt
    return orjson.dumps(out)
