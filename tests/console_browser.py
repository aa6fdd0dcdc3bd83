"""Driving the console in the real Chromium from Debian's packages (``chromium``,
``chromium-driver``), headless, through Selenium: never a browser build of its own.

``LORAPLEX_SCREENSHOTS=docs/console`` makes the tests save a screenshot of each page there
(``make screenshots``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = os.environ.get("LORAPLEX_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("LORAPLEX_CHROMEDRIVER", "/usr/bin/chromedriver")


def browser_missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (Path(path).is_file() or shutil.which(path)):
            return f"{path} is missing: apt-get install -y chromium chromium-driver (.ci/run installs them)"
    return None


@contextmanager
def chromium() -> Iterator[WebDriver]:
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1360,900", "--disable-extensions", "--no-first-run", "--hide-scrollbars"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


class Console:
    """One signed-in console tab."""

    def __init__(self, driver: WebDriver, base: str) -> None:
        self.d = driver
        self.base = base.rstrip("/")
        self.wait = WebDriverWait(driver, 30)

    def open(self) -> None:
        self.d.get(self.base + "/admin/console")
        self.wait.until(ec.presence_of_element_located((By.ID, "signin-form")))

    def sign_in(self, token: str) -> None:
        self.d.find_element(By.ID, "token").send_keys(token)
        self.d.find_element(By.CSS_SELECTOR, "#signin-form button[type=submit]").click()

    def signed_in_as(self, subject: str) -> None:
        self.wait.until(lambda d: d.find_element(By.ID, "who").text == subject)

    def refusal(self) -> str:
        el = self.wait.until(ec.visibility_of_element_located((By.CSS_SELECTOR, "#refusal .refused")))
        return el.text

    def go(self, hash_: str, page: str) -> WebElement:
        self.d.execute_script(  # marked loading at once: the page shown now is not the one asked for
            "if (location.hash === arguments[0]) window.dispatchEvent(new HashChangeEvent('hashchange'));"
            "else location.hash = arguments[0];"
            "document.getElementById('view').dataset.loading = '';", hash_)
        return self.page(page)

    def page(self, page: str) -> WebElement:
        """The page once rendered and no other is loading (so it is not replaced under the test)."""
        return self.wait.until(ec.visibility_of_element_located(
            (By.CSS_SELECTOR, f"#view:not([data-loading]) [data-page='{page}']")))

    def confirm(self) -> dict[str, tuple[str, str]]:
        """The open confirm step's rows (field -> (before, after))."""
        box = self.wait.until(ec.visibility_of_element_located((By.CSS_SELECTOR, "#dialog .confirm")))
        return {r.get_attribute("data-field"): (r.find_element(By.CSS_SELECTOR, ".before").text,
                                                r.find_element(By.CSS_SELECTOR, ".after").text)
                for r in box.find_elements(By.CSS_SELECTOR, "tr[data-field]")}

    def accept(self, timeout_s: float = 30) -> None:
        """Confirm; ``timeout_s`` for the calls (an activation waits for the gate's probe on a worker)."""
        self.d.find_element(By.CSS_SELECTOR, "#dialog [data-call]").click()
        # One look in the page's own thread: the dialog closed (done) or its refusal (so nothing goes stale).
        outcome = WebDriverWait(self.d, timeout_s).until(lambda d: d.execute_script(
            "const box = document.getElementById('dialog'); if (box.hidden) return 'done';"
            "const e = box.querySelector('.error'); return e && e.textContent ? 'refused: ' + e.textContent : null;"))
        assert outcome == "done", f"the admin API {outcome}"
        self.wait.until(lambda d: d.find_element(By.ID, "flash").text.startswith("Done"))

    def shot(self, name: str) -> None:
        where = os.environ.get("LORAPLEX_SCREENSHOTS")
        if where:
            Path(where).mkdir(parents=True, exist_ok=True)
            self.d.save_screenshot(str(Path(where) / f"{name}.png"))
