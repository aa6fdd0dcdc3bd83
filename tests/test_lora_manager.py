"""Adapter tiers: LRU eviction, pinning, users, failures, prefetch, version-keyed caching, sha256."""

from __future__ import annotations

import http.server
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.lora.eviction import LRUPolicy
from engine.lora.manager import AdapterLoadError, AdapterManager, SlotsExhausted
from engine.lora.slots import SlotBank
from engine.lora.sources import AdapterFetchError, HttpSource, LocalSource, SourceRegistry
from loraplex.digest import digest_directory
from loraplex.modelinfo import ModelInfo
from loraplex.wire import AdapterRef

TINY = ModelInfo(name="tiny", revision="0", architecture="llama", hidden_size=16, intermediate_size=24,
                 num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, vocab_size=32, context_length=64)


def make_adapter(d: Path, seed: int, rank: int = 4) -> Path:
    g = torch.Generator().manual_seed(seed)
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(
        f'{{"peft_type": "LORA", "r": {rank}, "lora_alpha": {2 * rank}, "target_modules": ["q_proj", "v_proj"]}}')
    tensors = {}
    for layer in range(TINY.num_layers):
        for proj in ("q_proj", "v_proj"):
            fin, fout = TINY.projection_shape(proj)
            k = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{k}.lora_A.weight"] = torch.randn(rank, fin, generator=g)
            tensors[f"{k}.lora_B.weight"] = torch.randn(fout, rank, generator=g)
    save_file(tensors, d / "adapter_model.safetensors")
    return d


def sha(d: Path) -> str:
    return digest_directory(d)


def ref_for(d: Path, id_: str, name: str = "", with_sha: bool = False) -> AdapterRef:
    return AdapterRef(id=id_, name=name or id_, uri=d.as_uri(), sha256=sha(d) if with_sha else None)


def manager(tmp_path: Path, slots: int = 2, max_loras: int = 4, cpu: int = 8, **kw) -> AdapterManager:
    bank = SlotBank.for_model(TINY, (8, 16), slots_per_class=slots)
    return AdapterManager(TINY, bank, max_loras=max_loras, max_cpu_loras=cpu,
                          cache_dir=str(tmp_path / "cache"), **kw)


