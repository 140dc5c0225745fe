"""A real headless Chromium (Debian's chromium + chromium-driver) driven through Selenium.

The flags keep it off the network (the test machine has none): no background, component-update,
sync or QUIC connections, a fresh profile each time.
"""

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1200,2400", "--force-device-scale-factor=1",
)


@contextmanager
def headless_chromium(tmp_path: Path) -> Iterator["object"]:
    """A Selenium WebDriver on a headless Chromium that records the console (get_log("browser"))."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        raise RuntimeError("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # an explicit driver path: Selenium Manager would otherwise try to download one
    service = Service(executable_path=driver, log_output=str(tmp_path / "chromedriver.log"))
    browser = webdriver.Chrome(options=options, service=service)
    try:
        yield browser
    finally:
        browser.quit()
