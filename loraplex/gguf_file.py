"""A GGUF file read in one pass over its mapped bytes: the metadata as plain Python values, each
tensor's data as a numpy view of the file.

``gguf.GGUFReader`` holds every metadata value, down to each of a vocabulary's strings, as a
``numpy.memmap`` slice (about 1.2 million of them for a 49k-token vocabulary and its merges), and
its tensors as ``memmap`` views that slow every numpy operation on them; on the demo model that
was most of a worker's start. This reader parses the same layout with ``struct`` and
``numpy.frombuffer`` over an ``mmap`` of the file and gives the same values: a key's value
equals ``GGUFReader``'s ``field.contents()`` (numbers through numpy's ``tolist`` as there,
strings decoded as UTF-8), a tensor's ``data`` has the dtype and shape of ``GGUFReader``'s
``ReaderTensor.data`` (typed for F16/F32/F64/I8/I16/I32/I64, the raw bytes as uint8 rows for
every other type) as a plain ``numpy.ndarray``. Only little-endian files of versions 2 and 3
are read; nested arrays come back as nested lists.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import quants
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)
from gguf.quants import quant_shape_to_byte_shape

VERSIONS = (2, 3)

_NUMBERS: dict[GGUFValueType, np.dtype[Any]] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
    GGUFValueType.BOOL: np.dtype("?"),
}
"""Each scalar value type's layout in the file."""

_TYPED: dict[GGMLQuantizationType, np.dtype[Any]] = {
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}
"""The tensor types whose data ``GGUFReader`` gives as typed elements (any other: uint8 bytes)."""

_WIDENED = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0})
"""The block types :meth:`GGUFTensor.dequantized` widens itself (any other: ``gguf.quants``)."""

