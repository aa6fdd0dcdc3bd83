"""Adapter sources: the worker fetches only from configured sources (nothing outside is opened
or connected to), and verifies the registry's version digest over every file it loads."""

from __future__ import annotations

import functools
import http.server
import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.lora.manager import AdapterLoadError, AdapterManager
from engine.lora.sources import AdapterFetchError, SourcePolicy, read_verified
from loraplex.digest import digest_directory
from loraplex.settings import Settings
from loraplex.wire import AdapterRef
from registry.service import RegistryService
from tests.registry_support import TINY, fresh_registry, make_settings, write_adapter


@pytest.fixture
def recorder() -> Iterator[tuple[socket.socket, str]]:
    """A listening socket nobody should connect to, and its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield sock, f"http://127.0.0.1:{sock.getsockname()[1]}/"
    sock.close()


def assert_never_connected(sock: socket.socket) -> None:
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.accept()  # a connection attempt would be waiting here


REDIRECT_TO: dict[str, str] = {}


@pytest.fixture
def store(tmp_path) -> Iterator[tuple[Path, str]]:
    """A static HTTP adapter store serving ``tmp_path/store``; ``/go/<name>`` redirects to
    ``REDIRECT_TO[base] + name``."""
    served = tmp_path / "store"
    (served / "v1").mkdir(parents=True)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/go/"):
                self.send_response(302)
                self.send_header("Location", REDIRECT_TO[base] + self.path.rsplit("/", 1)[-1])
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(served)))
    base = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield served, base
    REDIRECT_TO.pop(base, None)
    server.shutdown()
    server.server_close()


def worker(tmp_path: Path, **overrides: object) -> tuple[Settings, AdapterManager]:
    settings = Settings(home=str(tmp_path / "home"), adapter_root=str(tmp_path / "root"), **overrides)
    (tmp_path / "root").mkdir(exist_ok=True)
    return settings, AdapterManager.from_settings(settings, TINY)


def ref(uri: str, d: Path | None = None, id_: str = "v1") -> AdapterRef:
    return AdapterRef(id=id_, name=id_, uri=uri, sha256=digest_directory(d) if d is not None else None)


def test_default_source_is_the_adapter_root(tmp_path):
    settings, m = worker(tmp_path)
    inside = write_adapter(tmp_path / "root" / "team" / "a", TINY)
    outside = write_adapter(tmp_path / "elsewhere", TINY)
    os.symlink(outside, tmp_path / "root" / "link")
    try:
        assert settings.resolved_adapter_sources() == ((tmp_path / "root").resolve().as_uri() + "/",)
        assert m.acquire_slots([ref(inside.as_uri(), inside)]) == [0]
        m.release([ref(inside.as_uri())])
        for i, uri in enumerate([
            "file:///etc",
            "file:///etc/passwd",
            outside.as_uri(),
            str(outside),
            f"{(tmp_path / 'root').as_uri()}/../elsewhere",
            str(tmp_path / "root" / ".." / "elsewhere"),
            (tmp_path / "root" / "link").as_uri(),  # a symlink in the root pointing outside
            f"{(tmp_path / 'root').as_uri()}-sibling/a",
        ]):
            with pytest.raises(AdapterLoadError, match="not under a configured adapter source"):
                m.acquire_slots([ref(uri, outside, id_=f"bad-{i}")])
    finally:
        m.close()


def test_http_sources_are_checked_before_connecting(tmp_path, store, recorder):
    served, base = store
    sock, forbidden = recorder
    write_adapter(served / "v1" / "a", TINY)
    good = served / "v1" / "a"
    _, m = worker(tmp_path, adapter_sources=(f"{base}/v1/",))
    port = base.rsplit(":", 1)[1]
    try:
        assert m.acquire_slots([ref(f"{base}/v1/a", good)]) == [0]
        for i, uri in enumerate([
            forbidden,  # e.g. Redis on the worker's host
            f"{forbidden}v1/a",
            f"{base}/v10/a",
            f"{base}/v1/../v1/a",
            f"{base}/v1/%2e%2e/v1/a",
            f"http://user:pw@127.0.0.1:{port}/v1/a",
            f"https://127.0.0.1:{port}/v1/a",
            f"http://localhost:{port}/v1/a",
            f"{base}/v1/a?x=1",
            "ftp://127.0.0.1/v1/a",
            (tmp_path / "root").as_uri(),  # the adapter root is not allowed once sources are configured
        ]):
            with pytest.raises(AdapterLoadError, match="not under a configured adapter source"):
                m.acquire_slots([ref(uri, good, id_=f"bad-{i}")])
    finally:
        m.close()
    assert_never_connected(sock)


def test_redirects_are_not_followed(tmp_path, store, recorder):
    served, base = store
    sock, forbidden = recorder
    write_adapter(served / "v1" / "a", TINY)
    _, m = worker(tmp_path, adapter_sources=(f"{base}/",))
    REDIRECT_TO[base] = forbidden  # /go/<file> answers 302 to the forbidden address
    try:
        with pytest.raises(AdapterLoadError, match="redirects are not followed"):
            m.acquire_slots([ref(f"{base}/go/a", served / "v1" / "a")])
    finally:
        m.close()
    assert_never_connected(sock)


def test_bad_source_settings_fail_at_start(tmp_path):
    for bad in ("relative/dir", "ftp://host/x/", "s3://key@bucket/", "s3://bucket/a?b", "http://u:p@host/"):
        with pytest.raises(ValueError):
            SourcePolicy([bad])


async def test_config_edited_after_registration_fails_the_load(tmp_path):
    """The registry's digest covers adapter_config.json: a version whose config changed after
    admission fails to load on a fresh worker, the untouched one loads."""
    url = f"sqlite+aiosqlite:///{tmp_path}/r.db"
    await fresh_registry(url)
    settings = make_settings(tmp_path, url)
    root = Path(settings.resolved_adapter_root())
    svc = RegistryService(settings)
    try:
        await svc.register_base_model(TINY)
        kept = await svc.register_adapter("kept", str(write_adapter(root / "kept", TINY, seed=1)), "tiny")
        edited = await svc.register_adapter("edited", str(write_adapter(root / "edited", TINY, seed=2)), "tiny")
    finally:
        await svc.close()
    cfg_path = root / "edited" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["lora_alpha"] = 200  # still within every bound: only the digest can tell
    cfg_path.write_text(json.dumps(cfg))

    m = AdapterManager.from_settings(settings, TINY)
    try:
        refs = {v.name: AdapterRef(id=v.id, name=v.name, uri=v.uri, sha256=v.sha256) for v in (kept, edited)}
        assert m.acquire_slots([refs["kept"]]) == [0]
        with pytest.raises(AdapterLoadError, match="sha256 mismatch"):
            m.acquire_slots([refs["edited"]])
        assert m.state(refs["edited"]).state == "failed"
    finally:
        m.close()


def test_read_verified_returns_the_verified_bytes(tmp_path):
    d = write_adapter(tmp_path / "a", TINY)
    r = ref(d.as_uri(), d)
    contents = read_verified(r, d)
    assert set(contents) == {"adapter_config.json", "adapter_model.safetensors"}
    assert contents["adapter_config.json"] == (d / "adapter_config.json").read_bytes()
    (d / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterFetchError, match="sha256 mismatch"):
        read_verified(r, d)
