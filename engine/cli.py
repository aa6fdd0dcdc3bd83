"""``loraplex worker``, ``loraplex vllm-agent``, ``loraplex fetch-demo`` and ``loraplex export-hf``."""

from __future__ import annotations

import argparse
import logging
import os
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
    log.info("base model %s loaded in %.1f s (%s on %s, %s weights [%s], %.0f MB; %s KV cache, %d tokens; %s; "
             "%.0f MB resident)",
             engine.info.name if engine.info else settings.model, time.monotonic() - t0,
             dtype_name(m.dtype), m.device, dtype_name(m.matmul_dtype), engine.weights_reason,
             m.weight_bytes / 1e6, dtype_name(engine.cache.dtype),
             engine.cache.num_blocks * engine.cache.block_size, m.kernels, resident / 1e6)
    try:
        app = create_worker_app(settings, engine)
        uvicorn.run(app, host=settings.worker_host, port=settings.worker_port, log_level=settings.log_level.lower())
    finally:
        engine.close()
    return 0


def _vllm_agent(args: argparse.Namespace) -> int:
    """Torch-free: only ``engine.vllm_agent`` and what it imports (sources, disk cache, control shapes)."""
    import socket

    import uvicorn

    from engine.vllm_agent import AgentConfig, create_agent_app
    from loraplex.devsecrets import refusal
    from loraplex.modelinfo import describe_model
    from loraplex.settings import get_settings

    settings = get_settings()
    problem = refusal(settings, {"--host": args.host}, ("worker_secret",))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per call to vLLM otherwise
    name, revision = args.base_model or "", args.base_revision or ""
    model = args.model or settings.model
    if model and not (name and revision):
        info = describe_model(model, name=name or settings.model_name or None)
        name, revision = name or info.name, revision or info.revision
    if not name:
        print("error: give --model (the base model vLLM serves, as the registry knows it) or --base-model",
              file=sys.stderr)
        return 2
    url = args.url or f"http://{socket.gethostname() if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    config = AgentConfig(vllm_url=args.vllm_url, url=url, worker_id=args.worker_id or settings.worker_id
                         or f"vllm-{socket.gethostname()}-{args.port}", base_model=name, base_revision=revision,
                         served_model=args.served_model or "", max_adapters=args.max_adapters,
                         max_num_seqs=args.max_num_seqs, tokenizer_path=model or "",
                         vllm_api_key=os.environ.get("VLLM_API_KEY", ""))
    uvicorn.run(create_agent_app(config, settings), host=args.host, port=args.port,
                log_level=settings.log_level.lower())
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
    a = subparsers.add_parser("vllm-agent", help="front a vLLM server as a loraplex worker (torch-free)")
    a.add_argument("--vllm-url", required=True, help="vLLM's OpenAI server as the gateway reaches it")
    a.add_argument("--host", default="127.0.0.1")
    a.add_argument("--port", type=int, default=8200)
    a.add_argument("--url", help="this agent as the gateway reaches it (default: http://HOST:PORT)")
    a.add_argument("--worker-id", dest="worker_id")
    a.add_argument("--model", help="the base model's GGUF file or HF directory (registry name, revision and "
                   "tokenizer; default: LORAPLEX_MODEL)")
    a.add_argument("--base-model", dest="base_model", help="the registry's name of the base model (default: from --model)")
    a.add_argument("--base-revision", dest="base_revision")
    a.add_argument("--served-model", dest="served_model",
                   help="vLLM's name of the base model (default: what its /v1/models lists first)")
    a.add_argument("--max-adapters", dest="max_adapters", type=int, default=64,
                   help="adapter names registered with vLLM at most (least recently used unloaded first)")
    a.add_argument("--max-num-seqs", dest="max_num_seqs", type=int, default=0, help="vLLM's --max-num-seqs (reported)")
    a.set_defaults(handler=_vllm_agent)
    f = subparsers.add_parser("fetch-demo", help="fetch and cache the demo base model (SmolLM2-135M-Instruct GGUF)")
    f.set_defaults(handler=_fetch_demo)
    e = subparsers.add_parser("export-hf", help="write a base model as a Hugging Face directory (for vLLM, transformers)")
    e.add_argument("model", nargs="?", help=".gguf file or HF directory (default: the demo model)")
    e.add_argument("out", help="new directory to write config.json, model.safetensors and tokenizer files into")
    e.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    e.set_defaults(handler=_export_hf)
