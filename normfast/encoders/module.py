"""Any ``nn.Module`` (or list of stages) plus a pooling function as an :class:`Encoder`."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from .base import Encoder, LinearHead, State, callable_name


class ModuleEncoder(Encoder):
    """Any ``nn.Module`` mapping a batch tensor to embeddings, plus an optional pooling function.

    Args:
        stages: modules applied in order: a list, or an ``nn.Sequential``, which is split into
            its children automatically (parameter names stay those of the Sequential,
            ``blocks.0.<child>.<param>``); any other single module is one opaque stage. The
            last stage produces the embedding (or per-position embeddings when ``pooling`` is
            given). More stages mean a smaller probed tail: everything before the first probed
            parameter is computed once per chunk.
        pooling: ``pooling(x) -> [B, d]`` applied after the last stage for
            ``output="pooled"``; with it, ``output="tokens"`` returns the
            un-pooled ``[B, T, d]``.
        collate: turns a list of items into the input tensor (default: ``torch.stack``). It is
            always applied, also when the items arrive as one tensor (its rows are the items).
        head: if the last stage is an ``nn.Linear``, it is reported as the head
            automatically (set ``head=False`` to disable). ``output="pre_head"``
            then returns ``pooling(x)`` for the input ``x`` of that linear map,
            which is exact only when the pooling commutes with it (a mean or any
            fixed weighted average); with max-like poolings pass ``head=False``.
    """

    def __init__(
        self,
        stages: nn.Module | Sequence[nn.Module],
        pooling: Callable[[torch.Tensor], torch.Tensor] | None = None,
        collate: Callable[[Sequence[Any]], torch.Tensor] | None = None,
        head: bool = True,
    ):
        super().__init__()
        mods = [stages] if isinstance(stages, nn.Module) else list(stages)
        if not mods:
            raise ValueError("ModuleEncoder: expected at least one stage module, got none")
        for i, m in enumerate(mods):
            if not isinstance(m, nn.Module):
                raise TypeError(f"ModuleEncoder: expected stages to be nn.Modules, got {type(m).__name__} at {i}")
        self.blocks = nn.ModuleList(mods)
        if isinstance(stages, nn.Sequential):
            if len(stages) == 0:
                raise ValueError("ModuleEncoder: the nn.Sequential has no modules")
            # split: each child is a stage; names keep the Sequential's own (blocks.0.<child>)
            self._stage_list = [(f"blocks.0.{name}", child) for name, child in stages.named_children()]
        else:
            self._stage_list = [(f"blocks.{i}", m) for i, m in enumerate(mods)]
        self.pooling = pooling
        self.collate = collate
        self.has_tokens = pooling is not None
        self._use_head = head
        self.note = self._describe(stages)

    def _describe(self, stages: Any) -> str | None:
        if not isinstance(stages, nn.Sequential):
            return None
        name, last = self._stage_list[-1]
        if self.head() is not None:
            where = f"head = {name} (its last module, an nn.Linear)"
        elif not self._use_head:
            where = "no head (head=False)"
        else:
            where = f"no head (its last module is {type(last).__name__}, not an nn.Linear)"
        return f"nn.Sequential split into {len(self._stage_list)} stages; {where}"

    def settings(self) -> dict[str, Any]:
        """:meth:`Encoder.settings` plus the pooling and collate functions (by their qualified names)."""
        return {**super().settings(), "pooling": callable_name(self.pooling), "collate": callable_name(self.collate)}

    def head_hint(self) -> str:
        """What to pass to get a head, for error messages."""
        name, last = self._stage_list[-1]
        if not self._use_head:
            return "the head was disabled with ModuleEncoder(..., head=False)"
        if isinstance(last, nn.Linear):
            return ""
        if len(self._stage_list) == 1:
            return (
                f"ModuleEncoder wraps {type(last).__name__} as one opaque stage, so no final linear map "
                f"is visible: pass its stages as a list that ends with the final nn.Linear, e.g. "
                f"ModuleEncoder([model.body, model.proj]) (an nn.Sequential is split automatically)"
            )
        return (
            f"the last stage ({name}) is {type(last).__name__}, not an nn.Linear: head mode needs the "
            f"embedding to be a linear map of the previous stage's output"
        )

    @property
    def stages(self) -> list[tuple[str, nn.Module]]:
        return list(self._stage_list)

    def prepare(self, items: Sequence[Any]) -> State:
        if self.collate is not None:
            # the user's collate always runs; a tensor batch is handed over as its rows (the items)
            x = self.collate(list(items) if isinstance(items, torch.Tensor) else items)
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"ModuleEncoder: collate must return a torch.Tensor, got {type(x).__name__}")
        elif isinstance(items, torch.Tensor):
            x = items
        else:
            x = torch.stack([torch.as_tensor(it) for it in items])
        x = x.to(self.device)
        state = {"x": x}
        if self.has_tokens:
            state["mask"] = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        return state

    def run_stage(self, k: int, state: State) -> State:
        out = dict(state)
        out["x"] = self._stage_list[k][1](state["x"])
        return out

    def head(self) -> LinearHead | None:
        name, last = self._stage_list[-1]
        if not (self._use_head and isinstance(last, nn.Linear)):
            return None
        return LinearHead(f"{name}.weight", f"{name}.bias" if last.bias is not None else None)

    def finish(self, state: State, output: str) -> torch.Tensor:
        x = state["x"]
        if output == "pre_head_tokens":
            return x
        if output == "pre_head":
            # pooled = pooling(W x + b) = W pooling(x) + b holds for mean-like
            # (linear, weights summing to one) poolings, the case head mode needs.
            return self.pooling(x) if self.pooling is not None else x
        z = self._stage_list[-1][1](x)
        if output == "tokens":
            return z
        return self.pooling(z) if self.pooling is not None else z
