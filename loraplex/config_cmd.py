"""``loraplex config``: every setting, its variable, its effective value and what it means.

The descriptions are the attribute docstrings in ``loraplex/settings.py``, so the
reference printed here (and ``docs/configuration.md``, which is ``--markdown``'s output,
checked by a test) cannot drift from the code.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
from typing import Any

from loraplex.settings import PREFIX, Settings, get_settings, is_development_secret

SECRET_FIELDS = {"jwt_secret", "worker_secret", "admin_token"}


def field_docs() -> dict[str, tuple[str, str]]:
    """field -> (section, description) from the class source."""
    source = inspect.getsource(Settings)
    cls = ast.parse(source).body[0]
    assert isinstance(cls, ast.ClassDef)
    lines = source.splitlines()
    docs: dict[str, tuple[str, str]] = {}
    section = ""
    body = cls.body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            for line in reversed(lines[:node.lineno - 1]):
                text = line.strip()
                if text.startswith("# ---"):
                    section = text.strip("# -")
                    break
                if text and not text.startswith(("#", '"""')) and not text.endswith('"""'):
                    break
            doc = ""
            nxt = body[i + 1] if i + 1 < len(body) else None
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                doc = " ".join(nxt.value.value.split())
            docs[node.target.id] = (section, doc)
    return docs


MARKDOWN_HEAD = """# Configuration

Every setting is a `LORAPLEX_*` environment variable (or a field of `loraplex.settings.Settings`).
`loraplex config` prints each one's effective value (`-v` with its meaning, `--json`); this page
is `loraplex config --markdown > docs/configuration.md`, the defaults and the meanings written in
`loraplex/settings.py` (a test keeps it current).
"""


def reference_markdown() -> str:
    """``docs/configuration.md``: every setting by section, its default and its meaning."""
    docs = field_docs()
    defaults = Settings(home="./.loraplex")
    out = [MARKDOWN_HEAD]
    section = None
    for f in dataclasses.fields(Settings):
        sec, doc = docs.get(f.name, ("", ""))
        if sec != section:
            section = sec
            out.append(f"\n**{sec}**\n\n| variable | default | meaning |\n|---|---|---|\n")
        default = _show(f.name, getattr(defaults, f.name)) if f.name not in SECRET_FIELDS else "(development value)"
        out.append(f"| `{PREFIX}{f.name.upper()}` | {f'`{default}`' if default else '(empty)'} | {doc} |\n")
    return "".join(out)


def _show(name: str, value: Any) -> str:
    if is_development_secret(name, value):
        return f"(development default — set {PREFIX}{name.upper()})"
    if name in SECRET_FIELDS and value:
        return "(set)"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def run(args: argparse.Namespace) -> int:
    settings = get_settings()
    docs = field_docs()
    rows = [(f.name, PREFIX + f.name.upper(), _show(f.name, getattr(settings, f.name)), *docs.get(f.name, ("", "")))
            for f in dataclasses.fields(Settings)]
    if args.json:
        print(json.dumps({env: value for _, env, value, _, _ in rows}, indent=2))
    elif args.markdown:
        print(reference_markdown(), end="")
    else:
        width = max(len(env) for _, env, *_ in rows)
        for _, env, value, _, doc in rows:
            print(f"{env:<{width}}  {value}" + (f"\n{'':<{width}}  # {doc}" if args.verbose and doc else ""))
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("config", help="print every setting (LORAPLEX_* variable) and its effective value",
                              description="loraplex config: every setting, its variable, its effective value and what it means.")
    p.add_argument("--json", action="store_true", help="JSON object of variable -> value")
    p.add_argument("--markdown", action="store_true", help="the reference table (defaults and meanings)")
    p.add_argument("-v", "--verbose", action="store_true", help="with each setting's meaning")
    p.set_defaults(handler=run)
