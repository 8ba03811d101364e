"""Tiny models and toy data shared by the test modules (random weights, built offline), and E1's toy at
test size."""

from __future__ import annotations

import torch


def tanh_mlp(dtype=torch.float32, seed: int = 0):
    """The engine tests' 6-12-5 tanh MLP (a ModuleEncoder: its last linear map is the head), built after
    ``torch.manual_seed(seed)``."""
    from torch import nn

    from normfast.encoders import ModuleEncoder

    torch.manual_seed(seed)
    return ModuleEncoder([nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 5)]).to(dtype)


def vector_data(n_items: int, n_pairs: int, dtype=torch.float32, seed: int = 1):
    """``n_items`` random 6-vectors (the probe items) and ``n_pairs`` pairs of random 6-vectors (the pair
    source), drawn in that order from one generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    items = [torch.randn(6, generator=g, dtype=dtype) for _ in range(n_items)]
    pairs = [
        (torch.randn(6, generator=g, dtype=dtype), torch.randn(6, generator=g, dtype=dtype)) for _ in range(n_pairs)
    ]
    return items, pairs


def e1_toy(**settings):
    """E1's synthetic concepts at test size (bench.experiments.e1): 8 concepts of 4 items, an 8-16-8 MLP,
    800 pairs in batches of 16, SGD at η = 0.05, λ = 0.1; ``settings``: the rest of the E1Config."""
    from bench.experiments.e1.data import E1Config

    return E1Config(
        concepts=8,
        items_per_concept=4,
        d_in=8,
        hidden=16,
        d_out=8,
        n_pairs=800,
        batch_size=16,
        lr=0.05,
        weight_decay=0.1,
        **settings,
    )


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


def st_folder(root, tokenizer, dense_specs, normalize=True, weights="safetensors", seed=0):
    """A small sentence-transformers folder: tiny BERT, mean pooling, Dense layers, Normalize."""
    import json
    import os

    from safetensors.torch import save_file

    model = tiny_bert(tokenizer, seed=seed)
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    kind = "sentence_transformers.models."
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": kind + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": kind + "Pooling"},
    ]
    with open(os.path.join(root, "sentence_bert_config.json"), "w") as fh:
        json.dump({"max_seq_length": 48, "do_lower_case": False}, fh)
    os.makedirs(os.path.join(root, "1_Pooling"))
    with open(os.path.join(root, "1_Pooling", "config.json"), "w") as fh:
        json.dump(
            {
                "word_embedding_dimension": 32,
                "pooling_mode_mean_tokens": True,
                "pooling_mode_cls_token": False,
                "pooling_mode_max_tokens": False,
            },
            fh,
        )
    g = torch.Generator().manual_seed(seed + 1)
    width = 32
    for i, (out, activation) in enumerate(dense_specs):
        path = f"{i + 2}_Dense"
        os.makedirs(os.path.join(root, path))
        with open(os.path.join(root, path, "config.json"), "w") as fh:
            json.dump({"in_features": width, "out_features": out, "bias": True, "activation_function": activation}, fh)
        state = {
            "linear.weight": torch.randn(out, width, generator=g) / width**0.5,
            "linear.bias": torch.randn(out, generator=g),
        }
        if weights == "safetensors":
            save_file(state, os.path.join(root, path, "model.safetensors"))
        else:
            torch.save(state, os.path.join(root, path, "pytorch_model.bin"))
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": path, "type": kind + "Dense"})
        width = out
    if normalize:
        modules.append(
            {
                "idx": len(modules),
                "name": str(len(modules)),
                "path": f"{len(modules)}_Normalize",
                "type": kind + "Normalize",
            }
        )
    with open(os.path.join(root, "modules.json"), "w") as fh:
        json.dump(modules, fh)
    return root
