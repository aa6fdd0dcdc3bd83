"""Adapter admission: decide whether a PEFT LoRA artifact may enter the registry.

Checks, in order, each refusal naming a machine ``code`` and a human message:

* location: ``file://`` URI or plain path inside the configured adapter root, no symlinks
  on the way or inside the adapter directory (``unsupported_uri``, ``path_escape``,
  ``symlink``, ``not_found``);
* layout: PEFT only (``adapter_config.json`` + ``adapter_model.safetensors``); any pickle
  format present is refused (``pickle_format``, ``missing_file``), size cap (``too_large``);
* config: LoRA only, no DoRA / ``modules_to_save`` / per-module ranks / biases / layer
  replication / token training (``unsupported_feature``), rank cap (``rank_too_large``),
  allowed target modules (``target_module_not_allowed``), base revision
  (``base_revision_mismatch``); rsLoRA and ``layers_to_transform`` are fine;
* safetensors header, parsed by hand so truncated files are caught (``truncated``,
  ``bad_header``); every tensor's name, dtype, shape and layer index checked against the
  base model (``unexpected_tensor``, ``bad_dtype``, ``shape_mismatch``, ``layer_out_of_range``,
  ``missing_tensor``, ``rank_mismatch``);
* values: no NaN / Inf (``non_finite``); sha256 of ``adapter_model.safetensors``.

Blocking (file I/O, hashing, tensor scan): async callers run it in a thread.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

from loraplex.modelinfo import PROJECTIONS
from loraplex.settings import Settings

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
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

    name: str
    revision: str
    num_layers: int

    def projection_shape(self, module: str) -> tuple[int, int]: ...


class AdmissionError(Exception):
    """An adapter was refused. ``code`` is machine readable, ``message`` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class AdmittedAdapter:
    path: Path
    uri: str
    sha256: str
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
    for part in rel.parts:
        current = current / part
        if current.is_symlink():
            raise AdmissionError("symlink", f"adapter path goes through a symlink: {current}")
    if not current.exists():
        raise AdmissionError("not_found", f"adapter directory {current} does not exist")
    resolved = current.resolve()
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


def admit(uri: str, base: BaseDims, settings: Settings, expected_revision: str | None = None) -> AdmittedAdapter:
    """Run every check; return what the registry records, or raise ``AdmissionError``."""
    if expected_revision and expected_revision != base.revision:
        raise AdmissionError("base_revision_mismatch",
                             f"expected base revision {expected_revision!r} but the registry has "
                             f"{base.name} at revision {base.revision!r}")
    path = resolve_location(uri, settings)
    _check_layout(path)
    weights = path / WEIGHTS_FILE
    size = weights.stat().st_size + (path / CONFIG_FILE).stat().st_size
    if size > settings.max_adapter_bytes:
        raise AdmissionError("too_large", f"adapter is {size} bytes; the cap is {settings.max_adapter_bytes}")
    config = _read_config(path / CONFIG_FILE)
    cfg = _check_config(config, base, settings)
    header = read_safetensors_header(weights)
    num, modules = _check_tensors(header, base, cfg, settings)
    _check_finite(weights, header)
    return AdmittedAdapter(path=path, uri=path.as_uri(), sha256=sha256_file(weights), size_bytes=size,
                           rank=cfg.rank, alpha=cfg.alpha, target_modules=modules, num_tensors=num, config=config)


def _check_layout(path: Path) -> None:
    for entry in sorted(path.rglob("*")):
        if entry.is_symlink():
            raise AdmissionError("symlink", f"adapter directory contains a symlink: {entry.relative_to(path)}")
        if entry.suffix.lower() in PICKLE_SUFFIXES:
            raise AdmissionError("pickle_format",
                                 f"pickle-based file {entry.relative_to(path)} is refused; "
                                 f"save the adapter as safetensors")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise AdmissionError("missing_file", f"{name} is missing: only the PEFT layout "
                                 f"({CONFIG_FILE} + {WEIGHTS_FILE}) is accepted")


