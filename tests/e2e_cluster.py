"""A loraplex fleet of real processes on loopback, for the end-to-end tests.

PostgreSQL registry (a fresh database), Redis (a fresh key prefix), ``loraplex migrate``,
N ``loraplex worker`` processes on the demo model and M ``loraplex gateway`` processes,
all configured only through ``LORAPLEX_*`` variables, exactly as an operator would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loraplex.settings import Settings
from loraplex.tokens import mint, mint_admin

BIN = Path(sys.executable).parent / "loraplex"
JWT_SECRET = "e2e-secret-0123456789abcdef0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    args: list[str]
    env: dict[str, str]
    log: Path
    url: str
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        fh = open(self.log, "ab")
        self.popen = subprocess.Popen(self.args, env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        fh.close()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process group without waiting (``SIGSTOP``/``SIGCONT``)."""
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)
            self.popen.wait(timeout=30)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Cluster:
    home: Path
    database_url: str
    redis_url: str
    redis_prefix: str
    model: str
    base_name: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)
    """``LORAPLEX_*`` variables every process gets (a deployment's own secrets, say)."""
    worker_env: dict[str, str] = field(default_factory=dict)
    """Variables only the workers get."""
    workers: list[Proc] = field(default_factory=list)
    gateways: list[Proc] = field(default_factory=list)

    @property
    def settings(self) -> Settings:
        return Settings.from_env(self.env())

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
        env.update({
            "LORAPLEX_HOME": str(self.home),
            "LORAPLEX_DATABASE_URL": self.database_url,
            "LORAPLEX_REDIS_URL": self.redis_url,
            "LORAPLEX_REDIS_PREFIX": self.redis_prefix,
            "LORAPLEX_MODEL": self.model,
            "LORAPLEX_JWT_SECRET": JWT_SECRET,
            "LORAPLEX_ADAPTER_ROOT": str(self.home / "adapters"),
            "LORAPLEX_THREADS": "1",
            "LORAPLEX_REGISTRY_REFRESH_S": "5",
            "HF_HUB_OFFLINE": "1",
        })
        env.update(self.extra_env)
        env.update(extra)
        return env

    # --- lifecycle ---------------------------------------------------------------------------------
    def migrate(self) -> None:
        subprocess.run([str(BIN), "migrate"], env=self.env(), check=True, capture_output=True, timeout=120)

    def add_worker(self, worker_id: str) -> Proc:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = self.env(**{"LORAPLEX_WORKER_ID": worker_id, "LORAPLEX_WORKER_PORT": str(port), "LORAPLEX_WORKER_URL": url,
                          "LORAPLEX_KV_CACHE_BYTES": str(64 * 1024 * 1024), **self.worker_env})  # worker_env may size it
        proc = Proc(worker_id, [str(BIN), "worker"], env, self.home / f"{worker_id}.log", url)
        proc.start()
        self.workers.append(proc)
        return proc

    def add_gateway(self, name: str, **env_extra: str) -> Proc:
        """Start a gateway; ``env_extra``: variables this one gets besides the fleet's."""
        port = free_port()
        env = self.env(LORAPLEX_GATEWAY_PORT=str(port), LORAPLEX_GATEWAY_METRICS_PORT=str(free_port()), **env_extra)
        proc = Proc(name, [str(BIN), "gateway"], env, self.home / f"{name}.log", f"http://127.0.0.1:{port}")
        proc.start()
        self.gateways.append(proc)
        return proc

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Every worker answers /health and every gateway sees every worker in /readyz."""
        deadline = time.monotonic() + timeout
        pending = [(p, "/health") for p in self.workers] + [(p, "/readyz") for p in self.gateways]
        while pending:
            proc, path = pending[0]
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited during start-up:\n{proc.tail()}")
            try:
                r = httpx.get(proc.url + path, timeout=2.0)
                if r.status_code == 200 and (path != "/readyz" or r.json().get("workers", 0) >= len(self.workers)):
                    pending.pop(0)
                    continue
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{proc.name} not ready after {timeout}s:\n{proc.tail()}")
            time.sleep(0.5)

    @contextlib.contextmanager
    def running(self, workers: tuple[str, ...] = ("w1", "w2"),
                gateways: tuple[str, ...] = ("g1", "g2")) -> Iterator[Cluster]:
        """Migrate, start ``workers`` and ``gateways`` and wait until ready; what fails inside
        prints every process's log tail; everything is stopped at the end."""
        self.migrate()
        for wid in workers:
            self.add_worker(wid)
        for gid in gateways:
            self.add_gateway(gid)
        try:
            self.wait_ready()
            yield self
        except BaseException:
            for p in self.workers + self.gateways:
                print(f"--- {p.name} ---\n{p.tail()}")
            raise
        finally:
            self.stop()

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM every process, then SIGKILL whatever has not exited after ``grace_s``: one
        process slow to shut down never leaves the others running."""
        procs = [p for p in self.gateways + self.workers if p.alive()]
        for proc in procs:
            try:
                os.killpg(proc.popen.pid, signal.SIGTERM)  # type: ignore[union-attr]
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                proc.kill(signal.SIGKILL)

    # --- clients -----------------------------------------------------------------------------------
    def token(self, tenant: str) -> str:
        return mint(self.settings, f"{tenant}-backend", tenant=tenant)

    def admin(self, method: str, path: str, json: Any = None, gateway: int = 0) -> Any:
        r = httpx.request(method, self.gateways[gateway].url + "/admin" + path, json=json, timeout=120.0,
                          headers={"Authorization": f"Bearer {mint_admin(self.settings)}"})
        if r.status_code >= 400:
            raise AssertionError(f"admin {method} {path} -> {r.status_code}: {r.text}")
        return r.json()

    def wait_current(self, timeout: float = 15.0) -> None:
        """Until every gateway serves the registry's current version (LISTEN/NOTIFY brings it
        within a second; the periodic refresh bounds it): a test's admin writes are in force."""
        want = self.admin("GET", "/version")["version"]
        deadline = time.monotonic() + timeout
        for gw in self.gateways:
            while (seen := httpx.get(gw.url + "/readyz", timeout=5.0).json().get("registry_version") or 0) < want:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{gw.name} serves registry version {seen}, not {want}, after {timeout}s")
                time.sleep(0.05)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``loraplex admin ...`` against the first gateway, as an operator runs it."""
        env = self.env(LORAPLEX_ADMIN_URL=self.gateways[0].url)
        return subprocess.run([str(BIN), "admin", *args], env=env, capture_output=True, text=True, timeout=120)
