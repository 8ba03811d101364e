"""normfast in the training loop: every probe item's realized radial budget while a model trains.

* :mod:`.recorder` -- :class:`TrainingMonitor`, hooked around ``optimizer.step()``;
* :mod:`.realized` -- the realized terms of one step (first- and second-order task, decay,
  remainder), shared with E1's ledger;
* :mod:`.parts` -- its settings checked, the optimizer it is given (unwrapped, its settings, its
  law), eval mode, the virtual probe at a recorded state, the clock;
* :mod:`.state` -- its fingerprint and resume state;
* :mod:`.layout` -- the monitor folder's contract (columns, metadata, versions);
* :mod:`.analysis` -- what a monitor folder says: the law's window-averaged prediction per item;
* :mod:`.readout` -- ``normfast report FOLDER`` on a monitor folder: text, figure and files, and
  every key and column of those files;
* :mod:`.page` -- ``normfast view FOLDER``: the folder's self-contained HTML page;
* :mod:`.callbacks` -- :class:`MonitorCallback`, a ``transformers.TrainerCallback``;
* :mod:`.lightning` -- :class:`LightningMonitor`, a Lightning callback (optional extra).

The two adapters import their trainer libraries: they are loaded on first use.
"""

from normfast.engine.monitor.analysis import analyze, analyze_table, is_monitor, load_monitor, stationarity
from normfast.engine.monitor.page import write_monitor_page
from normfast.engine.monitor.readout import FIGURE_FILE, ITEMS_FILE, REPORT_FILE, monitor_report
from normfast.engine.monitor.realized import (
    TERMS,
    DecaySplit,
    StepRule,
    StepSums,
    estimated_terms,
    parameters_as,
    realized_law,
    step_rules,
    step_terms,
    with_sums,
)
from normfast.engine.monitor.recorder import TrainingMonitor

#: the trainer adapters, imported on first use (each imports its trainer library)
_ADAPTERS = {
    "MonitorCallback": "normfast.engine.monitor.callbacks",
    "LightningMonitor": "normfast.engine.monitor.lightning",
}


def __getattr__(name: str):
    if name in _ADAPTERS:
        import importlib

        return getattr(importlib.import_module(_ADAPTERS[name]), name)
    raise AttributeError(f"module 'normfast.engine.monitor' has no attribute {name!r}")


__all__ = [
    "FIGURE_FILE",
    "ITEMS_FILE",
    "REPORT_FILE",
    "TERMS",
    "parameters_as",
    "with_sums",
    "LightningMonitor",
    "MonitorCallback",
    "DecaySplit",
    "StepRule",
    "StepSums",
    "TrainingMonitor",
    "analyze",
    "analyze_table",
    "estimated_terms",
    "is_monitor",
    "load_monitor",
    "monitor_report",
    "realized_law",
    "stationarity",
    "step_rules",
    "step_terms",
    "write_monitor_page",
]
