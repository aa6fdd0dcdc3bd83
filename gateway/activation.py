"""The activation gate: a new adapter version goes live only after a worker has tried it.

``POST /admin/adapters/{ref}/activate`` on the gateway runs this gate before the
registry marks the version active. A worker serving the adapter's base model loads
the version (the same load path as traffic) and answers a few probe prompts greedily
with the base model and with the adapter (``POST /internal/adapters/probe``):

* the adapter's outputs must differ from the base model's on at least one probe —
  an adapter that changes nothing did not load, or is the wrong file;
* where the operator attached an evaluation set (``{"cases": [{"prompt", "expect"}],
  "threshold": 0.8}``, ``expect`` a regular expression searched in the adapter's
  answer), the share of matching answers must reach the threshold.

The outcome (worker, probe outputs, eval score, reason) is recorded on the version
(``verification``) and in the audit log; a refusal marks the version ``failed``.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.router import Router
from loraplex.settings import Settings
from loraplex.wire import HDR_WORKER_SECRET, AdapterRef
from registry.errors import Invalid, Unavailable

log = logging.getLogger("loraplex.gateway.activation")

DEFAULT_PROBES: tuple[str, ...] = (
    "What is the capital of France?",
    "How do I reset my password?",
    "Describe the ocean in one sentence.",
)
MAX_CASES = 64


class GateError(Invalid):
    """The activate request is malformed (eval set): nothing is recorded."""

    default_code = "invalid_eval_set"


class NoVerifier(Unavailable):
    """No worker could run the probes: nothing is recorded; retry when one is up."""

    default_code = "no_worker"


@dataclass
class GateResult:
    passed: bool
    reason: str | None
    verification: dict[str, Any] = field(default_factory=dict)


def _eval_set(raw: Any) -> tuple[list[tuple[str, re.Pattern[str]]], float] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("cases"), list) or not raw["cases"]:
        raise GateError("eval must be an object with a non-empty 'cases' list", param="eval")
    threshold = raw.get("threshold", 1.0)
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 < threshold <= 1:
        raise GateError("eval.threshold must be a number in (0, 1]")
    if len(raw["cases"]) > MAX_CASES:
        raise GateError(f"eval has more than {MAX_CASES} cases")
    cases = []
    for i, case in enumerate(raw["cases"]):
        if not isinstance(case, dict) or not isinstance(case.get("prompt"), str) or not case["prompt"].strip() \
                or not isinstance(case.get("expect"), str):
            raise GateError(f"eval.cases[{i}] needs a non-empty 'prompt' and an 'expect' regular expression")
        try:
            cases.append((case["prompt"], re.compile(case["expect"], re.IGNORECASE)))
        except re.error as exc:
            raise GateError(f"eval.cases[{i}].expect is not a valid regular expression: {exc}") from None
    return cases, float(threshold)


class ActivationGate:
    def __init__(self, settings: Settings, router: Router, client: httpx.AsyncClient, *,
                 probes: tuple[str, ...] = DEFAULT_PROBES, max_tokens: int = 32, timeout_s: float = 300.0) -> None:
        self.settings = settings
        self.router = router
        self.client = client
        self.probes = probes
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s

    async def __call__(self, adapter: dict[str, Any], request: dict[str, Any]) -> GateResult:
        """Probe ``adapter`` (a registry adapter record) on a worker; ``request`` is the activate body."""
        evaluation = _eval_set(request.get("eval"))
        ref = AdapterRef(id=adapter["id"], name=f"{adapter['name']}@{adapter['version']}", uri=adapter["uri"],
                         sha256=adapter.get("sha256"), rank=int(adapter.get("rank") or 0))
        prompts = list(self.probes) + ([p for p, _ in evaluation[0]] if evaluation else [])
        body = {"adapter": ref.to_dict(), "prompts": prompts, "max_tokens": self.max_tokens}
        workers = await self.router.route(adapter["base_model"], ref.id)
        if not workers:
            raise NoVerifier(f"no live worker serves base model {adapter['base_model']!r}; cannot verify "
                             f"the adapter")
        last_error = "no worker answered"
        for worker in workers:
            t0 = time.monotonic()
            try:
                r = await self.client.post(worker.url + "/internal/adapters/probe", json=body,
                                           headers={HDR_WORKER_SECRET: self.settings.worker_secret},
                                           timeout=self.timeout_s)
            except httpx.HTTPError as exc:
                self.router.mark_failed(worker)
                last_error = f"worker {worker.id}: {type(exc).__name__}"
                continue
            if r.status_code == 422:  # the worker could not load the adapter: a verdict, not an outage
                reason = _message(r) or "the worker could not load the adapter"
                return GateResult(False, f"load failed: {reason}",
                                  {"worker": worker.id, "passed": False, "reason": f"load failed: {reason}"})
            if r.status_code != 200:
                last_error = f"worker {worker.id}: HTTP {r.status_code}: {_message(r)}"
                continue
            return self._judge(worker.id, r.json(), evaluation, time.monotonic() - t0)
        raise NoVerifier(f"could not verify the adapter: {last_error}")

    def _judge(self, worker_id: str, data: dict[str, Any],
               evaluation: tuple[list[tuple[str, re.Pattern[str]]], float] | None, seconds: float) -> GateResult:
        results = data.get("results") or []
        probes = results[:len(self.probes)]
        differ = sum(1 for p in probes if p.get("adapter") != p.get("base"))
        verification: dict[str, Any] = {
            "worker": worker_id, "probes": probes, "probes_differing": differ,
            "adapter_load_ms": data.get("adapter_load_ms"), "seconds": round(seconds, 3),
        }
        reason = None
        if differ == 0:
            reason = "the adapter's outputs equal the base model's on every probe (not loaded, or the wrong file)"
        if evaluation is not None:
            cases, threshold = evaluation
            answers = results[len(self.probes):]
            hits = [bool(rx.search(a.get("adapter", ""))) for (_, rx), a in zip(cases, answers, strict=False)]
            score = sum(hits) / len(cases)
            verification["eval"] = {"score": round(score, 4), "threshold": threshold, "cases": len(cases),
                                    "matched": sum(hits)}
            if reason is None and score < threshold:
                reason = f"eval score {score:.2f} is below the threshold {threshold:.2f}"
        verification["passed"] = reason is None
        if reason:
            verification["reason"] = reason
        return GateResult(reason is None, reason, verification)


def _message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:200]
