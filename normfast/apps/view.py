"""``normfast view``: a run's page, or a training monitor folder's, one self-contained HTML file (driver
over :mod:`normfast.engine.report.page` and :mod:`normfast.engine.monitor.page`); ``--screenshot`` also
renders it to PNG in headless Chromium."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from normfast.data.manifest import run_stem
from normfast.engine.monitor.page import DEFAULT_SERIES, DEFAULT_STEPS
from normfast.engine.report.page.collect import DEFAULT_DOCS, DEFAULT_MAX_ROWS, DEFAULT_MAX_TYPES

view_description = """\
Write one HTML file that shows a probe run: the header in words (model,
objective, preset, M / M_D / K, the regime check and how to read r_eq here),
the text with every token colored by a statistic (hover a token for its
values with error bars), the per-type tables of `normfast aggregate` (by
token; by word for corpus runs) and a row table, sortable and filterable, and
figures (norm vs r_eq, the heat's distribution, type heat vs frequency).

The file is self-contained: its script, style and data are inline, it makes
no network request and works opened from file:// on a machine without
internet. Its size is bounded whatever the run's size: the text view and the
row table show a seeded sample of documents (--docs, --max-rows), the type
tables hold the --max-types most frequent types, the heat's distribution is a
histogram of every row.

A training monitor folder (normfast.TrainingMonitor(..., out=FOLDER)) gets
the page of the same family: the norms of chosen items over training with
the law's R_eq, the budget terms (task, decay, remainder) over training, and
a sortable table of the items' window means ± standard errors (batch means
over the window's steps). Its size is bounded whatever the run's length:
--steps points per plotted series, the trajectories of --series items.

examples:
  normfast view runs/demo/demo.parquet                 # writes runs/demo/demo.html
  normfast view runs/news.parquet --stat D --min-count 3 --out news.html
  normfast view runs/run.manifest.json                 # a sharded run
  normfast view runs/demo                              # the folder holding one run
  normfast view runs/demo/demo.parquet --screenshot runs/demo/demo.png
  normfast view runs/train_monitor                     # writes runs/train_monitor/monitor.html"""


def view_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run",
        help="a run: its .parquet file, a sharded run's .manifest.json, or the folder holding one; or a "
        "training monitor folder",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output .html (default: next to the run, RUN.html; a monitor folder's page: FOLDER/monitor.html)",
    )
    p.add_argument(
        "--stat",
        default=None,
        help="the statistic the text is colored by at first: V2 (default), D, norm, r_eq, r_eq_heat, "
        "kappa, drift_to_heat (the page switches between them)",
    )
    p.add_argument(
        "--docs",
        type=int,
        default=DEFAULT_DOCS,
        help=f"documents (probe inputs; a corpus run's documents) in the text view and row table, "
        f"a seeded random sample when the run has more (default {DEFAULT_DOCS})",
    )
    p.add_argument(
        "--max-rows",
        type=int,
        default=DEFAULT_MAX_ROWS,
        help=f"at most this many rows of sampled documents (default {DEFAULT_MAX_ROWS:,})",
    )
    p.add_argument(
        "--min-count",
        type=int,
        default=1,
        help="type tables: keep types with at least this many valid occurrences (default 1)",
    )
    p.add_argument(
        "--max-types",
        type=int,
        default=DEFAULT_MAX_TYPES,
        help=f"type tables: the most frequent types kept on the page (default {DEFAULT_MAX_TYPES:,})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the document sample (default 0)")
    p.add_argument(
        "--window",
        type=float,
        default=0.5,
        help="monitor folders: the last fraction of the recorded steps the window means and the law average "
        "over (default 0.5, as normfast report)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help=f"monitor folders: at most this many points per plotted series, each the mean over consecutive "
        f"recorded steps when there are more (default {DEFAULT_STEPS})",
    )
    p.add_argument(
        "--series",
        type=int,
        default=DEFAULT_SERIES,
        help=f"monitor folders: the items whose trajectories are on the page, spread over the range of "
        f"window-mean norms (default {DEFAULT_SERIES}; every item of the table is listed)",
    )
    screenshot_arguments(p)


def default_output(run: Path) -> Path:
    """``x.parquet`` -> ``x.html``; ``x.manifest.json`` -> ``x.html``; a folder -> ``folder/<run>.html``."""
    return run.with_name(run_stem(run) + ".html")


def chromium_executable() -> str | None:
    """The Chromium to drive: $NORMFAST_CHROMIUM, else `chromium` / `chromium-browser` on the PATH."""
    env = os.environ.get("NORMFAST_CHROMIUM")
    if env:
        return env if Path(env).exists() else None
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def screenshot(page: Path, png: Path, width: int = 1280, height: int = 1500, browser=None) -> Path:
    """Open ``page`` from file:// in headless Chromium and save the top ``width`` x ``height`` pixels
    as a 256-colour PNG (a third of the full-colour file's size; the page has few colours).

    ``browser``: a playwright ``Browser`` to use (default: start the system Chromium and close it after).
    """
    import io

    from PIL import Image

    png.parent.mkdir(parents=True, exist_ok=True)
    if browser is not None:
        tab = browser.new_page(viewport={"width": width, "height": height})
        try:
            tab.goto(page.resolve().as_uri())
            tab.wait_for_selector("body[data-ready='1']", timeout=60_000)
            shot = Image.open(io.BytesIO(tab.screenshot())).convert("RGB")
        finally:
            tab.close()
        shot.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(png, optimize=True)
        return png
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise ImportError(
            "--screenshot needs playwright (pip install playwright) and a Chromium (Debian: apt install chromium)"
        ) from None
    exe = chromium_executable()
    if exe is None:
        raise FileNotFoundError(
            "--screenshot needs a Chromium: install it (Debian: apt install chromium) or "
            "name its executable in NORMFAST_CHROMIUM"
        )
    with sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            return screenshot(page, png, width, height, browser=launched)
        finally:
            launched.close()


def _monitor_page(args: argparse.Namespace) -> Path:
    from normfast.core.paths import check_outputs
    from normfast.engine.monitor.analysis import monitor_inputs
    from normfast.engine.monitor.page import write_monitor_page

    if args.stat is not None:
        raise ValueError("--stat colors a probe run's text; a training monitor folder has none")
    folder = Path(args.run) if Path(args.run).is_dir() else Path(args.run).parent
    out = Path(args.out) if args.out else folder / "monitor.html"
    check_outputs(inputs=monitor_inputs(folder), files={"--out": out, "--screenshot": args.screenshot})
    return write_monitor_page(args.run, out, window=args.window, steps=args.steps, series=args.series)


def view_main(args: argparse.Namespace) -> int:
    from normfast.core.paths import check_outputs
    from normfast.data.manifest import resolve_run, run_inputs
    from normfast.engine.monitor.analysis import is_monitor
    from normfast.engine.result import ProbeResult

    try:
        if is_monitor(args.run):
            out = _monitor_page(args)
            what = "a training monitor folder"
        else:
            run = resolve_run(args.run)
            out = Path(args.out) if args.out else default_output(run)
            check_outputs(inputs=run_inputs(run), files={"--out": out, "--screenshot": args.screenshot})
            result = ProbeResult.load(run)
            result.to_html(
                out,
                stat=args.stat,
                docs=args.docs,
                min_count=args.min_count,
                max_rows=args.max_rows,
                max_types=args.max_types,
                seed=args.seed,
            )
            what = f"{len(result):,} rows"
    except (ValueError, TypeError, FileNotFoundError, KeyError) as exc:
        print(f"normfast view: error: {str(exc).removeprefix('normfast view: ')}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB, {what})")
    return write_screenshot(args, out, "view")


def write_screenshot(args: argparse.Namespace, page: Path, command: str) -> int:
    """``--screenshot``: the top of the written page as a PNG (0, or 2 with a one-line error)."""
    if not args.screenshot:
        return 0
    try:
        png = screenshot(page, Path(args.screenshot), args.width, args.height)
    except (ImportError, FileNotFoundError) as exc:
        print(f"normfast {command}: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {png} ({png.stat().st_size / 1e3:.0f} KB)")
    return 0


def screenshot_arguments(p: argparse.ArgumentParser) -> None:
    """``--screenshot PNG`` with its ``--width`` and ``--height``."""
    p.add_argument(
        "--screenshot",
        default=None,
        metavar="PNG",
        help="also render the page in headless Chromium and save its top as a PNG (needs playwright "
        "and a Chromium: `pip install playwright`, Debian `apt install chromium`, or the "
        "browser's executable in NORMFAST_CHROMIUM)",
    )
    p.add_argument("--width", type=int, default=1280, help="--screenshot: window width in pixels (default 1280)")
    p.add_argument("--height", type=int, default=1500, help="--screenshot: height in pixels (default 1500)")
