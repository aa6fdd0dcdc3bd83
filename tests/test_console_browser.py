"""The console in a real headless Chromium: sign in, change a tenant's limit, move a canary,
roll back, abort a canary, activate an uploaded version, bind it to a new alias and canary it
with a policy, and see each audit row appear; on the embedded default (``loraplex demo``) and on
PostgreSQL + Redis with two gateways (a change made through one is seen through the other).
Bad, expired and tenant tokens each get a refusal page."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

from loraplex.settings import Settings
from loraplex.tokens import mint, mint_admin
from tests.console_browser import Console, browser_missing, chromium
from tests.e2e_cluster import BIN, Cluster, free_port
from tests.engine_fixtures import demo_model_file
from tests.test_e2e import DEMO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

Admin = Callable[[str, str, Any], Any]


@pytest.fixture(scope="module")
def browser():
    missing = browser_missing()
    if missing:
        pytest.fail(missing, pytrace=False)
    with chromium() as driver:
        yield driver


def _admin(url: str, settings: Settings) -> Admin:
    headers = {"authorization": f"Bearer {mint_admin(settings, subject='seeder')}"}

    def call(method: str, path: str, body: Any = None) -> Any:
        r = httpx.request(method, url + "/admin" + path, json=body, headers=headers, timeout=300)
        assert r.status_code < 400, (method, path, r.status_code, r.text)
        return r.json()

    return call


def _prepare(admin: Admin) -> None:
    """acme/assistant gets a previous version (rollback) and acme/support a 10% canary."""
    versions = {a["label"]: a["id"] for a in admin("GET", "/adapters", None)["data"]}
    admin("PUT", "/tenants/acme/bindings/assistant", {"adapter": versions["acme-terse@1"]})
    admin("POST", "/tenants/acme/bindings/support/canary", {"adapter": versions["acme-french@1"], "percent": 10})


def _traffic(url: str, settings: Settings, n: int = 3, model: str = "support", stream: bool = True) -> None:
    token = mint(settings, "acme-backend", tenant="acme")
    for _ in range(n):
        r = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {token}"}, timeout=120,
                       json={"model": model, "max_tokens": 3, "stream": stream,
                             "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text


def _usage(c: Console, admin: Admin) -> None:
    """The usage pages once the gateway's ledger has flushed acme's traffic: the fleet's charts and
    top tenants, then acme's own page from its row."""
    deadline = time.monotonic() + 60  # the ledger is written every usage_flush_interval_s (10 s)
    while not any(b["results"] for b in admin("GET", f"/usage?start_time={int(time.time()) - 86400}", None)["data"]):
        assert time.monotonic() < deadline, "the usage ledger has no rows a minute after the traffic"
        time.sleep(1)
    fleet = c.go("#usage?window=24h", "usage")
    assert fleet.find_elements(By.CSS_SELECTOR, "figure[data-usage-chart] svg rect title"), fleet.text
    row = fleet.find_element(By.CSS_SELECTOR, "tr[data-tenant='acme']")
    assert "ok" in row.find_element(By.CSS_SELECTOR, ".outcomes").text
    c.shot("usage")
    row.find_element(By.CSS_SELECTOR, "a").click()
    page = c.page("tenant_usage")
    assert page.find_elements(By.CSS_SELECTOR, "tr[data-alias='support']"), page.text
    assert page.find_elements(By.CSS_SELECTOR, "tr[data-outcome='ok']"), page.text
    c.shot("tenant-usage")