BATCH_BLOCKS = 4096
"""Blocks widened per pass (its temporaries stay in the cache)."""

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    """The dimensions as the file lists them, innermost first (``ReaderTensor.shape``)."""
    data: np.ndarray
    """A read-only view of the file: ``logical_shape`` typed elements, or for block-quantized
    types the rows' bytes (``gguf.quants.quant_shape_to_byte_shape``)."""

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """The dimensions outermost first (a matrix's ``[rows, columns]``)."""
        return tuple(reversed(self.shape))

    def dequantized(self) -> np.ndarray:
        """The values as a new float32 array of ``logical_shape``, bit for bit what
        ``gguf.quants.dequantize`` gives. Q4_0, Q4_1 and Q8_0 are widened here with the same
        float32 arithmetic per value (``q x d``, ``(n - 8) x d``, ``n x d + m``), written in
        place over ``BATCH_BLOCKS`` blocks per pass: gguf's 16 rows per call, each through
        several temporaries, made it most of a model's load."""
        ttype = self.tensor_type
        if ttype not in _WIDENED:
            values = quants.dequantize(self.data, ttype)
            return np.array(values, dtype=np.float32, copy=True).reshape(self.logical_shape)
        block_size, type_size = GGML_QUANT_SIZES[ttype]
        blocks = self.data.reshape(-1, type_size)
        out = np.empty((blocks.shape[0], block_size), np.float32)
        half = block_size // 2
        for i in range(0, blocks.shape[0], BATCH_BLOCKS):
            b, o = blocks[i:i + BATCH_BLOCKS], out[i:i + BATCH_BLOCKS]
            d = b[:, :2].view(np.float16).astype(np.float32)
            if ttype == GGMLQuantizationType.Q8_0:
                o[:] = b[:, 2:].view(np.int8)
                o *= d
                continue
            nibbles = b[:, type_size - half:]  # low nibbles: values 0..15 of the block, high: 16..31
            np.bitwise_and(nibbles, 0x0F, out=o[:, :half], casting="unsafe")
            np.right_shift(nibbles, 4, out=o[:, half:], casting="unsafe")
            if ttype == GGMLQuantizationType.Q4_0:
                o -= 8
                o *= d
            else:
                o *= d
                o += b[:, 2:4].view(np.float16).astype(np.float32)
        return out.reshape(self.logical_shape)


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    """Every key's value in file order: ``int``, ``float``, ``bool``, ``str`` or a list of them."""
    tensors: dict[str, GGUFTensor]
    """By name, in file order."""
    alignment: int
    data_offset: int
    """Where the tensor data starts (tensor offsets count from here)."""

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _Cursor:
    """Reads the file's little-endian fields in order; running past its end is a ``ValueError``."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.size = len(buf)
        self.path = path
        self.pos = 0

    def take(self, n: int) -> int:
        """Where the next ``n`` bytes start; they must be in the file."""
        start = self.pos
        if n < 0 or start + n > self.size:
            raise ValueError(f"{self.path} is truncated: {n} bytes wanted at offset {start} of {self.size}")
        self.pos = start + n
        return start

    def u32(self) -> int:
        return int(_U32.unpack_from(self.buf, self.take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack_from(self.buf, self.take(8))[0])

    def string(self) -> str:
        n = self.u64()
        start = self.take(n)
        return self.buf[start:start + n].decode("utf-8")

    def numbers(self, dtype: np.dtype[Any], count: int) -> list[Any]:
        start = self.take(dtype.itemsize * count)
        return np.frombuffer(self.buf, dtype, count, start).tolist()

    def value_type(self) -> GGUFValueType:
        raw = self.u32()
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ValueError(f"{self.path}: unknown GGUF value type {raw} at offset {self.pos - 4}") from None

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item = self.value_type()
            count = self.u64()
            if item in _NUMBERS:
                return self.numbers(_NUMBERS[item], count)
            if item == GGUFValueType.STRING:
                return [self.string() for _ in range(count)]
            return [self.value(item) for _ in range(count)]
        return self.numbers(_NUMBERS[vtype], 1)[0]


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse ``path``'s header, metadata and tensor infos; the tensors' data stay in the mapped
    file (the mapping lives as long as any of their views). A file that is not GGUF, is truncated,
    big-endian, of another version or malformed is a ``ValueError`` that says so."""
    p = Path(path)
    with open(p, "rb") as fh:
        if p.stat().st_size < 8:
            raise ValueError(f"{p} is not a GGUF file (too short for its header)")
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf, p)
    if cur.u32() != GGUF_MAGIC:
        raise ValueError(f"{p} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
    version = cur.u32()
    if version and version & 0xFFFF == 0:
        raise ValueError(f"{p} is a big-endian GGUF file; only little-endian ones are read")
    if version not in VERSIONS:
        raise ValueError(f"{p} is GGUF version {version}; versions {', '.join(map(str, VERSIONS))} are read")
    tensor_count, kv_count = cur.u64(), cur.u64()
    metadata: dict[str, Any] = {}
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key = cur.string()
        vtype = cur.value_type()
        if key in metadata:
            raise ValueError(f"{p}: metadata key {key!r} appears twice")
        metadata[key] = cur.value(vtype)
        if key == "general.alignment":
            if vtype != GGUFValueType.UINT32:
                raise ValueError(f"{p}: general.alignment is a {vtype.name}, not a UINT32")
            alignment = metadata[key]
            if alignment == 0 or alignment & (alignment - 1):
                raise ValueError(f"{p}: general.alignment {alignment} is not a power of two")
    infos = []
    for _ in range(tensor_count):
        name = cur.string()
        n_dims = cur.u32()
        dims = tuple(cur.numbers(_NUMBERS[GGUFValueType.UINT64], n_dims))
        raw_type = cur.u32()
        try:
            ttype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"{p}: tensor {name!r} has unknown type {raw_type}") from None
        infos.append((name, dims, ttype, cur.u64()))
    data_offset = -(-cur.pos // alignment) * alignment
    base = np.frombuffer(buf, np.uint8)
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, ttype, offset in infos:
        if name in tensors:
            raise ValueError(f"{p}: tensor {name!r} appears twice")
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block_size, type_size = GGML_QUANT_SIZES[ttype]
        n_bytes = n_elements * type_size // block_size
        start = data_offset + offset
        if start + n_bytes > len(buf):
            raise ValueError(f"{p} is truncated: tensor {name!r} needs bytes {start}..{start + n_bytes} "
                             f"of {len(buf)}")
        shape = tuple(reversed(dims))
        raw = base[start:start + n_bytes]
        dtype = _TYPED.get(ttype)
        data = raw.view(dtype).reshape(shape) if dtype is not None \
            else raw.reshape(quant_shape_to_byte_shape(shape, ttype))
        tensors[name] = GGUFTensor(name, ttype, dims, data)
    return GGUFFile(p, version, metadata, tensors, alignment, data_offset)
