"""The explorer's page in a real JupyterLab and Chromium, for the benchmarks: how tall each
explorer of a notebook is drawn, and whether its assign button is beside the graph.

Needs Debian's Chromium (``/usr/bin/chromium``, never a downloaded browser) and the
``playwright`` package; :func:`browser_missing` says what is missing. Imported by the scripts
beside it (``python benchmarks/X.py`` puts this folder on the import path).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

KERNEL_IDLE = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session
            && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle';
}"""

#: whether ``n`` explorers and their graphs are drawn
DRAWN = """(n) => document.querySelectorAll('.pe-explorer').length >= n
  && typeof Bokeh !== 'undefined' && [...Bokeh.index.all_views()].filter(
    v => v.model && v.model.name === 'pe-graph-plot').length >= n"""

#: per explorer on the page (page order): its height in pixels, and whether its assign button
#: is beside the graph (right of it, its top above the graph's bottom)
MEASURE = """() => [...document.querySelectorAll('.pe-explorer')].map(e => {
  const r = e.getBoundingClientRect();
  const g = e.querySelector('.pe-graph'), a = e.querySelector('button.pe-assign');
  if (!g || !a) return [r.height, false];
  const gr = g.getBoundingClientRect(), ar = a.getBoundingClientRect();
  return [r.height, ar.left >= gr.right - 1 && ar.top < gr.bottom];
})"""


def browser_missing() -> str:
    """Why the page cannot be measured here ("" when it can)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed"
    if not Path(CHROMIUM).exists():
        return "Chromium is not installed"
    return ""


@contextlib.contextmanager
def jupyterlab(root: Path) -> Iterator[str]:
    """A JupyterLab server on ``root`` (no token, this machine only) until the block ends;
    yields its address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(root / ".cfg"),
           "JUPYTER_RUNTIME_DIR": str(root / ".rt")}
    with open(root / "server.log", "w") as log:
        srv = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip",
             "127.0.0.1", "--port", str(port), "--ServerApp.token=", "--ServerApp.password=",
             "--LabApp.expose_app_in_browser=True", f"--ServerApp.root_dir={root}",
             "--LabApp.news_url=", "--LabApp.check_for_updates_class="
             "jupyterlab.NeverCheckForUpdate"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), 1).close()
                    break
                except OSError:
                    if srv.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("JupyterLab did not start: "
                                           + (root / "server.log").read_text()[-2000:]
                                           ) from None
                    time.sleep(0.3)
            yield f"http://127.0.0.1:{port}"
        finally:
            srv.terminate()
            try:
                srv.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(srv.pid, 9)


def page_measures(cells: list[str], explorers: int, width: int = 1400,
                  height: int = 900, repo: Path | None = None) -> list[tuple[float, bool]]:
    """Run a notebook of ``cells`` (code) in JupyterLab, in a ``width`` x ``height`` window,
    and return, once ``explorers`` explorers are drawn, each one's (height in pixels,
    assign button beside the graph). ``repo`` (default: the folder above this one) is put on
    the kernel's import path."""
    import nbformat
    from playwright.sync_api import sync_playwright

    repo = repo or Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="pe-page-") as folder:
        root = Path(folder)
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(f"import sys\nsys.path.insert(0, {str(repo)!r})"),
                    *(nbformat.v4.new_code_cell(c) for c in cells)]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        nbformat.write(nb, root / "page.ipynb")
        with jupyterlab(root) as url, sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM, headless=True,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--disable-sync"])
            try:
                page = browser.new_page(viewport={"width": width, "height": height})
                page.set_default_timeout(600_000)
                page.goto(f"{url}/lab/tree/page.ipynb?reset")
                page.wait_for_function(KERNEL_IDLE)
                page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
                page.wait_for_function(DRAWN, arg=explorers)
                page.wait_for_function(KERNEL_IDLE)
                page.wait_for_timeout(1500)  # (the plots lay out after they are drawn)
                return [(float(h), bool(b)) for h, b in page.evaluate(MEASURE)]
            finally:
                browser.close()
