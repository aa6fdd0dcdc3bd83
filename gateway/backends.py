"""How ``Upstream.open`` speaks to each kind of worker: ``backend_of(worker)``.

A worker's report names its backend (``WorkerReport.backend``); ``backend_of`` turns it into
the ``WorkerBackend`` that answers what differs between them, so the proxy asks instead of
branching:

* ``BUNDLED`` (``loraplex worker``): gets the gateway's body as it is (its ``loraplex`` extension
  names the adapter, which the worker loads itself); a 404 is the worker's answer to the
  request; its stream sends ``: accepted`` and ``: progress`` comments, so silence past the
  stall bound ends it.
* ``VLLM`` (a vLLM server behind ``loraplex vllm-agent``): gets the request's vLLM body
  (``gateway.vllm_backend.vllm_body``: the adapter loaded through the agent first, named in
  ``model``); a 404 means vLLM no longer holds the adapter (unloaded since its report), so the
  proxy has the agent load it again and tries once more; its stream sends no comments, so it
  is patient: silence alone never ends it, only the worker's stopping reporting.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable

from gateway.router import Worker

VllmBody = Callable[[Worker, bool], Awaitable[bytes]]
"""The request's body for a vLLM worker: ``(worker, reload)`` -> bytes (``reload``: have the
agent register the adapter again, vLLM answered 404 for it)."""


class WorkerBackend(ABC):
    """What the proxy does differently for one kind of worker."""

    patient: bool
    """Silence alone does not end its stream (``gateway.proxy.Opened.patient``)."""

    @abstractmethod
    async def body(self, worker: Worker, payload: bytes, vllm: VllmBody | None, reload: bool) -> bytes:
        """The body ``worker`` gets for a request whose bundled body is ``payload``."""

    @abstractmethod
    def lost_adapter(self, status: int) -> bool:
        """Whether an answer with ``status`` says the worker no longer holds the request's adapter
        (the proxy then loads it there again and retries once; never the client's answer)."""


class Bundled(WorkerBackend):
    patient = False

    async def body(self, worker: Worker, payload: bytes, vllm: VllmBody | None, reload: bool) -> bytes:
        return payload

    def lost_adapter(self, status: int) -> bool:
        return False


class Vllm(WorkerBackend):
    patient = True

    async def body(self, worker: Worker, payload: bytes, vllm: VllmBody | None, reload: bool) -> bytes:
        """``payload`` where the caller gave no vLLM body."""
        return payload if vllm is None else await vllm(worker, reload)

    def lost_adapter(self, status: int) -> bool:
        return status == 404


BUNDLED = Bundled()
VLLM = Vllm()


def backend_of(worker: Worker) -> WorkerBackend:
    """``worker``'s backend, from its report (``Worker.vllm``)."""
    return VLLM if worker.vllm else BUNDLED
