"""Native CPU kernels (C, built on first use with the system compiler, loaded with ctypes).

``engine/csrc/*.c`` is compiled once per machine (with ``$CC``, else ``cc``/``gcc``) into a cache directory
(``$XDG_CACHE_HOME/loraplex/kernels``, else ``~/.cache/loraplex/kernels``), keyed by a hash of the source, the compiler flags and
this CPU's feature flags (the code is built for ``-march=native``, or ``$LORAPLEX_NATIVE_MARCH``: see
``engine.cpu``). No compiler, a
failed build or a non-Linux platform: ``decode_attention_kernel()``, ``gemv_kernel()``,
``fused_ops()``, ``q8_matmul_kernel()``, ``q4_matmul_kernel()`` (and ``engine.native_lora``'s
``lora_rows_kernel()``, ``engine.native_decoder``'s ``decoder_layers_kernel()``) return ``None``
and the engine keeps its pure-torch paths, with one warning in the log. This module builds and
loads the library and wraps its single kernels; the multi-LoRA kernels are
``engine.native_lora``, the one-call decoder ``engine.native_decoder``.

The library is built with ``-fopenmp`` and links ``libgomp.so.1``: inside a process that
imported torch this is the same OpenMP runtime PyTorch uses, so the kernels share its
thread pool instead of competing with it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

from engine.cpu import c_compiler, cpu_flags, cpu_has_vnni, march
from engine.kv_cache import KVCache
from engine.quant import PackedQ4, PackedQ8

log = logging.getLogger("loraplex.engine.native")

CSRC = Path(__file__).with_name("csrc")
# -ffp-contract=fast: fuse a*b+c into FMA instructions (ISO C mode turns that off); every
# kernel here is multiply-add loops, and the fused form is faster and no less accurate.
# -fno-trapping-math: lets GCC if-convert the clamps in exp/silu, so those loops vectorize on
# AVX2 too (without AVX-512's masks they stayed scalar); nothing here reads FP exception flags.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c11"]
# The C types of the kernels' arguments; engine.native_lora's and engine.native_decoder's structures too.
I64, INT, PTR, F32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "loraplex_decode_attention_f32": [PTR, I64, I64, PTR, PTR, PTR, I64, PTR, I64, PTR, PTR, I64,
                                      INT, INT, INT, INT, INT, INT, INT, INT],
    "loraplex_decode_attention_bf16kv": [PTR, I64, I64, PTR, PTR, PTR, I64, PTR, I64, PTR, PTR, I64,
                                         INT, INT, INT, INT, INT, INT, INT, INT, INT],
    "loraplex_lora_rows_f32": [PTR, I64, PTR, I64, INT, PTR, PTR, PTR, PTR, PTR, INT, PTR, PTR, INT,
                               INT, INT, INT, INT],
    "loraplex_gemv_f32": [PTR, PTR, PTR, PTR, INT, INT, INT],
    "loraplex_gemv_bf16": [PTR, PTR, PTR, PTR, INT, INT, INT],
    "loraplex_add_rms_norm_f32": [PTR, I64, PTR, I64, INT, PTR, I64, INT, PTR, F32, INT, INT, INT],
    "loraplex_silu_mul_f32": [PTR, I64, INT, PTR, I64, INT, INT, INT, INT],
    "loraplex_rope_store_f32": [PTR, I64, INT, PTR, PTR, PTR, I64, I64, PTR, PTR, I64, PTR, PTR, INT, I64,
                                PTR, INT, INT, INT, INT, INT],
    "loraplex_q8_matmul_f32": [PTR, I64, INT, INT, PTR, PTR, PTR, INT, PTR, PTR, I64, INT],
    "loraplex_q8_swiglu_f32": [PTR, I64, INT, INT, PTR, PTR, PTR, INT, PTR, I64, INT],
    "loraplex_q4_matmul_f32": [PTR, I64, INT, INT, PTR, PTR, PTR, INT, PTR, PTR, I64, INT],
    "loraplex_f32_panel_available": [],
    "loraplex_f32_panel_pack": [PTR, INT, INT, PTR],
    "loraplex_f32_panel_matmul": [PTR, I64, INT, INT, PTR, INT, PTR, PTR, I64, INT],
    "loraplex_tile_matmul_init": [],
    "loraplex_tile_matmul_fma": [INT],
    "loraplex_tile_matmul_bf16": [PTR, I64, INT, INT, PTR, INT, PTR, PTR, I64, INT, INT, INT],
    "loraplex_scan_rows_f32": [PTR, I64, INT, INT, PTR, PTR, INT],
    "loraplex_lora_rows_blocked": [],
    "loraplex_decoder_layers": [PTR, INT, PTR, INT],
}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "loraplex" / "kernels"


def cflags() -> list[str]:
    """``CFLAGS`` with ``-march=native`` replaced by ``$LORAPLEX_NATIVE_MARCH`` where that is set."""
    return [f"-march={march()}" if f == "-march=native" else f for f in CFLAGS]


def _build(name: str) -> Path:
    src = CSRC / f"{name}.c"
    cc = c_compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    flags = cflags()
    key = hashlib.sha256(src.read_bytes() + " ".join([cc, *flags]).encode()
                         + " ".join(sorted(cpu_flags()) or [platform.processor()]).encode())
    out = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling native kernel %s -> %s", src.name, out)
    # Build to a private name and rename: concurrent workers never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, str(src), "-o", tmp], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    try:
        lib = ctypes.CDLL(str(_build("cpu_kernels")))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native CPU kernels unavailable, using the torch path: %s", e)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = INT
        fn.argtypes = argtypes
    return lib


class DecodeAttention:
    """``out[rows[b]] = softmax(q[rows[b]] . K_b) V_b`` for every decoding sequence ``b``,
    K/V read from the paged pools in place (see ``engine/csrc/cpu_kernels.c``). ``q`` is
    float32; the pools float32 or bfloat16 (widened on load, the math in float32); ``out``
    float32, or bfloat16 (the float32 result rounded: a bfloat16 matmul's input).

    ``amx``: over bfloat16 pools with head dim 64, at most 4 query heads per kv head and blocks of a
    multiple of 16 tokens, the scores come from AMX tiles, each query split into three bfloat16
    parts so that they equal the vector path's to float32 rounding. On 2 cores of a Sapphire Rapids,
    32 rows of 144 tokens over 30 layers of scattered blocks: 12.1-12.5 -> 10.0-10.6 ms (and the
    kernel's compute with the blocks in cache 6.0 -> 4.1 ms); at 1000 tokens 84 -> 68 ms."""

    def __init__(self, lib: ctypes.CDLL, amx: bool = False) -> None:
        self._fns = {torch.float32: lib.loraplex_decode_attention_f32,
                     torch.bfloat16: lib.loraplex_decode_attention_bf16kv}
        self.amx = amx

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor,
                 lens: torch.Tensor, max_len: int, block_size: int, out: torch.Tensor,
                 rows: torch.Tensor | None = None) -> None:
        """``q``: ``[T, H, d]`` (head dim contiguous); ``k_pool``/``v_pool``: ``[Hk, slots, d]``
        contiguous, float32 or bfloat16 (both the same); ``blocks``: ``[B, nb]`` int64 contiguous; ``lens``: ``[B]`` int64;
        ``out``: ``[T, H*d]`` (row dim may be strided); ``rows``: ``[B]`` int64 or None (0..B-1)."""
        _, h, d = q.shape
        hk = k_pool.shape[0]
        assert q.dtype == torch.float32 and q.stride(2) == 1 and out.stride(1) == 1
        assert out.dtype in (torch.float32, torch.bfloat16)
        assert k_pool.is_contiguous() and v_pool.is_contiguous() and blocks.is_contiguous()
        assert k_pool.dtype == v_pool.dtype and k_pool.dtype in self._fns, f"KV pools in {k_pool.dtype}"
        assert blocks.dtype == torch.int64 and lens.dtype == torch.int64 and lens.is_contiguous()
        b, nb = blocks.shape
        extra = (self.amx,) if k_pool.dtype == torch.bfloat16 else ()
        rc = self._fns[k_pool.dtype](q.data_ptr(), q.stride(0), q.stride(1), rows.data_ptr() if rows is not None else None,
                      k_pool.data_ptr(), v_pool.data_ptr(), k_pool.shape[1],
                      blocks.data_ptr(), nb, lens.data_ptr(), out.data_ptr(), out.stride(0),
                      out.dtype == torch.bfloat16, b, h, hk, d, block_size, max_len, torch.get_num_threads(), *extra)
        if rc != 0:
            raise RuntimeError(f"native decode attention failed ({rc}): heads {h}/{hk}, head dim {d}")


@lru_cache(maxsize=1)
def decode_attention_kernel() -> DecodeAttention | None:
    """The native decode attention; its scores on AMX tiles where the CPU has them (and grants them)."""
    lib = library()
    if lib is None:
        return None
    tiles = tile_matmul_kernel()
    return DecodeAttention(lib, amx=tiles is not None and tiles.isa == "amx")


class Gemv:
    """``x @ weight.T + bias`` for a single float32 row ``x [1, in]``, ``weight`` float32 or
    bfloat16 (then ``x`` is rounded to bfloat16, sums stay float32); ``y`` and ``bias`` float32
    (see ``engine/csrc/cpu_kernels.c``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.float32: lib.loraplex_gemv_f32, torch.bfloat16: lib.loraplex_gemv_bf16}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n_out, n_in = weight.shape
        assert x.shape == (1, n_in) and x.dtype == torch.float32 and weight.is_contiguous()
        assert bias is None or (bias.is_contiguous() and bias.shape == (n_out,) and bias.dtype == torch.float32)
        x = x.contiguous()
        y = x.new_empty((1, n_out))
        rc = self._fns[weight.dtype](x.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None,
                                     y.data_ptr(), n_out, n_in, torch.get_num_threads())
        if rc != 0:
            raise MemoryError("native gemv: no memory for its input row")
        return y


@lru_cache(maxsize=1)
def gemv_kernel() -> Gemv | None:
    lib = library()
    return Gemv(lib) if lib is not None else None


class PanelMatmul:
    """``x @ weight.T + bias`` in float32, the weight packed once into panels of 16 output
    columns (:meth:`pack`); built for AVX2 CPUs without AVX-512, where it runs a 32-row decode
    step's matmuls 1.1-1.6x faster than oneDNN's prepacked linear and prefill's 300-3200 rows
    1.05-1.2x (see ``engine/csrc/cpu_kernels.c``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._pack = lib.loraplex_f32_panel_pack
        self._matmul = lib.loraplex_f32_panel_matmul

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        n, k = weight.shape
        assert weight.dtype == torch.float32 and weight.is_contiguous() and weight.device.type == "cpu"
        out = weight.new_empty(((n + 15) // 16, k, 16))
        self._pack(weight.data_ptr(), n, k, out.data_ptr())
        return out

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        m, k = x.shape
        assert x.dtype == torch.float32 and panels.shape[1] == k and x.stride(1) == 1
        assert bias is None or (bias.is_contiguous() and bias.shape == (n,) and bias.dtype == torch.float32)
        y = x.new_empty((m, n))
        self._matmul(x.data_ptr(), x.stride(0), m, k, panels.data_ptr(), n,
                     bias.data_ptr() if bias is not None else None, y.data_ptr(), n, torch.get_num_threads())
        return y


@lru_cache(maxsize=1)
def panel_matmul_kernel() -> PanelMatmul | None:
    """The float32 panel kernel where this build has it (AVX2 + FMA, no AVX-512), else None."""
    lib = library()
    return PanelMatmul(lib) if lib is not None and lib.loraplex_f32_panel_available() else None


class FusedOps:
    """Fused elementwise steps of a decoder layer (CPU, float32 math); same contract as
    ``engine.fused.TorchOps``, bfloat16 ``delta``/``gate_up`` and ``out_dtype`` included."""

    _NARROW = (torch.float32, torch.bfloat16)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._norm = lib.loraplex_add_rms_norm_f32
        self._silu_mul = lib.loraplex_silu_mul_f32
        self._rope_store = lib.loraplex_rope_store_f32

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        t, dim = h.shape
        assert h.stride(1) == 1 and weight.is_contiguous() and h.dtype == weight.dtype == torch.float32
        if delta is not None:
            assert delta.shape == h.shape and delta.stride(1) == 1 and delta.dtype in self._NARROW
        out = torch.empty((t, dim), dtype=out_dtype or h.dtype)
        assert out.dtype in self._NARROW
        self._norm(h.data_ptr(), h.stride(0), delta.data_ptr() if delta is not None else None,
                   delta.stride(0) if delta is not None else 0,
                   delta is not None and delta.dtype == torch.bfloat16, out.data_ptr(), out.stride(0),
                   out.dtype == torch.bfloat16, weight.data_ptr(), eps, t, dim, torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor, inter: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        t = gate_up.shape[0]
        assert gate_up.stride(1) == 1 and gate_up.shape[1] == 2 * inter and gate_up.dtype in self._NARROW
        out = torch.empty((t, inter), dtype=out_dtype or gate_up.dtype)
        assert out.dtype in self._NARROW
        self._silu_mul(gate_up.data_ptr(), gate_up.stride(0), gate_up.dtype == torch.bfloat16, out.data_ptr(),
                       out.stride(0), out.dtype == torch.bfloat16, t, inter, torch.get_num_threads())
        return out

    def rope_store(self, qkv: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                   cache: KVCache, layer: int, slots: torch.Tensor, heads: int,
                   head_scale: torch.Tensor | None = None) -> torch.Tensor:
        t, width = qkv.shape
        kv_heads, d = cache.num_kv_heads, cache.head_dim
        k_pool, v_pool = cache.k[layer], cache.v[layer]
        assert width == (heads + 2 * kv_heads) * d and qkv.stride(1) == 1 and qkv.dtype in self._NARROW
        assert bias is None or (bias.is_contiguous() and bias.dtype == torch.float32 and bias.numel() == width)
        assert cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape and cos.stride() == sin.stride()
        assert cos.stride(2) == 1 and cos.shape[0] == t and cos.shape[1] in (1, heads + kv_heads) and cos.shape[2] == d
        assert k_pool.is_contiguous() and v_pool.is_contiguous() and k_pool.dtype == v_pool.dtype in self._NARROW
        assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape[0] == t
        assert head_scale is None or (head_scale.dtype == torch.float32 and head_scale.is_contiguous()
                                      and head_scale.numel() == heads + kv_heads)
        q = torch.empty((t, heads, d), dtype=torch.float32)
        rc = self._rope_store(qkv.data_ptr(), qkv.stride(0), qkv.dtype == torch.bfloat16,
                              bias.data_ptr() if bias is not None else None, cos.data_ptr(), sin.data_ptr(),
                              cos.stride(0), 0 if cos.shape[1] == 1 else cos.stride(1),
                              head_scale.data_ptr() if head_scale is not None else None, q.data_ptr(), heads * d,
                              k_pool.data_ptr(), v_pool.data_ptr(), k_pool.dtype == torch.bfloat16, k_pool.shape[1],
                              slots.data_ptr(), t, heads, kv_heads, d, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"native rotary embedding failed ({rc}): head dim {d}")
        return q


@lru_cache(maxsize=1)
def fused_ops() -> FusedOps | None:
    lib = library()
    return FusedOps(lib) if lib is not None else None


class RowScan:
    """One pass over float32 rows (logits) for what the engine asks of each step's: the index of
    each row's maximum (:meth:`argmax`, as ``x.max(dim=-1).indices``: the first one, a NaN
    counting as the largest) and whether each row is finite (:meth:`finite`, as
    ``torch.isfinite(x).all(dim=-1)``), on the threads the rows split between."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.loraplex_scan_rows_f32

    @staticmethod
    def fits(x: torch.Tensor) -> bool:
        """Whether ``x`` is what the kernel reads: float32 ``[rows, cols]`` on CPU, unit column stride."""
        return x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1 and x.shape[1] > 0

    def _scan(self, x: torch.Tensor, argmax: torch.Tensor | None, finite: torch.Tensor | None) -> None:
        assert self.fits(x)
        rows, cols = x.shape
        rc = self._fn(x.data_ptr(), x.stride(0), rows, cols, argmax.data_ptr() if argmax is not None else None,
                      finite.data_ptr() if finite is not None else None, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"native row scan failed ({rc}): {rows}x{cols}")

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._scan(x, out, None)
        return out

    def finite(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], dtype=torch.bool)
        self._scan(x, None, out)
        return out


@lru_cache(maxsize=1)
def row_scan_kernel() -> RowScan | None:
    lib = library()
    return RowScan(lib) if lib is not None else None


class BlockMatmul:
    """``x @ W.T + bias`` for float32 rows ``x`` and a ``W`` in blocks of 32 inputs packed by
    ``engine.quant`` (8-bit ``pack_q8``, 4-bit ``pack_q4``): the activations quantized per row
    and block of 32; see ``engine/csrc/cpu_kernels.c``. ``extra``: the packed weight's third
    array (the 8-bit compensations ``comp``, the 4-bit offsets ``m``). ``swiglu_fn``: the
    kernel's fused SwiGLU entry point, where it has one (8 bits on AVX512-VNNI)."""

    def __init__(self, fn: Callable[..., int], extra: str, bits: int, swiglu_fn: Callable[..., int] | None = None) -> None:
        self._fn, self._extra, self._bits, self._swiglu_fn = fn, extra, bits, swiglu_fn

    def _check(self, x: torch.Tensor, w: PackedQ8 | PackedQ4) -> torch.Tensor:
        assert x.shape[1] == w.in_features and x.dtype == torch.float32 and x.device.type == "cpu"
        return x if x.stride(1) == 1 else x.contiguous()

    def __call__(self, x: torch.Tensor, w: PackedQ8 | PackedQ4, bias: torch.Tensor | None) -> torch.Tensor:
        x = self._check(x, w)
        assert bias is None or (bias.is_contiguous() and bias.shape == (w.out_features,)
                                and bias.dtype == torch.float32)
        m, k = x.shape
        y = x.new_empty((m, w.out_features))
        if m == 0:
            return y
        rc = self._fn(x.data_ptr(), x.stride(0), m, k, w.q.data_ptr(), w.d.data_ptr(),
                      getattr(w, self._extra).data_ptr(), w.out_features,
                      bias.data_ptr() if bias is not None else None, y.data_ptr(), y.stride(0),
                      torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"native {self._bits}-bit matmul: no memory for the quantized activations")
        return y

    def fuses_swiglu(self, w: PackedQ8 | PackedQ4) -> bool:
        """Whether :meth:`swiglu` runs for the fused gate|up weight ``w``."""
        return self._swiglu_fn is not None and isinstance(w, PackedQ8) and w.out_features % 32 == 0

    def swiglu(self, x: torch.Tensor, w: PackedQ8) -> torch.Tensor:
        """For a fused gate|up ``w`` (no bias): ``silu(gate) * up`` ``[m, n / 2]``, what
        ``FusedOps.silu_mul(self(x, w, None), n // 2)`` returns, without the ``[m, n]`` sums."""
        assert self.fuses_swiglu(w) and self._swiglu_fn is not None
        x = self._check(x, w)
        m, k = x.shape
        y = x.new_empty((m, w.out_features // 2))
        if m == 0:
            return y
        rc = self._swiglu_fn(x.data_ptr(), x.stride(0), m, k, w.q.data_ptr(), w.d.data_ptr(), w.comp.data_ptr(),
                             w.out_features, y.data_ptr(), y.stride(0), torch.get_num_threads())
        if rc != 0:
            raise MemoryError("native 8-bit matmul: no memory for the quantized activations")
        return y


@lru_cache(maxsize=1)
def q8_matmul_kernel() -> BlockMatmul | None:
    lib = library()
    if lib is None:
        return None
    fused = lib.loraplex_q8_swiglu_f32 if cpu_has_vnni() else None  # the build with the fused SwiGLU
    return BlockMatmul(lib.loraplex_q8_matmul_f32, "comp", 8, fused)


@lru_cache(maxsize=1)
def q4_matmul_kernel() -> BlockMatmul | None:
    lib = library()
    return BlockMatmul(lib.loraplex_q4_matmul_f32, "m", 4) if lib is not None else None


class TileMatmul:
    """``y = x @ W.T`` for bfloat16 ``x`` and ``W`` (``engine/csrc``, section 7), on AMX tiles or,
    on CPUs with AVX512-BF16 but no AMX, on ``vdpbf16ps``: the float32 sums rounded to bfloat16, as
    oneDNN's bfloat16 matmul rounds them (the same products summed in the same order), returned in
    bfloat16, or widened to float32 plus a bias. ``W`` is packed once (:meth:`pack`) into AMX's
    tile layout, which is also one ``vdpbf16ps`` operand per tile row.

    Against oneDNN's prepacked bfloat16 matmul on 2 threads of an AMX Xeon, weights streamed
    from memory: 1.3-1.5x faster at 32 rows (27-30 GB/s of weights against 20), twice as fast
    as the native ``gemv`` for one row, and about even over a 1000-token prefill step."""

    BLOCK = 32
    """``W``'s rows (outputs) and columns (inputs) must be multiples of this."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        self._fn = lib.loraplex_tile_matmul_bf16
        self._fma = lib.loraplex_tile_matmul_fma
        self.isa = isa
        """``amx`` or ``avx512_bf16``: the build that runs."""

    @property
    def by_fma(self) -> bool:
        """The AVX512-BF16 build sums with float32 FMAs on the widened bfloat16 (the same sums as
        ``vdpbf16ps``'s, but where it flushes a denormal), as the library's start chose on a core
        whose FMAs multiply-accumulate faster than its ``vdpbf16ps``; never on AMX."""
        return self._fma(-1) == 1

    @by_fma.setter
    def by_fma(self, on: bool) -> None:
        if self.isa == "avx512_bf16":
            self._fma(int(on))

    @classmethod
    def fits(cls, weight: torch.Tensor) -> bool:
        n, k = weight.shape
        return weight.dtype == torch.bfloat16 and n % cls.BLOCK == 0 and k % cls.BLOCK == 0

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """``[n, k]`` bfloat16 to 16 x 32 tiles in AMX's pair layout (tile (nb, kb), row r, column c,
        lane j = ``W[16 nb + c, 32 kb + 2 r + j]``), tile after tile."""
        n, k = weight.shape
        return weight.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()

    def __call__(self, x: torch.Tensor, tiles: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.bfloat16, swiglu: bool = False) -> torch.Tensor:
        """``x`` ``[m, k]`` bfloat16 (unit column stride); ``bias`` only with a float32 out.
        ``swiglu``: ``W`` is a fused gate|up projection (gate the first ``n / 2`` rows) and the result
        is ``silu(gate) * up`` ``[m, n / 2]`` of the rounded sums, as
        ``FusedOps.silu_mul(self(x, tiles, n), n // 2, out_dtype)`` computes it, in one pass."""
        m, k = x.shape
        assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and tiles.numel() == n * k
        assert out_dtype in (torch.float32, torch.bfloat16) and (bias is None or out_dtype == torch.float32)
        assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.numel() == n)
        assert not (swiglu and bias is not None)
        cols = n // 2 if swiglu else n
        y = torch.empty((m, cols), dtype=out_dtype)
        rc = self._fn(x.data_ptr(), x.stride(0), m, k, tiles.data_ptr(), n,
                      bias.data_ptr() if bias is not None else None, y.data_ptr(), cols,
                      out_dtype == torch.bfloat16, swiglu, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"native {self.isa} matmul failed ({rc}): {m}x{k} by {n}x{k}")
        return y


@lru_cache(maxsize=1)
def tile_matmul_kernel() -> TileMatmul | None:
    """The native bfloat16 matmul where this build has it (``-march=native`` on a CPU with AMX-BF16,
    and the kernel grants this process AMX state, or with AVX512-BF16); else None."""
    lib = library()
    if lib is None:
        return None
    isa = {1: "amx", 2: "avx512_bf16"}.get(lib.loraplex_tile_matmul_init())
    if isa is None:
        return None
    kernel = TileMatmul(lib, isa)
    w = torch.randn(32, 64).bfloat16()  # one check that the tiles compute what oneDNN would
    x = torch.randn(3, 64).bfloat16()
    if not torch.allclose(kernel(x, kernel.pack(w), 32, out_dtype=torch.float32),
                          (x.float() @ w.float().T).bfloat16().float(), rtol=1e-2, atol=1e-2):
        log.warning("native %s matmul disagrees with torch; not used", isa)
        return None
    return kernel
