"""Per-row grammar mask cost on CPU: xgrammar (the engine's) vs llguidance, demo tokenizer.

One JSON schema, one answer that follows it: each library's matcher fills the next-token
bitmask before every token of the answer (its own separators: compact for llguidance,
xgrammar's default for xgrammar), and the time of each fill is recorded. llguidance is not
a dependency: ``pip install llguidance`` to include it (skipped when missing).

Prints a table and writes ``bench/results/grammar_mask.json``.

    python bench/grammar_mask.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).resolve().parent / "results"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confident": {"type": "boolean"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["answer", "confident", "tags"], "additionalProperties": False}
ANSWER = {"answer": "The Eiffel Tower is in Paris, France", "confident": True, "tags": ["travel", "paris"]}


def xgrammar_fills(repeats: int) -> list[float]:
    import xgrammar as xgr

    from engine.fetch_demo import fetch_demo
    from engine.grammar import Grammars
    from loraplex.openai_request import spec_key
    from loraplex.tokenizer import TextTokenizer

    tok = TextTokenizer.from_model_path(fetch_demo())
    grammars = Grammars(tok, tok.vocab_size, [tok.eos_token_id])
    key = spec_key("json_schema", SCHEMA)
    ids = tok.encode(json.dumps(ANSWER, separators=(", ", ": ")), add_special_tokens=False)
    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    out = []
    for _ in range(repeats):
        m = grammars.matcher(key)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, 0)
            out.append(time.perf_counter() - t0)
            assert m.accept_token(t)
    return out


def llguidance_fills(repeats: int) -> list[float] | None:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lgt
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    from engine.fetch_demo import fetch_demo
    from loraplex.tokenizer import TextTokenizer

    tok = TextTokenizer.from_model_path(fetch_demo())
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.tk, eos_token=tok.eos_token)
    lt = llguidance.hf.from_tokenizer(hf)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                            defaults={"whitespace_flexible": False})
    ids = tok.encode(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False)
    bitmask = lgt.allocate_token_bitmask(1, lt.vocab_size)
    out = []
    for _ in range(repeats):
        m = llguidance.LLMatcher(lt, grammar)
        for t in ids:
            t0 = time.perf_counter()
            lgt.fill_next_token_bitmask(m, bitmask, 0)
            out.append(time.perf_counter() - t0)
            assert m.consume_token(t), m.get_error()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = {"xgrammar": xgrammar_fills(args.repeats), "llguidance": llguidance_fills(args.repeats)}
    load = os.getloadavg()
    print(f"mask fill per row and token, demo tokenizer, {args.repeats} passes over one answer, "
          f"load average {load[0]:.2f}")
    print(f"{'library':>10} | {'fills':>5} | {'median us':>9} | {'p90 us':>7} | {'mean us':>7}")
    out = {"load_avg": load}
    for name, v in rows.items():
        if v is None:
            print(f"{name:>10} | not installed")
            continue
        v = sorted(v)
        stats = {"fills": len(v), "median_us": 1e6 * statistics.median(v), "p90_us": 1e6 * v[int(0.9 * len(v))],
                 "mean_us": 1e6 * statistics.mean(v)}
        out[name] = stats
        print(f"{name:>10} | {stats['fills']:>5} | {stats['median_us']:>9.1f} | {stats['p90_us']:>7.1f} | "
              f"{stats['mean_us']:>7.1f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "grammar_mask.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
