"""E5: uncertainty and the projection-head regime, on a two-tower model trained here.

    python bench/e5_uncertainty.py [--quick] [--out DIR] [--seed 0]

Writes ``e5_uncertainty.json``, ``e5_entropy_heat.png`` and ``e5_alpha_sweep.png``
to ``--out`` (default ``runs/e5``, ignored by git; the committed results come from
``--out bench/results``) and prints a summary. The same ``--seed`` gives the same numbers
(one CPU thread; timings, recorded under ``timing``, are the only thing that
changes between runs).

Model (trained here, on Fashion-MNIST)
--------------------------------------
* Image tower: a three-block CNN trunk (3x3 conv + ReLU, 2x2 max-pool after the
  first two blocks) ending in global average pooling -> ``a`` (``channels[-1]``
  dims, the pre-head activations), then a linear projection head ``z = W a + b``
  (``embed_dim`` dims).
* Text tower: each class name is split into lower-case word tokens
  ("T-shirt/top" -> t, shirt, top; "Ankle boot" -> ankle, boot; 12 distinct
  tokens), a learned token embedding averaged over the tokens of the name, and a
  linear projection. Classes that share a word ("Shirt", "T-shirt/top") start
  with related embeddings, as class prompts would in a real vision-language
  model.
* Objective: the symmetric CLIP loss (``normfast.engine.objectives.CLIPLoss``,
  fixed temperature) on (image, class-name) pairs with in-batch negatives. A
  batch holds several images of one class, so several columns share a text;
  that is inherent to training on class names and is kept as it is.
* Optimizer: SGD with heavy-ball momentum and (torch's, coupled-to-lr) weight
  decay at a constant learning rate -- the setting the equilibrium law is
  derived for; the probe uses the same ``lr``, ``weight_decay`` and momentum
  (heuristic ``eta -> eta / (1 - beta)``).

1. Heat vs predictive entropy
-----------------------------
``n_probe`` held-out test images are probed with ``normfast.engine.probe`` in head
mode: the probed parameters are the image projection head, the objective is
the CLIP loss on ``M`` virtual batches of (training image, class name) pairs of
the training batch size; the text tower runs as ``pair_encoder`` (no
gradients). Zero-shot predictive entropy of a test image = entropy (nats) of
``softmax_c(cos(z_image, z_text_c) / T)`` over the ten class names, with the
training temperature. For V², the embedding norm, the full-law ``R_eq`` and the
heat-only ``R_eq`` we report Pearson r (raw values) and Spearman rho against
entropy, each with a percentile bootstrap 95% interval (``bootstrap``
resamples of the probe images, one seeded set of resamples shared by all
quantities), and, as a check for a class confound, the mean over classes of the
within-class Spearman rho. Paper's claim: V² correlates positively with model
entropy (CLIP ViT-B/32 on CIFAR-10H: r = +0.234). An ``exploratory`` block, added
after the first full run and outside the protocol, gives the partial Spearman
rho of V² with entropy given the embedding norm.

2. alpha sweep with and without the projection head
---------------------------------------------------
Image -> image retrieval on the test set, the one protocol that lives in both
spaces (class-name queries exist only in the projected space): ``n_queries``
query images and ``n_docs`` document images, disjoint, drawn from the test set
(also disjoint from the probe images); a document is relevant (grade 1) to a
query when it has the same class. Documents and queries are embedded (a) with
the head (``z``) and (b) without it (the trunk's pooled features ``a``). Score
``cos(q, d) * ||d||**alpha`` over ``alphas`` (``normfast.apps.retrieval.alpha_sweep``,
NDCG@10 from pytrec_eval); the best alpha is chosen on a seeded half of the
queries (dev) and every figure is reported on the other half. Length-only
control: an image has no token length; its proxy is the ink count (pixels > 0),
the amount of content in the picture, swept as ``cos * ink**beta`` over the same
grid. Paper's claim: with the projection head the best alpha is negative;
removing the head flips it to positive.

Everything above (architecture, optimizer settings, probe settings, retrieval
protocol, alpha grid, selection rule) is fixed in :class:`E5Config` before any
result is looked at.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

#: default output (git-ignored); the committed results are written with --out bench/results
RUNS = Path(__file__).resolve().parents[1] / "runs" / "e5"
QUANTITIES = ("V2", "norm", "r_eq", "r_eq_heat")
PAPER_V2_ENTROPY_R = 0.234  # CLIP ViT-B/32 on CIFAR-10H, as reported


@dataclass
class E5Config:
    """The whole protocol; ``quick()`` only shrinks sizes."""

    train_size: int | None = None          # None: all 60 000 training images
    epochs: int = 4
    batch_size: int = 128
    lr: float = 0.02
    momentum: float = 0.9
    weight_decay: float = 5e-4
    temperature: float = 0.07
    channels: tuple[int, int, int] = (32, 64, 128)
    embed_dim: int = 64
    token_dim: int = 64
    n_probe: int = 2000
    probe_batches: int = 128               # M
    n_queries: int = 1000
    n_docs: int = 7000
    # -2 .. 2 in steps of 0.1, plus a few small exponents: the useful range depends on the norm spread
    alphas: tuple[float, ...] = field(default_factory=lambda: tuple(sorted(
        {round(i / 10, 1) for i in range(-20, 21)} | {-0.05, -0.02, -0.01, 0.01, 0.02, 0.05})))
    dev_fraction: float = 0.5
    bootstrap: int = 2000
    seed: int = 0

    @classmethod
    def quick(cls) -> "E5Config":
        # the sweep on a coarser grid over the same range (-2 .. 2, step 0.25, and ±0.05)
        return cls(train_size=6000, epochs=2, channels=(8, 16, 32), embed_dim=32, token_dim=32,
                   n_probe=300, probe_batches=16, n_queries=200, n_docs=1000, bootstrap=1000,
                   alphas=tuple(sorted({i / 4 for i in range(-8, 9)} | {-0.05, 0.05})))

    def validate(self) -> None:
        fn = "E5Config"
        for name in ("epochs", "batch_size", "embed_dim", "token_dim", "n_probe", "n_queries", "n_docs",
                     "bootstrap"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{fn}: expected {name} to be a positive integer, got {v!r}")
        if self.probe_batches < 2:
            raise ValueError(f"{fn}: expected probe_batches (M) >= 2, got {self.probe_batches}")
        if self.train_size is not None and not self.batch_size <= self.train_size <= 60000:
            raise ValueError(f"{fn}: expected batch_size <= train_size <= 60000, "
                             f"got train_size={self.train_size}")
        if self.n_probe + self.n_queries + self.n_docs > 10000:
            raise ValueError(f"{fn}: n_probe + n_queries + n_docs must fit in the 10 000 test images, got "
                             f"{self.n_probe} + {self.n_queries} + {self.n_docs}")
        if self.bootstrap < 1000:
            raise ValueError(f"{fn}: expected at least 1000 bootstrap resamples, got {self.bootstrap}")


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
        ids[c, :len(ws)] = torch.tensor([index[w] for w in ws])
    return vocab, ids, ids < len(vocab)


@dataclass
class Data:
    images: torch.Tensor      # [60000 + 10000, 1, 28, 28] normalized; train rows first, then test
    labels: np.ndarray        # [70000]
    ink: np.ndarray           # [70000] pixels > 0 per image (the length proxy)
    train_ids: np.ndarray     # rows of the training images used
    probe_ids: np.ndarray     # test rows probed
    query_ids: np.ndarray     # test rows used as retrieval queries
    doc_ids: np.ndarray       # test rows used as retrieval documents


def load_data(cfg: E5Config) -> Data:
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
    train_ids = (np.arange(60000) if cfg.train_size is None
                 else np.sort(rng.choice(60000, cfg.train_size, replace=False)))
    perm = 60000 + rng.permutation(10000)
    a, b = cfg.n_probe, cfg.n_probe + cfg.n_queries
    return Data(images, labels, np.maximum(ink, 1.0), train_ids, np.sort(perm[:a]), np.sort(perm[a:b]),
                np.sort(perm[b:b + cfg.n_docs]))


# ----------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------
class ConvTrunk(nn.Module):
    """3x3 conv blocks with ReLU, max-pool after the first two, global average pooling."""

    def __init__(self, channels: Sequence[int]):
        super().__init__()
        c1, c2, c3 = channels
        self.net = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c2, c3, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())

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
    class_ids: torch.Tensor   # [C, L] token ids of the class names

    def parameters(self):
        for m in (self.trunk, self.head, self.text):
            yield from m.parameters()

    def image_encoder(self, images: torch.Tensor):
        from normfast.encoders import ModuleEncoder

        # items are row indices into ``images``: cheap to hash and to batch
        return ModuleEncoder([self.trunk, self.head],
                             collate=lambda rows: images[torch.as_tensor(list(rows), dtype=torch.long)])

    def text_encoder(self):
        from normfast.encoders import ModuleEncoder

        ids = self.class_ids
        return ModuleEncoder([self.text], head=False,
                             collate=lambda cls: ids[torch.as_tensor(list(cls), dtype=torch.long)])


def build_model(cfg: E5Config) -> Model:
    from normfast.data.fashion_mnist import FASHION_MNIST_CLASSES

    vocab, ids, _ = class_tokens(FASHION_MNIST_CLASSES)
    torch.manual_seed(cfg.seed)
    trunk = ConvTrunk(cfg.channels)
    head = nn.Linear(cfg.channels[-1], cfg.embed_dim)
    text = TextTower(len(vocab), cfg.token_dim, cfg.embed_dim)
    return Model(trunk, head, text, ids)


def train(model: Model, data: Data, cfg: E5Config, progress: bool) -> dict[str, Any]:
    """SGD with momentum and coupled weight decay, CLIP loss on (image, class name) batches."""
    from normfast.apps.training import train_epochs
    from normfast.engine.objectives import CLIPLoss

    objective = CLIPLoss(temperature=cfg.temperature)
    opt = torch.optim.SGD(list(model.parameters()), lr=cfg.lr, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    labels = torch.from_numpy(data.labels)

    def loss_on(rows: torch.Tensor) -> torch.Tensor:
        za = model.head(model.trunk(data.images[rows]))
        zb = model.text(model.class_ids[labels[rows]])
        return objective.loss(za, zb)

    record = train_epochs((model.trunk, model.head, model.text), opt, loss_on, data.train_ids,
                          batch_size=cfg.batch_size, epochs=cfg.epochs, seed=cfg.seed + 1, progress=progress,
                          desc="E5: train")
    record.pop("losses")
    return {**record, "chance_level_loss_image_to_text": math.log(cfg.batch_size)}


@torch.no_grad()
def embed_images(model: Model, images: torch.Tensor, rows: np.ndarray,
                 chunk: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    """Pre-head features ``a`` and projected embeddings ``z`` (float64) of the given rows."""
    encoder = model.image_encoder(images)
    a_parts, z_parts = [], []
    for lo in range(0, len(rows), chunk):
        a = encoder.encode(rows[lo:lo + chunk].tolist(), output="pre_head")
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
    from normfast.data.fashion_mnist import FASHION_MNIST_CLASSES
    from normfast.core.stats import spearman

    per = {FASHION_MNIST_CLASSES[c]: spearman(x[labels == c], y[labels == c]) for c in np.unique(labels)}
    vals = [v for v in per.values() if np.isfinite(v)]
    return {"mean": float(np.mean(vals)) if vals else math.nan, "per_class": per}


# ----------------------------------------------------------------------------
# the two analyses
# ----------------------------------------------------------------------------
def heat_vs_entropy(model: Model, data: Data, cfg: E5Config, progress: bool) -> tuple[dict[str, Any], dict]:
    from normfast.apps.training import zero_shot_entropy
    from normfast.core.bootstrap import correlation_with_ci, partial_spearman_with_ci
    from normfast.data.fashion_mnist import FASHION_MNIST_CLASSES
    from normfast.engine.objectives import CLIPLoss
    from normfast.data.pairs import PairSource
    from normfast.engine.probe import ProbeConfig, probe

    encoder = model.image_encoder(data.images)
    text_encoder = model.text_encoder()
    pairs = PairSource("pairs", data.train_ids.tolist(), data.labels[data.train_ids].tolist())
    pcfg = ProbeConfig(params="head", mode="head", output="pooled", optimizer="sgd", lr=cfg.lr,
                       weight_decay=cfg.weight_decay, momentum=cfg.momentum, batches=cfg.probe_batches,
                       batch_size=cfg.batch_size, seed=cfg.seed, chunk_size=500, radial_spread=True,
                       drift_batches=None)  # the protocol predates the mean-direction drift
    t0 = time.perf_counter()
    res = probe(encoder, data.probe_ids.tolist(), CLIPLoss(temperature=cfg.temperature), pairs, pcfg,
                pair_encoder=text_encoder, progress=progress, model_name="E5 Fashion-MNIST two-tower (image)")
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
        "note": ("added after the pre-registered correlations above were seen; not part of the protocol. "
                 "In head mode u = R t and t grows with the pre-head activation, so V2 carries the scale "
                 "of the embedding; these figures ask whether heat says anything about entropy beyond "
                 "the norm"),
        "partial_spearman_V2_entropy_given_norm": partial_spearman_with_ci(cols["V2"], entropy, cols["norm"],
                                                                           resamples),
        "spearman_V2_norm": correlation_with_ci(cols["V2"], cols["norm"], resamples)["spearman"],
    }

    per_class_entropy = {FASHION_MNIST_CLASSES[c]: float(entropy[labels == c].mean())
                         for c in np.unique(labels)}
    out = {
        "n_probe": len(entropy),
        "valid_rows": int(valid.sum()),
        "probe": {"params": "head (image projection W, b)", "mode": res.metadata["mode"],
                  "objective": f"CLIP loss, T={cfg.temperature}", "M": cfg.probe_batches,
                  "batch_size": cfg.batch_size, "optimizer": "sgd", "lr": cfg.lr,
                  "weight_decay": cfg.weight_decay, "momentum": cfg.momentum,
                  "pair_encoder": "text tower (no gradients)"},
        "engine_vs_direct_norm_max_rel_diff": norm_gap,
        "zero_shot_accuracy": float((pred == labels).mean()),
        "entropy": {"mean": float(entropy.mean()), "median": float(np.median(entropy)),
                    "max_possible": math.log(len(text)), "per_class_mean": per_class_entropy},
        "quantiles": {q: {k: float(np.nanpercentile(cols[q], p)) for k, p in (("p10", 10), ("median", 50),
                                                                              ("p90", 90))}
                      for q in QUANTITIES},
        "drift_sign_stability_median": float(np.nanmedian(res.column("sign_stability"))),
        "correlations_with_entropy": corr,
        "exploratory": exploratory,
        "probe_seconds": probe_seconds,
    }
    plot_data = {"entropy": entropy, **cols}
    return out, plot_data


def retrieval(model: Model, data: Data, cfg: E5Config, progress: bool) -> tuple[dict[str, Any], dict]:
    from normfast.apps.retrieval import alpha_sweep

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
        sw = alpha_sweep((q_names, Q), (d_names, D), qrels, cfg.alphas, k=100, lengths=ink, select_on="dev",
                         dev_fraction=cfg.dev_fraction, seed=cfg.seed, progress=progress)
        norm_best, len_best = sw.summary("norm"), sw.summary("length")
        norms = np.linalg.norm(D, axis=1)
        from normfast.core.stats import spearman

        out[space] = {
            "dim": int(D.shape[1]),
            "best_alpha": norm_best["alpha"],
            "ndcg@10": norm_best["ndcg@10"],
            "cosine_ndcg@10": norm_best["cosine_ndcg@10"],
            "gain_pct": norm_best["gain_pct"],
            "length_control": {"best_beta": len_best["alpha"], "ndcg@10": len_best["ndcg@10"],
                               "gain_pct": len_best["gain_pct"]},
            "doc_norm": {"p10": float(np.percentile(norms, 10)), "median": float(np.median(norms)),
                         "p90": float(np.percentile(norms, 90)),
                         "spearman_with_ink": spearman(norms, ink)},
            "sweep": sw.to_dict(),
        }
        sweeps[space] = sw
    out["protocol"] = (f"image->image, {len(q_names)} query and {len(d_names)} document test images (disjoint, "
                       "also disjoint from the probe images), relevance = same class (grade 1); alpha chosen "
                       f"on a seeded {cfg.dev_fraction:.0%} dev split of the queries, reported on the rest; "
                       "length control = ink count (pixels > 0)")
    return out, sweeps


# ----------------------------------------------------------------------------
# plots
# ----------------------------------------------------------------------------
def plot_entropy(plot_data: dict[str, np.ndarray], corr: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    labels = {"V2": "heat V²", "norm": "embedding norm ‖z‖", "r_eq": "R_eq (full law)"}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    ent = plot_data["entropy"]
    for ax, q in zip(axes, labels):
        x = plot_data[q]
        ok = np.isfinite(x) & (x > 0)
        ax.scatter(x[ok], ent[ok], s=3, alpha=0.25, color="tab:blue", rasterized=True)
        # entropy averaged in deciles of x
        edges = np.quantile(x[ok], np.linspace(0, 1, 11))
        idx = np.clip(np.searchsorted(edges, x[ok], side="right") - 1, 0, 9)
        mids, means, ses = [], [], []
        for b in range(10):
            sel = idx == b
            if sel.sum() >= 2:
                mids.append(float(np.exp(np.log(x[ok][sel]).mean())))
                means.append(float(ent[ok][sel].mean()))
                ses.append(float(ent[ok][sel].std(ddof=1) / math.sqrt(sel.sum())))
        ax.errorbar(mids, means, yerr=ses, color="black", marker="o", ms=4, lw=1.5,
                    label="decile means ± s.e.")
        ax.set_xscale("log")
        # labels at 1, 2, 3, 5 x 10^k: readable whether x spans a fraction of a decade or several
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        c = corr[q]
        ax.set_title(f"{labels[q]}: Pearson r {c['pearson']['r']:+.3f} "
                     f"[{c['pearson']['ci95'][0]:+.2f}, {c['pearson']['ci95'][1]:+.2f}]\n"
                     f"Spearman {c['spearman']['r']:+.3f} "
                     f"[{c['spearman']['ci95'][0]:+.2f}, {c['spearman']['ci95'][1]:+.2f}]", fontsize=9)
        ax.set_xlabel(labels[q] + " (log scale)")
        ax.set_ylabel("zero-shot predictive entropy (nats)")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("E5: held-out Fashion-MNIST test images, image projection head probed (CLIP loss)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_alpha(sweeps: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for space, color in (("with_head", "tab:blue"), ("without_head", "tab:red")):
        sw = sweeps[space]
        x = np.asarray(sw.alphas)
        best = sw.alphas[sw.best_index("norm")]
        ax.plot(x, sw.curve("norm", "ndcg@10", "eval"), color=color, marker="o", ms=3,
                label=f"{space.replace('_', ' ')}: cos*|d|^a (best a {best:+.2f})")
        ax.plot(x, sw.curve("length", "ndcg@10", "eval"), color=color, ls="--", lw=1,
                label=f"{space.replace('_', ' ')}: ink control cos*ink^a")
        ax.axvline(best, color=color, ls=":", lw=0.8)
    ax.axvline(0.0, color="grey", lw=0.5)
    ax.set_xlabel("alpha (exponent of the document norm; of the ink count for dashed lines)")
    ax.set_ylabel("NDCG@10 (test half of the queries)")
    ax.set_title("E5: image->image retrieval, same-class relevance; alpha chosen on the dev half",
                 fontsize=10)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------
def verdicts(heat: dict[str, Any], ret: dict[str, Any]) -> dict[str, Any]:
    v2 = heat["correlations_with_entropy"]["V2"]["pearson"]
    with_head, without = ret["with_head"]["best_alpha"], ret["without_head"]["best_alpha"]
    return {
        "V2_entropy_pearson_positive_ci_excludes_0": bool(v2["ci95"][0] > 0),
        "paper_V2_entropy_pearson_r_clip_vit_b32_cifar10h": PAPER_V2_ENTROPY_R,
        "best_alpha_with_head_negative": bool(with_head < 0),
        "best_alpha_without_head_positive": bool(without > 0),
        "paper_sign_flip_reproduced": bool(with_head < 0 < without),
    }


def run(cfg: E5Config, out: str | Path | None = RUNS, progress: bool = True) -> dict[str, Any]:
    cfg.validate()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small convs and matmuls: one thread is steadier and keeps runs reproducible
    timing: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        data = load_data(cfg)
        timing["load_seconds"] = time.perf_counter() - t0
        model = build_model(cfg)
        t0 = time.perf_counter()
        training = train(model, data, cfg, progress)
        timing["train_seconds"] = time.perf_counter() - t0
        heat, plot_data = heat_vs_entropy(model, data, cfg, progress)
        timing["probe_seconds"] = heat.pop("probe_seconds")
        t0 = time.perf_counter()
        ret, sweeps = retrieval(model, data, cfg, progress)
        timing["retrieval_seconds"] = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    from normfast.data.fashion_mnist import FASHION_MNIST_CLASSES
    from normfast.data.io import json_ready
    from normfast.engine.provenance import library_versions as _library_versions

    vocab, _, _ = class_tokens(FASHION_MNIST_CLASSES)
    n_params = {name: sum(p.numel() for p in m.parameters())
                for name, m in (("trunk", model.trunk), ("head", model.head), ("text_tower", model.text))}
    summary = {
        "experiment": "E5 uncertainty and the projection-head regime (Fashion-MNIST two-tower model)",
        "config": asdict(cfg),
        "model": {"image_trunk": f"CNN {cfg.channels}, 3x3 convs, global average pooling",
                  "image_head": f"Linear({cfg.channels[-1]}, {cfg.embed_dim})",
                  "text_tower": f"mean of word embeddings ({len(vocab)} words: {', '.join(vocab)}) -> "
                                f"Linear({cfg.token_dim}, {cfg.embed_dim})",
                  "parameters": n_params,
                  "train_images": len(data.train_ids)},
        "training": training,
        "heat_vs_entropy": heat,
        "retrieval": ret,
        "verdicts": verdicts(heat, ret),
        "timing": {**timing, "torch_threads": 1},
        "versions": _library_versions(),
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "e5_uncertainty.json").write_text(json.dumps(json_ready(summary), indent=1, allow_nan=False) + "\n")
        plot_entropy(plot_data, heat["correlations_with_entropy"], out / "e5_entropy_heat.png")
        plot_alpha(sweeps, out / "e5_alpha_sweep.png")
    return summary


def format_summary(s: dict[str, Any]) -> str:
    h = s["heat_vs_entropy"]
    lines = [f"zero-shot accuracy on the probe images: {h['zero_shot_accuracy']:.3f}; "
             f"training loss (last quarter epoch): {s['training']['loss_last_quarter_epoch_mean']:.3f}",
             "",
             "| quantity vs entropy | Pearson r [95% CI] | Spearman rho [95% CI] | within-class rho (mean) |",
             "|---|---|---|---|"]
    for q, c in h["correlations_with_entropy"].items():
        p, r = c["pearson"], c["spearman"]
        lines.append(f"| {q} | {p['r']:+.3f} [{p['ci95'][0]:+.3f}, {p['ci95'][1]:+.3f}] | "
                     f"{r['r']:+.3f} [{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}] | "
                     f"{c['within_class_spearman']['mean']:+.3f} |")
    e = h["exploratory"]["partial_spearman_V2_entropy_given_norm"]
    lines.append(f"(exploratory) partial Spearman of V2 with entropy given the norm: {e['r']:+.3f} "
                 f"[{e['ci95'][0]:+.3f}, {e['ci95'][1]:+.3f}]")
    lines += ["", "| documents | best alpha | NDCG@10 | cosine NDCG@10 | gain | ink control: best beta, gain |",
              "|---|---|---|---|---|---|"]
    for space in ("with_head", "without_head"):
        r = s["retrieval"][space]
        lc = r["length_control"]
        g = "n/a" if r["gain_pct"] is None else f"{r['gain_pct']:+.2f}%"
        lg = "n/a" if lc["gain_pct"] is None else f"{lc['gain_pct']:+.2f}%"
        lines.append(f"| {space.replace('_', ' ')} | {r['best_alpha']:+.2f} | {r['ndcg@10']:.4f} | "
                     f"{r['cosine_ndcg@10']:.4f} | {g} | {lc['best_beta']:+.2f}, {lg} |")
    lines += ["", "verdicts: " + json.dumps(s["verdicts"])]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small, fast configuration (used by the tests)")
    p.add_argument("--out", default=str(RUNS),
                   help="output folder (default runs/e5, git-ignored; the committed results: --out bench/results)")
    p.add_argument("--seed", type=int, default=0,
                   help="drives data subsets, initialization, batches, bootstrap")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    cfg = E5Config.quick() if args.quick else E5Config()
    cfg = replace(cfg, seed=args.seed)
    try:
        summary = run(cfg, args.out, progress=not args.no_progress)
    except (ValueError, FileNotFoundError) as exc:
        print(f"e5_uncertainty: error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    out = Path(args.out)
    print(f"\nwrote {out / 'e5_uncertainty.json'}, {out / 'e5_entropy_heat.png'}, {out / 'e5_alpha_sweep.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
