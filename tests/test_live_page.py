"""The live page at ``/`` of the management port, loaded in a real headless Chromium.

A slow queue is planted (``--queue-delay-us``) and a publisher floods it: the
page, fed by the API, must show the queue's upstream stages (its channel, its
connection's reader) in ``flow``. Then the memory alarm is set and cleared
(``ctl set-watermark``): the page shows it and then shows it gone. Skipped
where no Chromium is installed (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time

import pytest

from pipeline.amqp import frames
from pipeline.loadgen.client import AmqpClient

pytestmark = [pytest.mark.processes, pytest.mark.timeout(120)]
BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no headless Chromium on this machine")


def browse(url: str, *, screenshot: str | None = None, budget_ms: int = 3000) -> str:
    """The page's DOM after ``budget_ms`` of its (virtual) time: a few of its one-second updates."""
    args = [BROWSER, "--headless=new", "--no-sandbox", "--disable-gpu", f"--virtual-time-budget={budget_ms}"]
    if screenshot:
        args += ["--window-size=1400,900", f"--screenshot={screenshot}"]
    else:
        args += ["--dump-dom"]
    done = subprocess.run(args + [url], capture_output=True, text=True, timeout=60)
    return done.stdout


def states(dom: str) -> dict[str, str]:
    """Process name -> state, as the page drew them."""
    return dict(re.findall(r'data-name="([^"]+)" data-state="([^"]+)"', dom))


def alarms(dom: str) -> str | None:
    found = re.search(r'id="alarm-now" data-alarms="([^"]*)"', dom)
    return found.group(1) if found else None


@needs_browser
def test_the_page_shows_flow_upstream_of_a_slow_queue(start_broker, tmp_path):
    broker = start_broker("--queue-delay-us", "3000")
    url = f"http://127.0.0.1:{broker.info['management_port']}/"
    pub = AmqpClient("127.0.0.1", broker.port, heartbeat_s=0)
    pub.queue_declare("slow", durable=False)
    msg = frames.encode_publish(1, "", "slow", frames.properties_raw(), b"x" * 100, pub.frame_max)
    stop = threading.Event()

    def flood():
        while not stop.is_set():
            try:
                pub.send_all(msg * 200, timeout_s=1)
            except Exception:          # the socket stays full while the broker holds the reader back
                pass
    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        broker.wait_for(lambda s: any(p.get("state") == "flow" for p in s["processes"].values()
                                      if p.get("kind") in ("reader", "channel")), timeout_s=20, what="flow")
        shown = {}
        for _ in range(5):                         # the page samples the API once a second
            shown = states(browse(url))
            if any(state == "flow" for name, state in shown.items() if name.startswith(("reader-", "channel-"))):
                break
        upstream = {n: s for n, s in shown.items() if n.startswith(("reader-", "channel-"))}
        assert "flow" in upstream.values(), f"the page drew {shown}"
        assert any(n.startswith("queue-") for n in shown) and shown.get("store") == "running"
        browse(url, screenshot=str(tmp_path / "slow-queue.png"))
        assert (tmp_path / "slow-queue.png").stat().st_size > 10_000
    finally:
        stop.set()
        t.join(5)
        pub.abort()


@needs_browser
def test_the_page_shows_the_memory_alarm_set_and_then_cleared(start_broker):
    from pipeline.ctlclient import CtlClient
    broker = start_broker()
    url = f"http://127.0.0.1:{broker.info['management_port']}/"
    assert alarms(browse(url)) == ""
    with CtlClient(str(broker.data_dir)) as ctl:
        ctl.request("set_watermark", value="0")
    broker.wait_for(lambda s: s["processes"]["watchdog"].get("memory_alarm"), timeout_s=10, what="the alarm")
    assert alarms(browse(url)) == "memory"
    with CtlClient(str(broker.data_dir)) as ctl:
        ctl.request("set_watermark", value="0.6")
    broker.wait_for(lambda s: not s["processes"]["watchdog"].get("memory_alarm"), timeout_s=10, what="the clear")
    time.sleep(0.5)                                # past the API's status cache
    assert alarms(browse(url)) == ""
