"""Where adapter files come from: sources keyed by URI scheme, the allow-list of configured
sources (:class:`SourcePolicy`) and the local disk cache tier (:class:`DiskCache`).

A source turns an :class:`~loraplex.wire.AdapterRef` URI into a local directory holding the
PEFT files; every load checks the version digest over exactly the bytes it then parses
(:func:`read_verified`). Rules: docs/DESIGN.md, "Sources" and "Tiers".
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from loraplex.adapter_store import OBJECT_SCHEMES, AdapterStore, StoreError
from loraplex.digest import digest_contents, digest_directory
from loraplex.peft_config import ADAPTER_FILES
from loraplex.settings import Settings
from loraplex.wire import AdapterRef

DEFAULT_PORTS = {"http": 80, "https": 443}
STALE_PARTIAL_S = 3600.0
"""A ``.partial-*`` directory of the disk cache idle this long is left over from a dead process."""

log = logging.getLogger(__name__)


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

    schemes: tuple[str, ...] = ("", "file")
    remote = False

    def fetch(self, ref: AdapterRef, dest: Path | None) -> Path:
        path = Path(os.path.realpath(local_path(ref.uri)))
        if not path.is_dir():
            raise AdapterFetchError(f"adapter directory {path} does not exist")
        return path


class HttpSource:
    """``http(s)://.../dir``: GETs ``dir/adapter_config.json`` and ``dir/adapter_model.safetensors``."""

    schemes: tuple[str, ...] = ("http", "https")
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
            # Redirects are not followed: they could lead outside the configured sources.
            with httpx.Client(timeout=self.timeout_s, follow_redirects=False, trust_env=False,
                              **kwargs) as client:  # type: ignore[arg-type]
                for name in ADAPTER_FILES:
                    url = urllib.parse.urljoin(base, name)
                    total = 0
                    with client.stream("GET", url) as resp:
                        if resp.is_redirect:
                            raise AdapterFetchError(f"GET {url} answered a redirect (HTTP {resp.status_code}); "
                                                    f"redirects are not followed")
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


class StoreSource:
    """The configured object store (``s3://``, ``gs://``, ``az://``): GETs the version's files with the
    store client's timeout and retries. Only URIs under the store root are fetched (the store's
    credentials are not handed to other buckets)."""

    remote = True

    def __init__(self, store: AdapterStore, *, max_bytes: int = 512 * 1024 * 1024) -> None:
        self.store = store
        self.schemes: tuple[str, ...] = (uri_scheme(store.url),)
        self.max_bytes = max_bytes

    def fetch(self, ref: AdapterRef, dest: Path | None) -> Path:
        if dest is None:
            raise AdapterFetchError("remote adapter sources need a download directory")
        key = self.store.key_of(ref.uri.rstrip("/") + "/")
        if key is None:
            raise AdapterFetchError(f"adapter uri {ref.uri!r} is not under the adapter store {self.store.url}")
        remaining = self.max_bytes
        for name in ADAPTER_FILES:
            try:
                data = self.store.read_sync(key + name, remaining)
            except StoreError as exc:
                raise AdapterFetchError(f"fetch of {ref.uri} failed: {exc}") from None
            remaining -= len(data)
            (dest / name).write_bytes(data)
        return dest


