"""The one reader of a PEFT LoRA ``adapter_config.json``, for admission and the engine alike.

Strict JSON, PEFT's own defaults, unsupported features refused with a machine ``code``, and the
bounds of :class:`ConfigLimits` (rank, alpha, scale per module; the delta-weight peak through
:func:`check_delta`): docs/DESIGN.md, "Admission". Pure Python (no torch).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
"""Every file an adapter version is served from (what its digest covers)."""
MAX_CONFIG_BYTES = 1024 * 1024
FLOAT16_MAX = 65504.0

UNSUPPORTED_FLAGS: dict[str, str] = {
    "use_dora": "DoRA adapters (use_dora) are not supported",
    "modules_to_save": "modules_to_save is not supported: only LoRA deltas on decoder projections "
                       "can be served from a shared base",
    "lora_bias": "lora_bias is not supported",
    "layer_replication": "layer_replication is not supported",
    "trainable_token_indices": "trainable_token_indices (embedding training) is not supported",
    "target_parameters": "target_parameters is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
}


class PeftConfigError(ValueError):
    """The config cannot be served. ``code`` is machine readable, ``message`` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ConfigLimits:
    max_rank: int = 64
    max_scale: float = 256.0
    max_delta: float = FLOAT16_MAX

    @classmethod
    def from_settings(cls, settings: Any) -> ConfigLimits:
        return cls(max_rank=settings.max_lora_rank, max_scale=settings.max_lora_scale,
                   max_delta=settings.max_lora_delta)


@dataclass(frozen=True)
class LoraConfig:
    """The parts of ``adapter_config.json`` that decide the math, validated."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str
    """Module names (matched on a dotted suffix), a regex (full match), or ``"all-linear"``."""
    exclude_modules: tuple[str, ...] | str | None
    fan_in_fan_out: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    layers_to_transform: frozenset[int] | None
    base_model_name_or_path: str
    base_model_revision: str | None
    limits: ConfigLimits = field(default_factory=ConfigLimits, compare=False)
    raw: dict[str, Any] = field(default_factory=dict, compare=False)

    def rank_and_scale(self, module: str) -> tuple[int, float]:
        """Rank and scale PEFT gives ``module`` (a dotted name such as ``model.layers.0.self_attn.q_proj``);
        refuses a scale over ``limits.max_scale``."""
        r = self.rank_pattern[k] if (k := _pattern_key(self.rank_pattern, module)) else self.r
        alpha = self.alpha_pattern[k] if (k := _pattern_key(self.alpha_pattern, module)) else self.lora_alpha
        return r, self.checked_scale(module, alpha, r)

    def checked_scale(self, what: str, alpha: float, r: int) -> float:
        scale = lora_scale(alpha, r, self.use_rslora)
        if not math.isfinite(scale) or scale > self.limits.max_scale:
            raise PeftConfigError("scale_too_large",
                                  f"{what}: scale {scale:g} (lora_alpha {alpha:g}, r {r}"
                                  f"{', rsLoRA' if self.use_rslora else ''}) exceeds the cap of "
                                  f"{self.limits.max_scale:g}")
        return scale

    def targets(self, module: str) -> bool:
        """Whether PEFT would have adapted ``module`` under this config."""
        if self.exclude_modules and _matches(self.exclude_modules, module):
            return False
        if self.target_modules == "all-linear":
            return True
        return _matches(self.target_modules, module)

    @property
    def local_base(self) -> bool:
        """``base_model_name_or_path`` is a path on the training machine (what PEFT writes after
        training from a local copy: ``/home/me/models/base``, ``./base``, ``C:\\models``), not a hub
        id (``org/Model`` or ``Model``): it names no model, so the registration's base decides and
        the adapter's shapes are the check."""
        name = (self.base_model_name_or_path or "").rstrip("/\\")
        return bool(name) and (name.startswith(("/", "./", "../", "~", ".\\", "..\\")) or "\\" in name
                               or re.match(r"^[A-Za-z]:", name) is not None or name.count("/") >= 2)

    def names_base(self, name: str) -> bool:
        """Whether ``base_model_name_or_path`` (empty: unknown) names the base model ``name``:
        the last path component, case-insensitively (a hub id ``org/Model`` names ``Model``)."""
        return not self.base_model_name_or_path or _last_part(self.base_model_name_or_path) == _last_part(name)


def lora_scale(alpha: float, r: int, use_rslora: bool) -> float:
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def check_delta(module: str, scale: float, rank: int, max_abs_a: float, max_abs_b: float,
                limits: ConfigLimits) -> None:
    """Refuse a module whose delta weight ``scale * B @ A`` could hold an entry over ``max_delta``."""
    bound = scale * rank * max_abs_a * max_abs_b
    if not math.isfinite(bound) or bound > limits.max_delta:
        raise PeftConfigError("delta_too_large",
                              f"{module}: the delta weight may reach {bound:g} (scale {scale:g} x r {rank} x "
                              f"max|A| {max_abs_a:g} x max|B| {max_abs_b:g}); the cap is {limits.max_delta:g}")


def read_config(data: bytes, limits: ConfigLimits | None = None) -> LoraConfig:
    """Parse and validate the bytes of ``adapter_config.json``."""
    return parse_config(loads(data), limits)


