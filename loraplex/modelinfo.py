"""What a base model is, read without loading its weights: architecture, dimensions, revision.

From a Hugging Face directory (``config.json`` + ``*.safetensors``) or a ``.gguf`` file; the
revision is a content hash, so hosts with the same bytes agree on it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplex.gguf_file import GGUFFile

PROJECTIONS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """A decoder's architecture numbers: the one description the registry checks adapters
    against and the engine builds its model from (``engine.config.ModelConfig`` adds only
    what running it needs)."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def projection_shape(self, module: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of one decoder-layer projection."""
        q, kv = self.q_size, self.kv_size
        shapes = {
            "q_proj": (self.hidden_size, q),
            "k_proj": (self.hidden_size, kv),
            "v_proj": (self.hidden_size, kv),
            "o_proj": (q, self.hidden_size),
            "gate_proj": (self.hidden_size, self.intermediate_size),
            "up_proj": (self.hidden_size, self.intermediate_size),
            "down_proj": (self.intermediate_size, self.hidden_size),
        }
        if module not in shapes:
            raise KeyError(f"unknown projection {module!r}; known: {', '.join(PROJECTIONS)}")
        return shapes[module]


@dataclass(frozen=True)
class ModelInfo(ModelShape):
    """A base model as the registry records it: its shape, a name and a content revision."""

    name: str
    revision: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def hf_shape(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``ModelShape`` fields of a Hugging Face ``config.json``."""
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return {
        "architecture": str(cfg.get("model_type") or "llama").lower(),
        "hidden_size": hidden,
        "intermediate_size": int(cfg["intermediate_size"]),
        "num_layers": int(cfg["num_hidden_layers"]),
        "num_heads": heads,
        "num_kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or hidden // heads),
        "vocab_size": int(cfg["vocab_size"]),
        "context_length": int(cfg.get("max_position_embeddings", 2048)),
    }


def gguf_getter(reader: GGUFFile) -> Any:
    """``get(key, default)`` over a GGUF file's metadata; the pseudo-key
    ``tokenizer.ggml.tokens.__len__`` is the vocabulary's length."""

    def get(key: str, default: Any = None) -> Any:
        if key == "tokenizer.ggml.tokens.__len__":
            tokens = reader.get("tokenizer.ggml.tokens")
            return default if tokens is None else len(tokens)
        return reader.get(key, default)

    return get


def gguf_shape(get: Any) -> dict[str, Any]:
    """The ``ModelShape`` fields of GGUF metadata (``get`` from :func:`gguf_getter`)."""
    arch = str(get("general.architecture"))
    heads = int(get(f"{arch}.attention.head_count"))
    hidden = int(get(f"{arch}.embedding_length"))
    vocab = get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = get("tokenizer.ggml.tokens.__len__")
    return {
        "architecture": arch,
        "hidden_size": hidden,
        "intermediate_size": int(get(f"{arch}.feed_forward_length")),
        "num_layers": int(get(f"{arch}.block_count")),
        "num_heads": heads,
        "num_kv_heads": int(get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(get(f"{arch}.attention.key_length", hidden // heads)),
        "vocab_size": int(vocab),
        "context_length": int(get(f"{arch}.context_length", 2048)),
    }


def model_files(path: str | Path) -> list[Path]:
    """The files whose bytes define the model (what the revision hashes)."""
    p = Path(path)
    if p.is_file():
        return [p]
    files = [p / "config.json", *sorted(p.glob("*.safetensors"))]
    missing = [f.name for f in files if not f.is_file()]
    if missing or len(files) < 2:
        raise FileNotFoundError(f"{p} is not a Hugging Face model directory "
                                f"(needs config.json and *.safetensors)")
    return files


def revision_of(path: str | Path, chunk: int = 1 << 22) -> str:
    """Content hash (first 16 hex chars of sha256 over the model files, in order)."""
    h = hashlib.sha256()
    for f in model_files(path):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while block := fh.read(chunk):
                h.update(block)
    return h.hexdigest()[:16]


def describe_model(path: str | Path, name: str | None = None, revision: str | None = None,
                   shape: ModelShape | None = None) -> ModelInfo:
    """Read dimensions from ``config.json`` or GGUF metadata (or take ``shape``, already read from
    the same files); hash the files for the revision."""
    p = Path(path)
    gguf = p.is_file() and p.suffix == ".gguf"
    default_name = p.name.removesuffix(".gguf").split(".")[0] if gguf else p.name
    if shape is not None:
        dims = {f.name: getattr(shape, f.name) for f in fields(ModelShape)}
    elif gguf:
        from loraplex.gguf_file import read_gguf

        dims = gguf_shape(gguf_getter(read_gguf(p)))
    else:
        dims = hf_shape(json.loads((p / "config.json").read_text()))
    return ModelInfo(name=name or default_name, revision=revision or revision_of(p), **dims)
