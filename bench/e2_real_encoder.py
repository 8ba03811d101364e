"""E2: the equilibrium law on a real pretrained text encoder (all-MiniLM-L6-v2).

    python bench/e2_real_encoder.py --pilot     # choose η, λ, steps by training health
    python bench/e2_real_encoder.py             # the full protocol with the chosen settings
    python bench/e2_real_encoder.py --quick     # a toy size that only exercises the code

The pretrained sentence encoder (real weights, loaded offline) is fine-tuned
with plain SGD + weight decay on real text pairs until its embedding norms are
stationary; the engine's prediction of each probe item's equilibrium norm is
then compared with the norm the item actually keeps. This is E1's protocol
(``normfast.apps.validate``) on a real model and real text.

Data. WordNet 3.0 noun (lemma, gloss) pairs: every lemma of every noun synset
paired with the synset's definition, from which a fixed pool of ``n_pairs``
pairs is drawn with the seed. Probe items: ``n_probes`` distinct lemma strings
of the pool's anchors, drawn with the seed.

Objective. InfoNCE with in-batch negatives (temperature 0.05), both sides
through the same encoder (mean-pooled output, raw vectors). Dropout is off
in training, as it is in the engine's virtual batches for InfoNCE: the noise
the law describes is the minibatch noise. Training batches are uniform draws
from the pool, as the engine's virtual batches are.

Trainable part. Only the last transformer layer (``model.encoder.layer.5.*``)
is trained and probed; the embeddings and layers 0-4 are frozen. The model
that is trained and probed is a :class:`normfast.encoders.CachedFrontEncoder`
over the sentence encoder: the hidden states entering layer 5 are computed
once for every text of the pool, and a training step or a virtual batch runs
only the real layer 5 and the mean pooling (in up to three groups of similar
length, which saves padding). Its output equals the full encoder's (the
maximum difference on a sample is recorded).

Weight decay. SGD without momentum; decay on the weight matrices only: the
LayerNorm weights and biases and all bias vectors are exempt (parameter
groups with ``weight_decay=0``, the usual BERT practice), and the engine
gets the same exemption (``ProbeConfig(no_decay="bias|LayerNorm")``, which
also restricts κ to the decayed matrices). The first two protocols decayed
every parameter of the layer, LayerNorm included, and collapsed (below).

Protocol ``v3`` (the default), fixed in two steps before any fit was computed:

1. Pilot (``--pilot``; never computes the law's inputs or predictions).
   Candidate settings at ``ηλ = 1e-3`` (equilibration time ``1/(ηλ) = 1000``
   steps), ``steps = 7500`` (the window starts after 4.5 equilibration
   times), a 200-step linear lr warm-up, batch size 32, differing in the
   split of ``ηλ`` into η and λ -- from the split that holds the pretrained
   matrices' squared norm in balance (``2λ‖W‖² = η E‖g‖²`` gives
   ``η/λ ≈ 480`` on the pretrained layer) towards smaller η. They are run in
   the fixed order of ``PILOT_CANDIDATES``; the first that passes every
   health criterion is chosen (a collapsed candidate is stopped early).
   Criteria, checked on 200 probe lemmas:

   (a) loss: every 100-step mean loss in the window (last 40% of steps) is
       below ``0.75 ln(batch size)`` (chance is ``ln(batch size)``);
   (b) no collapse: the mean pairwise cosine of the probe embeddings stays
       below 0.9 at every record (every 100 steps, and every 20 in the window);
   (c) stationarity: the median over probe items of the relative change of
       the window-mean norm between the two halves of the window is below
       5%, and the norm of the decayed matrices changes by less than 2%
       between the two halves.

   The outcome, with the failed v1/v2 settings as history, is stored under
   ``pilot`` in the JSON; the full run carries it over. Outcome of the pilot
   run (seed 0): ``η = 0.5, λ = 2e-3`` collapsed near step 6000 (mean
   pairwise cosine -> 1) and was stopped; ``η = 0.2, λ = 5e-3`` passed every
   criterion and is the default of ``E2Config``.
2. Full run, once, with the chosen settings (the defaults of ``E2Config``):
   record every probe item's norm every 20 steps over the window and
   average -> observed norm; at 50 checkpoints (every 60 steps) in the same
   window run ``normfast.engine.probe`` (jvp mode over ``model.encoder.layer.5.*``,
   pooled output, ``M = 8`` virtual batches of 32 pairs from the same pool,
   the same η, λ and decay exemption, a different seed -- hence fresh
   virtual batches -- per checkpoint) and average D, Q and κ; solve the law
   with the averages -> predicted ``R_eq``; report the log-log slope and
   Pearson r of observed against predicted (bootstrap 95% intervals over
   probe items) for the full law, the heat-only law (D = 0) and the last
   checkpoint alone, next to the health criteria of this run, the κ range,
   the drift-over-heat ratio, a training trajectory and the runtimes.

History (``--protocol v1`` / ``v2`` reproduce them; decay on every parameter):
v1 ``η = 0.05, λ = 0.1`` (``ηλ = 5e-3``, 3000 steps) and v2 ``η = 1.0,
λ = 2e-3`` (``ηλ = 2e-3``, 200-step warm-up, 3000 steps) both collapsed:
near step 400-500 every embedding turned to the same direction (mean
pairwise cosine 0.997 over v2's window), the loss sat at chance (ln 32) to
the end, and the norms never became stationary, so their fits test nothing.

The paper this project tests reports slope 0.88, r = 0.97 for a fine-tuned
DistilBERT; that figure is stored in the JSON next to ours.

``--quick`` runs the same code at a toy size (used by the tests); its numbers
are not stationary and not a result.

Writes ``e2_real_encoder.json`` and ``e2_real_encoder.png`` to ``--out``
(``e2_real_encoder_v1.*`` / ``_v2.*`` with ``--protocol v1`` / ``v2``);
``--pilot`` writes only the ``pilot`` entry of ``e2_real_encoder.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from normfast.encoders import CachedFrontEncoder  # noqa: E402

RUNS = Path(__file__).resolve().parents[1] / "runs" / "e2"  # default output (git-ignored)
PAPER = {"model": "DistilBERT, fine-tuned", "slope": 0.88, "pearson_r": 0.97}
NO_DECAY = r"bias|LayerNorm"

#: health thresholds of the pilot (and reported for the full run)
LOSS_FRACTION_OF_CHANCE = 0.75
COLLAPSE_COSINE = 0.9
NORM_CHANGE_MAX = 0.05
WEIGHT_CHANGE_MAX = 0.02

#: (lr, weight_decay) candidates of the pilot, tried in this order; ηλ = 1e-3 for all
PILOT_CANDIDATES: tuple[tuple[float, float], ...] = ((0.5, 2e-3), (0.2, 5e-3), (0.1, 1e-2))

#: the first two protocols (decay on every parameter), from their full runs
PILOT_HISTORY: tuple[dict[str, Any], ...] = (
    {"protocol": "v1", "lr": 0.05, "weight_decay": 0.1, "eta_times_lambda": 5e-3, "steps": 3000,
     "warmup": 0, "decay": "every parameter of the layer (LayerNorm and biases included)",
     "outcome": "collapse",
     "details": "near step 400 every embedding turned to the same direction (mean pairwise "
                "cosine -> 1), the loss sat at chance (ln 32) from then on, and the norms shrank "
                "and jumped back by an order of magnitude again and again (no stationary state)"},
    {"protocol": "v2", "lr": 1.0, "weight_decay": 2e-3, "eta_times_lambda": 2e-3, "steps": 3000,
     "warmup": 200, "decay": "every parameter of the layer (LayerNorm and biases included)",
     "outcome": "collapse",
     "details": "the loss rose after the warm-up (1.33 -> 1.68) and near step 500 every "
                "embedding turned to the same direction; window: mean pairwise cosine 0.997, "
                "loss over the last 500 steps 3.460 (chance ln 32 = 3.466), median norm change "
                "between the window halves 31%"},
)


@dataclass
class E2Config:
    n_pairs: int = 20_000
    n_probes: int = 500
    temperature: float = 0.05
    batch_size: int = 32
    lr: float = 0.2             # chosen by the pilot (see the module docstring)
    weight_decay: float = 5e-3
    no_decay: str | None = NO_DECAY
    steps: int = 7500
    warmup: int = 200
    window: float = 0.4
    record_every: int = 20
    probe_every: int = 60
    M: int = 8
    layer: int = 5
    n_boot: int = 2000
    trajectory_every: int = 100
    seed: int = 0
    protocol: str = "v3"

    @classmethod
    def v1(cls) -> "E2Config":
        """The first protocol, which collapses (see the module docstring)."""
        return cls(lr=0.05, weight_decay=0.1, no_decay=None, steps=3000, warmup=0,
                   probe_every=20, protocol="v1")

    @classmethod
    def v2(cls) -> "E2Config":
        """The second protocol, which collapses too."""
        return cls(lr=1.0, weight_decay=2e-3, no_decay=None, steps=3000, warmup=200,
                   probe_every=20, protocol="v2")

    @classmethod
    def quick(cls) -> "E2Config":
        return cls(n_pairs=600, n_probes=64, batch_size=16, steps=160, warmup=40, record_every=8,
                   probe_every=16, M=4, n_boot=500, trajectory_every=40)

    def validate(self) -> None:
        fn = "E2Config"
        for name in ("n_pairs", "n_probes", "batch_size", "steps", "record_every", "probe_every",
                     "n_boot", "trajectory_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{fn}: expected {name} to be a positive int, got {value!r}")
        if not 0 < self.window <= 1:
            raise ValueError(f"{fn}: expected 0 < window <= 1, got window={self.window!r}")
        if self.protocol not in ("v1", "v2", "v3"):
            raise ValueError(f"{fn}: expected protocol 'v1', 'v2' or 'v3', got {self.protocol!r}")
        if not (self.lr > 0 and self.weight_decay > 0):
            raise ValueError(f"{fn}: expected lr > 0 and weight_decay > 0, got lr={self.lr!r}, "
                             f"weight_decay={self.weight_decay!r}")
        if self.M < 2 or self.batch_size < 2:
            raise ValueError(f"{fn}: expected M >= 2 and batch_size >= 2, got M={self.M}, "
                             f"batch_size={self.batch_size}")
        if self.batch_size > self.n_pairs:
            raise ValueError(f"{fn}: expected batch_size <= n_pairs, got {self.batch_size} > "
                             f"{self.n_pairs}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"{fn}: expected warmup to be an int >= 0, got {self.warmup!r}")
        window_steps = int(self.steps * self.window)
        if self.warmup > self.steps - window_steps:
            raise ValueError(f"{fn}: the warmup ({self.warmup} steps) must end before the window "
                             f"starts (step {self.steps - window_steps})")
        if window_steps < 2 * self.probe_every or window_steps < 2 * self.record_every:
            raise ValueError(f"{fn}: the window ({window_steps} steps) must hold at least two "
                             f"checkpoints and two records, got probe_every={self.probe_every}, "
                             f"record_every={self.record_every}")


# ----------------------------------------------------------------------------
# data and model
# ----------------------------------------------------------------------------
def wordnet_pairs(cfg: E2Config) -> tuple[list[tuple[str, str]], list[str]]:
    """The fixed pool of (lemma, gloss) pairs and the probe lemmas, both drawn with ``cfg.seed``."""
    from normfast.data.datasets import gloss, lemma_names, load_wordnet, noun_synsets

    every = [(lemma, gloss(s)) for s in noun_synsets(load_wordnet()) for lemma in lemma_names(s)]
    if cfg.n_pairs > len(every):
        raise ValueError(f"wordnet_pairs: expected n_pairs <= {len(every)} (all noun lemma-gloss "
                         f"pairs), got {cfg.n_pairs}")
    rng = np.random.default_rng(cfg.seed)
    pool = [every[i] for i in rng.choice(len(every), size=cfg.n_pairs, replace=False)]
    lemmas = sorted({lemma for lemma, _ in pool})
    if cfg.n_probes > len(lemmas):
        raise ValueError(f"wordnet_pairs: expected n_probes <= {len(lemmas)} (distinct lemmas in "
                         f"the pool), got {cfg.n_probes}")
    probes = [lemmas[i] for i in rng.choice(len(lemmas), size=cfg.n_probes, replace=False)]
    return pool, probes


@dataclass
class Setup:
    """The pool as cache indices, the probe items, and the cached-front encoder."""
    texts: list[str]
    pair_ids: np.ndarray       # [n_pairs, 2] cache indices (lemma, gloss)
    probe_ids: list[int]
    probe_texts: list[str]
    encoder: CachedFrontEncoder
    pretrained_norm: np.ndarray
    cache_max_abs_diff: float
    seconds: dict[str, float]


def build_setup(cfg: E2Config, progress: bool = True) -> Setup:
    """Draw the data, load all-MiniLM-L6-v2 and cache its front for every text of the pool."""
    from normfast.encoders import load_encoder

    t0 = time.perf_counter()
    pool, probe_texts = wordnet_pairs(cfg)
    texts = sorted({t for pair in pool for t in pair})
    text_id = {t: i for i, t in enumerate(texts)}
    pair_ids = np.array([(text_id[a], text_id[b]) for a, b in pool], dtype=np.int64)
    probe_ids = [text_id[t] for t in probe_texts]
    data_seconds = time.perf_counter() - t0

    t0 = time.perf_counter()
    base = load_encoder("minilm").eval()
    cut = cfg.layer + 1  # stages: embeddings, layers 0..5, pooling
    enc = CachedFrontEncoder(base, texts, cut=cut, progress=progress).eval()
    cache_seconds = time.perf_counter() - t0
    # the cached tail must reproduce the full encoder
    check = probe_ids[:32] + [int(i) for i in pair_ids[:32, 1]]
    with torch.no_grad():
        full = base.encode([texts[i] for i in check])
        cached = enc.encode(check)
        pretrained_norm = enc.encode(probe_ids).norm(dim=-1).double().numpy()
    return Setup(texts, pair_ids, probe_ids, list(probe_texts), enc, pretrained_norm,
                 float((full - cached).abs().max()),
                 {"data": round(data_seconds, 1), "cache_front": round(cache_seconds, 1)})


def trained_parameters(enc: CachedFrontEncoder, cfg: E2Config
                       ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(decayed, exempt) parameters of the trained layer, the rest frozen."""
    pattern = re.compile(rf"model\.encoder\.layer\.{cfg.layer}\.")
    exempt_re = re.compile(cfg.no_decay) if cfg.no_decay else None
    decayed, exempt = [], []
    for name, p in enc.named_parameters():
        trained = bool(pattern.match(name))
        p.requires_grad_(trained)
        if trained:
            (exempt if exempt_re and exempt_re.search(name) else decayed).append(p)
    return decayed, exempt


