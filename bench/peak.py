"""``bench/peak.c`` built as the native kernels are (their compiler and flags) and loaded.

``peak_kernel()(kind, iters, threads)`` returns GFLOP/s of ``kind``'s multiply instruction looped
on registers alone on ``threads`` threads (``peak.c`` lists the kinds), or -1 where this build has
no such instruction. ``block_matmul.py`` reports each format's peak with it;
``serve_vs_vllm.py`` probes the cores' speed around each server with its float32 kind.
"""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from engine.cpu import c_compiler
from engine.native import cflags

FLOAT32, BFLOAT16, INT8 = 0, 1, 2
"""``peak.c``'s kinds: float32 FMA, AVX512-BF16 pair dot product, AVX512-VNNI 8-bit dot product."""


@lru_cache(maxsize=1)
def peak_kernel() -> Callable[[int, int, int], float] | None:
    """The loaded probe, or None without a C compiler."""
    cc = c_compiler()
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:  # the loaded library outlives its file
        so = Path(tmp) / "peak.so"
        subprocess.run([cc, *cflags(), str(Path(__file__).with_name("peak.c")), "-o", str(so)], check=True,
                       capture_output=True, timeout=120)
        fn = ctypes.CDLL(str(so)).loraplex_bench_peak
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_long, ctypes.c_int]
    return fn