def _operate(c: Console, subject: str) -> None:
    """The operator's round: limit, canary percent, rollback, each seen in the audit log."""
    c.go("#tenants", "tenants")
    c.shot("tenants")
    c.d.find_element(By.CSS_SELECTOR, "tr[data-tenant='acme'] a").click()
    page = c.page("tenant")
    old = page.find_element(By.NAME, "requests_per_min").get_attribute("value")
    box = page.find_element(By.NAME, "requests_per_min")
    box.clear()
    box.send_keys(str(int(old) + 17))
    page.find_element(By.CSS_SELECTOR, "form.limits button[type=submit]").click()
    assert c.confirm() == {"requests_per_min": (old, str(int(old) + 17))}
    c.shot("confirm-limits")
    c.accept()
    assert c.page("tenant").find_element(By.NAME, "requests_per_min").get_attribute("value") == str(int(old) + 17)

    row = c.page("tenant").find_element(By.CSS_SELECTOR, "tr[data-alias='support']")
    pct = row.find_element(By.NAME, "percent")
    pct.clear()
    pct.send_keys("25")
    row.find_element(By.CSS_SELECTOR, "form.inline button").click()
    assert c.confirm()["canary_percent"] == ("10.0", "25.0")
    c.accept()
    assert c.page("tenant").find_element(By.CSS_SELECTOR, "tr[data-alias='support'] .percent").text == "25.0%"

    row = c.page("tenant").find_element(By.CSS_SELECTOR, "tr[data-alias='assistant']")
    row.find_element(By.CSS_SELECTOR, "[data-confirm='rollback']").click()
    assert c.confirm() == {"active": ("acme-terse@1", "acme-french@1"), "previous": ("acme-french@1", "acme-terse@1")}
    c.shot("confirm-rollback")
    c.accept()
    row = c.page("tenant").find_element(By.CSS_SELECTOR, "tr[data-alias='assistant']")
    assert row.find_element(By.CSS_SELECTOR, ".active").text == "acme-french@1"
    c.shot("tenant")

    audit = c.go(f"#audit?actor={subject}", "audit")
    actions = [r.get_attribute("data-action") for r in audit.find_elements(By.CSS_SELECTOR, "tr[data-audit]")]
    assert actions[:3] == ["binding.rollback", "binding.canary_set", "tenant.limits"], actions
    c.shot("audit")


def _last_audit(c: Console, subject: str, n: int = 1) -> list[tuple[str, str, dict[str, tuple[str, str]]]]:
    """The newest ``n`` audit rows of ``subject``: (action, target as shown, change field -> (before, after))."""
    audit = c.go(f"#audit?actor={subject}", "audit")
    out = []
    for row in audit.find_elements(By.CSS_SELECTOR, "tr[data-audit]")[:n]:
        diff = {d.get_attribute("data-field"): (d.find_element(By.CSS_SELECTOR, ".before").text,
                                                d.find_element(By.CSS_SELECTOR, ".after").text)
                for d in row.find_elements(By.CSS_SELECTOR, "table.diff tr[data-field]")}
        out.append((row.get_attribute("data-action"), row.find_element(By.CSS_SELECTOR, ".target").text, diff))
    return out


def _whole_job(c: Console, subject: str) -> None:
    """Abort a canary, activate the uploaded version, bind it to a new alias and canary it with a
    policy, all through the console, each read back from the audit row it wrote."""
    _abort(c, subject)
    _activate(c, subject)
    _bind_new_alias(c, subject)
    _canary_with_a_policy(c, subject)


def _abort(c: Console, subject: str) -> None:
    page = c.go("#tenant?slug=acme", "tenant")
    page.find_element(By.CSS_SELECTOR, "tr[data-alias='support'] [data-confirm='abort']").click()
    assert c.confirm() == {"canary": ("acme-french@1", "—"), "canary_percent": ("25.0", "0.0")}
    c.accept()
    assert _last_audit(c, subject) == [("binding.canary_abort", "binding:acme/support",
                                        {"canary": ("acme-french@1", "—"), "canary_percent": ("25", "0")})]


def _activate(c: Console, subject: str) -> None:
    row = c.go("#adapters?q=acme-up", "adapters").find_element(By.CSS_SELECTOR, "tr[data-adapter='acme-uploaded@1']")
    row.find_element(By.CSS_SELECTOR, "[data-confirm='activate']").click()
    assert c.confirm() == {"status": ("pending", "active (if the gate passes)")}
    c.shot("confirm-activate")
    c.accept(timeout_s=300)  # the gate probes the version on the demo's worker
    page = c.page("adapter")  # the version's page: the gate's verdict and evidence
    assert "passed" in page.find_element(By.CSS_SELECTOR, ".evidence .verdict").text
    assert page.find_elements(By.CSS_SELECTOR, ".evidence table.probes tbody tr")
    c.shot("adapter")
    [(action, target, diff)] = _last_audit(c, subject)
    assert (action, target, diff["status"]) == ("adapter.activate", "adapter:acme-uploaded@1", ("pending", "active"))


def _bind_new_alias(c: Console, subject: str) -> None:
    form = c.go("#tenant?slug=acme", "tenant").find_element(By.CSS_SELECTOR, "form.bind")
    form.find_element(By.NAME, "alias").send_keys("uploaded")
    Select(form.find_element(By.NAME, "adapter")).select_by_visible_text("acme-uploaded@1")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    assert c.confirm() == {"active": ("—", "acme-uploaded@1")}
    c.shot("confirm-bind")
    c.accept()
    row = c.page("tenant").find_element(By.CSS_SELECTOR, "tr[data-alias='uploaded']")
    assert row.find_element(By.CSS_SELECTOR, ".active").text == "acme-uploaded@1"
    assert "Nothing to roll back to" in row.find_element(By.CSS_SELECTOR, ".actions").text  # one version only
    assert _last_audit(c, subject)[0][:2] == ("binding.create", "binding:acme/uploaded")


