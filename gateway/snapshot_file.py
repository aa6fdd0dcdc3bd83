"""A static registry snapshot read from a JSON file (``LORAPLEX_REGISTRY_SNAPSHOT_FILE``).

For tests and benchmarks that run a gateway without a registry database. The file
mirrors ``registry.snapshot``::

    {"version": 1,
     "base_models": {"smol": {"revision": "r1", "architecture": "llama"}},
     "adapters": {"v1": {"name": "support", "version": 1, "base_model": "smol", "uri": "file:///a",
                         "sha256": "", "rank": 8, "alpha": 16, "status": "ready"}},
     "tenants": {"acme": {"status": "active", "requests_per_min": 0, "tokens_per_min": 0,
                          "max_concurrent": 0, "priority": "normal", "cache_scope": "",
                          "bindings": {"support": {"active": "v1", "canary": null,
                                                   "canary_percent": 0, "enabled": true,
                                                   "on_disabled": "refuse"}}}}}

``cache_scope`` is the tenant's shared prefix-cache scope (empty or absent: its own).
The file is re-read when its modification time changes (checked at most once a second).
``FileSnapshotSource`` is a ``gateway.snapshot_source.SnapshotSource`` with nothing to start,
stop or freeze: the interface's no-op hooks.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from gateway.snapshot_source import SnapshotSource
from registry.snapshot import AdapterVersionView, BaseModelView, BindingView, RegistrySnapshot, TenantView


def snapshot_from_dict(data: dict[str, Any]) -> RegistrySnapshot:
    bases = {name: BaseModelView(name=name, revision=str(b.get("revision", "")),
                                 architecture=str(b.get("architecture", "")), created=int(b.get("created", 0)))
             for name, b in data.get("base_models", {}).items()}
    versions = {vid: AdapterVersionView(id=vid, name=a["name"], version=int(a["version"]),
                                        base_model=a["base_model"], uri=a.get("uri", ""),
                                        sha256=a.get("sha256", ""), rank=int(a.get("rank", 0)),
                                        alpha=float(a.get("alpha", 0)), status=a.get("status", "ready"),
                                        created=int(a.get("created", 0)))
                for vid, a in data.get("adapters", {}).items()}
    tenants = {}
    for slug, t in data.get("tenants", {}).items():
        bindings = {}
        for alias, b in t.get("bindings", {}).items():
            active = versions.get(b["active"]) if b.get("active") else None
            canary = versions.get(b["canary"]) if b.get("canary") else None
            bindings[alias] = BindingView(
                alias=alias, active=active, canary=canary, canary_percent=float(b.get("canary_percent", 0)),
                enabled=bool(b.get("enabled", True)), on_disabled=b.get("on_disabled", "refuse"),
                base_model=b.get("base_model", active.base_model if active else ""))
        tenants[slug] = TenantView(
            slug=slug, status=t.get("status", "active"), requests_per_min=int(t.get("requests_per_min", 0)),
            tokens_per_min=int(t.get("tokens_per_min", 0)), max_concurrent=int(t.get("max_concurrent", 0)),
            priority=t.get("priority", "normal"), bindings=bindings, cache_scope=str(t.get("cache_scope") or ""))
    return RegistrySnapshot(version=int(data.get("version", 1)), tenants=tenants, base_models=bases)


class FileSnapshotSource(SnapshotSource):
    """The snapshot of the JSON file at ``path``, re-read at most every ``check_s`` seconds when it
    changed; a file that cannot be read or parsed keeps the last good snapshot."""

    def __init__(self, path: str, check_s: float = 1.0) -> None:
        self.path = path
        self.check_s = check_s
        self._mtime = -1.0
        self._checked = 0.0
        self._snapshot = RegistrySnapshot(version=0)
        self._load()

    def _load(self) -> None:
        mtime = os.stat(self.path).st_mtime
        if mtime != self._mtime:
            with open(self.path, encoding="utf-8") as fh:
                self._snapshot = snapshot_from_dict(json.load(fh))
            self._mtime = mtime

    @property
    def current(self) -> RegistrySnapshot:
        now = time.monotonic()
        if now - self._checked >= self.check_s:
            self._checked = now
            try:
                self._load()
            except (OSError, ValueError, KeyError):
                pass  # keep serving the last good snapshot
        return self._snapshot
