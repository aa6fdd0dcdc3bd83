"""The ``loraplex`` command: one CLI for every process and every operation.

Each package contributes its own subcommands through a ``register(subparsers)``
function in its ``cli`` module; modules are imported lazily so ``--help`` is fast
and a gateway host never imports torch (nor needs it installed: see ``ENGINE_COMMANDS``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

# command -> (module with register(), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "admin": ("registry.cli", "operate the registry: tenants, adapters, bindings, canaries, limits, audit"),
    "migrate": ("registry.cli", "apply the registry schema migrations (alembic upgrade head)"),
    "gateway": ("gateway.cli", "run the OpenAI-compatible gateway (uvicorn)"),
    "admin-api": ("gateway.cli", "run the registry admin API in a process of its own"),
    "token": ("gateway.cli", "mint a JWT for a tenant or an admin"),
    "worker": ("engine.cli", "run an engine worker"),
    "vllm-agent": ("vllm_agent.cli", "front a vLLM server as a loraplex worker (adapters, residency, probes)"),
    "fetch-demo": ("engine.cli", "fetch and cache the demo base model (SmolLM2-135M-Instruct GGUF)"),
    "export-hf": ("engine.cli", "write a base model (GGUF or HF) as a Hugging Face directory for vLLM/transformers"),
    "serve": ("loraplex_cli.serve", "run gateway + one worker in one process on the embedded default"),
    "demo": ("loraplex_cli.serve", "seed demo tenants/adapters and run the embedded system"),
    "plan": ("planner.cli", "size the fleet (workers, device slots, host cache) from the gateways' access logs"),
    "config": ("loraplex.config_cmd", "print every setting (LORAPLEX_* variable) and its effective value"),
}

ENGINE_COMMANDS = frozenset({"worker", "serve", "demo", "export-hf"})
"""Commands that run the engine: they need the ``engine`` extra (``pip install 'loraplex[engine]'``)."""
ENGINE_MODULES = ("torch", "safetensors")
"""What the ``engine`` extra installs that the plain install does not."""


def missing_engine_modules() -> list[str]:
    """The ``engine`` extra's modules this interpreter cannot import."""
    return [name for name in ENGINE_MODULES if importlib.util.find_spec(name) is None]


def _top_parser() -> argparse.ArgumentParser:
    from loraplex import __version__

    parser = argparse.ArgumentParser(prog="loraplex", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"loraplex {__version__}")
    return parser


EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE, what a shell reports for a command whose reader went away (``| head``)."""


def main(argv: list[str] | None = None) -> int:
    """Run one command; output cut short by a closed pipe ends quietly with ``EXIT_BROKEN_PIPE``."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        # Point stdout at devnull so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _top_parser()
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    if not argv or argv[0] not in COMMANDS:
        # Top-level help: list the commands without importing any package.
        for name, (_, help_text) in COMMANDS.items():
            sub.add_parser(name, help=help_text)
        parser.parse_args(argv)
        parser.print_help()
        return 2
    # Import only the module that owns the command; it registers its commands.
    importlib.import_module(COMMANDS[argv[0]][0]).register(sub)
    # Help needs no engine; anything else learns first that the engine is missing, before its
    # arguments are checked.
    wants_help = any(a in ("-h", "--help") for a in argv[1:])
    missing = missing_engine_modules() if argv[0] in ENGINE_COMMANDS and not wants_help else []
    if missing:
        print(f"error: `loraplex {argv[0]}` runs the engine, which this install lacks ({', '.join(missing)} "
              "not installed): install loraplex[engine] (pip install 'loraplex[engine]')", file=sys.stderr)
        return 1
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)
