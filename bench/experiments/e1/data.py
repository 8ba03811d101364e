"""E1's synthetic concepts, its encoders and its optimizers (one per variant).

Synthetic concepts of varying ambiguity: ``K`` concepts with prototypes
``μ_k``; each concept owns a few items ``x = μ_k + σ ε``. A training pair is
an item and a positive from the same concept, except that for concept ``k``
the positive is drawn from another concept with probability ``a_k``
(ambiguity, spread evenly over ``[0, a_max]``). Ambiguous items receive
inconsistent updates -- more heat -- and settle at larger norms.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch import nn


@dataclass
class E1Config:
    concepts: int = 64
    items_per_concept: int = 4
    d_in: int = 32
    hidden: int = 128
    d_out: int = 32
    sigma: float = 0.5
    max_ambiguity: float = 0.9
    n_pairs: int = 20_000
    temperature: float = 0.1
    batch_size: int = 64
    lr: float = 0.01
    weight_decay: float = 0.05
    adamw_lr: float = 1e-3
    #: heavy-ball SGD (momentum 0.9) runs at lr * (1 - 0.9), so that its long-run step
    #: size lr / (1 - beta) equals the plain SGD runs'
    heavyball_lr: float = 1e-3
    steps: int = 20_000
    window: float = 0.4
    record_every: int = 50
    probe_every: int = 20
    #: heat batches per checkpoint
    M: int = 16
    #: drift batches per checkpoint (the drift is taken from their mean direction)
    drift_batches: int = 64
    #: the single-snapshot probe: heat batches, drift batches, curvature batches
    snapshot_batches: int = 256
    snapshot_drift_batches: int = 1024
    snapshot_curvature_batches: int = 64
    #: the snapshot's virtual trajectory: this many relaxation times of R², at least min steps
    snapshot_relaxations: float = 4.0
    snapshot_min_steps: int = 500
    seed: int = 0

    @classmethod
    def quick(cls) -> "E1Config":
        return cls(
            concepts=16,
            items_per_concept=4,
            hidden=64,
            n_pairs=4000,
            steps=3000,
            probe_every=60,
            M=8,
            drift_batches=16,
            snapshot_batches=16,
            snapshot_drift_batches=32,
            snapshot_curvature_batches=8,
            snapshot_relaxations=0.25,
            snapshot_min_steps=100,
        )


@dataclass(frozen=True)
class Variant:
    """One E1 run: the encoder and the optimizer that trains it."""

    name: str
    model: str  # "mlp" (bias-free 2-layer ReLU), "mlp_bias", "table" (free embedding table)
    optimizer: str  # "sgd" or "adamw" (torch.optim.SGD / AdamW)
    momentum: float = 0.0  # heavy-ball momentum of SGD (torch's, weight decay coupled as in torch)
    beta1: float = 0.9  # AdamW's beta1
    description: str = ""

    def lr(self, cfg: E1Config) -> float:
        if self.optimizer == "adamw":
            return cfg.adamw_lr
        return cfg.heavyball_lr if self.momentum else cfg.lr


VARIANT_SPECS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("mlp", "mlp", "sgd", description="2-layer ReLU MLP, no biases"),
        Variant("mlp_bias", "mlp_bias", "sgd", description="2-layer ReLU MLP, biases"),
        Variant("table", "table", "sgd", description="free embedding table"),
        Variant("mlp_adamw", "mlp", "adamw", beta1=0.9, description="2-layer ReLU MLP, no biases"),
        Variant("mlp_adamw_b0", "mlp", "adamw", beta1=0.0, description="2-layer ReLU MLP, no biases"),
        Variant("mlp_heavyball", "mlp", "sgd", momentum=0.9, description="2-layer ReLU MLP, no biases"),
    )
}
VARIANTS = tuple(VARIANT_SPECS)


@dataclass
class SyntheticConcepts:
    x: torch.Tensor  # [n_items, d_in] item inputs (for the MLP)
    concept: torch.Tensor  # [n_items] concept of each item
    ambiguity: torch.Tensor  # [concepts]
    pairs: np.ndarray  # [n_pairs, 2] item ids (anchor, positive)


def make_concepts(cfg: E1Config) -> SyntheticConcepts:
    g = torch.Generator().manual_seed(cfg.seed)
    K, m = cfg.concepts, cfg.items_per_concept
    mu = torch.randn(K, cfg.d_in, generator=g)
    concept = torch.arange(K).repeat_interleave(m)
    x = mu[concept] + cfg.sigma * torch.randn(K * m, cfg.d_in, generator=g)
    ambiguity = torch.linspace(0.0, cfg.max_ambiguity, K)
    rng = np.random.default_rng(cfg.seed)
    anchors = rng.integers(0, K * m, cfg.n_pairs)
    k_a = concept.numpy()[anchors]
    flip = rng.random(cfg.n_pairs) < ambiguity.numpy()[k_a]
    other = rng.integers(0, K - 1, cfg.n_pairs)
    other = other + (other >= k_a)
    k_b = np.where(flip, other, k_a)
    positives = k_b * m + rng.integers(0, m, cfg.n_pairs)
    return SyntheticConcepts(x, concept, ambiguity, np.stack([anchors, positives], 1))


def build_encoder(variant: str | Variant, cfg: E1Config, data: SyntheticConcepts):
    """The variant's encoder, freshly initialized from ``cfg.seed``."""
    from normfast.encoders import ModuleEncoder

    model = VARIANT_SPECS[variant].model if isinstance(variant, str) else variant.model
    torch.manual_seed(cfg.seed + 1)
    if model == "table":
        table = nn.Embedding(data.x.shape[0], cfg.d_out)
        nn.init.normal_(table.weight, std=1.0)
        return ModuleEncoder([table], collate=lambda ids: torch.as_tensor(list(ids), dtype=torch.long))
    bias = model == "mlp_bias"
    layers = [nn.Linear(cfg.d_in, cfg.hidden, bias=bias), nn.ReLU(), nn.Linear(cfg.hidden, cfg.d_out, bias=bias)]
    x = data.x
    return ModuleEncoder(layers, collate=lambda ids: x[torch.as_tensor(list(ids), dtype=torch.long)], head=False)


