"""open_clip image and text towers, with or without the projection head."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .base import TRUNCATED, Encoder, LinearHead, State, describe, short_hash
from .staging import block_index, check_texts, stage_list

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


def _run_block(
    transformer: nn.Module, block: nn.Module, x: torch.Tensor, attn_mask: torch.Tensor | None
) -> torch.Tensor:
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

    def __init__(
        self,
        model: nn.Module,
        tower: str = "image",
        *,
        projection: bool = True,
        tokenizer: Any = None,
        preprocess: Callable[[Any], torch.Tensor] | None = None,
    ):
        super().__init__()
        fn = "OpenCLIPEncoder"
        if tower not in ("image", "text"):
            raise ValueError(f"{fn}: tower must be 'image' or 'text', got {tower!r}")
        if not isinstance(model, nn.Module) or not hasattr(model, "visual"):
            raise TypeError(f"{fn}: expected an open_clip model (with .visual), got {type(model).__name__}")
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
            self._head_names = ("visual.ln_post.", "visual.attn_pool.", "visual.attn_pool_contrastive.")
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
            raise ValueError(
                f"{fn}: projection=False needs a ViT image tower or an open_clip text "
                f"transformer; this {tower} tower runs as one opaque stage"
            )
        self.projection = bool(projection) and (has_projection or not self._staged)

    # -- helpers ----------------------------------------------------------------
    @property
    def _transformer(self) -> nn.Module:
        return (self.visual if self.tower == "image" else self.text).transformer

    def settings(self) -> dict[str, Any]:
        """:meth:`Encoder.settings` plus the tower, the projection, whether it runs in stages, and a hash
        of the image preprocessing (its transforms and their sizes, means and deviations)."""
        return {
            **super().settings(),
            "tower": self.tower,
            "projection": self.projection,
            "staged": self._staged,
            "preprocess": None if self.preprocess is None else short_hash(describe(self.preprocess)),
        }

    def with_tower(self, tower: str, projection: bool | None = None) -> "OpenCLIPEncoder":
        """An encoder for ``tower`` of the same model (shared weights)."""
        return OpenCLIPEncoder(
            self.clip_model,
            tower,
            projection=self.projection if projection is None else projection,
            tokenizer=self.tokenizer,
            preprocess=self.preprocess,
        )

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
            return stage_list(self, [root], lambda name: 0)
        n_blocks = len(self._transformer.resblocks)
        block_labels = [f"{self._blocks_prefix}{i}" for i in range(n_blocks)]
        labels = [f"{root}.embed", *block_labels, f"{root}.head"]

        def assign(name: str) -> int:
            k = block_index(name, self._blocks_prefix)
            if k is not None:
                return k + 1
            if name in self._head_params or name.startswith(self._head_names):
                return n_blocks + 1
            # everything else feeds the first block; the earliest stage is always safe
            return 0

        return stage_list(self, labels, assign)

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
                    raise TypeError(
                        f"{fn}: item {i} is a {type(item).__name__}; pass image "
                        "tensors [3, H, W] or build the encoder with preprocess=..."
                    )
            pixels = torch.stack(tensors)
        if pixels.dim() != 4 or pixels.shape[1] != 3 or pixels.shape[0] == 0:
            raise ValueError(f"{fn}: expected images [B, 3, H, W] with B >= 1, got shape {tuple(pixels.shape)}")
        weight = next(self.visual.parameters())
        pixels = pixels.to(device=weight.device, dtype=weight.dtype)
        state = {"pixels": pixels}
        if self._staged:
            ph, pw = self.visual.patch_size
            n_tokens = 1 + (pixels.shape[2] // ph) * (pixels.shape[3] // pw)
            state["mask"] = torch.ones(pixels.shape[0], n_tokens, dtype=torch.bool, device=pixels.device)
        return state

    def _prepare_text(self, items: Any) -> State:
        fn = "OpenCLIPEncoder.prepare"
        if isinstance(items, torch.Tensor):
            ids = items
        else:
            texts = check_texts(fn, items)
            if self.tokenizer is None:
                raise ValueError(
                    f"{fn}: raw strings need a tokenizer; build the encoder with "
                    "tokenizer=open_clip.get_tokenizer(arch), or pass token ids"
                )
            ids = self.tokenizer(texts)
        if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{fn}: expected token ids [B, T] (integer), got shape {tuple(ids.shape)}, dtype={ids.dtype}"
            )
        ids = ids.to(self.device).long()
        state = {"input_ids": ids, "mask": self._text_mask(ids)}
        if not isinstance(items, torch.Tensor) and self.max_length is not None:
            state[TRUNCATED] = self._truncated(texts, ids)
        return state

    @property
    def max_length(self) -> int | None:
        """The text tower's context length, when its tokenizer's truncation can be counted (open_clip's
        ``SimpleTokenizer``: start token, the text's tokens, end token, cut to the context); else None."""
        tok = self.tokenizer
        if (
            self.tower != "text"
            or getattr(tok, "reduction_fn", None) is not None
            or not all(hasattr(tok, a) for a in ("encode", "context_length", "sot_token_id", "eot_token_id"))
        ):
            return None
        return int(tok.context_length)

    def _truncated(self, texts: list[str], ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[B]``: tokens cut off each text; only a text that fills the context can have been cut."""
        cut = torch.zeros(len(texts), dtype=torch.long, device=ids.device)
        for i in torch.nonzero(ids[:, -1] != 0).flatten().tolist():
            cut[i] = max(0, len(self.tokenizer.encode(texts[i])) + 2 - self.max_length)
        return cut

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
            out["x"] = _run_block(
                text.transformer, text.transformer.resblocks[k - 1], state["x"], state.get("attn_mask")
            )
        return out

    def finish(self, state: State, output: str) -> torch.Tensor:
        if not self._staged:
            tower = self.visual if self.tower == "image" else self.text
            out = tower(state["pixels"] if self.tower == "image" else state["input_ids"])
            return out[0] if isinstance(out, (tuple, list)) else out
        if "x" not in state:
            raise ValueError(
                "OpenCLIPEncoder.forward: the last stage needs a state with 'x' (the output of forward(state, 0, k))"
            )
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
                a = text.ln_final(
                    text_global_pool(x, state["input_ids"], text.pool_type, eos_token_id=getattr(text, "eos_id", None))
                )
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
            return LinearHead(
                "text.text_projection.weight", "text.text_projection.bias" if projection.bias is not None else None
            )
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
