"""The README's (and the docs') results tables, rendered from the JSON files in bench/results/.

    python -m bench tables                       # print every table
    python -m bench tables --write README.md     # refresh the tables in a markdown file
    python -m bench tables --check README.md     # fail if the file disagrees with the JSON

In a markdown file each table sits between ``<!-- results:NAME -->`` and
``<!-- /results:NAME -->``; the text between the markers is exactly what
:func:`render_all` gives for NAME, so a number in the README is always the
number in the JSON that the named command wrote. Each experiment renders its
own blocks (:mod:`bench.harness`: ``tables``/``blocks``); the blocks that no
experiment owns are in :data:`EXTRA`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from bench.harness import EXPERIMENTS, RESULTS_DIR, load, read_json
from bench.headline import table_demo_excerpt, table_headline


def committed(name: str) -> dict[str, Any] | None:
    """The committed result file ``bench/results/<name>`` (a path relative to bench/results), or None
    when absent."""
    path = RESULTS_DIR / name
    return read_json(path) if path.exists() else None


def table_demo() -> str | None:
    """What ``normfast demo`` printed (bench/results/demo/demo_output.txt): a product's output, no experiment's."""
    path = RESULTS_DIR / "demo" / "demo_output.txt"
    if not path.exists():
        return None
    return "```\n" + path.read_text().rstrip("\n") + "\n```"


#: blocks that no experiment renders: block name -> renderer (None: nothing committed to render)
EXTRA: dict[str, Callable[[], str | None]] = {
    "demo": table_demo,
    "demo-excerpt": table_demo_excerpt,
    "headline": table_headline,
}


def experiment_blocks(name: str) -> dict[str, str]:
    """The blocks of experiment ``name`` from the committed results (only those it has data for)."""
    module = load(name)
    if hasattr(module, "blocks"):
        found = module.blocks(lambda rel: committed(f"{name}/{rel}"))
    else:
        d = committed(f"{name}/{module.RESULTS[0]}")
        found = {} if d is None else module.tables(d)
    return {k: v for k, v in found.items() if k in module.TABLES and v is not None}


def render_all() -> dict[str, str]:
    """Every block with committed data behind it: block name -> markdown."""
    out: dict[str, str] = {}
    for name in EXPERIMENTS:
        out.update(experiment_blocks(name))
    for name, fn in EXTRA.items():
        if (text := fn()) is not None:
            out[name] = text
    return out


_BLOCK = re.compile(r"(<!-- results:(?P<name>[\w-]+) -->\n)(?P<body>(?:.*?\n)?)(<!-- /results:(?P=name) -->)", re.S)


def check(path: str | Path) -> list[str]:
    """Names of the blocks in ``path`` that differ from the JSON (or name no known table)."""
    tables = render_all()
    bad = []
    for m in _BLOCK.finditer(Path(path).read_text()):
        name = m.group("name")
        if name not in tables or tables[name] + "\n" != m.group("body"):
            bad.append(name)
    return bad


def write(path: str | Path) -> None:
    """Refresh every known block of ``path`` in place (unknown blocks are left as they are)."""
    tables = render_all()

    def fill(m: re.Match) -> str:
        name = m.group("name")
        body = tables[name] + "\n" if name in tables else m.group("body")
        return m.group(1) + body + m.group(4)

    path = Path(path)
    path.write_text(_BLOCK.sub(fill, path.read_text()))
