"""E5's model and analyses: Fashion-MNIST, the two-tower model, training, the probe and the sweep."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from . import QUANTITIES, Config


# ----------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------
def class_tokens(names: Sequence[str]) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Word vocabulary of the class names, ``[C, L]`` token ids (padded) and the ``[C, L]`` mask."""
    words = [re.findall(r"[a-z0-9]+", n.lower()) for n in names]
    vocab = sorted({w for ws in words for w in ws})
    index = {w: i for i, w in enumerate(vocab)}
    width = max(len(ws) for ws in words)
    ids = torch.full((len(names), width), len(vocab), dtype=torch.long)  # pad id = len(vocab)
    for c, ws in enumerate(words):
        ids[c, : len(ws)] = torch.tensor([index[w] for w in ws])
    return vocab, ids, ids < len(vocab)


@dataclass
class Data:
    images: torch.Tensor  # [60000 + 10000, 1, 28, 28] normalized; train rows first, then test
    labels: np.ndarray  # [70000]
    ink: np.ndarray  # [70000] pixels > 0 per image (the length proxy)
    train_ids: np.ndarray  # rows of the training images used
    probe_ids: np.ndarray  # test rows probed
    query_ids: np.ndarray  # test rows used as retrieval queries
    doc_ids: np.ndarray  # test rows used as retrieval documents


def load_data(cfg: Config) -> Data:
    from normfast.data.fashion_mnist import load_fashion_mnist

    x_tr, y_tr = load_fashion_mnist("train")
    x_te, y_te = load_fashion_mnist("test")
    raw = np.concatenate([x_tr, x_te])
    labels = np.concatenate([y_tr, y_te])
    scaled = raw.astype(np.float32) / 255.0
    mean, std = float(scaled[:60000].mean()), float(scaled[:60000].std())  # training statistics only
    images = torch.from_numpy((scaled - mean) / std).unsqueeze(1)
    ink = (raw > 0).reshape(len(raw), -1).sum(1).astype(np.float64)
    rng = np.random.default_rng(cfg.seed)
    train_ids = (
        np.arange(60000) if cfg.train_size is None else np.sort(rng.choice(60000, cfg.train_size, replace=False))
    )
    perm = 60000 + rng.permutation(10000)
    a, b = cfg.n_probe, cfg.n_probe + cfg.n_queries
    return Data(
        images,
        labels,
        np.maximum(ink, 1.0),
        train_ids,
        np.sort(perm[:a]),
        np.sort(perm[a:b]),
        np.sort(perm[b : b + cfg.n_docs]),
    )