def _canary_with_a_policy(c: Console, subject: str) -> None:
    form = c.go("#tenant?slug=acme", "tenant").find_element(By.CSS_SELECTOR, "form.canary-start")
    Select(form.find_element(By.NAME, "alias")).select_by_visible_text("support")
    Select(form.find_element(By.NAME, "adapter")).select_by_visible_text("acme-uploaded@1")
    for name, value in (("steps", "10,50"), ("interval_s", "600"), ("min_requests", "20")):
        box = form.find_element(By.NAME, name)
        box.clear()
        box.send_keys(value)
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    rows = c.confirm()
    assert rows["canary"] == ("—", "acme-uploaded@1") and rows["canary_percent"] == ("0.0", "10.0")
    assert rows["policy steps"] == ("—", "10, 50") and rows["policy min_requests"] == ("—", "20")
    c.shot("confirm-canary")
    c.accept()
    support = c.page("tenant").find_element(By.CSS_SELECTOR, "tr[data-alias='support']")
    assert "acme-uploaded@1 at" in support.find_element(By.CSS_SELECTOR, ".canary").text
    c.shot("tenant")
    (start, _, start_diff), (policy, target, policy_diff) = _last_audit(c, subject, 2)
    assert (start, start_diff["canary"]) == ("binding.canary_start", ("—", "acme-uploaded@1"))
    assert (policy, target, policy_diff["steps"]) == ("canary.policy_set", "binding:acme/support", ("—", "10, 50"))
    c.shot("audit")


def _refusals(c: Console, settings: Settings) -> None:
    for token, words, shot in (
        ("not-a-jwt", "not valid", "refused-bad-token"),
        (mint(settings, "ops", scopes=(settings.jwt_admin_scope,), ttl_s=-3600), "expired", "refused-expired"),
        (mint(settings, "acme-backend", tenant="acme"), "not an admin token", "refused-tenant-token"),
    ):
        c.d.execute_script("sessionStorage.clear()")
        c.open()
        c.sign_in(token)
        text = c.refusal()
        assert words in text and "Traceback" not in c.d.page_source, text
        assert not c.d.find_element(By.ID, "nav").is_displayed()
        if shot:
            c.shot(shot)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory) -> Iterator[tuple[str, Settings]]:
    """``loraplex demo``: SQLite registry, in-process limiter, one worker on the demo model."""
    home = tmp_path_factory.mktemp("console-embedded")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env |= {"LORAPLEX_HOME": str(home), "LORAPLEX_MODEL": str(demo_model_file()), "LORAPLEX_GATEWAY_PORT": str(port),
            "LORAPLEX_WORKER_PORT": str(free_port()), "LORAPLEX_GATEWAY_METRICS_PORT": str(free_port()),
            "HF_HUB_OFFLINE": "1"}
    log = home / "demo.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([str(BIN), "demo"], env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # the demo gates its three adapters on a CPU worker first
        while "curl" not in log.read_text(errors="replace"):  # printed once seeded
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}", Settings.from_env(env)
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def test_the_console_on_the_embedded_default(embedded, browser):
    url, settings = embedded
    admin = _admin(url, settings)
    _prepare(admin)
    _traffic(url, settings)
    c = Console(browser, url)
    c.open()
    c.shot("signin")
    c.sign_in(mint_admin(settings, subject="ops-alice"))
    c.signed_in_as("ops-alice")
    _operate(c, "ops-alice")
    adapters = c.go("#adapters?q=acme", "adapters")
    labels = [r.get_attribute("data-adapter") for r in adapters.find_elements(By.CSS_SELECTOR, "tr[data-adapter]")]
    assert labels == ["acme-french@1", "acme-terse@1"]
    assert "passed" in adapters.find_element(By.CSS_SELECTOR, "tr[data-adapter='acme-french@1']").text  # the gate
    c.shot("adapters")
    # Upload a version through the form (it starts pending, as the CLI's upload does).
    form = adapters.find_element(By.CSS_SELECTOR, "form[data-upload]")
    form.find_element(By.NAME, "name").send_keys("acme-uploaded")
    form.find_element(By.NAME, "owner").send_keys("acme")
    form.find_element(By.NAME, "config").send_keys(str(DEMO / "terse" / "adapter_config.json"))
    form.find_element(By.NAME, "weights").send_keys(str(DEMO / "terse" / "adapter_model.safetensors"))
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    c.wait.until(lambda d: d.find_element(By.ID, "flash").text == "Uploaded acme-uploaded@1 (pending)")
    uploaded = c.go("#adapters?q=acme-up", "adapters").find_element(By.CSS_SELECTOR, "tr[data-adapter='acme-uploaded@1']")
    assert "pending" in uploaded.text
    assert admin("GET", "/audit?action=adapter.register&limit=1", None)["data"][0]["actor"] == "ops-alice"
    _whole_job(c, "ops-alice")
    _traffic(url, settings, n=1, model="uploaded", stream=False)  # no TTFT: the live page says why
    fleet = c.go("#fleet", "fleet")
    assert fleet.find_elements(By.CSS_SELECTOR, "tr[data-worker]"), fleet.text
    assert "acme-" in fleet.find_element(By.CSS_SELECTOR, "tr[data-worker] .device").text
    c.shot("fleet")
    live = c.go("#live", "live")
    versions = {r.get_attribute("data-version") for r in live.find_elements(By.CSS_SELECTOR, "tr[data-version]")}
    assert versions & {"acme-terse@1", "acme-french@1"}, live.text
    assert "streamed requests only" in live.text
    assert live.find_elements(By.CSS_SELECTOR, "figure[data-chart='requests'] svg path[data-version]")
    assert "no streamed requests" in live.find_element(By.CSS_SELECTOR, "tr[data-version='acme-uploaded@1']").text
    c.shot("live")
    _usage(c, admin)
    _refusals(c, settings)


