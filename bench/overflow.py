"""
Check: is every table and code block of the docs readable, on a laptop and on a phone?

    python bench/overflow.py                      (needs mkdocs and the theme: pip install -r requirements-dev.txt,
                                                   and Chromium: apt-get install chromium, or --chromium PATH)
    python bench/overflow.py --screenshots shots  (also screenshots of each page into shots/: its top
                                                   2000 pixels at 1280 wide, and its top 900 at 390)

Builds the site into a temporary folder, serves it on 127.0.0.1, and opens each page in
headless Chromium at 1280 and 390 pixels wide. A small script, added to each page as it
is served, runs after the theme's own scripts and looks at every table and every code
block (pre, and the code inside it): one wider than the page's column must sit in a box
that scrolls sideways (computed overflow-x auto or scroll) and that itself fits the
column; otherwise the reader sees it cut, or the whole page scrolls. At 1280 pixels a
table must fit whole, with no scrolling: scrolling tables are for phones. It also fails a
page wider than the window. Folded blocks (??? in the pages) are opened first. No Python
package beyond mkdocs: Chromium's --dump-dom reads the result back, and the 390-pixel
page is measured in a frame of that width, since headless Chromium's window is at least
500 pixels wide.

Prints one line per problem (page, element, widths) and exits with 1 if there is any;
the code blocks (and, on a phone, tables) that fit only by scrolling are listed too, as
notes. Too heavy for CI (a Chromium start for each page and width, about 40 seconds in
all on two CPU cores): a check to run by hand after changing the pages or the theme.
"""
import argparse
import functools
import html
import http.server
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDTHS = (1280, 390)
HEIGHT = 900  # of the frame a page is measured in
SCREENSHOT = (1280, 2000)
REPORT = "overflow-report"

# Runs in the page (in a frame of the width asked for) once it has loaded and the theme
# has wrapped its tables; writes its findings into the page around the frame.
PROBE = r"""
<script>
window.addEventListener("load", () => setTimeout(() => {
  // Open the folded blocks (??? in the pages): what they hold must fit too.
  document.querySelectorAll("details").forEach((details) => { details.open = true; });
  // The column: the content area between the side bars (the whole width on a phone).
  const column = document.querySelector(".md-content") || document.body;
  const edge = column.getBoundingClientRect().right;
  const found = [];
  const name = (el) => {
    const text = (el.innerText || "").trim().split("\n")[0].slice(0, 50);
    return `${el.tagName.toLowerCase()} "${text}"`;
  };
  const where = (box) => `${box.tagName.toLowerCase()}${box.className ? "." + box.className.split(" ")[0] : ""}`;
  for (const el of column.querySelectorAll("table, pre")) {
    // A code block is a pre with its code inside: the code is what scrolls.
    const target = (el.tagName === "PRE" && el.querySelector(":scope > code")) || el;
    const content = target.getBoundingClientRect().left + target.scrollWidth;  // where its content ends
    // Up from the element: the first box that scrolls sideways and fits in the column
    // holds it readably; a box that hides what sticks out of it cuts it.
    let verdict = null, box = target;
    for (; box && box !== column; box = box.parentElement) {
      const style = getComputedStyle(box), right = box.getBoundingClientRect().right;
      if (["table", "inline-table", "inline"].includes(style.display)) continue;  // overflow does nothing there
      if (["auto", "scroll"].includes(style.overflowX) && right <= edge + 1) {
        verdict = box.scrollWidth > box.clientWidth + 1 ? "scrolls" : "fits";
        break;
      }
      if (["hidden", "clip"].includes(style.overflowX) && content > right + 1) {
        verdict = "cut";
        break;
      }
    }
    if (!verdict) verdict = Math.max(content, el.getBoundingClientRect().right) > edge + 1 ? "wider" : "fits";
    if (verdict === "scrolls") {
      found.push({problem: false, element: name(el), width: box.scrollWidth, column: box.clientWidth,
                  why: `scrolls sideways in ${where(box)}`});
    } else if (verdict !== "fits") {
      found.push({problem: true, element: name(el), width: Math.round(content - column.getBoundingClientRect().left),
                  column: column.clientWidth,
                  why: verdict === "cut" ? `cut by ${where(box)}` : "wider than the column, with nothing that scrolls"});
    }
  }
  const page = document.documentElement.scrollWidth;
  if (page > window.innerWidth + 1) {
    found.push({problem: true, element: "the page", width: page, column: window.innerWidth,
                why: "the whole page scrolls sideways"});
  }
  const report = window.parent.document.createElement("pre");
  report.id = "REPORT";
  report.textContent = JSON.stringify({
    window: window.innerWidth, column: column.clientWidth, tables: column.querySelectorAll("table").length,
    wrapped: document.querySelectorAll(".md-typeset__scrollwrap").length, found});
  window.parent.document.body.appendChild(report);
}, 1000));
</script>
""".replace("REPORT", REPORT)


class Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the built site, with the probe added to every page."""

    def send_head(self):
        if self.path.startswith("/frame?"):
            # A page in a frame of a given width: headless Chromium's window is at least 500 px.
            width, page = self.path[len("/frame?"):].split("&", 1)
            return self.html(f'<!doctype html><body style="margin:0"><iframe src="{page}" '
                             f'style="width:{width}px;height:{HEIGHT}px;border:0"></iframe></body>')
        path = Path(self.translate_path(self.path))
        if path.is_dir():
            path = path / "index.html"
        if self.path.split("?")[0].endswith(("/", ".html")) and path.is_file():
            return self.html(path.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"))
        return super().send_head()

    def html(self, text):
        body = text.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return io.BytesIO(body)

    def log_message(self, *args):
        pass


def chromium(binary, profile, url, window, extra=()):
    """Runs headless Chromium on one page in a window of (width, height); returns what it printed."""
    command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
               f"--user-data-dir={profile}", "--window-size={},{}".format(*window), "--virtual-time-budget=10000",
               *extra, url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    return done.stdout


def pages_of(site):
    """Every page of the built site, as URL paths: the home page, then the others in order."""
    pages = sorted(p.parent.relative_to(site).as_posix() for p in site.glob("**/index.html"))
    return ["/" if p == "." else f"/{p}/" for p in pages if p != "search"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser")
                        or shutil.which("google-chrome"), help="the browser to run (default: chromium on PATH)")
    parser.add_argument("--screenshots", help="a folder for screenshots of each page, at 1280 and 390 pixels")
    parser.add_argument("--pages", nargs="+", help="only these pages (as 07-dpo, or index for the home page)")
    args = parser.parse_args()
    if not args.chromium:
        parser.error("no chromium on PATH: install it (apt-get install chromium) or give --chromium PATH")
    pages = sorted(page.stem for page in (ROOT / "docs").glob("*.md"))
    unknown = sorted(set(args.pages or []) - set(pages))
    if unknown:
        parser.error(f"no page named {', '.join(unknown)}; the pages: {', '.join(pages)}")

    with tempfile.TemporaryDirectory() as temp:
        site, profile = Path(temp) / "site", Path(temp) / "profile"
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                               cwd=ROOT, env=env, capture_output=True, text=True)
        if built.returncode:
            print(built.stdout + built.stderr)
            raise SystemExit("mkdocs build --strict failed")

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(site)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{server.server_address[1]}"
        problems = 0
        try:
            pages = pages_of(site)
            if args.pages:
                pages = [p for p in pages if (p.strip("/") or "index") in args.pages]
            for page in pages:
                for width in WIDTHS:
                    dom = chromium(args.chromium, profile, f"{base}/frame?{width}&{page}",
                                   (max(width, 500) + 20, HEIGHT + 20), ["--dump-dom"])
                    match = re.search(rf'<pre id="{REPORT}">(.*?)</pre>', dom, re.S)
                    if not match:
                        print(f"{page} at {width} px: no report from the page (did it load?)")
                        problems += 1
                        continue
                    report = json.loads(html.unescape(match.group(1)))
                    if report["window"] != width:
                        print(f"{page}: asked for {width} px, the window was {report['window']} px")
                        problems += 1
                    if report["tables"] != report["wrapped"]:
                        print(f"{page} at {width} px: {report['tables']} tables, {report['wrapped']} wrapped "
                              "by the theme to scroll")
                    for item in report["found"]:
                        if width == max(WIDTHS) and item["element"].startswith("table") and not item["problem"]:
                            # On a laptop a table should be seen whole, not cut at the column's edge.
                            item["problem"] = True
                            item["why"] += f", where at {width} px a table should fit whole"
                        problems += item["problem"]
                        mark = "PROBLEM" if item["problem"] else "note"
                        print(f"{mark}: {page} at {width} px: {item['element']}: {item['width']} px in "
                              f"{item['column']} px, {item['why']}")
                    print(f"{page} at {width} px: column {report['column']} px, {report['tables']} tables, "
                          f"{sum(i['problem'] for i in report['found'])} problems")
                if args.screenshots:
                    folder = Path(args.screenshots).resolve()
                    folder.mkdir(parents=True, exist_ok=True)
                    name = page.strip("/") or "index"
                    chromium(args.chromium, profile, base + page, SCREENSHOT,
                             ["--hide-scrollbars", f"--screenshot={folder / name}.png"])
                    # The phone's width, in a frame as the measures are (the frame is HEIGHT high).
                    chromium(args.chromium, profile, f"{base}/frame?{min(WIDTHS)}&{page}", (500, HEIGHT),
                             [f"--screenshot={folder / name}-{min(WIDTHS)}.png"])
        finally:
            server.shutdown()
    if problems:
        print(f"{problems} problem{'s' if problems > 1 else ''}")
        raise SystemExit(1)
    print("every table and code block fits its column, or scrolls in a box that does")


if __name__ == "__main__":
    main()
