"""The console's fleet view shows each worker's prefix cache: the KV blocks its residency report says are
cached and the evictions so far; a vLLM worker's report carries neither, and the view says so."""

from __future__ import annotations

import re

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from loraplex.tokens import mint_admin
from loraplex.wire import BACKEND_VLLM, WorkerReport
from registry.admin_api import admin_app
from registry.service import RegistryService
from tests.registry_support import fresh_registry, make_settings


class Reports:
    """The console's fleet source with fixed reports (no ejections, no live numbers)."""

    def __init__(self, reports: list[WorkerReport]) -> None:
        self.reports = reports

    async def workers(self) -> list[WorkerReport]:
        return self.reports

    async def ejections(self) -> dict:
        return {}

    async def live(self) -> dict:
        return {}


@pytest.fixture
async def fleet_html(sqlite_url, tmp_path):
    await fresh_registry(sqlite_url)
    settings = make_settings(tmp_path, sqlite_url)
    service = RegistryService(settings)
    reports = Reports([
        WorkerReport(worker_id="w1", url="http://w1", base_model="tiny", base_revision="r", free_kv_blocks=40,
                     total_kv_blocks=100, cached_kv_blocks=37, kv_evictions=1204),
        WorkerReport(worker_id="w2", url="http://w2", base_model="tiny", base_revision="r", total_kv_blocks=10),
        WorkerReport(worker_id="v1", url="http://v1", base_model="tiny", base_revision="r", backend=BACKEND_VLLM),
    ])
    app = Starlette(routes=[Mount("/admin", app=admin_app(service, settings, console=reports))])
    headers = {"authorization": f"Bearer {mint_admin(settings, subject='ops-alice')}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/admin",
                                 headers=headers) as client:
        r = await client.get("/console/view/fleet")
        assert r.status_code == 200
        yield r.text
    await service.close()


def _cell(html: str, worker: str) -> list[str]:
    row = re.search(rf'<tr data-worker="{worker}">.*?</tr>', html, re.S)
    assert row, worker
    cell = re.search(r'<td class="prefix">(.*?)</td>', row.group(0), re.S)
    assert cell, row.group(0)
    return re.sub(r"<[^>]+>", " ", cell.group(1)).split()


async def test_the_fleet_view_shows_cached_blocks_and_evictions_per_worker(fleet_html):
    assert "<th>prefix cache</th>" in fleet_html
    assert _cell(fleet_html, "w1") == ["37", "blocks", "cached", "1204", "evicted"]
    assert _cell(fleet_html, "w2") == ["0", "blocks", "cached", "0", "evicted"]
    assert _cell(fleet_html, "v1") == ["not", "reported"]
