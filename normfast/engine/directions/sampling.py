"""The heat's virtual batches drawn by their gradient energy (``ProbeConfig.heat_sampling``).

A row's heat ``V2`` is the mean over virtual batches of its squared displacement about the
mean, and every displacement is the update direction of one batch pushed through the row's
Jacobian. On some inputs the directions' energies ``e_b = |p_b|²`` are heavy-tailed: a few
rare batches carry most of the energy, and so most of every row's heat. A plain mean of M = 16
batches then misses those batches most of the time and, once in a while, holds one: the
heat's level moves tens of times between seeds, by a factor shared by every row.

The engine computes the gradients of all M_D drift batches anyway (the drift comes from their
mean direction ``p̄``). So it knows every batch's energy before it picks the heat's batches:
:func:`draw_heat` draws the M heat batches independently, with replacement, from that pool of N
batches with probability ``q_b`` (:func:`heat_proposal`: by default proportional to the energy,
the proposal ``python -m bench run heat_sampling`` chose), and each draw ``i`` (pool batch ``b_i``)
carries the weight ``w_i = 1 / ((N - 1) q_{b_i})``. With the pool's mean direction ``p̄`` known
exactly, the heat's estimator is

    V2 = (1/M) Σ_i w_i |J (p_{b_i} - p̄)|²

which is unbiased for the pool's sample variance ``Σ_b |J (p_b - p̄)|² / (N - 1)``, itself
unbiased for the heat (the same for ``V2_w``). The engine folds the weight and the centering
into the direction itself, ``p'_i = sqrt(w_i) (p_{b_i} - p̄)``, so every transmission path (jvp,
head mode, the Triton kernels) runs unchanged and only the final step differs: the heat is the
mean square of the displacements about a known centre
(``ProbeAccumulator(known_mean=True)``, ``prepare_head(..., known_mean=True)``). The draws are
independent, so the K-group jackknife over draws (draw ``i`` in group ``i mod K``) still gives
the error bars.

What the draw cannot see is the pool's own sampling error: a pool of N batches that happened to
miss (or hold) the tail. :func:`pool_level_se` estimates it from the energies (the relative
standard error of their mean, in log units); the engine adds it to the error of the heat's
common level and to the ``r_eq`` intervals, so that an interval can hold across seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from normfast.engine.defaults import HEAT_SAMPLING  # noqa: F401 - the choices, re-exported

#: the proposal shapes :func:`heat_proposal` knows; the engine's (``DEFAULT_PROPOSAL``) is the one
#: ``python -m bench run heat_sampling`` chose by its protocol (stage A: the smallest mean squared log
#: error of the rows' heat on the worse of its two held-out sets)
PROPOSALS = ("energy", "sqrt_energy", "mixture", "mixture_sqrt")
DEFAULT_PROPOSAL = "energy"
#: the random stream of the draw, apart from the batches' own (the same seed draws the same batches)
_STREAM = 0x4EA7


def heat_proposal(energy: Any, method: str = DEFAULT_PROPOSAL) -> np.ndarray:
    """The probability ``q_b`` of drawing pool batch ``b``, from the batches' energies (float64, sums to 1).

    ``"energy"``: ``∝ e``; ``"sqrt_energy"``: ``∝ sqrt(e)``; ``"mixture"``: ``½ uniform + ½ ∝ e``;
    ``"mixture_sqrt"``: ``½ uniform + ½ ∝ sqrt(e)``. A pool whose energies are all zero is drawn
    uniformly, and one where the tilt would give some batch ``q = 0`` (an energy of zero, or a share
    that underflows) takes the mixture with the uniform draw: every batch can be drawn, since even
    one without energy moves every row by the centre, and the estimator stays unbiased.
    """
    fn = "heat_proposal"
    e = np.asarray(energy, dtype=np.float64)
    if e.ndim != 1 or e.size < 1:
        raise ValueError(f"{fn}: expected a 1-D array of at least one energy, got shape {e.shape}")
    if not np.all(np.isfinite(e)) or np.any(e < 0):
        bad = int((~np.isfinite(e)).sum())
        raise ValueError(f"{fn}: expected finite energies >= 0, got min {np.nanmin(e)!r} and {bad} non-finite")
    if method not in PROPOSALS:
        raise ValueError(f"{fn}: expected method in {PROPOSALS}, got {method!r}")
    n = e.size
    uniform = np.full(n, 1.0 / n)
    shape = np.sqrt(e) if method in ("sqrt_energy", "mixture_sqrt") else e
    total = shape.sum()
    if not total > 0:
        return uniform
    tilted = shape / total
    if method.startswith("mixture"):
        return 0.5 * uniform + 0.5 * tilted
    # a batch the tilt cannot reach still moves every row by the centre (|J p̄|²): a batch of zero energy
    # (e.g. SupCon's batch without a positive) or one whose share underflows keeps the uniform half
    if np.any(tilted == 0):
        return 0.5 * uniform + 0.5 * tilted
    return tilted


@dataclass(frozen=True)
class HeatDraw:
    """The heat's batches drawn from the drift's pool, and what the run reports about the draw.

    ``batches[i]``: the pool batch (its global index) of draw ``i``; ``weights[i]``: ``1 / ((N - 1)
    q)`` of that draw (folded into its direction as ``sqrt(w)``); ``pool``: N; ``proposal``: the
    shape of q; ``level_se``: the pool's own error of the heat's level (log units,
    :func:`pool_level_se`)."""

    batches: tuple[int, ...]
    weights: tuple[float, ...]
    pool: int
    proposal: str
    level_se: float

    @property
    def M(self) -> int:
        return len(self.batches)

    @property
    def effective_size(self) -> float:
        """Kish's effective sample size of the weights, ``(Σ w)² / Σ w²``."""
        w = np.asarray(self.weights)
        return float(w.sum() ** 2 / np.square(w).sum())

    def head(self, m: int) -> "HeatDraw":
        """The first ``m`` draws (adaptive M draws up to its cap and uses the first M)."""
        return HeatDraw(self.batches[:m], self.weights[:m], self.pool, self.proposal, self.level_se)

    def metadata(self) -> dict[str, Any]:
        """What the run's metadata records (``heat_sampling``)."""
        return {
            "method": "energy",
            "proposal": self.proposal,
            "pool": self.pool,
            "draws": self.M,
            "distinct_batches": len(set(self.batches)),
            "effective_sample_size": self.effective_size,
            "pool_level_se": self.level_se,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "batches": list(self.batches),
            "weights": list(self.weights),
            "pool": self.pool,
            "proposal": self.proposal,
            "level_se": self.level_se,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "HeatDraw":
        return cls(
            tuple(int(b) for b in d["batches"]),
            tuple(float(w) for w in d["weights"]),
            int(d["pool"]),
            str(d["proposal"]),
            float(d["level_se"]),
        )


def pool_level_se(energy: Any) -> float:
    """The pool's own error of the heat's level, in log units: the relative standard error of the mean
    of the pool's N energies, ``sd(e) / (mean(e) sqrt(N))``, as a log-normal's ``sqrt(log(1 + rse²))``.

    The heat is a mean over the batch distribution, and the pool is N draws of it; a heavy tail
    the pool did not sample stays unseen (this is the estimate the pool itself can give)."""
    e = np.asarray(energy, dtype=np.float64)
    if e.size < 2 or not e.mean() > 0:
        return 0.0
    rse = e.std(ddof=1) / (e.mean() * math.sqrt(e.size))
    return float(math.sqrt(math.log1p(rse * rse)))


def draw_heat(energy: Any, m: int, seed: int, proposal: str = DEFAULT_PROPOSAL, first: int = 0) -> HeatDraw:
    """M heat batches drawn independently, with replacement, from a pool with these energies.

    ``energy[j]`` belongs to pool batch ``first + j`` (its global index); ``seed`` the run's: the
    same seed and energies give the same draw. Raises ``ValueError`` for a pool of fewer than two
    batches or ``m < 2``.
    """
    fn = "draw_heat"
    e = np.asarray(energy, dtype=np.float64)
    if e.ndim != 1 or e.size < 2:
        raise ValueError(f"{fn}: expected the energies of a pool of at least 2 batches, got shape {e.shape}")
    if isinstance(m, bool) or not isinstance(m, int) or m < 2:
        raise ValueError(f"{fn}: expected m >= 2 draws, got m={m!r}")
    q = heat_proposal(e, proposal)
    rng = np.random.default_rng([int(seed), _STREAM])
    picks = rng.choice(e.size, size=m, replace=True, p=q)
    weights = 1.0 / ((e.size - 1) * q[picks])
    return HeatDraw(
        tuple(int(first + j) for j in picks), tuple(float(w) for w in weights), int(e.size), proposal, pool_level_se(e)
    )
