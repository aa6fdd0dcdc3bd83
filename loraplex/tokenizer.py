"""Tokenizer and chat template, from a Hugging Face directory or from GGUF metadata.

Torch-free: workers tokenize with it, and the gateway counts prompts with the same class,
rebuilt from the form a worker serves (``to_dict``/``from_dict``; docs/DESIGN.md, "The
tokenizer route").
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:
    from loraplex.gguf_file import GGUFFile


class ChatTemplateError(ValueError):
    """The messages could not be rendered by the model's chat template."""


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen")


def _gguf_pre_tokenizer(pre: str | None) -> Any:
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT if pre in _QWEN2_PRE else None
    if split is not None:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile_template(source: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, *, bos_token: str | None, eos_token: str | None,
                 add_bos: bool, chat_template: str | None, extra_special: dict[str, Any] | None = None) -> None:
        self.tk = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.extra_special = extra_special or {}
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self._token_bytes: dict[int, bytes] = {}
        self._byte_fallback_ids: frozenset[int] | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> TextTokenizer:
        p = Path(path)
        tk = Tokenizer.from_file(str(p / "tokenizer.json"))
        cfg_path = p / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = p / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        bos = _token_str(cfg.get("bos_token"))
        eos = _token_str(cfg.get("eos_token"))
        # tokenizer.json's post-processor adds BOS when the model wants it; add it ourselves
        # only when the config asks for it and the post-processor does not.
        add_bos = bool(cfg.get("add_bos_token", False))
        if add_bos and bos is not None:
            probe = tk.encode("a", add_special_tokens=True).ids
            add_bos = not (probe and probe[0] == tk.token_to_id(bos))
        extra = {k: _token_str(v) for k, v in cfg.items() if k in ("unk_token", "pad_token")}
        return cls(tk, bos_token=bos, eos_token=eos, add_bos=add_bos, chat_template=template, extra_special=extra)

    @classmethod
    def from_gguf(cls, path: str | Path, reader: GGUFFile | None = None) -> TextTokenizer:
        """``reader``: ``path`` already parsed (shared with the weights' load)."""
        if reader is None:
            from loraplex.gguf_file import read_gguf

            reader = read_gguf(path)
        get = reader.get

        kind = get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer {kind!r} is not supported (only gpt2-style byte-level BPE)")
        tokens: list[str] = list(get("tokenizer.ggml.tokens"))
        types: list[int] = list(get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges") or []]
        alphabet = set(_bytes_to_unicode().values())
        spell = _bytes_to_unicode()
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            key = t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))
            vocab.setdefault(key, i)
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False)
        tk = Tokenizer(bpe)
        tk.pre_tokenizer = _gguf_pre_tokenizer(get("tokenizer.ggml.pre"))
        tk.decoder = decoders.ByteLevel()
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
        control = [AddedToken(t, normalized=False, special=True)
                   for t, ty in zip(tokens, types, strict=True) if ty == 3 and set(t) <= alphabet]
        if control:
            tk.add_special_tokens(control)
        user = [AddedToken(t, normalized=False, special=False)
                for t, ty in zip(tokens, types, strict=True) if ty == 4 and t in vocab]
        if user:
            tk.add_tokens(user)

        def tok(key: str) -> str | None:
            i = get(key)
            return None if i is None else tokens[int(i)]

        return cls(tk, bos_token=tok("tokenizer.ggml.bos_token_id"), eos_token=tok("tokenizer.ggml.eos_token_id"),
                   add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=get("tokenizer.chat_template"),
                   extra_special={"unk_token": tok("tokenizer.ggml.unknown_token_id"),
                                  "pad_token": tok("tokenizer.ggml.padding_token_id")})

    @classmethod
    def from_model_path(cls, path: str | Path, gguf_reader: GGUFFile | None = None) -> TextTokenizer:
        p = Path(path)
        return cls.from_gguf(p, gguf_reader) if p.suffix == ".gguf" else cls.from_hf_dir(p)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form that ``from_dict`` turns back into an equal tokenizer."""
        return {"tokenizer": self.tk.to_str(), "bos_token": self.bos_token, "eos_token": self.eos_token,
                "add_bos": self.add_bos, "chat_template": self.chat_template, "extra_special": self.extra_special}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TextTokenizer:
        return cls(Tokenizer.from_str(data["tokenizer"]), bos_token=data.get("bos_token"),
                   eos_token=data.get("eos_token"), add_bos=bool(data.get("add_bos")),
                   chat_template=data.get("chat_template"), extra_special=data.get("extra_special") or {})

    # ------------------------------------------------------------------ use
    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def count(self, text: str, add_special_tokens: bool = True) -> int:
        """``len(encode(...))`` without building offsets (the gateway's per-request count)."""
        return len(self.ids(text, add_special_tokens))

    def ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``encode(...)`` without building offsets: the gateway counts prompts and hashes their
        prefixes for routing with it, at the cost of a count."""
        fast = getattr(self.tk, "encode_batch_fast", None)
        ids = (fast([text], add_special_tokens=add_special_tokens)[0] if fast is not None
               else self.tk.encode(text, add_special_tokens=add_special_tokens)).ids
        return [self.bos_token_id, *ids] if add_special_tokens and self.add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE piece may be part of a character)."""
        b = self._token_bytes.get(token_id)
        if b is None:
            piece = self.tk.id_to_token(token_id)
            inverse = _unicode_to_bytes()
            if piece is not None and isinstance(self.tk.decoder, decoders.ByteLevel) and all(c in inverse for c in piece):
                b = bytes(inverse[c] for c in piece)
            else:
                b = self.tk.decode([token_id], skip_special_tokens=False).encode("utf-8")
            self._token_bytes[token_id] = b
        return b

    @property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of SentencePiece byte-fallback tokens (``<0xE2>``): a run of them decodes as one
        piece of UTF-8, or every byte as U+FFFD when the run is not valid UTF-8."""
        if self._byte_fallback_ids is None:
            self._byte_fallback_ids = frozenset(
                i for piece, i in self.tk.get_vocab(with_added_tokens=False).items()
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"))
        return self._byte_fallback_ids

    def token_text(self, token_id: int) -> str:
        """The token as text (invalid UTF-8 of a partial character shows as U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", "replace")

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> str:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        from jinja2.exceptions import TemplateError

        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                **{k: v or "" for k, v in self.extra_special.items()}, **kwargs)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered template (special tokens come from the template itself)."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)
