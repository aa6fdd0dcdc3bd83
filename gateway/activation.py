"""The activation gate: a new adapter version goes live only after a worker has tried it.

``POST /admin/adapters/{ref}/activate`` on the gateway runs this gate before the
registry marks the version active. A worker serving the adapter's base model loads
the version (the same load path as traffic) and answers a few probe prompts greedily
with the base model and with the adapter (``POST /internal/adapters/probe``):

* the adapter's outputs must differ from the base model's on at least one probe —
  an adapter that changes nothing did not load, or is the wrong file;
* its outputs must be answers: an empty (or whitespace-only) answer to any prompt, or one
  and the same answer to every prompt while the base model's differ, fails it;
* a worker's engine failing during the probe fails it, and the gate stops there (only a
  worker that cannot be reached hands the probe to the next one);
* where the operator attached an evaluation set (``{"cases": [{"prompt", "expect"}],
  "threshold": 0.8}``, ``expect`` a regular expression searched in the adapter's
  answer), the share of matching answers must reach the threshold.

The outcome (worker, probe prompts with base and adapter outputs, eval score and the failed
cases with the adapter's answers, reason) is recorded on the version (``verification``) and
in the audit log; a refusal marks the version ``failed``, and activating it again re-runs
the gate.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.router import Router
from gateway.worker_client import WorkerBroke, WorkerClient, WorkerUnreachable
from loraplex.settings import Settings
from loraplex.wire import AdapterRef
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
    def __init__(self, settings: Settings, router: Router, client: WorkerClient, *,
                 probes: tuple[str, ...] = DEFAULT_PROBES, max_tokens: int = 32, timeout_s: float = 300.0) -> None:
        self.settings = settings
        self.router = router
        self.client = client
        self.probes = probes
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s

    async def __call__(self, adapter: dict[str, Any], request: dict[str, Any]) -> GateResult:
        """Probe ``adapter`` (a registry adapter record) on a worker; ``request`` is the activate body.

        Only a worker that cannot be reached hands the probe to the next one; once a worker
        has taken it, its answer (a verdict, or an engine failure) is final: an adapter that
        breaks one worker's engine is not tried on another.
        """
        evaluation = _eval_set(request.get("eval"))
        revision = str(adapter.get("base_revision") or "")
        ref = AdapterRef(id=adapter["id"], name=f"{adapter['name']}@{adapter['version']}", uri=adapter["uri"],
                         sha256=adapter.get("sha256"), rank=int(adapter.get("rank") or 0), base_revision=revision)
        prompts = list(self.probes) + ([p for p, _ in evaluation[0]] if evaluation else [])
        body = orjson.dumps({"adapter": ref.to_dict(), "prompts": prompts, "max_tokens": self.max_tokens})
        routed = await self.router.route(adapter["base_model"], ref.id)
        if not routed:
            raise NoVerifier(f"no live worker serves base model {adapter['base_model']!r}; cannot verify "
                             f"the adapter")
        # Only a worker on the version's base revision may judge it (a worker that does not report
        # its revision is asked, and refuses the load itself if it differs).
        workers = [w for w in routed if not revision or not w.base_revision or w.base_revision == revision]
        if not workers:  # reload the live set once (a worker on the revision may just have reported)
            await self.router.refresh()
            routed = await self.router.route(adapter["base_model"], ref.id) or routed
            workers = [w for w in routed if not w.base_revision or w.base_revision == revision]
        if not workers:
            seen = ", ".join(sorted({f"{w.id} at {w.base_revision!r}" for w in routed}))
            raise NoVerifier(f"no live worker serves {adapter['base_model']} at revision {revision!r} ({seen}); "
                             f"cannot verify the adapter", code="no_worker_on_revision")
        last_error = "no worker answered"
        for worker in workers:
            t0 = time.monotonic()
            try:
                answer = await self.client.call("POST", worker.control + "/internal/adapters/probe", body=body,
                                                timeout_s=self.timeout_s)
            except WorkerUnreachable as exc:  # it never took the probe: the next worker may try
                self.router.mark_failed(worker)
                last_error = f"worker {worker.id}: {exc}"
                continue
            except WorkerBroke as exc:  # it took the probe and broke off (crashed, hung)
                self.router.mark_failed(worker)
                return _failed(worker.id, f"worker {worker.id} broke off during the probe ({exc})",
                               error={"message": str(exc)})
            result = self._verdict(worker.id, *answer, prompts, evaluation, time.monotonic() - t0)
            if evaluation is not None and isinstance(result.verification.get("eval"), dict):
                result.verification["eval"]["set"] = request["eval"]  # re-run by a base-model upgrade
            return result
        raise NoVerifier(f"could not verify the adapter: {last_error}")

    def _verdict(self, worker_id: str, status: int, raw: bytes, prompts: list[str],
                 evaluation: tuple[list[tuple[str, re.Pattern[str]]], float] | None, seconds: float) -> GateResult:
        """What one worker's answer (``status``, body ``raw``) to the probe says about the adapter."""
        error = {"status": status, "code": _code(raw), "message": _message(raw)}
        if status == 422:  # the worker could not load the adapter
            return _failed(worker_id, f"load failed: {error['message'] or 'the worker could not load the adapter'}",
                           error=error)
        if status == 503 and error["code"] == "queue_full":
            raise NoVerifier(f"worker {worker_id} is too busy to run the probe; retry: {error['message']}",
                             code="worker_busy")
        if status == 400:  # an eval prompt the worker cannot take (too long, template)
            raise GateError(f"the worker refused the probe prompts: {error['message']}", param="eval")
        if 400 < status < 500:  # secret, routes: the worker's set-up, not the adapter
            raise NoVerifier(f"worker {worker_id} refused the probe (HTTP {status}: {error['message']}); "
                             f"check its worker secret and LoRA settings", code="verifier_refused")
        if status != 200:
            code = f" {error['code']}" if error["code"] else ""
            return _failed(worker_id, f"the engine failed during the probe (HTTP {status}{code}: "
                                      f"{error['message']})", error=error)
        try:
            data = orjson.loads(raw)
            results = data["results"]
            texts = [(str(x.get("base") or ""), str(x.get("adapter") or "")) for x in results]
        except (ValueError, KeyError, TypeError, AttributeError):
            return _failed(worker_id, "the worker's probe answer is malformed", error=error)
        if len(texts) != len(prompts):
            return _failed(worker_id, f"the worker answered {len(texts)} of {len(prompts)} probe prompts")
        return self._judge(worker_id, prompts, texts, data.get("adapter_load_ms"), evaluation, seconds)

    def _judge(self, worker_id: str, prompts: list[str], texts: list[tuple[str, str]], load_ms: Any,
               evaluation: tuple[list[tuple[str, re.Pattern[str]]], float] | None, seconds: float) -> GateResult:
        n = len(self.probes)
        probes = [{"prompt": p, "base": b, "adapter": a} for p, (b, a) in zip(prompts[:n], texts[:n], strict=True)]
        differ = sum(1 for p in probes if p["adapter"] != p["base"])
        verification: dict[str, Any] = {
            "worker": worker_id, "probes": probes, "probes_differing": differ,
            "adapter_load_ms": load_ms, "seconds": round(seconds, 3),
        }
        reason = _degenerate(prompts, texts)
        if reason is None and differ == 0:
            reason = "the adapter's outputs equal the base model's on every probe (not loaded, or the wrong file)"
        if evaluation is not None:
            cases, threshold = evaluation
            failed_cases = []
            for (prompt, rx), (_, answer) in zip(cases, texts[n:], strict=True):
                if not rx.search(answer):
                    failed_cases.append({"prompt": prompt, "expect": rx.pattern, "adapter": answer})
            matched = len(cases) - len(failed_cases)
            score = matched / len(cases)
            verification["eval"] = {"score": round(score, 4), "threshold": threshold, "cases": len(cases),
                                    "matched": matched, "failed_cases": failed_cases}
            if reason is None and score < threshold:
                reason = f"eval score {score:.2f} is below the threshold {threshold:.2f}"
        verification["passed"] = reason is None
        if reason:
            verification["reason"] = reason
        return GateResult(reason is None, reason, verification)


