"""E2: the equilibrium law on a real pretrained text encoder (all-MiniLM-L6-v2).

    python -m bench run e2 --protocol A --pilot     # health only: choose η, λ, steps
    python -m bench run e2 --protocol A             # the full run with the chosen settings
    python -m bench run e2 --protocol B [--pilot]   # the projection-head regime
    python -m bench run e2 --quick --protocol B     # a toy size that only exercises the code

Output goes to ``runs/e2`` unless ``--out`` says otherwise; the committed
results in ``bench/results`` change only with an explicit ``--out bench/results/e2``.
A full run keeps its state in ``runs/e2/state/`` (:class:`bench.training.Resume`,
and the checkpoints' parameter snapshots and probe results beside it): started
again with the same settings after an interruption, it goes on from its last
checkpoint, or with the checkpoints not yet probed, and gives the result an
uninterrupted run gives (``--fresh`` deletes the state first).

The pretrained sentence encoder (real weights, loaded offline) is fine-tuned
with plain SGD + weight decay on real text pairs until its embedding norms are
stationary; the engine's prediction of each probe item's equilibrium norm is
then compared with the norm the item actually keeps. The training, the health
criteria, the pilot and the checkpoint averaging are
:mod:`bench.training`; the statistics are :func:`normfast.probe`'s.

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
probe lemmas, seed 0. Criteria (:class:`bench.training.HealthThresholds`):
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
per thread (:func:`bench.training.probe_checkpoints`), which gives what
probing during training gives (the same parameters and seeds). The engine takes
one direction per forward-mode pass on the cached front
(``CachedFrontEncoder.batched_directions``): batching the directions with vmap
does not get the length groups' saving and was 1.9x slower here. v3, A and B's
first full run probed during training on one thread (27 to 82 minutes).

The paper this project tests reports slope 0.88, r = 0.97 for a fine-tuned
DistilBERT; that figure is stored in the JSON next to ours. ``--quick`` runs the
same code at a toy size (used by the tests); its numbers are not a result.

Layout: :mod:`.settings` (the protocols' settings, :class:`E2Config`),
:mod:`.protocol` (the run and the pilot), :mod:`.report` (figure and tables).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from bench.common import offline
from bench.harness import Context, JsonStyle, UsageError, read_json

from .protocol import Setup, build_setup, pilot_candidates, probes_of, run_pilot, run_protocol
from .render import e2_fits_table, health_line, plot, table_e2
from .settings import (
    PILOT_CANDIDATES,
    PROTOCOL_FULL,
    PROTOCOLS,
    RUNS,
    E2Config,
    checkpoint_folder,
    result_stem,
    state_path,
)

__all__ = [
    "Config",
    "E2Config",
    "PILOT_CANDIDATES",
    "PROTOCOL_FULL",
    "RUNS",
    "Setup",
    "build_setup",
    "pilot_candidates",
    "probes_of",
    "run",
    "run_pilot",
    "run_protocol",
]

RESULTS = ("e2_real_encoder_A.json", "e2_real_encoder_B.json", "e2_real_encoder.json", "e2_real_encoder_v2.json")
FIGURES = ("e2_real_encoder_A.png", "e2_real_encoder_B.png", "e2_real_encoder.png", "e2_real_encoder_v2.png")
TABLES = ("e2",)
#: fields of the committed quick run that rounding alone moves on another CPU path (bench.harness.differences):
#: the cached front's largest difference from the full encoder is itself a rounding error, and a
#: bootstrap percentile jumps to a neighbouring resample when the values move in their last bits
QUICK_TOLERANCE: dict[str, float | None] = {"/cache_check_max_abs_diff": None, "*_ci95*": 2e-2}
#: as the committed runs were written
JSON = JsonStyle(newline=False)


@dataclass
class Config:
    protocol: str = field(
        default="A",
        metadata={
            "choices": PROTOCOLS,
            "help": "A (everything decayed), B (projection head), v3 (the negative control, "
            "LayerNorm exempt) or the historical v1/v2",
        },
    )
    pilot: bool = field(
        default=False, metadata={"help": "A/B: run the pilot (health only) and store it under 'pilot' in the JSON"}
    )
    fresh: bool = field(
        default=False,
        metadata={
            "help": "a full run keeps its state in runs/e2/state/ and an interrupted one resumes from it; "
            "--fresh deletes that state first"
        },
    )
    size: str = field(
        default="full",
        metadata={"choices": ("full", "quick"), "help": "the protocol's sizes, or E2Config.quick()'s toy sizes"},
    )
    threads: int = field(default=0, metadata={"help": "torch threads (0: torch's own count, every core)"})
    seed: int = 0

    @classmethod
    def quick(cls) -> "Config":
        return cls(size="quick")

    def validate(self) -> None:
        if self.pilot and self.protocol not in ("A", "B"):
            raise ValueError("e2: --pilot belongs to protocols A and B")


def result_name(config: Config) -> str:
    return f"{result_stem(config.protocol)}.json"


def _settings(config: Config, chosen: dict[str, Any] | None) -> E2Config:
    cfg = E2Config.of(config.protocol, chosen)
    return replace(cfg.quick() if config.size == "quick" else cfg, seed=config.seed)


def run(config: Config, ctx: Context) -> dict[str, Any]:
    """The pilot (``--pilot``: merged into the protocol's JSON) or the full run of a protocol."""
    offline()
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    existing = read_json(ctx.out / result_name(config))
    if config.pilot:
        cfg = _settings(config, None)
        record = run_pilot(
            cfg,
            n_probes=min(200, cfg.n_probes),
            progress=ctx.progress,
            candidates=pilot_candidates(config.protocol, ctx.out),
        )
        return {**existing, "pilot": record, "_pilot_only": True}
    record = existing.get("pilot") if config.protocol in ("A", "B") else None
    if config.protocol in ("A", "B") and config.size != "quick" and not (record or {}).get("chosen"):
        raise UsageError(
            f"e2: protocol {config.protocol} takes η, λ and steps from its pilot; run --pilot "
            f"first (with the same --out)"
        )
    cfg = _settings(config, (record or {}).get("chosen"))
    resume = None if config.size == "quick" else state_path(cfg)
    if resume is not None and config.fresh:
        resume.unlink(missing_ok=True)
        import shutil

        shutil.rmtree(checkpoint_folder(resume), ignore_errors=True)
    if resume is not None and resume.exists():
        print(f"e2: resuming from {resume} (--fresh starts afresh)", file=sys.stderr)
    return run_protocol(cfg, progress=ctx.progress, pilot_record=record, resume=resume)


def figures(result: dict[str, Any], out: Path) -> list[Path]:
    if result.get("_pilot_only"):
        return []
    return [plot(result, out / f"{result_stem(result['protocol_name'])}.png")]


def tables(result: dict[str, Any]) -> dict[str, str]:
    if result.get("_pilot_only"):
        pilot = result["pilot"]
        lines = [
            f"lr={r['lr']} wd={r['weight_decay']} steps={r['steps']}: {health_line(r['health'])} -> "
            f"{'PASS' if r['health']['passed'] else 'fail'}"
            for r in pilot["results"]
        ]
        return {"e2 pilot": "\n".join(lines + [f"chosen: {pilot['chosen']}"])}
    lines = [f"health: {health_line(result['health'])}"]
    for name, k in result["kappas"].items():
        rg = result["regime"][name]
        lines.append(
            f"{name}: κ median {k['median']:.3f} [{k['min']:.3f}, {k['max']:.3f}]; regime check: "
            f"{rg['regime']} ({rg['reason']}), {rg['fractions']}"
        )
    lines.append(
        f"target met: {result['target']['met']}; seconds {result['seconds']}; cpu seconds {result['cpu_seconds']}"
    )
    return {f"e2 {result['protocol_name']}": e2_fits_table(result), "e2, health and regime": "\n".join(lines)}


def blocks(load: Callable[[str], dict | None]) -> dict[str, str | None]:
    return {"e2": table_e2(load)}
