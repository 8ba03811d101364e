"""Tiny models shared by the test modules (random weights, built offline)."""

from __future__ import annotations

import torch


def tiny_bert(tokenizer, seed: int = 0, eager: bool = True, layers: int = 2):
    """A 2-layer BERT with MiniLM's vocabulary (so the real tokenizer works with it)."""
    import transformers

    cfg = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=37,
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=64,
    )
    if eager:
        cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.BertModel(cfg).eval()


def tiny_clip(seed: int = 0):
    """A 2-layer open_clip CLIP (ViT image tower on 32x32 images, text tower, 16-d projection)."""
    import open_clip

    torch.manual_seed(seed)
    model = open_clip.model.CLIP(
        embed_dim=16,
        vision_cfg=dict(image_size=32, patch_size=8, width=32, layers=2, head_width=16),
        text_cfg=dict(context_length=16, vocab_size=49408, width=32, heads=2, layers=2),
    )
    return model.eval()
