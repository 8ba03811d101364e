"""The interactive page of ``normfast serve``: a text box whose texts are probed by the service and
shown as the page ``normfast view`` writes for a run (:mod:`normfast.engine.report.page.build`),
in a frame. One HTML file with its script and style inline (``live.html.j2``, ``live.js`` and the
view's ``page.css``); it talks to the service that served it and to nothing else."""

from __future__ import annotations

from typing import Any

from normfast.engine.report.page.build import ASSETS, jinja_environment, json_for_script


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
    conf: dict[str, Any] = {
        "max_texts": int(max_texts),
        "max_chars": int(max_chars),
        "view_url": view_url,
        "probe_on_load": bool(probe_on_load),
    }
    return (
        jinja_environment()
        .get_template("live.html.j2")
        .render(
            title=title,
            runline=runline,
            source=source,
            max_texts=max_texts,
            max_chars=max_chars,
            example=example,
            payload=json_for_script(conf),
            script=(ASSETS / "live.js").read_text(encoding="utf-8"),
            style=(ASSETS / "page.css").read_text(encoding="utf-8"),
        )
    )
