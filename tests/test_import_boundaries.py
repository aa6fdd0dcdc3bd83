"""The package boundaries of docs/DESIGN.md hold (checked in fresh interpreters; the ground floor in its source too).

| package | may import | never imports |
|---|---|---|
| ``loraplex/`` (ground floor) | third-party libraries only | gateway, registry, engine, loraplex_cli, torch |
| ``registry/`` | loraplex | gateway, engine, loraplex_cli |
| ``gateway/`` | loraplex, registry | engine, loraplex_cli, torch (not even when it admits an adapter) |
| ``engine/`` | loraplex | gateway, registry, vllm_agent, loraplex_cli |
| ``vllm_agent/`` | loraplex, engine's torch-free worker pieces (sources, control shapes, secret, reports) | gateway, registry, loraplex_cli, torch |
| ``planner/`` | loraplex, gateway's router, engine's eviction policy (torch-free) | registry, loraplex_cli, torch |
| ``loraplex_cli/`` (composition root) | every package, each only for the command that runs it | |
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules_after(code: str) -> set[str]:
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=120)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _top(mods: set[str]) -> set[str]:
    return {m.split(".")[0] for m in mods}


def _floor_modules() -> list[str]:
    return sorted(f"loraplex.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "loraplex")]))


def test_the_ground_floor_imports_nothing_above_it():
    modules = _floor_modules()
    assert {"loraplex.settings", "loraplex.wire", "loraplex.openai_request"} <= set(modules)
    top = _top(_modules_after("\n".join(f"import {m}" for m in modules)))
    assert not top & {"gateway", "registry", "engine", "loraplex_cli", "torch"}, sorted(top)


def _imported_names(path: Path) -> set[str]:
    """Every module an ``import`` statement anywhere in ``path`` names, deferred imports in functions included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_the_ground_floor_defers_no_import_of_an_upper_package():
    """Deferred imports (inside functions) escape the import-time check above; the source shows them."""
    upper = {"gateway", "registry", "engine", "loraplex_cli", "torch"}
    reaching = {f"{path.name}: {name}" for path in sorted((ROOT / "loraplex").glob("*.py"))
                for name in _imported_names(path) if name.split(".")[0] in upper}
    assert not reaching, sorted(reaching)


def test_the_cli_dispatcher_imports_no_package_until_a_command_runs():
    top = _top(_modules_after("import loraplex_cli.main"))
    assert not top & {"gateway", "registry", "engine", "torch"}, sorted(top)


def test_gateway_does_not_import_torch_even_when_admitting(tmp_path):
    code = f"""
import gateway.app, gateway.activation, gateway.cli, registry.admin_api, registry.service, registry.cache
from loraplex.modelinfo import ModelInfo
from loraplex.settings import Settings
from registry.admission import admit
from tests.registry_support import TINY, write_adapter
import torch as _t  # writing the test adapter needs torch; forget it before admission
write_adapter(__import__("pathlib").Path({str(tmp_path)!r}) / "a", TINY,
              tensors=lambda t: {{k: v.to(_t.bfloat16) for k, v in t.items()}})
import sys
for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
    del sys.modules[name]
del _t
admit("a", TINY, Settings(adapter_root={str(tmp_path)!r}))
"""
    # Re-importing torch after the purge would show up in sys.modules again.
    assert "torch" not in _modules_after(code)
    assert not _top(_modules_after("import gateway.app, gateway.activation, gateway.cli")) & {
        "torch", "engine", "loraplex_cli"}


def test_registry_imports_neither_gateway_nor_engine():
    top = _top(_modules_after("import registry.service, registry.admin_api, registry.cache, registry.cli, "
                              "registry.admission, registry.migrate"))
    assert not top & {"gateway", "engine", "loraplex_cli"}


def test_engine_imports_neither_gateway_nor_registry():
    top = _top(_modules_after("import engine.api, engine.engine, engine.internal_api, engine.reporter, "
                              "engine.warmstart, engine.lora.manager, engine.cli"))
    assert not top & {"gateway", "registry", "vllm_agent", "loraplex_cli"}
    reaching = {f"{path.relative_to(ROOT)}: {name}" for path in sorted((ROOT / "engine").rglob("*.py"))
                for name in _imported_names(path) if name.split(".")[0] == "vllm_agent"}
    assert not reaching, sorted(reaching)


def test_the_vllm_agent_is_a_package_of_its_own_without_torch():
    top = _top(_modules_after("import vllm_agent.agent, vllm_agent.cli"))
    assert "vllm_agent" in top and not top & {"gateway", "registry", "loraplex_cli", "torch"}, sorted(top)


def test_the_planner_replays_the_real_router_and_policy_without_torch():
    mods = _modules_after("import planner.cli, planner.replay, planner.report")
    assert {"gateway.router", "engine.lora.eviction"} <= mods
    assert not _top(mods) & {"registry", "loraplex_cli", "torch"}, sorted(_top(mods))


def _project_imports() -> dict[str, set[str]]:
    """Each project module -> the project modules it imports anywhere in its source (function
    bodies included: a deferred import is a dependency too)."""
    mods = {}
    for pkg in ("engine", "gateway", "registry", "loraplex", "loraplex_cli", "vllm_agent", "planner"):
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            mods[name] = f
    graph: dict[str, set[str]] = {}
    for name, f in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                            for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def test_no_module_imports_its_way_back_to_itself():
    """The import picture has no circle (``engine.lora.ops`` and ``triton_ops`` share the step's
    plan through ``engine.lora.plan``, not through each other)."""
    graph = _project_imports()
    assert graph["engine.lora.triton_ops"] >= {"engine.lora.plan"}, "the check must see deferred imports"
    circles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not circles, circles[:5]
