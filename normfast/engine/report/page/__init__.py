"""The pages normfast writes: one self-contained HTML file each (``normfast view``, ``normfast compare``,
``ProbeResult.to_html``).

:mod:`~normfast.engine.report.page.frame` is what every page of the family shares: the jinja2
frame ``base.html.j2``, the style ``page.css``, the script helpers ``common.js`` and the inline
JSON data. A probe run's page: :mod:`~normfast.engine.report.page.collect` gathers what it shows
from the run (bounded in size whatever the run's size), :mod:`~normfast.engine.report.page.build`
renders it (``page.html.j2``, ``page.js``). A comparison of two runs:
:mod:`~normfast.engine.report.page.compare` (``compare.html.j2``, ``compare.js``). A training
monitor's page lives with the monitor (:mod:`normfast.engine.monitor.page`).
"""

from normfast.engine.report.page.build import InlinePage, page_data, page_html, render, summary_html, write_page

__all__ = ["InlinePage", "page_data", "page_html", "render", "summary_html", "write_page"]
