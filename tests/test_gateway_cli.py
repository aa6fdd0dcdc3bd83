"""``loraplex token`` and ``loraplex gateway`` as real commands; metrics label caps."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from unittest import mock

import httpx

from gateway.access_lines import BufferedLines
from gateway.metrics import OTHER, GatewayMetrics
from gateway.request_path import _AccessRecords
from loraplex.settings import Settings
from loraplex.tokens import Verifier
from loraplex_cli.main import main
from tests.stub_worker import StubProcess, free_port

ROOT = Path(__file__).resolve().parent.parent


def test_token_command(capsys):
    assert main(["token", "--tenant", "acme", "--ttl", "60"]) == 0
    p = Verifier(Settings.from_env()).verify(capsys.readouterr().out.strip())
    assert p.tenant == "acme" and p.claims["exp"] - p.claims["iat"] == 60
    assert main(["token", "--admin"]) == 0
    p = Verifier(Settings.from_env()).verify(capsys.readouterr().out.strip())
    assert p.tenant is None and p.has_scope(Settings().jwt_admin_scope)
    assert main(["token"]) == 2


def test_gateway_command_serves_with_a_snapshot_file(tmp_path):
    snap = {"version": 1, "base_models": {"smol": {"revision": "r"}},
            "adapters": {"v1": {"name": "support", "version": 1, "base_model": "smol", "uri": "file:///a"}},
            "tenants": {"acme": {"bindings": {"support": {"active": "v1"}}}}}
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps(snap))
    port = free_port()
    with StubProcess("c1") as stub:
        env = dict(os.environ, LORAPLEX_REGISTRY_SNAPSHOT_FILE=str(path), LORAPLEX_GATEWAY_PORT=str(port),
                   LORAPLEX_GATEWAY_METRICS_PORT=str(free_port()), LORAPLEX_WORKER_URLS=stub.url, LORAPLEX_HOME=str(tmp_path / "home"))
        env.pop("LORAPLEX_REDIS_URL", None)
        proc = subprocess.Popen([sys.executable, "-m", "loraplex_cli", "gateway"], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            assert httpx.get(url + "/readyz").status_code == 200
            token = subprocess.run([sys.executable, "-m", "loraplex_cli", "token", "--tenant", "acme"], cwd=ROOT,
                                   env=env, capture_output=True, text=True, check=True).stdout.strip()
            r = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {token}"},
                           json={"model": "support", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.headers["x-loraplex-adapter"] == "support@1"
            # The snapshot file is re-read when it changes.
            snap["tenants"]["acme"]["status"] = "disabled"
            path.write_text(json.dumps(snap))
            os.utime(path, (time.time() + 5, time.time() + 5))
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                r = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {token}"},
                               json={"model": "support", "messages": [{"role": "user", "content": "hi"}]})
                if r.status_code == 403:
                    break
                time.sleep(0.2)
            assert r.status_code == 403
        finally:
            proc.terminate()
            proc.wait(10)
        err = proc.stderr.read() if proc.stderr else ""
        assert "Traceback" not in err
        lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
        assert lines and lines[0]["tenant"] == "acme" and lines[0]["adapter"] == "support@1"
        assert {line["status"] for line in lines} >= {200, 403}


def test_metric_labels_are_capped():
    m = GatewayMetrics(max_tenants=3, max_adapters=2)
    for i in range(10):
        m.observe(f"t{i}", f"a{i}@1", 200, 0.01, 5, 5)
        m.limited(f"t{i}", "tokens")
    text = m.render().decode()
    tenants = {line.split('tenant="')[1].split('"')[0] for line in text.splitlines()
               if line.startswith("loraplex_gateway_requests_total{")}
    assert tenants == {"t0", "t1", "t2", OTHER}
    adapters = {line.split('adapter="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("loraplex_gateway_requests_total{")}
    assert adapters == {"a0@1", "a1@1", OTHER}
    assert 'loraplex_gateway_tokens_total{adapter="other",kind="prompt",tenant="other"} 35.0' in text


def test_request_metrics_exposition():
    m = GatewayMetrics()
    m.observe("acme", "sup@1", 200, 0.005, 40, 5)  # on a bucket bound: counted in that bucket
    m.observe("acme", "sup@1", 200, 0.3, 1, 1)
    m.observe("acme", "sup@1", 503, 200.0, 0, 0)
    text = m.render().decode()
    labels = 'adapter="sup@1",tenant="acme"'
    for line in ('loraplex_gateway_requests_total{adapter="sup@1",status="2xx",tenant="acme"} 2.0',
                 'loraplex_gateway_requests_total{adapter="sup@1",status="503",tenant="acme"} 1.0',
                 f'loraplex_gateway_errors_total{{{labels}}} 1.0',
                 'loraplex_gateway_tokens_total{adapter="sup@1",kind="prompt",tenant="acme"} 41.0',
                 'loraplex_gateway_tokens_total{adapter="sup@1",kind="completion",tenant="acme"} 6.0',
                 'loraplex_gateway_request_seconds_bucket{adapter="sup@1",le="0.005",tenant="acme"} 1.0',
                 'loraplex_gateway_request_seconds_bucket{adapter="sup@1",le="0.25",tenant="acme"} 1.0',
                 'loraplex_gateway_request_seconds_bucket{adapter="sup@1",le="0.5",tenant="acme"} 2.0',
                 'loraplex_gateway_request_seconds_bucket{adapter="sup@1",le="120.0",tenant="acme"} 2.0',
                 'loraplex_gateway_request_seconds_bucket{adapter="sup@1",le="+Inf",tenant="acme"} 3.0',
                 f'loraplex_gateway_request_seconds_count{{{labels}}} 3.0',
                 f'loraplex_gateway_request_seconds_sum{{{labels}}} 200.305'):
        assert line in text, line


async def test_event_loop_lag_shows_a_synchronous_stall():
    m = GatewayMetrics()
    watcher = asyncio.create_task(m.watch_loop_lag(interval_s=0.01))
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.12)  # noqa: ASYNC251 -- work that holds the loop, as a slow rebuild would
        await asyncio.sleep(0.05)
    finally:
        watcher.cancel()
    text = m.render().decode()

    def value(name: str) -> float:
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))

    count = value("loraplex_gateway_event_loop_lag_seconds_count")
    under_100ms = value('loraplex_gateway_event_loop_lag_seconds_bucket{le="0.1"}')
    assert count >= 3 and under_100ms <= count - 1  # the stall landed above 0.1 s
    assert value("loraplex_gateway_event_loop_lag_seconds_sum") >= 0.1


def test_access_lines_go_straight_to_a_line_handler_else_through_logging():
    logger = logging.getLogger(f"test.access.{uuid.uuid4().hex}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    sink = io.StringIO()
    handler = BufferedLines(sink)
    logger.addHandler(handler)
    records = _AccessRecords(logger)
    with mock.patch.object(BufferedLines, "emit", side_effect=AssertionError("no record expected")):
        records.emit('{"a":1}', time.time())
    handler.flush()
    assert sink.getvalue() == '{"a":1}\n'
    seen: list[str] = []
    handler.addFilter(lambda r: seen.append(r.getMessage()) or True)  # a filter needs records
    records.emit('{"b":2}', time.time())
    handler.flush()
    assert seen == ['{"b":2}'] and sink.getvalue() == '{"a":1}\n{"b":2}\n'
