"""``pip install loraplex`` is the control plane without torch; the engine commands say what is missing.

The slow test installs the checkout into a fresh virtual environment the way an operator would
(a real resolution, not editable) and runs ``loraplex migrate`` and ``loraplex gateway`` from it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

from loraplex_cli import main as cli
from tests.stub_worker import free_port

ROOT = Path(__file__).resolve().parent.parent
ENGINE_ONLY = {"torch", "safetensors", "triton", "xgrammar"}
"""Distributions only the ``engine`` extra may bring (nvidia-* CUDA libraries come with torch)."""


def _engine_only(names: list[str]) -> list[str]:
    return sorted(n for n in names if n.lower() in ENGINE_ONLY or n.lower().startswith("nvidia-"))


@pytest.fixture
def no_torch(monkeypatch):
    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *a: None if name in cli.ENGINE_MODULES else real(name, *a))


@pytest.mark.parametrize("command", sorted(cli.ENGINE_COMMANDS))
def test_engine_commands_without_the_engine_extra_say_how_to_install_it(no_torch, capsys, command):
    assert cli.main([command]) == 1
    err = capsys.readouterr().err
    assert "loraplex[engine]" in err and "torch" in err


def test_engine_command_help_needs_no_engine_extra(no_torch, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["worker", "--help"])
    assert exit_.value.code == 0 and "usage: loraplex worker" in capsys.readouterr().out


def test_control_plane_commands_do_not_ask_for_the_engine_extra(no_torch, capsys):
    assert cli.main(["config", "--json"]) == 0
    assert "LORAPLEX_MODEL" in json.loads(capsys.readouterr().out)


def test_the_engine_extra_holds_what_only_the_engine_imports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {d.split(">")[0].split("[")[0].split(";")[0].strip() for d in project["dependencies"]}
    engine = {d.split(">")[0].split("[")[0].strip() for d in project["optional-dependencies"]["engine"]}
    assert set(cli.ENGINE_MODULES) <= engine and not engine & base
    assert "loraplex[engine]" in project["optional-dependencies"]["test"]


def _copy_project(dst: Path) -> Path:
    """What a source distribution holds: pyproject, README and the packages pyproject includes."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["packages"]["find"]["include"]
    dst.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dst / name)
    for top in ROOT.iterdir():
        if top.is_dir() and (top / "__init__.py").is_file() and any(fnmatch.fnmatch(top.name, p) for p in patterns):
            shutil.copytree(top, dst / top.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dst


def _run(args: list[str | Path], env: dict[str, str], cwd: Path, timeout: float = 600) -> str:
    out = subprocess.run([str(a) for a in args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{args}: {out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out.stdout


@pytest.mark.slow
def test_pip_install_brings_no_torch_and_the_gateway_runs_from_it(tmp_path):
    started = time.monotonic()
    # Nothing of the checkout or of this environment may leak into the fresh one.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LORAPLEX_", "PYTHON", "VIRTUAL_ENV")) and k != "PIP_REQUIRE_VIRTUALENV"}
    env |= {"LORAPLEX_HOME": str(tmp_path / "home"), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    src = _copy_project(tmp_path / "src")
    venv = tmp_path / "venv"
    base_python = getattr(sys, "_base_executable", sys.executable)
    _run([base_python, "-m", "venv", venv], env, tmp_path)
    pip, loraplex = [venv / "bin" / "python", "-m", "pip"], venv / "bin" / "loraplex"

    # Resolve first, install nothing: torch must not be in the plan (so it is never downloaded).
    report = tmp_path / "report.json"
    _run([*pip, "install", "-q", "--dry-run", "--report", report, src], env, tmp_path)
    planned = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert "loraplex" in planned and not _engine_only(planned), _engine_only(planned)

    _run([*pip, "install", "-q", src], env, tmp_path)
    installed = [d["name"] for d in json.loads(_run([*pip, "list", "--format", "json"], env, tmp_path))]
    assert "loraplex" in installed and not _engine_only(installed), _engine_only(installed)
    resolved = time.monotonic() - started

    _run([loraplex, "migrate"], env, tmp_path)
    worker = subprocess.run([loraplex, "worker"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert worker.returncode == 1 and "loraplex[engine]" in worker.stderr, worker.stderr

    port = free_port()
    gw_env = env | {"LORAPLEX_GATEWAY_PORT": str(port), "LORAPLEX_GATEWAY_METRICS_PORT": str(free_port())}
    log = (tmp_path / "gateway.log").open("w")
    proc = subprocess.Popen([loraplex, "gateway"], env=gw_env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "gateway.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
                    break
            except OSError:
                assert time.monotonic() < deadline, (tmp_path / "gateway.log").read_text()[-4000:]
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    print(f"\nlean install: resolved + installed in {resolved:.1f}s, whole test {time.monotonic() - started:.1f}s")
