"""What an operator reads of the canary judge: ``canary set-policy`` with a check judged per topic,
and ``canary status`` saying which checks failed, on how many samples, in words."""

from __future__ import annotations

import asyncio

from gateway.canary_judge import CanaryJudge
from gateway.canary_samples import MemorySamples
from registry.service import RegistryService
from tests.test_admin_cli import _seed, run, run_json, server  # noqa: F401  (server: the fixture)


def _feed(samples: MemorySamples, version: str, n: int, at: float, *, broken_topic: str | None = None,
          streamed: bool = False) -> None:
    for i in range(n):
        topic = "refund" if i % 10 == 0 else "shipping"
        samples.record("acme/support", (at + i * 1e-3, version, True, 0.05 + (i % 7) * 1e-3,
                                        (40.0 + i % 5) if streamed else 0.0, 12, topic == broken_topic, False,
                                        {"topic": topic}))


async def _judge(settings, ids: dict[str, str]) -> dict:
    svc = RegistryService(settings)
    try:
        samples = MemorySamples()
        judge = CanaryJudge(svc, samples)
        [start] = await judge.tick(now=1000.0)
        assert start["decision"] == "start"
        _feed(samples, ids["canary"], 100, 1001.0, broken_topic="refund")
        _feed(samples, ids["active"], 400, 1001.0)
        [failing] = await judge.tick(now=1005.0)
        return failing
    finally:
        await svc.close()


def test_status_names_the_failed_check_per_topic_in_words(server, capsys, tmp_path):  # noqa: F811
    settings, _, _ = server
    _seed(capsys, settings, tmp_path)
    active = run_json(capsys, "adapter", "activate", "support@1")["id"]
    canary = run_json(capsys, "adapter", "activate", "support@2")["id"]
    run_json(capsys, "bind", "acme", "support", "support@1")
    code, _, err = run(capsys, "canary", "set-policy", "acme", "support", "--check", "empty_share=2@topic")
    assert code == 1 and "metadata.KEY" in err
    code, out, err = run(capsys, "canary", "set-policy", "acme", "support", "--steps", "10,100", "--min-requests",
                         "20", "--check", "empty_share=2@metadata.topic", "--check", "tokens_per_s=0.67",
                         "--check", "error_rate=2")
    assert code == 0, err
    assert "empty_share per metadata.topic" in out
    assert run_json(capsys, "canary", "status", "acme", "support")["checks"]["empty_share"] == {
        "threshold": 2.0, "segment": "metadata.topic"}
    run_json(capsys, "canary", "start", "acme", "support", "support@2", "--percent", "1")

    failing = asyncio.run(_judge(settings, {"canary": canary, "active": active}))
    assert failing["decision"] == "failing" and failing["failed"] == ["empty_share[topic=refund]"]

    code, out, _ = run(capsys, "canary", "status", "acme", "support")
    assert code == 0
    lines = out.splitlines()
    assert "last judgement: failing, window 5 s: canary 100 requests, active 400, failures 1 of 2" in out, out
    assert any("failed judgement 1 of 2: empty_share[topic=refund]: canary 10 of 10 answers vs active 0 of 40"
               in line for line in lines), out
    [refund] = [line.split() for line in lines if line.strip().startswith("empty_share[topic=refund]")
                and "FAILED" in line]
    assert refund[1:4] == ["FAILED", "10", "of"] and "inf" in refund, refund
    [shipping] = [line.split() for line in lines if line.strip().startswith("empty_share[topic=shipping]")]
    assert shipping[1] == "ok"
    [tps] = [line for line in lines if line.strip().startswith("tokens_per_s")]
    assert "no data" in tps and "ok" not in tps.split()  # non-streamed traffic: no data, not "ok"
    assert " ok " in next(line for line in lines if line.strip().startswith("error_rate")) + " "
