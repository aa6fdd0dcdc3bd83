"""End to end on ``loraplex demo``: the README's ops guide pastes and works, and the demo keeps what
operators did.

One demo (a throwaway home, free ports) runs every command of the README's ops-guide block as
written there (parsed out of README.md, so the test follows the README), each exiting 0. A second
demo on the same home is refused with one line. The demo's access log is in its home, off its
terminal, and ``loraplex plan`` reads it. Then an operator's bind, a rollback to a version older than
the newest and a canary abort, and a restart of the demo: every binding is as the operator left it,
and the restart's seeding changed nothing in the registry.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraplex.settings import Settings
from loraplex.tokens import mint, mint_admin
from tests.e2e_cluster import BIN, free_port
from tests.engine_fixtures import demo_model_file

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


def readme_ops_commands() -> list[str]:
    """The command lines of the ops guide's first indented block in README.md."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Ops guide\n"):]
    section = section[:section.index("\n## ", 1)]
    lines = section.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("    loraplex "))
    block = []
    for line in lines[first:]:
        if line.strip() and not line.startswith("    "):
            break
        block.append(line.strip())
    return [line for line in block if line]


def test_the_readme_block_is_parsed():
    commands = readme_ops_commands()
    assert len(commands) >= 8 and all(c.startswith("loraplex admin ") for c in commands), commands
    verbs = " ".join(commands)
    for op in ("adapter upload", "adapter activate", " bind ", "canary start", "canary set-policy", "canary status",
               "rollback", "tenant limits", "audit"):
        assert op in verbs, op


class Demo:
    """``loraplex demo`` as a user starts it, on a given home and ports."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log = env, log
        with open(log, "wb") as fh:
            self.proc = subprocess.Popen([str(BIN), "demo"], env=env, stdout=fh, stderr=subprocess.STDOUT,
                                         cwd=ROOT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_up(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while "curl" not in self.text():  # the demo prints its instructions once seeded
            assert self.proc.poll() is None, self.text()[-3000:]
            assert time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.5)

    def stop(self, sig: int = signal.SIGINT) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env |= {"LORAPLEX_HOME": str(home), "LORAPLEX_MODEL": str(demo_model_file()),
            "LORAPLEX_GATEWAY_PORT": str(free_port()), "LORAPLEX_WORKER_PORT": str(free_port()),
            "LORAPLEX_GATEWAY_METRICS_PORT": str(free_port()), "HF_HUB_OFFLINE": "1",
            "PATH": f"{BIN.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return env


def _bindings(admin: Any) -> dict[tuple[str, str], tuple[str | None, str | None, str | None]]:
    def label(ref: Any) -> str | None:
        return ref["label"] if ref else None

    return {(b["tenant"], b["alias"]): (label(b["active"]), label(b["previous"]), label(b["canary"]))
            for b in admin("GET", "/bindings")["data"]}


def test_the_readme_ops_guide_runs_on_the_demo_and_a_restart_keeps_what_operators_did(tmp_path):
    home = tmp_path / "home"
    env = _env(home)
    settings = Settings.from_env(env)
    url = f"http://127.0.0.1:{settings.gateway_port}"
    admin_h = {"authorization": f"Bearer {mint_admin(settings, subject='test')}"}

    def admin(method: str, path: str, body: Any = None) -> Any:
        r = httpx.request(method, url + "/admin" + path, json=body, headers=admin_h, timeout=120, trust_env=False)
        assert r.status_code < 400, (method, path, r.status_code, r.text)
        return r.json()

    def sh(command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", command], env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=300)

    demo = Demo(env, tmp_path / "demo-1.log")
    try:
        demo.wait_up()
        # A second demo on the same home (its own ports) is refused with one line.
        other = env | {"LORAPLEX_GATEWAY_PORT": str(free_port()), "LORAPLEX_WORKER_PORT": str(free_port()),
                       "LORAPLEX_GATEWAY_METRICS_PORT": str(free_port())}
        second = subprocess.run([str(BIN), "demo"], env=other, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, (second.stdout, second.stderr)
        assert second.stderr.strip().splitlines() == [
            f"error: loraplex demo (pid {demo.proc.pid}) already runs on LORAPLEX_HOME={home} "
            f"(lock {home / 'serve.lock'}); stop it, or set LORAPLEX_HOME to another directory"]

        # The README's ops guide, every command as written there.
        for command in readme_ops_commands():
            r = sh(command)
            assert r.returncode == 0, (command, r.stdout, r.stderr)
        assert _bindings(admin)[("acme", "assistant")] == ("acme-french@1", "acme-terse@1", None)
        assert _bindings(admin)[("acme", "support")] == ("acme-terse@1", None, None)

        # The access log: in the home, off the terminal, read by `loraplex plan`.
        token = mint(settings, "acme-backend", tenant="acme")
        r = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {token}"}, timeout=120,
                       json={"model": "support", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
                       trust_env=False)
        assert r.status_code == 200, r.text
        access = home / "access.log"
        deadline = time.monotonic() + 15
        while not (access.exists() and access.read_text().strip()):
            assert time.monotonic() < deadline, "no access log line"
            time.sleep(0.2)
        line = json.loads(access.read_text().splitlines()[-1])
        assert (line["tenant"], line["alias"], line["adapter"]) == ("acme", "support", "acme-terse@1")
        assert line["request_id"] not in demo.text() and f"access log: {access}" in demo.text()
        plan = sh(f"loraplex plan {access}")
        assert plan.returncode == 0 and "below the floor" in plan.stdout, (plan.stdout, plan.stderr)

        # What an operator does next: a rollback to a version older than the newest, a bind, an abort.
        for command in ("loraplex admin bind acme support acme-terse@2", "loraplex admin rollback acme support",
                        "loraplex admin bind acme assistant acme-terse@1",
                        "loraplex admin adapter upload demo/adapters/json globex-json "
                        "--base-model SmolLM2-135M-Instruct --owner globex",
                        "loraplex admin adapter activate globex-json@2",
                        "loraplex admin canary start globex assistant globex-json@2 --percent 50",
                        "loraplex admin canary abort globex assistant"):
            r = sh(command)
            assert r.returncode == 0, (command, r.stdout, r.stderr)
        left = _bindings(admin)
        assert left == {("acme", "assistant"): ("acme-terse@1", "acme-french@1", None),
                        ("acme", "support"): ("acme-terse@1", "acme-terse@2", None),
                        ("globex", "assistant"): ("globex-json@1", None, None)}
        version = admin("GET", "/version")["version"]
    finally:
        demo.stop()
    assert demo.proc.returncode == 0, demo.text()[-3000:]
    assert "Traceback" not in demo.text(), demo.text()[-3000:]

    demo = Demo(env, tmp_path / "demo-2.log")
    try:
        demo.wait_up()
        assert _bindings(admin) == left
        assert admin("GET", "/version")["version"] == version  # the seeding changed nothing
        assert "model 'assistant'  -> adapter acme-terse@1" in demo.text(), demo.text()
        tenants = {t["slug"]: t for t in admin("GET", "/tenants")["data"]}
        assert tenants["acme"]["tokens_per_min"] == 200_000  # the README's limits, kept too
    finally:
        demo.stop()
    assert "Traceback" not in demo.text(), demo.text()[-3000:]
    assert re.search(r"activation gate", demo.text()) is None  # nothing registered or activated again
