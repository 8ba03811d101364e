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
means sum to ≈ 0 against the size of each (tests/test_validate.py).

The decay part of the step: ``−ηλθ`` for SGD without momentum (torch's
coupled L2 is then the same as decoupled decay) and for AdamW (decoupled);
for heavy-ball SGD, whose buffer also accumulates the coupled decay, a
shadow buffer ``b_d ← β b_d + λθ`` run from step 0 gives ``Δθ_d = −η b_d``.

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
from torch.func import functional_call, jvp

TERMS = ("task1", "task2", "decay", "remainder")
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
        self.sums = {k: torch.zeros(n, dtype=torch.float64)
                     for k in (*TERMS, "decay_first_order", "total", "R", "R2")}
        self.blocks: list[dict[str, torch.Tensor]] = []
        self._block = {k: torch.zeros(n, dtype=torch.float64) for k in (*TERMS, "R2")}
        self._in_block = 0
        self.steps = 0
        self.r2_first: torch.Tensor | None = None
        self.r2_last: torch.Tensor | None = None
        self._theta: dict[str, torch.Tensor] | None = None
        self._buf_decay: dict[str, torch.Tensor] | None = None

    def _params64(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.float64, copy=True) for n, p in self.encoder.named_parameters()}

    def _f(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(self.encoder, params, (self.state,), {"output": "pooled"}, strict=False)

    def before_step(self, record: bool) -> None:
        if not record and not self.momentum:
            self._theta = None
            return
        theta = self._params64()
        if self.momentum:
            if self._buf_decay is None:  # torch's first step: buffer = d_p
                self._buf_decay = {n: self.wd * t for n, t in theta.items()}
            else:
                for n, t in theta.items():
                    self._buf_decay[n].mul_(self.momentum).add_(t, alpha=self.wd)
        self._theta = theta if record else None

    @torch.no_grad()
    def after_step(self, record: bool) -> None:
        if not record or self._theta is None:
            return
        theta = self._theta
        new = self._params64()
        if self.momentum:
            d_decay = {n: -self.lr * self._buf_decay[n] for n in self.names}
        else:
            d_decay = {n: -self.lr * self.wd * theta[n] for n in self.names}
        d_task = {n: new[n] - theta[n] - d_decay[n] for n in self.names}
        z, jt = jvp(self._f, (theta,), (d_task,))
        _, jd = jvp(self._f, (theta,), (d_decay,))
        z_new = self._f(new)
        r2 = z.square().sum(-1)
        r2_new = z_new.square().sum(-1)
        lin = z + jt + jd
        terms = {
            "task1": 2 * (z * jt).sum(-1),
            "task2": jt.square().sum(-1),
            "decay": 2 * (z * jd).sum(-1) + jd.square().sum(-1) + 2 * (jt * jd).sum(-1),
            "remainder": r2_new - lin.square().sum(-1),
        }
        for k, v in terms.items():
            self.sums[k] += v
            self._block[k] += v
        self.sums["decay_first_order"] += 2 * (z * jd).sum(-1)
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


# ----------------------------------------------------------------------------
# the engine's estimates of the same terms
# ----------------------------------------------------------------------------
def estimated_terms(optimizer: str, stats: Mapping[str, np.ndarray], *, lr: float, weight_decay: float,
                    momentum: float = 0.0, curvature: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The law's per-step terms at one probe (see the module docstring), per item.

    ``stats``: the probe's columns ``norm``, ``kappa`` and ``D``, ``Q`` (SGD) or
    ``D_w``, ``Q_w`` (AdamW). ``curvature``: an estimate of the remainder in the same
    per-step units, if one is made (else the law's 0).
    """
    R = np.asarray(stats["norm"], dtype=float)
    kap = np.asarray(stats["kappa"], dtype=float)
    eta, lam = lr, weight_decay
    if optimizer == "adamw":
        out = {"task1": 2 * eta * R * stats["D_w"], "task2": eta ** 2 * np.asarray(stats["Q_w"]),
               "decay": -2 * eta * lam * kap * R ** 2}
    else:
        s = 1.0 / (1.0 - momentum)
        out = {"task1": 2 * eta * s * np.asarray(stats["D"]), "task2": (eta * s) ** 2 * stats["Q"] / R ** 2,
               "decay": -2 * eta * lam * s * kap * R ** 2}
    out["remainder"] = np.zeros_like(R) if curvature is None else np.asarray(curvature, dtype=float)
    return _with_sums(out)


def _with_sums(terms: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = dict(terms)
    out["task"] = out["task1"] + out["task2"]
    out["total"] = out["task"] + out["decay"] + out["remainder"]
    return out


def realized_terms(means: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The realized window means with the same derived rows as :func:`estimated_terms`."""
    out = _with_sums({k: np.asarray(means[k]) for k in TERMS})
    out["total_telescoped"] = np.asarray(means["total"])
    return out


def compare(realized: Mapping[str, np.ndarray], estimates: Mapping[str, Mapping[str, np.ndarray]]) -> dict:
    """Per term: the realized mean over items and, per estimate, its mean, ratio of means and per-item r."""
    rows = {}
    for term in ("task1", "task2", "task", "decay", "remainder", "total"):
        real = np.asarray(realized[term], dtype=float)
        row: dict[str, Any] = {"realized_mean": float(np.mean(real)),
                               "realized_mean_abs": float(np.mean(np.abs(real)))}
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
