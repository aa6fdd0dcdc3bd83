"""Read a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

The result is a :class:`LoRAWeights` on CPU: for each (layer, projection) the adapter
touches, ``A [r, in]``, ``B [out, r]`` and the scale, so that the projection output
becomes ``y + (x @ A.T) @ B.T * scale`` exactly as PEFT's ``lora.Linear`` computes it.

Anything this engine cannot reproduce exactly is refused with the reason
(:class:`AdapterFormatError`), never silently approximated: DoRA, ``modules_to_save``,
LoRA biases, embedding/lm_head adapters, layer replication, pickle weight files.

``fan_in_fan_out`` describes the *base* layer's weight layout (GPT-2 ``Conv1D``); PEFT
keeps ``lora_A``/``lora_B`` as ``nn.Linear`` weights either way (and resets the flag to
False for ``nn.Linear`` bases such as Llama's). Tensors are therefore expected in the
``[r, in]`` / ``[out, r]`` layout; with ``fan_in_fan_out: true`` the transposed layout
(``[in, r]`` / ``[r, out]``) is also accepted and transposed on load.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loraplex.modelinfo import PROJECTIONS, ModelInfo

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
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


@dataclass(frozen=True)
class AdapterConfig:
    """The parts of ``adapter_config.json`` that decide the math."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str
    exclude_modules: tuple[str, ...] | str | None
    fan_in_fan_out: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    layers_to_transform: tuple[int, ...] | None
    raw: dict[str, Any]

    def rank_and_scale(self, module: str) -> tuple[int, float]:
        """Rank and scale PEFT gives ``module`` (a dotted name such as ``model.layers.0.self_attn.q_proj``)."""
        r = int(self.rank_pattern[k]) if (k := _pattern_key(self.rank_pattern, module)) else self.r
        alpha = float(self.alpha_pattern[k]) if (k := _pattern_key(self.alpha_pattern, module)) else self.lora_alpha
        if r <= 0:
            raise AdapterFormatError(f"{module}: rank must be positive, got {r}")
        scale = alpha / math.sqrt(r) if self.use_rslora else alpha / r
        return r, scale

    def targets(self, module: str) -> bool:
        """Whether PEFT would have adapted ``module`` under this config."""
        if self.exclude_modules and _matches(self.exclude_modules, module):
            return False
        if self.target_modules == "all-linear":
            return True
        return _matches(self.target_modules, module)


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    # Same rule as peft.utils.other.get_pattern_key.
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def _matches(targets: tuple[str, ...] | str, module: str) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def _refuse_unless(ok: bool, reason: str) -> None:
    if not ok:
        raise AdapterFormatError(reason)