def _read_config(path: Path) -> dict[str, Any]:
    if path.stat().st_size > 1024 * 1024:
        raise AdmissionError("bad_config", f"{CONFIG_FILE} is larger than 1 MiB")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdmissionError("bad_config", f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdmissionError("bad_config", f"{CONFIG_FILE} must be a JSON object")
    return config


UNSUPPORTED_FLAGS: dict[str, str] = {
    "use_dora": "DoRA adapters (use_dora) are not supported",
    "modules_to_save": "modules_to_save is not supported (LoRA deltas on decoder projections only)",
    "rank_pattern": "rank_pattern (per-module ranks) is not supported",
    "alpha_pattern": "alpha_pattern (per-module alphas) is not supported",
    "lora_bias": "lora_bias is not supported",
    "layer_replication": "layer_replication is not supported",
    "trainable_token_indices": "trainable_token_indices (embedding training) is not supported",
    "target_parameters": "target_parameters is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "fan_in_fan_out": "fan_in_fan_out is not supported (Llama projections are nn.Linear)",
}


@dataclass(frozen=True)
class _Config:
    rank: int
    alpha: float
    targets: frozenset[str] | None
    """Named target modules, or None when the config gives a regex (tensors decide)."""
    layers: frozenset[int] | None


def _check_config(config: dict[str, Any], base: BaseDims, settings: Settings) -> _Config:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdmissionError("unsupported_feature", f"peft_type {peft_type!r} is not supported (LoRA only)")
    for key, message in UNSUPPORTED_FLAGS.items():
        if config.get(key):
            raise AdmissionError("unsupported_feature", f"{message}: {key}={config[key]!r}")
    if config.get("bias", "none") not in ("none", None):
        raise AdmissionError("unsupported_feature", f"bias={config['bias']!r} is not supported (only 'none')")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdmissionError("bad_config", f"r must be a positive integer, got {rank!r}")
    if rank > settings.max_lora_rank:
        raise AdmissionError("rank_too_large", f"rank {rank} exceeds the cap of {settings.max_lora_rank}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise AdmissionError("bad_config", f"lora_alpha must be a positive number, got {alpha!r}")
    raw_targets = config.get("target_modules")
    targets: frozenset[str] | None
    if isinstance(raw_targets, str) and raw_targets:
        targets = None  # a regex or "all-linear": every tensor's module is checked against the allow-list
    elif isinstance(raw_targets, list) and raw_targets and all(isinstance(t, str) for t in raw_targets):
        allowed = set(settings.allowed_target_modules) & set(PROJECTIONS)
        bad = sorted(t for t in raw_targets if t.rsplit(".", 1)[-1] not in allowed)
        if bad:
            raise AdmissionError("target_module_not_allowed",
                                 f"target modules {bad} are not allowed; allowed: {sorted(allowed)}")
        targets = frozenset(t.rsplit(".", 1)[-1] for t in raw_targets)
    else:
        raise AdmissionError("bad_config", "target_modules must be a non-empty list of module names or a regex")
    ltt = config.get("layers_to_transform")
    layers: frozenset[int] | None = None
    if isinstance(ltt, int) and not isinstance(ltt, bool):
        layers = frozenset((ltt,))
    elif isinstance(ltt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ltt):
        layers = frozenset(ltt)
    elif ltt is not None:
        raise AdmissionError("bad_config", f"layers_to_transform must be an int or a list of ints, got {ltt!r}")
    revision = config.get("base_model_revision")
    if revision is not None and str(revision) != base.revision:
        raise AdmissionError("base_revision_mismatch",
                             f"adapter was trained on base revision {revision!r}; the registry's "
                             f"{base.name} is at revision {base.revision!r}")
    return _Config(rank=rank, alpha=float(alpha), targets=targets, layers=layers)


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """Parse the safetensors header ourselves (8-byte LE length + JSON) and check the data
    region covers every tensor exactly, so truncated or padded files are refused."""
    file_size = path.stat().st_size
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise AdmissionError("truncated", f"{path.name} is {file_size} bytes: too short for a header")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES:
            raise AdmissionError("bad_header", f"{path.name} declares a {n}-byte header")
        if 8 + n > file_size:
            raise AdmissionError("truncated", f"{path.name} is truncated: header needs {n} bytes, "
                                 f"{file_size - 8} present")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdmissionError("bad_header", f"{path.name} header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise AdmissionError("bad_header", f"{path.name} header is not a JSON object")
    data_len = file_size - 8 - n
    end_max = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if (not isinstance(info, dict) or not isinstance(info.get("shape"), list)
                or not isinstance(info.get("data_offsets"), list) or len(info["data_offsets"]) != 2):
            raise AdmissionError("bad_header", f"tensor {name!r} has a malformed header entry")
        dtype = info.get("dtype")
        if dtype not in DTYPE_SIZES:
            raise AdmissionError("bad_dtype", f"tensor {name!r} has dtype {dtype!r}; allowed: "
                                 f"{', '.join(DTYPE_SIZES)}")
        shape = info["shape"]
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise AdmissionError("bad_header", f"tensor {name!r} has an invalid shape {shape!r}")
        start, end = info["data_offsets"]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
            raise AdmissionError("bad_header", f"tensor {name!r} has invalid data offsets")
        if end - start != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise AdmissionError("bad_header", f"tensor {name!r}: byte length does not match shape and dtype")
        end_max = max(end_max, end)
    if end_max > data_len:
        raise AdmissionError("truncated", f"{path.name} is truncated: tensors need {end_max} data bytes, "
                             f"{data_len} present")
    if end_max < data_len:
        raise AdmissionError("bad_header", f"{path.name} has {data_len - end_max} trailing bytes")
    return header


def _check_tensors(header: dict[str, Any], base: BaseDims, cfg: _Config,
                   settings: Settings) -> tuple[int, list[str]]:
    allowed = set(settings.allowed_target_modules) & set(PROJECTIONS)
    seen: dict[tuple[int, str], set[str]] = {}
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
        if cfg.targets is not None and module not in cfg.targets:
            raise AdmissionError("unexpected_tensor",
                                 f"tensor {name!r} is for {module}, which is not in target_modules")
        if layer >= base.num_layers:
            raise AdmissionError("layer_out_of_range",
                                 f"tensor {name!r}: layer {layer} but {base.name} has {base.num_layers} layers")
        if cfg.layers is not None and layer not in cfg.layers:
            raise AdmissionError("layer_out_of_range", f"tensor {name!r}: layer {layer} is outside layers_to_transform")
        in_f, out_f = base.projection_shape(module)
        shape = tuple(info["shape"])
        want = (cfg.rank, in_f) if ab == "A" else (out_f, cfg.rank)
        if len(shape) == 2:
            r_dim, f_dim = (shape[0], shape[1]) if ab == "A" else (shape[1], shape[0])
            if f_dim == (in_f if ab == "A" else out_f) and r_dim != cfg.rank:
                raise AdmissionError("rank_mismatch",
                                     f"tensor {name!r} has rank {r_dim} but the config says r={cfg.rank}")
        if shape != want:
            raise AdmissionError("shape_mismatch",
                                 f"tensor {name!r} has shape {list(shape)}; {base.name} needs {list(want)}")
        seen.setdefault((layer, module), set()).add(ab)
    if not seen:
        raise AdmissionError("empty_adapter", "adapter has no LoRA tensors")
    for (layer, module), parts in sorted(seen.items()):
        if parts != {"A", "B"}:
            missing = "B" if "A" in parts else "A"
            raise AdmissionError("missing_tensor", f"layer {layer} {module} has no lora_{missing} weight")
    modules = sorted({module for _, module in seen}, key=PROJECTIONS.index)
    return sum(len(p) for p in seen.values()), modules


def _check_finite(path: Path, header: dict[str, Any]) -> None:
    """Scan every tensor for NaN/Inf straight from the (already validated) file bytes.

    numpy over a memory map: admission runs in the gateway process, which never imports torch.
    BF16 is widened to float32 by shifting its 16 bits into the high half.
    """
    import numpy as np

    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    try:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            raw = data[start:end]
            if info["dtype"] == "F32":
                values = raw.view("<f4")
            elif info["dtype"] == "F16":
                values = raw.view("<f2")
            else:  # BF16
                values = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
            if not bool(np.isfinite(values).all()):
                raise AdmissionError("non_finite", f"tensor {name!r} contains NaN or Inf values")
    finally:
        del data


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()