# ----------------------------------------------------------------------------
# training and its health
# ----------------------------------------------------------------------------
@dataclass
class Records:
    losses: list[float]
    trajectory: list[dict[str, float]]
    window_norms: list[np.ndarray]       # [records][n_probes]
    window_cosines: list[float]
    window_weight_norms: list[float]     # norm of the decayed matrices
    window_start: int
    stopped_at: int | None               # step at which a collapsed run was stopped
    seconds: float


def _mean_cosine(z: torch.Tensor) -> float:
    """Mean pairwise cosine of the rows of ``z`` (diagonal excluded): 1 means collapse."""
    n = z.shape[0]
    zh = torch.nn.functional.normalize(z.double(), dim=-1)
    return float((zh.sum(0).square().sum() - n) / (n * (n - 1)))


def _norm(params: Sequence[torch.Tensor]) -> float:
    return float(torch.sqrt(sum(p.detach().double().square().sum() for p in params)))


def train(setup: Setup, cfg: E2Config, probe_items: Sequence[int], *,
          on_checkpoint: Callable[[int], None] | None = None, stop_on_collapse: bool = False,
          progress: bool = True, desc: str = "E2: train") -> Records:
    """SGD + decay on the chosen layer, recording what the health criteria and the fit need.

    ``on_checkpoint(i)`` runs at every ``probe_every``-th step of the window (the
    engine's probes); its time is not counted as training time.
    """
    enc = setup.encoder
    decayed, exempt = trained_parameters(enc, cfg)
    groups = [{"params": decayed, "weight_decay": cfg.weight_decay}]
    if exempt:
        groups.append({"params": exempt, "weight_decay": 0.0})
    opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=0.0)
    from normfast.engine.objectives import InfoNCE

    objective = InfoNCE(temperature=cfg.temperature)
    pair_ids = setup.pair_ids
    window_start = int(cfg.steps * (1 - cfg.window))
    rng = np.random.default_rng(cfg.seed + 2)
    probe_state = enc.prepare(list(probe_items))
    bs = cfg.batch_size
    rec = Records([], [], [], [], [], window_start, None, 0.0)
    checkpoint_seconds = 0.0
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=desc, unit="step", disable=not progress)
    for step in bar:
        if step <= cfg.warmup:
            for group in opt.param_groups:
                group["lr"] = cfg.lr * min(1.0, (step + 1) / (cfg.warmup + 1))
        idx = rng.choice(len(pair_ids), size=bs, replace=False)
        # both sides in one call: one pass through the layer, split by length inside
        z = enc(enc.prepare(np.concatenate([pair_ids[idx, 0], pair_ids[idx, 1]])))
        loss = objective.loss(z[:bs], z[bs:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        rec.losses.append(float(loss.detach()))
        if not np.isfinite(rec.losses[-1]):
            raise FloatingPointError(f"E2: the training loss is {rec.losses[-1]} at step {step}")
        done = step + 1
        in_window = step >= window_start
        k = step - window_start
        record = in_window and k % cfg.record_every == 0
        traj = done % cfg.trajectory_every == 0 or done == cfg.steps
        if record or traj:
            with torch.no_grad():
                zp = enc(probe_state)
            cosine = _mean_cosine(zp)
        if record:
            rec.window_norms.append(zp.norm(dim=-1).double().numpy())
            rec.window_cosines.append(cosine)
            rec.window_weight_norms.append(_norm(decayed))
        if traj:
            rec.trajectory.append({"step": done,
                                   "loss_mean": float(np.mean(rec.losses[-cfg.trajectory_every:])),
                                   "norm_median": float(zp.norm(dim=-1).median()),
                                   "mean_cosine": cosine, "decayed_weight_norm": _norm(decayed),
                                   "exempt_param_norm": _norm(exempt)})
            bar.set_postfix(loss=f"{rec.trajectory[-1]['loss_mean']:.3f}", cos=f"{cosine:.2f}")
            if stop_on_collapse and cosine >= COLLAPSE_COSINE:
                rec.stopped_at = done
                break
        if in_window and on_checkpoint is not None and k % cfg.probe_every == 0:
            tp = time.perf_counter()
            on_checkpoint(k // cfg.probe_every)
            checkpoint_seconds += time.perf_counter() - tp
    rec.seconds = time.perf_counter() - t0 - checkpoint_seconds
    return rec


def _halves_change(values: np.ndarray) -> np.ndarray:
    """|mean of the second half - mean of the first half| / overall mean, along axis 0."""
    half = len(values) // 2
    first, second = values[:half].mean(0), values[half:].mean(0)
    return np.abs(second - first) / values.mean(0)


def health(rec: Records, cfg: E2Config) -> dict[str, Any]:
    """The pilot's criteria (a) loss, (b) no collapse, (c) stationarity, on recorded training."""
    chance = float(np.log(cfg.batch_size))
    out: dict[str, Any] = {"loss_chance": chance, "stopped_at_step": rec.stopped_at}
    cosines = [t["mean_cosine"] for t in rec.trajectory] + list(rec.window_cosines)
    out["max_mean_cosine"] = float(max(cosines)) if cosines else float("nan")
    out["no_collapse"] = bool(cosines) and out["max_mean_cosine"] < COLLAPSE_COSINE
    window_losses = np.asarray(rec.losses[rec.window_start:])
    if rec.stopped_at is not None or len(rec.window_norms) < 2 or window_losses.size == 0:
        out.update(loss_below_chance=False, stationary=False, passed=False)
        return out
    per100 = [float(window_losses[i:i + 100].mean()) for i in range(0, len(window_losses), 100)]
    out["loss_window_mean"] = float(window_losses.mean())
    out["loss_window_max_100_step_mean"] = max(per100)
    out["loss_threshold"] = LOSS_FRACTION_OF_CHANCE * chance
    out["loss_below_chance"] = out["loss_window_max_100_step_mean"] < out["loss_threshold"]
    norms = np.stack(rec.window_norms)
    out["norm_change_between_window_halves_median"] = float(np.median(_halves_change(norms)))
    weights = np.asarray(rec.window_weight_norms)
    out["decayed_weight_norm_change_between_window_halves"] = float(_halves_change(weights))
    out["decayed_weight_norm_window"] = [float(weights.min()), float(weights.max())]
    out["mean_cosine_window"] = float(np.mean(rec.window_cosines))
    out["stationary"] = (out["norm_change_between_window_halves_median"] < NORM_CHANGE_MAX
                         and out["decayed_weight_norm_change_between_window_halves"]
                         < WEIGHT_CHANGE_MAX)
    out["passed"] = bool(out["loss_below_chance"] and out["no_collapse"] and out["stationary"])
    return out


def criteria_text() -> dict[str, str]:
    return {
        "a_loss": f"every 100-step mean loss in the window < {LOSS_FRACTION_OF_CHANCE} ln(batch)",
        "b_no_collapse": f"mean pairwise cosine of the probe embeddings < {COLLAPSE_COSINE} at "
                         "every record (every trajectory_every steps, and every record_every "
                         "steps in the window)",
        "c_stationary": f"median relative change of the window-mean probe norm between the "
                        f"window halves < {NORM_CHANGE_MAX}, and of the decayed matrices' "
                        f"norm < {WEIGHT_CHANGE_MAX}",
    }


# ----------------------------------------------------------------------------
# pilot
# ----------------------------------------------------------------------------
def run_pilot(cfg: E2Config, candidates: Sequence[tuple[float, float]] = PILOT_CANDIDATES, *,
              n_probes: int = 200, progress: bool = True) -> dict[str, Any]:
    """Train each candidate ``(lr, weight_decay)`` in order, health only; stop at the first pass."""
    cfg.validate()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one layer of small matmuls per call: one thread is faster here
    try:
        t_start = time.perf_counter()
        setup = build_setup(cfg, progress=progress)
        state = {n: p.detach().clone() for n, p in setup.encoder.named_parameters()}
        results, chosen = [], None
        for lr, wd in candidates:
            with torch.no_grad():  # every candidate starts from the pretrained layer
                for n, p in setup.encoder.named_parameters():
                    p.copy_(state[n])
            c = replace(cfg, lr=lr, weight_decay=wd)
            rec = train(setup, c, setup.probe_ids[:n_probes], stop_on_collapse=True,
                        progress=progress, desc=f"E2 pilot lr={lr} wd={wd}")
            h = health(rec, c)
            results.append({"lr": lr, "weight_decay": wd, "eta_times_lambda": lr * wd,
                            "eta_over_lambda": lr / wd, "health": h,
                            "train_seconds": round(rec.seconds, 1), "trajectory": rec.trajectory})
            if h["passed"]:
                chosen = {"lr": lr, "weight_decay": wd}
                break
        return {
            "rule": "candidates in the listed order; the first that passes (a), (b) and (c) is "
                    "chosen; a candidate whose probe embeddings collapse is stopped there",
            "criteria": criteria_text(),
            "fixed": {"steps": cfg.steps, "warmup": cfg.warmup, "window": cfg.window,
                      "batch_size": cfg.batch_size, "n_pairs": cfg.n_pairs,
                      "temperature": cfg.temperature, "no_decay": cfg.no_decay,
                      "record_every": cfg.record_every,
                      "trajectory_every": cfg.trajectory_every, "seed": cfg.seed,
                      "probe_items": min(n_probes, len(setup.probe_ids))},
            "candidates_declared": [{"lr": lr, "weight_decay": wd} for lr, wd in candidates],
            "results": results,
            "chosen": chosen,
            "history": list(PILOT_HISTORY),
            "seconds": {**setup.seconds, "total": round(time.perf_counter() - t_start, 1)},
            "torch_threads": torch.get_num_threads(),
        }
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------
# statistics
# ----------------------------------------------------------------------------
def bootstrap_fit(predicted: np.ndarray, observed: np.ndarray, n_boot: int,
                  seed: int) -> dict[str, Any]:
    """Log-log slope and Pearson r of observed on predicted, with percentile 95% CIs over items."""
    from normfast.core.stats import loglog_fit

    fit = loglog_fit(predicted, observed)
    x, y = np.asarray(predicted, float), np.asarray(observed, float)
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    lx, ly = np.log(x[ok]), np.log(y[ok])
    fit["n_no_prediction"] = int((~ok).sum())
    if len(lx) < 3:
        fit["slope_ci95"] = fit["pearson_r_ci95"] = [float("nan"), float("nan")]
        return fit
    idx = np.random.default_rng(seed).integers(0, len(lx), size=(n_boot, len(lx)))
    bx, by = lx[idx], ly[idx]
    bx = bx - bx.mean(1, keepdims=True)
    by = by - by.mean(1, keepdims=True)
    sxy, sxx, syy = (bx * by).sum(1), (bx * bx).sum(1), (by * by).sum(1)
    keep = (sxx > 0) & (syy > 0)
    slope = sxy[keep] / sxx[keep]
    r = sxy[keep] / np.sqrt(sxx[keep] * syy[keep])
    fit["slope_ci95"] = [float(v) for v in np.percentile(slope, [2.5, 97.5])]
    fit["pearson_r_ci95"] = [float(v) for v in np.percentile(r, [2.5, 97.5])]
    fit["n_boot"] = int(keep.sum())
    return fit


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 3 or np.std(a[ok]) == 0 or np.std(b[ok]) == 0:
        return float("nan")
    return float(np.corrcoef(a[ok], b[ok])[0, 1])


# ----------------------------------------------------------------------------
# the experiment
# ----------------------------------------------------------------------------
def run(cfg: E2Config, out: str | Path | None = None, progress: bool = True,
        pilot: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run E2 with ``cfg``; write JSON + PNG to ``out`` when given; return the summary.

    ``pilot`` (the record of ``--pilot``) is stored in the summary as is.
    """
    cfg.validate()
    threads = torch.get_num_threads()
    # one layer of small matmuls per call: one thread is faster here and the timings steadier
    torch.set_num_threads(1)
    try:
        return _run(cfg, out, progress, pilot)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: E2Config, out: str | Path | None, progress: bool,
         pilot: dict[str, Any] | None) -> dict[str, Any]:
    from normfast.core.equilibrium import equilibrium_norm
    from normfast.engine.objectives import InfoNCE
    from normfast.data.pairs import PairSource
    from normfast.engine.probe import ProbeConfig, _library_versions, probe

    t_start = time.perf_counter()
    setup = build_setup(cfg, progress=progress)
    enc, probe_ids = setup.encoder, setup.probe_ids
    objective = InfoNCE(temperature=cfg.temperature)
    pairs = PairSource.from_iterable([(int(a), int(b)) for a, b in setup.pair_ids])
    pcfg = ProbeConfig(params=rf"model\.encoder\.layer\.{cfg.layer}\.", mode="jvp",
                       output="pooled", optimizer="sgd", lr=cfg.lr, weight_decay=cfg.weight_decay,
                       no_decay=cfg.no_decay, batches=cfg.M, batch_size=cfg.batch_size,
                       chunk_size=len(probe_ids), radial_spread=True,
                       drift_batches=None)  # the protocol predates the mean-direction drift
    per_ckpt: dict[str, list[np.ndarray]] = {k: [] for k in ("D", "Q", "V2", "kappa", "norm")}
    last: list[Any] = [None]

    def checkpoint(ci: int) -> None:
        res = probe(enc, probe_ids, objective, pairs, replace(pcfg, seed=cfg.seed * 7919 + ci),
                    progress=False, model_name="all-MiniLM-L6-v2 (layer 5, cached front)")
        for col in per_ckpt:
            per_ckpt[col].append(res.column(col))
        last[0] = res
        enc.train(False)

    tp = time.perf_counter()
    rec = train(setup, cfg, probe_ids, on_checkpoint=checkpoint, progress=progress)
    probe_seconds = time.perf_counter() - tp - rec.seconds
    checks = health(rec, cfg)

    obs = np.stack(rec.window_norms)
    observed_norm = obs.mean(0)
    stack = {k: np.stack(v) for k, v in per_ckpt.items()}
    avg = {k: v.mean(0) for k, v in stack.items()}
    law = dict(lr=cfg.lr, weight_decay=cfg.weight_decay)
    zero = np.zeros_like(observed_norm)
    r_full = np.asarray(equilibrium_norm(avg["D"], avg["Q"], avg["kappa"], **law))
    r_heat = np.asarray(equilibrium_norm(zero, avg["Q"], avg["kappa"], **law))
    r_last, r_last_heat = last[0].column("r_eq"), last[0].column("r_eq_heat")
    fits = {
        "full_law": bootstrap_fit(r_full, observed_norm, cfg.n_boot, cfg.seed + 11),
        "heat_only_law": bootstrap_fit(r_heat, observed_norm, cfg.n_boot, cfg.seed + 12),
        "last_checkpoint_full_law": bootstrap_fit(r_last, observed_norm, cfg.n_boot, cfg.seed + 13),
        "last_checkpoint_heat_only_law": bootstrap_fit(r_last_heat, observed_norm, cfg.n_boot,
                                                       cfg.seed + 14),
    }
    heat_scale = np.sqrt(cfg.weight_decay * np.abs(avg["kappa"]) * cfg.lr * avg["Q"])
    # drift fluctuates along the trajectory: how well one checkpoint's D tracks the average
    d_single_vs_avg = [_pearson(d, avg["D"]) for d in stack["D"]]
    n_ck = len(stack["D"])
    window_start = rec.window_start
    decayed, exempt = trained_parameters(enc, cfg)
    summary = {
        "experiment": "E2 equilibrium law on a real pretrained text encoder",
        "model": "all-MiniLM-L6-v2 (sentence-transformers), last layer trained, mean pooling",
        "data": "WordNet 3.0 noun (lemma, gloss) pairs; probe items: lemma strings",
        "config": asdict(cfg),
        "protocol": {
            "objective": f"InfoNCE, temperature {cfg.temperature}, in-batch negatives, "
                         "both sides through the same encoder, dropout off",
            "optimizer": "torch.optim.SGD (no momentum); weight decay "
                         + (f"on the weight matrices only (exempt: names matching "
                            f"{cfg.no_decay!r}), the same exemption in the engine"
                            if cfg.no_decay else "on every trained parameter"),
            "trained_and_probed_parameters": f"model.encoder.layer.{cfg.layer}.* "
                                             f"({sum(p.numel() for p in decayed + exempt)} values, "
                                             f"{sum(p.numel() for p in decayed)} decayed)",
            "eta_times_lambda": cfg.lr * cfg.weight_decay,
            "equilibration_steps": 1.0 / (cfg.lr * cfg.weight_decay),
            "equilibration_times_before_window": window_start * cfg.lr * cfg.weight_decay,
            "window_steps": [window_start, cfg.steps],
            "records": len(rec.window_norms),
            "checkpoints": n_ck,
            "probe_seed_of_checkpoint_i": f"{cfg.seed} * 7919 + i",
            "bootstrap": f"{cfg.n_boot} resamples of probe items, percentile 95% intervals",
        },
        "pilot": pilot,
        "health": {**checks, "criteria": criteria_text()},
        "n_pairs": len(setup.pair_ids),
        "n_texts_cached": len(setup.texts),
        "n_probe_items": len(probe_ids),
        "cache_check_max_abs_diff": setup.cache_max_abs_diff,
        "fits": fits,
        "paper": PAPER,
        "kappa": {"min": float(np.min(avg["kappa"])), "median": float(np.median(avg["kappa"])),
                  "max": float(np.max(avg["kappa"])),
                  "negative_fraction": float(np.mean(avg["kappa"] <= 0))},
        "drift_over_heat_median": float(np.median(np.abs(avg["D"]) / heat_scale)),
        "drift_negative_fraction": float(np.mean(avg["D"] < 0)),
        "drift_single_checkpoint_vs_average_r_median": float(np.nanmedian(d_single_vs_avg)),
        "norm_change_between_window_halves_median":
            checks["norm_change_between_window_halves_median"],
        "observed_norm": {"min": float(observed_norm.min()),
                          "median": float(np.median(observed_norm)),
                          "max": float(observed_norm.max())},
        "pretrained_norm_median": float(np.median(setup.pretrained_norm)),
        "pretrained_vs_observed_loglog_r": _pearson(np.log(setup.pretrained_norm),
                                                    np.log(observed_norm)),
        "probe_embedding_mean_cosine_window": checks["mean_cosine_window"],
        "loss_mean_first_100": float(np.mean(rec.losses[:100])),
        "loss_mean_last_500": float(np.mean(rec.losses[-500:])),
        "loss_chance": float(np.log(cfg.batch_size)),
        "trajectory": rec.trajectory,
        "seconds": {**setup.seconds, "train": round(rec.seconds, 1),
                    "probe": round(probe_seconds, 1),
                    "train_per_step": round(rec.seconds / cfg.steps, 4),
                    "probe_per_checkpoint": round(probe_seconds / max(n_ck, 1), 2),
                    "total": round(time.perf_counter() - t_start, 1)},
        "torch_threads": torch.get_num_threads(),
        "versions": _library_versions(),
        "items": {
            "text": list(setup.probe_texts),
            "observed": observed_norm.tolist(),
            "predicted_full": r_full.tolist(),
            "predicted_heat": r_heat.tolist(),
            "predicted_last_full": np.asarray(r_last).tolist(),
            "predicted_last_heat": np.asarray(r_last_heat).tolist(),
            "pretrained_norm": setup.pretrained_norm.tolist(),
            "D": avg["D"].tolist(), "Q": avg["Q"].tolist(), "kappa": avg["kappa"].tolist(),
        },
    }
    if pilot is not None and pilot.get("chosen") is not None:
        summary["pilot_choice_used"] = bool(
            pilot["chosen"]["lr"] == cfg.lr and pilot["chosen"]["weight_decay"] == cfg.weight_decay
            and pilot["fixed"]["steps"] == cfg.steps)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        stem = result_stem(cfg)
        (out / f"{stem}.json").write_text(json.dumps(summary, indent=1))
        plot(summary, out / f"{stem}.png")
    return summary


def result_stem(cfg: E2Config) -> str:
    """File name (without suffix) of a run's results: the historical protocols get their own."""
    return "e2_real_encoder" if cfg.protocol == "v3" else f"e2_real_encoder_{cfg.protocol}"


def plot(summary: dict[str, Any], path: str | Path) -> None:
    """Observed vs predicted norms, log-log (trajectory average, last checkpoint), and training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    items, fits = summary["items"], summary["fits"]
    obs = np.asarray(items["observed"])
    panels = (("trajectory-averaged D, Q, κ", ("predicted_full", "full_law"),
               ("predicted_heat", "heat_only_law")),
              ("last checkpoint alone", ("predicted_last_full", "last_checkpoint_full_law"),
               ("predicted_last_heat", "last_checkpoint_heat_only_law")))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    for ax, (title, full, heat) in zip(axes, panels):
        values = [obs]
        for (key, fit_key), color, label in ((full, "tab:blue", "full law"),
                                             (heat, "tab:orange", "heat-only law")):
            pred = np.asarray(items[key], dtype=float)
            f = fits[fit_key]
            ax.loglog(pred, obs, ".", ms=3, alpha=0.6, color=color,
                      label=f"{label}: slope {f['slope']:.2f}, r {f['pearson_r']:.3f}")
            values.append(pred[np.isfinite(pred) & (pred > 0)])
        lo = min(float(np.min(v)) for v in values if v.size)
        hi = max(float(np.max(v)) for v in values if v.size)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="y = x")
        ax.set_title(title, fontsize=10)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_minor_formatter(NullFormatter())  # minor labels overlap on short ranges
        ax.set_xlabel("predicted R_eq")
        ax.set_ylabel("observed stationary norm (window mean)")
        ax.legend(fontsize=7, loc="upper left")
    ax = axes[2]
    traj = summary["trajectory"]
    steps = [t["step"] for t in traj]
    ax.plot(steps, [t["loss_mean"] for t in traj], color="tab:red", label="loss (100-step mean)")
    ax.axhline(summary["loss_chance"], color="tab:red", ls=":", lw=0.8, label="chance ln(batch)")
    ax.plot(steps, [t["norm_median"] for t in traj], color="tab:blue",
            label="median probe norm")
    ax.plot(steps, [t["mean_cosine"] for t in traj], color="tab:green",
            label="mean pairwise cosine")
    w0 = np.asarray([t["decayed_weight_norm"] for t in traj])
    ax.plot(steps, w0 / w0[0], color="tab:purple", label="decayed weight norm / initial")
    start, stop = summary["protocol"]["window_steps"]
    ax.axvspan(start, stop, color="0.9", zorder=0, label="window")
    ax.set_xlabel("step")
    ax.set_title("training health", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    cfg, h = summary["config"], summary["health"]
    fig.suptitle(f"E2 ({cfg['protocol']}): all-MiniLM-L6-v2 layer {cfg['layer']}, SGD "
                 f"η={cfg['lr']} λ={cfg['weight_decay']} (decay exempt: {cfg['no_decay']}), "
                 f"{summary['n_probe_items']} WordNet lemmas, "
                 f"{summary['protocol']['checkpoints']} checkpoints × M={cfg['M']}\nwindow: "
                 f"max mean pairwise cosine {h['max_mean_cosine']:.3f}, median norm change "
                 f"between halves {h.get('norm_change_between_window_halves_median', np.nan):.3f}, "
                 f"loss over the last 500 steps {summary['loss_mean_last_500']:.2f} (chance "
                 f"{summary['loss_chance']:.2f}); health criteria "
                 f"{'met' if h['passed'] else 'NOT met'}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(summary: dict[str, Any]) -> str:
    from tables import e2_fits_table  # bench/tables.py, next to this script: the README's renderer

    return e2_fits_table(summary)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a toy size for the tests (about a minute)")
    p.add_argument("--pilot", action="store_true",
                   help="run the pilot (health only) and store it under 'pilot' in the JSON")
    p.add_argument("--out", default=str(RUNS),
                   help="output folder (default runs/e2, git-ignored; the committed results: --out bench/results)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--protocol", choices=("v3", "v2", "v1"), default="v3",
                   help="v3 (default) or the historical v1/v2, which collapse; those write "
                        "e2_real_encoder_v1/_v2.json/.png")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    cfg = {"v1": E2Config.v1, "v2": E2Config.v2, "v3": E2Config}[args.protocol]()
    if args.quick:
        quick = E2Config.quick()
        cfg = replace(quick, lr=cfg.lr, weight_decay=cfg.weight_decay, no_decay=cfg.no_decay,
                      protocol=cfg.protocol, warmup=quick.warmup if cfg.warmup else 0)
    cfg = replace(cfg, seed=args.seed)
    out = Path(args.out)
    path = out / f"{result_stem(cfg)}.json"
    if args.pilot:
        if args.protocol != "v3":
            print("e2_real_encoder: --pilot belongs to protocol v3", file=sys.stderr)
            return 2
        candidates = PILOT_CANDIDATES
        record = run_pilot(cfg, candidates, n_probes=min(200, cfg.n_probes),
                           progress=not args.no_progress)
        existing = _read_json(path)
        existing["pilot"] = record
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(existing, indent=1))
        for r in record["results"]:
            h = r["health"]
            print(f"lr={r['lr']} wd={r['weight_decay']}: loss ok {h['loss_below_chance']}, "
                  f"no collapse {h['no_collapse']} (max cosine {h['max_mean_cosine']:.3f}), "
                  f"stationary {h['stationary']} (norm change "
                  f"{h.get('norm_change_between_window_halves_median', float('nan')):.4f}, "
                  f"weight change "
                  f"{h.get('decayed_weight_norm_change_between_window_halves', float('nan')):.4f})"
                  f" -> {'PASS' if h['passed'] else 'fail'}")
        print(f"chosen: {record['chosen']}\nwrote the pilot to {path}")
        return 0
    pilot = _read_json(path).get("pilot") if cfg.protocol == "v3" else None
    summary = run(cfg, out=out, progress=not args.no_progress, pilot=pilot)
    print(format_table(summary))
    s, h = summary, summary["health"]
    print(f"\nhealth: loss ok {h['loss_below_chance']}, no collapse {h['no_collapse']} (max "
          f"cosine {h['max_mean_cosine']:.3f}), stationary {h['stationary']} (norm change "
          f"{h.get('norm_change_between_window_halves_median', float('nan')):.4f}, weight change "
          f"{h.get('decayed_weight_norm_change_between_window_halves', float('nan')):.4f})")
    print(f"κ {s['kappa']['min']:.3f}..{s['kappa']['max']:.3f}; drift/heat median "
          f"{s['drift_over_heat_median']:.3f}; loss over the last 500 steps "
          f"{s['loss_mean_last_500']:.3f} (chance {s['loss_chance']:.3f})")
    print(f"seconds {s['seconds']}")
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
