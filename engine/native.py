"""Native CPU kernels (C, built on first use with the system compiler, loaded with ctypes).

``engine/csrc/*.c`` is compiled once per machine (with ``$CC``, else ``cc``/``gcc``) into a cache directory
(``$XDG_CACHE_HOME/loraplex/kernels``, else ``~/.cache/loraplex/kernels``), keyed by a hash of the source, the compiler flags and
this CPU's feature flags (the code is built for ``-march=native``, or ``$LORAPLEX_NATIVE_MARCH``: see
``engine.cpu``). No compiler, a
failed build or a non-Linux platform: ``decode_attention_kernel()``,
``lora_rows_kernel()``, ``gemv_kernel()``, ``fused_ops()``, ``q8_matmul_kernel()`` and ``q4_matmul_kernel()`` return ``None`` and the engine keeps its
pure-torch paths, with one warning in the log.

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
from collections.abc import Callable, Sequence
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
_i64, _int, _ptr, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "loraplex_decode_attention_f32": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64,
                                      _int, _int, _int, _int, _int, _int, _int, _int],
    "loraplex_decode_attention_bf16kv": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64,
                                         _int, _int, _int, _int, _int, _int, _int, _int, _int],
    "loraplex_lora_rows_f32": [_ptr, _i64, _ptr, _i64, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _ptr, _ptr, _int,
                               _int, _int, _int, _int],
    "loraplex_gemv_f32": [_ptr, _ptr, _ptr, _ptr, _int, _int, _int],
    "loraplex_gemv_bf16": [_ptr, _ptr, _ptr, _ptr, _int, _int, _int],
    "loraplex_add_rms_norm_f32": [_ptr, _i64, _ptr, _i64, _int, _ptr, _i64, _int, _ptr, _f32, _int, _int, _int],
    "loraplex_silu_mul_f32": [_ptr, _i64, _int, _ptr, _i64, _int, _int, _int, _int],
    "loraplex_rope_store_f32": [_ptr, _i64, _int, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _int, _i64,
                                _ptr, _int, _int, _int, _int, _int],
    "loraplex_q8_matmul_f32": [_ptr, _i64, _int, _int, _ptr, _ptr, _ptr, _int, _ptr, _ptr, _i64, _int],
    "loraplex_q8_swiglu_f32": [_ptr, _i64, _int, _int, _ptr, _ptr, _ptr, _int, _ptr, _i64, _int],
    "loraplex_q4_matmul_f32": [_ptr, _i64, _int, _int, _ptr, _ptr, _ptr, _int, _ptr, _ptr, _i64, _int],
    "loraplex_f32_panel_available": [],
    "loraplex_f32_panel_pack": [_ptr, _int, _int, _ptr],
    "loraplex_f32_panel_matmul": [_ptr, _i64, _int, _int, _ptr, _int, _ptr, _ptr, _i64, _int],
    "loraplex_tile_matmul_init": [],
    "loraplex_tile_matmul_bf16": [_ptr, _i64, _int, _int, _ptr, _int, _ptr, _ptr, _i64, _int, _int, _int],
    "loraplex_scan_rows_f32": [_ptr, _i64, _int, _int, _ptr, _ptr, _int],
    "loraplex_lora_rows_blocked": [],
    "loraplex_decoder_layers": [_ptr, _int, _ptr, _int],
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
def _library() -> ctypes.CDLL | None:
    if platform.system() != "Linux":
        return None
    try:
        lib = ctypes.CDLL(str(_build("cpu_kernels")))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native CPU kernels unavailable, using the torch path: %s", e)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = _int
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
    lib = _library()
    if lib is None:
        return None
    tiles = tile_matmul_kernel()
    return DecodeAttention(lib, amx=tiles is not None and tiles.isa == "amx")


class _LoraCall(ctypes.Structure):
    _fields_ = [("y_cols", _ptr), ("out_dims", _ptr), ("a_ptrs", _ptr), ("b_ptrs", _ptr), ("scale_ptrs", _ptr),
                ("num_targets", _int), ("b_transposed", _int), ("in_dim", _int), ("rank", _int),
                ("weights_bf16", _int)]


class _LoraPass(ctypes.Structure):
    _fields_ = [("rows", _ptr), ("row_slots", _ptr), ("num_rows", _int)]


class _Lora(ctypes.Structure):
    _fields_ = [("passes", _ptr), ("calls", _ptr), ("num_passes", _int)]


class LoRASteps:
    """A step's LoRA rows as :class:`DecoderLayers` applies them: per rank class (pass) its rows
    sorted by slot, and per layer, input (q|k|v, o, gate|up, down) and pass the stacks to apply
    (:meth:`LoRATable.call`) or none."""

    INPUTS = 4
    FAILED = 1000
    """The decoder's return code for a failed LoRA call: this plus the index of its pass."""

    def __init__(self, passes: Sequence[tuple[torch.Tensor, torch.Tensor]], num_layers: int) -> None:
        """``passes``: per pass ``(rows, row_slots)``, int64 contiguous; fill the calls with :meth:`set`."""
        self.num_passes = len(passes)
        for rows, row_slots in passes:
            assert rows.dtype == row_slots.dtype == torch.int64 and rows.is_contiguous() and row_slots.is_contiguous()
        self._passes = (_LoraPass * self.num_passes)(*(_LoraPass(r.data_ptr(), rs.data_ptr(), int(r.numel()))
                                                       for r, rs in passes))
        self._calls = (ctypes.c_void_p * (num_layers * self.INPUTS * self.num_passes))()
        self._keep: list[object] = [passes]
        self.args = _Lora(ctypes.addressof(self._passes), ctypes.addressof(self._calls), self.num_passes)

    def set(self, layer: int, inp: int, pass_index: int, call: _LoraCall) -> None:
        self._calls[(layer * self.INPUTS + inp) * self.num_passes + pass_index] = ctypes.addressof(call)
        self._keep.append(call)


