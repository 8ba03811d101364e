"""Encoder adapters: turn raw probe items into embeddings, in stages.

Every adapter is an ``nn.Module`` subclass of :class:`Encoder`. The probe
engine relies on three things only:

``prepare(items) -> state``
    Tokenize texts / stack images into an initial *state*: a ``dict`` of
    tensors on the encoder's device. Sequence models always put a boolean
    ``"mask"`` ``[B, T]`` in the state (True = real token).

``forward(state, start=0, stop=None, output="pooled")``
    Run stages ``start .. stop-1`` on ``state``. When ``stop`` is before the
    last stage the result is the next state (a ``dict`` of tensors, ``"mask"``
    carried along); when the run reaches the end the result is one tensor:

    * ``output="pooled"``  -> ``z`` ``[B, d]``
    * ``output="tokens"``  -> ``z`` ``[B, T, d]`` (one embedding per position;
      padded positions are whatever the model computes, the mask says which
      rows are real)
    * ``output="pre_head"`` -> the activations ``a`` ``[B, d_in]`` that feed
      the final linear head for the pooled embedding, so that ``pooled =
      a @ W.T + b`` (for mean pooling this is the pooled ``ā``);
    * ``output="pre_head_tokens"`` -> the same per position, ``[B, T, d_in]``.

    The two ``pre_head`` outputs exist only for encoders whose :meth:`head`
    is not ``None``.

    Because this is ``forward``, ``torch.func.functional_call(encoder, params,
    (state,), {"start": k, ...})`` runs the tail with substituted parameters:
    that is how the engine takes forward-mode JVPs through the tail only.

``stages`` (property)
    Ordered list of ``(name, module)``; every trainable parameter of the
    encoder belongs to exactly one stage. The engine finds the first stage
    that owns a probed parameter, computes everything before it once under
    ``no_grad`` (the frozen front) and caches it.

Adapters for Hugging Face, sentence-transformers and open_clip models live
in this module too; :class:`ModuleEncoder` wraps any ``nn.Module`` plus a
pooling function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

State = dict  # dict[str, torch.Tensor]

OUTPUTS = ("pooled", "tokens", "pre_head", "pre_head_tokens")


@dataclass(frozen=True)
class LinearHead:
    """Where the final linear map ``z = W a + b`` of an encoder lives.

    ``weight_name`` / ``bias_name`` are names from ``named_parameters()``.
    ``transposed`` is True when the stored parameter is ``[d_in, d_out]`` and
    used as ``a @ P`` (open_clip's ``proj`` / ``text_projection``); otherwise it
    is ``[d_out, d_in]`` as in ``nn.Linear``.
    """

    weight_name: str
    bias_name: str | None = None
    transposed: bool = False

    def weight(self, encoder: nn.Module) -> torch.Tensor:
        """``W`` as ``[d_out, d_in]`` (a view, not a copy)."""
        w = encoder.get_parameter(self.weight_name)
        return w.t() if self.transposed else w

    def bias(self, encoder: nn.Module) -> torch.Tensor | None:
        return None if self.bias_name is None else encoder.get_parameter(self.bias_name)

    @property
    def parameter_names(self) -> tuple[str, ...]:
        return (self.weight_name,) if self.bias_name is None else (self.weight_name, self.bias_name)


class Encoder(nn.Module):
    """Base class of all adapters (see the module docstring for the contract)."""

    #: "text", "image" or "generic": what :meth:`prepare` accepts.
    modality: str = "generic"
    #: whether ``output="tokens"`` is meaningful (sequence models).
    has_tokens: bool = False

    # -- to implement -------------------------------------------------------
    @property
    def stages(self) -> list[tuple[str, nn.Module]]:
        raise NotImplementedError

    def prepare(self, items: Sequence[Any]) -> State:
        raise NotImplementedError

    def run_stage(self, k: int, state: State) -> State:
        """Run stage ``k`` (not the last) and return the next state."""
        raise NotImplementedError

    def finish(self, state: State, output: str) -> torch.Tensor:
        """Run the last stage on ``state`` and produce the requested output."""
        raise NotImplementedError

    def head(self) -> LinearHead | None:
        """The final linear map ``z = W a + b`` (projection / Dense head), if the encoder ends in one."""
        return None

    def token_info(self, state: State) -> tuple[torch.Tensor, list[list[str]]] | None:
        """``(token_ids [B, T], token_texts)`` for the initial state of a text batch, else None."""
        return None

    # -- provided -------------------------------------------------------------
    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        for b in self.buffers():
            return b.device
        return torch.device("cpu")

    def forward(self, state: State, start: int = 0, stop: int | None = None,
                output: str = "pooled") -> torch.Tensor | State:
        n = self.n_stages
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise ValueError(f"{type(self).__name__}.forward: expected 0 <= start <= stop <= {n}, "
                             f"got start={start}, stop={stop}")
        if output not in OUTPUTS:
            raise ValueError(f"{type(self).__name__}.forward: output must be one of {OUTPUTS}, got {output!r}")
        if output in ("tokens", "pre_head_tokens") and not self.has_tokens:
            raise ValueError(f"{type(self).__name__}: token-level output needs a sequence model")
        if output.startswith("pre_head") and self.head() is None:
            raise ValueError(f"{type(self).__name__}: output={output!r} needs an encoder ending in a linear head")
        for k in range(start, min(stop, n - 1)):
            state = self.run_stage(k, state)
        if stop < n:
            return state
        return self.finish(state, output)

    def stage_of_parameters(self) -> dict[str, int]:
        """Map every parameter name (as in ``named_parameters()``) to its stage index."""
        owner: dict[int, int] = {}
        for k, (_, module) in enumerate(self.stages):
            for p in module.parameters():
                owner.setdefault(id(p), k)
        mapping = {}
        for name, p in self.named_parameters():
            if id(p) not in owner:
                raise RuntimeError(f"{type(self).__name__}: parameter {name!r} belongs to no stage")
            mapping[name] = owner[id(p)]
        return mapping

    def encode(self, items: Sequence[Any], output: str = "pooled") -> torch.Tensor:
        """Convenience: embeddings of ``items`` without gradients."""
        with torch.no_grad():
            return self(self.prepare(items), output=output)


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
            automatically (set ``head=False`` to disable).
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