def loads(data: bytes) -> dict[str, Any]:
    """Strict JSON object: refuses NaN/Infinity, overflowing numbers and duplicate keys."""
    if len(data) > MAX_CONFIG_BYTES:
        raise PeftConfigError("bad_config", f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite_float,
                         object_pairs_hook=_unique_keys)
    except PeftConfigError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise PeftConfigError("bad_config", f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise PeftConfigError("bad_config", f"{CONFIG_FILE} must be a JSON object")
    return raw


def _refuse_constant(name: str) -> float:
    raise PeftConfigError("bad_config", f"{CONFIG_FILE} contains {name}: non-finite numbers are refused")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise PeftConfigError("bad_config", f"{CONFIG_FILE} contains {text}, which is not a finite float")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise PeftConfigError("bad_config", f"{CONFIG_FILE} repeats the key {key!r}")
        out[key] = value
    return out


def parse_config(raw: Mapping[str, Any], limits: ConfigLimits | None = None) -> LoraConfig:
    """Validate parsed ``adapter_config.json`` contents; refuse what cannot be served exactly."""
    limits = limits or ConfigLimits()
    if not isinstance(raw, Mapping):
        raise PeftConfigError("bad_config", f"{CONFIG_FILE} must be a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise PeftConfigError("unsupported_feature", f"peft_type {peft_type!r} is not supported (LoRA only)")
    for key, message in UNSUPPORTED_FLAGS.items():
        if raw.get(key):
            raise PeftConfigError("unsupported_feature", f"{message}: {key}={raw[key]!r}")
    if raw.get("bias", "none") not in ("none", None):
        raise PeftConfigError("unsupported_feature", f"bias={raw['bias']!r} is not supported (only 'none')")
    r = _rank(raw.get("r", 8), "r", limits)
    alpha = _alpha(raw.get("lora_alpha", 8), "lora_alpha")
    rank_pattern = {k: _rank(v, f"rank_pattern[{k!r}]", limits)
                    for k, v in _pattern(raw.get("rank_pattern"), "rank_pattern").items()}
    alpha_pattern = {k: _alpha(v, f"alpha_pattern[{k!r}]")
                     for k, v in _pattern(raw.get("alpha_pattern"), "alpha_pattern").items()}
    use_rslora = _flag(raw.get("use_rslora"), "use_rslora")
    targets = _module_list(raw.get("target_modules"), "target_modules")
    if not targets:
        raise PeftConfigError("bad_config", "target_modules must be a non-empty list of module names or a regex")
    base_name = raw.get("base_model_name_or_path")
    if base_name is not None and not isinstance(base_name, str):
        raise PeftConfigError("bad_config", f"base_model_name_or_path must be a string, got {base_name!r}")
    revision = raw.get("base_model_revision")
    config = LoraConfig(
        r=r, lora_alpha=alpha, use_rslora=use_rslora, target_modules=targets,
        exclude_modules=_module_list(raw.get("exclude_modules"), "exclude_modules"),
        fan_in_fan_out=_flag(raw.get("fan_in_fan_out"), "fan_in_fan_out"),
        rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
        layers_to_transform=_layers(raw.get("layers_to_transform")),
        base_model_name_or_path=base_name or "", base_model_revision=None if revision is None else str(revision),
        limits=limits, raw=dict(raw),
    )
    config.checked_scale("lora_alpha / r", alpha, r)
    return config


def _rank(value: Any, name: str, limits: ConfigLimits) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PeftConfigError("bad_config", f"{name} must be a positive integer, got {value!r}")
    if value > limits.max_rank:
        raise PeftConfigError("rank_too_large", f"{name}: rank {value} exceeds the cap of {limits.max_rank}")
    return value


def _alpha(value: Any, name: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise PeftConfigError("bad_config", f"{name} must be a positive number, got {value!r}")
    try:
        alpha = float(value)
    except OverflowError:
        alpha = math.inf
    if not math.isfinite(alpha) or alpha <= 0:
        raise PeftConfigError("bad_config", f"{name} must be a finite positive number, got {value!r}")
    return alpha


def _flag(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise PeftConfigError("bad_config", f"{name} must be true or false, got {value!r}")
    return value


def _pattern(value: Any, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PeftConfigError("bad_config", f"{name} must be an object, got {value!r}")
    for key in value:
        try:
            re.compile(key)
        except re.error as exc:
            raise PeftConfigError("bad_config", f"{name} key {key!r} is not a valid regular expression: "
                                  f"{exc}") from None
    return dict(value)


def _layers(value: Any) -> frozenset[int] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return frozenset((value,))
    if isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return frozenset(value)
    raise PeftConfigError("bad_config", f"layers_to_transform must be an int or a list of ints, got {value!r}")


def _module_list(value: Any, name: str) -> tuple[str, ...] | str | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value != "all-linear":
            try:
                re.compile(value)
            except re.error as exc:
                raise PeftConfigError("bad_config", f"{name} is not a valid regular expression: {exc}") from None
        return value or None
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise PeftConfigError("bad_config", f"{name} must be a list of module names or a regex string, got {value!r}")


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


def _last_part(name: str) -> str:
    return PurePosixPath(name.replace("\\", "/").rstrip("/")).name.lower()
