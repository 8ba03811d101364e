"""The page family's frame: what every page normfast writes shares (a probe run's, a training
monitor's, a comparison of two runs).

A page is one HTML file rendered from a jinja2 template that extends ``base.html.j2``, with the
style (``page.css``), the data (one JSON element) and the script (``common.js``, the shared
helpers, followed by the page's own script) inline: it needs no network and works opened from
``file://``. A page whose template and script live beside the code that gathers its data (the
training monitor's) passes that folder as ``assets``.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

ASSETS = Path(__file__).parent  # base.html.j2, page.html.j2, common.js, page.js, page.css (package data)


def rounded(values: Any, digits: int) -> list[float | None]:
    """Floats rounded to ``digits`` significant digits; NaN and infinities become null."""
    arr = np.asarray(values, dtype=float)
    return [float(f"{v:.{digits}g}") if math.isfinite(v) else None for v in arr.ravel().tolist()]


def json_for_script(data: Any) -> str:
    """JSON that is safe inside <script>: no '</' can end the element, no '<!--' can open a comment."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def data_size(data: Any) -> int:
    """Bytes (UTF-8) the data takes on the page."""
    return len(json_for_script(data).encode("utf-8"))


def _asset(name: str, folders: Sequence[Path]) -> str:
    for folder in folders:
        if (folder / name).is_file():
            return (folder / name).read_text(encoding="utf-8")
    raise FileNotFoundError(f"render_page: no {name} in {', '.join(str(f) for f in folders)}")


def render_page(
    data: dict[str, Any], *, template: str, script: str, generator: str, assets: Sequence[str | Path] = ()
) -> str:
    """One page as HTML: ``template`` (extending ``base.html.j2``) rendered with ``data``, the shared
    style and script, and the page's ``script``, looked up in ``assets`` first, then beside this module."""
    import jinja2

    folders = [Path(a) for a in assets] + [ASSETS]
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(f) for f in folders]),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    return env.get_template(template).render(
        data=data,
        generator=generator,
        payload=json_for_script(data),
        script=_asset("common.js", folders) + "\n" + _asset(script, folders),
        style=_asset("page.css", folders),
    )


def html_path(path: str | Path, command: str) -> Path:
    """``path`` as the page's destination: refused in one line unless it ends in .html (checked
    before the page is gathered)."""
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"{command}: expected an output path ending in .html, got {str(path)!r}")
    return path


def write_html(text: str, path: Path) -> Path:
    """Write a page's HTML to ``path`` (its folder made if needed); returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


class InlinePage:
    """A page shown inline by a notebook: ``_repr_html_`` puts it in an iframe (its script and ids
    stay apart from the notebook's)."""

    def __init__(self, page: str, height: int = 900):
        self.html = page
        self.height = int(height)

    def _repr_html_(self) -> str:
        return (
            f'<iframe srcdoc="{html.escape(self.html, quote=True)}" style="width:100%;'
            f'height:{self.height}px;border:1px solid #ddd" sandbox="allow-scripts"></iframe>'
        )
