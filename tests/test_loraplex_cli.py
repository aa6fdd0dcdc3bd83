"""The ``loraplex`` command's texts and arguments: plain ``--help``, ``demo``/``serve --weights``, one
embedded runner per home, the demo's access log in a file, ``token --ttl`` above 0."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import subprocess

import pytest

import loraplex_cli.serve as serve
from loraplex.settings import Settings
from loraplex_cli.main import COMMANDS, main
from tests.e2e_cluster import BIN, free_port


def _parsers(parser: argparse.ArgumentParser, path: str):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_help_text_is_plain_text():
    """Docstrings are reStructuredText (``literal``); ``--help`` is read in a terminal."""
    seen = 0
    for command, (module, _) in COMMANDS.items():
        top = argparse.ArgumentParser(prog="loraplex")
        importlib.import_module(module).register(top.add_subparsers(dest="command"))
        for path, parser in _parsers(top._subparsers._group_actions[0].choices[command], command):
            seen += 1
            text = parser.format_help()
            assert "``" not in text, (path, [line for line in text.splitlines() if "``" in line])
    assert seen > 40  # every admin subcommand too


@pytest.fixture
def embedded(monkeypatch, tmp_path):
    """``serve``/``demo`` with a throwaway home and free ports, the model load and servers recorded
    instead of run; the access logger as it was afterwards."""
    for key in list(os.environ):
        if key.startswith("LORAPLEX_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path))
    for var in ("LORAPLEX_GATEWAY_PORT", "LORAPLEX_WORKER_PORT", "LORAPLEX_GATEWAY_METRICS_PORT"):
        monkeypatch.setenv(var, str(free_port()))
    runs: list[Settings] = []
    monkeypatch.setattr(serve, "prepare", lambda settings: settings)

    async def run(settings, *, demo=False):
        runs.append(settings)

    monkeypatch.setattr(serve, "run", run)
    access = logging.getLogger("loraplex.gateway.access")
    saved = (access.level, list(access.handlers), access.propagate)
    yield runs
    for handler in access.handlers:
        if handler not in saved[1]:
            handler.close()
    access.setLevel(saved[0])
    access.handlers[:] = saved[1]
    access.propagate = saved[2]


@pytest.mark.parametrize("command", ["demo", "serve"])
def test_demo_and_serve_take_weights(embedded, command, capsys):
    assert main([command, "--weights", "int4"]) == 0
    assert [s.weights for s in embedded] == ["int4"]
    with pytest.raises(SystemExit) as refused:
        main([command, "--weights", "int3"])
    assert refused.value.code == 2 and "invalid choice: 'int3'" in capsys.readouterr().err


def test_a_second_runner_on_the_same_home_is_refused_with_one_line(embedded, tmp_path, capsys):
    held = serve.hold_home(Settings.from_env(), "demo")
    assert not isinstance(held, str)
    try:
        assert main(["demo"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: loraplex demo (pid {os.getpid()}) already runs on LORAPLEX_HOME={tmp_path} "
                       f"(lock {tmp_path / serve.LOCK_FILE}); stop it, or set LORAPLEX_HOME to another directory"]
        assert embedded == []
    finally:
        held.close()
    assert main(["demo"]) == 0  # released with its holder
    assert main(["serve"]) == 0  # and by each run when it ends
    assert len(embedded) == 2


def test_the_demo_writes_its_access_log_to_a_file_and_says_where(embedded, tmp_path, capsys):
    assert main(["demo"]) == 0
    path = tmp_path / serve.ACCESS_LOG
    out = capsys.readouterr().out
    assert out.count(str(path)) == 2 and "loraplex plan" in out  # the path, once, and how to plan from it
    access = logging.getLogger("loraplex.gateway.access")
    assert not access.propagate  # off the terminal
    from gateway.request_path import _access_records
    _access_records.emit(json.dumps({"request_id": "r1"}), 0.0)
    for handler in access.handlers:
        handler.flush()
    assert json.loads(path.read_text().splitlines()[-1]) == {"request_id": "r1"}


def test_access_log_setting_names_the_file(embedded, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LORAPLEX_ACCESS_LOG", str(tmp_path / "logs" / "gw.log"))
    assert main(["serve"]) == 0
    assert str(tmp_path / "logs" / "gw.log") in capsys.readouterr().out
    assert (tmp_path / "logs" / "gw.log").exists()


@pytest.mark.parametrize("ttl", ["-60", "0", "nan", "soon"])
def test_token_ttl_must_be_a_positive_number_of_seconds(ttl):
    r = subprocess.run([str(BIN), "token", "--tenant", "acme", "--ttl", ttl], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert "argument --ttl:" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(("argv", "timeout"), [
    (["adapter", "activate", "bot@2"], 330.0),  # the gate probes on a worker for up to 300 s
    (["adapter", "activate", "bot@2", "--timeout", "5"], 5.0),
    (["--timeout", "7", "adapter", "activate", "bot@2"], 7.0),
    (["adapter", "show", "bot@2"], 30.0),
])
def test_adapter_activate_waits_as_long_as_the_gate_may_take(monkeypatch, argv, timeout):
    import registry.admin_commands as commands

    waited = []

    def request(a, method, path, body=None):
        waited.append(a.timeout)
        return {"label": "bot@2"}

    monkeypatch.setattr(commands, "admin_request", request)
    assert main(["admin", *argv, "--json"]) == 0
    assert waited == [timeout]
