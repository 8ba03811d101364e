"""The calibration's models: a small MLP (with or without biases) trained on synthetic concepts, and
MiniLM's head trained on WordNet pairs, each at a stationary state before its intervals are checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench.experiments.calibration import Protocol


# ----------------------------------------------------------------------------
# the three models
# ----------------------------------------------------------------------------
def _concepts(p: Protocol, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    K, m = p.concepts, p.items_per_concept
    mu = torch.randn(K, 32, generator=g)
    concept = torch.arange(K).repeat_interleave(m)
    x = mu[concept] + 0.5 * torch.randn(K * m, 32, generator=g)
    rng = np.random.default_rng(seed)
    ambiguity = np.linspace(0, 0.9, K)
    anchors = rng.integers(0, K * m, p.n_pairs)
    k_a = concept.numpy()[anchors]
    other = rng.integers(0, K - 1, p.n_pairs)
    k_b = np.where(rng.random(p.n_pairs) < ambiguity[k_a], other + (other >= k_a), k_a)
    positives = k_b * m + rng.integers(0, m, p.n_pairs)
    return x, [(int(a), int(b)) for a, b in zip(anchors, positives)]


def _train(
    enc: Any, pairs: list[tuple[Any, Any]], steps: int, lr: float, wd: float, tau: float, batch: int = 64, seed: int = 0
) -> None:
    import torch

    from normfast import InfoNCE

    opt = torch.optim.SGD(enc.parameters(), lr=lr, weight_decay=wd)
    loss_fn = InfoNCE(tau)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.integers(0, len(pairs), batch)
        a = enc(enc.prepare([pairs[i][0] for i in idx]))
        b = enc(enc.prepare([pairs[i][1] for i in idx]))
        loss = loss_fn.loss(a, b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    enc.zero_grad(set_to_none=True)


def build_mlp(p: Protocol, bias: bool) -> dict[str, Any]:
    import torch
    from torch import nn

    from normfast import InfoNCE, ModuleEncoder, PairSource

    x, pairs = _concepts(p)
    torch.manual_seed(1)
    layers = [nn.Linear(32, 128, bias=bias), nn.ReLU(), nn.Linear(128, 32, bias=bias)]
    enc = ModuleEncoder(layers, collate=lambda ids: x[torch.as_tensor(list(ids), dtype=torch.long)], head=False)
    _train(enc, pairs, p.mlp_steps, lr=0.01, wd=0.05, tau=0.1)
    return {
        "encoder": enc,
        "items": list(range(x.shape[0])),
        "pairs": PairSource.from_iterable(pairs),
        "objective": InfoNCE(0.1),
        "config": dict(params="all", mode="jvp", lr=0.01, weight_decay=0.05),
    }


def build_minilm_head(p: Protocol, cache: Path) -> dict[str, Any]:
    import torch
    from torch import nn

    from normfast import InfoNCE, ModuleEncoder, PairSource, load_encoder
    from normfast.data.wordnet import gloss, lemma_names, load_wordnet, noun_synsets

    synsets = noun_synsets(load_wordnet())
    rng = np.random.default_rng(0)
    pick = rng.choice(len(synsets), p.head_synsets, replace=False)
    lemmas = [lemma_names(synsets[i])[0].replace("_", " ") for i in pick]
    glosses = [gloss(synsets[i]) for i in pick]
    path = cache / f"calibration_minilm_{p.head_synsets}.pt"
    if path.exists():
        feats = torch.load(path, weights_only=True)  # a tensor: nothing in the file can run
    else:
        enc = load_encoder("all-MiniLM-L6-v2")
        texts = lemmas + glosses
        with torch.no_grad():
            feats = torch.cat([enc(enc.prepare(texts[i : i + 64]), output="pooled") for i in range(0, len(texts), 64)])
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(feats, path)
    feats = feats.float()
    n = p.head_synsets
    pairs = [(i, n + i) for i in range(n)]
    torch.manual_seed(2)
    head = nn.Linear(feats.shape[1], 64)
    enc = ModuleEncoder([head], collate=lambda ids: feats[torch.as_tensor(list(ids), dtype=torch.long)])
    _train(enc, pairs, p.head_steps, lr=0.05, wd=0.01, tau=0.05)
    return {
        "encoder": enc,
        "items": list(range(p.head_items)),
        "pairs": PairSource.from_iterable(pairs),
        "objective": InfoNCE(0.05),
        "config": dict(params="head", mode="head", lr=0.05, weight_decay=0.01),
    }
