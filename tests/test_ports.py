"""A busy port stops ``demo``, ``serve``, ``gateway`` and ``worker`` at once with one line naming the
port and what moves it, before any model loads, never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from loraplex.ports import busy
from tests.e2e_cluster import BIN, free_port


@pytest.fixture
def held():
    """A port another process (here: this one) listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


def test_busy_names_the_port_and_the_setting(held):
    assert busy({"LORAPLEX_GATEWAY_PORT": ("127.0.0.1", free_port())}) is None
    why = busy({"LORAPLEX_WORKER_PORT": ("127.0.0.1", free_port()), "LORAPLEX_GATEWAY_PORT (or --port)":
                ("127.0.0.1", held)})
    assert why == (f"port {held} on 127.0.0.1 is in use (another loraplex, or another server); set "
                   f"LORAPLEX_GATEWAY_PORT (or --port) to a free port")
    assert busy({"LORAPLEX_GATEWAY_METRICS_PORT": ("127.0.0.1", 0)}) is None  # 0: that server is off


@pytest.mark.parametrize(("argv", "setting"), [
    (["demo", "--port", "{held}"], "LORAPLEX_GATEWAY_PORT (or --port)"),
    (["serve", "--worker-port", "{held}"], "LORAPLEX_WORKER_PORT (or --worker-port)"),
    (["gateway", "--port", "{held}"], "LORAPLEX_GATEWAY_PORT (or --port)"),
    (["worker", "--port", "{held}"], "LORAPLEX_WORKER_PORT (or --port)"),
])
def test_the_commands_stop_with_one_line(held, tmp_path, argv, setting):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env |= {"LORAPLEX_HOME": str(tmp_path), "LORAPLEX_GATEWAY_METRICS_PORT": str(free_port()),
            "LORAPLEX_WORKER_PORT": str(free_port()), "LORAPLEX_GATEWAY_PORT": str(free_port())}
    args = [a.format(held=held) for a in argv]
    r = subprocess.run([str(BIN), *args], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert lines == [f"error: port {held} on 127.0.0.1 is in use (another loraplex, or another server); "
                     f"set {setting} to a free port"], r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert not (Path(tmp_path) / "models").exists()  # stopped before fetching or loading a model