class SourcePolicy:
    """The URI prefixes adapters may be fetched from.

    ``file:///dir/`` (or a plain absolute path) allows that directory and below, compared
    after resolving symlinks and ``..``; ``http(s)://host[:port]/path/`` allows URLs with
    that scheme, host, port and path prefix. URIs with userinfo, a query, a fragment or
    dot segments are refused.
    """

    def __init__(self, prefixes: Iterable[str]) -> None:
        self.prefixes = tuple(p for p in prefixes if p)
        self._dirs: list[str] = []
        self._urls: list[tuple[str, str, int, str]] = []
        self._objects: list[str] = []
        for prefix in self.prefixes:
            scheme = uri_scheme(prefix)
            if scheme in ("", "file"):
                path = local_path(prefix)
                if not path.is_absolute():
                    raise ValueError(f"adapter source {prefix!r} must be an absolute path or file:// URI")
                self._dirs.append(str(path))
            elif scheme in DEFAULT_PORTS:
                self._urls.append(_url_parts(prefix, prefix=True))
            elif scheme in OBJECT_SCHEMES:
                self._objects.append(_object_prefix(prefix, prefix=True))
            else:
                raise ValueError(f"adapter source {prefix!r}: only file://, http(s)://, s3://, gs:// and az:// "
                                 f"are supported")

    @classmethod
    def from_settings(cls, settings: Settings) -> SourcePolicy:
        return cls(settings.resolved_adapter_sources())

    def check(self, uri: str) -> None:
        """Raise :class:`AdapterFetchError` unless ``uri`` is under a configured source."""
        if not self._allows(uri):
            raise AdapterFetchError(f"adapter uri {uri!r} is not under a configured adapter source "
                                    f"({', '.join(self.prefixes) or 'none'}); see LORAPLEX_ADAPTER_SOURCES")

    def _allows(self, uri: str) -> bool:
        scheme = uri_scheme(uri)
        try:
            if scheme in ("", "file"):
                path = os.path.realpath(local_path(uri))
                return any(_under(path, os.path.realpath(d)) for d in self._dirs)
            if scheme in DEFAULT_PORTS:
                got = _url_parts(uri, prefix=False)
                return any(got[:3] == want[:3] and (got[3].rstrip("/") + "/").startswith(want[3])
                           for want in self._urls)
            if scheme in OBJECT_SCHEMES:
                obj = _object_prefix(uri, prefix=True)
                return any(obj.startswith(want) for want in self._objects)
        except (AdapterFetchError, ValueError, OSError):
            return False
        return False


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _object_prefix(uri: str, *, prefix: bool) -> str:
    """``scheme://bucket/path`` of an object-store URI, refusing userinfo, queries and dot segments."""
    parts = urllib.parse.urlsplit(uri)
    if parts.username is not None or "@" in parts.netloc or parts.query or parts.fragment or not parts.netloc:
        raise ValueError(f"{uri!r}: expected scheme://bucket/path without userinfo, query or fragment")
    decoded = urllib.parse.unquote(parts.path)
    if "\\" in decoded or any(seg in (".", "..") for seg in decoded.split("/")):
        raise ValueError(f"{uri!r}: dot segments are not allowed in adapter URIs")
    path = parts.path.rstrip("/") + "/" if prefix else parts.path
    return f"{parts.scheme.lower()}://{parts.netloc}{path if path.startswith('/') else '/' + path}"


