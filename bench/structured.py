"""Grammar-constrained vs free decoding: a batch of rows, every row constrained, against the
same batch unconstrained (same prompts, same demo adapters, one run, one process).

The demo model (float32) with its shipped adapters (base, french, json, terse, round-robin);
chat prompts asking for a JSON answer; sampled with a seed per row. The constrained run gives
each row one of five JSON schemas (response_format json_schema); the free run the same rows
without. Constrained rows end when their JSON is complete, so each free row is then given
exactly as many tokens as its constrained twin produced (EOS ignored): both runs generate the
same tokens per row and shrink the same way, and tokens/s (generated tokens over wall time)
compares the cost of the grammar alone. Pairs alternate, the best of each kind counts. Also reported:
the time spent filling masks (on the grammar thread, beside the forward) and how many of the
constrained answers validate against their schema.

Prints a table and writes ``bench/results/structured.json``.

    python bench/structured.py [--threads 2] [--batch 32] [--new 48] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

RESULTS = Path(__file__).resolve().parent / "results"
DEMO = Path(__file__).resolve().parent.parent / "demo" / "adapters"
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"answer": {"type": "string"}, "confident": {"type": "boolean"}},
     "required": ["answer", "confident"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
     "required": ["city", "country"], "additionalProperties": False},
    {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
     "required": ["steps"], "additionalProperties": False},
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "neutral", "negative"]},
                                      "score": {"type": "integer"}},
     "required": ["sentiment", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
                                                                            "items": {"type": "string"}}},
     "required": ["name", "tags"], "additionalProperties": False},
]
QUESTIONS = ["How do I reset my password?", "Where is the Eiffel Tower?", "How do I make tea?",
             "Is this product good?", "Describe a cat."]


def run(engine: Any, prompts: list[list[int]], params: list[Any], adapters: list[Any]) -> dict[str, Any]:
    mask0 = engine.mask_s
    t0 = time.perf_counter()
    seqs = [engine.add_request(p, sp, adapter=a) for p, sp, a in zip(prompts, params, adapters, strict=True)]
    steps = 0
    while not all(s.is_finished for s in seqs):
        if engine.step():
            steps += 1
        else:
            time.sleep(0.001)
    wall = time.perf_counter() - t0
    tokens = sum(len(s.output_ids) for s in seqs)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "steps": steps,
            "mask_s": engine.mask_s - mask0, "seqs": seqs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2, help="alternating free/constrained pairs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import jsonschema

    from engine.engine import Engine, EngineConfig
    from engine.fetch_demo import fetch_demo
    from engine.sequence import SamplingParams
    from loraplex.modelinfo import describe_model
    from loraplex.openai_request import spec_key
    from loraplex.settings import Settings
    from loraplex.wire import AdapterRef

    gguf = fetch_demo()
    engine = Engine.from_path(gguf, EngineConfig(kv_cache_bytes=512 << 20, max_num_seqs=max(32, args.batch),
                                                 max_num_batched_tokens=1024))
    settings = Settings(home=str(RESULTS / "structured-home"), max_loras=4,
                        adapter_sources=(DEMO.resolve().as_uri() + "/",))
    engine.info = describe_model(gguf)
    engine.enable_lora(settings)
    refs = [None] + [AdapterRef(id=f"demo-{n}", name=n, uri=(DEMO / n).as_uri()) for n in ("french", "json", "terse")]
    tok = engine.tokenizer
    prompts, adapters, free, constrained, schemas = [], [], [], [], []
    for i in range(args.batch):
        schema = SCHEMAS[i % len(SCHEMAS)]
        q = QUESTIONS[i % len(QUESTIONS)]
        msg = [{"role": "user", "content": f"{q} Answer in JSON with the keys {', '.join(schema['required'])}."}]
        prompts.append(tok.encode_chat(msg))
        adapters.append(refs[i % len(refs)])
        free.append(SamplingParams(max_tokens=args.new, temperature=0.8, seed=i, ignore_eos=True))
        constrained.append(SamplingParams(max_tokens=args.new, temperature=0.8, seed=i,
                                          grammar=spec_key("json_schema", schema)))
        schemas.append(schema)
    print("compiling grammars and warming up ...", flush=True)
    t = time.perf_counter()
    for sp in constrained[:len(SCHEMAS)]:
        engine.grammars.compile(sp.grammar)
    compile_s = time.perf_counter() - t
    run(engine, prompts[:4], free[:4], adapters[:4])  # adapters loaded, kernels warm
    pairs = []
    for _ in range(args.repeats):
        c = run(engine, prompts, constrained, adapters)
        twins = [replace(sp, max_tokens=max(1, len(s.output_ids))) for sp, s in zip(free, c["seqs"], strict=True)]
        f = run(engine, prompts, twins, adapters)
        pairs.append((f, c))
        print(f"  free {f['tok_s']:.1f} tok/s, constrained {c['tok_s']:.1f} tok/s", flush=True)
    last = pairs[-1][1]["seqs"]
    finished = [(s, sch) for s, sch in zip(last, schemas, strict=True) if s.finish_reason == "stop"]
    valid = 0
    for s, sch in finished:
        try:
            jsonschema.validate(json.loads(s.output_text), sch)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    free_tok_s = max(p[0]["tok_s"] for p in pairs)
    cons_tok_s = max(p[1]["tok_s"] for p in pairs)
    mask_share = sum(p[1]["mask_s"] for p in pairs) / sum(p[1]["wall_s"] for p in pairs)
    load = os.getloadavg()
    print(f"\nbatch {args.batch}, {args.new} new tokens max, demo model float32 + 3 demo adapters and base, "
          f"{args.threads} threads, load average {load[0]:.2f}")
    print(f"{'run':>12} | {'tok/s (best)':>12} | {'tokens':>6} | {'steps':>5} | {'mask fill s':>11}")
    for name, key in (("free", 0), ("constrained", 1)):
        best = max((p[key] for p in pairs), key=lambda r: r["tok_s"])
        print(f"{name:>12} | {best['tok_s']:>12.1f} | {best['tokens']:>6} | {best['steps']:>5} | {best['mask_s']:>11.3f}")
    ratio = cons_tok_s / free_tok_s
    print(f"constrained / free: {ratio:.2f} (target >= 0.80); mask filling {100 * mask_share:.1f}% of the "
          f"constrained wall time; {len(finished)}/{args.batch} constrained rows finished within "
          f"{args.new} tokens, {valid}/{len(finished)} of those validate; grammar compile "
          f"{1000 * compile_s / len(SCHEMAS):.0f} ms per schema")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"batch": args.batch, "new": args.new, "threads": args.threads, "load_avg": load,
           "machine": platform.machine(), "free_tok_s": free_tok_s, "constrained_tok_s": cons_tok_s,
           "ratio": ratio, "mask_share": mask_share, "finished": len(finished), "valid": valid,
           "compile_ms_per_schema": 1000 * compile_s / len(SCHEMAS),
           "runs": [{k: v for k, v in r.items() if k != "seqs"} for p in pairs for r in p]}
    (RESULTS / "structured.json").write_text(json.dumps(out, indent=2))
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
