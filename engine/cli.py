"""``loraplex worker``, ``loraplex vllm-agent``, ``loraplex fetch-demo`` and ``loraplex export-hf``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any


def _worker(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.api import create_worker_app
    from engine.engine import Engine, settle_after_load
    from engine.quant import dtype_name
    from loraplex.devsecrets import refusal
    from loraplex.ports import busy
    from loraplex.settings import get_settings

    overrides: dict[str, Any] = {}
    for key in ("model", "worker_host", "worker_port", "worker_id", "device", "dtype", "weights", "kv_cache_dtype",
                "threads", "max_loras", "max_cpu_loras", "max_lora_rank", "preload_top_n"):
        value = getattr(args, key, None)
        if value is not None:
            overrides[key] = value
    for key in ("preload_adapters", "pin_adapters"):
        value = getattr(args, key, None)
        if value:
            overrides[key] = tuple(value)
    settings = get_settings().replace(**overrides)
    problem = refusal(settings, {"LORAPLEX_WORKER_HOST / --host": settings.worker_host}, ("worker_secret",)) or \
        busy({"LORAPLEX_WORKER_PORT (or --port)": (settings.worker_host, settings.worker_port)})
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level)
    # The model loads before the server takes over the process's signals: a SIGTERM during a long
    # load ends the process at once instead of after the load, the warm start and a start-up.
    log = logging.getLogger("loraplex.engine")
    log.info("loading the base model %s", settings.model or "(the demo model)")
    t0 = time.monotonic()
    try:
        engine = Engine.from_settings(settings)
    except Exception as exc:
        log.debug("loading the base model failed", exc_info=True)
        print(f"error: cannot load the base model: {exc}", file=sys.stderr)
        return 1
    m = engine.model
    resident = settle_after_load()
    log.info("base model %s loaded in %.1f s (%s on %s, %s weights [%s], %.0f MB; %s KV cache, %.0f MiB [%s], "
             "%d tokens, prefix cache %s; %s; %.0f MB resident)",
             engine.info.name if engine.info else settings.model, time.monotonic() - t0,
             dtype_name(m.dtype), m.device, dtype_name(m.matmul_dtype), engine.weights_reason,
             m.weight_bytes / 1e6, dtype_name(engine.cache.dtype), engine.kv_cache_bytes / 2**20, engine.kv_reason,
             engine.cache.num_blocks * engine.cache.block_size, "on" if engine.config.prefix_cache else "off",
             m.kernels, resident / 1e6)
    try:
        app = create_worker_app(settings, engine)
        uvicorn.run(app, host=settings.worker_host, port=settings.worker_port, log_level=settings.log_level.lower())
    finally:
        engine.close()
    return 0


def _fetch_demo(args: argparse.Namespace) -> int:
    from engine.fetch_demo import FetchError, fetch_demo
    from loraplex.settings import get_settings

    try:
        path = fetch_demo(get_settings())
    except FetchError as exc:
        print(f"error: {exc}")
        return 1
    print(path)
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from engine.export_hf import ExportError, export_hf
    from engine.fetch_demo import FetchError, fetch_demo

    try:
        model = args.model or fetch_demo()
        export_hf(model, args.out, dtype=args.dtype)
    except (ExportError, FetchError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(args.out)
    return 0


def register(subparsers: Any) -> None:
    w = subparsers.add_parser("worker", help="run an engine worker (OpenAI-shaped API over one base model)")
    w.add_argument("--model", help="HF directory or .gguf file (default: LORAPLEX_MODEL, else the demo model)")
    w.add_argument("--host", dest="worker_host")
    w.add_argument("--port", dest="worker_port", type=int)
    w.add_argument("--worker-id", dest="worker_id")
    w.add_argument("--device")
    w.add_argument("--dtype")
    w.add_argument("--weights", help="base weights: auto (as --dtype), bfloat16 (under float32 activations), "
                   "int8 or int4 (CPU, float32 activations: 8-bit or 4-bit blocks of 32)")
    w.add_argument("--kv-cache-dtype", dest="kv_cache_dtype",
                   help="KV cache: auto (bfloat16 with bfloat16 weights on CPU, else as --dtype), float32 or bfloat16")
    w.add_argument("--threads", type=int)
    w.add_argument("--max-loras", dest="max_loras", type=int, help="distinct adapters per batch (0: LoRA off)")
    w.add_argument("--max-cpu-loras", dest="max_cpu_loras", type=int, help="adapters kept in host memory")
    w.add_argument("--max-lora-rank", dest="max_lora_rank", type=int)
    w.add_argument("--preload-adapter", dest="preload_adapters", action="append", metavar="ID=URI[#SHA256]",
                   help="load at start (repeatable)")
    w.add_argument("--pin-adapter", dest="pin_adapters", action="append", metavar="ID|ID=URI[#SHA256]",
                   help="load and pin at start (repeatable)")
    w.add_argument("--preload-top-n", dest="preload_top_n", type=int,
                   help="with Redis: warm the N adapters with most recent traffic")
    w.set_defaults(handler=_worker)
    f = subparsers.add_parser("fetch-demo", help="fetch and cache the demo base model (SmolLM2-135M-Instruct GGUF)")
    f.set_defaults(handler=_fetch_demo)
    e = subparsers.add_parser("export-hf", help="write a base model as a Hugging Face directory (for vLLM, transformers)")
    e.add_argument("model", nargs="?", help=".gguf file or HF directory (default: the demo model)")
    e.add_argument("out", help="new directory to write config.json, model.safetensors and tokenizer files into")
    e.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    e.set_defaults(handler=_export_hf)
