"""E1 AdamW: why the law fails on the real training window but holds on a virtual continuation.

    python -m bench run e1_adamw --out bench/results/e1_adamw                     # seed 0, both AdamW variants
    python -m bench run e1_adamw --seed 1 --out bench/results/e1_adamw/seed1   # the fresh seed
    python -m bench run e1_adamw --quick                                  # toy size: no evidence

On E1's AdamW variants the law fed the dense means along the real training window
(one fresh batch per step) misses (slope / r 0.66 / 0.78 at β1 = 0.9), while the
same law fed the means along a *virtual* continuation of the end-of-training
snapshot (the snapshot candidate `trajectory`, one batch per state) fits
(0.90 / 0.97), against the same observed norms. Both are trajectory averages of
one-batch samples of the same statistics; if the continuation were faithful to
the training, the two would agree. This experiment swaps the ingredients one at a
time to find the one that makes the difference.

Protocol (v1, written down and committed before any run of it was looked at):

Hypotheses (ingredients in which the virtual continuation V and the real window R differ):
  H1 meter batch: V samples each state along the batch the step then takes; R along
     a fresh, independent batch.
  H2 sampler: V draws its batches with the engine's virtual_batches (distinct pairs
     within a batch); R with E1's training sampler (pairs drawn with replacement, so a
     batch can hold a pair twice: a false negative for InfoNCE).
  H3 length: V runs 4 relaxation times (20 000 steps here); R's window is 8 000 steps.
  H4 where: V starts at the end of training and runs beyond it; R is the window before
     it (steps 12 000-20 000), which may not yet be stationary (E1: the AdamW balance
     closes to 7-9% of the decay, SGD's to under 1%).
  H5 optimizer state: V starts AdamW from the snapshot's v̂ with a zero first moment
     and its bias correction spent; R carries the training optimizer's full state.
Runs (each one trajectory of torch's AdamW at E1's settings, measured at every step by
the engine's TrajectoryMeter with the curvature heat, κ every 10 steps):
  V0  end snapshot, v̂-seeded optimizer, 20 000 steps, engine sampler, own batch (= `trajectory`)
  V1  V0 with the meter on a fresh batch                                   (H1)
  V2  V0 with E1's training sampler                                        (H2)
  V3  V0 for 8 000 steps                                                   (H3)
  V4  V0 from the window's first checkpoint for 8 000 steps                (H4, with H3)
  V5  V0 with the training optimizer's own state at the end                (H5)
  R1  every ingredient swapped: the window's first checkpoint, 8 000 steps, E1's sampler,
      fresh meter batches (a second realization of the real window's measurement)
Read-outs per run, each against E1's observed window norms (slope / r): the law without
and with the curvature heat, and the run's own mean norm (is the run's norm like the
real window's?); the median ratio of its mean D_w and Q_w to the real window's dense
means (E1's meter). The real window's dense law (E1's) beside them.
Decision: an ingredient explains the gap when swapping it alone moves V0's law fit
from the target band (slope in [0.85, 1.15], r >= 0.93) to R's miss, or R1 reproduces
the real window's miss while V0 meets the target. Whatever is found, every run is
reported; if no single swap closes the gap the docs say which pair or which run
resists, with the numbers.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from bench.common import fmt
from bench.experiments.e1 import e1_name, e1_setup
from bench.harness import Context, UsageError

RESULTS = ("e1_adamw.json", "seed1/e1_adamw.json")
FIGURES = ()
TABLES = ("e1-adamw",)

#: run -> (start, optimizer state, steps as a multiple of the window, sampler, meter batch)
RUNS = {
    "V0": ("end", "seeded", "long", "engine", "own"),
    "V1": ("end", "seeded", "long", "engine", "fresh"),
    "V2": ("end", "seeded", "long", "e1", "own"),
    "V3": ("end", "seeded", "window", "engine", "own"),
    "V4": ("window_start", "seeded", "window", "engine", "own"),
    "V5": ("end", "training", "long", "engine", "own"),
    "R1": ("window_start", "seeded", "window", "e1", "fresh"),
}


@dataclass
class Config:
    variants: str = field(default="mlp_adamw,mlp_adamw_b0", metadata={"help": "comma-separated AdamW variants"})
    runs: str = field(default=",".join(RUNS), metadata={"help": "comma-separated subset of " + ",".join(RUNS)})
    size: str = field(
        default="full",
        metadata={"choices": ("full", "quick"), "help": "E1's training configuration: E1Config() or its quick()"},
    )
    steps: int | None = field(default=None, metadata={"help": "override E1's training steps"})
    long_steps: int = field(default=20_000, metadata={"help": "the long runs' steps (V's 4 relaxation times)"})
    seed: int = 0

    @classmethod
    def quick(cls) -> "Config":
        return cls(variants="mlp_adamw", runs="V0,R1", size="quick", steps=500, long_steps=300)


def walk(
    run, cfg, data, *, start: str, state: str, steps: int, sampler: str, meter_batch: str, seed: int, progress: bool
) -> dict[str, Any]:
    """One trajectory of torch's AdamW at E1's settings, measured at every step by the engine's meter."""
    import torch
    from tqdm.auto import tqdm

    from bench.experiments.e1.data import probe_config, variant_optimizer
    from bench.experiments.e1.training import load_checkpoint
    from normfast import InfoNCE, virtual_batches
    from normfast.engine.directions import adam_second_moments
    from normfast.engine.trajectory import TrajectoryMeter, start_adam

    variant = run.variant
    enc = copy.deepcopy(run.encoder)
    names = [n for n, _ in enc.named_parameters()]
    opt = variant_optimizer(variant, cfg, enc.parameters())
    if state == "training":  # the training optimizer's own state at the end of training
        opt.load_state_dict(run.optimizer.state_dict())
    else:  # the engine's way: the snapshot's v̂, a zero first moment
        if start == "window_start":
            load_checkpoint(enc, run.checkpoints[0])
            v = run.checkpoints[0].second_moments
        else:
            v = adam_second_moments(run.optimizer, run.encoder)  # run.encoder is the end state
        start_adam(opt, enc, names, v)
    n_items = data.x.shape[0]
    items = list(range(n_items))
    meter = TrajectoryMeter(
        enc, items, probe_config(variant, cfg, n_items, batches=cfg.M, drift_batches=cfg.drift_batches), curvature=True
    )
    objective = InfoNCE(temperature=cfg.temperature)
    pairs_t = torch.as_tensor(data.pairs)
    rng = np.random.default_rng(seed)
    engine_batches = iter(virtual_batches(len(pairs_t), 2 * steps, cfg.batch_size, seed))

    def draw() -> torch.Tensor:
        if sampler == "e1":
            return torch.as_tensor(rng.integers(0, len(pairs_t), cfg.batch_size))
        return torch.as_tensor(next(engine_batches))

    def loss_of(idx: torch.Tensor) -> torch.Tensor:
        return objective.loss(enc(enc.prepare(pairs_t[idx, 0].tolist())), enc(enc.prepare(pairs_t[idx, 1].tolist())))

    params = list(enc.parameters())
    state_all = enc.prepare(items)
    norms = []
    for step in tqdm(
        range(steps), desc=f"{variant.name}: {start}/{state}/{sampler}/{meter_batch}", disable=not progress, leave=False
    ):
        loss = loss_of(draw())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if meter_batch == "own":
            grads = {n: p.grad for n, p in zip(names, params)}
        else:
            grads = dict(zip(names, torch.autograd.grad(loss_of(draw()), params)))
        meter.add(meter.direction(grads, adam_second_moments(opt, enc)), kappa=step % 10 == 0)
        opt.step()
        if step % cfg.record_every == 0:
            with torch.no_grad():
                norms.append(enc(state_all).norm(dim=-1).double())
    stats = meter.statistics()
    stats["mean_norm"] = torch.stack(norms).mean(0).numpy()
    return stats


