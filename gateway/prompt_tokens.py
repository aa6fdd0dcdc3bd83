"""Exact prompt token counts at the gateway, with the base model's own tokenizer.

Workers serve their tokenizer on ``GET /internal/tokenizer`` (secret-checked). The gateway
fetches it once per (base model, revision) from a live worker of that base, in the
background, keeps it, and counts each prompt the way the worker will (the same chat
template rendering and encode), so the count equals the worker's ``usage.prompt_tokens``.
Requests in the first ``fetch_wait_s`` of a fetch wait for it; while no
tokenizer is known (no worker reached), ``count`` returns None and the caller falls back
to the byte-based upper bound (``gateway.validate.estimate``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import orjson

from gateway.router import Router
from gateway.worker_client import WorkerClient
from loraplex.openai_request import OpenAIRequest
from loraplex.tokenizer import ChatTemplateError, TextTokenizer
from loraplex.tool_calls import render_prompt

log = logging.getLogger("loraplex.gateway.prompt_tokens")

TOKENIZER_PATH = "/internal/tokenizer"
FETCH_TIMEOUT_S = 10.0
OFFLOAD_CHARS = 32_768
"""Prompts longer than this are encoded in a thread (the event loop keeps serving)."""


class PromptError(ValueError):
    """The prompt cannot be encoded (the worker would refuse it too): a 400."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(slots=True)
class _Entry:
    tokenizer: TextTokenizer
    revision: str
    max_model_len: int
    checked_at: float = 0.0


class PromptCounter:
    """Tokenizers per base model, fetched from workers; ``count`` per request."""

    def __init__(self, router: Router, client: WorkerClient, *, retry_s: float = 5.0,
                 check_s: float = 1.0, fetch_wait_s: float = 2.0) -> None:
        self.router = router
        self.fetch_wait_s = fetch_wait_s
        self.client = client
        self.retry_s = retry_s
        self.check_s = check_s
        self._entries: dict[str, _Entry] = {}
        self._fetching: dict[str, asyncio.Task[None]] = {}
        self._failed_at: dict[str, float] = {}
        self._fetch_started: dict[str, float] = {}

    def known(self, base_model: str) -> bool:
        """Whether a tokenizer of ``base_model`` was fetched."""
        return base_model in self._entries

    def entry(self, base_model: str) -> _Entry | None:
        """The tokenizer of ``base_model`` if known and still served by a live worker (else a
        fetch starts in the background and None comes back)."""
        e = self._entries.get(base_model)
        now = time.monotonic()
        if e is not None and now - e.checked_at < self.check_s:
            return e
        if e is not None:
            revisions = {w.base_revision for w in self.router.workers() if w.base_model == base_model}
            if not revisions or e.revision in revisions:
                e.checked_at = now
                return e
            del self._entries[base_model]  # every worker of this base serves another revision now
        self._fetch_soon(base_model, now)
        return None

    def _fetch_soon(self, base_model: str, now: float) -> None:
        if base_model in self._fetching or now - self._failed_at.get(base_model, -1e9) < self.retry_s:
            return
        task = asyncio.get_running_loop().create_task(self._fetch(base_model))
        self._fetch_started[base_model] = now
        self._fetching[base_model] = task
        task.add_done_callback(lambda _: self._fetching.pop(base_model, None))

    async def _fetch(self, base_model: str) -> None:
        workers = [w for w in self.router.workers() if w.base_model in (base_model, "")]
        workers.sort(key=lambda w: w.base_model != base_model)  # reporting workers of the base first
        for w in workers:
            try:
                status, raw = await asyncio.wait_for(
                    self.client.call("GET", w.control + TOKENIZER_PATH, timeout_s=FETCH_TIMEOUT_S), FETCH_TIMEOUT_S)
                if status != 200:
                    continue
                data = orjson.loads(raw)
                if data.get("base_model") != base_model:
                    continue
                tok = await asyncio.to_thread(TextTokenizer.from_dict, data["tokenizer"])
                self._entries[base_model] = _Entry(tok, str(data.get("base_revision", "")),
                                                   int(data["max_model_len"]), time.monotonic())
                self._failed_at.pop(base_model, None)
                log.info("prompt tokens of %s counted with the tokenizer of worker %s (revision %s)",
                         base_model, w.id, data.get("base_revision"))
                return
            except Exception as exc:  # a worker that cannot answer: try the next one
                log.debug("tokenizer from worker %s failed: %s", w.id, exc)
        self._failed_at[base_model] = time.monotonic()

    async def count(self, base_model: str, req: OpenAIRequest) -> tuple[int, int] | None:
        """``(prompt tokens, the model's context length)``, or None while no tokenizer is known."""
        got = await self.tokens(base_model, req)
        return None if got is None else (len(got[0]), got[1])

    async def tokens(self, base_model: str, req: OpenAIRequest) -> tuple[list[int], int] | None:
        """``(the prompt's token ids, the model's context length)``, or None while no tokenizer is
        known: the ids the worker will compute (routing hashes their prefix), at a count's cost."""
        e = self.entry(base_model)
        if e is None:
            task = self._fetching.get(base_model)
            wait = self.fetch_wait_s - (time.monotonic() - self._fetch_started.get(base_model, 0.0))
            if task is None or wait <= 0:
                return None
            with contextlib.suppress(TimeoutError):  # the first requests wait for the fetch a while
                await asyncio.wait_for(asyncio.shield(task), wait)
            e = self._entries.get(base_model)
            if e is None:
                return None
        tok = e.tokenizer
        if req.messages is not None:
            try:
                text = render_prompt(tok, req.messages, req.tools)
            except ChatTemplateError as exc:
                raise PromptError(str(exc), "messages") from None
            ids = await _encode(tok, text, special=False)
        elif isinstance(req.prompt, str):
            ids = await _encode(tok, req.prompt, special=True)
        else:
            ids = req.prompt or []
        return ids, e.max_model_len

    async def close(self) -> None:
        tasks = list(self._fetching.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


async def _encode(tok: TextTokenizer, text: str, *, special: bool) -> list[int]:
    if len(text) > OFFLOAD_CHARS:
        return await asyncio.to_thread(tok.ids, text, special)
    return tok.ids(text, special)

