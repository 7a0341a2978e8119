"""A picture of the live page (``/`` of the management port) taken by a headless Chromium, if one is
installed: ``creditflow demo`` keeps one while the alarm is set and one after it cleared."""

from __future__ import annotations

import os
import shutil
import subprocess

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
PAGE_BUDGET_MS = 3000          # the page's own (virtual) time before the picture: a few of its updates
TIMEOUT_S = 60


def find_browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


def screenshot(url: str, path: str, *, width: int = 1400, height: int = 900) -> str | None:
    """Save the page at ``url`` as PNG at ``path``; None when it worked, else why not (one line)."""
    browser = find_browser()
    if browser is None:
        return "no headless Chromium installed (Debian: apt-get install chromium)"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        done = subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu",
                               f"--virtual-time-budget={PAGE_BUDGET_MS}", f"--window-size={width},{height}",
                               f"--screenshot={path}", url], capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{os.path.basename(browser)} failed: {exc}"
    if done.returncode != 0 or not os.path.exists(path):
        return f"{os.path.basename(browser)} exited {done.returncode}: {done.stderr.strip()[-200:]}"
    return None
