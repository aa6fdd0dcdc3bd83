"""Development secrets: ``gateway``, ``admin-api``, ``worker``, ``serve`` and ``demo`` refuse non-loopback binds
with a built-in secret unless explicitly allowed; ``loraplex config`` names such a value."""

from __future__ import annotations

import argparse
import json
import logging
import os

import pytest

from loraplex import config_cmd
from loraplex.devsecrets import development_secrets, is_loopback, refusal
from loraplex.settings import DEV_JWT_SECRET, DEV_WORKER_SECRET, Settings, is_development_secret
from loraplex_cli.main import main

REAL = {"LORAPLEX_JWT_SECRET": "j" * 64, "LORAPLEX_WORKER_SECRET": "w" * 64}


@pytest.fixture
def env(monkeypatch, tmp_path):
    """No LORAPLEX_* variable but a throwaway home; returns monkeypatch to set more."""
    for key in list(os.environ):
        if key.startswith("LORAPLEX_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path))
    return monkeypatch


@pytest.fixture
def started(env):
    """What would have served: uvicorn.run, the gateway's servers and the embedded runner,
    recorded instead of run."""
    import uvicorn

    import gateway.http_edge as http_edge
    import loraplex_cli.serve as serve

    calls: list[tuple[str, dict]] = []
    env.setattr(uvicorn, "run", lambda app, **kw: calls.append(("uvicorn", kw)))

    async def serve_all(servers):
        calls.append(("uvicorn", {"host": servers[-1].config.host}))

    env.setattr(http_edge, "serve_all", serve_all)
    env.setattr(serve, "prepare", lambda settings: settings)

    async def run(settings, *, demo=False):
        calls.append(("serve", {"host": settings.gateway_host, "demo": demo}))

    env.setattr(serve, "run", run)
    access = logging.getLogger("loraplex.gateway.access")
    saved = (access.level, list(access.handlers), access.propagate)
    yield calls
    access.setLevel(saved[0])
    access.handlers[:] = saved[1]
    access.propagate = saved[2]


COMMANDS = {
    "gateway": (["gateway", "--host", "0.0.0.0", "--no-access-log"], {"LORAPLEX_JWT_SECRET", "LORAPLEX_WORKER_SECRET"}),
    "worker": (["worker", "--host", "0.0.0.0"], {"LORAPLEX_WORKER_SECRET"}),
    "admin-api": (["admin-api", "--host", "0.0.0.0"], {"LORAPLEX_JWT_SECRET", "LORAPLEX_WORKER_SECRET"}),
    "serve": (["serve"], {"LORAPLEX_JWT_SECRET", "LORAPLEX_WORKER_SECRET"}),
    "demo": (["demo"], {"LORAPLEX_JWT_SECRET", "LORAPLEX_WORKER_SECRET"}),
}


def _public(env, command: str) -> None:
    if command in ("serve", "demo"):
        env.setenv("LORAPLEX_GATEWAY_HOST", "0.0.0.0")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_public_bind_with_development_secrets_is_refused(env, started, capsys, command):
    argv, named = COMMANDS[command]
    _public(env, command)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "0.0.0.0" in err and "LORAPLEX_ALLOW_DEV_SECRETS=true" in err
    for var in {"LORAPLEX_JWT_SECRET", "LORAPLEX_WORKER_SECRET"}:
        assert (var in err) == (var in named), var
    assert started == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("how", ["allowed", "real secrets"])
def test_the_override_or_real_secrets_let_it_start(env, started, command, how):
    argv, _ = COMMANDS[command]
    _public(env, command)
    for key, value in ({"LORAPLEX_ALLOW_DEV_SECRETS": "true"} if how == "allowed" else REAL).items():
        env.setenv(key, value)
    assert main(argv) == 0
    assert len(started) == 1
    kind, kw = started[0]
    assert kw["host"] == "0.0.0.0"
    assert kind == ("serve" if command in ("serve", "demo") else "uvicorn")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_loopback_keeps_working_with_the_defaults(env, started, command):
    argv, _ = COMMANDS[command]
    argv = [a if a != "0.0.0.0" else "127.0.0.1" for a in argv]
    assert main(argv) == 0
    assert len(started) == 1


def test_serve_checks_the_worker_address_too(env, started, capsys):
    env.setenv("LORAPLEX_WORKER_HOST", "0.0.0.0")
    assert main(["serve"]) == 2
    assert "LORAPLEX_WORKER_HOST" in capsys.readouterr().err


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.7", False), ("no-such-host.invalid", False),
])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_jwt_secret_counts_only_while_hmac_tokens_are_accepted():
    s = Settings()
    assert development_secrets(s, ("jwt_secret", "worker_secret")) == ["jwt_secret", "worker_secret"]
    rs = s.replace(jwt_algorithms=("RS256",))
    assert development_secrets(rs, ("jwt_secret", "worker_secret")) == ["worker_secret"]
    assert refusal(rs.replace(worker_secret="x" * 40), {"host": "0.0.0.0"}, ("jwt_secret", "worker_secret")) is None


@pytest.mark.parametrize("name", ["jwt_secret", "worker_secret"])
def test_short_secrets_are_refused_off_loopback_whatever_the_flag(name):
    s = Settings(jwt_secret="j" * 64, worker_secret="w" * 64, allow_dev_secrets=True)
    both = ("jwt_secret", "worker_secret")
    for value in ("x", "y" * 31):
        short = s.replace(**{name: value})
        why = refusal(short, {"LORAPLEX_GATEWAY_HOST": "0.0.0.0"}, both)
        assert why is not None and f"LORAPLEX_{name.upper()}" in why and "32 bytes" in why, why
        assert refusal(short, {"LORAPLEX_GATEWAY_HOST": "127.0.0.1"}, both) is None
    assert refusal(s.replace(**{name: "z" * 32}), {"host": "0.0.0.0"}, both) is None
    rs = s.replace(jwt_algorithms=("RS256",), jwt_secret="x")  # never read: no HS* algorithm
    assert refusal(rs, {"host": "0.0.0.0"}, both) is None


def test_is_development_secret():
    assert is_development_secret("jwt_secret", DEV_JWT_SECRET)
    assert is_development_secret("worker_secret", DEV_WORKER_SECRET)
    assert not is_development_secret("worker_secret", DEV_JWT_SECRET)
    assert not is_development_secret("jwt_secret", "x" * 40)
    assert not is_development_secret("admin_token", "")


def _config_json(capsys) -> dict:
    config_cmd.run(argparse.Namespace(json=True, markdown=False, verbose=False))
    return json.loads(capsys.readouterr().out)


def test_config_names_development_defaults(env, capsys):
    values = _config_json(capsys)
    assert values["LORAPLEX_JWT_SECRET"] == "(development default \u2014 set LORAPLEX_JWT_SECRET)"
    assert values["LORAPLEX_WORKER_SECRET"] == "(development default \u2014 set LORAPLEX_WORKER_SECRET)"
    env.setenv("LORAPLEX_JWT_SECRET", REAL["LORAPLEX_JWT_SECRET"])
    values = _config_json(capsys)
    assert values["LORAPLEX_JWT_SECRET"] == "(set)"
    assert REAL["LORAPLEX_JWT_SECRET"] not in json.dumps(values)