# ----------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------
class ConvTrunk(nn.Module):
    """3x3 conv blocks with ReLU, max-pool after the first two, global average pooling."""

    def __init__(self, channels: Sequence[int]):
        super().__init__()
        c1, c2, c3 = channels
        self.net = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c2, c3, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TextTower(nn.Module):
    """Mean of learned word embeddings over a class name's tokens, then a linear projection."""

    def __init__(self, vocab_size: int, token_dim: int, embed_dim: int):
        super().__init__()
        self.pad = vocab_size
        self.tokens = nn.Embedding(vocab_size + 1, token_dim, padding_idx=vocab_size)
        self.proj = nn.Linear(token_dim, embed_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids != self.pad).unsqueeze(-1).to(self.tokens.weight.dtype)
        pooled = (self.tokens(ids) * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        return self.proj(pooled)


@dataclass
class Model:
    trunk: ConvTrunk
    head: nn.Linear
    text: TextTower
    class_ids: torch.Tensor  # [C, L] token ids of the class names

    def parameters(self):
        for m in (self.trunk, self.head, self.text):
            yield from m.parameters()

    def image_encoder(self, images: torch.Tensor):
        from normfast import ModuleEncoder

        # items are row indices into ``images``: cheap to hash and to batch
        return ModuleEncoder(
            [self.trunk, self.head], collate=lambda rows: images[torch.as_tensor(list(rows), dtype=torch.long)]
        )

    def text_encoder(self):
        from normfast import ModuleEncoder

        ids = self.class_ids
        return ModuleEncoder(
            [self.text], head=False, collate=lambda cls: ids[torch.as_tensor(list(cls), dtype=torch.long)]
        )


def build_model(cfg: Config) -> Model:
    from normfast.data.fashion_mnist import FASHION_MNIST_CLASSES

    vocab, ids, _ = class_tokens(FASHION_MNIST_CLASSES)
    torch.manual_seed(cfg.seed)
    trunk = ConvTrunk(cfg.channels)
    head = nn.Linear(cfg.channels[-1], cfg.embed_dim)
    text = TextTower(len(vocab), cfg.token_dim, cfg.embed_dim)
    return Model(trunk, head, text, ids)


def train(model: Model, data: Data, cfg: Config, progress: bool) -> dict[str, Any]:
    """SGD with momentum and coupled weight decay, CLIP loss on (image, class name) batches."""
    from bench.training import train_epochs
    from normfast import CLIPLoss

    objective = CLIPLoss(temperature=cfg.temperature)
    opt = torch.optim.SGD(list(model.parameters()), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    labels = torch.from_numpy(data.labels)

    def loss_on(rows: torch.Tensor) -> torch.Tensor:
        za = model.head(model.trunk(data.images[rows]))
        zb = model.text(model.class_ids[labels[rows]])
        return objective.loss(za, zb)

    record = train_epochs(
        (model.trunk, model.head, model.text),
        opt,
        loss_on,
        data.train_ids,
        batch_size=cfg.batch_size,
        epochs=cfg.epochs,
        seed=cfg.seed + 1,
        progress=progress,
        desc="E5: train",
    )
    record.pop("losses")
    return {**record, "chance_level_loss_image_to_text": math.log(cfg.batch_size)}


@torch.no_grad()
def embed_images(
    model: Model, images: torch.Tensor, rows: np.ndarray, chunk: int = 1000
) -> tuple[np.ndarray, np.ndarray]:
    """Pre-head features ``a`` and projected embeddings ``z`` (float64) of the given rows."""
    encoder = model.image_encoder(images)
    a_parts, z_parts = [], []
    for lo in range(0, len(rows), chunk):
        a = encoder.encode(rows[lo : lo + chunk].tolist(), output="pre_head")
        a_parts.append(a)
        z_parts.append(model.head(a))
    return torch.cat(a_parts).double().numpy(), torch.cat(z_parts).double().numpy()


@torch.no_grad()
def class_text_embeddings(model: Model) -> np.ndarray:
    return model.text(model.class_ids).double().numpy()


# ----------------------------------------------------------------------------
# statistics
# ----------------------------------------------------------------------------
def within_class_spearman(x: np.ndarray, y: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    from normfast.core.stats import spearman
    from normfast.data.fashion_mnist import FASHION_MNIST_CLASSES

    per = {FASHION_MNIST_CLASSES[c]: spearman(x[labels == c], y[labels == c]) for c in np.unique(labels)}
    vals = [v for v in per.values() if np.isfinite(v)]
    return {"mean": float(np.mean(vals)) if vals else math.nan, "per_class": per}


# ----------------------------------------------------------------------------
# the two analyses
# ----------------------------------------------------------------------------
def heat_vs_entropy(model: Model, data: Data, cfg: Config, progress: bool) -> tuple[dict[str, Any], dict]:
    from bench.training import zero_shot_entropy
    from normfast import CLIPLoss, PairSource, ProbeConfig, probe
    from normfast.core.bootstrap import correlation_with_ci, partial_spearman_with_ci
    from normfast.data.fashion_mnist import FASHION_MNIST_CLASSES

    encoder = model.image_encoder(data.images)
    text_encoder = model.text_encoder()
    pairs = PairSource("pairs", data.train_ids.tolist(), data.labels[data.train_ids].tolist())
    pcfg = ProbeConfig(
        params="head",
        mode="head",
        output="pooled",
        optimizer="sgd",
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.momentum,
        batches=cfg.probe_batches,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        chunk_size=500,
        radial_spread=True,
        drift_batches=None,
    )  # the protocol predates the mean-direction drift
    t0 = time.perf_counter()
    res = probe(
        encoder,
        data.probe_ids.tolist(),
        CLIPLoss(temperature=cfg.temperature),
        pairs,
        pcfg,
        pair_encoder=text_encoder,
        progress=progress,
        model_name="E5 Fashion-MNIST two-tower (image)",
    )
    probe_seconds = time.perf_counter() - t0

    _, z = embed_images(model, data.images, data.probe_ids)
    text = class_text_embeddings(model)
    entropy, pred = zero_shot_entropy(z, text, cfg.temperature)
    labels = data.labels[data.probe_ids]
    cols = {q: res.column(q).astype(np.float64) for q in QUANTITIES}
    valid = res.column("valid").astype(bool)
    for q in cols:
        cols[q] = np.where(valid, cols[q], np.nan)
    # the engine's norm and ours must describe the same embeddings
    norm_gap = float(np.max(np.abs(cols["norm"] - np.linalg.norm(z, axis=1)) / np.linalg.norm(z, axis=1)))

    rng = np.random.default_rng(cfg.seed + 2)
    resamples = rng.integers(0, len(entropy), size=(cfg.bootstrap, len(entropy)))
    corr = {}
    for q in QUANTITIES:
        entry = correlation_with_ci(cols[q], entropy, resamples)
        entry["within_class_spearman"] = within_class_spearman(cols[q], entropy, labels)
        corr[q] = entry
    exploratory = {
        "note": (
            "added after the pre-registered correlations above were seen; not part of the protocol. "
            "In head mode u = R t and t grows with the pre-head activation, so V2 carries the scale "
            "of the embedding; these figures ask whether heat says anything about entropy beyond "
            "the norm"
        ),
        "partial_spearman_V2_entropy_given_norm": partial_spearman_with_ci(
            cols["V2"], entropy, cols["norm"], resamples
        ),
        "spearman_V2_norm": correlation_with_ci(cols["V2"], cols["norm"], resamples)["spearman"],
    }

    per_class_entropy = {FASHION_MNIST_CLASSES[c]: float(entropy[labels == c].mean()) for c in np.unique(labels)}
    out = {
        "n_probe": len(entropy),
        "valid_rows": int(valid.sum()),
        "probe": {
            "params": "head (image projection W, b)",
            "mode": res.metadata["mode"],
            "objective": f"CLIP loss, T={cfg.temperature}",
            "M": cfg.probe_batches,
            "batch_size": cfg.batch_size,
            "optimizer": "sgd",
            "lr": cfg.lr,
            "weight_decay": cfg.weight_decay,
            "momentum": cfg.momentum,
            "pair_encoder": "text tower (no gradients)",
        },
        "engine_vs_direct_norm_max_rel_diff": norm_gap,
        "zero_shot_accuracy": float((pred == labels).mean()),
        "entropy": {
            "mean": float(entropy.mean()),
            "median": float(np.median(entropy)),
            "max_possible": math.log(len(text)),
            "per_class_mean": per_class_entropy,
        },
        "quantiles": {
            q: {k: float(np.nanpercentile(cols[q], p)) for k, p in (("p10", 10), ("median", 50), ("p90", 90))}
            for q in QUANTITIES
        },
        "drift_sign_stability_median": float(np.nanmedian(res.column("sign_stability"))),
        "correlations_with_entropy": corr,
        "exploratory": exploratory,
        "probe_seconds": probe_seconds,
    }
    plot_data = {"entropy": entropy, **cols}
    return out, plot_data


def retrieval(model: Model, data: Data, cfg: Config, progress: bool) -> tuple[dict[str, Any], dict]:
    from normfast import alpha_sweep

    qa, qz = embed_images(model, data.images, data.query_ids)
    da, dz = embed_images(model, data.images, data.doc_ids)
    q_names = [f"q{r - 60000:05d}" for r in data.query_ids]
    d_names = [f"d{r - 60000:05d}" for r in data.doc_ids]
    doc_label = data.labels[data.doc_ids]
    by_class = {int(c): {d_names[i]: 1 for i in np.flatnonzero(doc_label == c)} for c in np.unique(doc_label)}
    qrels = {q: by_class.get(int(c), {}) for q, c in zip(q_names, data.labels[data.query_ids])}
    ink = data.ink[data.doc_ids]
    out: dict[str, Any] = {}
    sweeps = {}
    for space, (Q, D) in (("with_head", (qz, dz)), ("without_head", (qa, da))):
        sw = alpha_sweep(
            (q_names, Q),
            (d_names, D),
            qrels,
            cfg.alphas,
            k=100,
            lengths=ink,
            select_on="dev",
            dev_fraction=cfg.dev_fraction,
            seed=cfg.seed,
            progress=progress,
        )
        norm_best, len_best = sw.summary("norm"), sw.summary("length")
        norms = np.linalg.norm(D, axis=1)
        from normfast.core.stats import spearman

        out[space] = {
            "dim": int(D.shape[1]),
            "best_alpha": norm_best["alpha"],
            "ndcg@10": norm_best["ndcg@10"],
            "cosine_ndcg@10": norm_best["cosine_ndcg@10"],
            "gain_pct": norm_best["gain_pct"],
            "length_control": {
                "best_beta": len_best["alpha"],
                "ndcg@10": len_best["ndcg@10"],
                "gain_pct": len_best["gain_pct"],
            },
            "doc_norm": {
                "p10": float(np.percentile(norms, 10)),
                "median": float(np.median(norms)),
                "p90": float(np.percentile(norms, 90)),
                "spearman_with_ink": spearman(norms, ink),
            },
            "sweep": sw.to_dict(),
        }
        sweeps[space] = sw
    out["protocol"] = (
        f"image->image, {len(q_names)} query and {len(d_names)} document test images (disjoint, "
        "also disjoint from the probe images), relevance = same class (grade 1); alpha chosen "
        f"on a seeded {cfg.dev_fraction:.0%} dev split of the queries, reported on the rest; "
        "length control = ink count (pixels > 0)"
    )
    return out, sweeps
