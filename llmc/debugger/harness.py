"""
llmc/debugger/harness.py: start the debugger as a user does and drive its page in a real browser
(Playwright with Debian's Chromium), for its tests (tests/test_debugger_browser.py), its speed
benchmark (dev/bench_debugger.py) and the tutorial's screenshots (doc/visual_debugger.py).

    with DebuggerProcess(["-e", "d2", "-b", "2", "-t", "16"]) as dbg, browser_page() as page:
        page.goto(dbg.url); wait_ready(page)
        click_and_wait(page, "#btn-step")

What it is not: part of the page (the page runs without it), or a browser installer: Chromium
comes from Debian (`apt-get install chromium`; make test's set-up installs it) and Playwright from
pip; chromium_unavailable_reason() says which is missing.
"""

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

CHROMIUM = "/usr/bin/chromium"
URL_LINE = re.compile(r"open (http://\S+)")
START_TIMEOUT_S = 120
VIEWPORT = {"width": 1400, "height": 900}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def chromium_unavailable_reason():
    """None if Playwright imports and Debian's Chromium is installed, else why not (one line)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as e:
        return f"Playwright is not installed ({e}): pip install playwright"
    if not os.path.isfile(CHROMIUM):
        return f"no {CHROMIUM}: apt-get install chromium"
    return None


class DebuggerProcess:
    """`python -m llmc.debugger ARGS --port 0` in a child process; url once it printed it. Its
    output lines are collected in `lines` (stdout) and `errors` (stderr)."""

    def __init__(self, args, env=None, timeout=START_TIMEOUT_S):
        self.args, self.timeout = list(args), timeout
        self.env = {**os.environ, **(env or {})}
        self.lines, self.errors = [], []
        self.url = None

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "llmc.debugger", *self.args, "--port", "0"],
                                     cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1)
        found = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines, found), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.errors, None), daemon=True).start()
        try:
            self.url = found.get(timeout=self.timeout)
        except queue.Empty:
            self.__exit__(None, None, None)
            raise RuntimeError(f"the debugger printed no URL in {self.timeout} s: {self.lines[-5:]} {self.errors[-5:]}")
        if self.url is None:
            self.proc.wait(timeout=10)
            raise RuntimeError(f"the debugger exited ({self.proc.returncode}): {self.errors[-5:]}")
        self.port = int(re.search(r":(\d+)/", self.url).group(1))
        self.token = self.url.split("token=", 1)[1]
        return self

    @staticmethod
    def _read(stream, lines, found):
        for line in stream:
            lines.append(line.rstrip("\n"))
            if found is not None:
                match = URL_LINE.search(line)
                if match:
                    found.put(match.group(1))
        if found is not None:
            found.put(None)

    def wait_for_line(self, pattern, timeout=60):
        """The first stdout line matching regex `pattern` (waiting up to timeout s), or None."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if re.search(pattern, line):
                    return line
            time.sleep(0.05)
        return None

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return False


@contextlib.contextmanager
def browser_page(viewport=VIEWPORT):
    """A Playwright page in headless Debian Chromium."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport=viewport)
            page.errors = []
            page.on("pageerror", lambda e: page.errors.append(str(e)))
            yield page
        finally:
            browser.close()


def wait_ready(page, after=None, timeout_ms=120_000):
    """Wait until the page has drawn the state after version `after` (body[data-ready] changes)."""
    if after is None:
        page.wait_for_selector("body[data-ready]", timeout=timeout_ms)
    else:
        page.wait_for_function(f"document.body.dataset.ready && document.body.dataset.ready !== '{after}'",
                               timeout=timeout_ms)
    return page.get_attribute("body", "data-ready")


def click_and_wait(page, selector, timeout_ms=600_000):
    """Click a control and wait until the page has drawn where the step then stands."""
    before = page.get_attribute("body", "data-ready")
    page.click(selector)
    return wait_ready(page, before, timeout_ms)


def redrawn(page, action, timeout_ms=120_000):
    """Do action() (a click, a choice in a list) and wait until the page has finished the drawing
    it starts (body[data-drawn] counts finished drawings)."""
    before = page.get_attribute("body", "data-drawn") or ""
    action()
    page.wait_for_function(f"(document.body.dataset.drawn || '') !== '{before}'", timeout=timeout_ms)


def show_view(page, name):
    """Click a view's tab and wait until it is drawn."""
    redrawn(page, lambda: page.click(f"#tabs button[data-view='{name}']"))


def choose(page, selector, value):
    """Choose `value` in the <select> `selector` and wait until the page has redrawn."""
    redrawn(page, lambda: page.select_option(selector, value))


def click(page, selector):
    """Click something that redraws (an op in the list, a table row, a link) and wait for it."""
    redrawn(page, lambda: page.click(selector))


def op_index(page, label, layer=None):
    """The op-list index (0-based) of the first op whose line shows `label` (and, given, layer)."""
    for li in page.query_selector_all("#oplist li[data-op]"):
        text = li.inner_text()
        if label in text and (layer is None or f" L{layer} " in text):
            return int(li.get_attribute("data-op"))
    raise LookupError(label)


def hover_cell(page, div_id, row, col):
    """Move the mouse over the heatmap cell (row, col) (element indices) of Plotly div `div_id`
    and return the hover label's text. A label left from an earlier hover (the same cell before a
    redraw) is cleared first, so the text read is the redrawn heatmap's."""
    x, y = page.evaluate("""([id, row, col]) => {
        const gd = document.getElementById(id), L = gd._fullLayout, box = gd.getBoundingClientRect();
        return [box.left + L.xaxis._offset + L.xaxis.l2p(col), box.top + L.yaxis._offset + L.yaxis.l2p(row)];
    }""", [div_id, row, col])
    page.mouse.move(0, 0)                                          # off the plot, then no label left
    page.evaluate("id => Plotly.Fx.unhover(document.getElementById(id))", div_id)
    page.wait_for_selector(f"#{div_id} .hoverlayer .hovertext", state="detached")
    page.mouse.move(x, y)
    page.wait_for_selector(f"#{div_id} .hoverlayer .hovertext")
    return page.eval_on_selector(f"#{div_id} .hoverlayer .hovertext",      # SVG: one tspan per line
                                 "e => [...e.querySelectorAll('tspan.line')].map(t => t.textContent).join('\\n') || e.textContent")
