"""``loraplex.gguf_file`` reads what ``gguf.GGUFReader`` reads, value for value and byte for byte,
and dequantizes to exactly ``gguf.quants.dequantize``'s float32 values."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from loraplex.gguf_file import BATCH_BLOCKS, GGUFFile, GGUFTensor, read_gguf
from tests.engine_fixtures import demo_model_file

V = GGUFValueType
T = GGMLQuantizationType

SCALARS: dict[str, tuple[Any, GGUFValueType]] = {
    "t.u8": (250, V.UINT8), "t.i8": (-100, V.INT8), "t.u16": (65000, V.UINT16), "t.i16": (-32000, V.INT16),
    "t.u32": (4_000_000_000, V.UINT32), "t.i32": (-2_000_000_000, V.INT32), "t.f32": (0.1, V.FLOAT32),
    "t.u64": (2**63 + 5, V.UINT64), "t.i64": (-(2**62), V.INT64), "t.f64": (1 / 3, V.FLOAT64),
    "t.bool": (True, V.BOOL), "t.str": ("héllo ✓ \x00 end", V.STRING),
}
ARRAYS: dict[str, tuple[list[Any], GGUFValueType]] = {
    "a.u8": ([0, 1, 255], V.UINT8), "a.i8": ([-128, 127], V.INT8), "a.u16": ([1, 65535], V.UINT16),
    "a.i16": ([-1, 2], V.INT16), "a.u32": ([7, 2**32 - 1], V.UINT32), "a.i32": ([-7, 3, 9], V.INT32),
    "a.f32": ([0.5, -1.25, 3.3], V.FLOAT32), "a.u64": ([2**64 - 1], V.UINT64), "a.i64": ([-5, 2**40], V.INT64),
    "a.f64": ([2.5, -0.1], V.FLOAT64), "a.bool": ([True, False, True], V.BOOL),
    "a.str": (["a b", "", "Ġtoken", "日本"], V.STRING),
}
NESTED = [[1, 2], [3], [4, 5, 6]]
INTEGERS = frozenset({T.I8, T.I16, T.I32, T.I64})


def _matrix(rows: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


TENSORS: dict[str, tuple[np.ndarray, GGMLQuantizationType]] = {
    "f32": (_matrix(3, 40, 0), T.F32),
    "f16": (_matrix(4, 64, 1).astype(np.float16), T.F16),
    "i32": (np.arange(24, dtype=np.int32).reshape(2, 3, 4), T.I32),
    "q8_0": (quantize(_matrix(6, 64, 2), T.Q8_0), T.Q8_0),
    "q4_0": (quantize(_matrix(5, 96, 3), T.Q4_0), T.Q4_0),
    "q4_1": (quantize(_matrix(2, 3, 4).repeat(32, axis=1), T.Q4_1), T.Q4_1),
    "bf16": (quantize(_matrix(2, 16, 5), T.BF16), T.BF16),
}


def _write(path: Path, alignment: int | None = None) -> Path:
    w = GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (value, vtype) in SCALARS.items():
        w.add_key_value(key, value, vtype)
    for key, (values, vtype) in ARRAYS.items():
        w.add_key_value(key, values, V.ARRAY, sub_type=vtype)
    w.add_key_value("a.nested", NESTED, V.ARRAY)
    for name, (data, ttype) in TENSORS.items():
        w.add_tensor(name, data, raw_dtype=None if ttype in (T.F32, T.F16, T.I32) else ttype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_reads_as_gguf_does(ours: GGUFFile, theirs: GGUFReader, skip: frozenset[str] = frozenset()) -> None:
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for key in keys:
        if key in skip:
            continue
        want, got = theirs.fields[key].contents(), ours.metadata[key]
        assert got == want and type(got) is type(want), key
        if isinstance(want, list):
            assert [type(v) for v in got] == [type(v) for v in want], key
    assert ours.alignment == theirs.alignment and ours.data_offset == theirs.data_offset
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.tensor_type == t.tensor_type and mine.shape == tuple(t.shape.tolist()), t.name
        assert type(mine.data) is np.ndarray, "a plain array, not a memmap"
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape, t.name
        assert mine.data.tobytes() == t.data.tobytes(), t.name
        if t.tensor_type in INTEGERS:  # gguf does not dequantize these
            continue
        want_values = dequantize(t.data, t.tensor_type).reshape(mine.logical_shape)
        got_values = mine.dequantized()
        assert got_values.dtype == np.float32 and got_values.shape == want_values.shape, t.name
        assert got_values.tobytes() == np.asarray(want_values, np.float32).tobytes(), t.name


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_type_reads_back(tmp_path, alignment):
    path = _write(tmp_path / "all.gguf", alignment)
    got = read_gguf(path)
    assert got.version == 3 and got.alignment == (alignment or 32)
    assert got.get("general.architecture") == "llama" and got.get("no.such.key", 7) == 7
    for key, (value, vtype) in SCALARS.items():
        assert got.metadata[key] == (pytest.approx(value, rel=1e-7) if vtype == V.FLOAT32 else value), key
    for key, (values, vtype) in ARRAYS.items():
        assert got.metadata[key] == (pytest.approx(values, rel=1e-7) if vtype == V.FLOAT32 else values), key
    assert got.metadata["a.nested"] == NESTED  # gguf's reader flattens nested arrays: checked here only
    for name, (data, ttype) in TENSORS.items():
        t = got.tensors[name]
        assert t.tensor_type == ttype and t.data.tobytes() == data.tobytes(), name
    assert got.tensors["i32"].shape == (4, 3, 2) and got.tensors["i32"].logical_shape == (2, 3, 4)
    assert got.tensors["q4_0"].logical_shape == (5, 96) and got.tensors["q4_0"].data.shape == (5, 3 * 18)
    _assert_reads_as_gguf_does(got, GGUFReader(path), skip=frozenset({"a.nested"}))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_block_dequantization_is_ggufs_bit_for_bit_on_any_bytes(tmp_path, qtype):
    """Random bytes: every nibble and int8 value, subnormal, infinite and NaN scales, over more
    than one batch of blocks."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = BATCH_BLOCKS // 4 + 3, 4
    raw = np.random.default_rng(int(qtype)).integers(0, 256, (rows, blocks_per_row * type_size), np.uint8)
    t = GGUFTensor("w", qtype, (blocks_per_row * block_size, rows), raw)
    with np.errstate(invalid="ignore", over="ignore"):
        want = dequantize(raw, qtype)
        got = t.dequantized()
    assert got.shape == (rows, blocks_per_row * block_size)
    assert got.tobytes() == want.tobytes()


