"""E2's run: the data and the cached-front encoder, training, the checkpoints' probes, the fits; the pilot."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from bench.harness import read_json

from .settings import (
    HEAD,
    HISTORY,
    PAPER,
    PILOT_CANDIDATES,
    PROTOCOL_FULL,
    TARGET,
    E2Config,
    checkpoint_folder,
    result_stem,
)

if TYPE_CHECKING:
    from normfast.encoders import CachedFrontEncoder


# ----------------------------------------------------------------------------
# data and model
# ----------------------------------------------------------------------------
@dataclass
class Setup:
    """The pool as cache indices, the probe items, and the cached-front encoder."""

    texts: list[str]
    pair_ids: np.ndarray  # [n_pairs, 2] cache indices (lemma, gloss)
    probe_ids: list[int]
    probe_texts: list[str]
    encoder: CachedFrontEncoder
    pretrained_norm: np.ndarray
    cache_max_abs_diff: float
    seconds: dict[str, float]


def build_setup(cfg: E2Config, progress: bool = True) -> Setup:
    """Draw the data, load all-MiniLM-L6-v2 (+ B's head) and cache its front for every text."""
    import torch

    from normfast import load_encoder
    from normfast.data.wordnet import wordnet_gloss_pairs
    from normfast.encoders import CachedFrontEncoder, DenseLayer, HFEncoder

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
        base = HFEncoder(
            base.model,
            base.tokenizer,
            pooling="mean",
            dense=[head],
            max_length=base.max_length,
            lowercase=base.lowercase,
        ).eval()
    enc = CachedFrontEncoder(base, texts, cut=cfg.layer + 1, progress=progress).eval()
    cache_seconds = time.perf_counter() - t0
    check = probe_ids[:32] + [int(i) for i in pair_ids[:32, 1]]
    with torch.no_grad():  # the cached tail must reproduce the full encoder
        full = base.encode([texts[i] for i in check])
        cached = enc.encode(check)
        pretrained_norm = enc.encode(probe_ids).norm(dim=-1).double().numpy()
    return Setup(
        texts,
        pair_ids,
        probe_ids,
        list(probe_texts),
        enc,
        pretrained_norm,
        float((full - cached).abs().max()),
        {"data": round(data_seconds, 1), "cache_front": round(cache_seconds, 1)},
    )


def _probe_fn(setup: Setup, cfg: E2Config, params: str, mode: str):
    """``seed -> ProbeResult``: one engine run over the probe lemmas at the current parameters."""
    from bench.common import PLAIN_HEAT
    from normfast import InfoNCE, PairSource, ProbeConfig, probe

    objective = InfoNCE(temperature=cfg.temperature)
    pairs = PairSource.from_iterable([(int(a), int(b)) for a, b in setup.pair_ids])
    # v1-v3 predate the drift from the mean direction: drift_batches=None keeps their estimator
    pcfg = ProbeConfig(
        params=params,
        mode=mode,
        output="pooled",
        optimizer="sgd",
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        no_decay=cfg.no_decay,
        batches=cfg.M,
        drift_batches=cfg.drift_batches,
        batch_size=cfg.batch_size,
        chunk_size=len(setup.probe_ids),
        **PLAIN_HEAT,  # E2's committed results predate the heat drawn by energy (bench.common.PLAIN_HEAT)
    )
    name = f"all-MiniLM-L6-v2 E2 {cfg.protocol} ({mode}, {params})"

    def run(seed: int):
        res = probe(
            setup.encoder, setup.probe_ids, objective, pairs, replace(pcfg, seed=seed), progress=False, model_name=name
        )
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
def _kappa_summary(kappa: np.ndarray) -> dict[str, float]:
    p10, p50, p90 = np.percentile(kappa, [10, 50, 90])
    return {
        "min": float(np.min(kappa)),
        "p10": float(p10),
        "median": float(p50),
        "p90": float(p90),
        "max": float(np.max(kappa)),
        "negative_fraction": float(np.mean(kappa <= 0)),
    }


class SegmentLog:
    """The setup time of every process that ran part of a resumed run (a :class:`Resume` part)."""

    def __init__(self) -> None:
        self.segments: list[dict[str, Any]] = []

    def state_dict(self) -> list[dict[str, Any]]:
        return list(self.segments)

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        self.segments = list(state) + self.segments[-1:]  # the earlier ones, then this process's


def run_protocol(
    cfg: E2Config,
    progress: bool = True,
    pilot_record: dict[str, Any] | None = None,
    setup: Setup | None = None,
    resume: str | Path | None = None,
) -> dict[str, Any]:
    """Run E2 with ``cfg``; return the summary.

    ``setup`` (from :func:`build_setup` with the same data settings) skips building one.
    ``resume``: a state file; the run saves its state there as it goes and, when the
    file exists, continues from it (an interrupted run loses at most one checkpoint).
    """
    cfg.validate()
    with tempfile.TemporaryDirectory(prefix="normfast-e2-") as scratch:  # the snapshots without resume
        return _run(cfg, progress, pilot_record, setup, resume, Path(scratch))


def _run(
    cfg: E2Config,
    progress: bool,
    pilot_record: dict[str, Any] | None,
    setup: Setup | None,
    resume_path: str | Path | None,
    scratch: Path,
) -> dict[str, Any]:
    import torch

    from bench.training import (
        CheckpointLaw,
        CheckpointSnapshots,
        HealthThresholds,
        Resume,
        health,
        probe_checkpoints,
        split_decay,
        train,
    )
    from normfast.core.stats import correlation, loglog_fit_ci
    from normfast.engine.runner import library_versions

    t_start, c_start = time.perf_counter(), time.process_time()
    setup = setup or build_setup(cfg, progress=progress)
    laws = {
        name: CheckpointLaw(_probe_fn(setup, cfg, params, mode), cfg.seed)
        for name, (params, mode) in probes_of(cfg).items()
    }
    settings = cfg.settings()
    groups = split_decay(setup.encoder, cfg.trained, cfg.no_decay)
    log = SegmentLog()
    log.segments.append(
        {
            "setup_seconds": round(time.perf_counter() - t_start, 1),
            "setup_cpu_seconds": round(time.process_time() - c_start, 1),
        }
    )
    identity = {"config": asdict(cfg), "n_texts": len(setup.texts)}
    folder = checkpoint_folder(resume_path) if resume_path is not None else scratch / "checkpoints"
    snapshots = CheckpointSnapshots([*groups[0], *groups[1]], folder, identity)
    # kept until the checkpoints are probed: a run interrupted while probing resumes there
    resume = (
        None
        if resume_path is None
        else Resume(Path(resume_path), parts={"segments": log}, identity=identity, keep=True)
    )
    t_loop, c_loop = time.perf_counter(), time.process_time()
    rec = train(
        setup.encoder,
        setup.pair_ids,
        setup.probe_ids,
        settings,
        groups,
        on_checkpoint=snapshots,
        progress=progress,
        desc=f"E2 {cfg.protocol}: train",
        resume=resume,
    )
    # the loop's time in earlier processes of a resumed run (0 for a run in one go)
    earlier = (rec.loop_seconds - (time.perf_counter() - t_loop), rec.loop_cpu_seconds - (time.process_time() - c_loop))
    phase = probe_checkpoints(laws, snapshots, progress=progress, desc=f"E2 {cfg.protocol}: probe checkpoints")
    checks = health(rec, settings)
    observed = np.stack(rec.window_norms).mean(0)
    fits, items, kappas, regimes, drift = (
        {},
        {"text": setup.probe_texts, "observed": observed.tolist(), "pretrained_norm": setup.pretrained_norm.tolist()},
        {},
        {},
        {},
    )
    for k, (name, law) in enumerate(laws.items()):
        pred = law.predictions(cfg.lr, cfg.weight_decay)
        prefix = "" if len(laws) == 1 else f"{name}_"
        for j, (key, label) in enumerate(
            (
                ("full", "full_law"),
                ("heat", "heat_only_law"),
                ("last_full", "last_checkpoint_full_law"),
                ("last_heat", "last_checkpoint_heat_only_law"),
            )
        ):
            fits[prefix + label] = loglog_fit_ci(pred[key], observed, cfg.n_boot, cfg.seed + 11 + 4 * k + j)
            items[f"{prefix}predicted_{key}"] = pred[key].tolist()
        avg = law.averages()
        for col in ("D", "Q", "kappa", "kappa_exempt"):
            items[prefix + col] = avg[col].tolist()
        kappas[name] = _kappa_summary(avg["kappa"])
        regimes[name] = law.regime(cfg.lr, cfg.weight_decay)
        heat_scale = np.sqrt(2 * cfg.weight_decay * np.abs(avg["kappa"]) * cfg.lr * avg["Q"])
        stack = np.stack(law.columns["D"])
        drift[name] = {
            "drift_over_heat_median": float(np.median(np.abs(avg["D"]) / heat_scale)),
            "drift_negative_fraction": float(np.mean(avg["D"] < 0)),
            "single_checkpoint_vs_average_r_median": float(
                np.nanmedian([correlation(d, avg["D"], "pearson") for d in stack])
            ),
        }
    main = next(iter(laws))
    target = fits[("" if len(laws) == 1 else f"{main}_") + "full_law"]
    met = bool(
        TARGET["slope"][0] <= target["slope"] <= TARGET["slope"][1] and target["pearson_r"] >= TARGET["pearson_r"]
    )
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
            "optimizer": "torch.optim.SGD (no momentum); weight decay "
            + (
                f"exempt for names matching {cfg.no_decay!r} (the same exemption in the engine)"
                if cfg.no_decay
                else "on every trained parameter"
            ),
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
        "observed_norm": {
            "min": float(observed.min()),
            "median": float(np.median(observed)),
            "max": float(observed.max()),
        },
        "pretrained_norm_median": float(np.median(setup.pretrained_norm)),
        "pretrained_vs_observed_loglog_r": correlation(np.log(setup.pretrained_norm), np.log(observed), "pearson"),
        "loss_mean_first_100": float(np.mean(rec.losses[:100])),
        "loss_mean_last_500": float(np.mean(rec.losses[-500:])),
        "loss_chance": float(np.log(cfg.batch_size)),
        "trajectory": rec.trajectory,
        "seconds": {
            **setup.seconds,
            "train": round(rec.seconds, 1),
            "probe": round(phase["seconds"], 1),
            "total": round(
                time.perf_counter() - t_start + earlier[0] + sum(g["setup_seconds"] for g in log.segments[:-1]), 1
            ),
        },
        "cpu_seconds": {
            "train": round(rec.cpu_seconds, 1),
            "probe": round(phase["cpu_seconds"], 1),
            "total": round(
                time.process_time()
                - c_start
                + earlier[1]
                + phase["worker_cpu_seconds"]
                + sum(g["setup_cpu_seconds"] for g in log.segments[:-1]),
                1,
            ),
        },
        "segments": [{**g, **t} for g, t in zip(log.segments, rec.segments)],
        "load_average_at_end": list(os.getloadavg()),
        "torch_threads": torch.get_num_threads(),
        "probe_workers": phase["workers"],
        "items": items,
    }
    summary["versions"] = library_versions()
    snapshots.remove()
    if resume is not None:
        resume.path.unlink(missing_ok=True)
    if pilot_record is not None and pilot_record.get("chosen") is not None:
        ch = pilot_record["chosen"]
        summary["pilot_choice_used"] = bool(
            ch["lr"] == cfg.lr and ch["weight_decay"] == cfg.weight_decay and ch.get("steps", cfg.steps) == cfg.steps
        )
    return summary


