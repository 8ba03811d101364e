"""A probe run's page: one self-contained HTML file (``normfast view``, ``ProbeResult.to_html``).

:mod:`~normfast.engine.report.page.collect` gathers what the page shows from the run (bounded in size
whatever the run's size), :mod:`~normfast.engine.report.page.build` renders it with the jinja2
template and the script and style beside it (``page.html.j2``, ``page.js``, ``page.css``);
:mod:`~normfast.engine.report.page.live` is ``normfast serve``'s interactive page, which shows that
same page for the texts typed into it (``live.html.j2``, ``live.js``).
"""

from normfast.engine.report.page.build import InlinePage, page_data, page_html, render, summary_html, write_page
from normfast.engine.report.page.live import live_html

__all__ = ["InlinePage", "live_html", "page_data", "page_html", "render", "summary_html", "write_page"]
