"""The encoder protocol: :class:`Encoder` (staged forward, ``prepare``, ``settings``) and :class:`LinearHead`."""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

State = dict  # dict[str, torch.Tensor]

OUTPUTS = ("pooled", "tokens", "pre_head", "pre_head_tokens")

#: the state entry in which :meth:`Encoder.prepare` counts, per input, the tokens it cut off (int64 ``[B]``)
TRUNCATED = "n_truncated"


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


#: token texts that are never content (a fallback when the tokenizer's special ids are unknown)
SPECIAL_TOKEN_TEXTS = frozenset(
    {
        "[CLS]",
        "[SEP]",
        "[PAD]",
        "<s>",
        "</s>",
        "<pad>",
        "<cls>",
        "<sep>",
        "<start_of_text>",
        "<end_of_text>",
        "<|startoftext|>",
        "<|endoftext|>",
    }
)


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokens a tokenizer adds around a text (not [UNK] / [MASK], which stand for content)."""
    out: set[int] = set()
    for tok in (tokenizer, getattr(tokenizer, "tokenizer", None)):
        if tok is None:
            continue
        for attr in (
            "cls_token_id",
            "sep_token_id",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "sot_token_id",
            "eot_token_id",
        ):
            value = getattr(tok, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                out.add(value)
    return out


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def describe(obj: Any) -> str:
    """``repr(obj)`` on one line and without memory addresses: the same text in every process."""
    return _ADDRESS.sub("", " ".join(repr(obj).split()))


def short_hash(text: str) -> str:
    """16 hex digits of the SHA-256 of ``text``."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def callable_name(fn: Any) -> str | None:
    """``module.qualname`` of a function or class, or of a callable object's class (None for None):
    the same text in every process."""
    if fn is None:
        return None
    if isinstance(fn, functools.partial):
        return f"partial({callable_name(fn.func)}, {describe(fn.args)}, {describe(sorted(fn.keywords.items()))})"
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(target, '__module__', '?')}.{target.__qualname__}"


class Encoder(nn.Module):
    """Base class of all adapters (see the module docstring for the contract)."""

    #: "text", "image" or "generic": what :meth:`prepare` accepts.
    modality: str = "generic"
    #: what the adapter decided for the user when wrapping the model (run metadata, summary), or None
    note: str | None = None
    #: whether ``output="tokens"`` is meaningful (sequence models).
    has_tokens: bool = False
    #: the longest input, in tokens, that :meth:`prepare` keeps (longer texts are cut to it, and the
    #: tokens cut are counted: :meth:`truncated_tokens`); None: the adapter truncates nothing
    max_length: int | None = None
    #: whether the engine should batch several update directions in one forward-mode pass
    #: (``torch.func.vmap`` over the tangents); False: one direction per pass.
    batched_directions: bool = True
    #: the model as the user named it (``load_encoder``'s spec: ``"all-MiniLM-L6-v2"``, a folder, a hub
    #: id, or the wrapped module's class); a run records it as its ``model``. None: the adapter's class.
    spec: str | None = None

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

    def settings(self) -> dict[str, Any]:
        """Every choice of this adapter that changes an embedding, besides the values of the weights and
        the tokenizer (hashed apart), as plain JSON: the adapter, its head, and a hash of its module tree
        (``repr``: module types and sizes, activations, norms' eps, dropout rates). Adapters add
        theirs (pooling, lowercasing, tower, projection, ...). A probe run records it in its metadata
        (``encoder_settings``) and its resume key, so that a resume with other settings is refused."""
        head = self.head()
        return {
            "adapter": f"{type(self).__module__}.{type(self).__qualname__}",
            "head": None if head is None else list(head.parameter_names),
            "modules": short_hash(describe(self)),
        }

    def head_hint(self) -> str:
        """Why :meth:`head` is None and what to pass instead (error messages); empty when unknown."""
        return ""

    def token_info(self, state: State) -> tuple[torch.Tensor, list[list[str]]] | None:
        """``(token_ids [B, T], token_texts)`` for the initial state of a text batch, else None."""
        return None

    def truncated_tokens(self, state: State) -> torch.Tensor | None:
        """int64 ``[B]``: the tokens of each input that :meth:`prepare` cut off at :attr:`max_length`
        (0 for an input that fits); None when it tokenized nothing (images, tensors, token windows)."""
        return state.get(TRUNCATED)

    def special_token_mask(self, state: State) -> torch.Tensor | None:
        """Bool ``[B, T]``: positions holding a token the tokenizer added around the text ([CLS],
        [SEP], <s>, </s>, padding, open_clip's start/end of text); None without :meth:`token_info`.

        By the tokenizer's own ids (``cls/sep/bos/eos/pad_token_id``, ``sot/eot_token_id``) and,
        for adapters without a tokenizer attribute, by the token texts in :data:`SPECIAL_TOKEN_TEXTS`.
        """
        info = self.token_info(state)
        if info is None:
            return None
        ids, texts = info
        special = torch.tensor(
            [[t in SPECIAL_TOKEN_TEXTS for t in row] for row in texts], dtype=torch.bool, device=ids.device
        ).reshape(ids.shape)
        known = special_token_ids(getattr(self, "tokenizer", None))
        if known:
            special |= torch.isin(ids, torch.tensor(sorted(known), dtype=ids.dtype, device=ids.device))
        return special

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

    def forward(
        self, state: State, start: int = 0, stop: int | None = None, output: str = "pooled"
    ) -> torch.Tensor | State:
        n = self.n_stages
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise ValueError(
                f"{type(self).__name__}.forward: expected 0 <= start <= stop <= {n}, got start={start}, stop={stop}"
            )
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
