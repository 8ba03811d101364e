"""The radial-budget ledger: the realized change of every item's squared norm, term by term.

At every training step in the window, for every item, with ``z = f(θ)``,
``z' = f(θ')`` and the step ``Δθ = θ' − θ`` that the optimizer actually took
(torch's SGD, heavy-ball SGD or AdamW, with its real ``exp_avg``/``exp_avg_sq``)
split into its weight-decay part ``Δθ_d`` and its task part
``Δθ_t = Δθ − Δθ_d``::

    R'² − R² = 2 z·J Δθ_t                              first-order task
             + |J Δθ_t|²                               second-order task
             + 2 z·J Δθ_d + |J Δθ_d|² + 2 J Δθ_t·J Δθ_d  decay (with its tiny second-order parts)
             + (|z'|² − |z + J Δθ|²)                  remainder: what the linearization misses

``J Δθ`` is a forward-mode jvp of the item forward along the actual step,
evaluated in float64 (the float32 parameters are exact in float64, so the
terms are free of the rounding of ``R'² − R²``). The four terms sum to
``R'² − R²`` by construction; the checks that they are right are not that sum
but: the free table is linear in its parameters (remainder exactly 0) and
its rows receive only tangential task gradients (first-order task exactly 0);
for a bias-free 2-layer ReLU network the decay term is exactly
``−2ηλ·2·R²`` per step (κ = 2); and over a stationary window the terms'
means sum to ≈ 0 against the size of each (tests/experiments/test_e1.py).

The decay part of the step: ``−ηλθ`` for SGD without momentum (torch's
coupled L2 is then the same as decoupled decay) and for AdamW (decoupled);
for heavy-ball SGD, whose buffer also accumulates the coupled decay, a
shadow buffer ``b_d ← β b_d + λθ`` run from step 0 gives ``Δθ_d = −η b_d``.

The per-step computation (the decay split and the jvps) is the engine's,
:mod:`normfast.engine.monitor.realized`, shared with the training monitor
(:class:`normfast.TrainingMonitor`); this module accumulates it over E1's window.

The engine's estimate of each term, in the same units (per step), from a
probe at a checkpoint with norm ``R`` (``η`` the learning rate, ``β`` the
heavy-ball momentum, 0 otherwise)::

                       SGD (β: long-run, see below)     AdamW
    first-order task   2η D / (1−β)                      2η R D_w
    second-order task  η² Q / ((1−β)² R²)                η² Q_w
    decay              −2ηλ κ R² / (1−β)                 −2ηλ κ R²
    remainder          0 (the law has no such term)      0

With momentum (heavy-ball β, or AdamW's β1) each gradient is spread over many
steps, so the realized per-step ``|J Δθ_t|²`` is only part of the long-run
noise; the rest appears in the first-order term, through the correlation of
the buffer's past gradients with the present ``z``. The law's estimates are
long-run figures: for momentum runs compare their sum ("task, both orders").
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch
from torch.func import functional_call

from normfast.engine.monitor import TERMS, DecaySplit, StepRule, estimated_terms, parameters_as, step_terms, with_sums

__all__ = ["TERMS", "TERM_LABELS", "RealizedLedger", "estimated_terms", "realized_terms", "compare"]

TERM_LABELS = {
    "task1": "first-order task 2z·JΔθ_t",
    "task2": "second-order task |JΔθ_t|²",
    "task": "task, both orders",
    "decay": "decay",
    "remainder": "curvature remainder",
    "total": "total R'²−R²",
}


class RealizedLedger:
    """Accumulates the realized terms of every step it is told to record (see the module docstring).

    Call :meth:`before_step` right before ``optimizer.step()`` and :meth:`after_step`
    right after it, on every training step (heavy-ball SGD's shadow decay buffer
    must see every step from the first); ``record`` says whether the step counts.
    Per-item sums over the recorded steps are kept, and block sums over blocks of
    ``cfg.probe_every`` recorded steps (the checkpoint spacing).
    """

    def __init__(self, encoder: Any, state: Mapping[str, torch.Tensor], variant: Any, cfg: Any):
        self.encoder = encoder
        x = state["x"]
        self.state = dict(state, x=x.double() if x.is_floating_point() else x)
        self.names = [n for n, _ in encoder.named_parameters()]
        self.lr = variant.lr(cfg)
        self.wd = cfg.weight_decay
        self.momentum = variant.momentum if variant.optimizer == "sgd" else 0.0
        self.block = cfg.probe_every
        n = x.shape[0]
        self.sums = {k: torch.zeros(n, dtype=torch.float64) for k in (*TERMS, "decay_first_order", "total", "R", "R2")}
        self.blocks: list[dict[str, torch.Tensor]] = []
        self._block = {k: torch.zeros(n, dtype=torch.float64) for k in (*TERMS, "R2")}
        self._in_block = 0
        self.steps = 0
        self.r2_first: torch.Tensor | None = None
        self.r2_last: torch.Tensor | None = None
        self._theta: dict[str, torch.Tensor] | None = None
        rule = StepRule(self.lr, self.wd, self.momentum)
        self._rules = {n: rule for n in self.names}
        self._decay = DecaySplit()

    def _params64(self) -> dict[str, torch.Tensor]:
        return parameters_as(self.encoder.named_parameters())

    def _f(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(self.encoder, params, (self.state,), {"output": "pooled"}, strict=False)

    def before_step(self, record: bool) -> None:
        if not record and not self.momentum:
            self._theta = None
            return
        theta = self._params64()
        if self.momentum:
            self._decay.before_step(theta, self._rules)
        self._theta = theta if record else None

    @torch.no_grad()
    def after_step(self, record: bool) -> None:
        if not record or self._theta is None:
            return
        theta = self._theta
        new = self._params64()
        terms = step_terms(self._f, theta, new, self._decay.decay(theta, self._rules))
        r2, r2_new = terms["r2"], terms["r2_new"]
        for k in TERMS:
            self.sums[k] += terms[k]
            self._block[k] += terms[k]
        self.sums["decay_first_order"] += terms["decay_first_order"]
        self.sums["total"] += r2_new - r2
        self.sums["R"] += r2.sqrt()
        self.sums["R2"] += r2
        self._block["R2"] += r2
        if self.r2_first is None:
            self.r2_first = r2.clone()
        self.r2_last = r2_new
        self.steps += 1
        self._in_block += 1
        if self._in_block == self.block:
            self.blocks.append({k: v / self.block for k, v in self._block.items()})
            self._block = {k: torch.zeros_like(v) for k, v in self._block.items()}
            self._in_block = 0

    def means(self) -> dict[str, np.ndarray]:
        """Per-item window means of every term (and of R, R²)."""
        if not self.steps:
            raise ValueError("RealizedLedger.means: no step was recorded")
        return {k: (v / self.steps).numpy() for k, v in self.sums.items()}

    def block_means(self, term: str) -> np.ndarray:
        """``[n_blocks, n_items]``: the term's mean over each block of ``probe_every`` steps."""
        return torch.stack([b[term] for b in self.blocks]).numpy()


