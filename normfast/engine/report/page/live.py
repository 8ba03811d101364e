"""The interactive page of ``normfast serve``: a text box whose texts are probed by the service and
shown as the page ``normfast view`` writes for a run (:mod:`normfast.engine.report.page.build`),
in a frame. A page of the family (:mod:`normfast.engine.report.page.frame`: ``live.html.j2``
extends ``base.html.j2``; ``live.js`` follows the shared script; the shared ``page.css``); it talks
to the service that served it and to nothing else."""

from __future__ import annotations

from typing import Any

from normfast.engine.report.page.frame import render_page


def live_html(
    *,
    title: str,
    runline: str,
    source: str,
    max_texts: int,
    max_chars: int,
    example: str = "",
    view_url: str = "/api/view",
    probe_on_load: bool = False,
) -> str:
    """The interactive page: ``runline`` (the settings in one line) and ``source`` (where the directions
    came from) under the title; ``example`` fills the text box (probed at once with ``probe_on_load``)."""
    data: dict[str, Any] = {
        "title": title,
        "header": {"lines": [runline, source], "runlines": 1, "facts": []},
        "example": example,
        "conf": {
            "max_texts": int(max_texts),
            "max_chars": int(max_chars),
            "view_url": view_url,
            "probe_on_load": bool(probe_on_load),
        },
    }
    return render_page(data, template="live.html.j2", script="live.js", generator="normfast serve")
