"""Screenshots of every TensorBoard view as a reader first opens it (no clicks beyond picking the view), in
headless Chromium, so a person can check that no view is empty or misleading in its default state.

Starts TensorBoard (this Python's) on --logdir, drives Debian's chromium through chromedriver's W3C WebDriver
HTTP interface (urllib only: no selenium), and writes one PNG per view into --out, plus views.json with each
view's URL and the text TensorBoard showed (so "no data" notices can be grepped). Views: Time Series,
Scalars, Custom Scalars, Images, Text, HParams (its table, then its parallel-coordinates tab: the one click
the view needs) and Profile when the profile plugin is installed. The network is closed here, so Chromium
runs with everything that phones home turned off and a fresh profile folder.

  apt-get install -y chromium chromium-driver        # as root
  python scripts/tensorboard_screenshots.py --logdir=/tmp/i21tb --out=/tmp/i21shots
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from base64 import b64decode

from absl import app, flags

flags.DEFINE_string("logdir", None, "Folder holding the run folders (TensorBoard's --logdir).")
flags.DEFINE_string("out", "/tmp/i21shots", "Where the PNGs and views.json go.")
flags.DEFINE_string("chromedriver", "/usr/bin/chromedriver", "chromedriver (Debian: chromium-driver).")
flags.DEFINE_string("chromium", "/usr/bin/chromium", "The browser chromedriver starts.")
flags.DEFINE_integer("width", 1600, "Window width (px).")
flags.DEFINE_integer("height", 1100, "Window height (px).")
flags.DEFINE_float("settle_s", 8.0, "Seconds to let a view load and draw before its screenshot.")
flags.DEFINE_list("views", [], "Only these views (names as in VIEWS); default all.")
FLAGS = flags.FLAGS

# name -> (URL fragment, text of a tab to click after opening, or None). Only the click that reaches a
# view nobody can see otherwise (HParams opens on its table).
VIEWS = {
    "timeseries": ("timeseries", None),
    "scalars": ("scalars", None),
    "custom_scalars": ("custom_scalars", None),
    "images": ("images", None),
    "text": ("text", None),
    "hparams_table": ("hparams", None),
    "hparams_parallel_coordinates": ("hparams", "PARALLEL COORDINATES VIEW"),
    "profile": ("profile", None),
    # Not a default state: the same dashboards with smoothing off and outliers kept, through the URL
    # settings the legacy dashboards read (the README's link; a sweep's curve is not a noisy time series).
    "custom_scalars_unsmoothed": ("custom_scalars&_smoothingWeight=0&_ignoreYOutliers=false", None),
    "scalars_unsmoothed": ("scalars&_smoothingWeight=0&_ignoreYOutliers=false", None),
}

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--hide-scrollbars"]

# Every element under `root` in document order (a shadow root's content before the light children it
# slots), through shadow roots and same-origin iframes (TensorBoard's Polymer plugins live in shadow DOM,
# some in iframes).
_WALK = """
function* walk(root) {
  const stack = [root];
  while (stack.length) {
    const node = stack.pop();
    if (!node) continue;
    if (node.nodeType === 1) yield node;
    const kids = Array.from(node.children || []);
    for (let i = kids.length - 1; i >= 0; i--) stack.push(kids[i]);
    if (node.tagName === 'IFRAME') { try { stack.push(node.contentDocument); } catch (e) {} }
    if (node.shadowRoot) stack.push(node.shadowRoot);
  }
}
"""
_CLICK = _WALK + """
const want = arguments[0].toUpperCase();
let best = null;
for (const el of walk(document)) {
  const t = (el.innerText || el.textContent || '').trim().toUpperCase();
  if (t === want && (!best || best.contains(el))) best = el;
}
if (best) { best.click(); return true; }
return false;
"""
_TEXT = _WALK + """
const parts = [];
for (const el of walk(document)) {
  if (el.shadowRoot) parts.push(el.shadowRoot.textContent || '');
}
parts.push(document.body ? document.body.innerText : '');
return parts.join(' ').replace(/\\s+/g, ' ').slice(0, 20000);
"""

# The parallel-coordinates plot draws one path per session group under `g.foreground`.
_SESSION_LINES = _WALK + """
let n = 0;
for (const el of walk(document)) {
  if (el.tagName.toLowerCase() === 'path' && el.parentNode && el.parentNode.getAttribute
      && el.parentNode.getAttribute('class') === 'foreground') n++;
}
return n;
"""

# Every chart the legacy dashboards (Scalars, Custom Scalars) drew: its card's title, the y range it shows and
# its series (name, values). A series whose values all lie outside the y range is not seen as opened ("Ignore
# outliers" keeps the range between the 5% and 95% quantiles of the chart's values: of two values, neither).
_CHARTS = _WALK + """
const out = [];
for (const el of walk(document)) {
  if (el.tagName !== 'VZ-LINE-CHART2' || !el._chart) continue;
  const c = el._chart;
  const domain = c.yScale.domain();
  const series = [];
  for (const ds of c.datasets) {
    const values = [];
    for (const d of ds.data()) { const v = c.yValueAccessor(d, -1, ds); if (isFinite(v)) values.push(v); }
    series.push({name: ds.metadata().name, values: values});
  }
  let host = el, title = null;
  while (host && title === null) {
    const root = host.getRootNode();
    host = root && root.host;
    if (!host) break;
    if (typeof host.tag === 'string' && host.tag) title = host.tag;
    else if (typeof host.title === 'string' && host.title) title = host.title;
  }
  out.push({title: title, domain: [Number(domain[0]), Number(domain[1])], series: series});
}
return out;
"""

# Time Series as opened: its card groups in order (TensorBoard opens the first two), and the scalar cards drawn
# (those of the open groups) with their tag and text (the run table under the chart included).
_TIME_SERIES = _WALK + """
const groups = [], cards = [];
for (const el of walk(document)) {
  if (el.classList && el.classList.contains('group-title')) {
    const name = (el.getAttribute('title') || el.textContent || '').trim();
    if (name !== 'Pinned') groups.push(name);
  }
  if (el.tagName.toLowerCase() === 'scalar-card-component') {
    const tag = el.querySelector('tb-truncated-path');
    cards.push({tag: tag ? tag.getAttribute('title') : null, text: (el.innerText || '').replace(/\\s+/g, ' ')});
  }
}
return {groups: groups, cards: cards};
"""

# The Text tab's boxes: per run and tag, the box's height, the height of what it holds (taller: it scrolls,
# hiding the rest) and its text.
_TEXT_BOXES = _WALK + """
const out = [];
for (const el of walk(document)) {
  if (el.tagName !== 'TF-TEXT-LOADER' || !el.shadowRoot) continue;
  const box = el.shadowRoot.getElementById('steps-container');
  if (!box) continue;
  let text = '';
  for (const n of walk(box)) {
    if (n.tagName !== 'TF-MARKDOWN-VIEW' || !n.shadowRoot) continue;
    for (const c of n.shadowRoot.children) { if (c.tagName !== 'STYLE') text += ' ' + (c.innerText || ''); }
  }
  out.push({run: el.run, tag: el.tag, scroll_height: box.scrollHeight, client_height: box.clientHeight,
            text: text.replace(/\\s+/g, ' ').trim()});
}
return out;
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _wait_http(url: str, timeout: float) -> None:
  end = time.time() + timeout
  while True:
    try:
      with urllib.request.urlopen(url, timeout=5):
        return
    except (urllib.error.URLError, ConnectionError, OSError):
      if time.time() > end:
        raise RuntimeError(f"{url} did not answer within {timeout:.0f} s") from None
      time.sleep(0.5)


