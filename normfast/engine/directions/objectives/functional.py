"""The math the objectives share: the checks of a loss call and the contrastive losses themselves.

Imported by a loss when it runs (and by :func:`.check_scale_invariance`), never when the registry
is read: the command line's ``--help`` stays free of torch.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F

from normfast.core.checks import describe

__all__ = ["check_embeddings", "info_nce", "sup_con"]


def check_embeddings(
    fn: str, za: Any, zb: Any = None, labels: Any = None, *, need_zb: bool = False, need_labels: bool = False
) -> torch.Tensor | None:
    """Validate a loss call; returns ``labels`` as a 1-D integer tensor on ``za``'s device."""
    if not isinstance(za, torch.Tensor):
        raise TypeError(f"{fn}: expected za to be a torch.Tensor, got {type(za).__name__}")
    if za.dim() != 2:
        raise ValueError(f"{fn}: expected za to be 2-D [B, d], got {describe('za', za)}")
    if not za.is_floating_point():
        raise TypeError(f"{fn}: expected za to have a floating dtype, got {describe('za', za)}")
    if za.shape[0] < 2:
        raise ValueError(f"{fn}: expected a batch of at least 2 rows (in-batch negatives), got {describe('za', za)}")
    if need_zb and zb is None:
        raise ValueError(f"{fn}: expected zb (the second side of each pair), got None")
    if zb is not None:
        if not isinstance(zb, torch.Tensor):
            raise TypeError(f"{fn}: expected zb to be a torch.Tensor, got {type(zb).__name__}")
        if zb.shape != za.shape:
            raise ValueError(f"{fn}: expected zb to match za.shape={tuple(za.shape)}, got {describe('zb', zb)}")
        if zb.device != za.device:
            raise ValueError(f"{fn}: expected za and zb on one device, got za on {za.device}, zb on {zb.device}")
    if labels is None:
        if need_labels:
            raise ValueError(f"{fn}: expected labels (one class per row of za), got None")
        return None
    labels = torch.as_tensor(labels, device=za.device)
    if labels.dim() != 1 or labels.shape[0] != za.shape[0]:
        raise ValueError(
            f"{fn}: expected labels to be 1-D with {za.shape[0]} entries "
            f"(one per row of za), got {describe('labels', labels)}"
        )
    if labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"{fn}: expected integer class labels, got {describe('labels', labels)}")
    return labels


def info_nce(za: torch.Tensor, zb: torch.Tensor, temperature: float, symmetric: bool) -> torch.Tensor:
    """``mean_i -log softmax_j(cos(a_i, b_j) / T)[i]``; symmetric: averaged with ``a`` and ``b`` swapped."""
    a = F.normalize(za, dim=-1)
    b = F.normalize(zb, dim=-1)
    logits = a @ b.T / temperature
    target = torch.arange(za.shape[0], device=za.device)
    loss = F.cross_entropy(logits, target)
    if symmetric:
        loss = 0.5 * (loss + F.cross_entropy(logits.T, target))
    return loss


def sup_con(z: torch.Tensor, y: torch.Tensor, temperature: float) -> torch.Tensor:
    """Supervised contrastive loss ("L_out") of rows ``z`` with classes ``y`` (:class:`.SupCon`)."""
    n = z.shape[0]
    u = F.normalize(z, dim=-1)
    logits = u @ u.T / temperature
    self_mask = torch.eye(n, dtype=torch.bool, device=z.device)
    # log-softmax over A(i): every row but the anchor itself
    logits = logits.masked_fill(self_mask, float("-inf"))
    log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    positives = (y[:, None] == y[None, :]) & ~self_mask
    n_pos = positives.sum(dim=1)
    has_pos = n_pos > 0
    if not bool(has_pos.any()):
        warnings.warn(
            "SupCon: no anchor in this batch has a positive (every label appears once); the loss is zero",
            RuntimeWarning,
            stacklevel=3,
        )
        return (z * 0.0).sum()
    pos_log_prob = torch.where(positives, log_prob, torch.zeros_like(log_prob)).sum(dim=1)
    per_anchor = -pos_log_prob[has_pos] / n_pos[has_pos].to(z.dtype)
    return per_anchor.mean()
