"""This CPU's instruction sets, as far as the engine may use them.

The native kernels (``engine.native``) are compiled for ``-march=native`` unless
``LORAPLEX_NATIVE_MARCH`` names another target. An older one (``x86-64-v3``: AVX2 and FMA,
what Zen 3 and Haswell-to-Alder-Lake CPUs run; ``x86-64``: plain SSE2) compiles the kernels
without the newer instructions, and ``cpu_flags()`` drops the AVX and AMX flags that build
lacks, so every choice the engine makes from them (weight formats, the fused SwiGLU, the
bfloat16 table) is the one such a CPU gets. The tests run the AVX2 build on AVX-512 machines
this way, benchmarks measure it, and a fleet of mixed CPUs can pin the oldest one's build.
torch's own kernels are not narrowed by it (``ONEDNN_MAX_CPU_ISA`` and ``ATEN_CPU_CAPABILITY``
are torch's knobs for that).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

MARCH_ENV = "LORAPLEX_NATIVE_MARCH"


def march() -> str:
    """The ``-march`` the native kernels are built for: ``native`` unless ``$LORAPLEX_NATIVE_MARCH``."""
    return os.environ.get(MARCH_ENV, "").strip() or "native"


def c_compiler() -> str | None:
    """The C compiler the native kernels build with: ``$CC``, else ``cc``, else ``gcc``."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@lru_cache(maxsize=1)
def _proc_flags() -> frozenset[str]:
    try:
        line = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


@lru_cache(maxsize=8)
def march_macros(target: str) -> frozenset[str]:
    """The macros the C compiler predefines for ``-march=target`` (``__AVX2__``, ``__AVX512F__``, ...)."""
    cc = c_compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    proc = subprocess.run([cc, f"-march={target}", "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                          text=True, timeout=60)
    if proc.returncode != 0:
        first = (proc.stderr.strip().splitlines() or ["no output"])[0]
        raise ValueError(f"{MARCH_ENV}={target}: {cc} refuses it ({first})")
    return frozenset(ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("#define "))


def _isa_macro(flag: str) -> str | None:
    """The compiler's macro for a /proc/cpuinfo instruction-set flag (``avx512_vnni`` -> ``__AVX512VNNI__``,
    ``amx_bf16`` -> ``__AMX_BF16__``); None for flags that are not AVX, AMX or FMA."""
    if flag.startswith("amx"):
        return f"__{flag.upper()}__"
    if flag.startswith("avx") or flag == "fma":
        return "__" + flag.upper().replace("_", "") + "__"
    return None


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where unreadable), less the AVX, AMX and FMA
    flags that ``-march=$LORAPLEX_NATIVE_MARCH`` does not enable."""
    flags = _proc_flags()
    if march() == "native":
        return flags
    macros = march_macros(march())
    return frozenset(f for f in flags if (m := _isa_macro(f)) is None or m in macros)


def cpu_has_bf16_matmul() -> bool:
    """This CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_has_vnni() -> bool:
    """This CPU has AVX512-VNNI (the 8-bit kernel's fast path; others run its portable build)."""
    return "avx512_vnni" in cpu_flags()


def cpu_has_avx2() -> bool:
    """This CPU has AVX2 and FMA: the 4-bit kernel's AVX2 build outruns float32 there (its integer
    multiply takes 32 products an instruction against FMA's 8; the 8-bit kernel needs two)."""
    return {"avx2", "fma"} <= cpu_flags()


def default_weights() -> tuple[str, str]:
    """What ``weights=auto`` serves the base model's projections in on this CPU (float32
    activations), and why: bfloat16 where the CPU multiplies it natively (as vLLM-CPU defaults to
    bfloat16 there), else float32, as vLLM-CPU falls back to float32 on such CPUs.

    The narrower formats are faster where bfloat16 is not native (int4 1.35x float32 on a Zen 3
    with AVX2, int8 on AVX512-VNNI) but less faithful: on a Zen 3, against transformers + PEFT
    float32, int4 kept 21 of 36 greedy rows and int8 17 where float32 (and vLLM-CPU's default
    there) kept 36 (``tests/test_fidelity.py``, which holds the default to vLLM's default within
    3 rows). They stay one setting away (``--weights int8`` / ``int4``)."""
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "bfloat16", "AMX multiplies bfloat16 natively"
    if "avx512_bf16" in flags:
        # Zen 4 measured int8 1.1-1.4x bfloat16's tokens/s, at 7x bfloat16's KL divergence from float32
        # its sums as vdpbf16ps sums them, on FMAs where the core runs those faster (native.TileMatmul)
        return "bfloat16", "AVX512-BF16: bfloat16 weights, half float32's memory, summed as vdpbf16ps sums them"
    return "float32", ("no native bfloat16 on this CPU: the exact float32 path (--weights int8 or int4 is "
                       "faster and less faithful)")


BURST_TOKENS_AMX = 4096


def default_burst_tokens() -> int:
    """A CPU step's token budget while a burst of prompts waits, by default: wider (fewer, larger
    prefill matmuls) only with AMX, whose tile kernel ran ~1.3x faster per token on large blocks;
    elsewhere 0 (no wider). On a Zen 4 in bfloat16 a 3,200-token burst step took 1.8 s: every
    request of the burst waited for all of it (TTFT p50 1.92 s), where 512-token steps gave
    0.32 s and 6% more tokens/s."""
    return BURST_TOKENS_AMX if "amx_bf16" in cpu_flags() else 0
