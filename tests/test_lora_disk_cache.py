"""The adapter disk tier: byte budget, LRU eviction by use, stale partial downloads, and
refetching an evicted adapter through the manager."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from engine.lora.manager import AdapterManager
from engine.lora.sources import DiskCache, HttpSource, LocalSource, SourceRegistry
from engine.metrics import WorkerMetrics
from loraplex.settings import Settings
from loraplex.wire import AdapterRef
from tests.test_lora_manager import TINY, make_adapter, manager

ENTRY = 1000  # bytes of one fake entry


class BlobSource:
    """A remote source writing ``ENTRY`` bytes per adapter (``sizes`` overrides), counting fetches."""

    schemes = ("blob",)
    remote = True

    def __init__(self, sizes: dict[str, int] | None = None) -> None:
        self.sizes = sizes or {}
        self.fetches: list[str] = []

    def fetch(self, ref: AdapterRef, dest: Path | None) -> Path:
        assert dest is not None
        self.fetches.append(ref.id)
        half = self.sizes.get(ref.id, ENTRY) // 2
        (dest / "adapter_config.json").write_bytes(b"{" + b" " * (half - 2) + b"}")
        (dest / "adapter_model.safetensors").write_bytes(b"\0" * half)
        return dest


def blob(id_: str) -> AdapterRef:
    return AdapterRef(id=id_, name=id_, uri=f"blob://{id_}")


class Evictions(list):
    def __call__(self, name: str, nbytes: int) -> None:
        self.append((name, nbytes))


def fill_aged(cache: DiskCache, source: BlobSource, ids: str) -> None:
    """Fill one entry per id, then date them a minute apart (first oldest), all in the past."""
    now = time.time_ns()
    for i, id_ in enumerate(ids):
        cache.fill(blob(id_), source)
        t = now - (len(ids) - i) * 60 * 10**9
        os.utime(cache.path_for(blob(id_)), ns=(t, t))


def test_eviction_is_lru_by_use(tmp_path):
    evicted = Evictions()
    cache = DiskCache(tmp_path / "c", max_bytes=3 * ENTRY, on_evict=evicted)
    src = BlobSource()
    fill_aged(cache, src, "abc")
    assert cache.ids() == ["a", "b", "c"] and not evicted
    assert cache.get(blob("a")) == tmp_path / "c" / "a"  # a is now the most recently used
    cache.fill(blob("d"), src)
    assert cache.ids() == ["a", "c", "d"] and evicted == [("b", ENTRY)]
    cache.fill(blob("e"), src)
    assert cache.ids() == ["a", "d", "e"] and evicted == [("b", ENTRY), ("c", ENTRY)]
    assert cache.get(blob("b")) is None
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.startswith(".")], "no trash left behind"


def test_just_filled_entry_survives_over_budget(tmp_path, caplog):
    evicted = Evictions()
    cache = DiskCache(tmp_path / "c", max_bytes=2 * ENTRY, on_evict=evicted)
    src = BlobSource({"big": 5 * ENTRY})
    fill_aged(cache, src, "ab")
    with caplog.at_level(logging.INFO, logger="engine.lora.sources"):
        cache.fill(blob("big"), src)
    assert cache.ids() == ["big"] and cache.get(blob("big")) is not None
    assert sorted(evicted) == [("a", ENTRY), ("b", ENTRY)]
    assert any(r.levelno == logging.WARNING and "exceeds the disk cache budget" in r.message for r in caplog.records)
    assert any(r.levelno == logging.INFO and "evicted adapter a" in r.message and f"{ENTRY} bytes" in r.message
               for r in caplog.records)


def test_zero_budget_is_unbounded(tmp_path):
    evicted = Evictions()
    cache = DiskCache(tmp_path / "c", max_bytes=0, on_evict=evicted)
    fill_aged(cache, BlobSource({"big": 50 * ENTRY}), ["a", "b", "c", "d", "big"])
    assert cache.count() == 5 and not evicted


def test_entries_of_another_process_count(tmp_path):
    """Two workers sharing the directory: each one's budget covers what the other wrote."""
    evicted = Evictions()
    mine = DiskCache(tmp_path / "c", max_bytes=2 * ENTRY, on_evict=evicted)
    theirs = DiskCache(tmp_path / "c")
    fill_aged(theirs, BlobSource(), "ab")
    mine.fill(blob("m"), BlobSource())
    assert mine.ids() == ["b", "m"] and evicted == [("a", ENTRY)]
    shutil.rmtree(tmp_path / "c" / "b")  # the other worker removed it
    mine.fill(blob("n"), BlobSource())
    assert mine.ids() == ["m", "n"] and evicted == [("a", ENTRY)]
    theirs.fill(blob("m"), BlobSource({"m": 2 * ENTRY}))  # ... and replaced one with a larger copy
    t = time.time_ns() - 60 * 10**9
    os.utime(tmp_path / "c" / "n", ns=(t, t))  # n is the least recently used
    mine.fill(blob("o"), BlobSource())
    assert mine.ids() == ["o"] and evicted == [("a", ENTRY), ("n", ENTRY), ("m", 2 * ENTRY)]


