"""A ``WorkerClient`` whose exchanges go to an httpx transport (``httpx.MockTransport``, an
``httpx.ASGITransport`` over a worker app) instead of the network: the gateway's own header
building, retries and error handling run unchanged, only the bytes stay in the process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import httpx

from gateway.worker_client import WorkerBroke, WorkerClient, WorkerResponse, WorkerUnreachable
from loraplex.settings import DEV_WORKER_SECRET
from loraplex.wire import HDR_CACHE


class _Buffered:
    """A worker's answer read whole at the exchange (in-process transports buffer it anyway)."""

    def __init__(self, status: int, content_type: str, parts: list[bytes], cache: str = "") -> None:
        self.status = status
        self.content_type = content_type
        self.cache = cache
        self._parts = parts

    async def read(self) -> bytes:
        return b"".join(self._parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        for part in self._parts:
            yield part

    def close(self) -> None:
        self._parts = []


class TransportWorkerClient(WorkerClient):
    def __init__(self, transport: httpx.AsyncBaseTransport, *, secret: str = DEV_WORKER_SECRET) -> None:
        super().__init__(secret)
        self.client = httpx.AsyncClient(transport=transport)

    async def exchange(self, method: str, url: str, body: bytes | None, headers: Mapping[str, str]) -> WorkerResponse:
        try:
            r = await self.client.request(method, url, content=body, headers=dict(headers))
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise WorkerUnreachable(f"{type(exc).__name__}: {exc}") from None
        except httpx.HTTPError as exc:
            raise WorkerBroke(f"{type(exc).__name__}: {exc}") from None
        return _Buffered(r.status_code, r.headers.get("content-type", "application/json"), [r.content],
                         r.headers.get(HDR_CACHE, ""))

    async def close(self) -> None:
        await self.client.aclose()


def worker_client(transport: httpx.AsyncBaseTransport, *, secret: str = DEV_WORKER_SECRET) -> TransportWorkerClient:
    """The gateway's ``http_client`` for in-process tests: workers answered by ``transport``."""
    return TransportWorkerClient(transport, secret=secret)