class WebDriver:
  """The four W3C WebDriver calls this needs, over chromedriver's HTTP port."""

  def __init__(self, base: str, chromium: str, profile: str, width: int, height: int):
    self.base = base
    caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
        "binary": chromium, "args": [*CHROMIUM_ARGS, f"--user-data-dir={profile}",
                                     f"--window-size={width},{height}"]}}}}
    self.session = self._call("POST", "/session", caps)["sessionId"]

  def _call(self, method: str, path: str, body: dict | None = None):
    req = urllib.request.Request(self.base + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
      return json.load(r)["value"]

  def get(self, url: str) -> None:
    self._call("POST", f"/session/{self.session}/url", {"url": url})

  def script(self, source: str, *args):
    return self._call("POST", f"/session/{self.session}/execute/sync", {"script": source, "args": list(args)})

  def screenshot(self, path: str) -> None:
    with open(path, "wb") as f:
      f.write(b64decode(self._call("GET", f"/session/{self.session}/screenshot")))

  def quit(self) -> None:
    try:
      self._call("DELETE", f"/session/{self.session}")
    except (urllib.error.URLError, OSError):
      pass


class Browser:
  """TensorBoard on `logdir` and a headless Chromium session, both ended on exit."""

  def __init__(self, logdir: str, chromedriver: str = "/usr/bin/chromedriver", chromium: str = "/usr/bin/chromium",
               width: int = 1600, height: int = 1100, tb_log=subprocess.DEVNULL):
    self.profile = tempfile.mkdtemp(prefix="tb_shots_chromium_")
    tb_port, wd_port = _free_port(), _free_port()
    self.procs = [subprocess.Popen([sys.executable, "-m", "tensorboard.main", f"--logdir={logdir}",
                                    "--host=127.0.0.1", f"--port={tb_port}", "--reload_interval=0"],
                                   stdout=tb_log, stderr=subprocess.STDOUT),
                  subprocess.Popen([chromedriver, f"--port={wd_port}"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)]
    self.driver = None
    try:
      self.tb = f"http://127.0.0.1:{tb_port}"
      _wait_http(self.tb + "/data/plugins_listing", 120)
      _wait_http(f"http://127.0.0.1:{wd_port}/status", 60)
      self.driver = WebDriver(f"http://127.0.0.1:{wd_port}", chromium, self.profile, width, height)
    except BaseException:
      self.close()
      raise

  def __enter__(self) -> "Browser":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    if self.driver:
      self.driver.quit()
      self.driver = None
    for p in self.procs:
      p.terminate()
    for p in self.procs:
      try:
        p.wait(timeout=20)
      except subprocess.TimeoutExpired:
        p.kill()
    shutil.rmtree(self.profile, ignore_errors=True)

  def open(self, fragment: str, settle_s: float = 0.0) -> None:
    """A view by its URL fragment, loaded afresh (no state carried from the previous view)."""
    self.driver.get("about:blank")
    self.driver.get(f"{self.tb}/#{fragment}")
    time.sleep(settle_s)

  def charts(self, want: int = 1, want_series: int = 1, timeout: float = 40.0) -> list[dict]:
    """The open legacy dashboard's charts (title, y domain, values, series names), polling until `want` charts
    hold data in `want_series` series each (runs' data come in separately) or `timeout` passes."""
    end = time.time() + timeout
    charts: list[dict] = []
    while time.time() < end:
      charts = self.driver.script(_CHARTS)
      if sum(1 for c in charts if sum(1 for x in c["series"] if x["values"]) >= want_series) >= want:
        break
      time.sleep(0.5)
    return charts

  def time_series(self, want_cards: int = 1, want_runs: tuple[str, ...] = (), timeout: float = 40.0) -> dict:
    """Time Series' groups in order and its drawn cards (tag, text), polling until `want_cards` show a run and
    the first card lists every run of `want_runs` (runs' data come in separately) or `timeout` passes."""
    end = time.time() + timeout
    view: dict = {"groups": [], "cards": []}
    while time.time() < end:
      view = self.driver.script(_TIME_SERIES)
      shown = [c for c in view["cards"] if c["tag"] and "Run" in c["text"]]
      first = next((c["text"].split() for c in view["cards"] if c["tag"]), [])
      if len(shown) >= want_cards and all(r in first for r in want_runs):
        break
      time.sleep(0.5)
    return view

  def text_boxes(self, want: int = 1, timeout: float = 40.0) -> list[dict]:
    """The Text tab's boxes (run, tag, heights, text), polling until `want` hold text and no box shown is
    still empty (a loaded machine fills one box after another: a box caught before its text arrives is 20 px
    with nothing in it)."""
    end = time.time() + timeout
    boxes: list[dict] = []
    while time.time() < end:
      boxes = self.driver.script(_TEXT_BOXES)
      if sum(1 for b in boxes if b["text"]) >= want and all(b["text"] for b in boxes):
        break
      time.sleep(0.5)
    return boxes

  def parallel_coordinates_lines(self, want: int, timeout: float = 40.0) -> int:
    """Opens HParams, clicks its parallel-coordinates tab and counts the session lines drawn, polling until
    `want` are there or `timeout` passes (a loaded machine draws late)."""
    self.driver.get(f"{self.tb}/#hparams")
    end = time.time() + timeout
    clicked = False
    n = 0
    while time.time() < end:
      clicked = clicked or bool(self.driver.script(_CLICK, "PARALLEL COORDINATES VIEW"))
      n = int(self.driver.script(_SESSION_LINES)) if clicked else 0
      if n >= want:
        break
      time.sleep(0.5)
    return n


def shoot(logdir: str, out: str, views: list[str] | None = None) -> dict[str, dict]:
  """Screenshots of `views` (default all) of TensorBoard over `logdir` into `out`; returns per view its
  URL, PNG path, whether a clicked tab was found, and the visible text."""
  os.makedirs(out, exist_ok=True)
  result = {}
  with open(os.path.join(out, "tensorboard.log"), "w", encoding="utf-8") as tb_log, \
       Browser(logdir, FLAGS.chromedriver, FLAGS.chromium, FLAGS.width, FLAGS.height, tb_log) as browser:
    with urllib.request.urlopen(browser.tb + "/data/plugins_listing", timeout=30) as r:
      active = {name for name, p in json.load(r).items() if p.get("enabled")}
    driver = browser.driver
    for name in views or list(VIEWS):
      fragment, click = VIEWS[name]
      plugin = fragment.split("&")[0]
      plugin = "scalars" if plugin == "timeseries" else plugin
      if plugin not in active:
        result[name] = {"skipped": f"plugin {plugin} not active (no data, or not installed)"}
        continue
      url = f"{browser.tb}/#{fragment}"
      driver.get("about:blank")  # a fresh load per view: no state carried from the previous one
      driver.get(url)
      time.sleep(FLAGS.settle_s)
      clicked = None
      if click:
        clicked = bool(driver.script(_CLICK, click))
        time.sleep(FLAGS.settle_s)
      path = os.path.join(out, f"{name}.png")
      driver.screenshot(path)
      result[name] = {"url": url, "png": path, "clicked": click and (click if clicked else f"NOT FOUND: {click}"),
                      "text": driver.script(_TEXT)}
  with open(os.path.join(out, "views.json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1)
  return result


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if not FLAGS.logdir or not os.path.isdir(FLAGS.logdir):
    raise app.UsageError(f"--logdir={FLAGS.logdir}: give a folder holding run folders")
  for exe in (FLAGS.chromedriver, FLAGS.chromium):
    if not shutil.which(exe):
      raise app.UsageError(f"{exe} not found: apt-get install -y chromium chromium-driver (as root)")
  unknown = [v for v in FLAGS.views if v not in VIEWS]
  if unknown:
    raise app.UsageError(f"--views: unknown {', '.join(unknown)}; known: {', '.join(VIEWS)}")
  for name, r in shoot(FLAGS.logdir, FLAGS.out, FLAGS.views or None).items():
    print(f"{name}: {r.get('png') or r.get('skipped')}" + (f" (clicked {r['clicked']})" if r.get("clicked") else ""))


if __name__ == "__main__":
  app.run(main)
