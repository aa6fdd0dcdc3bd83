"""``loraplex vllm-agent``: the command that runs the agent (``vllm_agent.agent``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any


def _vllm_agent(args: argparse.Namespace) -> int:
    """Torch-free: only ``vllm_agent.agent`` and what it imports (sources, disk cache, control shapes)."""
    import socket

    import uvicorn

    from loraplex.devsecrets import refusal
    from loraplex.modelinfo import describe_model
    from loraplex.settings import get_settings
    from vllm_agent.agent import AgentConfig, create_agent_app

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


def register(subparsers: Any) -> None:
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