def realized_terms(means: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The realized window means with the same derived rows as :func:`estimated_terms`."""
    out = with_sums({k: np.asarray(means[k]) for k in TERMS})
    out["total_telescoped"] = np.asarray(means["total"])
    return out


def compare(realized: Mapping[str, np.ndarray], estimates: Mapping[str, Mapping[str, np.ndarray]]) -> dict:
    """Per term: the realized mean over items and, per estimate, its mean, ratio of means and per-item r."""
    rows = {}
    for term in ("task1", "task2", "task", "decay", "remainder", "total"):
        real = np.asarray(realized[term], dtype=float)
        row: dict[str, Any] = {"realized_mean": float(np.mean(real)), "realized_mean_abs": float(np.mean(np.abs(real)))}
        for name, est in estimates.items():
            e = np.asarray(est[term], dtype=float)
            m = float(np.mean(e))
            ratio = float(np.mean(real) / m) if m != 0 else float("nan")
            r = _pearson(real, e)
            row[name] = {"mean": m, "ratio_realized_over_estimated": ratio, "pearson_r": r}
        rows[term] = row
    return rows


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.std(x[ok]) == 0 or np.std(y[ok]) == 0:
        return float("nan")
    return float(np.corrcoef(x[ok], y[ok])[0, 1])
