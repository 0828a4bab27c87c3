"""Prefect's UI in a real browser: Debian's chromium driven through Debian's chromium-driver by selenium.

Only what a user does: open a deployment's "Custom run" form, press Submit, follow the new run by its name
in the deployment's run list, read the run's state badge and its Artifacts tab. Selectors are the UI's own
(Prefect 3.8.8's bundled UI): button texts, run-name links, `.state-badge`.
"""

from __future__ import annotations

import re
import shutil
import time

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CHROMEDRIVER = "/usr/bin/chromedriver"  # Debian's chromium-driver (infra/test-deps.sh)
FINAL = ("completed", "failed", "crashed", "cancelled")


def missing() -> str | None:
    """Why no browser test can run here, or None."""
    if not shutil.which("chromium") or not shutil.which(CHROMEDRIVER):
        return "chromium / chromium-driver not installed (infra/test-deps.sh installs them)"
    return None


def browser() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def _wait(driver, timeout_s: float = 60) -> WebDriverWait:
    # The UI re-renders lists and toasts while it polls; a stale element is looked up again.
    return WebDriverWait(driver, timeout_s, ignored_exceptions=(StaleElementReferenceException,))


def _button(driver, text: str):
    return next((b for b in driver.find_elements(By.TAG_NAME, "button") if b.text.strip() == text), None)


def submit_custom_run(driver, ui: str, deployment_id: str, new_runs, timeout_s: float = 120) -> str:
    """Open the deployment's run form (its parameters pre-filled) and submit it; returns the new run's name.

    ``new_runs()`` lists the names of the deployment's runs created since the form opened (from the API): a
    toast is shown only for a few seconds, and on a loaded machine a click that lands while the form is
    still rendering does nothing, so the click is repeated until the server has the run."""
    driver.get(f"{ui}/deployments/deployment/{deployment_id}/run")
    _wait(driver).until(lambda d: "Repo Id" in d.find_element(By.TAG_NAME, "body").text)  # the form rendered
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        button = _wait(driver).until(lambda d: (b := _button(d, "Submit")) is not None and b.is_enabled() and b)
        button.click()
        clicked = time.monotonic()
        while time.monotonic() - clicked < 15:
            if names := new_runs():
                return names[0]
            time.sleep(1)
        if "/run" not in driver.current_url:  # submitted (the page moved on) but the run is not listed yet
            continue
    raise AssertionError(f"no run created from the form within {timeout_s:.0f} s; the page shows: "
                         f"{driver.find_element(By.TAG_NAME, 'body').text[-1500:]}")


def open_run(driver, name: str) -> str:
    """Click the run's name in the deployment page's run list; returns the run page's URL."""
    def link(d):
        return next((a for a in d.find_elements(By.TAG_NAME, "a")
                     if a.text.strip() == name and "/runs/flow-run/" in (a.get_attribute("href") or "")), None)

    _wait(driver).until(link).click()
    _wait(driver).until(lambda d: "/runs/flow-run/" in d.current_url)
    return driver.current_url


def run_state(driver) -> str | None:
    """The run page's state badge (e.g. "completed"), or None before it renders."""
    for badge in driver.find_elements(By.CSS_SELECTOR, "span.state-badge"):
        m = re.search(r"state--(\w+)", badge.get_attribute("class") or "")
        if m:
            return m.group(1)
    return None


def wait_final_state(driver, timeout_s: float) -> str:
    """Poll the open run page until its state is final; the page updates itself, no reload needed."""
    deadline, state = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            state = run_state(driver)
        except StaleElementReferenceException:
            state = None
        if state in FINAL:
            return state
        time.sleep(1)
    raise AssertionError(f"run still {state} after {timeout_s:.0f} s")


def open_tab(driver, name: str) -> str:
    """Open one of the run page's tabs (Logs, Artifacts, ...); returns the page's text once it has loaded."""
    _wait(driver).until(lambda d: next((t for t in d.find_elements(By.CSS_SELECTOR, "li.p-tab")
                                        if t.text.strip() == name), None)).click()
    time.sleep(2)  # the tab fetches its list when opened
    return driver.find_element(By.TAG_NAME, "body").text