def run_variant(name: str, cfg, data, config: Config, progress: bool) -> dict[str, Any]:
    from bench.experiments.e1.data import VARIANT_SPECS
    from bench.experiments.e1.laws import law_norms
    from bench.experiments.e1.training import train, window_start
    from normfast.core.stats import loglog_fit

    variant = VARIANT_SPECS[name]
    t0 = time.perf_counter()
    run = train(variant, cfg, data, meter=False, progress=progress)  # R: the fresh-batch meter
    observed = run.observed
    window = cfg.steps - window_start(cfg)

    def fits(s: dict[str, Any]) -> dict[str, Any]:
        corrected = dict(s, Q_w=s["Q_w"] + s["Q_curv_w"])
        return {
            "law": loglog_fit(law_norms(variant, s, cfg), observed),
            "law_with_curvature": loglog_fit(law_norms(variant, corrected, cfg), observed),
        }

    dense = run.meter_fresh
    out = {
        "variant": name,
        "beta1": variant.beta1,
        "window_steps": window,
        "real_window": dict(fits(dense), seconds=round(time.perf_counter() - t0, 1)),
        "runs": {},
    }
    for k, key in enumerate(r.strip() for r in config.runs.split(",")):
        start, state, length, sampler, meter_batch = RUNS[key]
        t1 = time.perf_counter()
        steps = config.long_steps if length == "long" else window
        s = walk(
            run,
            cfg,
            data,
            start=start,
            state=state,
            steps=steps,
            sampler=sampler,
            meter_batch=meter_batch,
            seed=cfg.seed * 7919 + 1000 + k,
            progress=progress,
        )
        out["runs"][key] = dict(
            fits(s),
            ingredients={
                "start": start,
                "optimizer_state": state,
                "steps": steps,
                "sampler": sampler,
                "meter_batch": meter_batch,
            },
            own_mean_norm=loglog_fit(s["mean_norm"], observed),
            own_mean_norm_over_observed_median=float(np.median(s["mean_norm"] / observed)),
            D_w_over_real_median=float(np.median(s["D_w"] / dense["D_w"])),
            D_w_vs_real_r=float(np.corrcoef(s["D_w"], dense["D_w"])[0, 1]),
            Q_w_over_real_median=float(np.median(s["Q_w"] / dense["Q_w"])),
            seconds=round(time.perf_counter() - t1, 1),
        )
    return out


