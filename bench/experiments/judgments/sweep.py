"""Norms against human similarity judgments: does ``cos · (‖a‖‖b‖)^α`` track people better than cosine?

For item pairs ``(a_i, b_i)`` with raw (unnormalized) embeddings and a human score
``h_i``, the norm-aware similarity ``s_α = cos(a, b) · (‖a‖ ‖b‖)^α`` is correlated
with ``h`` for every α of a grid (α = 0 is cosine). Protocol
(:func:`judgment_sweep`):

* the pairs are split at random (seeded) into two halves; the best α is the one
  with the highest correlation on the first half (the *dev* half; ties go to the
  smallest ``|α|``, so cosine wins a tie), and everything is reported on the
  other half (the *test* half): the correlation of cosine, that of the chosen α,
  and their difference, with paired percentile bootstrap CIs over the test pairs;
* the same with the halves swapped (a second, independent choice of α);
* descriptive, not used for any choice: the correlation at every α on all pairs,
  and that of the norm product ``‖a‖‖b‖`` alone.

The bootstrap treats pairs as independent; where items recur across pairs (the
Lee documents each appear in 49 pairs) its CIs are optimistic.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from normfast.core.stats import correlation, paired_bootstrap

DEFAULT_ALPHAS = tuple(round(a, 2) for a in np.arange(-1.0, 1.0001, 0.05))


def norm_aware_similarity(a: np.ndarray, b: np.ndarray, alpha: float) -> np.ndarray:
    """Row-wise ``cos(a_i, b_i) · (‖a_i‖ ‖b_i‖)^alpha`` for ``a, b`` of shape ``[n, d]``."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or a.shape != b.shape:
        raise ValueError(
            f"norm_aware_similarity: expected a and b of the same shape [n, d], got "
            f"a.shape={a.shape}, b.shape={b.shape}"
        )
    na = np.linalg.norm(a, axis=1)
    nb = np.linalg.norm(b, axis=1)
    if np.any(na == 0) or np.any(nb == 0) or not (np.isfinite(na).all() and np.isfinite(nb).all()):
        raise ValueError(
            "norm_aware_similarity: zero-norm or non-finite embeddings "
            f"(rows {np.flatnonzero((na == 0) | (nb == 0) | ~np.isfinite(na * nb))[:5].tolist()})"
        )
    cos = (a * b).sum(1) / (na * nb)
    return cos * (na * nb) ** alpha


def _best_alpha(values: np.ndarray, alphas: np.ndarray) -> float:
    ok = np.isfinite(values)
    if not ok.any():
        return 0.0
    top = np.nanmax(values)
    tied = np.flatnonzero(ok & (values >= top - 1e-12))
    return float(alphas[tied[np.argmin(np.abs(alphas[tied]))]])


def judgment_sweep(
    a: np.ndarray,
    b: np.ndarray,
    human: Sequence[float],
    *,
    method: str = "spearman",
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    seed: int = 0,
    resamples: int = 1000,
) -> dict[str, Any]:
    """The α sweep against human scores, with the split-half choice of α (module docstring).

    Args:
        a, b: raw embeddings of the two sides of each pair, ``[n, d]``.
        human: the human score of each pair.
        method: ``"spearman"`` (word similarity sets) or ``"pearson"`` (Lee documents).
        alphas: the grid (must contain 0).
        seed: seeds the split and the bootstrap.
        resamples: bootstrap resamples.
    """
    fn = "judgment_sweep"
    human = np.asarray(human, dtype=np.float64)
    alphas = np.asarray(alphas, dtype=np.float64)
    n = human.shape[0]
    if np.asarray(a).shape[0] != n:
        raise ValueError(f"{fn}: expected one human score per pair, got {n} scores for {np.asarray(a).shape[0]} pairs")
    if n < 20:
        raise ValueError(f"{fn}: expected at least 20 pairs, got {n}")
    if not np.any(alphas == 0):
        raise ValueError(f"{fn}: the alpha grid must contain 0 (cosine)")
    sims = np.stack([norm_aware_similarity(a, b, float(al)) for al in alphas])  # [n_alpha, n]
    norm_product = np.linalg.norm(np.asarray(a, float), axis=1) * np.linalg.norm(np.asarray(b, float), axis=1)
    cos = sims[int(np.flatnonzero(alphas == 0)[0])]
    curve = np.array([correlation(s, human, method) for s in sims])
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    halves = (np.sort(perm[: n // 2]), np.sort(perm[n // 2 :]))
    folds = []
    for k, (dev, test) in enumerate((halves, halves[::-1])):
        dev_curve = np.array([correlation(s[dev], human[dev], method) for s in sims])
        best = _best_alpha(dev_curve, alphas)
        s_best = sims[int(np.flatnonzero(alphas == best)[0])]
        boot = paired_bootstrap(
            {"cosine": cos[test], "best": s_best[test]},
            human[test],
            method=method,
            baseline="cosine",
            resamples=resamples,
            seed=seed * 7919 + k + 1,
        )
        folds.append(
            {
                "dev_pairs": int(dev.size),
                "test_pairs": int(test.size),
                "best_alpha": best,
                "dev_curve": dev_curve.tolist(),
                "dev_at_best": float(np.nanmax(dev_curve)),
                "test": {"cosine": boot["cosine"], "best_alpha": boot["best"], "gain": boot["best - cosine"]},
            }
        )
    whole = paired_bootstrap(
        {"cosine": cos, "norm_product": norm_product}, human, method=method, resamples=resamples, seed=seed * 7919
    )
    peak = int(np.nanargmax(curve)) if np.isfinite(curve).any() else 0
    return {
        "method": method,
        "pairs": int(n),
        "alphas": alphas.tolist(),
        "all_pairs_curve": curve.tolist(),
        "all_pairs_peak_alpha": float(alphas[peak]),
        "all_pairs_peak": float(curve[peak]),
        "all_pairs": {"cosine": whole["cosine"], "norm_product_only": whole["norm_product"]},
        "folds": folds,
        "seed": seed,
        "resamples": resamples,
    }


def verdict(sweep: dict[str, Any]) -> str:
    """One line: does the held-out best α beat cosine (gain CI above zero), in both folds?"""
    gains = [f["test"]["gain"] for f in sweep["folds"]]
    above = [g["ci_low"] > 0 for g in gains]
    below = [g["ci_high"] < 0 for g in gains]
    if all(above):
        return "norm-aware beats cosine on held-out pairs in both folds"
    if all(below):
        return "norm-aware is worse than cosine on held-out pairs in both folds"
    if any(above):
        return "mixed: a held-out gain in one fold only"
    return (
        "no held-out gain over cosine (gain CI includes 0)"
        if not any(below)
        else "no held-out gain (worse than cosine in one fold)"
    )