def wait_settled(m: AdapterManager, ref: AdapterRef, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while (s := m.state(ref).state) == "loading":
        assert time.monotonic() < deadline, "load did not finish"
        time.sleep(0.01)
    return s


@pytest.fixture
def adapters(tmp_path):
    return {n: ref_for(make_adapter(tmp_path / n, seed=i), n) for i, n in enumerate("abcde")}


def test_lru_policy_order():
    p = LRUPolicy()
    for k in "abc":
        p.touch(k)
    p.touch("a")
    assert p.order({"a", "b", "c"}) == ["b", "c", "a"]
    p.remove("b")
    assert p.order({"a", "c", "z"}) == ["c", "a", "z"]


def test_device_eviction_is_lru(tmp_path, adapters):
    m = manager(tmp_path)
    a, b, c = adapters["a"], adapters["b"], adapters["c"]
    for r in (a, b, a):
        m.acquire_slots([r])
        m.release([r])
    slot_b = m.slot_of(b)
    assert m.resident()["device"] == {"a", "b"}
    [slot_c] = m.acquire_slots([c])
    assert slot_c == slot_b, "least recently used adapter (b) gives up its slot"
    assert m.state(b).state == "host" and m.state(a).state == "device"
    assert m.stats.evictions["device"] == 1
    assert m.stats.loads["disk"] == 3 and m.stats.loads["host"] == 3 and m.stats.hits["device"] == 1
    m.close()


def test_slot_holds_the_adapter_weights(tmp_path, adapters):
    from engine.lora.peft import load_adapter

    m = manager(tmp_path)
    [s] = m.acquire_slots([adapters["d"]])
    w = load_adapter(tmp_path / "d", TINY)
    c, i = m.bank.split(s)
    a, b, scale = m.bank.stacks(c, 1, "v_proj")
    mod = w.modules[(1, "v_proj")]
    assert torch.equal(a[i, :4], mod.a) and torch.equal(b[i, :, :4], mod.b) and float(scale[i]) == mod.scale
    m.close()


def test_in_use_never_evicted_and_max_loras(tmp_path, adapters):
    m = manager(tmp_path, slots=2, max_loras=3)
    a, b, c = adapters["a"], adapters["b"], adapters["c"]
    assert m.acquire_slots([a, a]) == [m.slot_of(a)] * 2
    m.acquire_slots([b])
    with pytest.raises(SlotsExhausted, match="rank-8 slots are in use"):
        m.acquire_slots([c])
    assert m.state(a).users == 2 and m.state(c).users == 0
    m.release([a])
    with pytest.raises(SlotsExhausted):
        m.acquire_slots([c])  # a still has one user
    m.release(["a"])
    [sc] = m.acquire_slots([c])
    assert m.slot_of(a) is None and sc not in (None, m.slot_of(b))
    m2 = manager(tmp_path, slots=4, max_loras=2)
    m2.acquire_slots([a, b])
    with pytest.raises(SlotsExhausted, match="max_loras=2"):
        m2.acquire_slots([c])
    with pytest.raises(ValueError, match="without a matching acquire"):
        m2.release([c])
    m.close()
    m2.close()


def test_pinned_never_evicted(tmp_path, adapters):
    m = manager(tmp_path, slots=2, cpu=2)
    a = adapters["a"]
    m.pin(a)
    assert wait_settled(m, a) == "host"
    m.acquire_slots([a])
    m.release([a])
    for name in "bcde":
        r = adapters[name]
        m.acquire_slots([r])
        m.release([r])
    assert m.state(a).state == "device" and m.state(a).in_host
    assert m.resident_counts()["host"] == 2
    m.unpin(a)
    for name in "bc":
        m.acquire_slots([adapters[name]])
        m.release([adapters[name]])
    assert m.state(a).state in ("host", "absent") and m.slot_of(a) is None
    m.close()


def test_host_lru_eviction(tmp_path, adapters):
    m = manager(tmp_path, cpu=2)
    for name in "abc":
        m.prefetch(adapters[name])
        assert wait_settled(m, adapters[name]) == "host"
    assert m.resident()["host"] == {"b", "c"}
    assert m.state(adapters["a"]).state == "absent"
    assert m.stats.evictions["host"] == 1
    m.close()


class _GatedSource:
    """A source that waits for an event: shows that prefetch does not block."""

    schemes = ("gated",)
    remote = False

    def __init__(self, path: Path) -> None:
        self.path = path
        self.gate = threading.Event()

    def fetch(self, ref, dest):
        assert self.gate.wait(10)
        return self.path


def test_prefetch_runs_in_background_then_acquire_hits(tmp_path, adapters):
    gated = _GatedSource(tmp_path / "a")
    m = manager(tmp_path, sources=SourceRegistry([LocalSource(), gated]))
    ref = AdapterRef(id="g1", name="gated", uri="gated://a")
    t0 = time.perf_counter()
    m.prefetch(ref)
    assert time.perf_counter() - t0 < 5.0  # the load itself waits on the gate for 10 s
    assert m.state(ref).state == "loading" and not m.ready(ref)
    gated.gate.set()
    assert wait_settled(m, ref) == "host" and m.ready(ref)
    m.acquire_slots([ref])
    assert m.stats.hits["host"] == 1 and m.stats.misses == 0
    m.release([ref])
    m.acquire_slots([ref])
    assert m.stats.hits["device"] == 1
    m.close()


def test_load_failure_fails_only_that_adapter_and_is_retriable(tmp_path, adapters):
    m = manager(tmp_path, failure_ttl_s=0.0)
    bad_dir = make_adapter(tmp_path / "bad", seed=9)
    good = (bad_dir / "adapter_model.safetensors").read_bytes()
    (bad_dir / "adapter_model.safetensors").write_bytes(good[:100])
    bad = ref_for(bad_dir, "bad")
    m.prefetch(bad)
    assert wait_settled(m, bad) == "failed"
    assert "safetensors" in m.state(bad).error
    with pytest.raises(AdapterLoadError, match="invalid adapter"):
        m.acquire_slots([bad, adapters["a"]])
    assert m.state(adapters["a"]).users == 0
    assert m.acquire_slots([adapters["a"]])
    assert m.stats.failures >= 1
    (bad_dir / "adapter_model.safetensors").write_bytes(good)
    m.prefetch(bad)
    assert wait_settled(m, bad) == "host"
    m.close()


def test_failure_ttl_holds_failed_state(tmp_path):
    m = manager(tmp_path, failure_ttl_s=60.0)
    missing = AdapterRef(id="x", name="x", uri=(tmp_path / "nope").as_uri())
    m.prefetch(missing)
    assert wait_settled(m, missing) == "failed"
    m.prefetch(missing)
    assert m.state(missing).state == "failed" and "does not exist" in m.state(missing).error
    m.close()


def test_rank_above_largest_class_fails(tmp_path):
    m = manager(tmp_path)
    ref = ref_for(make_adapter(tmp_path / "big", seed=1, rank=32), "big")
    with pytest.raises(AdapterLoadError, match="rank 32 exceeds"):
        m.acquire_slots([ref])
    m.close()


def test_versions_of_one_name_never_share_weights(tmp_path):
    m = manager(tmp_path)
    v1 = ref_for(make_adapter(tmp_path / "v1", seed=1), "ver-1", name="support")
    v2 = ref_for(make_adapter(tmp_path / "v2", seed=2), "ver-2", name="support")
    s1, s2 = m.acquire_slots([v1, v2])
    assert s1 != s2
    c1, i1 = m.bank.split(s1)
    c2, i2 = m.bank.split(s2)
    a1 = m.bank.stacks(c1, 0, "q_proj")[0][i1]
    a2 = m.bank.stacks(c2, 0, "q_proj")[0][i2]
    assert not torch.equal(a1, a2)
    m.close()


def test_sha256_mismatch_refused(tmp_path, adapters):
    m = manager(tmp_path)
    d = tmp_path / "a"
    good = AdapterRef(id="s1", name="s", uri=d.as_uri(), sha256=sha(d))
    bad = AdapterRef(id="s2", name="s", uri=d.as_uri(), sha256="0" * 64)
    assert m.acquire_slots([good])
    with pytest.raises(AdapterLoadError, match="sha256 mismatch"):
        m.acquire_slots([bad])
    m.close()


@pytest.fixture
def http_root(tmp_path):
    root = tmp_path / "served"
    root.mkdir()
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None  # type: ignore[method-assign]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_source_disk_cache_and_versions(tmp_path, http_root):
    root, url = http_root
    v1 = make_adapter(root / "v1", seed=1)
    make_adapter(root / "v2", seed=2)
    r1 = AdapterRef(id="ver-1", name="support", uri=f"{url}/v1", sha256=sha(v1))
    r2 = AdapterRef(id="ver-2", name="support", uri=f"{url}/v2")
    m = manager(tmp_path)
    m.acquire_slots([r1, r2])
    assert m.stats.loads["source"] == 2
    assert (tmp_path / "cache" / "ver-1" / "adapter_model.safetensors").read_bytes() == \
        (root / "v1" / "adapter_model.safetensors").read_bytes()
    assert m.resident_counts()["disk"] == 2
    m.close()
    m2 = manager(tmp_path)  # same disk cache, fresh host tier
    m2.acquire_slots([r1])
    assert m2.stats.loads == {"source": 0, "disk": 1, "host": 1}
    missing = AdapterRef(id="ver-3", name="support", uri=f"{url}/nothing-here")
    with pytest.raises(AdapterLoadError, match="HTTP 404"):
        m2.acquire_slots([missing])
    assert m2.state(missing).state == "failed"
    wrong = AdapterRef(id="ver-4", name="support", uri=f"{url}/v2", sha256="f" * 64)
    with pytest.raises(AdapterLoadError, match="sha256 mismatch"):
        m2.acquire_slots([wrong])
    assert not (tmp_path / "cache" / "ver-4").exists()
    m2.close()


def test_unknown_scheme_and_oversized_download(tmp_path, http_root):
    root, url = http_root
    make_adapter(root / "v1", seed=1)
    m = manager(tmp_path)
    with pytest.raises(AdapterLoadError, match="no adapter source for URI scheme 's3'"):
        m.acquire_slots([AdapterRef(id="o", name="o", uri="s3://bucket/x")])
    m.close()
    small = manager(tmp_path, sources=SourceRegistry([LocalSource(), HttpSource(max_bytes=64)]))
    with pytest.raises(AdapterLoadError, match="larger than 64 bytes"):
        small.acquire_slots([AdapterRef(id="big", name="big", uri=f"{url}/v1")])
    small.close()
    assert issubclass(AdapterFetchError, RuntimeError)


def test_from_settings(tmp_path, adapters):
    from loraplex.settings import Settings

    settings = Settings(home=str(tmp_path / "home"), adapter_root=str(tmp_path), max_loras=3, max_cpu_loras=5,
                        lora_rank_classes=(8, 32))
    m = AdapterManager.from_settings(settings, TINY)
    assert m.sources.policy is not None and m.sources.policy.prefixes == (tmp_path.resolve().as_uri() + "/",)
    assert m.bank.rank_classes == (8, 32) and m.bank.slots_per_class == 3 and m.bank.num_slots == 6
    assert m.max_cpu_loras == 5 and str(m.disk.root) == settings.resolved_adapter_cache_dir()
    assert m.acquire_slots([adapters["a"]]) == [0]
    m.close()


def test_acquired_slots_drive_the_batch(tmp_path, adapters):
    """Slot ids from the manager, per-token slots into LoRABatch: each row gets its own adapter alone."""
    from engine.lora.batch import LoRABatch

    m = manager(tmp_path)
    big = ref_for(make_adapter(tmp_path / "r16", seed=7, rank=16), "r16")
    refs = [adapters["a"], big, adapters["b"]]
    seq_slots = m.acquire_slots(refs)
    assert len({m.bank.split(s)[0] for s in seq_slots}) == 2  # two rank classes in one batch
    token_slots = [seq_slots[0]] * 3 + [-1] * 2 + [seq_slots[1]] * 4 + [seq_slots[2]]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(len(token_slots), 16, generator=g)
    out0 = torch.randn(len(token_slots), 16, generator=g)
    mixed = out0.clone()
    LoRABatch.build(m.bank, token_slots).apply(1, "q_proj", x, mixed)
    for i, s in enumerate(token_slots):
        alone = out0[i:i + 1].clone()
        LoRABatch.build(m.bank, [s]).apply(1, "q_proj", x[i:i + 1], alone)
        torch.testing.assert_close(mixed[i], alone[0], rtol=1e-5, atol=1e-5)
        if s < 0:
            assert torch.equal(mixed[i], out0[i])
    no_k = out0.clone()
    LoRABatch.build(m.bank, token_slots).apply(1, "k_proj", x, no_k)  # no adapter targets k_proj
    assert torch.equal(no_k, out0)
    m.release(refs)
    m.close()
