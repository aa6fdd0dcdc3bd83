"""The identity of an adapter version: one sha256 over every file it is served from.

The digest is the sha256 of a canonical manifest, one line per file in name order::

    loraplex-adapter-v1
    adapter_config.json <sha256 of its bytes>
    adapter_model.safetensors <sha256 of its bytes>
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path

from loraplex.peft_config import ADAPTER_FILES

MANIFEST_HEADER = "loraplex-adapter-v1"
_HEX64 = re.compile(r"[0-9a-f]{64}")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def manifest(file_sha256: Mapping[str, str]) -> bytes:
    """The canonical manifest of ``{file name: sha256 hex}``."""
    if set(file_sha256) != set(ADAPTER_FILES):
        raise ValueError(f"an adapter version is {', '.join(ADAPTER_FILES)}; got {sorted(file_sha256)}")
    lines = [MANIFEST_HEADER, *(f"{name} {file_sha256[name].lower()}" for name in sorted(file_sha256))]
    return ("\n".join(lines) + "\n").encode()


def version_digest(file_sha256: Mapping[str, str]) -> str:
    """The version digest from per-file sha256 hex digests."""
    return sha256_bytes(manifest(file_sha256))


def digest_contents(contents: Mapping[str, bytes]) -> str:
    """The version digest of files held in memory (``{file name: bytes}``)."""
    return version_digest({name: sha256_bytes(data) for name, data in contents.items()})


def digest_directory(directory: Path) -> str:
    """The version digest of the adapter files in ``directory`` (read from disk)."""
    return version_digest({name: sha256_file(Path(directory) / name) for name in ADAPTER_FILES})


def is_digest(value: object) -> bool:
    """A lowercase or uppercase 64-digit hex string."""
    return isinstance(value, str) and _HEX64.fullmatch(value.lower()) is not None
