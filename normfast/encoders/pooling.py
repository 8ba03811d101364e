"""Pooling and dense layers with sentence-transformers semantics."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

# ---------------------------------------------------------------------------
# pooling and dense layers (sentence-transformers semantics)

#: pooling modes understood by :class:`HFEncoder` (the sentence-transformers
#: modes plus ``"pooler"``, the model's own pooler).
HF_POOLINGS = ("mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", "pooler")


def pool_tokens(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Pool ``hidden`` ``[B, T, d]`` over the positions where ``mask`` ``[B, T]`` is True.

    Computed as sentence-transformers' ``Pooling`` module does: ``"cls"`` takes the
    first real position (so left padding works), ``"mean"`` / ``"mean_sqrt_len_tokens"``
    divide the masked sum by ``n`` / ``sqrt(n)`` (accumulated in fp32 for half
    inputs), ``"max"`` is the masked maximum, ``"weightedmean"`` weights position
    ``t`` by ``t + 1`` counted from the first real token, ``"lasttoken"`` takes the
    last real position.
    """
    if mode not in HF_POOLINGS or mode == "pooler":
        raise ValueError(f"pool_tokens: unsupported mode {mode!r}; expected one of {HF_POOLINGS[:-1]}")
    mask = mask.bool()
    batch, length, _ = hidden.shape
    rows = torch.arange(batch, device=hidden.device)
    if mode == "cls":
        return hidden[rows, mask.int().argmax(dim=1)]
    keep = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "max":
        return hidden.masked_fill(~mask.unsqueeze(-1), float("-inf")).max(dim=1).values
    if mode == "lasttoken":
        seen, from_end = mask.int().flip(1).max(dim=1)
        from_end = torch.where(seen == 0, torch.full_like(from_end, length - 1), from_end)
        return (hidden * keep)[rows, length - 1 - from_end]
    acc = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
    if mode == "weightedmean":
        weights = torch.arange(1, length + 1, device=hidden.device, dtype=acc).view(1, -1, 1)
        weights = weights - mask.int().argmax(dim=1).view(-1, 1, 1).to(acc)
        weighted = keep.to(acc) * weights
        total = (hidden * weighted).sum(dim=1)
        return (total / weighted.sum(dim=1).clamp_min(1e-9)).to(hidden.dtype)
    total = (hidden * keep).sum(dim=1, dtype=acc)
    count = keep.sum(dim=1, dtype=acc).clamp_min(1e-9)
    out = total / (count if mode == "mean" else count.sqrt())
    return out.to(hidden.dtype)


def pooling_modes(fn: str, pooling: str | Sequence[str], model: nn.Module) -> tuple[str, ...]:
    modes = (pooling,) if isinstance(pooling, str) else tuple(pooling)
    if not modes:
        raise ValueError(f"{fn}: expected a pooling mode, got an empty sequence")
    for mode in modes:
        if mode not in HF_POOLINGS:
            raise ValueError(f"{fn}: unsupported pooling {mode!r}; expected one of {HF_POOLINGS}")
    if "pooler" in modes:
        if len(modes) > 1:
            raise ValueError(f"{fn}: pooling='pooler' cannot be combined with other modes, got {modes}")
        if getattr(model, "pooler", None) is None:
            raise ValueError(
                f"{fn}: pooling='pooler' needs a model with a pooler, but {type(model).__name__}.pooler is None"
            )
    return modes


class DenseLayer(nn.Module):
    """``activation(x @ W.T + b)`` (+ a residual), laid out like sentence-transformers' ``Dense``.

    The state-dict keys (``linear.weight``, ``linear.bias``, ``residual.weight``)
    match the files sentence-transformers writes, so its weights load directly.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: nn.Module | None = None,
        use_residual: bool = False,
    ):
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.linear = nn.Linear(self.in_features, self.out_features, bias=bias)
        self.activation = nn.Identity() if activation is None else activation
        self.use_residual = bool(use_residual)
        if self.use_residual and self.in_features != self.out_features:
            self.residual = nn.Linear(self.in_features, self.out_features, bias=False)

    @property
    def is_linear(self) -> bool:
        """True when the layer is exactly ``x @ W.T + b`` (usable as a linear head)."""
        return isinstance(self.activation, nn.Identity) and not self.use_residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (self.residual(x) if hasattr(self, "residual") else x)
        return out


class L2Normalize(nn.Module):
    """Row-wise L2 normalization: a sentence-transformers ``Normalize`` module that sits
    *between* other modules (a trailing one is dropped: the probe needs raw vectors)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(x, dim=-1)
