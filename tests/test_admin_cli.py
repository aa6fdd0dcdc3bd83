"""``loraplex admin`` against a running admin API (uvicorn on a loopback port, real SQLite
registry): every command group, ``--json`` output, refusals exit nonzero with the reason."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Mount

from loraplex_cli.main import main
from registry.admin_api import admin_app
from registry.migrate import upgrade
from registry.service import RegistryService
from tests.registry_support import TINY, make_settings, write_adapter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path, monkeypatch):
    url = f"sqlite+aiosqlite:///{tmp_path}/registry.db"
    upgrade(url)
    settings = make_settings(tmp_path, url)
    port = _free_port()
    service = RegistryService(settings)
    gate = RecordingGate()
    app = Starlette(routes=[Mount("/admin", app=admin_app(service, settings, gate=gate))])
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "admin server did not start"
        time.sleep(0.02)
    admin_url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("LORAPLEX_ADMIN_URL", admin_url)
    monkeypatch.setenv("LORAPLEX_JWT_SECRET", settings.jwt_secret)
    monkeypatch.delenv("LORAPLEX_ADMIN_TOKEN", raising=False)
    yield settings, admin_url, gate
    srv.should_exit = True
    thread.join(timeout=10)


class RecordingGate:
    """The activation-gate seam: passes every version (refuses while ``fail``), remembering what it was asked."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.fail = False

    async def __call__(self, adapter: dict, request: dict):
        from types import SimpleNamespace

        self.requests.append(request)
        if self.fail:
            reason = "eval score 0.00 is below the threshold 1.00"
            return SimpleNamespace(passed=False, reason=reason, verification={
                "worker": "w1", "passed": False, "reason": reason,
                "probes": [{"prompt": "What is 2+2?", "base": "4", "adapter": "Quatre."}],
                "eval": {"score": 0.0, "threshold": 1.0, "cases": 1, "matched": 0,
                         "failed_cases": [{"prompt": "Say hi", "expect": "^hello", "adapter": "Bonjour !"}]}})
        return SimpleNamespace(passed=True, reason=None, verification={"passed": True, "gate": "recording"})


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["admin", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def run_json(capsys, *argv: str):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_admin_cli_end_to_end(server, capsys, tmp_path):
    settings, _, gate = server
    code, out, _ = run(capsys, "tenant", "create", "acme", "--tokens-per-min", "5000", "--priority", "high")
    assert code == 0 and "created tenant acme" in out and "5000" in out and "high" in out
    code, _, err = run(capsys, "tenant", "create", "acme")
    assert code == 1 and "already exists" in err and "409" in err and "tenant_exists" in err
    code, _, err = run(capsys, "tenant", "limits", "acme", "--requests-per-min", "-5")
    assert code == 1 and "422" in err
    assert run_json(capsys, "tenant", "limits", "acme", "--max-concurrent", "3")["max_concurrent"] == 3
    kept = run_json(capsys, "tenant", "limits", "acme", "--response-retention-s", "86400")
    assert kept["response_retention_s"] == 86400 and kept["max_concurrent"] == 3
    assert run_json(capsys, "tenant", "disable", "acme")["status"] == "disabled"
    assert run_json(capsys, "tenant", "enable", "acme")["status"] == "active"
    assert [t["slug"] for t in run_json(capsys, "tenant", "list")["data"]] == ["acme"]
    code, out, _ = run(capsys, "tenant", "list")
    assert out.splitlines()[0].split()[:2] == ["SLUG", "STATUS"] and "acme" in out

    # base model from a local HF-format directory (config.json + safetensors)
    model_dir = tmp_path / "tiny-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 128}))
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(model_dir / "model.safetensors"))
    bm = run_json(capsys, "base-model", "add", "--from-model", str(model_dir), "--name", "tiny")
    assert (bm["hidden_size"], bm["num_layers"], bm["head_dim"]) == (32, 2, 8) and len(bm["revision"]) == 16
    tiny = TINY.__class__(**{**TINY.to_dict(), "revision": bm["revision"]})
    assert [m["name"] for m in run_json(capsys, "base-model", "list")["data"]] == ["tiny"]

    root = Path(settings.resolved_adapter_root())
    for seed in (1, 2, 3):
        write_adapter(root / f"support-v{seed}", tiny, seed=seed)
        a = run_json(capsys, "adapter", "register", "support", f"support-v{seed}", "--base-model", "tiny",
                     "--owner", "acme")
        assert a["status"] == "pending" and a["version"] == seed
        run_json(capsys, "adapter", "activate", f"support@{seed}")
    bad = write_adapter(root / "bad", tiny, config={"r": 999})
    code, _, err = run(capsys, "adapter", "register", "bad", str(bad), "--base-model", "tiny")
    assert code == 1 and "rank_too_large" in err
    code, _, err = run(capsys, "adapter", "register", "bad", "bad", "--base-model", "tiny", "--json")
    assert code == 1 and json.loads(err)["error"]["code"] == "rank_too_large"
    code, out, _ = run(capsys, "adapter", "list", "--owner", "acme")
    assert code == 0 and out.count("support@") == 3
    code, out, _ = run(capsys, "adapter", "show", "support@1")
    assert "target modules: q_proj, v_proj" in out and "verification: passed" in out
    assert '"gate": "recording"' in out
    eval_file = tmp_path / "eval.json"
    eval_file.write_text(json.dumps({"cases": [{"prompt": "hi", "expect": "hello"}], "threshold": 0.5}))
    write_adapter(root / "support-v4", tiny, seed=4)
    run_json(capsys, "adapter", "register", "support", "support-v4", "--base-model", "tiny", "--owner", "acme")
    assert run_json(capsys, "adapter", "activate", "support@4", "--eval", f"@{eval_file}")["status"] == "active"
    assert gate.requests[-1] == {"eval": {"cases": [{"prompt": "hi", "expect": "hello"}], "threshold": 0.5}}
    code, _, err = run(capsys, "adapter", "activate", "support@4", "--verification", "{}")
    assert code == 1 and "recorded by the activation gate" in err

    code, out, _ = run(capsys, "bind", "acme", "support", "support@1", "--on-disabled", "base")
    assert code == 0 and "acme/support -> support@1" in out
    assert run_json(capsys, "bind", "acme", "support", "support@2")["previous"]["label"] == "support@1"
    code, out, _ = run(capsys, "rollback", "acme", "support")
    assert code == 0 and "back to support@1" in out
    code, out, _ = run(capsys, "canary", "start", "acme", "support", "support@3", "--percent", "10")
    assert code == 0 and "support@3 at 10%" in out
    code, _, err = run(capsys, "canary", "set", "acme", "support", "0")
    assert code == 1 and "invalid_percent" in err
    assert run_json(capsys, "canary", "set", "acme", "support", "40")["canary_percent"] == 40
    assert run_json(capsys, "canary", "promote", "acme", "support")["active"]["label"] == "support@3"
    code, _, err = run(capsys, "canary", "abort", "acme", "support")
    assert code == 1 and "no_canary" in err
    run_json(capsys, "canary", "start", "acme", "support", "support@2", "--percent", "5")
    assert run_json(capsys, "canary", "abort", "acme", "support")["canary"] is None
    # The judge's policy: set (fields given over the defaults), status, pause, resume.
    code, _, err = run(capsys, "canary", "status", "acme", "support")
    assert code == 1 and "set-policy" in err
    code, out, _ = run(capsys, "canary", "set-policy", "acme", "support", "--steps", "10,50,100", "--interval", "30",
                       "--check", "error_rate=1.5", "--check", "ttft_p99=2")
    assert code == 0 and "steps 10/50/100 %, every 30 s" in out and "waiting, no canary" in out
    got = run_json(capsys, "canary", "status", "acme", "support")
    assert got["checks"] == {"error_rate": 1.5, "ttft_p99": 2.0} and got["min_requests"] == 50
    code, _, err = run(capsys, "canary", "set-policy", "acme", "support", "--check", "nope=1")
    assert code == 1 and "unknown check" in err
    assert run_json(capsys, "canary", "pause", "acme", "support")["status"] == "paused"
    code, out, _ = run(capsys, "canary", "resume", "acme", "support")
    assert code == 0 and "running" in out
    assert run_json(capsys, "binding", "disable", "acme", "support")["on_disabled"] == "refuse"  # not sticky
    assert run_json(capsys, "binding", "enable", "acme", "support")["enabled"] is True
    code, out, _ = run(capsys, "binding", "list")
    assert "support@3" in out and "ACTIVE" in out
    assert run_json(capsys, "binding", "show", "acme", "support")["active"]["label"] == "support@3"
    code, _, err = run(capsys, "rollback", "acme", "missing")
    assert code == 1 and "404" in err
    assert run_json(capsys, "adapter", "disable", "support@1", "--reason", "old")["status"] == "disabled"
    code, _, err = run(capsys, "adapter", "disable", "support@3")
    assert code == 1 and "409" in err and "adapter_in_use" in err and "acme/support (active)" in err
    run_json(capsys, "bind", "acme", "spare", "support@2")
    code, out, _ = run(capsys, "binding", "delete", "acme", "spare")
    assert code == 0 and "removed acme/spare" in out
    code, _, err = run(capsys, "binding", "show", "acme", "spare")
    assert code == 1 and "binding_not_found" in err

    entries = run_json(capsys, "audit", "--target", "binding:acme/support", "--limit", "7")["data"]
    assert [e["action"] for e in entries] == ["binding.enable", "binding.disable", "canary.resume", "canary.pause",
                                              "canary.policy_set", "binding.canary_abort", "binding.canary_start"]
    assert all(e["actor"] == "cli" for e in entries)
    code, out, _ = run(capsys, "audit", "--action", "tenant.create")
    assert code == 0 and "tenant:acme" in out
    v = run_json(capsys, "version")["version"]
    assert v == max(e["registry_version"] for e in run_json(capsys, "audit")["data"])