def run_pilot(
    cfg: E2Config,
    n_probes: int = 200,
    progress: bool = True,
    setup: Setup | None = None,
    candidates: Sequence[dict[str, Any]] = PILOT_CANDIDATES,
) -> dict[str, Any]:
    """A's or B's pilot: ``candidates`` (default :data:`PILOT_CANDIDATES`) in order, health only
    (no probe, no fit). At the quick size every candidate runs ``cfg.steps`` steps."""
    import torch

    from bench.training import pilot

    cfg.validate()  # the pilot never runs the engine
    t0, c0 = time.perf_counter(), time.process_time()
    setup = setup or build_setup(cfg, progress=progress)
    quick = cfg.steps < 1000
    candidates = [dict(c, steps=cfg.steps) if quick else dict(c) for c in candidates]
    record = pilot(
        setup.encoder,
        setup.pair_ids,
        setup.probe_ids[:n_probes],
        cfg.settings(),
        candidates,
        trained=cfg.trained,
        no_decay=cfg.no_decay,
        progress=progress,
        desc=f"E2 {cfg.protocol} pilot",
    )
    record.update(
        protocol=cfg.protocol,
        history=list(HISTORY),
        seconds={**setup.seconds, "total": round(time.perf_counter() - t0, 1)},
        cpu_seconds={"total": round(time.process_time() - c0, 1)},
        load_average_at_end=list(os.getloadavg()),
        torch_threads=torch.get_num_threads(),
    )
    return record


def pilot_candidates(protocol: str, out: Path) -> tuple[dict[str, Any], ...]:
    """A: every candidate; B: from the one A's pilot (in ``out``) chose, all when it chose none."""
    if protocol != "B":
        return PILOT_CANDIDATES
    chosen = (read_json(out / f"{result_stem('A')}.json").get("pilot") or {}).get("chosen")
    start = next((i for i, c in enumerate(PILOT_CANDIDATES) if c == chosen), 0)
    return PILOT_CANDIDATES[start:]