def run(config: Config, ctx: Context) -> dict[str, Any]:
    from bench.experiments.e1.data import VARIANT_SPECS

    variants = [v.strip() for v in config.variants.split(",") if v.strip()]
    wrong = [v for v in variants if v not in VARIANT_SPECS or VARIANT_SPECS[v].optimizer != "adamw"]
    bad_runs = [r for r in config.runs.split(",") if r.strip() not in RUNS]
    if wrong or bad_runs:
        raise UsageError(
            f"e1_adamw: expected AdamW variants (mlp_adamw, mlp_adamw_b0) and runs from "
            f"{', '.join(RUNS)}, got variants {wrong} and runs {bad_runs}"
        )
    cfg, data = e1_setup(config.size, config.seed, config.steps)
    return {
        "config": asdict(config),
        "protocol": __doc__.split("Protocol")[1].strip(),
        "results": [run_variant(v, cfg, data, config, ctx.progress) for v in variants],
    }


def tables(result: dict[str, Any]) -> dict[str, str]:
    """The table for this run alone."""
    return {"e1-adamw": table_adamw([(str(result["config"]["seed"]), result)])}


def blocks(load) -> dict[str, str | None]:
    """The committed runs, seed 0 and the fresh seed 1, in one table."""
    runs = [(seed, d) for seed, path in (("0", RESULTS[0]), ("1 (fresh)", RESULTS[1])) if (d := load(path))]
    return {"e1-adamw": table_adamw(runs) if runs else None}


def table_adamw(runs: list[tuple[str, dict[str, Any]]]) -> str:
    rows = [
        "| seed | E1 variant | run | start | optimizer state | steps | sampler | meter batch | law (slope / r) | "
        "law + curvature | run's own mean norm | D_w / real (median, r) | Q_w / real |",
        "|---" * 13 + "|",
    ]
    for seed, d in runs:
        for r in d["results"]:
            rw = r["real_window"]
            rows.append(
                f"| {seed} | {e1_name(r)} | real window (E1) | window | training | {r['window_steps']} | E1 | "
                f"fresh | {fmt(rw['law']['slope'])} / {fmt(rw['law']['pearson_r'])} | "
                f"{fmt(rw['law_with_curvature']['slope'])} / {fmt(rw['law_with_curvature']['pearson_r'])} "
                f"| (the observed norms) | 1 | 1 |"
            )
            for key, x in r["runs"].items():
                i = x["ingredients"]
                rows.append(
                    f"| {seed} | {e1_name(r)} | {key} | {i['start'].replace('_', ' ')} | "
                    f"{i['optimizer_state']} | {i['steps']} | {i['sampler']} | {i['meter_batch']} | "
                    f"{fmt(x['law']['slope'])} / {fmt(x['law']['pearson_r'])} | "
                    f"{fmt(x['law_with_curvature']['slope'])} / {fmt(x['law_with_curvature']['pearson_r'])} | "
                    f"{fmt(x['own_mean_norm']['slope'])} / {fmt(x['own_mean_norm']['pearson_r'])} | "
                    f"{fmt(x['D_w_over_real_median'])}, {fmt(x['D_w_vs_real_r'])} | "
                    f"{fmt(x['Q_w_over_real_median'])} |"
                )
    return "\n".join(rows)
