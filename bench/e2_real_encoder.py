"""E2: the equilibrium law on a real pretrained text encoder (all-MiniLM-L6-v2).

    python bench/e2_real_encoder.py --protocol A --pilot     # health only: choose η, λ, steps
    python bench/e2_real_encoder.py --protocol A             # the full run with the chosen settings
    python bench/e2_real_encoder.py --protocol B [--pilot]   # the projection-head regime
    python bench/e2_real_encoder.py --quick --protocol B     # a toy size that only exercises the code

Output goes to ``runs/e2`` unless ``--out`` says otherwise; the committed
results in ``bench/results`` change only with an explicit ``--out bench/results``.
A full run keeps its state in ``runs/e2/state/`` (:class:`normfast.apps.training.storage.Resume`,
and the checkpoints' parameter snapshots and probe results beside it): started
again with the same settings after an interruption, it goes on from its last
checkpoint, or with the checkpoints not yet probed, and gives the result an
uninterrupted run gives (``--fresh`` deletes the state first).

The pretrained sentence encoder (real weights, loaded offline) is fine-tuned
with plain SGD + weight decay on real text pairs until its embedding norms are
stationary; the engine's prediction of each probe item's equilibrium norm is
then compared with the norm the item actually keeps. The training, the health
criteria, the pilot and the checkpoint averaging are
:mod:`normfast.apps.training`; the statistics are :func:`normfast.engine.probe`'s.

Data (every protocol). WordNet 3.0 noun (lemma, gloss) pairs
(:func:`normfast.data.wordnet.wordnet_gloss_pairs`): a pool of ``n_pairs``
pairs and ``n_probes`` distinct probe lemmas, drawn with the seed. InfoNCE with
in-batch negatives, both sides through the same encoder, mean pooling, raw
(unnormalized) vectors; dropout off in training and in the virtual batches.
Training batches are uniform draws from the pool, as the virtual batches are.
Only the tail is trained: the hidden states entering the last transformer
layer are cached once for every text (:class:`normfast.encoders.CachedFrontEncoder`;
the largest difference to the full encoder on a sample is recorded).

Protocols
---------
``v3`` (negative control; committed result, run before the regime check existed):
the last layer trained, decay on its weight matrices only -- LayerNorm gains and
biases and all bias vectors exempt (``no_decay="bias|LayerNorm"``), η = 0.2,
λ = 5e-3, 7500 steps, 50 checkpoints × M = 8. Its pilot tried η = 0.5, λ = 2e-3
first (collapsed near step 6000). Result: slope 0.078, r 0.533; diagnosis: in a
post-LayerNorm encoder the exempt final LayerNorm sets the embedding's scale, so
decay has no radial grip (κ small, ≤ 0 for 39% of the items) -- the regime
check classifies this setting "not applicable". ``v1``/``v2`` (decay on every
parameter, η = 0.05/λ = 0.1 and η = 1/λ = 2e-3) collapsed (history only).

``A`` (everything decayed): the last layer trained, decay on every parameter
of it, the final LayerNorm's gain and bias included, so the pooled embedding is
degree-1 homogeneous in decayed parameters and κ should be near 1. The probe:
jvp mode over ``model.encoder.layer.5.*``, no exemption.

``B`` (projection head): the MiniLM trunk, mean pooling, then a linear
projection head 384 → 256 without bias (as a CLIP projection; a
sentence-transformers ``Dense`` layer with identity activation), initialized
with the seed. Trained: the head AND the last transformer layer, every
parameter decayed (the final LayerNorm included). Why the last layer is
trained: the jvp prediction over head + last layer then probes exactly what was
trained, and head mode (the closed form over the head alone, which ignores the
last layer's share of heat and damping) is the cheap approximation a user would
reach for -- the two side by side show what it loses. Why its LayerNorm is
decayed too: with the LayerNorm exempt and the head decayed, the loss is
invariant under (γ, β, W) → (cγ, cβ, W/c), an exact rescaling symmetry that
moves the scale from the decayed head into the exempt LayerNorm (the regime
check's "not applicable"). Two probes at every checkpoint: head mode
(``dense.0.linear.weight``, closed form) and jvp mode over
``model.encoder.layer.5.*`` + the head.

Pilot of A and of B (``--pilot``; fixed before any run of it, and it never
computes the law's inputs or a fit). Candidates in this order, the first that
passes every health criterion is chosen, a collapsed candidate is stopped at
once: towards smaller η and longer runs (the collapses so far were at η = 0.5
with the LayerNorm exempt and η = 1 or λ = 0.1 with everything decayed)::

    η = 0.2,  λ = 5e-3, 5 000 steps  (ηλ = 1e-3: 1/(ηλ) = 1 000 steps)
    η = 0.1,  λ = 1e-2, 5 000 steps  (same ηλ, smaller η)
    η = 0.1,  λ = 5e-3, 10 000 steps (ηλ = 5e-4, twice as long)
    η = 0.05, λ = 5e-3, 20 000 steps (ηλ = 2.5e-4)

B's pilot starts at the candidate A's pilot chose (the ones before it
collapsed or failed for A; this order was added before B's pilot ran, to save
its time), and runs all four when A's chose none.

Fixed: temperature 0.05, batches of 32 pairs, 200-step linear warm-up, window =
the last 40% of the steps (it starts after 3 equilibration times 1/(ηλ)), 200
probe lemmas, seed 0. Criteria (:class:`normfast.apps.training.settings.HealthThresholds`):
(a) every 100-step mean loss in the window below 0.75 ln(32); (b) the mean
pairwise cosine of the probe embeddings below 0.9 at every record; (c) the
median relative change of the window-mean probe norm between the window halves
below 5%, and of the decayed parameters' norm below 2%.

Full run of A and of B (``PROTOCOL_FULL`` below; written and committed before
the run): the pilot's chosen η, λ and steps; 500 probe lemmas; every probe
item's norm recorded every 20 steps over the window and averaged -> observed
norm; 50 checkpoints evenly spread over the window, each a fresh engine run
on the parameters of that step (seed ``7919·seed + i``) drawing
``drift_batches`` = 64 virtual batches of 32 pairs: the drift from their mean
direction (``ProbeConfig(drift_batches=...)``, se_D from the engine's 8 groups
of 8), the heat from the first M = 8 of them; D, Q, κ averaged over the
checkpoints -> the trajectory-averaged full law and the heat-only law (D = 0);
the last checkpoint alone beside them. Reported: the log-log slope and Pearson
r of observed on predicted with 2000-resample bootstrap 95% intervals over
items, the target (slope in [0.85, 1.15], r ≥ 0.90), the health record of the
run and of its pilot, the κ distribution, the regime check of the averaged
statistics, and the wall and process CPU time.

Time (the 30-minute budget of a run on a 2-core machine). Training runs on
torch's own thread count, every core by default (``OMP_NUM_THREADS`` or
``torch.set_num_threads`` before the call limit it): two threads make a B
training step 1.7x faster than one. The checkpoints are probed after training:
the trained parameters are saved at each checkpoint (``runs/e2/state/``, with
the resume state) and the engine runs on every snapshot in one worker process
per thread (:func:`normfast.apps.training.workers.probe_checkpoints`), which gives what
probing during training gives (the same parameters and seeds). The engine takes
one direction per forward-mode pass on the cached front
(``CachedFrontEncoder.batched_directions``): batching the directions with vmap
does not get the length groups' saving and was 1.9x slower here. v3, A and B's
first full run probed during training on one thread (27 to 82 minutes).

The paper this project tests reports slope 0.88, r = 0.97 for a fine-tuned
DistilBERT; that figure is stored in the JSON next to ours. ``--quick`` runs the
same code at a toy size (used by the tests); its numbers are not a result.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from normfast.apps.training import (CheckpointLaw, CheckpointSnapshots, HealthThresholds, Resume,  # noqa: E402
                                    TrainSettings, health, pilot, probe_checkpoints, split_decay, train)
from normfast.core.stats import loglog_fit_ci  # noqa: E402
from normfast.encoders import CachedFrontEncoder  # noqa: E402

RUNS = Path(__file__).resolve().parents[1] / "runs" / "e2"  # default output (git-ignored)
PAPER = {"model": "DistilBERT, fine-tuned", "slope": 0.88, "pearson_r": 0.97}
TARGET = {"slope": [0.85, 1.15], "pearson_r": 0.90}
LAYER = r"model\.encoder\.layer\.5\."
HEAD = r"dense\.0\.linear\.weight"
PROTOCOLS = ("v3", "A", "B", "v1", "v2")

#: pilot candidates of A and B, in order (see the module docstring)
PILOT_CANDIDATES: tuple[dict[str, Any], ...] = (
    {"lr": 0.2, "weight_decay": 5e-3, "steps": 5000},
    {"lr": 0.1, "weight_decay": 1e-2, "steps": 5000},
    {"lr": 0.1, "weight_decay": 5e-3, "steps": 10000},
    {"lr": 0.05, "weight_decay": 5e-3, "steps": 20000},
)

#: the full run's protocol beyond the pilot's choice (stored in the JSON)
PROTOCOL_FULL = {
    "n_probes": 500, "checkpoints": 50, "M": 8, "drift_batches": 64, "record_every": 20,
    "n_boot": 2000, "target": TARGET,
    "predictors": "trajectory average of D, Q, κ over the checkpoints -> full law and heat-only law; "
                  "the last checkpoint alone beside them",
}

#: the first two protocols (decay on every parameter), from their full runs
HISTORY: tuple[dict[str, Any], ...] = (
    {"protocol": "v1", "lr": 0.05, "weight_decay": 0.1, "steps": 3000, "warmup": 0,
     "decay": "every parameter of the layer", "outcome": "collapse near step 400 (mean pairwise "
     "cosine -> 1, loss at chance, no stationary norms)"},
    {"protocol": "v2", "lr": 1.0, "weight_decay": 2e-3, "steps": 3000, "warmup": 200,
     "decay": "every parameter of the layer", "outcome": "collapse near step 500 (window: mean "
     "pairwise cosine 0.997, loss 3.460 vs chance 3.466, median norm change 31%)"},
    {"protocol": "v3 pilot", "lr": 0.5, "weight_decay": 2e-3, "steps": 7500, "warmup": 200,
     "decay": "weight matrices only (bias|LayerNorm exempt)", "outcome": "collapse near step 6000"},
)


@dataclass
class E2Config:
    protocol: str = "v3"
    n_pairs: int = 20_000
    n_probes: int = 500
    temperature: float = 0.05
    batch_size: int = 32
    lr: float = 0.2
    weight_decay: float = 5e-3
    no_decay: str | None = "bias|LayerNorm"
    steps: int = 7500
    warmup: int = 200
    window: float = 0.4
    record_every: int = 20
    probe_every: int = 60
    M: int = 8
    drift_batches: int | None = None
    head_dim: int | None = None
    layer: int = 5
    n_boot: int = 2000
    trajectory_every: int = 100
    seed: int = 0

    @classmethod
    def of(cls, protocol: str, chosen: dict[str, Any] | None = None) -> "E2Config":
        """The settings of a protocol; A and B take η, λ, steps from their pilot's choice."""
        if protocol == "v1":
            return cls(protocol="v1", lr=0.05, weight_decay=0.1, no_decay=None, steps=3000, warmup=0,
                       probe_every=20)
        if protocol == "v2":
            return cls(protocol="v2", lr=1.0, weight_decay=2e-3, no_decay=None, steps=3000,
                       probe_every=20)
        if protocol == "v3":
            return cls()
        if protocol not in ("A", "B"):
            raise ValueError(f"E2Config.of: expected a protocol in {PROTOCOLS}, got {protocol!r}")
        chosen = dict(chosen or PILOT_CANDIDATES[0])
        steps = int(chosen.get("steps", 5000))
        window = int(steps * 0.4)
        return cls(protocol=protocol, no_decay=None, lr=float(chosen["lr"]),
                   weight_decay=float(chosen["weight_decay"]), steps=steps,
                   probe_every=max(1, window // PROTOCOL_FULL["checkpoints"]), M=PROTOCOL_FULL["M"],
                   drift_batches=PROTOCOL_FULL["drift_batches"],
                   head_dim=256 if protocol == "B" else None)

    def quick(self) -> "E2Config":
        """The same protocol at a toy size (for the tests)."""
        return replace(self, n_pairs=160, n_probes=32, batch_size=16, steps=40, warmup=8,
                       record_every=4, probe_every=8, M=4, n_boot=500, trajectory_every=20,
                       drift_batches=8 if self.drift_batches else None)

    def settings(self) -> TrainSettings:
        return TrainSettings(lr=self.lr, weight_decay=self.weight_decay, steps=self.steps,
                             temperature=self.temperature, batch_size=self.batch_size,
                             warmup=self.warmup if self.protocol != "v1" else 0, window=self.window,
                             record_every=self.record_every, probe_every=self.probe_every,
                             trajectory_every=self.trajectory_every, seed=self.seed)

    @property
    def trained(self) -> str:
        layer = rf"model\.encoder\.layer\.{self.layer}\."
        return f"{layer}|{HEAD}" if self.head_dim else layer

    def validate(self) -> None:
        fn = "E2Config"
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"{fn}: expected protocol in {PROTOCOLS}, got {self.protocol!r}")
        for name in ("n_pairs", "n_probes", "n_boot"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{fn}: expected {name} to be a positive int, got {value!r}")
        if self.M < 2:
            raise ValueError(f"{fn}: expected M >= 2, got M={self.M}")
        if self.batch_size > self.n_pairs:
            raise ValueError(f"{fn}: expected batch_size <= n_pairs, got {self.batch_size} > {self.n_pairs}")
        self.settings().validate()


# ----------------------------------------------------------------------------
# data and model
# ----------------------------------------------------------------------------
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
    """Draw the data, load all-MiniLM-L6-v2 (+ B's head) and cache its front for every text."""
    from normfast.data.wordnet import wordnet_gloss_pairs
    from normfast.encoders import DenseLayer, HFEncoder, load_encoder

    t0 = time.perf_counter()
    pool, probe_texts = wordnet_gloss_pairs(cfg.n_pairs, cfg.n_probes, cfg.seed)
    texts = sorted({t for pair in pool for t in pair})
    text_id = {t: i for i, t in enumerate(texts)}
    pair_ids = np.array([(text_id[a], text_id[b]) for a, b in pool], dtype=np.int64)
    probe_ids = [text_id[t] for t in probe_texts]
    data_seconds = time.perf_counter() - t0

    t0 = time.perf_counter()
    base = load_encoder("minilm").eval()
    if cfg.head_dim:
        torch.manual_seed(cfg.seed + 101)
        head = DenseLayer(base.model.config.hidden_size, cfg.head_dim, bias=False)
        base = HFEncoder(base.model, base.tokenizer, pooling="mean", dense=[head],
                         max_length=base.max_length, lowercase=base.lowercase).eval()
    enc = CachedFrontEncoder(base, texts, cut=cfg.layer + 1, progress=progress).eval()
    cache_seconds = time.perf_counter() - t0
    check = probe_ids[:32] + [int(i) for i in pair_ids[:32, 1]]
    with torch.no_grad():  # the cached tail must reproduce the full encoder
        full = base.encode([texts[i] for i in check])
        cached = enc.encode(check)
        pretrained_norm = enc.encode(probe_ids).norm(dim=-1).double().numpy()
    return Setup(texts, pair_ids, probe_ids, list(probe_texts), enc, pretrained_norm,
                 float((full - cached).abs().max()),
                 {"data": round(data_seconds, 1), "cache_front": round(cache_seconds, 1)})


def _probe_fn(setup: Setup, cfg: E2Config, params: str, mode: str):
    """``seed -> ProbeResult``: one engine run over the probe lemmas at the current parameters."""
    from normfast.data.pairs import PairSource
    from normfast.engine.objectives import InfoNCE
    from normfast.engine.probe import ProbeConfig, probe

    objective = InfoNCE(temperature=cfg.temperature)
    pairs = PairSource.from_iterable([(int(a), int(b)) for a, b in setup.pair_ids])
    # v1-v3 predate the drift from the mean direction: drift_batches=None keeps their estimator
    pcfg = ProbeConfig(params=params, mode=mode, output="pooled", optimizer="sgd", lr=cfg.lr,
                       weight_decay=cfg.weight_decay, no_decay=cfg.no_decay, batches=cfg.M,
                       drift_batches=cfg.drift_batches, batch_size=cfg.batch_size,
                       chunk_size=len(setup.probe_ids))
    name = f"all-MiniLM-L6-v2 E2 {cfg.protocol} ({mode}, {params})"

    def run(seed: int):
        res = probe(setup.encoder, setup.probe_ids, objective, pairs, replace(pcfg, seed=seed),
                    progress=False, model_name=name)
        setup.encoder.train(False)
        return res

    return run


def probes_of(cfg: E2Config) -> dict[str, tuple[str, str]]:
    """The engine runs at every checkpoint: ``{name: (params, mode)}``."""
    layer = rf"model\.encoder\.layer\.{cfg.layer}\."
    if cfg.head_dim:
        return {"jvp": (f"{layer}|{HEAD}", "jvp"), "head": (HEAD, "head")}
    return {"jvp": (layer, "jvp")}


# ----------------------------------------------------------------------------
# the experiment
# ----------------------------------------------------------------------------
def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 3 or np.std(a[ok]) == 0 or np.std(b[ok]) == 0:
        return float("nan")
    return float(np.corrcoef(a[ok], b[ok])[0, 1])


def _kappa_summary(kappa: np.ndarray) -> dict[str, float]:
    p10, p50, p90 = np.percentile(kappa, [10, 50, 90])
    return {"min": float(np.min(kappa)), "p10": float(p10), "median": float(p50), "p90": float(p90),
            "max": float(np.max(kappa)), "negative_fraction": float(np.mean(kappa <= 0))}


class SegmentLog:
    """The setup time of every process that ran part of a resumed run (a :class:`Resume` part)."""

    def __init__(self) -> None:
        self.segments: list[dict[str, Any]] = []

    def state_dict(self) -> list[dict[str, Any]]:
        return list(self.segments)

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        self.segments = list(state) + self.segments[-1:]  # the earlier ones, then this process's


def state_path(cfg: E2Config) -> Path:
    """Where a full run keeps its resume state (git-ignored, whatever ``--out`` is)."""
    return RUNS / "state" / f"{result_stem(cfg.protocol)}_seed{cfg.seed}.pt"


def checkpoint_folder(state: str | Path) -> Path:
    """Where a resumable run keeps its checkpoints' snapshots and probe results (beside ``state``)."""
    return Path(state).with_suffix(".checkpoints")


def run(cfg: E2Config, out: str | Path | None = None, progress: bool = True,
        pilot_record: dict[str, Any] | None = None, setup: Setup | None = None,
        resume: str | Path | None = None) -> dict[str, Any]:
    """Run E2 with ``cfg``; write JSON + PNG to ``out`` when given; return the summary.

    ``setup`` (from :func:`build_setup` with the same data settings) skips building one.
    ``resume``: a state file; the run saves its state there as it goes and, when the
    file exists, continues from it (an interrupted run loses at most one checkpoint).
    """
    cfg.validate()
    with tempfile.TemporaryDirectory(prefix="normfast-e2-") as scratch:  # the snapshots without resume
        return _run(cfg, out, progress, pilot_record, setup, resume, Path(scratch))


def _run(cfg: E2Config, out: str | Path | None, progress: bool,
         pilot_record: dict[str, Any] | None, setup: Setup | None,
         resume_path: str | Path | None, scratch: Path) -> dict[str, Any]:
    t_start, c_start = time.perf_counter(), time.process_time()
    setup = setup or build_setup(cfg, progress=progress)
    laws = {name: CheckpointLaw(_probe_fn(setup, cfg, params, mode), cfg.seed)
            for name, (params, mode) in probes_of(cfg).items()}
    settings = cfg.settings()
    groups = split_decay(setup.encoder, cfg.trained, cfg.no_decay)
    log = SegmentLog()
    log.segments.append({"setup_seconds": round(time.perf_counter() - t_start, 1),
                         "setup_cpu_seconds": round(time.process_time() - c_start, 1)})
    identity = {"config": asdict(cfg), "n_texts": len(setup.texts)}
    folder = checkpoint_folder(resume_path) if resume_path is not None else scratch / "checkpoints"
    snapshots = CheckpointSnapshots([*groups[0], *groups[1]], folder, identity)
    # kept until the checkpoints are probed: a run interrupted while probing resumes there
    resume = None if resume_path is None else Resume(Path(resume_path), parts={"segments": log},
                                                     identity=identity, keep=True)
    t_loop, c_loop = time.perf_counter(), time.process_time()
    rec = train(setup.encoder, setup.pair_ids, setup.probe_ids, settings, groups, on_checkpoint=snapshots,
                progress=progress, desc=f"E2 {cfg.protocol}: train", resume=resume)
    # the loop's time in earlier processes of a resumed run (0 for a run in one go)
    earlier = (rec.loop_seconds - (time.perf_counter() - t_loop), rec.loop_cpu_seconds - (time.process_time() - c_loop))
    phase = probe_checkpoints(laws, snapshots, progress=progress, desc=f"E2 {cfg.protocol}: probe checkpoints")
    checks = health(rec, settings)
    observed = np.stack(rec.window_norms).mean(0)
    fits, items, kappas, regimes, drift = {}, {"text": setup.probe_texts, "observed": observed.tolist(),
                                               "pretrained_norm": setup.pretrained_norm.tolist()}, {}, {}, {}
    for k, (name, law) in enumerate(laws.items()):
        pred = law.predictions(cfg.lr, cfg.weight_decay)
        prefix = "" if len(laws) == 1 else f"{name}_"
        for j, (key, label) in enumerate((("full", "full_law"), ("heat", "heat_only_law"),
                                          ("last_full", "last_checkpoint_full_law"),
                                          ("last_heat", "last_checkpoint_heat_only_law"))):
            fits[prefix + label] = loglog_fit_ci(pred[key], observed, cfg.n_boot, cfg.seed + 11 + 4 * k + j)
            items[f"{prefix}predicted_{key}"] = pred[key].tolist()
        avg = law.averages()
        for col in ("D", "Q", "kappa", "kappa_exempt"):
            items[prefix + col] = avg[col].tolist()
        kappas[name] = _kappa_summary(avg["kappa"])
        regimes[name] = law.regime(cfg.lr, cfg.weight_decay)
        heat_scale = np.sqrt(2 * cfg.weight_decay * np.abs(avg["kappa"]) * cfg.lr * avg["Q"])
        stack = np.stack(law.columns["D"])
        drift[name] = {"drift_over_heat_median": float(np.median(np.abs(avg["D"]) / heat_scale)),
                       "drift_negative_fraction": float(np.mean(avg["D"] < 0)),
                       "single_checkpoint_vs_average_r_median":
                           float(np.nanmedian([_pearson(d, avg["D"]) for d in stack]))}
    main = next(iter(laws))
    target = fits[("" if len(laws) == 1 else f"{main}_") + "full_law"]
    met = bool(TARGET["slope"][0] <= target["slope"] <= TARGET["slope"][1]
               and target["pearson_r"] >= TARGET["pearson_r"])
    decayed, exempt = groups
    summary = {
        "experiment": "E2 equilibrium law on a real pretrained text encoder",
        "protocol_name": cfg.protocol,
        "model": "all-MiniLM-L6-v2, last layer trained, mean pooling"
                 + (f", linear head {384}->{cfg.head_dim} (no bias), trained" if cfg.head_dim else ""),
        "data": "WordNet 3.0 noun (lemma, gloss) pairs; probe items: lemma strings",
        "config": asdict(cfg),
        "protocol": {
            "objective": f"InfoNCE, temperature {cfg.temperature}, in-batch negatives, both sides "
                         "through the same encoder, dropout off",
            "optimizer": "torch.optim.SGD (no momentum); weight decay " + (
                f"exempt for names matching {cfg.no_decay!r} (the same exemption in the engine)"
                if cfg.no_decay else "on every trained parameter"),
            "trained_parameters": f"{cfg.trained} ({sum(p.numel() for p in decayed + exempt)} values, "
                                  f"{sum(p.numel() for p in decayed)} decayed)",
            "probes": {name: {"params": p, "mode": m} for name, (p, m) in probes_of(cfg).items()},
            "eta_times_lambda": cfg.lr * cfg.weight_decay,
            "equilibration_steps": 1.0 / (cfg.lr * cfg.weight_decay),
            "equilibration_times_before_window": rec.window_start * cfg.lr * cfg.weight_decay,
            "window_steps": [rec.window_start, cfg.steps],
            "records": len(rec.window_norms),
            "checkpoints": laws[main].n,
            "drift_batches": cfg.drift_batches,
            "probe_seed_of_checkpoint_i": f"{cfg.seed} * 7919 + i",
            "bootstrap": f"{cfg.n_boot} resamples of probe items, percentile 95% intervals",
            "full_run": PROTOCOL_FULL if cfg.protocol in ("A", "B") else None,
        },
        "pilot": pilot_record,
        "health": {**checks, "criteria": HealthThresholds().criteria_text()},
        "n_pairs": len(setup.pair_ids),
        "n_texts_cached": len(setup.texts),
        "n_probe_items": len(setup.probe_ids),
        "cache_check_max_abs_diff": setup.cache_max_abs_diff,
        "fits": fits,
        "main_predictor": main,
        "target": {**TARGET, "met": met, "predictor": f"{main} full law, trajectory average"},
        "paper": PAPER,
        "kappa": kappas[main],
        "kappas": kappas,
        "regime": regimes,
        "drift": drift,
        "drift_over_heat_median": drift[main]["drift_over_heat_median"],
        "observed_norm": {"min": float(observed.min()), "median": float(np.median(observed)),
                          "max": float(observed.max())},
        "pretrained_norm_median": float(np.median(setup.pretrained_norm)),
        "pretrained_vs_observed_loglog_r": _pearson(np.log(setup.pretrained_norm), np.log(observed)),
        "loss_mean_first_100": float(np.mean(rec.losses[:100])),
        "loss_mean_last_500": float(np.mean(rec.losses[-500:])),
        "loss_chance": float(np.log(cfg.batch_size)),
        "trajectory": rec.trajectory,
        "seconds": {**setup.seconds, "train": round(rec.seconds, 1), "probe": round(phase["seconds"], 1),
                    "total": round(time.perf_counter() - t_start + earlier[0]
                                   + sum(g["setup_seconds"] for g in log.segments[:-1]), 1)},
        "cpu_seconds": {"train": round(rec.cpu_seconds, 1), "probe": round(phase["cpu_seconds"], 1),
                        "total": round(time.process_time() - c_start + earlier[1] + phase["worker_cpu_seconds"]
                                       + sum(g["setup_cpu_seconds"] for g in log.segments[:-1]), 1)},
        "segments": [{**g, **t} for g, t in zip(log.segments, rec.segments)],
        "load_average_at_end": list(os.getloadavg()),
        "torch_threads": torch.get_num_threads(),
        "probe_workers": phase["workers"],
        "items": items,
    }
    from normfast.engine.provenance import library_versions as _library_versions

    summary["versions"] = _library_versions()
    snapshots.remove()
    if resume is not None:
        resume.path.unlink(missing_ok=True)
    if pilot_record is not None and pilot_record.get("chosen") is not None:
        ch = pilot_record["chosen"]
        summary["pilot_choice_used"] = bool(ch["lr"] == cfg.lr and ch["weight_decay"] == cfg.weight_decay
                                            and ch.get("steps", cfg.steps) == cfg.steps)
    if out is not None:
        from normfast.data.io import json_ready

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        stem = result_stem(cfg.protocol)
        (out / f"{stem}.json").write_text(json.dumps(json_ready(summary), indent=1))
        plot(summary, out / f"{stem}.png")
    return summary


def run_pilot(cfg: E2Config, n_probes: int = 200, progress: bool = True, setup: Setup | None = None,
              candidates: Sequence[dict[str, Any]] = PILOT_CANDIDATES) -> dict[str, Any]:
    """A's or B's pilot: ``candidates`` (default :data:`PILOT_CANDIDATES`) in order, health only
    (no probe, no fit). At the quick size every candidate runs ``cfg.steps`` steps."""
    cfg.validate()  # the pilot never runs the engine
    t0, c0 = time.perf_counter(), time.process_time()
    setup = setup or build_setup(cfg, progress=progress)
    quick = cfg.steps < 1000
    candidates = [dict(c, steps=cfg.steps) if quick else dict(c) for c in candidates]
    record = pilot(setup.encoder, setup.pair_ids, setup.probe_ids[:n_probes], cfg.settings(),
                   candidates, trained=cfg.trained, no_decay=cfg.no_decay, progress=progress,
                   desc=f"E2 {cfg.protocol} pilot")
    record.update(protocol=cfg.protocol, history=list(HISTORY),
                  seconds={**setup.seconds, "total": round(time.perf_counter() - t0, 1)},
                  cpu_seconds={"total": round(time.process_time() - c0, 1)},
                  load_average_at_end=list(os.getloadavg()), torch_threads=torch.get_num_threads())
    return record


def pilot_candidates(protocol: str, out: Path) -> tuple[dict[str, Any], ...]:
    """A: every candidate; B: from the one A's pilot (in ``out``) chose, all when it chose none."""
    if protocol != "B":
        return PILOT_CANDIDATES
    chosen = (_read_json(out / f"{result_stem('A')}.json").get("pilot") or {}).get("chosen")
    start = next((i for i, c in enumerate(PILOT_CANDIDATES) if c == chosen), 0)
    return PILOT_CANDIDATES[start:]


def result_stem(protocol: str) -> str:
    """File name (without suffix) of a protocol's results."""
    return "e2_real_encoder" if protocol == "v3" else f"e2_real_encoder_{protocol}"


# ----------------------------------------------------------------------------
# figure and printout
# ----------------------------------------------------------------------------
def plot(summary: dict[str, Any], path: str | Path) -> None:
    """Observed vs predicted norms (log-log) per probe, trajectory average and last checkpoint, and
    the training health."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    items, fits = summary["items"], summary["fits"]
    obs = np.asarray(items["observed"])
    names = list(summary["protocol"]["probes"]) if "probes" in summary["protocol"] else ["jvp"]
    panels = []
    for name in names:
        p = "" if len(names) == 1 else f"{name}_"
        tag = "" if len(names) == 1 else f"{name} mode: "
        panels.append((f"{tag}trajectory-averaged D, Q, κ", p, ("full", "full_law"), ("heat", "heat_only_law")))
        panels.append((f"{tag}last checkpoint alone", p, ("last_full", "last_checkpoint_full_law"),
                       ("last_heat", "last_checkpoint_heat_only_law")))
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5 * (len(panels) + 1), 4.8))
    for ax, (title, p, full, heat) in zip(axes, panels):
        values = [obs]
        for (key, fit_key), color, label in ((full, "tab:blue", "full law"), (heat, "tab:orange", "heat-only")):
            pred = np.asarray(items[f"{p}predicted_{key}"], dtype=float)
            f = fits[p + fit_key]
            ax.loglog(pred, obs, ".", ms=3, alpha=0.6, color=color,
                      label=f"{label}: slope {f['slope']:.2f}, r {f['pearson_r']:.3f}")
            values.append(pred[np.isfinite(pred) & (pred > 0)])
        lo = min(float(np.min(v)) for v in values if v.size)
        hi = max(float(np.max(v)) for v in values if v.size)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="y = x")
        ax.set_title(title, fontsize=10)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("predicted R_eq")
        ax.set_ylabel("observed stationary norm (window mean)")
        ax.legend(fontsize=7, loc="upper left")
    ax = axes[-1]
    traj = summary["trajectory"]
    steps = [t["step"] for t in traj]
    ax.plot(steps, [t["loss_mean"] for t in traj], color="tab:red", label="loss (100-step mean)")
    ax.axhline(summary["loss_chance"], color="tab:red", ls=":", lw=0.8, label="chance ln(batch)")
    ax.plot(steps, [t["norm_median"] for t in traj], color="tab:blue", label="median probe norm")
    ax.plot(steps, [t["mean_cosine"] for t in traj], color="tab:green", label="mean pairwise cosine")
    w0 = np.asarray([t["decayed_weight_norm"] for t in traj])
    ax.plot(steps, w0 / w0[0], color="tab:purple", label="decayed weight norm / initial")
    start, stop = summary["protocol"]["window_steps"]
    ax.axvspan(start, stop, color="0.9", zorder=0, label="window")
    ax.set_xlabel("step")
    ax.set_title("training health", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    cfg, h = summary["config"], summary["health"]
    regime = summary.get("regime", {}).get(names[0], {})
    fig.suptitle(f"E2 ({cfg['protocol']}): {summary['model']}; SGD η={cfg['lr']} λ={cfg['weight_decay']} "
                 f"(decay exempt: {cfg['no_decay']}), {summary['n_probe_items']} WordNet lemmas, "
                 f"{summary['protocol']['checkpoints']} checkpoints × M={cfg['M']}\nregime check: "
                 f"{regime.get('regime', 'n/a')} ({regime.get('reason', '')}); health criteria "
                 f"{'met' if h['passed'] else 'NOT met'} (max mean cosine {h['max_mean_cosine']:.3f}, "
                 f"norm change between halves "
                 f"{h.get('norm_change_between_window_halves_median', np.nan):.3f})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _health_line(h: dict[str, Any]) -> str:
    return (f"loss ok {h['loss_below_chance']}, no collapse {h['no_collapse']} (max cosine "
            f"{h['max_mean_cosine']:.3f}), stationary {h['stationary']} (norm change "
            f"{h.get('norm_change_between_window_halves_median', float('nan')):.4f}, weight change "
            f"{h.get('decayed_weight_norm_change_between_window_halves', float('nan')):.4f})")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocol", choices=PROTOCOLS, default="A",
                   help="A (everything decayed, default), B (projection head), v3 (the negative "
                        "control, LayerNorm exempt) or the historical v1/v2")
    p.add_argument("--pilot", action="store_true",
                   help="A/B: run the pilot (health only) and store it under 'pilot' in the JSON")
    p.add_argument("--quick", action="store_true", help="a toy size for the tests")
    p.add_argument("--out", default=str(RUNS),
                   help="output folder (default runs/e2, git-ignored; the committed results: --out bench/results)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", action="store_true",
                   help="a full run keeps its state in runs/e2/state/ and an interrupted one resumes from "
                        "it; --fresh deletes that state first")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    path = out / f"{result_stem(args.protocol)}.json"
    existing = _read_json(path)
    if args.pilot:
        if args.protocol not in ("A", "B"):
            print("e2_real_encoder: --pilot belongs to protocols A and B", file=sys.stderr)
            return 2
        cfg = E2Config.of(args.protocol)
        cfg = replace(cfg.quick() if args.quick else cfg, seed=args.seed)
        candidates = pilot_candidates(args.protocol, out)
        record = run_pilot(cfg, n_probes=min(200, cfg.n_probes), progress=not args.no_progress,
                           candidates=candidates)
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**existing, "pilot": record}, indent=1))
        for r in record["results"]:
            print(f"lr={r['lr']} wd={r['weight_decay']} steps={r['steps']}: {_health_line(r['health'])} -> "
                  f"{'PASS' if r['health']['passed'] else 'fail'}")
        print(f"chosen: {record['chosen']}\nwrote the pilot to {path}")
        return 0
    record = existing.get("pilot") if args.protocol in ("A", "B") else None
    if args.protocol in ("A", "B") and not args.quick and not (record or {}).get("chosen"):
        print(f"e2_real_encoder: protocol {args.protocol} takes η, λ and steps from its pilot; run "
              f"--pilot first (with the same --out)", file=sys.stderr)
        return 2
    cfg = E2Config.of(args.protocol, (record or {}).get("chosen"))
    cfg = replace(cfg.quick() if args.quick else cfg, seed=args.seed)
    resume = None if args.quick else state_path(cfg)
    if resume is not None and args.fresh:
        resume.unlink(missing_ok=True)
        shutil.rmtree(checkpoint_folder(resume), ignore_errors=True)
    if resume is not None and resume.exists():
        print(f"e2_real_encoder: resuming from {resume} (--fresh starts afresh)", file=sys.stderr)
    summary = run(cfg, out=out, progress=not args.no_progress, pilot_record=record, resume=resume)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tables import e2_fits_table  # bench/tables.py: the README's renderer

    print(e2_fits_table(summary))
    print(f"\nhealth: {_health_line(summary['health'])}")
    for name, k in summary["kappas"].items():
        rg = summary["regime"][name]
        print(f"{name}: κ median {k['median']:.3f} [{k['min']:.3f}, {k['max']:.3f}]; regime check: "
              f"{rg['regime']} ({rg['reason']}), {rg['fractions']}")
    print(f"target met: {summary['target']['met']}; seconds {summary['seconds']}; "
          f"cpu seconds {summary['cpu_seconds']}")
    print(f"wrote {out / result_stem(cfg.protocol)}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
