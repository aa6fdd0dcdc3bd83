"""Adapter supply chain: cold-load time by stage, and the disk tier's hit ratio under a Zipf stream.

Scenario 1: synthetic PEFT adapters at rank 8, 16 and 64 for the demo model's shapes (SmolLM2-135M:
30 layers; q_proj and v_proj, PEFT's default targets, or all seven projections with
``--all-modules``) are stored content-addressed in an S3-compatible store; each cold load runs the
worker's own code, timed by stage:

* store fetch: ``StoreSource.fetch`` (GET of both files through obstore, written to a download dir);
* sha256: read the files back and check the version digest (``read_verified``);
* parse: ``adapter_config.json`` and the safetensors bytes into tensors;
* host copy: pairing, checks and the copy into the host tier's contiguous tensors (pinned on CUDA);
* slot fill: the copy into a device slot of the rank class (``SlotBank.write``), once the class's
  slot stacks exist (one untimed load per rank allocates them first).

Scenario 2: a stream of requests whose adapters follow Zipf(``--zipf-s``) over ``--adapters``
small adapters, through the disk tier (``DiskCache``, byte budget of ``--disk-slots`` adapters,
LRU) filled from the store: the hit ratio, against the ideal of a cache holding the
``--disk-slots`` most popular adapters.

By default the store is moto's S3 API server started on loopback (the test extra); ``--store
s3://bucket/prefix`` uses a real one with the standard ``AWS_*`` environment. Sizes are kept small
by default (a Python S3 server is the bottleneck long before a real store is).

Prints tables and writes ``bench/results/adapter_fetch.json``.

    python bench/adapter_fetch.py [--quick] [--repeat 5] [--store s3://bucket/prefix] [--all-modules]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
from safetensors.torch import save

from engine.lora.peft import build_weights, parse_config_bytes, parse_tensors
from engine.lora.slots import SlotBank
from engine.lora.sources import DiskCache, StoreSource, read_verified
from loraplex.adapter_store import ObjectStore, version_prefix
from loraplex.digest import digest_contents
from loraplex.modelinfo import PROJECTIONS, ModelInfo
from loraplex.peft_config import CONFIG_FILE, WEIGHTS_FILE
from loraplex.wire import AdapterRef

RESULTS = Path(__file__).resolve().parent / "results"
DEMO_SHAPES = ModelInfo(name="SmolLM2-135M-Instruct", revision="bench", architecture="llama", hidden_size=576,
                        intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                        vocab_size=49152, context_length=2048)
STAGES = ("store fetch", "sha256", "parse", "host copy", "slot fill")


def adapter_files(info: ModelInfo, rank: int, targets: tuple[str, ...], seed: int) -> dict[str, bytes]:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(info.num_layers):
        for proj in targets:
            group = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            fan_in, fan_out = info.projection_shape(proj)
            key = f"base_model.model.model.layers.{layer}.{group}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
           "base_model_name_or_path": info.name}
    return {CONFIG_FILE: json.dumps(cfg).encode(), WEIGHTS_FILE: save(tensors)}


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    import httpx

    while True:
        try:
            httpx.get(url + "/", timeout=2.0)
            return proc, url
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"moto_server did not start on {url} (pip install 'moto[server]')") from None
            time.sleep(0.2)


def put(store: ObjectStore, files: dict[str, bytes]) -> AdapterRef:
    digest = digest_contents(files)
    prefix = version_prefix(digest)

    async def run() -> None:
        for name, data in files.items():
            await store.put(prefix + name, data)

    asyncio.run(run())
    return AdapterRef(id=f"v-{digest[:16]}", name=f"bench-{digest[:8]}", uri=store.uri_for(prefix), sha256=digest)


def cold_load(ref: AdapterRef, source: StoreSource, bank: SlotBank, info: ModelInfo, slot: int,
              device: torch.device) -> dict[str, float]:
    t: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        source.fetch(ref, Path(tmp))
        t1 = time.perf_counter()
        contents = read_verified(ref, Path(tmp))
        t2 = time.perf_counter()
    config = parse_config_bytes(contents[CONFIG_FILE])
    tensors = parse_tensors(contents[WEIGHTS_FILE])
    t3 = time.perf_counter()
    weights = build_weights(config, tensors, info, dtype=bank.dtype, projections=bank.projections)
    if device.type == "cuda":
        weights = weights.pin_memory()
    t4 = time.perf_counter()
    bank.write(slot, weights)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t5 = time.perf_counter()
    for stage, a, b in zip(STAGES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5), strict=True):
        t[stage] = (b - a) * 1000
    t["bytes"] = sum(len(v) for v in contents.values())
    return t


def zipf_stream(n: int, s: float, length: int, seed: int) -> tuple[list[int], list[float]]:
    weights = [1 / (k + 1) ** s for k in range(n)]
    total = sum(weights)
    probs = [w / total for w in weights]
    rng = random.Random(seed)
    return rng.choices(range(n), weights=probs, k=length), probs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and a shorter stream")
    ap.add_argument("--repeat", type=int, default=5, help="cold loads per rank (the median is reported)")
    ap.add_argument("--ranks", default="8,16,64")
    ap.add_argument("--all-modules", action="store_true", help="adapt all seven projections (default q, v)")
    ap.add_argument("--store", default="", help="s3://bucket/prefix of a real store (default: moto on loopback)")
    ap.add_argument("--adapters", type=int, default=24, help="adapters in the Zipf stream")
    ap.add_argument("--disk-slots", type=int, default=6, help="disk tier budget, in adapters")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--zipf-s", type=float, default=1.1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.quick:
        args.repeat, args.requests = min(args.repeat, 2), min(args.requests, 150)
    device = torch.device(args.device)
    targets = PROJECTIONS if args.all_modules else ("q_proj", "v_proj")
    ranks = [int(r) for r in args.ranks.split(",")]

    moto = None
    try:
        if args.store:
            url = args.store
        else:
            moto, endpoint = start_moto()
            os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
                               "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
                               "AWS_ALLOW_HTTP": "true"})
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            import httpx

            httpx.put(f"{endpoint}/{bucket}", timeout=10.0).raise_for_status()
            url = f"s3://{bucket}/adapters"
        store = ObjectStore(url, timeout_s=60, retries=2)
        source = StoreSource(store)
        print(f"store {url} ({'moto on loopback' if moto else 'given'}), device {device}, "
              f"targets {','.join(targets)}, {args.repeat} cold loads per rank (median)\n")

        # --- scenario 1: cold load by stage --------------------------------------------------
        bank = SlotBank.for_model(DEMO_SHAPES, tuple(ranks), slots_per_class=1, device=device)
        rows = []
        for rank in ranks:
            runs = []
            # untimed first load: allocates the rank class's slot stacks and opens the connection
            warm = put(store, adapter_files(DEMO_SHAPES, rank, targets, seed=rank * 1000 - 1))
            cold_load(warm, source, bank, DEMO_SHAPES, bank.slot_ids(bank.class_of_rank(rank))[0], device)
            for i in range(args.repeat):
                ref = put(store, adapter_files(DEMO_SHAPES, rank, targets, seed=rank * 1000 + i))
                slot = bank.slot_ids(bank.class_of_rank(rank))[0]
                runs.append(cold_load(ref, source, bank, DEMO_SHAPES, slot, device))
            med = {k: statistics.median(r[k] for r in runs) for k in (*STAGES, "bytes")}
            med["total"] = sum(med[s] for s in STAGES)
            rows.append({"rank": rank, **med})
        print("cold load by stage (ms, median)")
        print(f"{'rank':>5} {'MiB':>7} " + " ".join(f"{s:>12}" for s in STAGES) + f" {'total':>9}")
        for r in rows:
            print(f"{r['rank']:>5} {r['bytes'] / 2**20:>7.2f} " + " ".join(f"{r[s]:>12.1f}" for s in STAGES)
                  + f" {r['total']:>9.1f}")

        # --- scenario 2: disk tier under a Zipf stream ----------------------------------------
        refs = [put(store, adapter_files(DEMO_SHAPES, 4, ("q_proj",), seed=50_000 + k)) for k in range(args.adapters)]
        entry = len(adapter_files(DEMO_SHAPES, 4, ("q_proj",), seed=50_000)[WEIGHTS_FILE]) + 200
        stream, probs = zipf_stream(args.adapters, args.zipf_s, args.requests, seed=7)
        cache_dir = Path(tempfile.mkdtemp(prefix="adapter-fetch-"))
        try:
            cache = DiskCache(cache_dir, max_bytes=entry * args.disk_slots)
            hits = fetches = 0
            t0 = time.perf_counter()
            for k in stream:
                if cache.get(refs[k]) is not None:
                    hits += 1
                else:
                    cache.fill(refs[k], source)
                    fetches += 1
            seconds = time.perf_counter() - t0
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
        ideal = sum(sorted(probs, reverse=True)[:args.disk_slots])
        zipf = {"adapters": args.adapters, "disk_slots": args.disk_slots, "requests": args.requests,
                "zipf_s": args.zipf_s, "hit_ratio": hits / len(stream), "ideal_top_k": ideal,
                "fetches": fetches, "seconds": seconds}
        print(f"\ndisk tier, Zipf({args.zipf_s}) over {args.adapters} adapters, budget {args.disk_slots} adapters, "
              f"{args.requests} requests")
        print(f"  hit ratio {zipf['hit_ratio']:.3f} (ideal fixed top-{args.disk_slots}: {ideal:.3f}); "
              f"{fetches} store fetches in {seconds:.1f} s")
    finally:
        if moto is not None:
            moto.terminate()
            try:
                moto.wait(timeout=10)
            except subprocess.TimeoutExpired:
                moto.kill()

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"machine": platform.platform(), "cpus": os.cpu_count(), "device": str(device), "store": url,
           "targets": list(targets), "repeat": args.repeat, "cold_load_ms": rows, "zipf": zipf}
    (RESULTS / "adapter_fetch.json").write_text(json.dumps(out, indent=2))
    print(f"\nwrote {RESULTS / 'adapter_fetch.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
