"""What a run's statistics can be trusted for, row by row and as a whole.

* :mod:`.regime` -- does the law apply (decay grips the scale), is the row heat-dominated, or is
  the law not applicable; the run's tally and its one-line headline;
* :mod:`.health` -- the virtual objective's health: its loss against chance, the gradient scale,
  and whether it is saturated;
* :mod:`.relative_heat` -- the heat split into a run-level common level and each row's relative
  heat, with the ranking's error bar.
"""

from normfast.engine.diagnostics.health import objective_health
from normfast.engine.diagnostics.regime import (
    REGIME_INPUTS,
    REGIMES,
    SATURATED,
    THRESHOLDS,
    RegimeThresholds,
    classify_rows,
    headline,
    run_regime,
)
from normfast.engine.diagnostics.relative_heat import (
    heat_reference,
    ranking_resolution,
    relative_heat,
    with_relative_heat,
)

__all__ = [
    "REGIMES",
    "REGIME_INPUTS",
    "RegimeThresholds",
    "SATURATED",
    "THRESHOLDS",
    "classify_rows",
    "headline",
    "heat_reference",
    "objective_health",
    "ranking_resolution",
    "relative_heat",
    "run_regime",
    "with_relative_heat",
]