class LoRATable:
    """Kernel arguments for the LoRA stacks of projections that read the same input
    (validated once; build with :meth:`LoRARows.table`, keep while the stacks live)."""

    __slots__ = ("_calls", "_keep", "a_ptrs", "b_ptrs", "bf16", "in_dim", "n", "out_dims", "rank", "scale_ptrs",
                 "transposed")

    def __init__(self, stacks: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        if not stacks:
            raise ValueError("no LoRA stacks")
        a0 = stacks[0][0]
        _, self.rank, self.in_dim = a0.shape
        self.transposed = stacks[0][1].transpose(1, 2).is_contiguous()
        self.bf16 = a0.dtype == torch.bfloat16
        for a, b, scale in stacks:
            s, r, n_in = a.shape
            assert (r, n_in) == (self.rank, self.in_dim), "stacks of one call share rank and input size"
            assert a.dtype == b.dtype == a0.dtype and a.dtype in (torch.float32, torch.bfloat16)
            assert scale.dtype == torch.float32 and a.device.type == "cpu"
            assert a.is_contiguous() and scale.is_contiguous() and b.shape == (s, b.shape[1], r)
            assert scale.shape == (s,)
            assert b.transpose(1, 2).is_contiguous() if self.transposed else b.is_contiguous()
        self.n = len(stacks)
        arr = ctypes.c_int64 * self.n
        self.out_dims = arr(*(b.shape[1] for _, b, _ in stacks))
        self.a_ptrs = arr(*(a.data_ptr() for a, _, _ in stacks))
        self.b_ptrs = arr(*(b.data_ptr() for _, b, _ in stacks))
        self.scale_ptrs = arr(*(sc.data_ptr() for _, _, sc in stacks))
        self._keep = tuple(stacks)
        self._calls: dict[tuple[int, ...], _LoraCall] = {}

    def call(self, cols: tuple[int, ...]) -> _LoraCall:
        """These stacks as one LoRA call of :class:`DecoderLayers`, their outputs at columns
        ``cols`` of the matmul's output (built once per ``cols``, kept with the table)."""
        c = self._calls.get(cols)
        if c is None:
            assert len(cols) == self.n
            y_cols = (ctypes.c_int64 * self.n)(*cols)
            c = self._calls[cols] = _LoraCall(ctypes.addressof(y_cols), ctypes.addressof(self.out_dims),
                                              ctypes.addressof(self.a_ptrs), ctypes.addressof(self.b_ptrs),
                                              ctypes.addressof(self.scale_ptrs), self.n, int(self.transposed),
                                              self.in_dim, self.rank, int(self.bf16))
            c.keep = (y_cols, self)  # the column offsets, and the arrays the other pointers name
        return c


class LoRARows:
    """``out_p[rows[n]] += scale_p[s] * B_p[s] @ (A_p[s] @ x[rows[n]])`` with ``s = row_slots[n]``,
    for one or several projections ``p`` of the same input (see ``engine/csrc/cpu_kernels.c``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.loraplex_lora_rows_f32
        # The AVX-512 and AVX2 builds take each segment of one adapter in blocks (B transposed,
        # rank a multiple of 8): prefill too (engine.lora.ops.native_max_tokens).
        self.blocked = bool(lib.loraplex_lora_rows_blocked())

    @staticmethod
    def table(stacks: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> LoRATable:
        """``stacks``: per projection ``(A [S, r, in] contiguous, B [S, out, r] contiguous or the
        transposed view of a contiguous [S, r, out] (as ``SlotBank`` stores it: the faster
        expand), scale [S])`` on CPU, one rank and input size; A and B float32 or bfloat16 (the
        math stays float32), the scales float32."""
        return LoRATable(stacks)

    def run(self, table: LoRATable, x: torch.Tensor, outs: Sequence[torch.Tensor], rows: torch.Tensor,
            row_slots: torch.Tensor) -> None:
        """``x``: ``[T, in]``; ``outs``: one ``[T, out_p]`` per stack of the table, column slices of
        one float32 tensor (e.g. q/k/v of a fused projection's output; rows may be strided,
        columns contiguous); ``rows``/``row_slots``: ``[n]`` int64 contiguous, best sorted by slot."""
        y = outs[0]
        stride = y.stride(0)
        assert len(outs) == table.n and x.dtype == y.dtype == torch.float32
        assert x.stride(1) == 1 and x.shape[1] == table.in_dim
        base = y.data_ptr()
        cols = (ctypes.c_int64 * table.n)()
        for p, o in enumerate(outs):
            assert o.stride(1) == 1 and o.stride(0) == stride and o.shape == (y.shape[0], table.out_dims[p])
            assert o.dtype == torch.float32
            cols[p] = (o.data_ptr() - base) // 4
        assert rows.dtype == row_slots.dtype == torch.int64 and rows.is_contiguous() and row_slots.is_contiguous()
        rc = self._fn(x.data_ptr(), x.stride(0), base, stride, table.n, cols, table.out_dims, table.a_ptrs,
                      table.b_ptrs, table.scale_ptrs, int(table.transposed), rows.data_ptr(), row_slots.data_ptr(),
                      int(rows.numel()), table.in_dim, table.rank, int(table.bf16), torch.get_num_threads())
        if rc == 1:
            raise MemoryError("native LoRA kernel: no memory for the shrunk rows")
        if rc != 0:
            raise RuntimeError(f"native LoRA kernel failed ({rc}): rank {table.rank}")

    def __call__(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                 rows: torch.Tensor, row_slots: torch.Tensor) -> None:
        """One projection: ``y [T, out]``, ``x [T, in]``, stacks as in :meth:`table`."""
        self.run(self.table([(a, b, scale)]), x, [y], rows, row_slots)


@lru_cache(maxsize=1)
def lora_rows_kernel() -> LoRARows | None:
    lib = _library()
    return LoRARows(lib) if lib is not None else None


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
    lib = _library()
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
    lib = _library()
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
    lib = _library()
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
    lib = _library()
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
    lib = _library()
    if lib is None:
        return None
    fused = lib.loraplex_q8_swiglu_f32 if cpu_has_vnni() else None  # the build with the fused SwiGLU
    return BlockMatmul(lib.loraplex_q8_matmul_f32, "comp", 8, fused)


@lru_cache(maxsize=1)
def q4_matmul_kernel() -> BlockMatmul | None:
    lib = _library()
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
        self.isa = isa
        """``amx`` or ``avx512_bf16``: the build that runs."""

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
    lib = _library()
    isa = {1: "amx", 2: "avx512_bf16"}.get(lib.loraplex_tile_matmul_init()) if lib is not None else None
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


class _Weight(ctypes.Structure):
    _fields_ = [("w", _ptr), ("d", _ptr), ("extra", _ptr), ("bias", _ptr), ("format", _int), ("n", _int), ("k", _int)]


class _LayerArgs(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight),
                ("down", _Weight), ("k_pool", _ptr), ("v_pool", _ptr)]


class _StepArgs(ctypes.Structure):
    _fields_ = [("h", _ptr), ("x", _ptr), ("qkv", _ptr), ("attn", _ptr), ("res", _ptr), ("mlp", _ptr),
                ("gate_up", _ptr), ("xb", _ptr), ("q", _ptr), ("lora", _ptr), ("cos", _ptr), ("sin", _ptr),
                ("head_scale", _ptr),
                ("cs_row_stride", _i64), ("cs_head_stride", _i64), ("slots", _ptr), ("row_blocks", _ptr),
                ("row_lens", _ptr), ("blocks_per_seq", _i64), ("pool_slots", _i64), ("max_len", _int),
                ("block_size", _int), ("kv_bf16", _int), ("amx", _int), ("act_bf16", _int), ("rows", _int),
                ("hidden", _int), ("heads", _int), ("kv_heads", _int), ("head_dim", _int), ("inter", _int),
                ("eps", _f32)]


class NativeWeight:
    """One projection's matrix as :class:`DecoderLayers` reads it: ``tiles`` packed by
    :meth:`TileMatmul.pack` (bfloat16, the bias left to the caller's flow), a
    :class:`engine.quant.PackedQ8` / ``PackedQ4``, or float32 ``panels`` packed by
    :meth:`PanelMatmul.pack` (the bias added by the matmul for these)."""

    TILE, Q8, Q4, PANEL = 0, 1, 2, 3

    def __init__(self, weight: torch.Tensor | PackedQ8 | PackedQ4, bias: torch.Tensor | None,
                 n: int | None = None, single: torch.Tensor | None = None) -> None:
        """``n``: the tiles' or panels' output count (``weight`` then the packed tiles or panels);
        ``single``: with panels, the float32 ``[n, k]`` matrix a single row multiplies on the gemv
        kernel (as :class:`engine.linear.Linear` does), or None (panels for it too)."""
        assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
        self.bias = bias
        # _keep: the tensors behind the C struct's w, d and extra pointers (None, or missing: NULL).
        if isinstance(weight, PackedQ8 | PackedQ4):
            q8 = isinstance(weight, PackedQ8)
            self.format, self.n, self.k = (self.Q8 if q8 else self.Q4), weight.out_features, weight.in_features
            self._keep: tuple[torch.Tensor | None, ...] = (weight.q, weight.d, weight.comp if q8 else weight.m)
        elif weight.dtype == torch.float32:
            assert weight.dim() == 3 and weight.shape[2] == 16 and weight.is_contiguous() and n is not None
            assert single is None or (single.shape == (n, weight.shape[1]) and single.dtype == torch.float32
                                      and single.is_contiguous())
            self.format, self.n, self.k = self.PANEL, n, weight.shape[1]
            self._keep = (weight, None, single)
        else:
            assert weight.dtype == torch.bfloat16 and weight.is_contiguous() and n is not None
            self.format, self.n, self.k = self.TILE, n, weight.numel() // n
            self._keep = (weight,)

    def args(self) -> _Weight:
        p = [t.data_ptr() if t is not None else None for t in self._keep] + [None] * (3 - len(self._keep))
        return _Weight(*p, self.bias.data_ptr() if self.bias is not None else None, self.format, self.n, self.k)


class DecoderLayers:
    """A step's decoder layers in one native call (``engine/csrc``, section 10), for a model whose
    matrices all run on native kernels (:class:`NativeWeight`: bfloat16 on the tile kernel, 8- and
    4-bit blocks, or float32 panels), the step's LoRA rows included (:class:`LoRASteps`): per layer the kernels
    the model calls one by one (``engine.model.DecoderModel``), in the same order with the same
    arguments, so the same numbers bit for bit; what it saves is the interpreter between them (240
    ctypes calls a step for a 30-layer model, about 400 with adapters, each with its checks and
    allocations, while the second OpenMP thread spins).

    Built once per model and KV cache with :meth:`layers` (weights and pools stay where they are)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.loraplex_decoder_layers

    @staticmethod
    def layers(weights: Sequence[tuple[torch.Tensor, torch.Tensor, NativeWeight, NativeWeight, NativeWeight,
                                       NativeWeight]], cache: KVCache) -> ctypes.Array:
        """``weights``: per layer ``(input_norm, post_norm, qkv, o, gate_up, down)``, every matrix
        of one kind (tiles, or blocks); the pools are ``cache``'s."""
        assert len(weights) == len(cache.k)
        tiles = weights[0][2].format == NativeWeight.TILE
        arr = (_LayerArgs * len(weights))()
        for i, (in_norm, post_norm, *mats) in enumerate(weights):
            assert in_norm.dtype == post_norm.dtype == torch.float32 and in_norm.is_contiguous()
            assert all((m.format == NativeWeight.TILE) == tiles for m in mats), "tiles and blocks do not mix"
            assert not tiles or all(m.bias is None for m in mats[1:]), "on tiles only q|k|v has a bias"
            k, v = cache.k[i], cache.v[i]
            assert k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype in (torch.float32, torch.bfloat16)
            arr[i] = _LayerArgs(in_norm.data_ptr(), post_norm.data_ptr(), *(m.args() for m in mats), k.data_ptr(),
                                v.data_ptr())
        arr.tiles = tiles  # type: ignore[attr-defined]
        arr.keep = weights  # type: ignore[attr-defined]
        return arr

    def __call__(self, layers: ctypes.Array, h: torch.Tensor, cache: KVCache, cos: torch.Tensor, sin: torch.Tensor,
                 head_scale: torch.Tensor, slots: torch.Tensor, row_blocks: torch.Tensor, row_lens: torch.Tensor,
                 max_len: int, heads: int, inter: int, eps: float, fused_swiglu: bool, amx: bool,
                 lora: LoRASteps | None = None) -> int:
        """Runs every layer over ``h [T, hidden]`` (float32, contiguous; updated in place to the
        residual stream after the last layer). ``cos``/``sin``/``head_scale`` as for
        :meth:`FusedOps.rope_store`, ``row_blocks``/``row_lens``/``max_len`` as for
        :class:`DecodeAttention` (one row per token); ``fused_swiglu``: SwiGLU in the gate|up
        matmul (the tile kernel, or the 8-bit one on AVX512-VNNI; never with ``lora``); ``lora``:
        the step's LoRA rows. Returns -1, or the index of the LoRA pass that failed (the
        caller raises what the model's hook would have)."""
        t, hidden = h.shape
        kv_heads, d = cache.num_kv_heads, cache.head_dim
        assert h.dtype == torch.float32 and h.is_contiguous() and t > 0
        assert cos.dtype == sin.dtype == torch.float32 and cos.stride() == sin.stride() and cos.stride(2) == 1
        assert cos.shape[0] == t and cos.shape[1] in (1, heads + kv_heads) and cos.shape[2] == d
        assert head_scale.dtype == torch.float32 and head_scale.is_contiguous() and head_scale.numel() == heads + kv_heads
        assert slots.dtype == row_blocks.dtype == row_lens.dtype == torch.int64
        assert slots.is_contiguous() and row_blocks.is_contiguous() and row_lens.is_contiguous()
        assert slots.shape[0] == row_blocks.shape[0] == row_lens.shape[0] == t
        assert not (fused_swiglu and lora is not None)
        tiles = layers.tiles  # type: ignore[attr-defined]
        act = torch.bfloat16 if tiles and lora is None else torch.float32
        x, res = torch.empty((t, hidden), dtype=act), torch.empty((t, hidden), dtype=act)
        qkv = torch.empty((t, (heads + 2 * kv_heads) * d), dtype=act)
        q = torch.empty((t, heads * d), dtype=torch.float32)
        attn, mlp = torch.empty((t, heads * d), dtype=act), torch.empty((t, inter), dtype=act)
        gate_up = None if fused_swiglu else torch.empty((t, 2 * inter), dtype=act)
        xb = torch.empty((t, max(hidden, heads * d, inter)), dtype=torch.bfloat16) if tiles and act != torch.bfloat16 else None
        args = _StepArgs(h.data_ptr(), x.data_ptr(), qkv.data_ptr(), attn.data_ptr(), res.data_ptr(), mlp.data_ptr(),
                         gate_up.data_ptr() if gate_up is not None else None, xb.data_ptr() if xb is not None else None,
                         q.data_ptr(), ctypes.addressof(lora.args) if lora is not None else None, cos.data_ptr(),
                         sin.data_ptr(), head_scale.data_ptr(), cos.stride(0), 0 if cos.shape[1] == 1 else cos.stride(1),
                         slots.data_ptr(), row_blocks.data_ptr(), row_lens.data_ptr(), row_blocks.shape[1],
                         cache.k[0].shape[1], max_len, cache.block_size, cache.k[0].dtype == torch.bfloat16, amx,
                         act == torch.bfloat16, t, hidden, heads, kv_heads, d, inter, eps)
        rc = self._fn(ctypes.addressof(layers), len(layers), ctypes.byref(args), torch.get_num_threads())
        if lora is not None and LoRASteps.FAILED <= rc < LoRASteps.FAILED + lora.num_passes:
            return rc - LoRASteps.FAILED
        if rc == 1:
            raise MemoryError("native decoder layers: no memory for the quantized activations")
        if rc != 0:
            raise RuntimeError(f"native decoder layers failed ({rc}): {t} rows, head dim {d}")
        return -1


@lru_cache(maxsize=1)
def decoder_layers_kernel() -> DecoderLayers | None:
    lib = _library()
    return DecoderLayers(lib) if lib is not None else None
