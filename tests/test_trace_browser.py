"""The trace viewer's page in a real browser (headless Chromium over the DevTools protocol, `tests/chromium.py`): it
opens without a script error, shows every token, recolours when a selector changes, draws what a policy kept, and
saves a screenshot. Skipped, saying why, where no Chromium is installed (Debian's package is ``chromium``; CI
installs it). How long the page took to open is printed, not asserted (a speed is no unit test's business):
``pytest -s tests/test_trace_browser.py`` shows it.

docs/trace-viewer.png is this page for the demo study: ``python -m figures.trace --study runs/demo`` then
``python tests/chromium.py runs/demo/trace-viewer.html docs/trace-viewer.png kv-policy=random``.
"""

from __future__ import annotations

import pytest
from chromium import Chromium, find_chromium  # tests/ is on sys.path under pytest
from test_trace_viewer import make_study

from figures.trace import write_study_viewer

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium), so the "
                                "trace viewer is not checked in a browser")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TOKENS = "Array.from(document.querySelectorAll('#kv-tokens .t'))"


def colours(browser: Chromium) -> list[str]:
    return browser.evaluate(f"{TOKENS}.map(s => s.style.background)")


def test_the_page_in_chromium(tmp_path, record_property):
    """A 1,000-token trace with 12 scorers at 30 layers (the budget the page is held to), and a second trace."""
    study = make_study(tmp_path / "study", n_prompt=100, n_generated=900, scorers=12, layers=30)
    page = write_study_viewer(study)
    assert CHROMIUM is not None
    with Chromium(CHROMIUM) as browser:
        browser.open(page.as_uri())
        assert browser.evaluate("document.body.dataset.ready") == "1", browser.errors()
        opened_ms = browser.evaluate("performance.getEntriesByName('kv-ready')[0].startTime")
        record_property("opened_ms", opened_ms)
        print(f"\n{page.stat().st_size / 1e6:.2f} MB page: first trace drawn {opened_ms:.0f} ms after navigation")
        assert browser.evaluate(f"{TOKENS}.length") == 1000

        labels = colours(browser)  # the first quantity: the occlusion flips
        assert sum(bool(c) for c in labels) == 892 and len(set(labels) - {""}) == 2  # reasoning span, two colours
        assert browser.select("kv-quantity", "scores · scorer3") == "scores · scorer3"
        aggregate = colours(browser)
        assert aggregate != labels and len(set(aggregate)) > 20
        assert browser.select("kv-layer", "2") == "2"
        assert colours(browser) != aggregate
        browser.select("kv-mode", "rank")
        ranked = colours(browser)
        assert ranked != aggregate and "rank 1" in browser.evaluate("document.getElementById('kv-legend').innerText")

        strips = f"{TOKENS}.filter(s => s.lastChild.style.background).length"
        assert browser.evaluate(strips) == 0
        browser.select("kv-policy", "random")
        assert browser.evaluate(strips) == 1000
        assert browser.evaluate(f"{TOKENS}.filter(s => s.classList.contains('gone')).length") > 0
        browser.select("kv-heads", "each")
        assert browser.evaluate(f"{TOKENS}[500].lastChild.style.height") == "6px"  # two KV heads, 3 px each

        def hover(token: int) -> str:
            browser.evaluate(f"{TOKENS}[{token}].dispatchEvent(new MouseEvent('mousemove', {{bubbles: true, "
                             "clientX: 50, clientY: 50}))")
            return browser.evaluate("document.getElementById('kv-tip').innerText")

        tip = hover(150)
        assert "token 150" in tip and "scorer3" in tip and "layer 2, per KV head: h0" in tip
        browser.select("kv-layer", "7")  # the scorers' layer 7; the tiny model's cache has 4
        assert browser.evaluate(strips) == 0 and "keep-log has no layer 7" in hover(150)

        shot = browser.screenshot(tmp_path / "trace-viewer.png")
        assert shot.read_bytes()[:8] == PNG_SIGNATURE and shot.stat().st_size > 10_000

        browser.select("kv-trace", "1")
        assert browser.evaluate(f"{TOKENS}.length") == 1000
        assert browser.evaluate("document.getElementById('kv-quantity').value") == "scores · scorer3"
        assert "wrong" in browser.evaluate("document.getElementById('kv-info').innerText")  # its random run
        assert browser.errors() == []