def _degenerate(prompts: list[str], texts: list[tuple[str, str]]) -> str | None:
    """Why the adapter's answers are no answers at all (empty, or one text for every prompt)."""
    empty = [p for p, (_, a) in zip(prompts, texts, strict=True) if not a.strip()]
    if empty:
        return (f"degenerate output: the adapter answered nothing (empty or whitespace) to {len(empty)} of "
                f"{len(prompts)} prompts, e.g. {empty[0]!r}")
    answers = {a.strip() for _, a in texts}
    if len(set(prompts)) > 1 and len(answers) == 1 and len({b.strip() for b, _ in texts}) > 1:
        return (f"degenerate output: the adapter gives the same answer to every prompt "
                f"({next(iter(answers))[:80]!r}) while the base model's answers differ")
    return None


def _failed(worker_id: str, reason: str, *, error: dict[str, Any] | None = None) -> GateResult:
    verification: dict[str, Any] = {"worker": worker_id, "passed": False, "reason": reason}
    if error is not None:
        verification["error"] = error
    return GateResult(False, reason, verification)


def _code(raw: bytes) -> str | None:
    try:
        code = orjson.loads(raw)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return str(code) if code is not None else None


def _message(raw: bytes) -> str:
    try:
        return str(orjson.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode("utf-8", "replace")
