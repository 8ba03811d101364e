"""Any ``nn.Module`` (or list of stages) plus a pooling function as an :class:`Encoder`."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from .base import Encoder, LinearHead, State


class ModuleEncoder(Encoder):
    """Any ``nn.Module`` mapping a batch tensor to embeddings, plus an optional pooling function.

    Args:
        stages: modules applied in order (a single module is one stage). The last
            one produces the embedding (or per-position embeddings when
            ``pooling`` is given).
        pooling: ``pooling(x) -> [B, d]`` applied after the last stage for
            ``output="pooled"``; with it, ``output="tokens"`` returns the
            un-pooled ``[B, T, d]``.
        collate: turns a list of items into the input tensor (default: ``torch.stack``).
        head: if the last stage is an ``nn.Linear``, it is reported as the head
            automatically (set ``head=False`` to disable). ``output="pre_head"``
            then returns ``pooling(x)`` for the input ``x`` of that linear map,
            which is exact only when the pooling commutes with it (a mean or any
            fixed weighted average); with max-like poolings pass ``head=False``.
    """

    def __init__(self, stages: nn.Module | Sequence[nn.Module],
                 pooling: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 collate: Callable[[Sequence[Any]], torch.Tensor] | None = None,
                 head: bool = True):
        super().__init__()
        mods = [stages] if isinstance(stages, nn.Module) else list(stages)
        if not mods:
            raise ValueError("ModuleEncoder: expected at least one stage module, got none")
        self.blocks = nn.ModuleList(mods)
        self.pooling = pooling
        self.collate = collate
        self.has_tokens = pooling is not None
        self._use_head = head

    @property
    def stages(self) -> list[tuple[str, nn.Module]]:
        return [(f"blocks.{i}", m) for i, m in enumerate(self.blocks)]

    def prepare(self, items: Sequence[Any]) -> State:
        if isinstance(items, torch.Tensor):
            x = items
        elif self.collate is not None:
            x = self.collate(items)
        else:
            x = torch.stack([torch.as_tensor(it) for it in items])
        x = x.to(self.device)
        state = {"x": x}
        if self.has_tokens:
            state["mask"] = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        return state

    def run_stage(self, k: int, state: State) -> State:
        out = dict(state)
        out["x"] = self.blocks[k](state["x"])
        return out

    def head(self) -> LinearHead | None:
        last = self.blocks[-1]
        if not (self._use_head and isinstance(last, nn.Linear)):
            return None
        i = len(self.blocks) - 1
        return LinearHead(f"blocks.{i}.weight", f"blocks.{i}.bias" if last.bias is not None else None)

    def finish(self, state: State, output: str) -> torch.Tensor:
        x = state["x"]
        if output == "pre_head_tokens":
            return x
        if output == "pre_head":
            # pooled = pooling(W x + b) = W pooling(x) + b holds for mean-like
            # (linear, weights summing to one) poolings, the case head mode needs.
            return self.pooling(x) if self.pooling is not None else x
        z = self.blocks[-1](x)
        if output == "tokens":
            return z
        return self.pooling(z) if self.pooling is not None else z