def parse_config(raw: Mapping[str, Any]) -> AdapterConfig:
    """Validate ``adapter_config.json`` contents; refuse what cannot be served exactly."""
    _refuse_unless(isinstance(raw, Mapping), "adapter_config.json is not a JSON object")
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    _refuse_unless(peft_type == "LORA", f"peft_type {peft_type!r} is not supported (only LORA)")
    _refuse_unless(not raw.get("use_dora"), "DoRA adapters (use_dora) are not supported")
    _refuse_unless(not raw.get("modules_to_save"),
                   f"modules_to_save {raw.get('modules_to_save')!r} is not supported: "
                   "only LoRA deltas on decoder projections can be served from a shared base")
    bias = raw.get("bias", "none")
    _refuse_unless(bias in (None, "none"), f"bias={bias!r} is not supported (only 'none')")
    _refuse_unless(not raw.get("lora_bias"), "lora_bias is not supported")
    _refuse_unless(not raw.get("layer_replication"), "layer_replication is not supported")
    _refuse_unless(not raw.get("trainable_token_indices"), "trainable_token_indices is not supported")
    _refuse_unless(not raw.get("target_parameters"), "target_parameters is not supported")
    _refuse_unless(not raw.get("alora_invocation_tokens"), "activated LoRA (alora_invocation_tokens) is not supported")
    _refuse_unless(not raw.get("use_qalora"), "QA-LoRA (use_qalora) is not supported")
    try:
        r = int(raw.get("r", 8))
        alpha = float(raw.get("lora_alpha", 8))
        rank_pattern = {str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()}
        alpha_pattern = {str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()}
    except (TypeError, ValueError) as exc:
        raise AdapterFormatError(f"bad r / lora_alpha / rank_pattern / alpha_pattern: {exc}") from None
    _refuse_unless(r > 0, f"r must be positive, got {r}")
    _refuse_unless(math.isfinite(alpha), f"lora_alpha must be finite, got {alpha}")
    targets = _module_list(raw.get("target_modules"), "target_modules")
    _refuse_unless(targets is not None, "target_modules is missing")
    assert targets is not None
    exclude = _module_list(raw.get("exclude_modules"), "exclude_modules")
    ltt = raw.get("layers_to_transform")
    layers: tuple[int, ...] | None
    if ltt is None:
        layers = None
    elif isinstance(ltt, int) and not isinstance(ltt, bool):
        layers = (ltt,)
    elif isinstance(ltt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ltt):
        layers = tuple(ltt)
    else:
        raise AdapterFormatError(f"layers_to_transform must be an int or a list of ints, got {ltt!r}")
    return AdapterConfig(
        r=r, lora_alpha=alpha, use_rslora=bool(raw.get("use_rslora", False)),
        target_modules=targets, exclude_modules=exclude,
        fan_in_fan_out=bool(raw.get("fan_in_fan_out", False)),
        rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
        layers_to_transform=layers, raw=dict(raw),
    )


def _module_list(value: Any, name: str) -> tuple[str, ...] | str | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value != "all-linear":
            try:
                re.compile(value)
            except re.error as exc:
                raise AdapterFormatError(f"{name} is not a valid regular expression: {exc}") from None
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise AdapterFormatError(f"{name} must be a list of names or a regex string, got {value!r}")


def read_config(path: str | Path) -> AdapterConfig:
    p = Path(path) / CONFIG_FILE
    if not p.is_file():
        raise AdapterFormatError(f"{p.name} not found in {path}")
    try:
        raw = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterFormatError(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    return parse_config(raw)


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of ``adapter_model.safetensors``; pickle files are refused, never unpickled."""
    d = Path(path)
    f = d / WEIGHTS_FILE
    if not f.is_file():
        pickles = [name for name in PICKLE_FILES if (d / name).exists()]
        if pickles:
            raise AdapterFormatError(f"pickle weight files are refused ({', '.join(pickles)}); "
                                     f"convert the adapter to {WEIGHTS_FILE}")
        raise AdapterFormatError(f"{WEIGHTS_FILE} not found in {path}")
    from safetensors import SafetensorError, safe_open

    try:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for key in fh.keys():
                out[key] = fh.get_tensor(key)
        return out
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise AdapterFormatError(f"{WEIGHTS_FILE} is not a readable safetensors file: {exc}") from None


def build_weights(
    config: AdapterConfig,
    tensors: Mapping[str, torch.Tensor],
    model: ModelInfo | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    projections: Iterable[str] = PROJECTIONS,
) -> LoRAWeights:
    """Pair ``lora_A``/``lora_B`` tensors per module, check them against ``config`` and ``model``."""
    allowed = set(projections)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    names: dict[tuple[int, str], str] = {}
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
        if not bool(torch.isfinite(tensor).all()):
            raise AdapterFormatError(f"{key!r} contains NaN or Inf")
        halves.setdefault((layer, proj), {})[m["ab"]] = tensor
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
        modules[(layer, proj)] = LoRAModule(a.to(dtype).contiguous(), b.to(dtype).contiguous(), float(scale))
    rank = max(mod.rank for mod in modules.values())
    return LoRAWeights(modules=modules, rank=rank, config=dict(config.raw))


def load_adapter(
    path: str | Path,
    model: ModelInfo | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    projections: Iterable[str] = PROJECTIONS,
) -> LoRAWeights:
    """Read a PEFT adapter directory and validate it against ``model``'s projection shapes."""
    config = read_config(path)
    return build_weights(config, read_tensors(path), model, dtype=dtype, projections=projections)
