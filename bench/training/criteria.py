"""The criteria a training run must meet before any fit means anything (:func:`health`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.training.settings import HealthThresholds, TrainSettings
from bench.training.stationary import Records


def _halves_change(values: np.ndarray) -> np.ndarray:
    """|mean of the second half - mean of the first half| / overall mean, along axis 0."""
    half = len(values) // 2
    first, second = values[:half].mean(0), values[half:].mean(0)
    return np.abs(second - first) / values.mean(0)


def health(rec: Records, settings: TrainSettings, thresholds: HealthThresholds = HealthThresholds()) -> dict[str, Any]:
    """(a) loss below a fraction of chance, (b) no collapse, (c) stationarity, on recorded training."""
    chance = float(np.log(settings.batch_size))
    out: dict[str, Any] = {"loss_chance": chance, "stopped_at_step": rec.stopped_at}
    cosines = [t["mean_cosine"] for t in rec.trajectory] + list(rec.window_cosines)
    out["max_mean_cosine"] = float(max(cosines)) if cosines else float("nan")
    out["no_collapse"] = bool(cosines) and out["max_mean_cosine"] < thresholds.collapse_cosine
    window_losses = np.asarray(rec.losses[rec.window_start :])
    if rec.stopped_at is not None or len(rec.window_norms) < 2 or window_losses.size == 0:
        out.update(loss_below_chance=False, stationary=False, passed=False)
        return out
    per100 = [float(window_losses[i : i + 100].mean()) for i in range(0, len(window_losses), 100)]
    out["loss_window_mean"] = float(window_losses.mean())
    out["loss_window_max_100_step_mean"] = max(per100)
    out["loss_threshold"] = thresholds.loss_fraction_of_chance * chance
    out["loss_below_chance"] = out["loss_window_max_100_step_mean"] < out["loss_threshold"]
    norms = np.stack(rec.window_norms)
    out["norm_change_between_window_halves_median"] = float(np.median(_halves_change(norms)))
    weights = np.asarray(rec.window_weight_norms)
    out["decayed_weight_norm_change_between_window_halves"] = float(_halves_change(weights))
    out["decayed_weight_norm_window"] = [float(weights.min()), float(weights.max())]
    out["mean_cosine_window"] = float(np.mean(rec.window_cosines))
    out["stationary"] = (
        out["norm_change_between_window_halves_median"] < thresholds.norm_change_max
        and out["decayed_weight_norm_change_between_window_halves"] < thresholds.weight_change_max
    )
    out["passed"] = bool(out["loss_below_chance"] and out["no_collapse"] and out["stationary"])
    return out
