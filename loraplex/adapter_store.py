"""Adapter stores: where the catalogue of adapter versions lives (docs/DESIGN.md, "Adapter stores").

One small interface, two implementations chosen by ``LORAPLEX_ADAPTER_STORE``:

* :class:`DirectoryStore`: a local directory (the embedded default, ``{adapter_root}/store``);
* :class:`ObjectStore`: S3-compatible object storage (``s3://bucket/prefix``; also ``gs://`` and
  ``az://``) through obstore, with its timeouts and retries. Credentials and the endpoint come from
  the client library's standard environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...), never
  from the registry.

Versions are content-addressed: a version's files live under ``sha256/{version digest}/``, so
two uploads of the same bytes share one copy and a URI names exactly one content. Keys are
``/``-separated paths relative to the store root. The registry calls the async methods; the
worker's loader threads call :meth:`AdapterStore.read_sync`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import tempfile
import urllib.parse
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from loraplex.peft_config import ADAPTER_FILES
from loraplex.settings import Settings

OBJECT_SCHEMES = ("s3", "gs", "az")
CONTENT_PREFIX = "sha256/"
UPLOAD_PREFIX = "uploads/"
"""Temporary objects of uploads in progress (deleted when the upload ends, either way)."""
_KEY = re.compile(r"^[A-Za-z0-9._=-][A-Za-z0-9._=/-]{0,1023}$")


class StoreError(RuntimeError):
    """The store could not be reached or answered an error (``missing``: the object does not exist)."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


class TooLarge(StoreError):
    """An object is larger than the caller's cap."""


@dataclass(frozen=True)
class StoredObject:
    key: str
    size: int
    modified: datetime


def version_prefix(digest: str) -> str:
    """The key prefix of a content-addressed version (``sha256/{digest}/``)."""
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ValueError(f"not a version digest: {digest!r}")
    return f"{CONTENT_PREFIX}{digest}/"


def check_key(key: str) -> str:
    if not _KEY.match(key) or any(part in ("", ".", "..") for part in key.rstrip("/").split("/")):
        raise StoreError(f"invalid store key {key!r}")
    return key


class AdapterStore(Protocol):
    url: str
    """The store root as a URI ending in ``/`` (``file:///...`` or ``s3://bucket/prefix/``)."""

    def key_of(self, uri: str) -> str | None:
        """The key of ``uri`` inside this store, or None when it is not under the store root."""
        ...

    def uri_for(self, key: str) -> str: ...

    async def put(self, key: str, data: bytes | AsyncIterable[bytes]) -> int:
        """Write an object (atomically: readers see the old or the new one); returns its size."""
        ...

    async def read(self, key: str, max_bytes: int) -> bytes: ...

    def read_sync(self, key: str, max_bytes: int) -> bytes: ...

    async def delete(self, keys: list[str]) -> None:
        """Delete objects; keys that do not exist are ignored."""
        ...

    async def list(self, prefix: str) -> list[StoredObject]: ...


def _under(uri: str, root: str) -> str | None:
    if not uri.startswith(root) and uri.rstrip("/") + "/" != root:
        return None
    key = uri[len(root):] if uri.startswith(root) else ""
    if "?" in key or "#" in key or "%" in key:
        return None
    try:
        return check_key(key) if key else ""
    except StoreError:
        return None


