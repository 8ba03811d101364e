"""A probe run's page: one self-contained HTML file (``normfast view``, ``ProbeResult.to_html``).

:mod:`~normfast.engine.report.page.collect` gathers what the page shows from the run (bounded in size
whatever the run's size), :mod:`~normfast.engine.report.page.build` renders it with the jinja2
template and the script and style beside it (``page.html.j2``, ``page.js``, ``page.css``).
"""

from normfast.engine.report.page.build import InlinePage, page_data, page_html, render, summary_html, write_page

__all__ = ["InlinePage", "page_data", "page_html", "render", "summary_html", "write_page"]
