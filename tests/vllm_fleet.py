"""vLLM's CPU build and ``loraplex vllm-agent`` as real processes, for the vLLM tests and bench.

``vllm_python`` builds (once, cached) the venv of ``scripts/vllm_venv.sh``; a failed build
raises, never skips. ``start_vllm`` runs vLLM's OpenAI server on the exported demo model with
runtime LoRA updating on and the start-up cut down (eager mode, no compilation, a small
context and KV space); ``start_agent`` runs the agent beside it, configured as an operator would.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import httpx

from tests.e2e_cluster import BIN, Cluster, Proc, free_port

ROOT = Path(__file__).resolve().parent.parent
SERVED = "base"
"""vLLM's ``--served-model-name`` of the base model."""


def vllm_python() -> str:
    """The venv's python (``scripts/vllm_venv.sh`` builds it when missing; a failure raises)."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "vllm_venv.sh")], check=True, stdout=subprocess.PIPE,
                         text=True, timeout=3600)
    return out.stdout.strip().splitlines()[-1]


def vllm_args(python: str, model: Path, port: int, *, max_loras: int = 8, max_cpu_loras: int = 32,
              max_num_seqs: int = 32, dtype: str = "float32") -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--max-model-len", "1024", "--max-num-seqs", str(max_num_seqs), "--enforce-eager",
            "--compilation-config", '{"mode": 0}', "--enable-lora", "--max-loras", str(max_loras),
            "--max-lora-rank", "64", "--max-cpu-loras", str(max_cpu_loras)]


def vllm_env() -> dict[str, str]:
    """One unbound OpenMP thread: on two shared cores, two bound threads that spin-wait on each
    other were slower (measured: 8 concurrent LoRA requests 72 s vs 52 s under load)."""
    return dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1",
                VLLM_CPU_KVCACHE_SPACE="1",
                VLLM_ALLOW_RUNTIME_LORA_UPDATING="true", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                VLLM_NO_USAGE_STATS="1", VLLM_LOGGING_LEVEL="WARNING")


def start_vllm(python: str, model: Path, log: Path, *, port: int | None = None, **kw: int) -> Proc:
    """vLLM's OpenAI server on ``port`` (default: a free one; a restart passes the old one)."""
    port = port or free_port()
    proc = Proc("vllm", vllm_args(python, model, port, **kw), vllm_env(), log, f"http://127.0.0.1:{port}")
    proc.start()
    return proc


def start_agent(cluster: Cluster, name: str, vllm_url: str, *, port: int | None = None,
                max_adapters: int = 16) -> Proc:
    port = port or free_port()
    args = [str(BIN), "vllm-agent", "--vllm-url", vllm_url, "--port", str(port), "--worker-id", name,
            "--model", cluster.model, "--max-adapters", str(max_adapters)]
    proc = Proc(name, args, cluster.env(LORAPLEX_REPORT_INTERVAL_S="0.5"), cluster.home / f"{name}.log",
                f"http://127.0.0.1:{port}")
    proc.start()
    return proc


def wait_http(proc: Proc, path: str, timeout_s: float) -> float:
    """Poll ``proc``'s ``path`` until it answers 200; seconds waited (raises with its log tail)."""
    t0 = time.monotonic()
    while True:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited during start-up:\n{proc.tail(60)}")
        try:
            if httpx.get(proc.url + path, timeout=5.0).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{proc.name} not ready after {timeout_s:.0f} s:\n{proc.tail(60)}")
        time.sleep(0.5)


def register_active(c: Cluster, tenant: str, dirs: dict[str, Path]) -> dict[str, str]:
    """Register PEFT directories through the admin API as ``{tenant}-{name}``, activate them with a
    recorded verification (no gate: random adapters are noise by design) and bind alias ``name``
    to each; the version ids by name."""
    ids = {}
    for name, d in dirs.items():
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg["base_model_name_or_path"] = c.base_name  # trained on the export of the registered base
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        ad = c.admin("POST", "/adapters", {"name": f"{tenant}-{name.replace('_', '-')}", "uri": str(d),
                                           "base_model": c.base_name, "owner": tenant})
        ids[name] = ad["id"]

    activate_recorded(c, list(ids.values()))
    for name, aid in ids.items():
        c.admin("PUT", f"/tenants/{tenant}/bindings/{name}", {"adapter": aid})
    return ids


def activate_recorded(c: Cluster, ids: list[str]) -> None:
    """Activate adapter versions with a recorded verification, past the gateway's activation gate
    (which probes each version on a worker: seconds per version on vLLM-CPU)."""
    from registry.service import RegistryService

    async def activate() -> None:
        svc = RegistryService(c.settings)
        try:
            for aid in ids:
                await svc.activate_adapter(aid, verification={"note": "activated by the test set-up"})
        finally:
            await svc.close()

    asyncio.run(activate())
