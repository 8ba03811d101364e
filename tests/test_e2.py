"""E2 (bench/e2_real_encoder.py) at its quick size: the real MiniLM, WordNet pairs, the engine.

The quick run is far from stationary, so these tests check structure and sanity
(finite fits, intervals around their estimates, positive norms, a cache that
reproduces the full encoder), not the law's accuracy.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.needs_data("wordnet")
FITS = ("full_law", "heat_only_law", "last_checkpoint_full_law", "last_checkpoint_heat_only_law")


@pytest.fixture
def quick_run(e2_quick) -> tuple[dict, Path]:
    # seed 3 (not the default): another pool, other probe items and batches; see conftest.e2_quick
    summary, out, printed = e2_quick
    assert "full law, trajectory average" in printed
    return summary, out


def test_e2_quick_structure(quick_run: tuple[dict, Path]) -> None:
    summary, out = quick_run
    png = out / "e2_real_encoder.png"
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cfg = summary["config"]
    n = summary["n_probe_items"]
    assert n == cfg["n_probes"]
    assert summary["n_pairs"] == cfg["n_pairs"]
    start, stop = summary["protocol"]["window_steps"]
    assert stop == cfg["steps"] and 0 < start < stop
    window = stop - start
    assert summary["protocol"]["checkpoints"] == math.ceil(window / cfg["probe_every"])
    assert summary["protocol"]["records"] == math.ceil(window / cfg["record_every"])
    for key in ("text", "observed", "predicted_full", "predicted_heat", "predicted_last_full",
                "predicted_last_heat", "pretrained_norm", "D", "Q", "kappa"):
        assert len(summary["items"][key]) == n, key
    assert len(set(summary["items"]["text"])) == n  # distinct lemmas
    assert summary["paper"] == {"model": "DistilBERT, fine-tuned", "slope": 0.88, "pearson_r": 0.97}
    for key in ("data", "cache_front", "train", "probe", "total"):
        assert summary["seconds"][key] >= 0
    assert summary["torch_threads"] == 1
    assert summary["config"]["seed"] == 3


def test_e2_quick_fits_and_statistics(quick_run: tuple[dict, Path]) -> None:
    summary, _ = quick_run
    for key in FITS:
        fit = summary["fits"][key]
        for name in ("slope", "pearson_r"):
            value, (lo, hi) = fit[name], fit[f"{name}_ci95"]
            assert np.isfinite([value, lo, hi]).all(), (key, name, fit)
            assert lo <= value <= hi, (key, name, fit)
        assert -1 <= fit["pearson_r_ci95"][0] <= fit["pearson_r_ci95"][1] <= 1
        assert fit["n"] + fit["n_no_prediction"] == summary["n_probe_items"]
    kappa = summary["kappa"]
    assert np.isfinite([kappa["min"], kappa["median"], kappa["max"]]).all()
    assert kappa["min"] <= kappa["median"] <= kappa["max"]
    assert np.isfinite(summary["items"]["kappa"]).all()
    assert np.isfinite(summary["items"]["Q"]).all() and min(summary["items"]["Q"]) > 0
    observed = np.asarray(summary["items"]["observed"])
    assert np.isfinite(observed).all() and (observed > 0).all()
    assert (np.asarray(summary["items"]["pretrained_norm"]) > 0).all()
    assert np.isfinite(summary["drift_over_heat_median"]) and summary["drift_over_heat_median"] >= 0
    change = summary["norm_change_between_window_halves_median"]
    assert np.isfinite(change) and change >= 0
    # the cached front + real layer 5 (length-grouped) reproduces the full sentence encoder
    assert summary["cache_check_max_abs_diff"] < 1e-4
    assert np.isfinite(summary["loss_mean_last_500"])
    assert summary["loss_chance"] == pytest.approx(math.log(summary["config"]["batch_size"]))
    assert -1 <= summary["probe_embedding_mean_cosine_window"] <= 1
    steps = [t["step"] for t in summary["trajectory"]]
    assert steps == sorted(steps) and steps[-1] == summary["config"]["steps"]
    for t in summary["trajectory"]:
        assert t["norm_median"] > 0 and t["decayed_weight_norm"] > 0 and np.isfinite(t["loss_mean"])


def test_length_groups_cover_and_save_padding() -> None:
    from normfast.encoders import length_groups as _length_groups

    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 17, 32):
        lengths = sorted(rng.integers(3, 60, size=n).tolist())
        groups = _length_groups(lengths)
        assert 1 <= len(groups) <= 3
        assert groups[0][0] == 0 and groups[-1][1] == n
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(groups, groups[1:]))
        padded = sum((hi - lo) * lengths[hi - 1] for lo, hi in groups)
        assert sum(lengths) <= padded <= n * lengths[-1]
    # one very long sequence among short ones gets a group of its own
    assert _length_groups([4] * 31 + [100]) == [(0, 31), (31, 32)]