def test_admin_cli_auth_and_unreachable(server, capsys, monkeypatch):
    settings, _, _ = server
    from loraplex.tokens import mint

    code, _, err = run(capsys, "tenant", "list", "--token", mint(settings, "x", tenant="acme"))
    assert code == 1 and "403" in err
    code, _, err = run(capsys, "tenant", "list", "--token", "garbage")
    assert code == 1 and "401" in err
    code, _, err = run(capsys, "tenant", "list", "--url", f"http://127.0.0.1:{_free_port()}")
    assert code == 3 and "cannot reach" in err


def test_admin_cli_subprocess(server, tmp_path):
    """The installed entry point, as an operator runs it."""
    _, admin_url, _ = server
    env = {**os.environ, "LORAPLEX_ADMIN_URL": admin_url}
    cmd = [sys.executable, "-m", "loraplex_cli", "admin"]
    r = subprocess.run([*cmd, "tenant", "create", "globex", "--json"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["slug"] == "globex"
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "tenant" in r.stdout and "canary" in r.stdout
    r = subprocess.run([*cmd, "canary", "--help"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "promote" in r.stdout


def _seed(capsys, settings, tmp_path) -> None:
    """Tenant acme, base model tiny, adapter support@1 (active) bound as acme/support."""
    assert run(capsys, "tenant", "create", "acme")[0] == 0
    model_dir = tmp_path / "tiny-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 128}))
    (model_dir / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    bm = run_json(capsys, "base-model", "add", "--from-model", str(model_dir), "--name", "tiny")
    tiny = TINY.__class__(**{**TINY.to_dict(), "revision": bm["revision"]})
    root = Path(settings.resolved_adapter_root())
    for seed in (1, 2):
        write_adapter(root / f"support-v{seed}", tiny, seed=seed)
        run_json(capsys, "adapter", "register", "support", f"support-v{seed}", "--base-model", "tiny")


def test_admin_cli_global_options_before_and_after_the_subcommand(server, capsys, monkeypatch):
    _, admin_url, _ = server
    monkeypatch.setenv("LORAPLEX_ADMIN_URL", f"http://127.0.0.1:{_free_port()}")  # nothing listens there
    run(capsys, "--url", admin_url, "tenant", "create", "acme")
    for argv in (("--url", admin_url, "--json", "tenant", "list"), ("tenant", "list", "--url", admin_url, "--json"),
                 ("--json", "tenant", "list", "--url", admin_url), ("--url", admin_url, "tenant", "--json", "list")):
        code, out, err = run(capsys, *argv)
        assert code == 0, (argv, err)
        assert [t["slug"] for t in json.loads(out)["data"]] == ["acme"], argv
    code, _, err = run(capsys, "--url", admin_url, "--token", "garbage", "tenant", "list")
    assert code == 1 and "401" in err  # the token given before the subcommand is the one sent
    code, _, err = run(capsys, "--url", admin_url, "--timeout", "5", "tenant", "list", "--token", "garbage")
    assert code == 1 and "401" in err
    code, _, err = run(capsys, "tenant", "list")  # no --url anywhere: the configured (dead) URL
    assert code == 3 and "cannot reach" in err


def test_admin_cli_failed_activation_shows_evidence_and_can_be_retried(server, capsys, tmp_path):
    settings, _, gate = server
    _seed(capsys, settings, tmp_path)
    gate.fail = True
    code, _, err = run(capsys, "adapter", "activate", "support@1")
    assert code == 1 and "activation refused: eval score 0.00" in err and "adapter_verification_failed" in err
    assert "verification: FAILED on worker w1" in err
    assert '"What is 2+2?"' in err and 'base:    "4"' in err and 'adapter: "Quatre."' in err
    assert 'failed "Say hi" expects /^hello/' in err and '"Bonjour !"' in err
    code, _, err = run(capsys, "adapter", "activate", "support@1", "--json")
    assert code == 1 and json.loads(err)["adapter"]["verification"]["eval"]["failed_cases"][0]["prompt"] == "Say hi"
    code, out, _ = run(capsys, "adapter", "show", "support@1")
    assert code == 0 and "failed" in out and 'adapter: "Quatre."' in out and "reason: eval score" in out
    gate.fail = False
    assert run_json(capsys, "adapter", "activate", "support@1")["status"] == "active"


def test_admin_cli_disable_in_use_force_enable(server, capsys, tmp_path):
    settings, _, _ = server
    _seed(capsys, settings, tmp_path)
    run_json(capsys, "adapter", "activate", "support@1")
    run_json(capsys, "adapter", "activate", "support@2")
    run_json(capsys, "bind", "acme", "support", "support@1", "--on-disabled", "base")
    run_json(capsys, "canary", "start", "acme", "support", "support@2", "--percent", "10")
    code, _, err = run(capsys, "adapter", "disable", "support@2")
    assert code == 1 and "acme/support (canary)" in err and "adapter_in_use" in err
    assert run_json(capsys, "binding", "show", "acme", "support")["canary"]["label"] == "support@2"
    code, out, _ = run(capsys, "adapter", "disable", "support@2", "--force", "--reason", "regression")
    assert code == 0 and "disabled support@2" in out and "acme/support: canary aborted" in out
    assert run_json(capsys, "binding", "show", "acme", "support")["canary"] is None
    code, out, _ = run(capsys, "adapter", "enable", "support@2")
    assert code == 0 and "enabled support@2" in out and "stay disabled" in out
    assert run_json(capsys, "adapter", "show", "support@2")["status"] == "active"
    entries = run_json(capsys, "audit", "--limit", "3")["data"]
    assert [e["action"] for e in entries] == ["adapter.enable", "binding.canary_abort", "adapter.disable"]
    # bind chose base; a plain disable refuses, an explicit one falls back to the base model
    assert run_json(capsys, "binding", "disable", "acme", "support")["on_disabled"] == "refuse"
    run_json(capsys, "binding", "enable", "acme", "support")
    assert run_json(capsys, "binding", "disable", "acme", "support", "--on-disabled", "base")["on_disabled"] == "base"


def _closed_stdout(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` with its stdout a pipe nobody reads any more (``cmd | head -0``)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(cmd, env=env, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)


def test_output_to_a_closed_pipe_ends_quietly(server):
    _, admin_url, _ = server
    env = {**os.environ, "LORAPLEX_ADMIN_URL": admin_url}
    cli = [sys.executable, "-m", "loraplex_cli"]
    assert subprocess.run([*cli, "admin", "tenant", "create", "acme"], env=env, capture_output=True).returncode == 0
    for argv in (["admin", "tenant", "list", "--json"], ["admin", "tenant", "list"], ["config"],
                 ["token", "--tenant", "acme"]):
        r = _closed_stdout([*cli, *argv], env)
        assert r.returncode == 141, (argv, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, (argv, r.stderr)


def test_admin_cli_upload_upgrade_and_gc(server, capsys, tmp_path):
    """Upload into the default local store, a base-model upgrade (plan, then run) and gc."""
    settings, _, gate = server
    assert run_json(capsys, "tenant", "create", "acme")["slug"] == "acme"
    run_json(capsys, "base-model", "add", "--name", TINY.name, "--revision", TINY.revision, "--architecture",
             "llama", "--hidden-size", "32", "--intermediate-size", "64", "--num-layers", "2", "--num-heads", "4",
             "--num-kv-heads", "2", "--head-dim", "8", "--vocab-size", "100")
    code, out, err = run(capsys, "adapter", "upload", str(write_adapter(tmp_path / "src", TINY, seed=7)), "bot",
                         "--base-model", TINY.name, "--owner", "acme", "--progress")
    assert code == 0 and "uploaded bot@1" in out and "upload [" in err, err
    stored = Path(settings.resolved_adapter_store())
    assert len(list(stored.glob("sha256/*/adapter_model.safetensors"))) == 1
    code, _, err = run(capsys, "adapter", "upload", str(tmp_path / "nowhere"), "x", "--base-model", TINY.name)
    assert code == 1 and "not found" in err
    run_json(capsys, "adapter", "activate", "bot@1")
    run_json(capsys, "bind", "acme", "support", "bot@1")

    run_json(capsys, "base-model", "add", "--name", "tiny-v2", "--revision", "rev-v2", "--architecture",
             "llama", "--hidden-size", "32", "--intermediate-size", "64", "--num-layers", "2", "--num-heads", "4",
             "--num-kv-heads", "2", "--head-dim", "8", "--vocab-size", "100")
    code, out, _ = run(capsys, "base-model", "upgrade", TINY.name, "tiny-v2", "--dry-run")
    assert code == 0 and "plan: tiny -> tiny-v2" in out and "bot@1  admitted" in out and "acme/support" in out
    assert run_json(capsys, "binding", "show", "acme", "support")["base_model"] == TINY.name
    code, out, _ = run(capsys, "base-model", "upgrade", TINY.name, "tiny-v2")
    assert code == 0 and "bot@1 -> bot@2  passes" in out and "binding acme/support: moves" in out
    b = run_json(capsys, "binding", "show", "acme", "support")
    assert (b["base_model"], b["active"]["label"], b["previous"]["label"]) == ("tiny-v2", "bot@2", "bot@1")
    assert len(gate.requests) == 2  # bot@1's activation, then bot@2's on the new base

    code, out, _ = run(capsys, "gc", "--retention", "0")  # bot@1 is previous: in use
    assert code == 0 and "would delete 0 version(s)" in out
    run_json(capsys, "binding", "delete", "acme", "support")
    code, out, _ = run(capsys, "gc", "--retention", "0")
    assert code == 0 and "bot@1" in out and "bot@2" in out and "would delete 2 version(s)" in out
    code, out, _ = run(capsys, "gc", "--retention", "0", "--apply")
    assert code == 0 and "deleted 2 version(s)" in out
    assert not list(stored.glob("sha256/*/*"))  # both versions recorded the same files


def test_admin_cli_canary_set_by_is_a_conditional_write(server, capsys, tmp_path):
    """``canary set --by`` reads, writes with the row_version it read and retries on 412: eight
    concurrent runs move the percent by exactly eight steps."""
    settings, _, _ = server
    _seed(capsys, settings, tmp_path)
    run_json(capsys, "adapter", "activate", "support@1")
    run_json(capsys, "adapter", "activate", "support@2")
    run_json(capsys, "bind", "acme", "support", "support@1")
    run_json(capsys, "canary", "start", "acme", "support", "support@2", "--percent", "10")
    assert run_json(capsys, "canary", "set", "acme", "support", "--by", "+5")["canary_percent"] == 15
    assert run_json(capsys, "canary", "set", "acme", "support", "--by", "-3")["canary_percent"] == 12
    code, _, err = run(capsys, "canary", "set", "acme", "support", "20", "--by", "1")
    assert code == 2 and "either PERCENT or --by" in err
    codes: list[int] = []
    threads = [threading.Thread(target=lambda: codes.append(
        main(["admin", "canary", "set", "acme", "support", "--by", "1", "--json"]))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    capsys.readouterr()
    assert codes == [0] * 8
    assert run_json(capsys, "binding", "show", "acme", "support")["canary_percent"] == 20


def test_admin_cli_tenant_cache_scope(server, capsys):
    assert run_json(capsys, "tenant", "create", "acme-eu")["cache_scope"] == ""
    assert run_json(capsys, "tenant", "create", "acme-us", "--cache-scope", "acme")["cache_scope"] == "acme"
    code, out, _ = run(capsys, "tenant", "cache-scope", "acme-eu", "acme")
    assert code == 0 and "shared scope 'acme'" in out
    code, out, _ = run(capsys, "tenant", "list")
    header, *rows = out.splitlines()
    assert header.split()[-2:] == ["CACHE", "SCOPE"]
    assert [r.split()[-1] for r in rows] == ["acme", "acme"]
    code, _, err = run(capsys, "tenant", "cache-scope", "acme-eu", "Acme Co")
    assert code == 1 and "422" in err and "invalid_cache_scope" in err and "cache_scope" in err
    code, _, err = run(capsys, "tenant", "cache-scope", "acme-eu")
    assert code == 2 and "--own" in err
    code, _, err = run(capsys, "tenant", "cache-scope", "acme-eu", "acme", "--own")
    assert code == 2
    assert run_json(capsys, "tenant", "cache-scope", "acme-eu", "--own")["cache_scope"] == ""
    code, out, _ = run(capsys, "tenant", "show", "acme-eu")
    assert code == 0 and out.splitlines()[-1].split()[-1] == "(own)"
    audit = run_json(capsys, "audit", "--target", "tenant:acme-eu", "--action", "tenant.cache_scope")["data"]
    assert [(e["before"]["cache_scope"], e["after"]["cache_scope"]) for e in audit] == [("acme", ""), ("", "acme")]
