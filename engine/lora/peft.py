"""Read a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

The result is a :class:`LoRAWeights` on CPU: per (layer, projection) ``A [r, in]``, ``B [out, r]``
and the scale, so the output becomes ``y + (x @ A.T) @ B.T * scale`` exactly as PEFT computes it.
Anything not reproducible exactly is refused (:class:`AdapterFormatError`); the config is read by
:mod:`loraplex.peft_config`.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loraplex import peft_config
from loraplex.modelinfo import PROJECTIONS, ModelInfo
from loraplex.peft_config import (
    ADAPTER_FILES,
    CONFIG_FILE,
    WEIGHTS_FILE,
    ConfigLimits,
    LoraConfig,
    PeftConfigError,
    check_delta,
)

PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "adapter_model.ckpt")

_KEY = re.compile(
    r"^(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<proj>[a-z_]+))"
    r"\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
_PREFIX = "base_model.model."


class AdapterFormatError(ValueError):
    """The adapter cannot be served; the message says why."""


@dataclass(frozen=True)
class LoRAModule:
    """One adapted projection: ``delta = (x @ a.T) @ b.T * scale``."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class LoRAWeights:
    """An adapter in host memory, keyed by ``(layer_index, projection_name)``."""

    modules: dict[tuple[int, str], LoRAModule]
    rank: int
    """Largest rank over the modules (picks the slot rank class)."""
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def projections(self) -> set[str]:
        return {proj for (_layer, proj) in self.modules}

    @property
    def nbytes(self) -> int:
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size()
                   for m in self.modules.values())

    def pin_memory(self) -> LoRAWeights:
        """A copy in page-locked memory (for asynchronous host->device copies)."""
        mods = {k: LoRAModule(m.a.pin_memory(), m.b.pin_memory(), m.scale) for k, m in self.modules.items()}
        return LoRAWeights(mods, self.rank, dict(self.config))


def parse_config_bytes(data: bytes, limits: ConfigLimits | None = None) -> LoraConfig:
    """``adapter_config.json`` bytes through the shared reader (:mod:`loraplex.peft_config`)."""
    try:
        return peft_config.read_config(data, limits)
    except PeftConfigError as exc:
        raise AdapterFormatError(exc.message) from None


def parse_config(raw: Mapping[str, Any], limits: ConfigLimits | None = None) -> LoraConfig:
    """Parsed ``adapter_config.json`` contents through the shared reader."""
    try:
        return peft_config.parse_config(raw, limits)
    except PeftConfigError as exc:
        raise AdapterFormatError(exc.message) from None


