"""Where adapter files come from: sources keyed by URI scheme, and the local disk cache tier.

A source turns an :class:`~loraplex.wire.AdapterRef` URI into a local directory holding
``adapter_config.json`` + ``adapter_model.safetensors``. Local sources (a path or a
``file://`` URI) are read in place; remote sources (``http(s)://``) download into the disk
cache, keyed by the adapter *version id* (never its name), so a rollback can never pick
up another version's files. Object stores plug in as another :class:`AdapterSource`
registered for their scheme (``s3``, ``gs``, ...).

``AdapterRef.sha256`` (when set) is the sha256 of ``adapter_model.safetensors``, as the
registry computes it at admission; every load checks it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Protocol

from engine.lora.peft import CONFIG_FILE, WEIGHTS_FILE
from loraplex.wire import AdapterRef

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)


class AdapterFetchError(RuntimeError):
    """The adapter's files could not be obtained or failed verification."""


class AdapterSource(Protocol):
    """Fetches one adapter version. Implementations are called from loader threads."""

    schemes: tuple[str, ...]
    remote: bool
    """True: ``fetch`` downloads into ``dest`` (the result is cached on disk)."""

    def fetch(self, ref: AdapterRef, dest: Path | None) -> Path:
        """Return a directory holding the adapter files; remote sources write into ``dest``."""
        ...


class LocalSource:
    """A local directory, as a plain path or a ``file://`` URI."""

    schemes = ("", "file")
    remote = False

    def fetch(self, ref: AdapterRef, dest: Path | None) -> Path:
        path = local_path(ref.uri)
        if not path.is_dir():
            raise AdapterFetchError(f"adapter directory {path} does not exist")
        return path


class HttpSource:
    """``http(s)://.../dir``: GETs ``dir/adapter_config.json`` and ``dir/adapter_model.safetensors``."""

    schemes = ("http", "https")
    remote = True

    def __init__(self, *, timeout_s: float = 60.0, max_bytes: int = 512 * 1024 * 1024,
                 transport: object | None = None) -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.transport = transport  # an httpx transport (tests may pass httpx.MockTransport)

    def fetch(self, ref: AdapterRef, dest: Path | None) -> Path:
        import httpx

        if dest is None:
            raise AdapterFetchError("remote adapter sources need a download directory")
        base = ref.uri.rstrip("/") + "/"
        kwargs = {"transport": self.transport} if self.transport is not None else {}
        try:
            with httpx.Client(timeout=self.timeout_s, follow_redirects=True, **kwargs) as client:  # type: ignore[arg-type]
                for name in ADAPTER_FILES:
                    url = urllib.parse.urljoin(base, name)
                    total = 0
                    with client.stream("GET", url) as resp:
                        if resp.status_code != 200:
                            raise AdapterFetchError(f"GET {url} answered HTTP {resp.status_code}")
                        with open(dest / name, "wb") as fh:
                            for chunk in resp.iter_bytes(1 << 20):
                                total += len(chunk)
                                if total > self.max_bytes:
                                    raise AdapterFetchError(f"{url} is larger than {self.max_bytes} bytes")
                                fh.write(chunk)
        except httpx.HTTPError as exc:
            raise AdapterFetchError(f"download of {ref.uri} failed: {type(exc).__name__}: {exc}") from None
        return dest


class SourceRegistry:
    """Sources by URI scheme."""

    def __init__(self, sources: list[AdapterSource] | None = None) -> None:
        self._by_scheme: dict[str, AdapterSource] = {}
        for s in sources if sources is not None else [LocalSource(), HttpSource()]:
            self.register(s)

    def register(self, source: AdapterSource) -> None:
        for scheme in source.schemes:
            self._by_scheme[scheme] = source

    def for_uri(self, uri: str) -> AdapterSource:
        scheme = uri_scheme(uri)
        source = self._by_scheme.get(scheme)
        if source is None:
            known = ", ".join(repr(s) for s in sorted(self._by_scheme))
            raise AdapterFetchError(f"no adapter source for URI scheme {scheme!r} (known: {known})")
        return source


def uri_scheme(uri: str) -> str:
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", uri)
    return m.group(1).lower() if m else ""


def local_path(uri: str) -> Path:
    if uri_scheme(uri) == "file":
        parsed = urllib.parse.urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            raise AdapterFetchError(f"file URI with a remote host is not supported: {uri}")
        return Path(urllib.request.url2pathname(parsed.path))
    return Path(uri)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_sha256(ref: AdapterRef, directory: Path) -> None:
    if not ref.sha256:
        return
    f = directory / WEIGHTS_FILE
    if not f.is_file():
        raise AdapterFetchError(f"{WEIGHTS_FILE} not found in {directory}")
    got = sha256_file(f)
    if got.lower() != ref.sha256.lower():
        raise AdapterFetchError(f"sha256 mismatch for {ref.name or ref.id}: "
                                f"expected {ref.sha256}, got {got}")


class DiskCache:
    """``{root}/{version id}/``: remote adapters, complete directories only (atomic rename)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path_for(self, ref: AdapterRef) -> Path:
        key = ref.id if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", ref.id) else (
            "h-" + hashlib.sha256(ref.id.encode()).hexdigest())
        return self.root / key

    def get(self, ref: AdapterRef) -> Path | None:
        d = self.path_for(ref)
        return d if all((d / n).is_file() for n in ADAPTER_FILES) else None

    def fill(self, ref: AdapterRef, source: AdapterSource) -> Path:
        """Fetch into a temporary directory, verify the checksum, then move into place."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=self.root))
        try:
            got = source.fetch(ref, tmp)
            verify_sha256(ref, got)
            final = self.path_for(ref)
            if final.exists():
                shutil.rmtree(final, ignore_errors=True)
            os.replace(got, final)
            return final
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def remove(self, ref: AdapterRef) -> None:
        shutil.rmtree(self.path_for(ref), ignore_errors=True)

    def ids(self) -> list[str]:
        """Directory names of complete entries (the version ids, hashed when not path-safe)."""
        if not self.root.is_dir():
            return []
        return sorted(d.name for d in self.root.iterdir() if d.is_dir() and not d.name.startswith("."))

    def count(self) -> int:
        if not self.root.is_dir():
            return 0
        return sum(1 for d in self.root.iterdir() if d.is_dir() and not d.name.startswith("."))