def _url_parts(url: str, *, prefix: bool) -> tuple[str, str, int, str]:
    """(scheme, host, port, path) of an http(s) URL; ``prefix``: the path as a directory prefix."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ValueError(f"{url!r}: userinfo is not allowed in adapter URIs")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: a query or fragment is not allowed in adapter URIs")
    if not parts.hostname:
        raise ValueError(f"{url!r} has no host")
    decoded = urllib.parse.unquote(parts.path)
    if "\\" in decoded or any(seg in (".", "..") for seg in decoded.split("/")):
        raise ValueError(f"{url!r}: dot segments are not allowed in adapter URIs")
    scheme = parts.scheme.lower()
    path = parts.path or "/"
    if prefix:
        path = path.rstrip("/") + "/"
    return scheme, parts.hostname.lower(), parts.port or DEFAULT_PORTS[scheme], path


class SourceRegistry:
    """Sources by URI scheme, behind an optional :class:`SourcePolicy` (the worker always has one)."""

    def __init__(self, sources: list[AdapterSource] | None = None, *, policy: SourcePolicy | None = None) -> None:
        self._by_scheme: dict[str, AdapterSource] = {}
        self.policy = policy
        if sources is None:
            sources = [LocalSource(), HttpSource()]
        for s in sources:
            self.register(s)

    def register(self, source: AdapterSource) -> None:
        for scheme in source.schemes:
            self._by_scheme[scheme] = source

    def for_uri(self, uri: str) -> AdapterSource:
        """The source for ``uri``, once the policy allows it (nothing is opened before)."""
        if self.policy is not None:
            self.policy.check(uri)
        scheme = uri_scheme(uri)
        source = self._by_scheme.get(scheme)
        if source is None:
            known = ", ".join(repr(s) for s in sorted(self._by_scheme))
            raise AdapterFetchError(f"no adapter source for URI scheme {scheme!r} (known: {known})")
        return source


def sources_from_settings(settings: Settings) -> SourceRegistry:
    """The worker's sources: local directories, http(s) and the configured object store, behind
    the allow-list of ``adapter_sources``."""
    fetchers: list[AdapterSource] = [LocalSource(), HttpSource(max_bytes=settings.max_adapter_bytes)]
    if settings.resolved_adapter_store().split("://", 1)[0].lower() in OBJECT_SCHEMES:
        from loraplex.adapter_store import open_store

        fetchers.append(StoreSource(open_store(settings), max_bytes=settings.max_adapter_bytes))
    return SourceRegistry(fetchers, policy=SourcePolicy.from_settings(settings))


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


def read_verified(ref: AdapterRef, directory: Path) -> dict[str, bytes]:
    """The adapter files' bytes, checked against ``ref.sha256`` (the version digest) when set:
    what is parsed next is exactly what was verified."""
    from engine.lora.peft import read_files  # here: fetching and caching stay torch-free (vllm-agent)

    contents = read_files(directory)
    if ref.sha256:
        _compare(ref, digest_contents(contents))
    return contents


def verify_digest(ref: AdapterRef, directory: Path) -> None:
    """Check the files in ``directory`` against ``ref.sha256`` (before a download is kept)."""
    if not ref.sha256:
        return
    missing = [n for n in ADAPTER_FILES if not (directory / n).is_file()]
    if missing:
        raise AdapterFetchError(f"{', '.join(missing)} not found in {directory}")
    _compare(ref, digest_directory(directory))


def _compare(ref: AdapterRef, got: str) -> None:
    if got != (ref.sha256 or "").lower():
        raise AdapterFetchError(f"sha256 mismatch for {ref.name or ref.id}: expected {ref.sha256}, got {got} "
                                f"(the digest over {' and '.join(ADAPTER_FILES)}); the files changed "
                                f"after registration")


class DiskCache:
    """``{root}/{version id}/``: remote adapters, complete directories only (atomic rename).

    Bounded by ``max_bytes`` (0: unbounded): :meth:`get` marks an entry used (its directory's
    mtime), and after each :meth:`fill` the least recently used entries are deleted until the
    complete entries fit, never the one just filled. An evicted version is fetched again from
    its source on its next load. Several workers may share ``root``: each fill lists ``root``
    once (one stat per entry) and sizes only entries it has not sized yet, so entries other
    processes added, replaced or removed are counted. ``.partial-*`` directories are work in progress
    (downloads, entries being deleted); construction removes those idle for an hour.
    """

    def __init__(self, root: str | Path, *, max_bytes: int = 0,
                 on_evict: Callable[[str, int], None] | None = None) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        """Called with ``(entry name, bytes freed)`` for each eviction."""
        self._sizes: dict[str, tuple[tuple[int, int], int]] = {}  # name -> ((inode, ctime), bytes)
        self._lock = threading.Lock()
        self._remove_stale_partials()
        if max_bytes:
            self._scan()

    def path_for(self, ref: AdapterRef) -> Path:
        key = ref.id if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", ref.id) else (
            "h-" + hashlib.sha256(ref.id.encode()).hexdigest())
        return self.root / key

    def has(self, ref: AdapterRef) -> bool:
        """Whether a complete entry for ``ref`` is there (without marking it used)."""
        d = self.path_for(ref)
        return all((d / n).is_file() for n in ADAPTER_FILES)

    def get(self, ref: AdapterRef) -> Path | None:
        d = self.path_for(ref)
        if not all((d / n).is_file() for n in ADAPTER_FILES):
            return None
        try:
            os.utime(d)  # most recently used: evicted last
        except FileNotFoundError:  # evicted meanwhile
            return None
        return d

    def fill(self, ref: AdapterRef, source: AdapterSource) -> Path:
        """Fetch into a temporary directory, verify the checksum, move into place, then evict
        least recently used entries down to the budget."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=self.root))
        try:
            got = source.fetch(ref, tmp)
            verify_digest(ref, got)
            final = self.path_for(ref)
            self._discard(final)
            os.replace(got, final)
            os.utime(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if self.max_bytes:
            try:
                self._evict(keep=final.name)
            except OSError as exc:  # the adapter is in place; a failed cleanup must not fail its load
                log.warning("disk cache eviction failed: %s", exc)
        return final

    def remove(self, ref: AdapterRef) -> None:
        self._discard(self.path_for(ref))

    def ids(self) -> list[str]:
        """Directory names of complete entries (the version ids, hashed when not path-safe)."""
        return sorted(self._entries())

    def count(self) -> int:
        return len(self._entries())

    def _evict(self, keep: str) -> None:
        with self._lock:
            entries = self._scan()
            total = sum(size for _, size in entries.values())
            kept = entries.get(keep, (0, 0))[1]
            if kept > self.max_bytes:
                log.warning("adapter %s alone (%d bytes) exceeds the disk cache budget of %d bytes; kept",
                            keep, kept, self.max_bytes)
            for name in sorted((n for n in entries if n != keep), key=lambda n: entries[n][0]):
                if total <= self.max_bytes:
                    break
                size = entries[name][1]
                total -= size
                if not self._discard(self.root / name):
                    continue  # another process removed it first
                self._sizes.pop(name, None)
                log.info("evicted adapter %s from the disk cache (%d bytes freed)", name, size)
                if self.on_evict is not None:
                    self.on_evict(name, size)

    def _scan(self) -> dict[str, tuple[int, int]]:
        """Complete entries: name -> (last use in ns, bytes). Refreshes the size index: entries
        new to it or changed since (inode and ctime: replaced, or marked used) are sized;
        vanished ones are dropped."""
        entries: dict[str, tuple[int, int]] = {}
        sizes: dict[str, tuple[tuple[int, int], int]] = {}
        for de in self._entries().values():
            try:
                st = de.stat(follow_symlinks=False)
                stamp = (st.st_ino, st.st_ctime_ns)
                known = self._sizes.get(de.name)
                size = known[1] if known is not None and known[0] == stamp else _tree_bytes(de.path)
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            sizes[de.name] = (stamp, size)
            entries[de.name] = (st.st_mtime_ns, size)
        self._sizes = sizes
        return entries

    def _entries(self) -> dict[str, os.DirEntry[str]]:
        try:
            with os.scandir(self.root) as it:
                return {de.name: de for de in it
                        if not de.name.startswith(".") and de.is_dir(follow_symlinks=False)}
        except FileNotFoundError:
            return {}

    def _discard(self, path: Path) -> bool:
        """Delete an entry: an atomic rename out of the way (readers see all of it or nothing,
        and one process wins), then the removal. False when it did not exist."""
        trash = self.root / f".partial-gone-{uuid.uuid4().hex}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return False
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def _remove_stale_partials(self) -> None:
        cutoff = time.time() - STALE_PARTIAL_S
        try:
            with os.scandir(self.root) as it:
                stale = [de.path for de in it if de.name.startswith(".partial-")
                         and de.is_dir(follow_symlinks=False) and _idle_since(de.path, cutoff)]
        except FileNotFoundError:
            return
        for path in stale:
            log.info("removing stale partial directory %s from the adapter disk cache", path)
            shutil.rmtree(path, ignore_errors=True)


def _tree_bytes(path: str) -> int:
    total = 0
    with os.scandir(path) as it:
        for de in it:
            if de.is_dir(follow_symlinks=False):
                total += _tree_bytes(de.path)
            else:
                total += de.stat(follow_symlinks=False).st_size
    return total


def _idle_since(path: str, cutoff: float) -> bool:
    """True when neither the directory nor a file in it changed after ``cutoff`` (a download
    writes its files); False when it vanished meanwhile."""
    try:
        with os.scandir(path) as it:
            return all(de.stat(follow_symlinks=False).st_mtime < cutoff for de in it) and \
                os.stat(path).st_mtime < cutoff
    except FileNotFoundError:
        return False
