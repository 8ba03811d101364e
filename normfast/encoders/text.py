"""Texts to raw pooled embeddings, in batches of similar length (:func:`encode_texts`)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["encode_texts", "wordpiece_lengths"]


def wordpiece_lengths(tokenizer: Any, texts: Sequence[str]) -> np.ndarray:
    """Word-pieces per text as ``tokenizer`` splits it, without special tokens and without truncation."""
    out = np.zeros(len(texts), dtype=np.int64)
    for lo in range(0, len(texts), 4096):
        enc = tokenizer(list(texts[lo : lo + 4096]), add_special_tokens=False, truncation=False)
        out[lo : lo + 4096] = [len(ids) for ids in enc["input_ids"]]
    return out


def encode_texts(
    encoder: Any,
    texts: Sequence[str],
    *,
    batch_size: int = 64,
    lengths: Any = None,
    desc: str = "encoding",
    progress: bool = True,
) -> np.ndarray:
    """Raw pooled embeddings (float32 ``[n, d]``) of ``texts``, in the input order.

    Texts are encoded in order of ``lengths`` (default: word-pieces when the encoder has a
    ``tokenizer``, else characters) so that a batch carries little padding; the attention
    mask makes padding irrelevant to the result.
    """
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ValueError(f"encode_texts: expected batch_size >= 1, got {batch_size}")
    if lengths is None:
        lengths = np.array([len(t) for t in texts])
        tokenizer = getattr(encoder, "tokenizer", None)
        if hasattr(tokenizer, "convert_ids_to_tokens"):  # a transformers tokenizer
            lengths = wordpiece_lengths(tokenizer, texts)
    order = np.argsort(np.asarray(lengths), kind="stable")
    chunks = []
    for lo in tqdm(range(0, len(texts), batch_size), desc=desc, unit="batch", disable=not progress):
        batch = [texts[i] for i in order[lo : lo + batch_size]]
        chunks.append(encoder.encode(batch, output="pooled").detach().to("cpu", torch.float32).numpy())
    if not chunks:
        return np.zeros((0, 0), dtype=np.float32)
    stacked = np.concatenate(chunks)
    out = np.empty_like(stacked)
    out[order] = stacked
    return out
