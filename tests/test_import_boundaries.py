"""The package boundaries of docs/DESIGN.md hold at import time (checked in fresh interpreters).

* the gateway never imports torch, not even when it admits an adapter (admission runs there);
* the registry imports neither the gateway nor the engine;
* the engine imports neither the gateway nor the registry.
"""

from __future__ import annotations

import json
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
    assert "torch" not in _top(_modules_after("import gateway.app, gateway.activation, gateway.cli"))


def test_registry_imports_neither_gateway_nor_engine():
    top = _top(_modules_after("import registry.service, registry.admin_api, registry.cache, registry.cli, "
                              "registry.admission, registry.migrate"))
    assert not top & {"gateway", "engine"}


def test_engine_imports_neither_gateway_nor_registry():
    top = _top(_modules_after("import engine.api, engine.engine, engine.internal_api, engine.reporter, "
                              "engine.warmstart, engine.lora.manager, engine.cli"))
    assert not top & {"gateway", "registry"}