def read_files(path: str | Path) -> dict[str, bytes]:
    """The bytes of the adapter files in ``path`` (regular files, no symlink followed);
    pickle weight files are refused, never unpickled."""
    d = Path(path)
    if not (d / WEIGHTS_FILE).exists():
        pickles = [name for name in PICKLE_FILES if (d / name).exists()]
        if pickles:
            raise AdapterFormatError(f"pickle weight files are refused ({', '.join(pickles)}); "
                                     f"convert the adapter to {WEIGHTS_FILE}")
    out: dict[str, bytes] = {}
    for name in ADAPTER_FILES:
        try:
            fd = os.open(d / name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise AdapterFormatError(f"{name} not found in {path}") from None
        except OSError as exc:
            raise AdapterFormatError(f"{name} in {path} cannot be opened: {exc.strerror}") from None
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise AdapterFormatError(f"{name} in {path} is not a regular file")
            out[name] = fh.read()
    return out


def peak(t: torch.Tensor) -> float:
    """``max |t|`` (0 for an empty tensor): NaN where ``t`` holds a NaN, inf where it holds an Inf.
    One pass, and about five times quicker than ``isfinite(t).all()`` on CPU."""
    return float(t.abs().amax()) if t.numel() else 0.0


def parse_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """Tensors of ``adapter_model.safetensors`` from its bytes."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(data)
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise AdapterFormatError(f"{WEIGHTS_FILE} is not a readable safetensors file: {exc}") from None


def build_weights(
    config: LoraConfig,
    tensors: Mapping[str, torch.Tensor],
    model: ModelInfo | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    projections: Iterable[str] = PROJECTIONS,
) -> LoRAWeights:
    """Pair ``lora_A``/``lora_B`` tensors per module, check them against ``config`` and ``model``."""
    try:
        return _build_weights(config, tensors, model, dtype, projections)
    except PeftConfigError as exc:
        raise AdapterFormatError(exc.message) from None


def _build_weights(config: LoraConfig, tensors: Mapping[str, torch.Tensor], model: ModelInfo | None,
                   dtype: torch.dtype, projections: Iterable[str]) -> LoRAWeights:
    allowed = set(projections)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    names: dict[tuple[int, str], str] = {}
    peaks: dict[tuple[int, str, str], float] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterFormatError(f"unsupported tensor {key!r}: only lora_A/lora_B of decoder "
                                     f"projections ({', '.join(sorted(allowed))}) can be served")
        layer, proj = int(m["layer"]), m["proj"]
        if proj not in allowed:
            raise AdapterFormatError(f"unsupported target module {proj!r} in {key!r}")
        if model is not None and layer >= model.num_layers:
            raise AdapterFormatError(f"{key!r}: layer {layer} does not exist (base model has {model.num_layers})")
        module = m["module"].removeprefix(_PREFIX)
        if not config.targets(module):
            raise AdapterFormatError(f"{key!r} is not covered by target_modules {config.target_modules!r}")
        if config.layers_to_transform is not None and layer not in config.layers_to_transform:
            raise AdapterFormatError(f"{key!r}: layer {layer} is outside layers_to_transform")
        if not tensor.is_floating_point():
            raise AdapterFormatError(f"{key!r} has non-float dtype {tensor.dtype}")
        if tensor.dim() != 2:
            raise AdapterFormatError(f"{key!r} must be 2-D, has shape {tuple(tensor.shape)}")
        top = peak(tensor)
        if not math.isfinite(top):
            raise AdapterFormatError(f"{key!r} contains NaN or Inf")
        halves.setdefault((layer, proj), {})[m["ab"]] = tensor
        peaks[(layer, proj, m["ab"])] = top
        names[(layer, proj)] = module

    if not halves:
        raise AdapterFormatError(f"{WEIGHTS_FILE} holds no LoRA weights")
    modules: dict[tuple[int, str], LoRAModule] = {}
    for (layer, proj), pair in sorted(halves.items()):
        module = names[(layer, proj)]
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterFormatError(f"{module}: {missing} is missing")
        r, scale = config.rank_and_scale(module)
        a, b = pair["A"], pair["B"]
        if model is not None:
            fan_in, fan_out = model.projection_shape(proj)
        else:
            fan_in, fan_out = (a.shape[1], b.shape[0]) if a.shape[0] == r else (a.shape[0], b.shape[1])
        if tuple(a.shape) == (r, fan_in) and tuple(b.shape) == (fan_out, r):
            pass
        elif config.fan_in_fan_out and tuple(a.shape) == (fan_in, r) and tuple(b.shape) == (r, fan_out):
            a, b = a.t(), b.t()
        else:
            raise AdapterFormatError(
                f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not match rank {r} "
                f"and the base projection (in={fan_in}, out={fan_out}); expected "
                f"[{r}, {fan_in}] / [{fan_out}, {r}]")
        check_delta(module, scale, r, peaks[(layer, proj, "A")], peaks[(layer, proj, "B")], config.limits)
        modules[(layer, proj)] = LoRAModule(a.to(dtype).contiguous(), b.to(dtype).contiguous(), float(scale))
    rank = max(mod.rank for mod in modules.values())
    return LoRAWeights(modules=modules, rank=rank, config=dict(config.raw))


def load_adapter(
    path: str | Path,
    model: ModelInfo | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    projections: Iterable[str] = PROJECTIONS,
    limits: ConfigLimits | None = None,
) -> LoRAWeights:
    """Read a PEFT adapter directory and validate it against ``model``'s projection shapes."""
    return load_adapter_files(read_files(path), model, dtype=dtype, projections=projections, limits=limits)


def load_adapter_files(
    contents: Mapping[str, bytes],
    model: ModelInfo | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    projections: Iterable[str] = PROJECTIONS,
    limits: ConfigLimits | None = None,
) -> LoRAWeights:
    """An adapter from the bytes of its files (``{file name: bytes}``, as :func:`read_files` gives)."""
    config = parse_config_bytes(contents[CONFIG_FILE], limits)
    return build_weights(config, parse_tensors(contents[WEIGHTS_FILE]), model, dtype=dtype, projections=projections)
