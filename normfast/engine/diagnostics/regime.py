"""The regime check: does the equilibrium law apply to this run, and to each of its rows?

The law (DESIGN §1) balances three things per probe item: weight decay pulling
the norm in (``2λκR²``), the stochastic heat pushing it out (``ηQ``) and the
radial drift (``2D``). It has an equilibrium to predict only where decay
actually grips the embedding's scale. Every probe run therefore classifies
each row, from quantities the engine already measures, as

``"law applicable"``
    decay grips the scale and the drift matters against the heat: the full
    law's ``r_eq`` is the prediction;
``"heat-dominated"``
    decay grips the scale and the drift is small against the heat
    (``drift_to_heat`` below 0.3, so the full law's ``r_eq`` is within about
    15% of the heat-only ``r_eq_heat``): the heat-only law is the prediction;
``"not applicable"``
    decay does not grip the scale; the law has no equilibrium, ``r_eq`` is no
    prediction. The heat ``V2`` (and the drift ``D``) are still measured
    correctly: they describe the update noise, not an equilibrium.
``"objective saturated"``
    decay grips the scale, but the virtual objective has no task left (by its
    own rule; for the softmax losses a loss near 0:
    :mod:`normfast.engine.diagnostics.health`), so drift and
    heat come from near-zero gradients and ``r_eq`` is far below any present
    norm: the law's answer for that virtual training, not a finding about the
    items (the relative heat still ranks them).

and the run as a whole (the class of most valid rows, with the shares of the
three). The checks, in order (the first that fires gives the row's reason):

* ``invalid``: the row has no valid statistics (zero or non-finite embedding...);
* ``no_update``: nothing moves the item: its drift and heat are exactly zero in
  every branch (a zero displacement in every virtual batch, e.g. a zero loss:
  SupCon when no two items of a batch share a label). There is nothing for
  decay to balance, and ``r_eq`` is NaN (no positive root);
* ``no_decay``: ``weight_decay = 0``;
* ``undecayed_sets_scale``: the probed parameters that are exempt from decay
  (``no_decay``, e.g. LayerNorm gains and biases) carry most of the radial
  grip. One more jvp, along the exempt probed parameters themselves, gives
  ``kappa_exempt = ẑ·(J θ_exempt)/R`` beside ``κ = ẑ·(J θ_decayed)/R``; when
  the share ``κ / (κ + |kappa_exempt|)`` is below 0.5, scaling the exempt
  parameters moves the norm more than scaling the decayed ones: in a
  post-LayerNorm encoder whose final LayerNorm is exempt, ``κ ≈ 0`` and
  ``kappa_exempt ≈ 1``, and the norm is set by parameters that decay never
  touches (E2 protocol v3 in the docs, Experiments). A negative κ beside a positive
  ``kappa_exempt`` counts here too: the exempt parameters are the cause;
* ``kappa_nonpositive``: ``κ ≤ 0`` -- decay does not pull the embedding inwards;
* ``kappa_small``: ``κ < 0.25`` -- the decayed parameters barely move the
  embedding's scale, typically because a normalization sits between them and
  the output (the scale is then held by parameters that are not probed, or by
  the normalization itself, and the law's second-order heat term is cancelled
  by the normalization's curvature, which the law does not contain). For the
  homogeneous cases the law is built on, κ is 1 (a linear head, an embedding
  table, a final LayerNorm whose gain and bias are decayed) or the depth ``L``
  of a bias-free ReLU network;
* ``objective_saturated`` (run level, checked after the κ checks): the run's virtual
  objective says it is saturated (:mod:`.health`; for the softmax losses, a mean virtual loss
  below 3e-4 of the chance level ``log(batch_size)``; each objective declares its rule);
* ``drift_small`` (heat-dominated): ``drift_to_heat < 0.3``, where
  ``drift_to_heat = |D| / sqrt(2λκη Q)`` (``η`` with the momentum heuristic
  ``η/(1−β)``; the scale-free branch uses ``D_w`` and ``Q_w``; with both, the
  larger ratio). In the SGD closed form ``R² = (D + sqrt(D² + 2λκηQ))/(2λκ)``
  this ratio alone sets ``r_eq / r_eq_heat`` (0.86 to 1.16 at 0.3);
* ``drift_resolved`` (law applicable): ``|D| > 2 se_D`` (with both branches: in
  every branch whose own ratio is not small);
* ``drift_unresolved`` (law applicable): the drift matters but its sign is not
  resolved by its standard error: ``r_eq`` is uncertain (more virtual batches
  for the drift resolve it).

The thresholds are constants of :class:`RegimeThresholds`, stored in the
run's metadata with the outcome (the saturation rule is the objective's, stored
with its health).

Not checked here, because the probe cannot see it: whether the model was
trained with the probe's settings until its norms were stationary. ``r_eq`` is
where each norm would settle under the probe's settings; present norms of a
model trained otherwise (every pretrained model) are not expected to match it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping

import numpy as np

LAW, HEAT, NOT_APPLICABLE = "law applicable", "heat-dominated", "not applicable"
SATURATED = "objective saturated"
REGIMES = (LAW, HEAT, NOT_APPLICABLE, SATURATED)
#: the classes whose r_eq is a prediction of the law (fits of present norms against r_eq use these rows)
PREDICTIVE = (LAW, HEAT)

#: reason code -> (regime, plain words for a row or a run whose rows mostly have it)
REGIME_REASONS: dict[str, tuple[str, str]] = {
    "invalid": (NOT_APPLICABLE, "the row has no valid statistics (see the reason column)"),
    "no_update": (
        NOT_APPLICABLE,
        "nothing moves these items: drift and heat are exactly zero in every virtual batch (a zero "
        "loss, e.g. SupCon with no two items of a batch sharing a label), so there is no equilibrium "
        "to predict",
    ),
    "no_decay": (
        NOT_APPLICABLE,
        "the weight decay is 0: nothing pulls the norm back, so the law has no "
        "equilibrium here; heat V2 and drift D are still meaningful",
    ),
    "kappa_nonpositive": (
        NOT_APPLICABLE,
        "weight decay does not pull this embedding inwards (kappa <= 0): the law "
        "has no equilibrium here; heat V2 is still meaningful",
    ),
    "undecayed_sets_scale": (
        NOT_APPLICABLE,
        "the decayed parameters you probed do not set this embedding's scale "
        "(the probed parameters exempt from decay, e.g. LayerNorm gains, carry "
        "most of the radial grip): the law has no equilibrium here; heat V2 is "
        "still meaningful",
    ),
    "kappa_small": (
        NOT_APPLICABLE,
        "the decayed parameters barely move this embedding's scale (kappa < 0.25; "
        "typically a normalization sits between them and the output): the law has no "
        "equilibrium here; heat V2 is still meaningful",
    ),
    "objective_saturated": (
        SATURATED,
        "the virtual objective is saturated (by its own rule: for a softmax loss, a loss near 0, far below "
        "its chance level log(batch size)): the drift and the heat come from near-zero gradients and are "
        "negligible against weight decay, so r_eq is the law's answer for a virtual training with no task "
        "left, not a finding about the items; the relative heat still ranks them. A higher --temperature, "
        "or a harder pair source (--pairs), gives the batches a task",
    ),
    "drift_small": (
        HEAT,
        "the drift is small against the heat: R_eq is within ~15% of the heat-only R_eq, and the heat sets it",
    ),
    "drift_resolved": (LAW, "decay, heat and drift all shape R_eq, and the drift's sign is resolved"),
    "drift_unresolved": (
        LAW,
        "decay, heat and drift all shape R_eq, but the drift's sign is not resolved "
        "(|D| < 2 se_D): R_eq is uncertain; more virtual batches for the drift "
        "resolve it",
    ),
}

#: per-row columns added to every probe table
COLUMNS = ("kappa_exempt", "drift_to_heat", "regime", "regime_reason")
#: the columns the run-level tally reads
REGIME_INPUTS = ("valid", "kappa", "kappa_exempt", "drift_to_heat", "regime_reason")


@dataclass(frozen=True)
class RegimeThresholds:
    """The constants of the regime check (see the module docstring)."""

    decayed_share_min: float = 0.5
    kappa_min: float = 0.25
    heat_dominated_below: float = 0.3
    drift_sigmas: float = 2.0


THRESHOLDS = RegimeThresholds()


def _f64(x: Any, n: int) -> np.ndarray:
    if x is None:
        return np.full(n, np.nan)
    return np.asarray(x, dtype=np.float64).reshape(-1)


def drift_to_heat(D: Any, Q: Any, kappa: Any, *, lr: float, weight_decay: float, momentum: float = 0.0) -> np.ndarray:
    """``|D| / sqrt(2 λ κ η Q)`` row-wise (η with the heavy-ball heuristic ``η/(1−β)``).

    NaN where ``κ ≤ 0``, ``Q ≤ 0`` or ``λ = 0`` (no heat scale to compare with).
    """
    D, Q, kappa = (np.asarray(v, dtype=np.float64) for v in (D, Q, kappa))
    eta = lr / (1.0 - momentum) if momentum else lr
    scale2 = 2.0 * weight_decay * kappa * eta * Q
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.abs(D) / np.sqrt(np.where(scale2 > 0, scale2, np.nan))
    return out


def classify_rows(
    columns: Mapping[str, Any],
    *,
    lr: float,
    weight_decay: float,
    momentum: float = 0.0,
    thresholds: RegimeThresholds = THRESHOLDS,
    saturated: bool = False,
) -> dict[str, np.ndarray]:
    """The regime of every row from a probe table's columns.

    ``saturated``: the run's virtual objective is saturated (:func:`.health.objective_health`); rows
    that decay grips are then ``"objective saturated"`` instead of law applicable or heat-dominated.

    ``columns`` holds ``valid``, ``kappa``, ``kappa_exempt`` (0 when no probed
    parameter is exempt from decay) and, per branch present, ``D``, ``se_D``,
    ``Q`` (and/or ``D_w``, ``se_D_w``, ``Q_w``). Returns ``drift_to_heat``
    (float64), ``regime`` and ``regime_reason`` (object arrays of strings).
    """
    valid = np.asarray(columns["valid"], dtype=bool).reshape(-1)
    n = valid.size
    kappa = _f64(columns["kappa"], n)
    exempt = _f64(columns.get("kappa_exempt", np.zeros(n)), n)
    ratios, resolved = [], []
    still = np.ones(n, dtype=bool)  # no displacement at all: zero drift and heat in every branch
    for sfx in ("", "_w"):
        if f"D{sfx}" not in columns:
            continue
        D = _f64(columns[f"D{sfx}"], n)
        still &= (D == 0) & (_f64(columns[f"Q{sfx}"], n) == 0)
        ratios.append(
            drift_to_heat(
                D,
                _f64(columns[f"Q{sfx}"], n),
                kappa,
                lr=lr,
                weight_decay=weight_decay,
                momentum=momentum if sfx == "" else 0.0,
            )
        )
        se = _f64(columns.get(f"se_D{sfx}"), n)
        with np.errstate(invalid="ignore"):  # a branch whose drift is small needs no sign
            resolved.append((np.abs(D) > thresholds.drift_sigmas * se) | (ratios[-1] < thresholds.heat_dominated_below))
    if not ratios:
        raise ValueError(f"classify_rows: expected drift columns 'D' and/or 'D_w', got {sorted(columns)}")
    ratio = np.fmax.reduce(ratios) if len(ratios) > 1 else ratios[0]
    drift_resolved = np.logical_and.reduce(resolved) if len(resolved) > 1 else resolved[0]
    with np.errstate(invalid="ignore", divide="ignore"):
        share = kappa / (kappa + np.abs(np.nan_to_num(exempt, nan=0.0)))
    reason = np.full(n, "drift_unresolved", dtype=object)
    undecided = np.ones(n, dtype=bool)

    def assign(mask: np.ndarray, code: str) -> None:
        nonlocal undecided
        hit = undecided & mask
        reason[hit] = code
        undecided = undecided & ~hit

    assign(~valid, "invalid")
    assign(still, "no_update")
    if not weight_decay > 0:
        assign(np.ones(n, dtype=bool), "no_decay")
    with np.errstate(invalid="ignore"):
        assign(share < thresholds.decayed_share_min, "undecayed_sets_scale")
    assign(~np.isfinite(kappa) | (kappa <= 0), "kappa_nonpositive")
    assign(kappa < thresholds.kappa_min, "kappa_small")
    if saturated:
        assign(np.ones(n, dtype=bool), "objective_saturated")
    with np.errstate(invalid="ignore"):
        assign(ratio < thresholds.heat_dominated_below, "drift_small")
    assign(drift_resolved, "drift_resolved")
    regime = np.empty(n, dtype=object)
    for code in set(reason.tolist()):
        regime[reason == code] = REGIME_REASONS[code][0]
    return {"drift_to_heat": ratio, "regime": regime, "regime_reason": reason}


# ----------------------------------------------------------------------------
# the run as a whole
# ----------------------------------------------------------------------------
class RegimeTally:
    """Run-level regime from the rows of one or more tables, in bounded memory.

    Counts are exact; the quantiles come from every ``stride``-th valid row,
    the stride doubling whenever more than ``keep`` values are held (so a run of
    any size costs at most ``keep`` values per quantity).
    """

    _QUANTITIES = ("kappa", "decayed_share", "drift_to_heat")

    def __init__(self, keep: int = 200_000):
        self.keep = int(keep)
        self.rows = 0
        self.valid = 0
        self.regimes = {r: 0 for r in REGIMES}
        self.reasons = {code: 0 for code in REGIME_REASONS}
        self.nonpositive_kappa = 0
        self.undecayed = 0
        self.resolved = 0
        self.has_exempt = False
        self.stride = 1
        self._seen = 0
        self._values: dict[str, list[np.ndarray]] = {q: [] for q in self._QUANTITIES}
        self._held = 0

    def add(self, table: Any) -> None:
        """Count a ``pyarrow.Table`` (or a mapping of columns) holding the regime columns."""
        col = (
            (lambda k: np.asarray(table[k]))
            if isinstance(table, Mapping)
            else (lambda k: table.column(k).to_numpy(zero_copy_only=False))
        )
        reason = col("regime_reason")
        valid = col("valid").astype(bool)
        kappa = col("kappa").astype(np.float64)
        exempt = col("kappa_exempt").astype(np.float64)
        ratio = col("drift_to_heat").astype(np.float64)
        self.rows += reason.size
        self.valid += int(valid.sum())
        codes, counts = np.unique(reason.astype(str), return_counts=True)
        for code, count in zip(codes, counts):
            self.reasons[code] = self.reasons.get(code, 0) + int(count)
            if code != "invalid":
                self.regimes[REGIME_REASONS[code][0]] += int(count)
        with np.errstate(invalid="ignore", divide="ignore"):
            share = kappa / (kappa + np.abs(np.nan_to_num(exempt, nan=0.0)))
        self.has_exempt = self.has_exempt or bool(np.any(np.nan_to_num(exempt[valid]) != 0))
        self.nonpositive_kappa += int(np.sum(valid & ~(kappa > 0)))
        self.undecayed += int(np.sum(valid & (share < THRESHOLDS.decayed_share_min)))
        self.resolved += int(np.sum(reason == "drift_resolved"))
        idx = np.nonzero(valid)[0]
        take = idx[(self._seen + np.arange(idx.size)) % self.stride == 0]
        self._seen += idx.size
        for name, values in (("kappa", kappa), ("decayed_share", share), ("drift_to_heat", ratio)):
            self._values[name].append(values[take])
        self._held += take.size
        while self._held > self.keep:
            self.stride *= 2
            for name in self._QUANTITIES:
                merged = np.concatenate(self._values[name])[::2]
                self._values[name] = [merged]
            self._held = self._values["kappa"][0].size

    def result(self) -> dict[str, Any]:
        """The run's regime: class, reason, plain words, shares and the inputs' quantiles."""
        fractions = {r: (self.regimes[r] / self.valid if self.valid else math.nan) for r in REGIMES}
        if self.valid == 0:
            regime, reason = NOT_APPLICABLE, "invalid"
        else:
            regime = max(REGIMES, key=lambda r: (self.regimes[r], -REGIMES.index(r)))
            in_class = {
                c: n for c, n in self.reasons.items() if n and REGIME_REASONS[c][0] == regime and c != "invalid"
            }
            reason = max(in_class, key=in_class.get)
        quant = {}
        for name in self._QUANTITIES:
            v = np.concatenate(self._values[name]) if self._values[name] else np.zeros(0)
            v = v[np.isfinite(v)]
            quant[name] = (
                {"p10": math.nan, "median": math.nan, "p90": math.nan}
                if v.size == 0
                else dict(zip(("p10", "median", "p90"), (float(x) for x in np.percentile(v, [10, 50, 90]))))
            )
        per_valid = lambda k: k / self.valid if self.valid else math.nan  # noqa: E731
        return {
            "regime": regime,
            "reason": reason,
            "explanation": REGIME_REASONS[reason][1],
            "fractions": fractions,
            "reasons": {c: n for c, n in self.reasons.items() if n},
            "rows": self.rows,
            "valid_rows": self.valid,
            "kappa": {**quant["kappa"], "nonpositive_fraction": per_valid(self.nonpositive_kappa)},
            "decayed_share": {
                **quant["decayed_share"],
                "below_threshold_fraction": per_valid(self.undecayed),
                "measured": self.has_exempt,
            },
            "drift_to_heat": quant["drift_to_heat"],
            "drift_resolved_fraction": per_valid(self.resolved),
            "thresholds": asdict(THRESHOLDS),
        }


def run_regime(tables: Iterable[Any]) -> dict[str, Any]:
    """The run-level regime (:meth:`RegimeTally.result`) of all rows of ``tables``."""
    tally = RegimeTally()
    for table in tables:
        tally.add(table)
    return tally.result()


# ----------------------------------------------------------------------------
# words
# ----------------------------------------------------------------------------
def share_text(f: float) -> str:
    """A share as a percentage that never rounds a non-empty class to 0% or a partial one to 100%."""
    if f != f:
        return "n/a"
    if 0 < f < 0.005:
        return "<1%"
    if 0.995 <= f < 1:
        return ">99%"
    return f"{f:.0%}"


def headline(regime: Mapping[str, Any]) -> list[str]:
    """Plain-words lines for the top of a summary (what the law can and cannot say here); the
    objective's health follows them (:func:`normfast.engine.diagnostics.health.health_line`)."""
    fr = regime["fractions"]
    name = regime["regime"]
    # the saturated class is the run's objective, all or nothing: named only when it is there
    others = ", ".join(
        f"{r} {share_text(fr[r])}"
        for r in REGIMES
        if r != name and fr.get(r, math.nan) == fr.get(r, math.nan) and (r != SATURATED or fr[r] > 0)
    )
    share = fr.get(name, math.nan)
    lines = [
        f"regime: {name.upper()} for {share_text(share)} of rows ({others})"
        if share == share
        else f"regime: {name.upper()} (no valid rows)"
    ]
    lines.append(f"  {regime['explanation']}.")
    if name in (NOT_APPLICABLE, SATURATED):
        lines.append("  R_eq, and any fit of norms against it, are not predictions of the law for these rows.")
    return lines


def fit_context(regime: Mapping[str, Any] | None, meta: Mapping[str, Any]) -> str:
    """What a slope/r of present norms against R_eq means for this run (one or two lines)."""
    settings = (
        f"{meta.get('optimizer')} lr={meta.get('lr')} wd={meta.get('weight_decay')}" if meta else "the probe's settings"
    )
    text = (
        f"  R_eq is where each norm would settle if the probed parameters were trained with "
        f"{settings} until stationary; present norms match it only in a model trained that "
        f"way, so for any other model the fit below is a comparison, not a test of the law."
    )
    if regime is not None and regime.get("regime") == NOT_APPLICABLE:
        text += " Here the law does not apply to most rows: the fit tests nothing."
    elif regime is not None and regime.get("regime") == SATURATED:
        text += " Here the virtual objective is saturated: the fit tests nothing."
    return text


def describe_short(regime: Mapping[str, Any] | None) -> str:
    """One line for a figure title."""
    if regime is None:
        return "regime check unavailable"
    fr = regime["fractions"][regime["regime"]]
    return f"regime: {regime['regime']} ({share_text(fr)} of rows) - {regime['reason'].replace('_', ' ')}"