def test_stale_partial_downloads_are_removed_young_kept(tmp_path):
    root = tmp_path / "c"
    old = time.time() - 2 * 3600
    for name in (".partial-dead", ".partial-live", ".partial-fresh"):
        (root / name).mkdir(parents=True)
        (root / name / "adapter_model.safetensors").write_bytes(b"\0" * 10)
    for p in (root / ".partial-dead" / "adapter_model.safetensors", root / ".partial-dead",
              root / ".partial-live"):
        os.utime(p, (old, old))  # .partial-live: an old directory whose file is still being written
    DiskCache(root).fill(blob("a"), BlobSource())
    os.utime(root / "a", (old, old))  # complete entries are not partial, however old
    DiskCache(root)
    assert sorted(p.name for p in root.iterdir()) == [".partial-fresh", ".partial-live", "a"]


# --- through the manager --------------------------------------------------------------------

def served(root: Path) -> tuple[httpx.MockTransport, list[str]]:
    """An HTTP transport serving files under ``root``, recording the paths requested."""
    requested: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        requested.append(request.url.path)
        f = root / request.url.path.lstrip("/")
        return httpx.Response(200, content=f.read_bytes()) if f.is_file() else httpx.Response(404)

    return httpx.MockTransport(handle), requested


def entry_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir())


def test_evicted_adapter_is_refetched_through_the_manager(tmp_path):
    root = tmp_path / "served"
    size = entry_bytes(make_adapter(root / "v1", seed=1))
    make_adapter(root / "v2", seed=2)
    make_adapter(root / "v3", seed=3)
    transport, requested = served(root)
    refs = [AdapterRef(id=f"ver-{i}", name="support", uri=f"http://store/v{i}") for i in (1, 2, 3)]
    m = manager(tmp_path, cpu=1, cache_max_bytes=2 * size + size // 2,
                sources=SourceRegistry([LocalSource(), HttpSource(transport=transport)]))
    for r in refs:
        m.prefetch(r)
        assert m.wait(r, timeout=10).state == "host"
    assert m.stats.evictions["disk"] == 1 and m.disk.ids() == ["ver-2", "ver-3"]
    assert m.state(refs[0]).state == "absent", "host memory holds one adapter: ver-1 left it too"
    m.prefetch(refs[0])
    assert m.wait(refs[0], timeout=10).state == "host"
    assert m.stats.loads["source"] == 4 and requested.count("/v1/adapter_model.safetensors") == 2
    assert m.stats.evictions["disk"] == 2 and "ver-1" in m.disk.ids() and m.disk.count() == 2
    engine = SimpleNamespace(load=lambda: {"queue_depth": 0, "running": 0, "kv_blocks_used": 0,
                                           "kv_blocks_total": 0}, grammars=None,
                             lora_runtime=SimpleNamespace(manager=m))
    text = WorkerMetrics(engine, "w").render().decode()
    assert 'loraplex_worker_adapter_evictions_total{tier="disk",worker="w"} 2.0' in text
    m.close()


class CopySource:
    """A remote source copying one real tiny adapter, counting fetches."""

    schemes = ("copy",)
    remote = True

    def __init__(self, adapter: Path) -> None:
        self.adapter = adapter
        self.fetches: list[str] = []

    def fetch(self, ref: AdapterRef, dest: Path | None) -> Path:
        assert dest is not None
        self.fetches.append(ref.id)
        shutil.copytree(self.adapter, dest, dirs_exist_ok=True)
        return dest


def test_entry_evicted_while_being_read_is_fetched_again(tmp_path):
    """Another worker evicts the entry between the lookup and the read: the load still succeeds."""
    src = CopySource(make_adapter(tmp_path / "adapter", seed=5))
    m = manager(tmp_path, sources=SourceRegistry([LocalSource(), src]))
    ref = AdapterRef(id="x", name="x", uri="copy://x")
    m.disk.fill(ref, src)
    lookup = m.disk.get

    def get_then_evicted(r: AdapterRef) -> Path | None:
        d = lookup(r)
        assert d is not None
        shutil.rmtree(d)
        return d

    m.disk.get = get_then_evicted  # type: ignore[method-assign]
    m.prefetch(ref)
    assert m.wait(ref, timeout=10).state == "host"
    assert m.stats.loads == {"source": 1, "disk": 0, "host": 0} and src.fetches == ["x", "x"]
    m.close()


def test_budget_comes_from_settings(tmp_path):
    assert Settings().adapter_cache_max_bytes == 10 * 1024**3
    assert Settings.from_env({"LORAPLEX_ADAPTER_CACHE_MAX_BYTES": "0"}).adapter_cache_max_bytes == 0
    settings = Settings(home=str(tmp_path / "home"), adapter_cache_max_bytes=12345)
    m = AdapterManager.from_settings(settings, TINY)
    assert m.disk is not None and m.disk.max_bytes == 12345
    m.close()
