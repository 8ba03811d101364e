"""Hugging Face ``transformers`` models as encoders (loading their files: :mod:`.hf_files`)."""

from __future__ import annotations

import inspect
import json
import warnings
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from .base import TRUNCATED, Encoder, LinearHead, State, describe, short_hash
from .pooling import DenseLayer, pool_tokens, pooling_modes
from .staging import block_index, check_texts, stage_list
from .tokenizing import tokenize_truncated

#: texts whose whole length :meth:`HFEncoder._truncated` keeps (a run's long probes, many times over)
_COUNTS_KEPT = 4096

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


def _is_pretokenized(items: Any) -> bool:
    """A non-empty sequence of objects with an ``input_ids`` attribute (corpus token windows)."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or not len(items):
        return False
    return all(hasattr(it, "input_ids") and not isinstance(it, (str, Mapping)) for it in items)


class HFEncoder(Encoder):
    """A Hugging Face ``transformers`` encoder (BERT family and alike), staged layer by layer.

    Args:
        model: a model that returns ``last_hidden_state`` (``BertModel``,
            ``RobertaModel``, a MiniLM ``BertModel``, ...). Its attention is switched
            to ``"eager"`` in place (see the module docstring); eager attention is
            the same computation as the fused kernels, in plain torch ops.
        tokenizer: the matching tokenizer; needed to prepare raw strings and for
            :meth:`token_info`. :meth:`prepare` also accepts an already tokenized
            mapping with ``input_ids`` (and ``attention_mask``), or a sequence of
            objects that carry their own ``input_ids`` (special tokens included; e.g.
            :class:`normfast.data.corpus.TokenWindow`), which it right-pads.
        pooling: ``"mean"`` (over the mask), ``"cls"`` (first real token), ``"max"``,
            ``"mean_sqrt_len_tokens"``, ``"weightedmean"``, ``"lasttoken"`` (computed
            as sentence-transformers does, see :func:`pool_tokens`), ``"pooler"``
            (the model's own pooler: first token, dense, tanh), or a sequence of
            modes whose results are concatenated.
        dense: modules applied after pooling, in order (sentence-transformers
            ``Dense`` layers, see :class:`DenseLayer`; plain ``nn.Linear`` works
            too). When the last one is linear it is the :meth:`head`.
        max_length: truncation length (default: the tokenizer's, capped by the
            model's position table). Longer texts are cut to it, and the tokens cut
            are counted per input (:meth:`truncated_tokens`; a run's ``n_truncated``).
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

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        *,
        pooling: str | Sequence[str] = "mean",
        dense: Sequence[nn.Module] = (),
        max_length: int | None = None,
        lowercase: bool = False,
        staged: bool | str = "auto",
    ):
        super().__init__()
        fn = "HFEncoder"
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise TypeError(
                f"{fn}: expected a transformers model (an nn.Module with .config), got {type(model).__name__}"
            )
        if staged not in (True, False, "auto"):
            raise ValueError(f"{fn}: staged must be True, False or 'auto', got {staged!r}")
        self.model = model
        self.training = model.training  # wrapping does not change train/eval mode
        _use_eager_attention(model)
        self.tokenizer = tokenizer
        self.pooling_modes = pooling_modes(fn, pooling, model)
        self.dense = nn.ModuleList(list(dense)).train(model.training)
        self.lowercase = bool(lowercase)
        self.max_length = self._default_max_length(max_length)
        self.name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        self._embedding_takes_token_types = False
        self._full_lengths: dict[str, int] = {}  # tokens of each text that filled max_length, whole

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
                raise ValueError(f"{fn}: cannot split {type(model).__name__} into stages: {problem}")
            else:
                warnings.warn(
                    f"{fn}: running {type(model).__name__} as a single stage (no tail cut): {problem}", stacklevel=2
                )

    # -- construction helpers ---------------------------------------------------
    def _default_max_length(self, max_length: int | None) -> int | None:
        if max_length is not None:
            if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
                raise ValueError(f"HFEncoder: expected max_length to be a positive int, got {max_length!r}")
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
        if not isinstance(embeddings, nn.Module) or not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            return "it has no .embeddings + .encoder.layer layout"
        if getattr(model.config, "is_decoder", False):
            return "it is configured as a decoder (causal attention)"
        covered = set()
        for part in (embeddings, layers, getattr(model, "pooler", None), self._position_bias_module()):
            if part is not None:
                covered.update(id(p) for p in part.parameters())
        outside = [n for n, p in model.named_parameters() if id(p) not in covered]
        if outside:
            return f"it has parameters outside the embeddings and layers ({', '.join(outside[:3])})"
        return None

    def _position_bias_module(self) -> nn.Module | None:
        """The table of a relative position bias shared by all layers (MPNet), if the model has one.

        MPNet's encoder computes one attention bias from the relative positions
        (``encoder.compute_position_bias``, a lookup in ``encoder.relative_attention_bias``)
        and adds it to the scores of every layer. Staged, each layer recomputes it from
        the table (a ``[B, heads, T, T]`` gather, small beside the attention itself), so a
        tangent on the table reaches every layer of the tail; the table belongs to the
        stage of the first layer.
        """
        encoder = getattr(self.model, "encoder", None)
        table = getattr(encoder, "relative_attention_bias", None)
        if isinstance(table, nn.Module) and callable(getattr(encoder, "compute_position_bias", None)):
            return table
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

    def settings(self) -> dict[str, Any]:
        """:meth:`Encoder.settings` plus the pooling, the lowercasing, whether the model runs in stages,
        and a hash of the model's configuration (less where it was loaded from and the library version)."""
        config = getattr(self.model, "config", None)
        values = config.to_dict() if callable(getattr(config, "to_dict", None)) else {}
        values = {k: v for k, v in values.items() if k not in ("_name_or_path", "transformers_version")}
        return {
            **super().settings(),
            "pooling": list(self.pooling_modes),
            "lowercase": self.lowercase,
            "staged": self.staged,
            "config": short_hash(describe(json.dumps(values, sort_keys=True, default=str))),
        }

    @property
    def stages(self) -> list[tuple[str, nn.Module]]:
        if not self.staged:
            return stage_list(self, ["model"], lambda name: 0)
        n_layers = len(self.model.encoder.layer)
        layer_labels = [f"model.encoder.layer.{i}" for i in range(n_layers)]
        labels = ["model.embeddings", *layer_labels, "pool"]

        def assign(name: str) -> int:
            if name.startswith("model.embeddings."):
                return 0
            if name.startswith("model.encoder.relative_attention_bias."):
                return 1  # shared by every layer: it enters at the first one
            k = block_index(name, "model.encoder.layer.")
            return n_layers + 1 if k is None else k + 1

        return stage_list(self, labels, assign)

    def prepare(self, items: Sequence[str] | Mapping[str, Any]) -> State:
        fn = "HFEncoder.prepare"
        if isinstance(items, Mapping):
            if "input_ids" not in items:
                raise ValueError(f"{fn}: a tokenized batch needs 'input_ids', got keys {sorted(items)}")
            batch = dict(items)
        elif _is_pretokenized(items):
            batch = self._pad_pretokenized(fn, items)
        else:
            texts = check_texts(fn, items)
            if self.tokenizer is None:
                raise ValueError(
                    f"{fn}: raw strings need a tokenizer; build the encoder with "
                    "tokenizer=..., or pass a mapping with input_ids and "
                    "attention_mask"
                )
            if self.lowercase:
                texts = [t.lower() for t in texts]
            if self.max_length is None:
                batch = self.tokenizer(texts, padding=True, truncation=False, return_tensors="pt")
            else:
                batch = tokenize_truncated(self.tokenizer, texts, self.max_length)
            batch[TRUNCATED] = self._truncated(texts, batch)
        device = self.device
        ids = torch.as_tensor(batch["input_ids"]).to(device)
        if ids.dim() != 2:
            raise ValueError(f"{fn}: expected input_ids to be 2-D [B, T], got input_ids.shape={tuple(ids.shape)}")
        attention = batch.get("attention_mask")
        mask = (
            torch.ones_like(ids, dtype=torch.bool)
            if attention is None
            else torch.as_tensor(attention).to(device).bool()
        )
        state = {"input_ids": ids, "mask": mask}
        token_types = batch.get("token_type_ids")
        if token_types is not None:
            state["token_type_ids"] = torch.as_tensor(token_types).to(device)
        if TRUNCATED in batch:
            state[TRUNCATED] = batch[TRUNCATED].to(device)
        return state

    def _truncated(self, texts: list[str], batch: Mapping[str, Any]) -> torch.Tensor:
        """int64 ``[B]``: the tokens the tokenizer cut off each text at :attr:`max_length`.

        Only a text that fills :attr:`max_length` can have been cut; those few are tokenized
        again, whole, to count (a single text: the cut is its full length less the maximum),
        once per text: the counts are kept, for the virtual batches that hold the text again.
        """
        cut = torch.zeros(len(texts), dtype=torch.long)
        if self.max_length is None:
            return cut
        ids = torch.as_tensor(batch["input_ids"])
        mask = batch.get("attention_mask")
        kept = torch.as_tensor(mask).sum(dim=1) if mask is not None else torch.full((len(texts),), ids.shape[1])
        full = [i for i in range(len(texts)) if int(kept[i]) >= self.max_length]
        counted = self._full_lengths
        missing = list({texts[i] for i in full if texts[i] not in counted})
        if missing:
            whole = self.tokenizer(missing, truncation=False, padding=False, verbose=False)
            if len(counted) + len(missing) > _COUNTS_KEPT:
                counted.clear()
            counted.update(zip(missing, (len(row) for row in whole["input_ids"])))
        for i in full:
            cut[i] = max(0, counted[texts[i]] - self.max_length)
        return cut

    def _pad_pretokenized(self, fn: str, items: Sequence[Any]) -> dict[str, torch.Tensor]:
        """Right-pad items that carry their own ``input_ids`` (e.g. corpus token windows)."""
        rows = [list(getattr(it, "input_ids")) for it in items]
        longest = max(len(r) for r in rows)
        if longest == 0:
            raise ValueError(f"{fn}: expected token windows with at least one token, got only empty ones")
        if self.max_length is not None and longest > self.max_length:
            raise ValueError(
                f"{fn}: a token window holds {longest} tokens, more than the model's maximum length {self.max_length}"
            )
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.model.config, "pad_token_id", None) or 0
        ids = torch.full((len(rows), longest), int(pad), dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        return {"input_ids": ids, "attention_mask": mask}

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
                raise ValueError(
                    "HFEncoder.forward: the last stage needs a state with 'hidden' (the output of forward(state, 0, k))"
                )
            hidden = state["hidden"]
        else:
            hidden = self._whole_model(state)
        per_position = output in ("tokens", "pre_head_tokens")
        if per_position:
            if len(self.dense) and len(self.pooling_modes) > 1:
                raise ValueError(
                    f"HFEncoder: output={output!r} is unavailable with dense "
                    f"layers after a concatenated pooling {self.pooling_modes}"
                )
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
            raise RuntimeError(
                "HFEncoder: the model's attention implementation was changed "
                "from 'eager'; forward-mode AD needs eager attention"
            )
        bias = _additive_attention_mask(mask, hidden.dtype)
        kwargs = {}
        if self._position_bias_module() is not None:
            kwargs["position_bias"] = self.model.encoder.compute_position_bias(hidden)
        out = self.model.encoder.layer[i](hidden, attention_mask=bias, **kwargs)
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
