"""Check the built docs site in a real headless browser.

Serves the site built by ``mkdocs build`` on 127.0.0.1 and drives Chromium with Playwright
(the system's Chromium: nothing is downloaded). Checks that

- the home page renders with its title and the navigation (Getting started, the API pages);
- an API page (tensorpar.collectives.functional) renders its heading, its functions and the
  navigation;
- the search (which runs in JavaScript, in a web worker) finds ``no_sync``;

and saves a screenshot of each into --screenshots. Exits 0 when every check passes, 1 when
one fails, 2 when no browser or no Playwright is installed.

    mkdocs build --strict --site-dir site
    python scripts/check_docs_site.py --site site --screenshots /tmp/tensorpar-docs
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve ``site`` on a free port of 127.0.0.1 from a daemon thread; returns its URL."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def find_browser(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def nav_titles(page: Any) -> list[str]:
    """The link texts of the primary navigation (the left sidebar on a wide screen)."""
    return [t.strip() for t in
            page.locator("nav.md-nav--primary a.md-nav__link").all_inner_texts()]


def check_home(page: Any, url: str) -> list[str]:
    page.goto(url + "/", wait_until="domcontentloaded")
    page.wait_for_selector("nav.md-nav--primary")
    problems = []
    if "tensorpar" not in page.title():
        problems.append(f"home: title is {page.title()!r}")
    if not page.locator("article h1").first.inner_text().strip().startswith("tensorpar"):
        problems.append("home: no 'tensorpar' heading in the article")
    titles = nav_titles(page)
    for wanted in ("Getting started", "Data parallelism", "tensorpar.collectives.functional"):
        if wanted not in titles:
            problems.append(f"home: navigation lacks {wanted!r} (has {titles})")
    return problems


def check_api(page: Any, url: str) -> list[str]:
    page.goto(url + "/api/functional/", wait_until="domcontentloaded")
    page.wait_for_selector("nav.md-nav--primary")
    problems = []
    heading = page.locator("article h1").first.inner_text()
    if "tensorpar.collectives.functional" not in heading:
        problems.append(f"api: heading is {heading!r}")
    functions = page.locator("article .doc-function").count()
    if functions < 8:
        problems.append(f"api: {functions} documented functions, expected the 8 collectives")
    for name in ("scatter", "all_reduce"):
        if page.locator(f"[id='tensorpar.collectives.functional.{name}']").count() == 0:
            problems.append(f"api: no entry for tensorpar.collectives.functional.{name}")
    active = page.locator("nav.md-nav--primary a.md-nav__link--active").all_inner_texts()
    if not any("tensorpar.collectives.functional" in a for a in active):
        problems.append(f"api: the navigation does not mark the page as active ({active})")
    return problems


def check_search(page: Any, url: str, query: str = "no_sync") -> list[str]:
    page.goto(url + "/", wait_until="domcontentloaded")
    page.wait_for_selector("input.md-search__input", state="attached")
    page.keyboard.press("/")  # the theme's shortcut: open the search and focus its input
    page.keyboard.type(query, delay=20)
    try:
        page.wait_for_selector(".md-search-result__item", timeout=20_000)
    except Exception:
        meta = page.locator(".md-search-result__meta").inner_text()
        return [f"search: no results for {query!r} within 20 s ({meta!r})"]
    texts = page.locator(".md-search-result__item").all_inner_texts()
    if not any(query in t for t in texts):
        return [f"search: {len(texts)} results for {query!r}, none mentions it"]
    print(f"search: {page.locator('.md-search-result__meta').inner_text()} for {query!r}")
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", default="site", help="the built site (default: site)")
    parser.add_argument("--screenshots", default="/tmp/tensorpar-docs-screenshots",
                        help="where the PNGs go")
    parser.add_argument("--browser", help="the Chromium binary (default: found on PATH)")
    args = parser.parse_args(argv)
    site = Path(args.site)
    if not (site / "index.html").exists():
        print(f"{site}/index.html is missing: run mkdocs build first", file=sys.stderr)
        return 1
    browser_path = find_browser(args.browser)
    if browser_path is None:
        print(f"skipped: no Chromium found ({', '.join(BROWSERS)}); on Debian: "
              "apt-get install chromium", file=sys.stderr)
        return 2
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("skipped: Playwright is not installed (pip install playwright; the system "
              "Chromium is used, no browser download is needed)", file=sys.stderr)
        return 2
    shots = Path(args.screenshots)
    shots.mkdir(parents=True, exist_ok=True)
    server, url = serve(site)
    checks: dict[str, Callable[[Any, str], list[str]]] = {
        "home": check_home, "api-functional": check_api, "search-no_sync": check_search}
    problems: list[str] = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=browser_path,
                                         args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            for name, check in checks.items():
                found = check(page, url)
                path = shots / f"{name}.png"
                page.screenshot(path=str(path))
                print(f"{name}: {'ok' if not found else 'FAILED'}; screenshot {path}")
                problems += found
            browser.close()
    finally:
        server.shutdown()
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
