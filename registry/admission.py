"""Adapter admission: decide whether a PEFT LoRA artifact may enter the registry.

``admit`` refuses with a machine ``code`` and a reason (the checks, in order:
docs/DESIGN.md, "Admission"); the version digest covers exactly the bytes it checked.
Blocking (file I/O, hashing, tensor scan): async callers run it in a thread.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

from loraplex.adapter_store import OBJECT_SCHEMES, AdapterStore, StoreError, TooLarge
from loraplex.digest import digest_contents
from loraplex.modelinfo import PROJECTIONS
from loraplex.peft_config import (
    ADAPTER_FILES,
    CONFIG_FILE,
    WEIGHTS_FILE,
    ConfigLimits,
    LoraConfig,
    PeftConfigError,
    check_delta,
    read_config,
)
from loraplex.settings import Settings

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
DTYPE_SIZES = {"F16": 2, "BF16": 2, "F32": 4}
MAX_HEADER_BYTES = 100 * 1024 * 1024
MODULE_GROUP = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(?P<layer>\d+)\.(?P<group>self_attn|mlp)\."
    r"(?P<module>[A-Za-z0-9_]+)\.lora_(?P<ab>[AB])\.weight$"
)


class BaseDims(Protocol):
    """What admission needs of a base model (``ModelInfo`` or the registry row)."""

    @property
    def name(self) -> str: ...

    @property
    def revision(self) -> str: ...

    @property
    def num_layers(self) -> int: ...

    def projection_shape(self, module: str) -> tuple[int, int]: ...


class AdmissionError(Exception):
    """An adapter was refused. ``code`` is machine readable, ``message`` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class AdmittedAdapter:
    path: Path | None
    """The local directory it was read from (None: read from the store or an upload)."""
    uri: str
    sha256: str
    """The version digest over every file it is served from (``loraplex.digest``)."""
    size_bytes: int
    rank: int
    alpha: float
    target_modules: list[str]
    """Projections the tensors actually adapt (in ``PROJECTIONS`` order)."""
    num_tensors: int
    config: dict[str, Any] = field(default_factory=dict, compare=False)


