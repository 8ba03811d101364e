"""Headless Chromium for the tests of the pages normfast writes or serves (playwright driving the
system browser, Debian's ``chromium``): a module fixture starts one browser with :func:`launch`, a
:class:`Tab` records every console error and request of its page and opens a page from ``file://``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REQUIRE_DATA, ROOT


def browser_missing() -> str | None:
    """Why the browser tests cannot run here (None: they can)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright)"
    from normfast.apps.view import chromium_executable

    if chromium_executable() is None:
        return "no Chromium for the browser tests (Debian: apt install chromium)"
    return None


def launch():
    """A generator for a module fixture: yields one launched browser, closes it after. Skips with the
    reason when there is none (fails instead under NORMFAST_REQUIRE_DATA=1)."""
    reason = browser_missing()
    if reason is not None:
        if REQUIRE_DATA:
            pytest.fail(f"NORMFAST_REQUIRE_DATA=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    from normfast.apps.view import chromium_executable

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium_executable(), args=["--no-sandbox"])
        yield b
        b.close()


class Tab:
    """One browser tab that records console errors, page errors and every request."""

    def __init__(self, browser, width: int = 1280, height: int = 900):
        self.page = browser.new_page(viewport={"width": width, "height": height})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on(
            "console",
            lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type in ("error", "warning") else None,
        )
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on("request", lambda r: self.requests.append(r.url))

    def open(self, path: Path):
        """Open the page from file:// and wait until its script is done; no error, no other request."""
        url = path.resolve().as_uri()
        self.errors.clear()
        self.requests.clear()
        self.page.goto(url)
        self.page.wait_for_selector("body[data-ready='1']", timeout=15_000)
        assert self.errors == [], self.errors
        assert [u for u in self.requests if u != url] == [], self.requests
        return self.page


def assert_not_blank(png: Path, width: int, height: int) -> None:
    """A screenshot with text, colours and figures in it, not a blank page."""
    from PIL import Image

    pixels = np.asarray(Image.open(png).convert("L"), float)
    assert pixels.shape == (height, width)
    assert pixels.std() > 20 and (pixels < 128).mean() > 0.01


def assert_screenshot_not_blank(page: Path, name: str, browser) -> None:
    """``normfast view --screenshot``'s PNG of ``page`` (1280 × 900, kept as runs/view-tests/NAME.png for a
    person to look at) is not blank."""
    from normfast.apps.view import screenshot

    png = ROOT / "runs" / "view-tests" / f"{name}.png"
    png.unlink(missing_ok=True)
    assert screenshot(page, png, 1280, 900, browser=browser) == png
    assert_not_blank(png, 1280, 900)