@pytest.mark.slow
def test_the_demo_model_reads_as_gguf_reads_it():
    path = demo_model_file()
    _assert_reads_as_gguf_does(read_gguf(path), GGUFReader(path))


def _header(version: int, tensors: int, kvs: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, kvs)


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload


def test_version_2_and_an_empty_array_read(tmp_path):
    body = _kv("e", V.ARRAY, struct.pack("<IQ", V.STRING, 0)) + _kv("z", V.ARRAY, struct.pack("<IQ", V.INT32, 0)) \
        + _kv("n", V.UINT32, struct.pack("<I", 9))
    path = tmp_path / "v2.gguf"
    path.write_bytes(_header(2, 0, 3) + body)
    got = read_gguf(path)
    assert (got.version, got.metadata, got.tensors) == (2, {"e": [], "z": [], "n": 9}, {})


@pytest.mark.parametrize(("mangle", "message"), [
    (lambda b: b"GGUX" + b[4:], "not a GGUF file"),
    (lambda b: b[:6], "not a GGUF file"),
    (lambda b: b[:4] + struct.pack(">I", 3) + b[8:], "big-endian"),
    (lambda b: b[:4] + struct.pack("<I", 1) + b[8:], "version 1"),
    (lambda b: b[:4] + struct.pack("<I", 4) + b[8:], "version 4"),
    (lambda b: b[:200], "truncated"),
    (lambda b: b[:-100], "truncated: tensor"),
])
def test_a_broken_file_is_a_clear_value_error(tmp_path, mangle, message):
    good = _write(tmp_path / "good.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(mangle(good))
    with pytest.raises(ValueError, match=message):
        read_gguf(bad)


@pytest.mark.parametrize(("body", "message"), [
    (_kv("k", V.UINT8, b"\x01") + _kv("k", V.UINT8, b"\x02"), "appears twice"),
    (_kv("k", 99, b""), "unknown GGUF value type 99"),
    (_kv("general.alignment", V.UINT64, struct.pack("<Q", 32)), "not a UINT32"),
    (_kv("general.alignment", V.UINT32, struct.pack("<I", 48)), "not a power of two"),
])
def test_malformed_metadata_is_a_clear_value_error(tmp_path, body, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(_header(3, 0, 2 if "twice" in message else 1) + body)
    with pytest.raises(ValueError, match=message):
        read_gguf(path)
