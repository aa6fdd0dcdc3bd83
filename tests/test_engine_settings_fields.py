"""Engine modules read only fields the typed ``Settings`` has: a misspelt one fails here."""

from __future__ import annotations

import ast
from pathlib import Path

from loraplex.settings import Settings

ENGINE = Path(__file__).resolve().parent.parent / "engine"


def _settings_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """``settings.X`` and ``<obj>.settings.X`` attribute reads."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        named = (isinstance(base, ast.Name) and base.id == "settings") or (
            isinstance(base, ast.Attribute) and base.attr == "settings")
        if named:
            out.append((node.lineno, node.attr))
    return out


def test_every_settings_read_in_the_engine_is_a_settings_attribute():
    known = set(dir(Settings)) | {f for f in Settings.__dataclass_fields__}
    reads = {}
    unknown = []
    for path in sorted(ENGINE.rglob("*.py")):
        for line, attr in _settings_reads(ast.parse(path.read_text(), str(path))):
            reads[attr] = path
            if attr not in known:
                unknown.append(f"{path.relative_to(ENGINE.parent)}:{line}: settings.{attr}")
    assert not unknown, "engine reads settings the Settings object does not have:\n" + "\n".join(unknown)
    assert {"max_loras", "worker_secret", "kv_cache_bytes"} <= set(reads), "the scan found the engine's reads"


def test_the_scan_catches_a_misspelt_field():
    tree = ast.parse("def f(settings):\n    return settings.max_lora + settings.kv_cache_bytes\n")
    assert [a for _, a in _settings_reads(tree) if a not in dir(Settings)] == ["max_lora"]
