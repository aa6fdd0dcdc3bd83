"""Triton LoRA kernels (SGMV, BGMV) equal the torch op.

On a CUDA machine the kernels run on the GPU in this process. Without one they run in
Triton's interpreter on CPU tensors; the interpreter must be chosen before Triton is first
imported (and transformers imports it), so those cases run in one child process with
``TRITON_INTERPRET=1`` (this file as a script) and each test checks its case's outcome.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

CASES = [
    # tokens, slots, rank, in, out, layout, kernel
    *[(*c, k) for c in [
        (1, 1, 8, 40, 24, "random"),
        (5, 3, 16, 64, 96, "random"),
        (37, 4, 8, 72, 40, "contiguous"),
        (50, 6, 64, 48, 130, "random"),
        (33, 2, 12, 33, 17, "contiguous"),
        (6, 3, 16, 32, 32, "none"),
    ] for k in ("sgmv", "bgmv")],
]


def case_id(case: tuple) -> str:
    return "-".join(str(v) for v in case)


def run_case(tokens: int, num_slots: int, rank: int, fin: int, fout: int, layout: str, kernel: str,
             device: str) -> None:
    from engine.lora import triton_ops
    from engine.lora.ops import lora_apply, lora_reference
    from engine.lora.plan import SegmentPlan

    g = torch.Generator().manual_seed(tokens + rank)
    a = torch.randn(num_slots, rank, fin, generator=g)
    b = torch.randn(num_slots, fout, rank, generator=g)
    scale = torch.rand(num_slots, generator=g) + 0.5
    slots = torch.randint(-1, num_slots, (tokens,), generator=g)
    if layout == "contiguous":
        slots = torch.sort(slots).values
    elif layout == "none":
        slots = torch.full((tokens,), -1)
    x = torch.randn(tokens, fin, generator=g)
    y0 = torch.randn(tokens, fout, generator=g)
    expect = y0.clone()
    lora_reference(expect, x, a, b, scale, slots)
    torch_out = y0.clone()
    lora_apply(torch_out, x, a, b, scale, SegmentPlan.build(slots), path="segmented")
    torch.testing.assert_close(torch_out, expect, rtol=1e-5, atol=1e-4)
    y = y0.to(device)
    dev = [t.to(device) for t in (x, a, b, scale)]
    triton_ops.lora_triton(y, *dev, SegmentPlan.build(slots.to(device)), kernel=kernel)
    torch.testing.assert_close(y.cpu(), torch_out, rtol=1e-5, atol=1e-4)
    base = slots < 0
    assert torch.equal(y.cpu()[base], y0[base]), "base rows must be untouched"


def _probe(device: str) -> None:
    """A trivial kernel: can Triton run here at all?"""
    import triton
    import triton.language as tl

    @triton.jit
    def double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

    x = torch.arange(4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    double[(1,)](x, y, 4, BLOCK=8)
    assert y.cpu().tolist() == [0.0, 2.0, 4.0, 6.0]


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str] | None:
    """Outcomes of every case in Triton's interpreter (None on CUDA: run in process)."""
    pytest.importorskip("triton", reason="triton is not installed")
    if torch.cuda.is_available():
        return None
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise AssertionError(f"interpreter run printed no result (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1])
    if "skip" in out:
        pytest.skip(f"Triton's interpreter cannot run here: {out['skip']}")
    return out


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_matches_torch(case, interpreted):
    if interpreted is None:
        run_case(*case, device="cuda")
    else:
        assert interpreted[case_id(case)] == "ok", interpreted[case_id(case)]


def test_kernel_choice():
    from engine.lora import triton_ops
    from engine.lora.plan import SegmentPlan

    assert triton_ops.choose_kernel(SegmentPlan.build(torch.arange(8))) == "bgmv"
    assert triton_ops.choose_kernel(SegmentPlan.build(torch.zeros(64, dtype=torch.int64))) == "sgmv"


if __name__ == "__main__":
    try:
        _probe("cpu")
    except Exception as exc:
        print(json.dumps({"skip": f"{type(exc).__name__}: {exc}"}))
        sys.exit(0)
    results = {}
    for c in CASES:
        try:
            run_case(*c, device="cpu")
            results[case_id(c)] = "ok"
        except Exception:
            results[case_id(c)] = traceback.format_exc()[-2000:]
    print(json.dumps(results))
