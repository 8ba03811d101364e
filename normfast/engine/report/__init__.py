"""What a finished run says: its summary and figures, per-type aggregation, and its page.

* :mod:`.summary` -- ``ProbeResult.summary()``, the printed summary and the figures;
* :mod:`.aggregate` -- per-type statistics of a token-level run (by vocabulary entry or word);
* :mod:`.ranking` -- the one ranking of types every hottest / coldest list uses;
* :mod:`.figures` -- the run's figures and its per-type table's;
* :mod:`.compare` -- two runs over the same inputs, type by type: what changed, with a multiple-testing
  aware flag (``normfast compare``, ``ProbeResult.compare``);
* :mod:`.page` -- the self-contained HTML pages (``normfast view``, ``normfast compare``).
"""

from normfast.engine.report.aggregate import aggregate, write_table
from normfast.engine.report.compare import benjamini_hochberg, compare
from normfast.engine.report.figures import make_plots, plot_type_heat
from normfast.engine.report.ranking import rank_types
from normfast.engine.report.summary import SPECIAL_TOKENS, format_summary, summarize

__all__ = [
    "SPECIAL_TOKENS",
    "aggregate",
    "benjamini_hochberg",
    "compare",
    "format_summary",
    "make_plots",
    "plot_type_heat",
    "rank_types",
    "summarize",
    "write_table",
]