class DirectoryStore:
    """Objects as files under a local directory (writes go to a temporary file, then a rename)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.url = self.root.as_uri().rstrip("/") + "/"

    def key_of(self, uri: str) -> str | None:
        if uri.startswith("file://"):
            return _under(uri, self.url)
        if uri.startswith("/"):
            return _under(Path(os.path.normpath(uri)).as_uri() + ("/" if uri.endswith("/") else ""), self.url)
        return None

    def uri_for(self, key: str) -> str:
        return self.url + check_key(key)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    async def put(self, key: str, data: bytes | AsyncIterable[bytes]) -> int:
        path = self._path(key)

        def start() -> tuple[Any, str]:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".partial-", dir=path.parent)
            return os.fdopen(fd, "wb"), tmp

        fh, tmp = await asyncio.to_thread(start)
        size = 0
        try:
            with fh:
                if isinstance(data, bytes | bytearray | memoryview):
                    await asyncio.to_thread(fh.write, data)
                    size = len(data)
                else:
                    async for chunk in data:
                        await asyncio.to_thread(fh.write, chunk)
                        size += len(chunk)
            await asyncio.to_thread(os.replace, tmp, path)
        except BaseException:
            await asyncio.to_thread(_unlink, tmp)
            raise
        return size

    async def read(self, key: str, max_bytes: int) -> bytes:
        return await asyncio.to_thread(self.read_sync, key, max_bytes)

    def read_sync(self, key: str, max_bytes: int) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as fh:
                data = fh.read(max_bytes + 1)
        except FileNotFoundError:
            raise StoreError(f"{self.uri_for(key)} does not exist", missing=True) from None
        except OSError as exc:
            raise StoreError(f"cannot read {self.uri_for(key)}: {exc.strerror}") from None
        if len(data) > max_bytes:
            raise TooLarge(f"{self.uri_for(key)} is larger than {max_bytes} bytes")
        return data

    async def delete(self, keys: list[str]) -> None:
        def run() -> None:
            for key in keys:
                path = self._path(key)
                path.unlink(missing_ok=True)
                parent = path.parent
                while parent != self.root:  # drop the directories the deletion emptied
                    try:
                        parent.rmdir()
                    except OSError:
                        break
                    parent = parent.parent

        await asyncio.to_thread(run)

    async def list(self, prefix: str) -> list[StoredObject]:
        def run() -> list[StoredObject]:
            out = []
            base = self.root / prefix if prefix else self.root
            for dirpath, _dirs, files in os.walk(base):
                for name in files:
                    if name.startswith(".partial-"):
                        continue
                    p = Path(dirpath) / name
                    try:
                        st = p.stat()
                    except FileNotFoundError:
                        continue
                    out.append(StoredObject(p.relative_to(self.root).as_posix(), st.st_size,
                                            datetime.fromtimestamp(st.st_mtime, UTC)))
            return sorted(out, key=lambda o: o.key)

        return await asyncio.to_thread(run)


class ObjectStore:
    """S3, GCS or Azure Blob storage through obstore (timeouts and retries from the settings)."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, retries: int = 3) -> None:
        from obstore.store import from_url

        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in OBJECT_SCHEMES or not parts.netloc:
            raise ValueError(f"adapter store {url!r}: expected s3://bucket[/prefix], gs://... or az://...")
        if parts.query or parts.fragment or parts.username or parts.password:
            raise ValueError(f"adapter store {url!r}: no credentials, query or fragment in the URL")
        self.url = f"{parts.scheme}://{parts.netloc}/" + (parts.path.strip("/") + "/" if parts.path.strip("/") else "")
        self.timeout_s = timeout_s
        client = {"timeout": f"{max(1, round(timeout_s))}s", "connect_timeout": f"{max(1, round(min(timeout_s, 5)))}s"}
        if os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://"):
            client["allow_http"] = True  # type: ignore[assignment]  # a local S3 API server (MinIO, moto)
        retry = {"max_retries": retries, "retry_timeout": timedelta(seconds=timeout_s * (retries + 1)),
                 "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5),
                             "base": 2}}
        kwargs: dict[str, Any] = {"client_options": client, "retry_config": retry}
        if parts.scheme == "s3" and os.environ.get("AWS_ENDPOINT_URL"):
            kwargs["config"] = {"endpoint": os.environ["AWS_ENDPOINT_URL"]}
        self._store = from_url(self.url, **kwargs)

    def key_of(self, uri: str) -> str | None:
        return _under(uri, self.url)

    def uri_for(self, key: str) -> str:
        return self.url + check_key(key)

    async def put(self, key: str, data: bytes | AsyncIterable[bytes]) -> int:
        import obstore

        size = 0
        if isinstance(data, bytes | bytearray | memoryview):
            size, body = len(data), data
        else:
            async def counted() -> AsyncIterator[bytes]:
                nonlocal size
                async for chunk in data:
                    size += len(chunk)
                    yield chunk
            body = counted()  # type: ignore[assignment]
        with _errors(f"cannot write {self.uri_for(key)}"):
            await obstore.put_async(self._store, check_key(key), body)
        return size

    async def read(self, key: str, max_bytes: int) -> bytes:
        import obstore

        with _errors(f"cannot read {self.uri_for(key)}"):
            result = await obstore.get_async(self._store, check_key(key))
            if result.meta["size"] > max_bytes:
                raise TooLarge(f"{self.uri_for(key)} is larger than {max_bytes} bytes")
            return bytes(await result.bytes_async())

    def read_sync(self, key: str, max_bytes: int) -> bytes:
        import obstore

        with _errors(f"cannot read {self.uri_for(key)}"):
            result = obstore.get(self._store, check_key(key))
            if result.meta["size"] > max_bytes:
                raise TooLarge(f"{self.uri_for(key)} is larger than {max_bytes} bytes")
            return bytes(result.bytes())

    async def delete(self, keys: list[str]) -> None:
        import obstore

        for key in keys:
            try:
                with _errors(f"cannot delete {self.uri_for(key)}"):
                    await obstore.delete_async(self._store, check_key(key))
            except StoreError as exc:
                if not exc.missing:
                    raise

    async def list(self, prefix: str) -> list[StoredObject]:
        import obstore

        out: list[StoredObject] = []
        with _errors(f"cannot list {self.url}{prefix}"):
            async for batch in obstore.list(self._store, prefix or None):
                for meta in batch:
                    out.append(StoredObject(str(meta["path"]), int(meta["size"]), meta["last_modified"]))
        return sorted(out, key=lambda o: o.key)


@contextlib.contextmanager
def _errors(what: str) -> Iterator[None]:
    """obstore's errors as :class:`StoreError` (``missing`` for a key that does not exist)."""
    from obstore.exceptions import BaseError, NotFoundError

    try:
        yield
    except StoreError:
        raise
    except (NotFoundError, FileNotFoundError):
        raise StoreError(f"{what}: it does not exist", missing=True) from None
    except (BaseError, OSError, RuntimeError, ValueError) as exc:
        raise StoreError(f"{what}: {_short(exc)}") from None


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def open_store(settings: Settings) -> AdapterStore:
    """The store ``settings`` configure (``LORAPLEX_ADAPTER_STORE``)."""
    url = settings.resolved_adapter_store()
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in OBJECT_SCHEMES:
        return ObjectStore(url, timeout_s=settings.adapter_store_timeout_s, retries=settings.adapter_store_retries)
    if scheme in ("", "file"):
        path = urllib.parse.unquote(urllib.parse.urlsplit(url).path) if scheme else url
        return DirectoryStore(path)
    raise ValueError(f"LORAPLEX_ADAPTER_STORE={url!r}: expected a directory, file://, s3://, gs:// or az://")


def version_keys(prefix: str) -> list[str]:
    """The object keys of a version stored under ``prefix`` (``.../``)."""
    return [prefix + name for name in ADAPTER_FILES]