def resolve_location(uri: str, settings: Settings) -> Path:
    """The adapter directory for ``uri``, or a refusal if it is not safely under the root."""
    if not uri or not isinstance(uri, str):
        raise AdmissionError("unsupported_uri", "adapter uri is empty")
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise AdmissionError("unsupported_uri", f"file URI with a host is not supported: {uri}")
        raw = unquote(parsed.path)
    elif parsed.scheme and len(parsed.scheme) > 1:
        raise AdmissionError("unsupported_uri",
                             f"scheme {parsed.scheme!r} is not supported; use file:// or a path under the adapter root")
    else:
        raw = uri
    if "\x00" in raw:
        raise AdmissionError("unsupported_uri", "adapter path contains a NUL byte")
    root = Path(settings.resolved_adapter_root()).resolve()
    candidate = Path(raw)
    if not candidate.is_absolute():
        candidate = root / candidate
    # Lexical check first ("..") then a component walk refusing any symlink below the root.
    lexical = Path(*_normalize(candidate.parts))
    try:
        rel = lexical.relative_to(root)
    except ValueError:
        raise AdmissionError("path_escape",
                             f"adapter path {raw!r} is outside the adapter root {root}") from None
    current = root
    try:
        for part in rel.parts:
            current = current / part
            if current.is_symlink():
                raise AdmissionError("symlink", f"adapter path goes through a symlink: {current}")
        if not current.exists():
            raise AdmissionError("not_found", f"adapter directory {current} does not exist")
        resolved = current.resolve()
    except OSError as exc:  # a name too long for the file system, a path it cannot read
        raise AdmissionError("not_found", f"adapter path {raw[:200]!r} cannot be read: "
                                          f"{exc.strerror or type(exc).__name__}") from None
    if resolved != root and root not in resolved.parents:
        raise AdmissionError("path_escape", f"adapter path {raw!r} resolves outside the adapter root")
    if not resolved.is_dir():
        raise AdmissionError("missing_file",
                             f"{resolved} is not a directory; an adapter is a PEFT directory with "
                             f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    return resolved


def _normalize(parts: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for part in parts:
        if part in ("", "."):
            continue
        if part == "..":
            if len(out) > 1:
                out.pop()
            continue
        out.append(part)
    return out


def admit(uri: str, base: BaseDims, settings: Settings, expected_revision: str | None = None, *,
          carried_from: BaseDims | None = None) -> AdmittedAdapter:
    """Run every check; return what the registry records, or raise ``AdmissionError``.

    Both files are read once into memory: every check and the digest cover those bytes.
    """
    if expected_revision and expected_revision != base.revision:
        raise AdmissionError("base_revision_mismatch",
                             f"expected base revision {expected_revision!r} but the registry has "
                             f"{base.name} at revision {base.revision!r}")
    path = resolve_location(uri, settings)
    _check_layout(path)
    contents = _read_files(path, settings.max_adapter_bytes)
    return admit_contents(contents, base, settings, uri=path.as_uri(), path=path, carried_from=carried_from)


def admit_contents(contents: dict[str, bytes], base: BaseDims, settings: Settings, *, uri: str,
                   path: Path | None = None, carried_from: BaseDims | None = None) -> AdmittedAdapter:
    """The checks on the adapter files' bytes (read from the adapter root, an upload or the store);
    ``uri`` is what the registry records for them. ``carried_from``: a base-model upgrade carries the
    version over from that base, so a config naming it (and its revision) is accepted for ``base``."""
    missing = [name for name in ADAPTER_FILES if name not in contents]
    if missing:
        raise AdmissionError("missing_file", f"{', '.join(missing)} is missing: only the PEFT layout "
                             f"({CONFIG_FILE} + {WEIGHTS_FILE}) is accepted")
    size = sum(len(data) for data in contents.values())
    if size > settings.max_adapter_bytes:
        raise AdmissionError("too_large", f"adapter is larger than the cap of {settings.max_adapter_bytes} bytes")
    try:
        cfg = read_config(contents[CONFIG_FILE], ConfigLimits.from_settings(settings))
    except PeftConfigError as exc:
        raise AdmissionError(exc.code, exc.message) from None
    _check_config(cfg, base, settings, carried_from)
    weights = contents[WEIGHTS_FILE]
    header = parse_safetensors_header(weights, WEIGHTS_FILE)
    num, modules, scales = _check_tensors(header, base, cfg, settings)
    _check_values(weights, header, scales, cfg)
    return AdmittedAdapter(path=path, uri=uri, sha256=digest_contents(contents), size_bytes=size,
                           rank=max(r for r, _ in scales.values()), alpha=cfg.lora_alpha, target_modules=modules, num_tensors=num,
                           config=cfg.raw)


def _check_layout(path: Path) -> None:
    for entry in sorted(path.rglob("*")):
        if entry.is_symlink():
            raise AdmissionError("symlink", f"adapter directory contains a symlink: {entry.relative_to(path)}")
        if entry.suffix.lower() in PICKLE_SUFFIXES:
            raise AdmissionError("pickle_format",
                                 f"pickle-based file {entry.relative_to(path)} is refused; "
                                 f"save the adapter as safetensors")
    for name in ADAPTER_FILES:
        if (path / name).exists() and not (path / name).is_file():
            raise AdmissionError("not_regular_file", f"{name} is not a regular file")
        if not (path / name).is_file():
            raise AdmissionError("missing_file", f"{name} is missing: only the PEFT layout "
                                 f"({CONFIG_FILE} + {WEIGHTS_FILE}) is accepted")


def _read_files(path: Path, max_bytes: int) -> dict[str, bytes]:
    """The adapter files' bytes. Each must be a regular file with one link (a hard link could
    bring in a file from outside the root), opened without following a symlink."""
    out: dict[str, bytes] = {}
    remaining = max_bytes
    for name in ADAPTER_FILES:
        try:
            fd = os.open(path / name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError as exc:
            raise AdmissionError("missing_file", f"{name} cannot be opened: {exc.strerror}") from None
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise AdmissionError("not_regular_file", f"{name} is not a regular file")
            if st.st_nlink != 1:
                raise AdmissionError("hard_link", f"{name} has {st.st_nlink} hard links; an adapter's files "
                                     f"must be its own (copy them instead of linking)")
            data = fh.read(remaining + 1)
        if len(data) > remaining:
            raise AdmissionError("too_large", f"adapter is larger than the cap of {max_bytes} bytes")
        remaining -= len(data)
        out[name] = data
    return out


def _check_config(cfg: LoraConfig, base: BaseDims, settings: Settings, carried_from: BaseDims | None = None) -> None:
    """What the shared reader cannot know: the allowed modules and the registered base model."""
    if isinstance(cfg.target_modules, tuple):
        allowed = set(settings.allowed_target_modules) & set(PROJECTIONS)
        bad = sorted(t for t in cfg.target_modules if t.rsplit(".", 1)[-1] not in allowed)
        if bad:
            raise AdmissionError("target_module_not_allowed",
                                 f"target modules {bad} are not allowed; allowed: {sorted(allowed)}")
    if carried_from is not None and cfg.names_base(carried_from.name) and \
            cfg.base_model_revision in (None, carried_from.revision):
        return
    if not cfg.names_base(base.name) and not cfg.local_base:
        raise AdmissionError("base_model_mismatch",
                             f"adapter_config.json says it was trained on {cfg.base_model_name_or_path!r}, not on "
                             f"the base model {base.name!r} it is registered against: register it against the base "
                             f"model it was trained on, or correct base_model_name_or_path (a local path there, "
                             f"as PEFT writes after local training, is accepted: the --base-model given at "
                             f"registration decides and the adapter's shapes are checked against it)")
    if cfg.base_model_revision is not None and cfg.base_model_revision != base.revision:
        raise AdmissionError("base_revision_mismatch",
                             f"adapter was trained on base revision {cfg.base_model_revision!r}; the registry's "
                             f"{base.name} is at revision {base.revision!r}")


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The checked header of a safetensors file on disk (see :func:`parse_safetensors_header`)."""
    return parse_safetensors_header(Path(path).read_bytes(), Path(path).name)


def parse_safetensors_header(data: bytes, name: str) -> dict[str, Any]:
    """Parse the safetensors header ourselves (8-byte LE length + JSON) and check the data
    region covers every tensor exactly, so truncated or padded files are refused."""
    file_size = len(data)
    if file_size < 8:
        raise AdmissionError("truncated", f"{name} is {file_size} bytes: too short for a header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES:
        raise AdmissionError("bad_header", f"{name} declares a {n}-byte header")
    if 8 + n > file_size:
        raise AdmissionError("truncated", f"{name} is truncated: header needs {n} bytes, "
                             f"{file_size - 8} present")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"), object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise AdmissionError("bad_header", f"{name} header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise AdmissionError("bad_header", f"{name} header is not a JSON object")
    data_len = file_size - 8 - n
    end_max = 0
    for tname, info in header.items():
        if tname == "__metadata__":
            continue
        if (not isinstance(info, dict) or not isinstance(info.get("shape"), list)
                or not isinstance(info.get("data_offsets"), list) or len(info["data_offsets"]) != 2):
            raise AdmissionError("bad_header", f"tensor {tname!r} has a malformed header entry")
        dtype = info.get("dtype")
        if dtype not in DTYPE_SIZES:
            raise AdmissionError("bad_dtype", f"tensor {tname!r} has dtype {dtype!r}; allowed: "
                                 f"{', '.join(DTYPE_SIZES)}")
        shape = info["shape"]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise AdmissionError("bad_header", f"tensor {tname!r} has an invalid shape {shape!r}")
        start, end = info["data_offsets"]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
            raise AdmissionError("bad_header", f"tensor {tname!r} has invalid data offsets")
        if end - start != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise AdmissionError("bad_header", f"tensor {tname!r}: byte length does not match shape and dtype")
        end_max = max(end_max, end)
    if end_max > data_len:
        raise AdmissionError("truncated", f"{name} is truncated: tensors need {end_max} data bytes, "
                             f"{data_len} present")
    if end_max < data_len:
        raise AdmissionError("bad_header", f"{name} has {data_len - end_max} trailing bytes")
    return header


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object without repeated keys (readers disagree on which one wins)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key is repeated")
    return out


def _check_tensors(header: dict[str, Any], base: BaseDims, cfg: LoraConfig,
                   settings: Settings) -> tuple[int, list[str], dict[tuple[int, str], tuple[int, float]]]:
    """Names, layers and shapes against the base model and the config; returns the tensor
    count, the adapted projections and each module's (rank, scale)."""
    allowed = set(settings.allowed_target_modules) & set(PROJECTIONS)
    seen: dict[tuple[int, str], set[str]] = {}
    scales: dict[tuple[int, str], tuple[int, float]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        m = TENSOR_NAME.match(name)
        if m is None:
            raise AdmissionError("unexpected_tensor", f"unexpected tensor {name!r} (only LoRA A/B weights of "
                                 f"decoder-layer projections are accepted)")
        layer, module, ab = int(m["layer"]), m["module"], m["ab"]
        if MODULE_GROUP.get(module) != m["group"]:
            raise AdmissionError("unexpected_tensor", f"tensor {name!r} names an unknown projection")
        if module not in allowed:
            raise AdmissionError("target_module_not_allowed",
                                 f"tensor {name!r} adapts {module}, which is not allowed; allowed: {sorted(allowed)}")
        dotted = f"model.layers.{layer}.{m['group']}.{module}"
        if not cfg.targets(dotted):
            raise AdmissionError("unexpected_tensor",
                                 f"tensor {name!r} is for {module}, which is not in target_modules")
        if layer >= base.num_layers:
            raise AdmissionError("layer_out_of_range",
                                 f"tensor {name!r}: layer {layer} but {base.name} has {base.num_layers} layers")
        if cfg.layers_to_transform is not None and layer not in cfg.layers_to_transform:
            raise AdmissionError("layer_out_of_range", f"tensor {name!r}: layer {layer} is outside layers_to_transform")
        try:
            rank, scale = cfg.rank_and_scale(dotted)
        except PeftConfigError as exc:
            raise AdmissionError(exc.code, exc.message) from None
        in_f, out_f = base.projection_shape(module)
        shape = tuple(info["shape"])
        want = (rank, in_f) if ab == "A" else (out_f, rank)
        if shape != want and cfg.fan_in_fan_out and shape == want[::-1]:
            want = shape  # fan_in_fan_out: the transposed layout, as the engine reads it
        if len(shape) == 2 and shape != want:
            r_dim, f_dim = (shape[0], shape[1]) if ab == "A" else (shape[1], shape[0])
            if f_dim == (in_f if ab == "A" else out_f) and r_dim != rank:
                raise AdmissionError("rank_mismatch",
                                     f"tensor {name!r} has rank {r_dim} but the config says r={rank}")
        if shape != want:
            raise AdmissionError("shape_mismatch",
                                 f"tensor {name!r} has shape {list(shape)}; {base.name} needs {list(want)}")
        seen.setdefault((layer, module), set()).add(ab)
        scales[(layer, module)] = (rank, scale)
    if not seen:
        raise AdmissionError("empty_adapter", "adapter has no LoRA tensors")
    for (layer, module), parts in sorted(seen.items()):
        if parts != {"A", "B"}:
            missing = "B" if "A" in parts else "A"
            raise AdmissionError("missing_tensor", f"layer {layer} {module} has no lora_{missing} weight")
    modules = sorted({module for _, module in seen}, key=PROJECTIONS.index)
    return sum(len(p) for p in seen.values()), modules, scales


def _check_values(data: bytes, header: dict[str, Any], scales: dict[tuple[int, str], tuple[int, float]],
                  cfg: LoraConfig) -> None:
    """No NaN / Inf in any tensor, and no module whose delta weight could overflow
    (``check_delta`` over each module's largest |A| and |B| entries).

    numpy over the file bytes: admission runs in the gateway process, which never imports torch.
    BF16 is widened to float32 by shifting its 16 bits into the high half.
    """
    import numpy as np

    (n,) = struct.unpack("<Q", data[:8])
    region = np.frombuffer(data, dtype=np.uint8, offset=8 + n)
    peak: dict[tuple[int, str], dict[str, float]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = region[start:end]
        if info["dtype"] == "F32":
            values = raw.view("<f4")
        elif info["dtype"] == "F16":
            values = raw.view("<f2")
        else:  # BF16
            values = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        if not bool(np.isfinite(values).all()):
            raise AdmissionError("non_finite", f"tensor {name!r} contains NaN or Inf values")
        m = TENSOR_NAME.match(name)
        assert m is not None  # _check_tensors accepted every name
        top = float(np.abs(values).max()) if values.size else 0.0
        peak.setdefault((int(m["layer"]), m["module"]), {})[m["ab"]] = top
    for (layer, module), (rank, scale) in sorted(scales.items()):
        p = peak[(layer, module)]
        try:
            check_delta(f"model.layers.{layer}.{MODULE_GROUP[module]}.{module}", scale, rank, p["A"], p["B"],
                        cfg.limits)
        except PeftConfigError as exc:
            raise AdmissionError(exc.code, exc.message) from None


async def admit_uri(uri: str, base: BaseDims, settings: Settings, store: AdapterStore,
                    expected_revision: str | None = None, *, carried_from: BaseDims | None = None) -> AdmittedAdapter:
    """Admission of ``uri``: a version in the adapter store is read from the store (the recorded
    URI is the store's, ending in ``/``); anything else from a directory under the adapter root."""
    import asyncio

    key = store.key_of(uri.rstrip("/") + "/") if isinstance(uri, str) and uri else None
    if key is None:
        if isinstance(uri, str) and uri.split("://", 1)[0].lower() in OBJECT_SCHEMES:
            raise AdmissionError("unsupported_uri", f"{uri!r} is not under the adapter store {store.url} "
                                 f"(LORAPLEX_ADAPTER_STORE)")
        return await asyncio.to_thread(lambda: admit(uri, base, settings, expected_revision,
                                                     carried_from=carried_from))
    if expected_revision and expected_revision != base.revision:
        raise AdmissionError("base_revision_mismatch",
                             f"expected base revision {expected_revision!r} but the registry has "
                             f"{base.name} at revision {base.revision!r}")
    contents = await read_version(store, key, settings.max_adapter_bytes)
    return await asyncio.to_thread(lambda: admit_contents(contents, base, settings, carried_from=carried_from,
                                                          uri=store.uri_for(key) if key else store.url))


async def read_version(store: AdapterStore, key: str, max_bytes: int) -> dict[str, bytes]:
    """The PEFT files under ``key`` (a prefix ending in ``/``) in ``store``, within ``max_bytes`` in all."""
    contents: dict[str, bytes] = {}
    remaining = max_bytes
    for name in ADAPTER_FILES:
        try:
            data = await store.read(key + name, remaining)
        except TooLarge:
            raise AdmissionError("too_large", f"adapter is larger than the cap of {max_bytes} bytes") from None
        except StoreError as exc:
            if exc.missing:
                raise AdmissionError("missing_file", f"{name} is missing at {store.url}{key}: only the PEFT "
                                     f"layout ({CONFIG_FILE} + {WEIGHTS_FILE}) is accepted") from None
            raise AdmissionError("store_unavailable", f"the adapter store could not be read: {exc}") from None
        remaining -= len(data)
        contents[name] = data
    return contents