def test_the_console_on_postgres_and_redis_with_two_gateways(pg_url, redis_url, tmp_path, browser):
    c = Cluster(home=tmp_path, database_url=pg_url, redis_url=redis_url,
                redis_prefix=f"loraplex-console-{uuid.uuid4().hex[:8]}", model=str(demo_model_file()))
    with c.running(workers=("w1",), gateways=("g1", "g2")):
        base = c.admin("POST", "/base-models", {"path": c.model})["name"]
        c.admin("POST", "/tenants", {"slug": "acme", "requests_per_min": 600, "tokens_per_min": 100_000})
        for name in ("french", "terse"):
            dst = c.home / "adapters" / "acme" / name
            shutil.copytree(DEMO / name, dst)
            ad = c.admin("POST", "/adapters", {"name": f"acme-{name}", "uri": str(dst), "base_model": base,
                                               "owner": "acme"})
            c.admin("POST", f"/adapters/{ad['id']}/activate", {})
        c.admin("PUT", "/tenants/acme/bindings/assistant", {"adapter": "acme-french@1"})
        c.admin("PUT", "/tenants/acme/bindings/support", {"adapter": "acme-terse@1"})
        g1, g2 = c.gateways[0].url, c.gateways[1].url
        _prepare(_admin(g1, c.settings))
        c.wait_current()
        _traffic(g1, c.settings)
        one = Console(browser, g1)
        one.open()
        one.sign_in(mint_admin(c.settings, subject="ops-bob"))
        one.signed_in_as("ops-bob")
        _operate(one, "ops-bob")
        # The other gateway: the new limit, the canary at 25% and the rollback, and the audit rows.
        c.wait_current()
        two = Console(browser, g2)
        two.open()  # another origin: its own session storage, sign in again
        two.sign_in(mint_admin(c.settings, subject="ops-carol"))
        two.signed_in_as("ops-carol")
        page = two.go("#tenant?slug=acme", "tenant")
        assert page.find_element(By.NAME, "requests_per_min").get_attribute("value") == "617"
        assert page.find_element(By.CSS_SELECTOR, "tr[data-alias='support'] .percent").text == "25.0%"
        assert page.find_element(By.CSS_SELECTOR, "tr[data-alias='assistant'] .active").text == "acme-french@1"
        audit = two.go("#audit?actor=ops-bob", "audit")
        assert len(audit.find_elements(By.CSS_SELECTOR, "tr[data-audit]")) == 3
        # Live numbers of traffic sent through g1, merged through Redis, seen on g2.
        deadline = time.monotonic() + 20
        while True:
            live = two.go("#live", "live")
            if live.find_elements(By.CSS_SELECTOR, "tr[data-version]") or time.monotonic() > deadline:
                break
            time.sleep(1)
            two.go("#tenants", "tenants")
        assert live.find_elements(By.CSS_SELECTOR, "tr[data-version]"), live.text
        fleet = two.go("#fleet", "fleet")
        assert [r.get_attribute("data-worker") for r in fleet.find_elements(By.CSS_SELECTOR, "tr[data-worker]")] == ["w1"]