def variant_optimizer(variant: Variant, cfg: E1Config, params) -> torch.optim.Optimizer:
    """torch's own optimizer for the variant (weight decay as torch applies it: coupled for SGD)."""
    lr = variant.lr(cfg)
    if variant.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay, betas=(variant.beta1, 0.999))
    return torch.optim.SGD(params, lr=lr, weight_decay=cfg.weight_decay, momentum=variant.momentum)


def probe_config(variant: Variant, cfg: E1Config, n_items: int, *, batches: int, drift_batches: int):
    """The engine's configuration for one E1 probe.

    The drift comes from the mean update direction over ``drift_batches`` virtual
    batches when the engine offers it (``ProbeConfig.drift_batches``); the heat from
    the first ``batches`` of them. An engine without that setting takes both from
    ``drift_batches`` batches, per batch (the same drift, at a higher cost).
    """
    from bench.common import PLAIN_HEAT
    from normfast import ProbeConfig

    kw: dict[str, Any] = dict(
        params="all",
        mode="jvp",
        output="pooled",
        optimizer=variant.optimizer,
        lr=variant.lr(cfg),
        weight_decay=cfg.weight_decay,
        batch_size=cfg.batch_size,
        chunk_size=n_items,
        radial_spread=True,
        **PLAIN_HEAT,  # E1's committed results predate the heat drawn by energy (bench.common.PLAIN_HEAT)
    )
    if variant.optimizer == "adamw":
        kw["betas"] = (variant.beta1, 0.999)
    else:
        kw["momentum"] = variant.momentum
    if has_mean_direction_drift():
        kw.update(batches=batches, drift_batches=drift_batches)
    else:
        kw.update(batches=max(batches, drift_batches))
    return ProbeConfig(**kw)


def has_mean_direction_drift() -> bool:
    from normfast import ProbeConfig

    return "drift_batches" in {f.name for f in fields(ProbeConfig)}


def drift_estimator_name(cfg_batches: int, drift_batches: int) -> str:
    if has_mean_direction_drift():
        return f"mean direction over M_D = {drift_batches} batches (heat: M = {cfg_batches})"
    return f"per batch over {max(cfg_batches, drift_batches)} batches (heat from the same batches)"
